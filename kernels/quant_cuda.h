// CUDA kernels of the quantization codec: the same bytes as the CPU reference (quant.h),
// on the GPU.
//
// Every function here only launches: it enqueues kernels on the caller's stream, allocates
// nothing, never synchronises, and so may be called during CUDA graph capture. Pointers
// named device_* / in the batches are device memory (or memory the device can address).
// Arguments are checked on the host before anything is launched (CodecError names what
// is wrong); a launch the runtime refuses throws CudaError with the runtime's message.
// Faults inside a kernel surface, as always with CUDA, at the caller's next synchronisation.
// A batch of more than 64 jobs takes several launches: if a later one is refused, the
// earlier ones have been enqueued (an encode's residuals may already be changing), so the
// caller must treat the whole call as failed. Jobs' output ranges must not overlap.
// Launches go to the current device; the stream must belong to it.
//
// Calls are batched: one launch encodes (decodes, measures) many slices of many layers,
// each with its own parameters, so that a bucket of a hundred layers costs one launch,
// not a hundred. A batch's jobs address the call's arrays by element and byte offsets, as
// the engine's plans do (plugin/collective/plan.h). Byte-for-byte and element-for-element
// what each job does is quant::encode / decode / decode_accumulate of quant.h on its slice.
//
// Built without CUDA (no nvcc), available() is false and every other function throws.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"
#include "kernels/slice.h"

struct CUstream_st;

namespace lgreco::quant::cuda {

// A cudaStream_t (nullptr: the legacy default stream).
using Stream = CUstream_st*;

// A CUDA runtime call failed; the message names the call, the kernel and the runtime's
// error string.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True when this build carries the kernels (nvcc was found at build time).
bool available();

// One slice of one layer: elements [first_element, first_element + count) of the layer,
// which sit at element_offset in the batch's element arrays (input, residual, output)
// and whose payload (quant::encoded_bytes(params, count) bytes) sits at byte_offset in
// the batch's payload buffer. first_element must be a multiple of params.bucket.
struct Job {
  uint64_t element_offset = 0;
  uint64_t count = 0;
  uint64_t first_element = 0;
  uint64_t byte_offset = 0;
  // The layer's index within the batch: its noise key's layer is the batch key's layer
  // plus this, and it indexes skip_residual (encode) and the statistics' rows.
  uint32_t layer = 0;
  QuantParams params;
};

// Each array of a batch may start anywhere in the jobs' element space: *_first is the
// element index that array[0] holds (element e of a job is input[e - input_first], and so
// on; every job's elements must lie at or after it). Zero: the arrays start at element 0.
struct EncodeBatch {
  std::span<const Job> jobs;
  const void* input = nullptr;  // float32, float16 or bfloat16 elements
  DType input_dtype = DType::kFloat32;
  uint64_t input_first = 0;
  // Error feedback when not null: float32, indexed like input; for each finite bucket it
  // becomes (input + residual) - decoded, as quant::encode does.
  float* residual = nullptr;
  uint64_t residual_first = 0;
  // Device bytes, one per layer index, or null: a layer whose byte is nonzero is encoded
  // without its residual, which stays untouched (an overflow step, see docs/ENGINE.md).
  const uint8_t* skip_residual = nullptr;
  uint8_t* payload = nullptr;
  // Rounding noise: job j uses {seed, rank, step, layer + jobs[j].layer}.
  NoiseKey noise;
  // Device counter or null: increased by the number of non-finite buckets (those holding a
  // NaN or an infinity after the residual is added, or whose range overflows).
  unsigned long long* nonfinite_buckets = nullptr;
};
void encode(const EncodeBatch& batch, Stream stream);

struct DecodeBatch {
  std::span<const Job> jobs;
  const uint8_t* payload = nullptr;
  // decode: output_dtype elements (float32, or float16/bfloat16 rounded to nearest even);
  // decode_accumulate: float32 accumulators, output_dtype must be float32.
  void* output = nullptr;
  DType output_dtype = DType::kFloat32;
  uint64_t output_first = 0;
};
void decode(const DecodeBatch& batch, Stream stream);
// output[i] += decoded value i in float32; a non-finite bucket sets its elements to NaN.
void decode_accumulate(const DecodeBatch& batch, Stream stream);

// Error statistics of up to kMaxStatsCandidates candidates (none and quant) on every job,
// in one read of the input per distinct candidate bucket size. jobs' params are ignored;
// each job's first_element must be a multiple of every candidate's bucket.
constexpr size_t kMaxStatsCandidates = 16;
struct StatsBatch {
  std::span<const Job> jobs;
  std::span<const CodecSpec> candidates;
  const void* input = nullptr;
  DType input_dtype = DType::kFloat32;
  uint64_t input_first = 0;
  const float* residual = nullptr;  // the values measured are input + residual
  uint64_t residual_first = 0;
  // Device, layers x candidates.size() (row = Job::layer): weight x the squared error of
  // candidate c on the job is ADDED to squared[layer * candidates.size() + c], as the
  // engine's Backend::measure does. quant::squared_errors defines the value; the GPU's
  // agrees within the tolerance docs/KERNELS.md states (it multiplies by a reciprocal
  // where the CPU divides, and sums in another order), and is deterministic.
  double* squared = nullptr;
  // Where each candidate's value goes, for a caller that measures several codec families
  // into one table (the engine's CUDA backend): when `columns` is not empty, candidate c
  // is added to squared[layer * row_stride + columns[c]] instead; one distinct column per
  // candidate, each below row_stride.
  std::span<const uint32_t> columns;
  uint32_t row_stride = 0;
  // Device, one byte per layer index: set to 1 where the layer's values were not finite
  // (its squared errors are then +inf); never cleared here.
  uint8_t* nonfinite = nullptr;
  double weight = 1.0;
  // Device scratch of at least stats_scratch_bytes(jobs, candidates) bytes, for per-bucket
  // partial sums; may be reused once the launches that used it have run.
  void* scratch = nullptr;
  uint64_t scratch_bytes = 0;
};
uint64_t stats_scratch_bytes(std::span<const Job> jobs, std::span<const CodecSpec> candidates);
void squared_errors(const StatsBatch& batch, Stream stream);

// One slice, the shape of quant.h's functions (a batch of one job at offset 0).
void encode(const QuantParams& params, const NoiseKey& noise, DType dtype, const Slice& device_input,
            float* device_residual, uint8_t* device_out, uint64_t out_bytes, Stream stream,
            unsigned long long* device_nonfinite_buckets = nullptr);
void decode(const QuantParams& params, const uint8_t* device_in, uint64_t in_bytes, uint64_t count, DType out_dtype,
            void* device_out, Stream stream);
void decode_accumulate(const QuantParams& params, const uint8_t* device_in, uint64_t in_bytes, uint64_t count,
                       float* device_acc, Stream stream);

// The device's float16 conversions of kernels/dtype.h (the hardware's, with NaN made as
// the CPU's), element by element, so that tests/gpu/quant_cuda_check.cc can compare them
// with the host's over every float16 and every float32: device_out[i] =
// half_to_float(device_in[i]), resp. float_to_half_rn(device_in[i]).
void half_to_float(const uint16_t* device_in, float* device_out, uint64_t count, Stream stream);
void float_to_half_rn(const float* device_in, uint16_t* device_out, uint64_t count, Stream stream);

}  // namespace lgreco::quant::cuda
