// PowerSGD on the GPU: the operations of the engine's low-rank exchange
// (collective::Backend's lowrank_* and measure_lowrank, plugin/collective/backend.h) on
// device memory, batched over the layers of a bucket. The arithmetic is kernels/lowrank.h's
// (docs/FORMAT.md, "Payload of `powersgd`"); docs/KERNELS.md ("PowerSGD on the GPU") says
// which results are bit for bit the CPU reference's and the tolerance of the others.
//
// Every function only enqueues work on the caller's stream: nothing is allocated, nothing
// synchronises the host, so a call may be captured into a CUDA graph. The two large
// products, P = M Q and Q = M^T P, are cuBLAS SGEMMs (float32 inputs, float32 accumulation,
// no TF32: the Handle's math mode is CUBLAS_DEFAULT_MATH); everything else is lgreco's own
// kernels. cuBLAS is loaded at run time (dlopen of libcublas.so.<major>, which finds the
// copy a framework such as torch already loaded) by Handle::create, so liblgreco.so does
// not depend on it: without cuBLAS only these functions are unavailable.
//
// Arguments are checked on the host before anything is enqueued (CodecError names the
// layer and what is wrong); a launch or a cuBLAS call that fails throws CudaError. Faults
// inside a kernel surface, as always with CUDA, at the caller's next synchronisation.
// Launches go to the current device; the stream and the Handle must belong to it.
//
// M of a layer is the rows x cols row-major matrix of its `rows x cols` call elements
// starting at `offset`: M[i][j] = input[offset + i cols + j] (+ residual, float32). Where
// M is not simply the float32 input (a float16/bfloat16 input, or a residual to add), a
// staging kernel writes it into the caller's scratch first, one layer at a time (so the
// scratch holds the largest layer, not the bucket); a float32 input with no residual goes
// to cuBLAS directly.
//
// Built without CUDA (no nvcc), available() is false and every entry point checks its
// arguments, then throws CudaError; the scratch sizes still answer (host arithmetic).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/quant_cuda.h"  // CudaError, Stream

namespace lgreco::lowrank::cuda {

using quant::cuda::CudaError;
using quant::cuda::Stream;

// True when this build carries the kernels (nvcc was found at build time). cuBLAS itself
// is only looked for by Handle::create.
bool available();
// "" when cuBLAS can be loaded (the first call tries, once per process), else why not: the
// dlopen error, or a missing symbol. Lets a caller refuse PowerSGD up front rather than
// fail at Handle::create.
std::string cublas_problem();

// One low-rank layer, as collective::Backend::LowRankLayer (kernels/ does not depend on
// plugin/): rows, cols and rank >= 1, rank <= 256, rows and cols below 2^31 (cuBLAS takes
// 32-bit dimensions), rows x cols <= 2^34.
struct Layer {
  uint32_t layer = 0;      // index in the bucket: flags, the statistics' rows
  uint64_t offset = 0;     // first element of M, within the call
  uint64_t rows = 0, cols = 0;
  uint32_t rank = 0;
  uint64_t p_offset = 0;   // floats, into P (rows x rank, row-major)
  uint64_t q_offset = 0;   // floats, into Q, Q', Q0 (cols x rank, row-major)
};

// Where M comes from. Element e of the call is input[e - input_first] and
// residual[e - residual_first]; every layer must lie at or after both.
struct Source {
  const void* input = nullptr;  // device: float32, float16 or bfloat16, aligned to its size
  DType input_dtype = DType::kFloat32;
  uint64_t input_first = 0;
  // Device float32 or null. project and squared_errors read it (M = input + residual, one
  // float32 addition); back_project also updates it (residual = M - P Q'^T).
  float* residual = nullptr;
  uint64_t residual_first = 0;
  // Device bytes, one per layer index, or null: a layer whose byte is nonzero is taken
  // without its residual (M = input), which back_project leaves untouched (an overflow
  // step, docs/ENGINE.md). squared_errors takes no flags (the CPU backend's statistics
  // always include the residual).
  const uint8_t* flags = nullptr;
};

// Where reconstruct writes: element e of the call at data[e - first], rounded to dtype.
struct Output {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  uint64_t first = 0;
};

// Device memory of the caller's, at least scratch_bytes(...) / measure_scratch_bytes(...)
// bytes, 256-byte aligned (what cudaMalloc returns). Its contents need not be anything on
// entry, and it may be reused by the next call on the same stream at once (not by a call
// on another stream until this one's work has run).
struct Scratch {
  void* data = nullptr;
  uint64_t bytes = 0;
};

// The cuBLAS workspace a Handle should be given: cuBLAS's own default on Hopper (32 MiB;
// 4 MiB is its default before it). With a workspace of the caller's, cuBLAS allocates
// nothing per stream and its results are reproducible run to run.
constexpr uint64_t kWorkspaceBytes = uint64_t{32} << 20;

// A cuBLAS context on the current device, with the caller's workspace (device memory,
// non-null, 256-byte aligned, kept alive by the caller for the Handle's life). Math mode CUBLAS_DEFAULT_MATH (float32 products and
// sums: no TF32, no BF16x9 emulation), host pointer mode. Each operation binds the
// handle to its stream and re-binds the workspace (cublasSetStream resets it), host calls
// only. Not thread-safe: one thread at a time per Handle. Move-only; the destructor
// destroys the context (cublasDestroy, which synchronises the device: do it at teardown).
class Handle {
 public:
  Handle() = default;  // empty: the operations refuse it
  // Throws CodecError for a null, empty or misaligned workspace, CudaError when cuBLAS
  // cannot be loaded (dlopen) or cublasCreate fails (no device, out of memory).
  static Handle create(void* workspace, uint64_t workspace_bytes);
  ~Handle() { reset(); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& other) noexcept { swap(other); }
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      swap(other);
    }
    return *this;
  }
  void reset();  // destroys the context (if any); the Handle is empty afterwards
  bool valid() const { return cublas_ != nullptr; }
  void* cublas() const { return cublas_; }  // the cublasHandle_t
  void* workspace() const { return workspace_; }
  uint64_t workspace_bytes() const { return workspace_bytes_; }
  int cublas_version() const { return version_; }  // e.g. 130100 for 13.1.0; 0 when empty

 private:
  void swap(Handle& o) noexcept {
    void* c = cublas_;
    cublas_ = o.cublas_;
    o.cublas_ = c;
    void* w = workspace_;
    workspace_ = o.workspace_;
    o.workspace_ = w;
    const uint64_t b = workspace_bytes_;
    workspace_bytes_ = o.workspace_bytes_;
    o.workspace_bytes_ = b;
    const int v = version_;
    version_ = o.version_;
    o.version_ = v;
  }
  void* cublas_ = nullptr;
  void* workspace_ = nullptr;
  uint64_t workspace_bytes_ = 0;
  int version_ = 0;
};

// Scratch of project, orthonormalize and back_project on these layers, with an input of
// this type, with or without a residual (the same rule for all three, so one buffer serves
// a step): the larger of
//   staging:        4 x max(rows x cols) bytes, only if input_dtype is not float32 or a
//                   residual is given (else 0), and
//   Gram-Schmidt:   the sum over layers of 8 x rows x rank bytes (each rounded up to 256),
// rounded up to 256 bytes. orthonormalize alone needs only the second
// (scratch_bytes(layers, DType::kFloat32, false)). Throws CodecError for invalid layers.
uint64_t scratch_bytes(std::span<const Layer> layers, DType input_dtype, bool residual);

// P = M Q for each layer: p[p_offset ...] (rows x rank) from q[q_offset ...] (cols x rank).
// cuBLAS: M row-major is the column-major cols x rows matrix M^T, so P^T (rank x rows,
// column-major = P row-major) = Q^T M^T, an NN SGEMM with m = rank, n = rows, k = cols.
void project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* q, float* p,
             const Scratch& scratch, Stream stream);

// Modified Gram-Schmidt on each layer's rank columns of P, in float64, with the CPU's rule
// (lowrank::orthonormalize: a column whose remaining squared norm is at most 1e-10 of its
// original one, or zero, becomes zero), rounded to float32. One thread block per layer
// (up to 64 per launch), its columns in float64 in the scratch; the sums are in a fixed
// order, so the result is deterministic.
void orthonormalize(std::span<const Layer> layers, float* p, const Scratch& scratch, Stream stream);

// Q' = M^T P for each layer (q[q_offset ...], cols x rank): Q'^T (rank x cols) = P^T M,
// an NT SGEMM with m = rank, n = cols, k = rows. With a residual, for each layer not
// flagged, residual = M - P Q'^T (this rank's own Q', before any sum), the products in
// float64 in the CPU's order: bit for bit lowrank's reconstruct and float32 subtraction.
void back_project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* p, float* q,
                  const Scratch& scratch, Stream stream);

// out = scale x P Q^T for each layer, narrowed to out's type (round to nearest even), a
// NaN written as 0x7FFFFFFF (float32) or 0x7FFF: bit for bit the CPU backend's.
void reconstruct(std::span<const Layer> layers, const float* p, const float* q, float scale, const Output& out,
                 Stream stream);

// For each column c of each layer: q's column = q0's if q_new's column is all zeros or
// holds a NaN or an infinity, else q_new's (Backend::lowrank_keep). All three arrays are
// indexed by q_offset; q must not overlap the others.
void keep(std::span<const Layer> layers, const float* q_new, const float* q0, float* q, Stream stream);

// Q0 of each layer into q0[q_offset ...] (cols x rank): lowrank::initial_q with the key
// {seed, 0, step, layer_base + layer}, the same floats (docs/FORMAT.md, Philox).
void initial_q(std::span<const Layer> layers, uint64_t seed, uint64_t step, uint32_t layer_base, float* q0,
               Stream stream);

// The statistics of low-rank candidates (Backend::measure_lowrank): for each layer, with
// R the largest rank in `ranks`, the basis Q0 of rank R of {seed, 0, step, layer_base +
// layer} (generated on the device), P the orthonormalized M Q0 and B = M^T P, rank r's
// squared error is max(0, ||M||^2 - sum over c < r of ||B[:, c]||^2), in float64.
// weight x that is ADDED to squared[layer x row_stride + columns[k]] for ranks[k]; a
// layer whose M holds a NaN or an infinity gets +inf (x weight) there and nonfinite[layer]
// = 1 (never cleared). The layers' rank and offsets p_offset / q_offset are not used.
constexpr size_t kMaxMeasureRanks = 32;
struct Measure {
  std::span<const uint32_t> ranks;    // 1..kMaxMeasureRanks entries, each 1..256
  std::span<const uint32_t> columns;  // as many: the output column of each rank
  uint32_t row_stride = 0;            // doubles in an output row; every column below it
  // Host, per layer index: 1 = measured. Empty: every layer given.
  std::span<const uint8_t> measured;
  double* squared = nullptr;   // device, row = Layer::layer
  uint8_t* nonfinite = nullptr;  // device, one byte per layer index
  double weight = 1.0;
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t layer_base = 0;
};

// Scratch of squared_errors: the largest over the layers of (each piece rounded up to 256)
//   4 rows cols (staging, as scratch_bytes) + 4 cols R (basis) + 4 rows R (P)
//   + 4 cols R (B) + 8 rows R (Gram-Schmidt) + 12 x 1024 (the norm's partial sums),
// with R = max_rank. Throws CodecError for invalid layers or a max_rank outside 1..256.
uint64_t measure_scratch_bytes(std::span<const Layer> layers, uint32_t max_rank, DType input_dtype, bool residual);

// One layer at a time (staging, Q0, two SGEMMs, Gram-Schmidt, the norms): about seven
// launches per measured layer, on measurement steps only.
void squared_errors(Handle& handle, std::span<const Layer> layers, const Source& source, const Measure& m,
                    const Scratch& scratch, Stream stream);

}  // namespace lgreco::lowrank::cuda
