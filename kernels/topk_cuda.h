// CUDA kernels of the TopK codec: the same bytes as the CPU reference (topk.h), on the GPU.
//
// Every function here only launches: it enqueues kernels (and zero-fills of the caller's
// scratch) on the caller's stream, allocates nothing, never synchronises, and so may be
// called during CUDA graph capture. Which values are kept is found on the device (an exact
// radix select, docs/KERNELS.md); nothing comes back to the host, and the number and shape
// of the launches depend only on the jobs' sizes, never on the data.
//
// Arguments are checked on the host before anything is launched (CodecError names the job
// and what is wrong); a launch the runtime refuses throws CudaError with the runtime's
// message. Faults inside a kernel surface, as always with CUDA, at the caller's next
// synchronisation. A batch of more than 64 jobs takes several rounds of launches: if a later
// one is refused, earlier ones have been enqueued (residuals may already be changing), so
// the caller must treat the whole call as failed. Jobs' output ranges must not overlap.
// Launches go to the current device; the stream must belong to it.
//
// Byte for byte, what each job does is topk::encode / decode / decode_accumulate of
// topk.h on its slice (docs/FORMAT.md). The one difference: the GPU cannot throw on a
// corrupt payload, so decode skips an index that is not below the count or not above the
// index before it (see DecodeBatch); the CPU throws CodecError there.
//
// Built without CUDA (no nvcc), available() is false and every kernel entry point throws
// CudaError; the scratch sizes still answer (they are host arithmetic).
#pragma once

#include <cstdint>
#include <span>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/quant_cuda.h"  // CudaError, Stream
#include "kernels/topk.h"

namespace lgreco::topk::cuda {

using quant::cuda::CudaError;
using quant::cuda::Stream;

// True when this build carries the kernels (nvcc was found at build time).
bool available();

// One slice of one layer: `count` elements at element_offset in the batch's element arrays
// (input, residual, output), whose payload (topk::encoded_bytes(params, count) = 8 k bytes:
// k u32 indices, then k f32 values) sits at byte_offset in the batch's payload buffer.
// count < 2^32 (indices are u32 within the slice); byte_offset is a multiple of 4.
struct Job {
  uint64_t element_offset = 0;
  uint64_t count = 0;
  uint64_t byte_offset = 0;
  // The layer's index within the batch: indexes skip_residual (encode) and the statistics'
  // rows and nonfinite flags.
  uint32_t layer = 0;
  TopkParams params;
};

// Each array may start anywhere in the jobs' element space: *_first is the element index
// that array[0] holds (element e of a job is input[e - input_first], and so on; every
// job's elements must lie at or after it).
struct EncodeBatch {
  std::span<const Job> jobs;
  const void* input = nullptr;  // float32, float16 or bfloat16 elements
  DType input_dtype = DType::kFloat32;
  uint64_t input_first = 0;
  // Error feedback when not null: float32, indexed like input. The value sent is
  // x = input + residual (float32); afterwards the residual of a finite x that was kept is
  // 0, of a finite x not kept x, and a non-finite x leaves its residual unchanged.
  float* residual = nullptr;
  uint64_t residual_first = 0;
  // Device bytes, one per layer index, or null: a layer whose byte is nonzero is encoded
  // without its residual (x = input), which stays untouched (an overflow step).
  const uint8_t* skip_residual = nullptr;
  uint8_t* payload = nullptr;  // 4-byte aligned
  // Device counter or null: increased by the number of non-finite x values (NaN or +-inf,
  // after the residual is added), as topk::encode's report counts them.
  unsigned long long* nonfinite_values = nullptr;
  // Device scratch of at least encode_scratch_bytes(jobs) bytes, 256-byte aligned (what
  // cudaMalloc returns). Its contents need not be anything on entry; it may be reused once
  // the launches of this call have run (the same stream: at once).
  void* scratch = nullptr;
  uint64_t scratch_bytes = 0;
};
void encode(const EncodeBatch& batch, Stream stream);
// Scratch an encode of these jobs needs (host arithmetic; throws CodecError on an invalid
// job, as encode would). See docs/KERNELS.md for the formula; about count / 4 bytes per
// job (its candidate list) plus a few bytes per 4096 elements and 25 KiB per job.
uint64_t encode_scratch_bytes(std::span<const Job> jobs);

struct DecodeBatch {
  std::span<const Job> jobs;
  const uint8_t* payload = nullptr;  // 4-byte aligned
  // decode: output_dtype elements (float32, or float16/bfloat16 rounded to nearest even),
  // zero where nothing was kept; decode_accumulate: float32 accumulators, output_dtype
  // must be float32, acc[index] = acc[index] + value (a NaN sum written as 0x7FFFFFFF).
  // A corrupt payload cannot be reported from the GPU: an entry whose index is >= count,
  // or not above the previous entry's index, is skipped (nothing is written out of the
  // job's range; what the job's output holds is then unspecified).
  void* output = nullptr;
  DType output_dtype = DType::kFloat32;
  uint64_t output_first = 0;
};
void decode(const DecodeBatch& batch, Stream stream);
void decode_accumulate(const DecodeBatch& batch, Stream stream);

// The squared error ||x - C(x)||^2 of TopK candidates on every job: the sum, in double, of
// x^2 over the values a candidate would NOT keep (x = input + residual). Candidate c's
// value for a job is ADDED, times weight, to squared[layer * row_stride + columns[c]], so
// that the caller can measure several codec families into one table of rows. A job with a
// non-finite x sets nonfinite[layer] = 1 (never cleared here) and adds weight x +inf.
// topk::squared_errors defines the value; the GPU's sums the same terms in another order
// (agreement to ~1e-12 relative, docs/KERNELS.md) and is deterministic: no floating-point
// atomics, jobs sharing a layer are added in job order. The jobs' params are ignored.
constexpr size_t kMaxStatsCandidates = 16;
struct StatsBatch {
  std::span<const Job> jobs;
  std::span<const TopkParams> candidates;  // at most kMaxStatsCandidates
  std::span<const uint32_t> columns;       // one per candidate, each < row_stride
  uint32_t row_stride = 0;                 // columns in an output row
  const void* input = nullptr;
  DType input_dtype = DType::kFloat32;
  uint64_t input_first = 0;
  const float* residual = nullptr;  // the values measured are input + residual
  uint64_t residual_first = 0;
  double* squared = nullptr;   // device, (max layer + 1) x row_stride
  uint8_t* nonfinite = nullptr;  // device, one byte per layer index
  double weight = 1.0;
  // Device scratch of at least stats_scratch_bytes(jobs, candidates) bytes, 256-byte
  // aligned; reusable as encode's.
  void* scratch = nullptr;
  uint64_t scratch_bytes = 0;
};
uint64_t stats_scratch_bytes(std::span<const Job> jobs, std::span<const TopkParams> candidates);
void squared_errors(const StatsBatch& batch, Stream stream);

}  // namespace lgreco::topk::cuda
