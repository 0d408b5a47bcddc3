// The engine's CUDA backend (cuda_backend.h): quant segments go to the batched kernels of
// kernels/quant_cuda.h, TopK segments to kernels/topk_cuda.h, PowerSGD layers (the
// lowrank_* operations) to kernels/lowrank_cuda.h (cuBLAS); `none` segments, the NaN
// scan, the owner's exact sum, the division and the narrowing are the small element-wise
// kernels below. Everything is
// enqueued on the current stream; nothing waits for the device except Event::wait,
// wait_mark, pinned host memory's cudaFreeHost and, on a device without memory pools,
// cudaMalloc/cudaFree (cuda_backend.h says how streams are ordered and memory freed).
//
// Bytes: every kernel here reproduces plugin/collective/cpu_backend.cc (and NoneCodec in
// kernels/codec.cc) bit for bit. Built with --fmad=false and every float32 operation
// spelled out (quant_math.h's f32_add / f32_sub / f32_div), so nothing is contracted.
// Conversions are dtype.h's own helpers, compiled for the device. One more rule: where
// the CPU reference adds or divides float32 values that may be NaN (a `none` layer's
// residual, the owner's sums, decode-accumulate of `none`, the division), both sides
// store a NaN result as quant::kDecodedNaNBits (quant::canonical_nan), since x86 would
// pass an operand's NaN bits through and a GPU writes its own canonical NaN
// (docs/FORMAT.md; docs/KERNELS.md, "The engine's CUDA backend"). The TopK kernels are
// byte-identical to the CPU too; PowerSGD's cuBLAS products agree within the tolerance
// of docs/KERNELS.md ("PowerSGD on the GPU").
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "config/log.h"
#include "kernels/codec_spec.h"
#include "kernels/cuda_launch.h"
#include "kernels/dtype.h"
#include "kernels/lowrank_cuda.h"
#include "kernels/quant_batch.h"
#include "kernels/quant_math.h"
#include "kernels/sketch.h"
#include "kernels/topk_cuda.h"
#include "kernels/topk_cuda_plan.h"
#include "plugin/shim/cuda_backend.h"

namespace lgreco::shim {

using collective::ElementSpan;
using collective::Event;
using collective::NoiseBase;
using collective::Plan;
using collective::Segment;
namespace qc = quant::cuda;
namespace tk = topk::cuda;
namespace lc = lowrank::cuda;

namespace {

[[noreturn]] void cuda_failed(cudaError_t e, const std::string& call) {
  throw qc::CudaError("lgreco: " + call + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) cuda_failed(e, call);
}

// Whether a CUDA context is current on this thread: cuCtxGetCurrent, reached through the
// runtime's driver entry point so that nothing links libcuda. A thread with none (one that
// never used CUDA) reads device 0 from cudaGetDevice, and setting that device back would
// create a stray primary context on GPU 0 of a multi-GPU node. Unknown counts as current
// (the device is then restored, as before this check).
bool context_is_current() {
  using GetCurrent = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*)
  static const GetCurrent get = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not the framework's error
      fn = nullptr;
    }
    return reinterpret_cast<GetCurrent>(fn);
  }();
  if (!get) return true;
  void* context = nullptr;
  return get(&context) != 0 || context != nullptr;
}

// Makes `device` current for the guard's life and then restores the caller's device:
// the framework's thread may have another device current than the communicator's.
// kQuiet is for destructors: a failure there is not thrown (it has been or will be
// reported by the operation that met it), the device just stays as it is.
class DeviceGuard {
 public:
  enum OnError { kThrow, kQuiet };
  explicit DeviceGuard(int device, OnError on_error = kThrow) {
    const cudaError_t got = cudaGetDevice(&previous_);
    if (got != cudaSuccess) {
      if (on_error == kThrow) cuda_failed(got, "cudaGetDevice");
      return;
    }
    if (previous_ == device) return;
    // Asked only when switching: most guards find the device already current.
    const bool had_context = context_is_current();
    const cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
      restore_ = had_context;  // none before: leave `device`, make none on GPU 0
    else if (on_error == kThrow) cuda_failed(e, "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Memory shared by the backend and its buffers (which may outlive it)

struct CudaBackend::Shared {
  explicit Shared(int d) : device(d) {}
  ~Shared() {
    DeviceGuard guard(device, DeviceGuard::kQuiet);
    // Pending frees on free_stream still complete after it is destroyed.
    if (free_stream) cudaStreamDestroy(free_stream);
    if (last_work) cudaEventDestroy(last_work);
    // Returns at once; the pool goes when its last allocation is freed.
    if (pool) cudaMemPoolDestroy(pool);
  }
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;

  // Device memory back, after every operation the backend has enqueued so far (the last
  // work event), on the backend's own stream: never on the framework's current stream,
  // which may be destroyed or captured by the time a buffer goes (at ncclCommDestroy, or
  // between calls). Never waits for the device where memory pools exist.
  void free_device(void* data, uint64_t bytes) noexcept {
    DeviceGuard guard(device, DeviceGuard::kQuiet);
    cudaError_t e = cudaSuccess;
    if (pools) {
      e = cudaStreamWaitEvent(free_stream, last_work, 0);
      if (e == cudaSuccess) e = cudaFreeAsync(data, free_stream);
    }
    if (!pools || e != cudaSuccess) {
      // No pools, or the stream-ordered free refused (a faulted context): cudaFree, which
      // waits for the device (it also frees memory from a pool).
      if (e != cudaSuccess) cudaGetLastError();
      cudaFree(data);
    }
    device_bytes -= bytes;  // the cap counts what is held, so it is given back at once
  }

  int device;
  bool pools = false;                  // stream-ordered allocation from `pool`
  // lgreco's own pool rather than the device's default one: its access can be granted to
  // peer GPUs without changing the framework's memory, and NCCL reads and writes our
  // buffers directly from a peer GPU in single-process multi-GPU jobs (P2P direct).
  cudaMemPool_t pool = nullptr;
  cudaStream_t free_stream = nullptr;  // the backend's own, non-blocking
  cudaEvent_t last_work = nullptr;     // re-recorded after every enqueueing operation
  std::atomic<uint64_t> device_bytes{0};
  std::atomic<uint64_t> host_bytes{0};
};

namespace {

// ---------------------------------------------------------------------------------------
// Buffers

class DeviceBuffer final : public collective::Backend::Buffer {
 public:
  DeviceBuffer(void* data, uint64_t bytes, std::shared_ptr<CudaBackend::Shared> shared)
      : data_(data), bytes_(bytes), shared_(std::move(shared)) {}
  // Stream-ordered: freed once the work enqueued before now (every use) has run.
  ~DeviceBuffer() override { shared_->free_device(data_, bytes_); }
  void* data() override { return data_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  uint64_t bytes_;
  std::shared_ptr<CudaBackend::Shared> shared_;
};

class PinnedBuffer final : public collective::Backend::Buffer {
 public:
  PinnedBuffer(void* data, uint64_t bytes, std::shared_ptr<CudaBackend::Shared> shared)
      : data_(data), bytes_(bytes), shared_(std::move(shared)) {}
  ~PinnedBuffer() override {
    // cudaFreeHost synchronises the device (it waits for any copy into the memory): the
    // engine drops read-back targets only when replanning or at teardown, never per call.
    cudaFreeHost(data_);
    shared_->host_bytes -= bytes_;
  }
  void* data() override { return data_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  uint64_t bytes_;
  std::shared_ptr<CudaBackend::Shared> shared_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Read-back events: a pool shared with the Event objects (which may outlive the backend),
// so that a read-back creates no event once the pool has one free.

struct CudaBackend::EventPool {
  explicit EventPool(int d) : device(d) {}
  ~EventPool() {
    DeviceGuard guard(device, DeviceGuard::kQuiet);
    for (cudaEvent_t e : free) cudaEventDestroy(e);
  }
  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!free.empty()) {
        cudaEvent_t e = free.back();
        free.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags (read-back event)");
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex);
    free.push_back(e);
  }

  int device;
  std::mutex mutex;
  std::vector<cudaEvent_t> free;
};

namespace {

class ReadBackEvent final : public Event {
 public:
  ReadBackEvent(std::shared_ptr<CudaBackend::EventPool> pool, cudaEvent_t event)
      : pool_(std::move(pool)), event_(event) {}
  ~ReadBackEvent() override { pool_->give(event_); }
  // Not ready while the copy is pending; a device error (a fault of earlier work) throws
  // CudaError rather than leaving a caller that polls waiting for ever.
  bool ready() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    cuda_failed(e, "cudaEventQuery (read-back)");
  }
  void wait() override { check(cudaEventSynchronize(event_), "cudaEventSynchronize (read-back)"); }

 private:
  std::shared_ptr<CudaBackend::EventPool> pool_;
  cudaEvent_t event_;
};

// ---------------------------------------------------------------------------------------
// Kernels. Segments travel by value in the kernel's parameters (a table of up to
// kMaxSegmentsPerLaunch, __grid_constant__), as quant_warp.h's JobTable does: nothing to
// allocate or upload per call. Block row y of the grid serves segment y of the table;
// its blocks stride over the segment's elements.

constexpr uint32_t kMaxSegmentsPerLaunch = 64;
constexpr uint32_t kThreads = 256;
constexpr uint32_t kMaxBlocksPerSegment = 1024;
constexpr uint32_t kMaxBlocksFlat = 8192;

struct SegmentJob {
  uint64_t offset;       // first element, within the call
  uint64_t count;        // elements
  uint64_t byte_offset;  // of the payload, from the batch's payload pointer
  uint32_t layer;
  uint32_t pad;
};
struct SegmentTable {
  uint32_t count;
  uint32_t pad;
  SegmentJob jobs[kMaxSegmentsPerLaunch];
};
static_assert(sizeof(SegmentTable) <= 2100, "kernel parameters are limited to 4 KB with the arguments");

// Float32 arithmetic whose NaN results are stored as quant::kDecodedNaNBits, as the CPU
// reference stores them (quant::canonical_nan, docs/FORMAT.md): the bits never depend on
// which operand was a NaN or on the compiler's operand order.
__device__ __forceinline__ float add_canonical(float a, float b) { return quant::canonical_nan(quant::f32_add(a, b)); }
__device__ __forceinline__ float div_canonical(float a, float b) { return quant::canonical_nan(quant::f32_div(a, b)); }

__device__ __forceinline__ uint64_t thread_index() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t thread_stride() { return static_cast<uint64_t>(gridDim.x) * blockDim.x; }

struct ScanArgs {
  const void* input;
  uint64_t input_first;
  uint8_t* flags;
  DType input_dtype;
};

// find_nonfinite, first pass: every segment's layer flag becomes 0 (all tables' zeroing
// runs before any table's scan, as the CPU zeroes every flag before setting any).
__global__ void __launch_bounds__(kThreads) zero_flags_kernel(const __grid_constant__ SegmentTable t,
                                                              const __grid_constant__ ScanArgs a) {
  for (uint32_t i = threadIdx.x; i < t.count; i += blockDim.x) a.flags[t.jobs[i].layer] = 0;
}

// Second pass: a layer with a NaN or an infinity among its segments' values gets 1.
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(const __grid_constant__ SegmentTable t,
                                                             const __grid_constant__ ScanArgs a) {
  const SegmentJob& j = t.jobs[blockIdx.y];
  const uint64_t base = j.offset - a.input_first;
  bool bad = false;
  for (uint64_t i = thread_index(); i < j.count && !bad; i += thread_stride())
    bad = !quant::is_finite_value(load_as_float(a.input, a.input_dtype, base + i));
  if (bad) a.flags[j.layer] = 1;
}

struct NoneEncodeArgs {
  const void* input;
  uint64_t input_first;
  float* residual;  // null: no error feedback
  uint64_t residual_first;
  const uint8_t* flags;  // null, or per layer: nonzero = no residual
  uint8_t* payload;
  DType input_dtype;
  DType payload_dtype;  // the plan's
};

// NoneCodec::encode, and CpuBackend::encode's branch for a float32 sum sent in a 16-bit
// type (the same arithmetic with the input's and the payload's types apart).
__global__ void __launch_bounds__(kThreads) none_encode_kernel(const __grid_constant__ SegmentTable t,
                                                               const __grid_constant__ NoneEncodeArgs a) {
  const SegmentJob& j = t.jobs[blockIdx.y];
  float* r = (a.residual && !(a.flags && a.flags[j.layer])) ? a.residual + (j.offset - a.residual_first) : nullptr;
  const uint64_t base = j.offset - a.input_first;
  uint8_t* out = a.payload + j.byte_offset;
  for (uint64_t i = thread_index(); i < j.count; i += thread_stride()) {
    const float x = load_as_float(a.input, a.input_dtype, base + i);
    const float v = r ? add_canonical(x, r[i]) : x;
    store_from_float(out, a.payload_dtype, i, v);
    if (r) {
      // A sum that overflows the payload type is sent as an infinity and keeps its residual.
      const float sent = round_to_dtype(v, a.payload_dtype);
      if (quant::is_finite_value(sent)) r[i] = quant::f32_sub(v, sent);
    }
  }
}

struct NoneDecodeArgs {
  const uint8_t* payload;
  void* output;
  uint64_t output_first;
  DType payload_dtype;
  DType output_dtype;  // float32 for decode-accumulate
};

template <bool kAccumulate>
__global__ void __launch_bounds__(kThreads) none_decode_kernel(const __grid_constant__ SegmentTable t,
                                                               const __grid_constant__ NoneDecodeArgs a) {
  const SegmentJob& j = t.jobs[blockIdx.y];
  const uint8_t* in = a.payload + j.byte_offset;
  const uint64_t base = j.offset - a.output_first;
  for (uint64_t i = thread_index(); i < j.count; i += thread_stride()) {
    const float v = load_as_float(in, a.payload_dtype, i);
    if constexpr (kAccumulate) {
      float* acc = static_cast<float*>(a.output) + base + i;
      *acc = add_canonical(*acc, v);
    } else {
      store_from_float(a.output, a.output_dtype, base + i, v);
    }
  }
}

struct ExactArgs {
  const void* input;
  uint64_t input_first;
  float* residual;
  uint64_t residual_first;
  const uint8_t* flags;
  float* acc;
  uint64_t acc_first;
  DType input_dtype;
};

// CpuBackend::accumulate_exact: acc += input + residual, the residual then 0, except in
// flagged layers (residual untouched and not added).
__global__ void __launch_bounds__(kThreads) exact_kernel(const __grid_constant__ SegmentTable t,
                                                         const __grid_constant__ ExactArgs a) {
  const SegmentJob& j = t.jobs[blockIdx.y];
  float* r = (a.residual && !(a.flags && a.flags[j.layer])) ? a.residual + (j.offset - a.residual_first) : nullptr;
  const uint64_t in_base = j.offset - a.input_first;
  float* sum = a.acc + (j.offset - a.acc_first);
  for (uint64_t i = thread_index(); i < j.count; i += thread_stride()) {
    const float x = load_as_float(a.input, a.input_dtype, in_base + i);
    const float addend = r ? quant::f32_add(x, r[i]) : x;
    sum[i] = add_canonical(sum[i], addend);
    if (r) r[i] = 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads) divide_kernel(float* acc, uint64_t n, float divisor) {
  for (uint64_t i = thread_index(); i < n; i += thread_stride()) acc[i] = div_canonical(acc[i], divisor);
}

__global__ void __launch_bounds__(kThreads) narrow_kernel(const float* acc, uint64_t n, void* out, DType out_dtype) {
  for (uint64_t i = thread_index(); i < n; i += thread_stride()) store_from_float(out, out_dtype, i, acc[i]);
}

// gather: runs travel in the parameters as segments do; block row y copies run y.
struct RunTable {
  uint32_t count;
  uint32_t pad;
  collective::Backend::Run runs[kMaxSegmentsPerLaunch];
};
static_assert(sizeof(RunTable) <= 2100, "kernel parameters are limited to 4 KB with the arguments");

struct GatherArgs {
  const void* src;
  uint64_t src_first, src_end;
  float* dst;
  float scale;
  DType src_dtype;
  uint8_t accumulate;
};

// CpuBackend::gather: dst[to + i] (+)= scale x src[from + i], 0 outside [src_first, src_end).
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ RunTable t,
                                                          const __grid_constant__ GatherArgs a) {
  const collective::Backend::Run& r = t.runs[blockIdx.y];
  for (uint64_t i = thread_index(); i < r.count; i += thread_stride()) {
    const uint64_t e = r.from + i;
    const float v = e >= a.src_first && e < a.src_end
                        ? quant::f32_mul(a.scale, load_as_float(a.src, a.src_dtype, e - a.src_first))
                        : 0.0f;
    float* d = a.dst + r.to + i;
    *d = a.accumulate ? add_canonical(*d, v) : quant::canonical_nan(v);
  }
}

struct SketchTable {
  uint32_t count;
  uint32_t pad;
  collective::Backend::SketchRun runs[kMaxSegmentsPerLaunch / 2];
};
static_assert(sizeof(SketchTable) <= 2100, "kernel parameters are limited to 4 KB with the arguments");

// sketch: one thread per bucket j of run blockIdx.y, over its elements j, j + width, ...
// in order, in double: the CPU backend's sum, in the same order.
__global__ void __launch_bounds__(kThreads)
    sketch_kernel(const __grid_constant__ SketchTable t, const float* src, float* dst) {
  const collective::Backend::SketchRun& r = t.runs[blockIdx.y];
  for (uint64_t j = thread_index(); j < r.width; j += thread_stride()) {
    double sum = 0;
    for (uint64_t i = j; i < r.count; i += r.width)
      sum += sketch::sign(r.key, i) * static_cast<double>(src[r.from + i]);
    dst[r.to + j] = static_cast<float>(sum);
  }
}

struct DistanceArgs {
  const void* a;
  const float* b;  // null: 0
  uint64_t first;
  double* partial;  // one per table entry (the kernels' scratch)
  DType a_dtype;
  int power;  // 1 or 2
};

// distance, first pass: one block per segment sums its differences' powers in
// double, each thread over a fixed stride, then a tree in shared memory: a fixed order for
// a fixed block size, so the result is deterministic.
__global__ void __launch_bounds__(kThreads) distance_kernel(const __grid_constant__ SegmentTable t,
                                                            const __grid_constant__ DistanceArgs a) {
  __shared__ double sums[kThreads];
  const SegmentJob& j = t.jobs[blockIdx.x];
  const uint64_t base = j.offset - a.first;
  double sum = 0;
  for (uint64_t i = threadIdx.x; i < j.count; i += blockDim.x) {
    const double v = load_as_float(a.a, a.a_dtype, base + i);
    const double d = a.b ? v - static_cast<double>(a.b[base + i]) : v;
    sum += a.power == 2 ? d * d : fabs(d);
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (uint32_t half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) a.partial[blockIdx.x] = sums[0];
}

// Second pass, one thread: the table's sums into their layers' rows in table order (jobs
// of one layer never race), or the layer's nonfinite byte.
__global__ void distance_add_kernel(const __grid_constant__ SegmentTable t, const double* partial, double weight,
                                    double* out, uint8_t* nonfinite) {
  for (uint32_t i = 0; i < t.count; ++i) {
    const double v = partial[i];
    if (isfinite(v)) out[t.jobs[i].layer] += weight * v;
    else nonfinite[t.jobs[i].layer] = 1;
  }
}

dim3 table_grid(uint64_t max_count, uint32_t segments) {
  const uint64_t blocks = std::clamp<uint64_t>((max_count + kThreads - 1) / kThreads, 1, kMaxBlocksPerSegment);
  return dim3(static_cast<uint32_t>(blocks), segments);
}
dim3 flat_grid(uint64_t n) {
  return dim3(static_cast<uint32_t>(std::clamp<uint64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocksFlat)));
}

// Calls launch(table, grid) for each run of up to kMaxSegmentsPerLaunch segments
// (empty ones dropped unless keep_empty), payload offsets from byte_offset_base.
template <class Launch>
void for_each_table(std::span<const Segment> segments, uint64_t byte_offset_base, bool keep_empty, Launch&& launch) {
  SegmentTable t;
  t.count = 0;
  t.pad = 0;
  uint64_t max_count = 0;
  const auto flush = [&] {
    if (t.count == 0) return;
    launch(t, table_grid(max_count, t.count));
    t.count = 0;
    max_count = 0;
  };
  for (const Segment& s : segments) {
    if (s.count == 0 && !keep_empty) continue;
    t.jobs[t.count++] = SegmentJob{s.offset, s.count, byte_offset_base + s.byte_offset, s.layer, 0};
    max_count = std::max(max_count, s.count);
    if (t.count == kMaxSegmentsPerLaunch) flush();
  }
  flush();
}

// Calls launch(table, grid) for each table of up to std::size(table.runs) of `runs`,
// copied as they are (gather's and sketch's tables), the grid's x from the largest
// extent(run) in the table; a run of extent 0 is dropped.
template <class Table, class Item, class Extent, class Launch>
void for_each_run_table(std::span<const Item> runs, Extent&& extent, Launch&& launch) {
  Table t;
  t.count = 0;
  t.pad = 0;
  uint64_t widest = 0;
  const auto flush = [&] {
    if (t.count == 0) return;
    launch(t, table_grid(widest, t.count));
    t.count = 0;
    widest = 0;
  };
  for (const Item& r : runs) {
    const uint64_t n = extent(r);
    if (n == 0) continue;
    t.runs[t.count++] = r;
    widest = std::max(widest, n);
    if (t.count == std::size(t.runs)) flush();
  }
  flush();
}

// A segment must lie at or after the first element of every array it is addressed in
// (the kernels index array[offset - first]); checked on the host, as quant_cuda does.
void require_after(const Segment& s, uint64_t first, const char* op, const char* array) {
  if (s.count > 0 && s.offset < first)
    throw CodecError(std::string("cuda backend ") + op + ": segment of layer " + std::to_string(s.layer) +
                     " at element " + std::to_string(s.offset) + " lies before the " + array + "'s first element " +
                     std::to_string(first));
}

CodecFamily family_of(const Plan& plan, const Segment& s) { return plan.codecs.at(s.codec).family(); }

// A segment whose codec is exchanged by other operations than encode/decode (PowerSGD's
// layers go through the lowrank_* operations): the engine's mistake, never the data's.
[[noreturn]] void not_a_segment_codec(const Plan& plan, const Segment& s, const char* op) {
  throw std::logic_error(std::string("lgreco: cuda backend ") + op + ": layer " + std::to_string(s.layer) +
                         "'s codec " + plan.codecs.at(s.codec).str() +
                         " is not encoded by segments (the low-rank operations run it)");
}

// The fields the quant and TopK kernels' batches share (same names in both families).
template <class Batch, class Job, class Residual>
Batch batch_over(const std::vector<Job>& jobs, ElementSpan input, Residual* residual, uint64_t residual_first) {
  Batch b;
  b.jobs = jobs;
  b.input = input.data;
  b.input_dtype = input.dtype;
  b.input_first = input.first;
  b.residual = residual;
  b.residual_first = residual_first;
  return b;
}
template <class Batch, class Job>
Batch encode_batch(const std::vector<Job>& jobs, ElementSpan input, float* residual, uint64_t residual_first,
                   const uint8_t* flags, uint8_t* out) {
  Batch b = batch_over<Batch>(jobs, input, residual, residual_first);
  b.skip_residual = flags;
  b.payload = out;
  return b;
}
template <class Batch, class Job>
Batch stats_batch(const std::vector<Job>& jobs, ElementSpan input, const float* residual, uint64_t residual_first,
                  const collective::Backend::Measure& m, void* scratch, uint64_t scratch_bytes) {
  Batch b = batch_over<Batch>(jobs, input, residual, residual_first);
  b.squared = m.squared;
  b.nonfinite = m.nonfinite;
  b.weight = m.weight;
  b.scratch = scratch;
  b.scratch_bytes = scratch_bytes;
  return b;
}

// A job of the TopK statistics: any segment (its own codec does not matter; the
// candidates' densities are the batch's).
tk::Job topk_stats_job(const Segment& s) {
  tk::Job job;
  job.element_offset = s.offset;
  job.count = s.count;
  job.layer = s.layer;
  return job;
}
// A job of TopK's encode or decode: the segment with its payload and density.
tk::Job topk_job(const Plan& plan, const Segment& s, uint64_t byte_offset_base) {
  tk::Job job = topk_stats_job(s);
  job.byte_offset = byte_offset_base + s.byte_offset;
  job.params = plan.codecs[s.codec].topk_params();
  return job;
}

qc::Job quant_job(const Plan& plan, const Segment& s, uint64_t byte_offset_base) {
  qc::Job job;
  job.element_offset = s.offset;
  job.count = s.count;
  job.first_element = s.first_element;
  job.byte_offset = byte_offset_base + s.byte_offset;
  job.layer = s.layer;
  job.params = plan.codecs[s.codec].quant_params();
  return job;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// The backend

CudaBackend::CudaBackend(int device, uint64_t memory_cap)
    : device_(device),
      cap_(memory_cap),
      shared_(std::make_shared<Shared>(device)),
      read_back_events_(std::make_shared<EventPool>(device)) {}

namespace {
// The compute capabilities this build carries code for, from nvcc's __CUDA_ARCH_LIST__
// (800,900 for the Makefile's sm_80, sm_90 and compute_90 PTX), as "8.0, 9.0".
std::string built_architectures() {
#ifdef __CUDA_ARCH_LIST__
#define LGRECO_STRINGIFY(...) #__VA_ARGS__
#define LGRECO_EXPAND(...) LGRECO_STRINGIFY(__VA_ARGS__)
  const std::string list = LGRECO_EXPAND(__CUDA_ARCH_LIST__);
#undef LGRECO_EXPAND
#undef LGRECO_STRINGIFY
  std::string out;
  size_t at = 0;
  while (at < list.size()) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    const int arch = std::atoi(list.substr(at, comma - at).c_str());
    if (!out.empty()) out += ", ";
    out += std::to_string(arch / 100) + "." + std::to_string(arch / 10 % 10);
    at = comma + 1;
  }
  return "built for compute capability " + out;
#else
  return "see the Makefile's -gencode list";
#endif
}
}  // namespace

namespace {
// lgreco's own memory pool on `device`, with its release threshold and peer access, and
// the stream frees run on. False (one WARN per process, nothing left behind, no error
// left set) when any of it fails, as it may in sandboxed or virtualised runtimes: the
// backend then allocates with plain cudaMalloc, which peers can reach too (never the
// device's default pool, whose access the framework owns).
bool make_private_pool(CudaBackend::Shared& shared, int device) {
  const char* failed = nullptr;
  cudaError_t e = cudaSuccess;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  // Keep what the pool holds: with the default threshold (0) its memory goes back to the
  // driver at every synchronisation and the next step allocates it again. What it holds
  // is bounded by LGRECO_MAX_MEMORY, counted by this backend.
  uint64_t keep_all = UINT64_MAX;  // a cuuint64_t, as the attribute wants
  if ((e = cudaMemPoolCreate(&shared.pool, &props)) != cudaSuccess)
    failed = "cudaMemPoolCreate";
  else if ((e = cudaMemPoolSetAttribute(shared.pool, cudaMemPoolAttrReleaseThreshold, &keep_all)) != cudaSuccess)
    failed = "cudaMemPoolSetAttribute (release threshold)";
  else if ((e = cudaStreamCreateWithFlags(&shared.free_stream, cudaStreamNonBlocking)) != cudaSuccess)
    failed = "cudaStreamCreateWithFlags (frees)";
  if (failed) {
    if (shared.pool) cudaMemPoolDestroy(shared.pool);
    shared.pool = nullptr;
    shared.free_stream = nullptr;
    cudaGetLastError();  // the failure (and any of the destroy's) is not the framework's error
    LGRECO_WARN_ONCE("SHIM", "private pool",
                     "cannot make lgreco's memory pool on CUDA device %d (%s failed: %s: %s); lgreco allocates with "
                     "cudaMalloc and frees with cudaFree instead, which wait for the whole device",
                     device, failed, cudaGetErrorName(e), cudaGetErrorString(e));
    return false;
  }
  // Every GPU that can reach this one may access the pool's memory, as it could
  // cudaMalloc'd memory once peer access is enabled (NCCL's P2P direct mode).
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) cudaGetLastError(), devices = 0;
  for (int peer = 0; peer < devices; ++peer) {
    int can = 0;
    if (peer == device || cudaDeviceCanAccessPeer(&can, peer, device) != cudaSuccess || !can) continue;
    cudaMemAccessDesc access{};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = peer;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    if (cudaMemPoolSetAccess(shared.pool, &access, 1) != cudaSuccess) {
      cudaGetLastError();
      LGRECO_INFO("SHIM", "cannot give CUDA device %d access to lgreco's memory on device %d", peer, device);
    }
  }
  cudaGetLastError();  // cudaDeviceCanAccessPeer's errors are not the framework's
  return true;
}
}  // namespace

std::unique_ptr<CudaBackend> CudaBackend::create(int device, uint64_t memory_cap) {
  const bool had_context = context_is_current();
  int previous = 0;
  cudaError_t e = cudaGetDevice(&previous);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: the framework's next check must not see it as its own
    throw std::runtime_error("lgreco: cannot use CUDA device " + std::to_string(device) +
                             ": cudaSetDevice failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
  if (had_context) cudaSetDevice(previous);
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device, memory_cap));
  DeviceGuard guard(device);
  Shared& shared = *backend->shared_;
  check(cudaEventCreateWithFlags(&shared.last_work, cudaEventDisableTiming), "cudaEventCreateWithFlags (last work)");
  int pools = 0;
  check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device),
        "cudaDeviceGetAttribute (memory pools)");
  shared.pools = pools != 0 && make_private_pool(shared, device);  // false: it WARNed why
  if (pools == 0) {
    static std::once_flag once;
    std::call_once(once, [device] {
      LGRECO_INFO("SHIM",
                  "CUDA device %d has no memory pools (cudaDevAttrMemoryPoolsSupported is 0): lgreco allocates with "
                  "cudaMalloc and frees with cudaFree, which wait for the whole device",
                  device);
    });
  }

  // Whether the device can run this build's kernels: asking for one kernel's attributes
  // fails when no image (SASS for its compute capability, or PTX it can JIT) fits. Found
  // by the runtime itself rather than from hard-coded numbers, so that it stays right when
  // the Makefile's -gencode list changes.
  cudaFuncAttributes attributes{};
  e = cudaFuncGetAttributes(&attributes, divide_kernel);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaDeviceProp prop{};
    const std::string name = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "unknown";
    cudaGetLastError();
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
      backend->unusable_ = "CUDA device " + std::to_string(device) + " (" + name + ", compute capability " +
                           std::to_string(major) + "." + std::to_string(minor) +
                           ") has no code in this build of lgreco (" + built_architectures() + ")";
    else
      backend->unusable_ = "CUDA device " + std::to_string(device) + " (" + name +
                           "): cudaFuncGetAttributes on lgreco's kernels failed: " + cudaGetErrorName(e) + ": " +
                           cudaGetErrorString(e);
  }
  return backend;
}

CudaBackend::~CudaBackend() {
  DeviceGuard guard(device_, DeviceGuard::kQuiet);
  for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  if (scratch_) shared_->free_device(scratch_, scratch_bytes_);
  // The context goes before its workspace (cublasDestroy waits for the device's work).
  cublas_.reset();
  if (cublas_workspace_) shared_->free_device(cublas_workspace_, lc::kWorkspaceBytes);
}

bool CudaBackend::stream_ordered() const { return shared_->pools; }

void CudaBackend::enqueued(const char* what) {
  const cudaError_t e = cudaEventRecord(shared_->last_work, stream_);
  if (e != cudaSuccess) cuda_failed(e, std::string("cudaEventRecord (last work, after ") + what + ")");
}

void CudaBackend::set_stream(nccl::Stream stream) {
  // Even for the same handle: a destroyed stream's address may come back for a new one
  // while the old one's work is still queued (the wait costs about a microsecond).
  DeviceGuard guard(device_);
  // The new stream waits for the last work enqueued on any earlier stream, recorded when
  // that work was enqueued (cuda_backend.h: the old stream may be gone or captured now,
  // so it is not touched here).
  check(cudaStreamWaitEvent(stream, shared_->last_work, 0), "cudaStreamWaitEvent (stream switch)");
  stream_ = stream;
}

uint64_t CudaBackend::device_bytes() const { return shared_->device_bytes.load(); }
uint64_t CudaBackend::host_bytes() const { return shared_->host_bytes.load(); }

void CudaBackend::reserve(uint64_t bytes, const char* what) {
  if (cap_ == 0) return;
  const uint64_t held = device_bytes() + host_bytes();
  if (bytes <= cap_ && held <= cap_ - bytes) return;
  LGRECO_INFO("SHIM",
              "cannot allocate %llu bytes of %s memory on CUDA device %d: lgreco holds %llu bytes and its cap is %llu "
              "(LGRECO_MAX_MEMORY)",
              static_cast<unsigned long long>(bytes), what, device_, static_cast<unsigned long long>(held),
              static_cast<unsigned long long>(cap_));
  throw std::bad_alloc();
}

namespace {
// A failed allocation: one INFO line, the runtime's error cleared if it is the ordinary
// out-of-memory one (not sticky; left set, the framework would take it for its own), and
// std::bad_alloc, as the engine expects.
[[noreturn]] void allocation_failed(cudaError_t e, const char* call, uint64_t bytes, int device) {
  if (e == cudaErrorMemoryAllocation) cudaGetLastError();
  LGRECO_INFO("SHIM", "%s of %llu bytes on CUDA device %d failed: %s: %s", call, static_cast<unsigned long long>(bytes),
              device, cudaGetErrorName(e), cudaGetErrorString(e));
  throw std::bad_alloc();
}
}  // namespace

namespace {
// Device memory, stream-ordered on `stream` where the device has pools (no device-wide
// synchronisation: cudaMalloc waits for the device and would break a global-mode capture
// elsewhere). Never a null pointer, even for 0 bytes: null means "absent" to the
// operations. Throws std::bad_alloc.
void* device_malloc(const CudaBackend::Shared& shared, uint64_t bytes, cudaStream_t stream, const char* what) {
  void* data = nullptr;
  const uint64_t n = std::max<uint64_t>(bytes, 1);
  const cudaError_t e = shared.pools ? cudaMallocFromPoolAsync(&data, n, shared.pool, stream) : cudaMalloc(&data, n);
  if (e != cudaSuccess) allocation_failed(e, what, bytes, shared.device);
  return data;
}
}  // namespace

std::unique_ptr<collective::Backend::Buffer> CudaBackend::allocate(uint64_t bytes) {
  DeviceGuard guard(device_);
  reserve(bytes, "device");
  void* data = device_malloc(*shared_, bytes, stream_, shared_->pools ? "cudaMallocFromPoolAsync" : "cudaMalloc");
  // Recorded at once, so that any free on the backend's own stream (the buffer's, or the
  // error paths below) is ordered after the allocation.
  try {
    enqueued("allocate");
  } catch (...) {
    if (shared_->pools ? cudaFreeAsync(data, stream_) : cudaFree(data)) cudaGetLastError();
    throw;
  }
  shared_->device_bytes += bytes;
  std::unique_ptr<Buffer> buffer;
  try {
    buffer = std::make_unique<DeviceBuffer>(data, bytes, shared_);
  } catch (...) {
    shared_->free_device(data, bytes);
    throw;
  }
  // Zeroed on the same stream, so ordered after the allocation and before any use; the
  // last work event then covers the allocation for a use on another stream.
  if (bytes) check(cudaMemsetAsync(data, 0, bytes, stream_), "cudaMemsetAsync (allocate)");
  enqueued("allocate");
  return buffer;
}

std::unique_ptr<collective::Backend::Buffer> CudaBackend::allocate_host(uint64_t bytes) {
  DeviceGuard guard(device_);
  reserve(bytes, "pinned host");
  void* data = nullptr;
  const cudaError_t e = cudaHostAlloc(&data, std::max<uint64_t>(bytes, 1), cudaHostAllocPortable);
  if (e != cudaSuccess) allocation_failed(e, "cudaHostAlloc", bytes, device_);
  shared_->host_bytes += bytes;
  std::unique_ptr<Buffer> buffer;
  try {
    buffer = std::make_unique<PinnedBuffer>(data, bytes, shared_);
  } catch (...) {
    cudaFreeHost(data);
    shared_->host_bytes -= bytes;
    throw;
  }
  if (bytes) memset(data, 0, bytes);
  return buffer;
}

void CudaBackend::fill_zero(void* data, uint64_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_);
  check(cudaMemsetAsync(data, 0, bytes, stream_), "cudaMemsetAsync (fill_zero)");
  enqueued("fill_zero");
}

void CudaBackend::copy(void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0 || dst == src) return;
  DeviceGuard guard(device_);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync (copy)");
  enqueued("copy");
}

void CudaBackend::upload(void* dst, const void* host_src, uint64_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device_);
  // From pageable memory the runtime has staged the source before this returns, so the
  // caller may reuse it at once (pinned sources would still be read afterwards).
  check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (upload)");
  enqueued("upload");
}

std::unique_ptr<Event> CudaBackend::read_back(void* host_dst, const void* src, uint64_t bytes) {
  DeviceGuard guard(device_);
  if (bytes) check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (read_back)");
  enqueued("read_back");
  cudaEvent_t event = read_back_events_->take();
  const cudaError_t e = cudaEventRecord(event, stream_);
  if (e != cudaSuccess) {
    read_back_events_->give(event);
    cuda_failed(e, "cudaEventRecord (read_back)");
  }
  try {
    return std::make_unique<ReadBackEvent>(read_back_events_, event);
  } catch (...) {
    read_back_events_->give(event);
    throw;
  }
}

void CudaBackend::find_nonfinite(const Plan&, std::span<const Segment> segments, ElementSpan input, uint8_t* flags) {
  if (segments.empty()) return;
  for (const Segment& s : segments) require_after(s, input.first, "find_nonfinite", "input");
  DeviceGuard guard(device_);
  const ScanArgs args{input.data, input.first, flags, input.dtype};
  // Every table's zeroing before any table's scan: a layer's segments may span tables.
  for_each_table(segments, 0, true, [&](const SegmentTable& t, dim3) {
    qc::launch_kernel(zero_flags_kernel, dim3(1), kThreads, stream_, "the backend's flag-zeroing kernel", t, args);
  });
  for_each_table(segments, 0, false, [&](const SegmentTable& t, dim3 grid) {
    qc::launch_kernel(nonfinite_kernel, grid, kThreads, stream_, "the backend's NaN/Inf scan kernel", t, args);
  });
  enqueued("find_nonfinite");
}

void CudaBackend::sort_segments(const Plan& plan, std::span<const Segment> segments, uint64_t byte_offset_base,
                                const char* op) {
  quant_jobs_.clear();
  topk_jobs_.clear();
  none_segments_.clear();
  for (const Segment& s : segments) {
    if (s.count == 0) continue;
    switch (family_of(plan, s)) {
      case CodecFamily::kNone: none_segments_.push_back(s); break;
      case CodecFamily::kQuant: quant_jobs_.push_back(quant_job(plan, s, byte_offset_base)); break;
      case CodecFamily::kTopk: topk_jobs_.push_back(topk_job(plan, s, byte_offset_base)); break;
      default: not_a_segment_codec(plan, s, op);
    }
  }
}

void CudaBackend::encode(const Plan& plan, std::span<const Segment> segments, ElementSpan input, float* residual_data,
                         uint64_t residual_first, const uint8_t* flags, const NoiseBase& noise, uint8_t* out,
                         uint64_t byte_offset_base) {
  for (const Segment& s : segments) {
    require_after(s, input.first, "encode", "input");
    if (residual_data) require_after(s, residual_first, "encode", "residual");
  }
  sort_segments(plan, segments, byte_offset_base, "encode");
  DeviceGuard guard(device_);
  if (!quant_jobs_.empty()) {
    auto batch = encode_batch<qc::EncodeBatch>(quant_jobs_, input, residual_data, residual_first, flags, out);
    batch.noise = NoiseKey{noise.seed, noise.rank, noise.step, noise.layer_base};
    qc::encode(batch, stream_);
  }
  if (!topk_jobs_.empty()) {
    auto batch = encode_batch<tk::EncodeBatch>(topk_jobs_, input, residual_data, residual_first, flags, out);
    batch.scratch_bytes = tk::encode_scratch_bytes(topk_jobs_);
    batch.scratch = scratch_for(batch.scratch_bytes, "encode (TopK selection)");
    tk::encode(batch, stream_);
  }
  if (!none_segments_.empty()) {
    const NoneEncodeArgs args{input.data, input.first, residual_data, residual_first, flags,
                              out,        input.dtype, plan.dtype};
    for_each_table(none_segments_, byte_offset_base, false, [&](const SegmentTable& t, dim3 grid) {
      qc::launch_kernel(none_encode_kernel, grid, kThreads, stream_, "the backend's `none` encode kernel", t, args);
    });
  }
  enqueued("encode");
}

void CudaBackend::decode(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                         uint64_t byte_offset_base, ElementSpan out) {
  for (const Segment& s : segments) require_after(s, out.first, "decode", "output");
  sort_segments(plan, segments, byte_offset_base, "decode");
  DeviceGuard guard(device_);
  if (!quant_jobs_.empty())
    qc::decode(qc::DecodeBatch{quant_jobs_, in, out.data, out.dtype, out.first}, stream_);
  if (!topk_jobs_.empty())
    tk::decode(tk::DecodeBatch{topk_jobs_, in, out.data, out.dtype, out.first}, stream_);
  if (!none_segments_.empty()) {
    const NoneDecodeArgs args{in, out.data, out.first, plan.dtype, out.dtype};
    for_each_table(none_segments_, byte_offset_base, false, [&](const SegmentTable& t, dim3 grid) {
      qc::launch_kernel(none_decode_kernel<false>, grid, kThreads, stream_, "the backend's `none` decode kernel", t,
                        args);
    });
  }
  enqueued("decode");
}

void CudaBackend::decode_accumulate(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                                    uint64_t byte_offset_base, ElementSpan acc) {
  if (acc.dtype != DType::kFloat32) throw CodecError("cuda backend decode_accumulate: accumulators must be float32");
  for (const Segment& s : segments) require_after(s, acc.first, "decode_accumulate", "accumulator");
  sort_segments(plan, segments, byte_offset_base, "decode_accumulate");
  DeviceGuard guard(device_);
  if (!quant_jobs_.empty())
    qc::decode_accumulate(qc::DecodeBatch{quant_jobs_, in, acc.data, DType::kFloat32, acc.first}, stream_);
  if (!topk_jobs_.empty())
    tk::decode_accumulate(tk::DecodeBatch{topk_jobs_, in, acc.data, DType::kFloat32, acc.first}, stream_);
  if (!none_segments_.empty()) {
    const NoneDecodeArgs args{in, acc.data, acc.first, plan.dtype, DType::kFloat32};
    for_each_table(none_segments_, byte_offset_base, false, [&](const SegmentTable& t, dim3 grid) {
      qc::launch_kernel(none_decode_kernel<true>, grid, kThreads, stream_,
                        "the backend's `none` decode-accumulate kernel", t, args);
    });
  }
  enqueued("decode_accumulate");
}

void CudaBackend::accumulate_exact(const Plan&, std::span<const Segment> segments, ElementSpan input,
                                   float* residual_data, uint64_t residual_first, const uint8_t* flags,
                                   ElementSpan acc) {
  if (acc.dtype != DType::kFloat32) throw CodecError("cuda backend accumulate_exact: accumulators must be float32");
  for (const Segment& s : segments) {
    require_after(s, input.first, "accumulate_exact", "input");
    require_after(s, acc.first, "accumulate_exact", "accumulator");
    if (residual_data) require_after(s, residual_first, "accumulate_exact", "residual");
  }
  DeviceGuard guard(device_);
  const ExactArgs args{input.data, input.first, residual_data,          residual_first,
                       flags,      static_cast<float*>(acc.data), acc.first, input.dtype};
  for_each_table(segments, 0, false, [&](const SegmentTable& t, dim3 grid) {
    qc::launch_kernel(exact_kernel, grid, kThreads, stream_, "the backend's exact-accumulate kernel", t, args);
  });
  enqueued("accumulate_exact");
}

void CudaBackend::divide(float* acc, uint64_t n, float divisor) {
  if (n == 0) return;
  DeviceGuard guard(device_);
  qc::launch_kernel(divide_kernel, flat_grid(n), kThreads, stream_, "the backend's divide kernel", acc, n, divisor);
  enqueued("divide");
}

void CudaBackend::narrow(const float* acc, uint64_t n, ElementSpan out) {
  if (n == 0) return;
  if (out.dtype == DType::kFloat32) {
    copy(out.data, acc, n * sizeof(float));
    return;
  }
  DeviceGuard guard(device_);
  void* data = out.data;
  DType dtype = out.dtype;
  qc::launch_kernel(narrow_kernel, flat_grid(n), kThreads, stream_, "the backend's narrow kernel", acc, n, data, dtype);
  enqueued("narrow");
}

void CudaBackend::gather(std::span<const Run> runs, ElementSpan src, uint64_t src_end, float scale, bool accumulate,
                         float* dst) {
  if (runs.empty()) return;
  DeviceGuard guard(device_);
  const GatherArgs args{src.data, src.first, src_end, dst, scale, src.dtype, static_cast<uint8_t>(accumulate)};
  for_each_run_table<RunTable>(
      runs, [](const Run& r) { return r.count; },
      [&](const RunTable& t, dim3 grid) {
        qc::launch_kernel(gather_kernel, grid, kThreads, stream_, "the backend's gather kernel", t, args);
      });
  enqueued("gather");
}

void CudaBackend::distance(std::span<const Segment> segments, ElementSpan a, const float* b, int power, double weight,
                           double* out, uint8_t* nonfinite) {
  if (segments.empty()) return;
  if (power != 1 && power != 2) throw std::invalid_argument("cuda backend distance: power " + std::to_string(power));
  for (const Segment& s : segments) require_after(s, a.first, "distance", "input");
  DeviceGuard guard(device_);
  auto* partial = static_cast<double*>(scratch_for(kMaxSegmentsPerLaunch * sizeof(double), "distance"));
  const DistanceArgs args{a.data, b, a.first, partial, a.dtype, power};
  for_each_table(segments, 0, false, [&](const SegmentTable& t, dim3) {
    qc::launch_kernel(distance_kernel, dim3(t.count), kThreads, stream_, "the backend's distance kernel", t, args);
    qc::launch_kernel(distance_add_kernel, dim3(1), 1, stream_, "the backend's distance sum kernel", t,
                      static_cast<const double*>(partial), weight, out, nonfinite);
  });
  enqueued("distance");
}

void CudaBackend::sketch(std::span<const SketchRun> runs, const float* src, float* dst) {
  if (runs.empty()) return;
  // Checked before anything is enqueued: a bad run launches none of the others.
  for (const SketchRun& r : runs)
    if (r.width == 0) throw std::invalid_argument("cuda backend sketch: a run of width 0");
  DeviceGuard guard(device_);
  for_each_run_table<SketchTable>(
      runs, [](const SketchRun& r) { return r.width; },
      [&](const SketchTable& t, dim3 grid) {
        qc::launch_kernel(sketch_kernel, grid, kThreads, stream_, "the backend's sketch kernel", t, src, dst);
      });
  enqueued("sketch");
}

void CudaBackend::prepare_probe(const Plan& plan) {
  prepare_encode(plan);
  grow_scratch(kMaxSegmentsPerLaunch * sizeof(double));
}

void CudaBackend::grow_scratch(uint64_t bytes) {
  if (bytes <= scratch_bytes_) return;
  DeviceGuard guard(device_);
  // The new scratch before the old one goes: the engine prepares an assignment a step
  // before it takes effect, and where the larger one cannot be had the plans in effect
  // keep theirs (so the cap counts both for a moment). The old scratch may still be read
  // by enqueued work: it is freed stream-ordered, so no wait here.
  reserve(bytes, "device (kernels' scratch)");
  void* fresh =
      device_malloc(*shared_, bytes, stream_,
                    shared_->pools ? "cudaMallocFromPoolAsync (kernels' scratch)" : "cudaMalloc (kernels' scratch)");
  shared_->device_bytes += bytes;
  if (scratch_) shared_->free_device(scratch_, scratch_bytes_);
  scratch_ = fresh;
  scratch_bytes_ = bytes;
  enqueued("allocating the kernels' scratch");
}

void* CudaBackend::scratch_for(uint64_t need, const char* what) {
  if (need > scratch_bytes_) {
    // prepare_* should have made room: an allocation that fails here fails this rank's call
    // alone, where the engine wants every rank to pass through together. Still grown
    // (stream-ordered) rather than refused, for a caller that skipped it.
    LGRECO_WARN_ONCE("SHIM", "an operation grows the kernels' scratch",
                     "%s needed %llu bytes of scratch on CUDA device %d where %llu were prepared: prepare_measure, "
                     "prepare_encode or prepare_lowrank was not called for it (this should not happen); growing it "
                     "here",
                     what, static_cast<unsigned long long>(need), device_,
                     static_cast<unsigned long long>(scratch_bytes_));
    grow_scratch(need);
  }
  return scratch_;
}

namespace {
// The non-empty segments of a plan, the kMaxJobsPerTable largest first: any subset of the
// plan's segments that one launch table of the kernels can hold needs at most what a table
// of these needs (every term of the kernels' scratch layouts grows with a job's size).
std::vector<Segment> largest_segments(const Plan& plan, size_t keep, bool (*wanted)(const Plan&, const Segment&)) {
  std::vector<Segment> out;
  for (const Segment& s : plan.segments)
    if (s.count && wanted(plan, s)) out.push_back(s);
  const size_t top = std::min(out.size(), keep);
  std::partial_sort(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(top), out.end(),
                    [](const Segment& a, const Segment& b) { return a.count > b.count; });
  out.resize(top);
  return out;
}
bool any_segment(const Plan&, const Segment&) { return true; }
bool topk_segment(const Plan& plan, const Segment& s) { return family_of(plan, s) == CodecFamily::kTopk; }
}  // namespace

void CudaBackend::split_candidates(const Measure& m, const char* what) {
  quant_candidates_.clear();
  quant_columns_.clear();
  topk_candidates_.clear();
  topk_columns_.clear();
  lowrank_ranks_.clear();
  lowrank_columns_.clear();
  for (size_t k = 0; k < m.candidates.size(); ++k) {
    if (!m.candidate_mask.empty() && !m.candidate_mask[k]) continue;
    const CodecSpec& c = m.candidates[k];
    const auto column = static_cast<uint32_t>(k);
    switch (c.family()) {
      case CodecFamily::kNone:
      case CodecFamily::kQuant: quant_candidates_.push_back(c), quant_columns_.push_back(column); break;
      case CodecFamily::kTopk: topk_candidates_.push_back(c.topk_params()), topk_columns_.push_back(column); break;
      case CodecFamily::kPowersgd:
        lowrank_ranks_.push_back(c.powersgd_params().rank), lowrank_columns_.push_back(column);
        break;
      default:
        throw CodecError(std::string("cuda backend ") + what + ": candidate " + std::to_string(k) + " (" + c.str() +
                         ") has no statistics kernels");
    }
  }
  if (lowrank_ranks_.size() > lc::kMaxMeasureRanks)
    throw CodecError(std::string("cuda backend ") + what + ": " + std::to_string(lowrank_ranks_.size()) +
                     " PowerSGD ranks to measure, at most " + std::to_string(lc::kMaxMeasureRanks));
}

void CudaBackend::prepare_measure(const Plan& plan, std::span<const CodecSpec> candidates) {
  if (candidates.empty()) return;
  Measure all;
  all.candidates = candidates;
  split_candidates(all, "prepare_measure");
  uint64_t need = 0;
  if (!quant_candidates_.empty()) {
    // An upper bound on qc::stats_scratch_bytes over every subset of the plan's segments:
    // the scratch is the largest (work items x candidates) array of any job table, and a
    // table holds at most kMaxJobsPerLaunch jobs and fewer than 2^31 work items. Which jobs
    // share a table depends on the subset (two large segments far apart in the plan may
    // meet in one table when the ones between them are not measured), so the full plan's
    // own need is not a bound; the kMaxJobsPerLaunch largest segments in one table are.
    // The launches (one per bucket size, `none` riding along the first) come from the
    // kernels' own split, with no jobs; it throws CodecError on candidates they cannot
    // measure, as measure() would.
    const std::vector<qc::StatsLaunch> launches =
        qc::stats_launches({}, quant_candidates_, "cuda backend prepare_measure");
    const std::vector<Segment> top = largest_segments(plan, quant::warp::kMaxJobsPerLaunch, any_segment);
    constexpr uint64_t kMaxWork = (uint64_t{1} << 31) - 1;  // kernels/quant_batch.cc's limit per table
    for (const qc::StatsLaunch& launch : launches) {
      uint64_t work = 0;
      for (const Segment& s : top) work += (s.count + launch.bucket - 1) / launch.bucket;
      need = std::max<uint64_t>(need, std::min(work, kMaxWork) * launch.candidates.size() * sizeof(double));
    }
  }
  if (!topk_candidates_.empty()) {
    // The same bound for TopK's statistics: its tables hold kMaxJobsPerTable jobs.
    topk_jobs_.clear();
    for (const Segment& s : largest_segments(plan, tk::plan::kMaxJobsPerTable, any_segment))
      topk_jobs_.push_back(topk_stats_job(s));
    need = std::max(need, tk::stats_scratch_bytes(topk_jobs_, topk_candidates_));
  }
  grow_scratch(need);
}

void CudaBackend::prepare_encode(const Plan& plan) {
  // Every TopK segment (which checks them all: a layer of 2^32 values or more is refused
  // here, where every rank passes through, not in the middle of a call), and the largest
  // that share one table (the bound for any subset, as prepare_measure's).
  topk_jobs_.clear();
  for (const Segment& s : plan.segments)
    if (s.count && topk_segment(plan, s)) topk_jobs_.push_back(topk_job(plan, s, 0));
  if (topk_jobs_.empty()) return;
  uint64_t need = tk::encode_scratch_bytes(topk_jobs_);
  topk_jobs_.clear();
  for (const Segment& s : largest_segments(plan, tk::plan::kMaxJobsPerTable, topk_segment))
    topk_jobs_.push_back(topk_job(plan, s, 0));
  need = std::max(need, tk::encode_scratch_bytes(topk_jobs_));
  grow_scratch(need);
}

std::string CudaBackend::unsupported(const CodecSpec& spec) const {
  switch (spec.family()) {
    case CodecFamily::kNone:
    case CodecFamily::kQuant:
    case CodecFamily::kTopk: return "";
    case CodecFamily::kPowersgd: {
      const std::string why = lc::cublas_problem();
      return why.empty() ? "" : "the CUDA backend runs PowerSGD's products with cuBLAS: " + why;
    }
    default: return std::string("the CUDA backend has no kernels for ") + family_name(spec.family());
  }
}

void CudaBackend::measure(const Plan&, std::span<const Segment> segments, ElementSpan input, const float* residual,
                          uint64_t residual_first, const Measure& m) {
  split_candidates(m, "measure");
  if (!lowrank_ranks_.empty())
    throw std::logic_error("lgreco: cuda backend measure: PowerSGD candidates are measured by measure_lowrank");
  quant_jobs_.clear();
  topk_jobs_.clear();
  for (const Segment& s : segments) {
    if (s.count == 0 || !m.measured[s.layer]) continue;
    require_after(s, input.first, "measure", "input");
    if (residual) require_after(s, residual_first, "measure", "residual");
    if (!quant_candidates_.empty()) {
      qc::Job job;
      job.element_offset = s.offset;
      job.count = s.count;
      job.first_element = s.first_element;
      job.layer = s.layer;  // params are ignored by the statistics
      quant_jobs_.push_back(job);
    }
    if (!topk_candidates_.empty()) topk_jobs_.push_back(topk_stats_job(s));
  }
  if (quant_jobs_.empty() && topk_jobs_.empty()) return;
  const auto row_stride = static_cast<uint32_t>(m.candidates.size());
  uint64_t need = 0;
  if (!quant_jobs_.empty()) need = qc::stats_scratch_bytes(quant_jobs_, quant_candidates_);
  if (!topk_jobs_.empty()) need = std::max(need, tk::stats_scratch_bytes(topk_jobs_, topk_candidates_));
  DeviceGuard guard(device_);
  void* scratch = scratch_for(need, "measure");
  if (!quant_jobs_.empty()) {
    auto batch = stats_batch<qc::StatsBatch>(quant_jobs_, input, residual, residual_first, m, scratch, scratch_bytes_);
    batch.candidates = quant_candidates_;
    batch.columns = quant_columns_;
    batch.row_stride = row_stride;
    qc::squared_errors(batch, stream_);
  }
  if (!topk_jobs_.empty()) {
    auto batch = stats_batch<tk::StatsBatch>(topk_jobs_, input, residual, residual_first, m, scratch, scratch_bytes_);
    batch.candidates = topk_candidates_;
    batch.columns = topk_columns_;
    batch.row_stride = row_stride;
    tk::squared_errors(batch, stream_);
  }
  enqueued("measure");
}

// ---------------------------------------------------------------------------------------
// Low rank

std::span<const lc::Layer> CudaBackend::lowrank_layers(std::span<const LowRankLayer> layers, uint32_t rank) {
  lowrank_layers_.clear();
  for (const LowRankLayer& l : layers)
    lowrank_layers_.push_back(
        lc::Layer{l.layer, l.offset, l.rows, l.cols, rank ? rank : l.rank, l.p_offset, l.q_offset});
  return lowrank_layers_;
}

lc::Handle& CudaBackend::cublas(const char* what) {
  if (!cublas_.valid())
    throw std::logic_error(std::string("lgreco: cuda backend ") + what +
                           ": no cuBLAS context (prepare_lowrank was not called)");
  return cublas_;
}

void CudaBackend::prepare_lowrank(std::span<const LowRankLayer> layers, std::span<const LowRankLayer> measured,
                                  uint32_t max_measured_rank, DType dtype, bool residual) {
  // Sizes first (they check every layer against the kernels' limits), then the context.
  uint64_t need = 0;
  if (!layers.empty()) need = lc::scratch_bytes(lowrank_layers(layers), dtype, residual);
  if (!measured.empty() && max_measured_rank)
    need = std::max(need, lc::measure_scratch_bytes(lowrank_layers(measured, max_measured_rank), max_measured_rank,
                                                    dtype, residual));
  if (!cublas_.valid()) {
    if (const std::string why = lc::cublas_problem(); !why.empty())
      throw std::runtime_error("lgreco: PowerSGD needs cuBLAS: " + why);
    DeviceGuard guard(device_);
    if (!cublas_workspace_) {
      reserve(lc::kWorkspaceBytes, "device (cuBLAS workspace)");
      cublas_workspace_ = device_malloc(*shared_, lc::kWorkspaceBytes, stream_, "cuBLAS workspace");
      shared_->device_bytes += lc::kWorkspaceBytes;
      enqueued("allocating the cuBLAS workspace");
    }
    cublas_ = lc::Handle::create(cublas_workspace_, lc::kWorkspaceBytes);
    LGRECO_INFO("SHIM", "cuBLAS %d on CUDA device %d for PowerSGD (float32 products, no TF32)",
                cublas_.cublas_version(), device_);
  }
  grow_scratch(need);
}

void CudaBackend::lowrank_project(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                                  const uint8_t* flags, const float* q, float* p) {
  if (layers.empty()) return;
  const std::span<const lc::Layer> ls = lowrank_layers(layers);
  const lc::Source source{input.data, input.dtype, input.first, const_cast<float*>(residual), 0, flags};
  lc::Handle& handle = cublas("lowrank_project");
  DeviceGuard guard(device_);
  void* scratch = scratch_for(lc::scratch_bytes(ls, input.dtype, residual != nullptr), "lowrank_project");
  lc::project(handle, ls, source, q, p, lc::Scratch{scratch, scratch_bytes_}, stream_);
  enqueued("lowrank_project");
}

void CudaBackend::lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) {
  if (layers.empty()) return;
  const std::span<const lc::Layer> ls = lowrank_layers(layers);
  DeviceGuard guard(device_);
  void* scratch = scratch_for(lc::scratch_bytes(ls, DType::kFloat32, false), "lowrank_orthonormalize");
  lc::orthonormalize(ls, p, lc::Scratch{scratch, scratch_bytes_}, stream_);
  enqueued("lowrank_orthonormalize");
}

void CudaBackend::lowrank_back_project(std::span<const LowRankLayer> layers, ElementSpan input, float* residual,
                                       const uint8_t* flags, const float* p, float* q) {
  if (layers.empty()) return;
  const std::span<const lc::Layer> ls = lowrank_layers(layers);
  const lc::Source source{input.data, input.dtype, input.first, residual, 0, flags};
  lc::Handle& handle = cublas("lowrank_back_project");
  DeviceGuard guard(device_);
  void* scratch = scratch_for(lc::scratch_bytes(ls, input.dtype, residual != nullptr), "lowrank_back_project");
  lc::back_project(handle, ls, source, p, q, lc::Scratch{scratch, scratch_bytes_}, stream_);
  enqueued("lowrank_back_project");
}

void CudaBackend::lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                                      ElementSpan out) {
  if (layers.empty()) return;
  const std::span<const lc::Layer> ls = lowrank_layers(layers);
  DeviceGuard guard(device_);
  lc::reconstruct(ls, p, q, scale, lc::Output{out.data, out.dtype, out.first}, stream_);
  enqueued("lowrank_reconstruct");
}

void CudaBackend::lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) {
  if (layers.empty()) return;
  const std::span<const lc::Layer> ls = lowrank_layers(layers);
  DeviceGuard guard(device_);
  lc::keep(ls, q_new, q0, q, stream_);
  enqueued("lowrank_keep");
}

void CudaBackend::measure_lowrank(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                                  const NoiseBase& key, const Measure& m) {
  split_candidates(m, "measure_lowrank");
  if (lowrank_ranks_.empty() || layers.empty()) return;
  if (std::none_of(layers.begin(), layers.end(), [&](const LowRankLayer& l) { return m.measured[l.layer] != 0; }))
    return;
  const uint32_t max_rank = *std::max_element(lowrank_ranks_.begin(), lowrank_ranks_.end());
  const std::span<const lc::Layer> ls = lowrank_layers(layers, max_rank);
  lc::Measure measure;
  measure.ranks = lowrank_ranks_;
  measure.columns = lowrank_columns_;
  measure.row_stride = static_cast<uint32_t>(m.candidates.size());
  measure.measured = m.measured;
  measure.squared = m.squared;
  measure.nonfinite = m.nonfinite;
  measure.weight = m.weight;
  measure.seed = key.seed;
  measure.step = key.step;
  measure.layer_base = key.layer_base;
  // No flags: the statistics always include the residual, as the CPU backend's do.
  const lc::Source source{input.data, input.dtype, input.first, const_cast<float*>(residual), 0, nullptr};
  lc::Handle& handle = cublas("measure_lowrank");
  DeviceGuard guard(device_);
  void* scratch =
      scratch_for(lc::measure_scratch_bytes(ls, max_rank, input.dtype, residual != nullptr), "measure_lowrank");
  lc::squared_errors(handle, ls, source, measure, lc::Scratch{scratch, scratch_bytes_}, stream_);
  enqueued("measure_lowrank");
}

// ---------------------------------------------------------------------------------------
// Marks: timing events from a pool; a handle is an index into it.

CUevent_st* CudaBackend::mark_event(uint64_t mark, const char* what) const {
  if (mark >= marks_.size() || std::find(free_marks_.begin(), free_marks_.end(), mark) != free_marks_.end())
    throw std::logic_error(std::string("lgreco: cuda backend ") + what + ": " + std::to_string(mark) +
                           " is not a mark in use");
  return marks_[mark];
}

uint64_t CudaBackend::mark() {
  DeviceGuard guard(device_);
  uint64_t handle;
  if (!free_marks_.empty()) {
    handle = free_marks_.back();
  } else {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDefault), "cudaEventCreateWithFlags (mark)");
    try {
      marks_.push_back(e);
    } catch (...) {
      cudaEventDestroy(e);
      throw;
    }
    handle = marks_.size() - 1;
    free_marks_.push_back(handle);  // taken below, with the pool's other marks
  }
  check(cudaEventRecord(marks_[handle], stream_), "cudaEventRecord (mark)");
  free_marks_.pop_back();
  // A mark often follows the fabric's exchange: the last work event then covers it too.
  enqueued("mark");
  return handle;
}

bool CudaBackend::mark_ready(uint64_t mark) {
  const cudaError_t e = cudaEventQuery(mark_event(mark, "mark_ready"));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  cuda_failed(e, "cudaEventQuery (mark)");
}

void CudaBackend::wait_mark(uint64_t mark) {
  check(cudaEventSynchronize(mark_event(mark, "wait_mark")), "cudaEventSynchronize (mark)");
}

double CudaBackend::seconds_between(uint64_t first_mark, uint64_t second_mark) {
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, mark_event(first_mark, "seconds_between"), mark_event(second_mark, "seconds_between")),
        "cudaEventElapsedTime");
  return ms > 0.0f ? static_cast<double>(ms) * 1e-3 : 0.0;
}

void CudaBackend::release_mark(uint64_t mark) {
  mark_event(mark, "release_mark");
  free_marks_.push_back(mark);
}

// ---------------------------------------------------------------------------------------
// The runtime

namespace {

class CudaRuntime final : public DeviceRuntime {
 public:
  std::string name() const override { return "cuda"; }

  bool capturing(nccl::Stream stream, std::string* error) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t e = cudaStreamIsCapturing(stream, &status);
    if (e != cudaSuccess) {
      // E.g. the legacy stream queried while another stream captures in global mode. Not
      // sticky; cleared so that the framework's next check does not take it for its own.
      cudaGetLastError();
      if (error)
        *error = std::string("cudaStreamIsCapturing failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
      return true;
    }
    return status != cudaStreamCaptureStatusNone;
  }

  std::unique_ptr<StreamBackend> create_backend(int device, uint64_t memory_cap) override {
    return CudaBackend::create(device, memory_cap);
  }
  std::unique_ptr<ExchangeMemory> exchange_memory(int device) override;
};

// The configuration exchange's memory when no backend could be made: plain cudaMalloc and
// cudaMallocHost (whose frees wait for the device: this happens once, on a rank that will
// pass its calls through), copies on the call's stream, and a read-back that polls the
// stream itself (cudaStreamQuery), so that nothing of lgreco's own (pool, stream, event)
// is needed.
class PlainBuffer final : public collective::Backend::Buffer {
 public:
  PlainBuffer(void* data, uint64_t bytes, int device, bool host)
      : data_(data), bytes_(bytes), device_(device), host_(host) {}
  ~PlainBuffer() override {
    DeviceGuard guard(device_, DeviceGuard::kQuiet);
    const cudaError_t e = host_ ? cudaFreeHost(data_) : cudaFree(data_);
    if (e != cudaSuccess) cudaGetLastError();
  }
  void* data() override { return data_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  uint64_t bytes_;
  int device_;
  bool host_;
};

class StreamDrained final : public Event {
 public:
  StreamDrained(cudaStream_t stream, int device) : stream_(stream), device_(device) {}
  bool ready() override {
    DeviceGuard guard(device_);
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    cuda_failed(e, "cudaStreamQuery (configuration exchange)");
  }
  void wait() override {
    DeviceGuard guard(device_);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (configuration exchange)");
  }

 private:
  cudaStream_t stream_;
  int device_;
};

class PlainExchangeMemory final : public ExchangeMemory {
 public:
  explicit PlainExchangeMemory(int device) : device_(device) {}
  void set_stream(nccl::Stream stream) override { stream_ = stream; }
  std::unique_ptr<Buffer> allocate(uint64_t bytes) override { return make(bytes, false); }
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override { return make(bytes, true); }
  void upload(void* dst, const void* host_src, uint64_t bytes) override {
    DeviceGuard guard(device_);
    check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (exchange)");
  }
  std::unique_ptr<Event> read_back(void* host_dst, const void* src, uint64_t bytes) override {
    DeviceGuard guard(device_);
    check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (exchange)");
    return std::make_unique<StreamDrained>(stream_, device_);
  }

 private:
  std::unique_ptr<Buffer> make(uint64_t bytes, bool host) {
    DeviceGuard guard(device_);
    void* data = nullptr;
    const uint64_t n = std::max<uint64_t>(bytes, 1);
    const cudaError_t e = host ? cudaMallocHost(&data, n) : cudaMalloc(&data, n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("lgreco: ") + (host ? "cudaMallocHost" : "cudaMalloc") + " of " +
                               std::to_string(n) + " bytes on CUDA device " + std::to_string(device_) +
                               " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
    }
    if (host) memset(data, 0, n);
    return std::make_unique<PlainBuffer>(data, bytes, device_, host);
  }

  int device_;
  cudaStream_t stream_ = nullptr;
};

std::unique_ptr<ExchangeMemory> CudaRuntime::exchange_memory(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    throw std::runtime_error("lgreco: cannot use CUDA device " + std::to_string(device) + ": " +
                             (e != cudaSuccess ? std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(e)
                                               : "there are " + std::to_string(count) + " devices"));
  }
  return std::make_unique<PlainExchangeMemory>(device);
}

}  // namespace

std::unique_ptr<DeviceRuntime> cuda_runtime() { return std::make_unique<CudaRuntime>(); }

}  // namespace lgreco::shim
