// The quantization codec's host side on CUDA: checks the batches, builds the job tables
// and launches the kernels for the element type on the caller's stream. The kernels are
// in quant_cuda_kernels.cuh, compiled by quant_cuda_encode.cu and
// quant_cuda_stats_*.cu (quant_cuda_launch.h says why); the statistics' reduction, a
// small kernel of its own, is here.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda_launch.h"
#include "kernels/quant.h"
#include "kernels/quant_batch.h"
#include "kernels/quant_cuda.h"
#include "kernels/quant_cuda_launch.h"
#include "kernels/quant_warp.h"

namespace lgreco::quant::cuda {
namespace {

using detail::launch_decode;
using detail::launch_encode;
using detail::launch_stats;
using warp::JobTable;
using warp::KernelJob;

constexpr uint32_t kReduceThreads = 256;

struct ReduceArgs {
  const double* partial;  // work items x candidate_count
  uint32_t candidate_count;
  uint32_t columns[warp::kMaxCandidates];
  uint32_t row_stride;    // candidates in an output row
  double* squared;
  double weight;
};

// Block c adds candidate c's per-bucket errors of each job, in double, into the
// job's output row: a fixed summation order (deterministic results), and one writer per
// output element even when several jobs share a layer (they are summed in job order).
__global__ void __launch_bounds__(kReduceThreads) stats_reduce_kernel(const __grid_constant__ JobTable table,
                                                                      const __grid_constant__ ReduceArgs args) {
  __shared__ double sums[kReduceThreads];
  const uint32_t c = blockIdx.x;
  for (uint32_t j = 0; j < table.count; ++j) {
    const KernelJob& job = table.jobs[j];
    const uint32_t buckets = static_cast<uint32_t>(warp::bucket_count_of(job));
    double local = 0.0;
    for (uint32_t i = threadIdx.x; i < buckets; i += kReduceThreads)
      local += args.partial[static_cast<uint64_t>(job.work_begin + i) * args.candidate_count + c];
    sums[threadIdx.x] = local;
    __syncthreads();
    for (uint32_t half = kReduceThreads / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0)
      args.squared[static_cast<uint64_t>(job.layer) * args.row_stride + args.columns[c]] += args.weight * sums[0];
    __syncthreads();
  }
}

void require(bool ok, const char* what, const char* message) {
  if (!ok) throw CodecError(std::string(what) + ": " + message);
}

// A misaligned element array would fault on the device (a sticky error that ends the
// context); say so on the host instead.
bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

void run_decode(const DecodeBatch& batch, bool accumulate, cudaStream_t stream) {
  const char* what = accumulate ? "quant cuda decode_accumulate" : "quant cuda decode";
  const std::vector<JobTable> tables = codec_tables(batch.jobs, what);
  if (tables.empty()) return;
  require(batch.payload && batch.output, what, "payload and output must not be null");
  require(aligned(batch.payload, 4), what, "the payload must be 4-byte aligned");
  require(is_valid_dtype(static_cast<uint32_t>(batch.output_dtype)), what, "invalid output element type");
  require(!accumulate || batch.output_dtype == DType::kFloat32, what, "accumulators must be float32");
  require(aligned(batch.output, dtype_size(batch.output_dtype)), what, "the output is not aligned to its element size");
  const warp::DecodeArgs args = decode_args(batch, what);
  for (const JobTable& t : tables) {
    switch (batch.output_dtype) {
      case DType::kFloat32: launch_decode<DType::kFloat32>(t, args, accumulate, stream); break;
      case DType::kFloat16: launch_decode<DType::kFloat16>(t, args, accumulate, stream); break;
      case DType::kBFloat16: launch_decode<DType::kBFloat16>(t, args, accumulate, stream); break;
    }
  }
}

Job single_job(const QuantParams& p, uint64_t count, uint64_t first_element) {
  Job job;
  job.count = count;
  job.first_element = first_element;
  job.params = p;
  return job;
}

__global__ void half_to_float_kernel(const uint16_t* in, float* out, uint64_t count) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x)
    out[i] = lgreco::half_to_float(in[i]);
}
__global__ void float_to_half_kernel(const float* in, uint16_t* out, uint64_t count) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x)
    out[i] = lgreco::float_to_half_rn(in[i]);
}

dim3 conversion_grid(uint64_t count) {
  return dim3(static_cast<uint32_t>(std::min<uint64_t>((count + 255) / 256, 65535)));
}

}  // namespace

bool available() { return true; }

void half_to_float(const uint16_t* device_in, float* device_out, uint64_t count, Stream stream) {
  if (count == 0) return;
  require(device_in && device_out, "quant cuda half_to_float", "input and output must not be null");
  launch_kernel(half_to_float_kernel, conversion_grid(count), 256, stream, "the float16 conversion kernel", device_in,
                device_out, count);
}

void float_to_half_rn(const float* device_in, uint16_t* device_out, uint64_t count, Stream stream) {
  if (count == 0) return;
  require(device_in && device_out, "quant cuda float_to_half_rn", "input and output must not be null");
  launch_kernel(float_to_half_kernel, conversion_grid(count), 256, stream, "the float16 conversion kernel", device_in,
                device_out, count);
}

void encode(const EncodeBatch& batch, Stream stream) {
  const char* what = "quant cuda encode";
  const std::vector<JobTable> tables = codec_tables(batch.jobs, what);
  if (tables.empty()) return;
  require(batch.input && batch.payload, what, "input and payload must not be null");
  require(aligned(batch.payload, 4), what, "the payload must be 4-byte aligned");
  require(is_valid_dtype(static_cast<uint32_t>(batch.input_dtype)), what, "invalid input element type");
  require(aligned(batch.input, dtype_size(batch.input_dtype)), what, "the input is not aligned to its element size");
  require(aligned(batch.residual, 4), what, "the residual is not 4-byte aligned");
  require(aligned(batch.nonfinite_buckets, 8), what, "the non-finite counter is not 8-byte aligned");
  const warp::EncodeArgs args = encode_args(batch, what);
  const bool residual = batch.residual != nullptr;
  for (const JobTable& t : tables) {
    switch (batch.input_dtype) {
      case DType::kFloat32: launch_encode<DType::kFloat32>(t, args, residual, stream); break;
      case DType::kFloat16: launch_encode<DType::kFloat16>(t, args, residual, stream); break;
      case DType::kBFloat16: launch_encode<DType::kBFloat16>(t, args, residual, stream); break;
    }
  }
}

void decode(const DecodeBatch& batch, Stream stream) { run_decode(batch, false, stream); }
void decode_accumulate(const DecodeBatch& batch, Stream stream) { run_decode(batch, true, stream); }

uint64_t stats_scratch_bytes(std::span<const Job> jobs, std::span<const CodecSpec> candidates) {
  return stats_scratch_bytes(stats_launches(jobs, candidates, "quant cuda stats_scratch_bytes"));
}

void squared_errors(const StatsBatch& batch, Stream stream) {
  const char* what = "quant cuda squared_errors";
  const std::vector<StatsLaunch> launches = stats_launches(batch.jobs, batch.candidates, what);
  if (launches.empty() || launches.front().tables.empty()) return;  // no candidates, or no elements
  require(batch.input && batch.squared && batch.nonfinite, what, "input, squared and nonfinite must not be null");
  require(is_valid_dtype(static_cast<uint32_t>(batch.input_dtype)), what, "invalid input element type");
  require(aligned(batch.input, dtype_size(batch.input_dtype)), what, "the input is not aligned to its element size");
  require(aligned(batch.residual, 4), what, "the residual is not 4-byte aligned");
  require(aligned(batch.squared, 8), what, "squared is not 8-byte aligned");
  require(aligned(batch.scratch, 8), what, "the scratch is not 8-byte aligned");
  const uint64_t need = stats_scratch_bytes(launches);
  if (batch.scratch == nullptr || batch.scratch_bytes < need)
    throw CodecError(std::string(what) + ": scratch of " + std::to_string(batch.scratch_bytes) +
                     " bytes is too small (needs " + std::to_string(need) + ", see stats_scratch_bytes)");
  for (const StatsLaunch& launch : launches) {
    const warp::StatsArgs args = stats_args(batch, launch, static_cast<double*>(batch.scratch), what);
    ReduceArgs reduce{};
    reduce.partial = args.partial;
    reduce.candidate_count = args.candidate_count;
    const StatsOutput output = stats_output(batch, launch, what);
    reduce.row_stride = output.row_stride;
    reduce.squared = batch.squared;
    reduce.weight = batch.weight;
    for (size_t c = 0; c < launch.candidates.size(); ++c) reduce.columns[c] = output.columns[c];
    for (const JobTable& t : launch.tables) {
      switch (batch.input_dtype) {
        case DType::kFloat32: launch_stats<DType::kFloat32>(t, args, stream); break;
        case DType::kFloat16: launch_stats<DType::kFloat16>(t, args, stream); break;
        case DType::kBFloat16: launch_stats<DType::kBFloat16>(t, args, stream); break;
      }
      launch_kernel(stats_reduce_kernel, dim3(args.candidate_count), kReduceThreads, stream,
             "the quant statistics reduction kernel", t, reduce);
    }
  }
}

void encode(const QuantParams& params, const NoiseKey& noise, DType dtype, const Slice& device_input,
            float* device_residual, uint8_t* device_out, uint64_t out_bytes, Stream stream,
            unsigned long long* device_nonfinite_buckets) {
  check_payload(params, out_bytes, device_input.count, "quant cuda encode");
  const Job job = single_job(params, device_input.count, device_input.first_element);
  EncodeBatch batch;
  batch.jobs = std::span<const Job>(&job, 1);
  batch.input = device_input.data;
  batch.input_dtype = dtype;
  batch.residual = device_residual;
  batch.payload = device_out;
  batch.noise = noise;
  batch.nonfinite_buckets = device_nonfinite_buckets;
  encode(batch, stream);
}

void decode(const QuantParams& params, const uint8_t* device_in, uint64_t in_bytes, uint64_t count, DType out_dtype,
            void* device_out, Stream stream) {
  check_payload(params, in_bytes, count, "quant cuda decode");
  const Job job = single_job(params, count, 0);
  decode(DecodeBatch{std::span<const Job>(&job, 1), device_in, device_out, out_dtype}, stream);
}

void decode_accumulate(const QuantParams& params, const uint8_t* device_in, uint64_t in_bytes, uint64_t count,
                       float* device_acc, Stream stream) {
  check_payload(params, in_bytes, count, "quant cuda decode_accumulate");
  const Job job = single_job(params, count, 0);
  decode_accumulate(DecodeBatch{std::span<const Job>(&job, 1), device_in, device_acc, DType::kFloat32}, stream);
}

}  // namespace lgreco::quant::cuda
