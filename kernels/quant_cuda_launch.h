// The quantization kernels' launchers, declared for kernels/quant_cuda.cu (the host side:
// checks, job tables, the dispatch on element type) and defined, one explicit instance
// per element type, in the files that compile the kernels: quant_cuda_encode.cu (encode
// and decode) and quant_cuda_stats_{f32,f16,bf16}.cu (the statistics). Split so that
// nvcc builds them side by side: as one file the kernels took 2 minutes of cicc and
// ptxas for the two architectures, the longest step of a build (docs/PERF.md, "Build
// time"). CUDA only: include from .cu files.
#pragma once

#include <cuda_runtime.h>

#include "kernels/dtype.h"
#include "kernels/quant_warp.h"

namespace lgreco::quant::cuda::detail {

constexpr uint32_t kWarpsPerBlock = 8;
constexpr uint32_t kBlockThreads = kWarpsPerBlock * warp::kLanes;

// One warp per work item (bucket), kWarpsPerBlock to a block.
inline dim3 grid_for(const warp::JobTable& t) { return dim3((t.total_work + kWarpsPerBlock - 1) / kWarpsPerBlock); }

template <DType T>
void launch_encode(const warp::JobTable& t, const warp::EncodeArgs& a, bool residual, cudaStream_t s);
template <DType T>
void launch_decode(const warp::JobTable& t, const warp::DecodeArgs& a, bool accumulate, cudaStream_t s);
template <DType T>
void launch_stats(const warp::JobTable& t, const warp::StatsArgs& a, cudaStream_t s);

}  // namespace lgreco::quant::cuda::detail
