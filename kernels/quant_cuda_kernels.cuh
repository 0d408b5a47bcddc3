// The quantization codec's kernels and their launchers' definitions: one warp per bucket,
// a block of kWarpsPerBlock warps taking kWarpsPerBlock consecutive work items (buckets)
// of the launch's job table; the per-bucket programs are quant_warp.h's (shared with the
// CPU-side emulation tests). Included only by the files that instantiate the launchers
// (quant_cuda_launch.h says which and why). Built with --fmad=false (Makefile), and
// quant_math.h spells out the rounding with __f*_rn, so no operation is contracted into
// an FMA that the CPU reference does not have.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda_launch.h"
#include "kernels/quant_cuda_launch.h"
#include "kernels/quant_warp.h"

namespace lgreco::quant::cuda::detail {

using warp::JobTable;
using warp::KernelJob;

// The hardware warp, for the programs of quant_warp.h. Every lane of the warp takes part
// in every collective (the programs keep their branches around them warp-uniform).
struct DeviceWarp {
  __device__ __forceinline__ uint32_t lane() const { return threadIdx.x % warp::kLanes; }
  __device__ __forceinline__ uint32_t ballot(bool p) const { return __ballot_sync(0xffffffffu, p); }
  __device__ __forceinline__ float shfl_xor(float v, int m) const { return __shfl_xor_sync(0xffffffffu, v, m); }
  __device__ __forceinline__ uint32_t shfl_xor(uint32_t v, int m) const { return __shfl_xor_sync(0xffffffffu, v, m); }
};

// The work item of this warp, or false when the warp has none (the grid is rounded up to
// whole blocks). Uniform across the warp.
__device__ __forceinline__ bool my_work(const JobTable& table, uint32_t& work) {
  work = blockIdx.x * kWarpsPerBlock + threadIdx.x / warp::kLanes;
  return work < table.total_work;
}

// Two blocks of 8 warps per multiprocessor at least: caps registers at 128, which the
// encoder fits without spilling (ptxas -v), and keeps 16 warps' loads in flight.
template <DType T, bool kResidual>
__global__ void __launch_bounds__(kBlockThreads, 2)
    encode_kernel(const __grid_constant__ JobTable table, const __grid_constant__ warp::EncodeArgs args) {
  uint32_t work;
  if (!my_work(table, work)) return;
  const KernelJob& job = table.jobs[warp::find_job(table, work)];
  warp::encode_bucket<T, kResidual>(DeviceWarp{}, args, job, work - job.work_begin);
}

template <DType T, bool kAccumulate>
__global__ void __launch_bounds__(kBlockThreads)
    decode_kernel(const __grid_constant__ JobTable table, const __grid_constant__ warp::DecodeArgs args) {
  uint32_t work;
  if (!my_work(table, work)) return;
  const KernelJob& job = table.jobs[warp::find_job(table, work)];
  warp::decode_bucket<T, kAccumulate>(DeviceWarp{}, args, job, work - job.work_begin);
}

template <DType T, bool kResidual, uint32_t kCapacity>
__global__ void __launch_bounds__(kBlockThreads, 2)
    stats_kernel(const __grid_constant__ JobTable table, const __grid_constant__ warp::StatsArgs args) {
  uint32_t work;
  if (!my_work(table, work)) return;
  const KernelJob& job = table.jobs[warp::find_job(table, work)];
  warp::stats_bucket<T, kResidual, kCapacity>(DeviceWarp{}, args, job, work - job.work_begin, work);
}

template <DType T>
void launch_encode(const JobTable& t, const warp::EncodeArgs& a, bool residual, cudaStream_t s) {
  launch_kernel(residual ? encode_kernel<T, true> : encode_kernel<T, false>, grid_for(t), kBlockThreads, s,
                "the quant encode kernel", t, a);
}

template <DType T>
void launch_decode(const JobTable& t, const warp::DecodeArgs& a, bool accumulate, cudaStream_t s) {
  if (accumulate)
    launch_kernel(decode_kernel<DType::kFloat32, true>, grid_for(t), kBlockThreads, s,
                  "the quant decode-accumulate kernel", t, a);
  else
    launch_kernel(decode_kernel<T, false>, grid_for(t), kBlockThreads, s, "the quant decode kernel", t, a);
}

// Up to 8 candidates (the usual: bits 2..8 and none) in a smaller register footprint.
template <DType T, uint32_t kCapacity>
void launch_stats_sized(const JobTable& t, const warp::StatsArgs& a, cudaStream_t s) {
  launch_kernel(a.residual ? stats_kernel<T, true, kCapacity> : stats_kernel<T, false, kCapacity>, grid_for(t),
                kBlockThreads, s, "the quant statistics kernel", t, a);
}

template <DType T>
void launch_stats(const JobTable& t, const warp::StatsArgs& a, cudaStream_t s) {
  if (a.candidate_count <= 8)
    launch_stats_sized<T, 8>(t, a, s);
  else
    launch_stats_sized<T, warp::kMaxCandidates>(t, a, s);
}

}  // namespace lgreco::quant::cuda::detail
