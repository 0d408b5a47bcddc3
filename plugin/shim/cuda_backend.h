// The CUDA backend of the engine: the Backend operations of plugin/collective/backend.h
// as kernels and copies enqueued on the stream of the current NCCL call (set_stream),
// on one device, with device memory capped per communicator. docs/KERNELS.md ("The
// engine's CUDA backend") says how each operation maps to kernels, what is allocated
// when and what is not measured yet.
//
// Ordering across streams. The backend cannot know where an NCCL call's work ends (the
// fabric's operations share its stream), and at set_stream time the previous stream may
// already be destroyed by the framework (recording an event there is then an error, or
// worse a handle reused by a new stream) or being captured into a CUDA graph (a record
// there would become a node of someone else's graph and break capture isolation). So the
// old stream is never touched when switching. Instead every operation that enqueues
// work (kernels, copies, zero-fills, read-backs, allocations' zero-fill, and marks, which
// follow the fabric's exchanges) re-records one "last work" event on the current stream
// right after it, while that stream is certainly alive and not captured (the shim passes
// captured calls through before the backend sees them). set_stream(s) makes s wait for
// that event; device memory is freed on a stream of the backend's own after waiting for
// it too. Cost: one cudaEventRecord (about 1-2 us of host time, no device work to speak
// of) per operation, some 10 to 20 per compressed call, against milliseconds of
// collective; cheaper schemes (recording only after writes of residuals) would miss
// write-after-read hazards (a staging buffer or the kernels' scratch overwritten by the
// next call on another stream while the last one still reads it). What the fabric
// enqueues after the backend's last operation of a call is not covered; in the engine a
// call always ends with a backend operation (decode, narrow, read_back or a mark).
//
// Memory. Device buffers are stream-ordered (cudaMallocFromPoolAsync from lgreco's own
// memory pool, which peer GPUs may access as NCCL's P2P direct mode needs, on the
// current stream, zero-filled there; cudaFreeAsync as above): no allocation or free waits for the device,
// so none can deadlock against another communicator's kernel that waits for a peer, nor
// invalidate a global-mode graph capture on another stream. Devices without memory pools
// fall back to cudaMalloc / cudaFree (which synchronise the device), with one INFO line.
//
// Free of CUDA headers (streams and events are the runtime's opaque CUstream_st and
// CUevent_st pointers), so that .cc files compiled by g++ can include it. Built without
// CUDA (plugin/shim/cuda_backend_none.cc), only cuda_runtime() exists, and its
// create_backend() throws.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/lowrank_cuda.h"
#include "kernels/quant_cuda.h"
#include "kernels/topk_cuda.h"
#include "plugin/shim/device_runtime.h"

struct CUevent_st;  // cudaEvent_t

namespace lgreco::shim {

class CudaBackend final : public StreamBackend {
 public:
  // A backend on CUDA device `device`; allocations beyond memory_cap bytes in all (device
  // plus pinned host, 0: no cap) throw std::bad_alloc. Throws std::runtime_error when the
  // device cannot be made current (no GPU, a bad index). Its first stream is the legacy
  // default stream, until set_stream. A device the build has no code for is not an error
  // here: unusable_reason() says so, and the shim passes the communicator through.
  static std::unique_ptr<CudaBackend> create(int device, uint64_t memory_cap);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  // Every family: none, quant and topk always; powersgd where cuBLAS can be loaded
  // (lowrank::cuda::cublas_problem says why not).
  std::string unsupported(const CodecSpec& spec) const override;
  int device() const { return device_; }
  uint64_t memory_cap() const { return cap_; }

  // StreamBackend
  void set_stream(nccl::Stream stream) override;
  uint64_t device_bytes() const override;
  uint64_t host_bytes() const override;
  // Found once by create(): "" when the device runs the backend's kernels, else why not
  // (a compute capability this build has no code for).
  std::string unusable_reason() const override { return unusable_; }
  // Whether device memory is stream-ordered (lgreco's pool); false: cudaMalloc/cudaFree.
  bool stream_ordered() const;

  // Backend
  std::unique_ptr<Buffer> allocate(uint64_t bytes) override;
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override;
  void fill_zero(void* data, uint64_t bytes) override;
  void copy(void* dst, const void* src, uint64_t bytes) override;
  void upload(void* dst, const void* host_src, uint64_t bytes) override;
  std::unique_ptr<collective::Event> read_back(void* host_dst, const void* src, uint64_t bytes) override;

  void find_nonfinite(const collective::Plan& plan, std::span<const collective::Segment> segments,
                      collective::ElementSpan input, uint8_t* flags) override;
  void encode(const collective::Plan& plan, std::span<const collective::Segment> segments,
              collective::ElementSpan input, float* residual_data, uint64_t residual_first, const uint8_t* flags,
              const collective::NoiseBase& noise, uint8_t* out, uint64_t byte_offset_base) override;
  void decode(const collective::Plan& plan, std::span<const collective::Segment> segments, const uint8_t* in,
              uint64_t byte_offset_base, collective::ElementSpan out) override;
  void decode_accumulate(const collective::Plan& plan, std::span<const collective::Segment> segments,
                         const uint8_t* in, uint64_t byte_offset_base, collective::ElementSpan acc) override;
  void accumulate_exact(const collective::Plan& plan, std::span<const collective::Segment> segments,
                        collective::ElementSpan input, float* residual_data, uint64_t residual_first,
                        const uint8_t* flags, collective::ElementSpan acc) override;
  void divide(float* acc, uint64_t n, float divisor) override;
  void narrow(const float* acc, uint64_t n, collective::ElementSpan out) override;
  // The error probe's two operations: gather (runs in the kernel's parameters, 64 per
  // launch) and distance (one block per segment, then its layers' rows in segment order:
  // deterministic; the partial sums use the kernels' scratch, grown by prepare_probe,
  // which also prepares encode() for the plan).
  void gather(std::span<const Run> runs, collective::ElementSpan src, uint64_t src_end, float scale, bool accumulate,
              float* dst) override;
  void distance(std::span<const collective::Segment> segments, collective::ElementSpan a, const float* b, int power,
                double weight, double* out, uint8_t* nonfinite) override;
  // One thread per bucket of a run, its elements in order (deterministic).
  void sketch(std::span<const SketchRun> runs, const float* src, float* dst) override;
  void prepare_probe(const collective::Plan& plan) override;
  // prepare_measure grows the kernels' scratch (device memory the backend owns,
  // counted in device_bytes and the cap) to what measure() could need on ANY segments of
  // the plan with these candidates, so that measure() allocates nothing; throws
  // std::bad_alloc like allocate (and CodecError on candidates the kernels cannot
  // measure). measure() still grows the scratch for a caller that skipped it (one WARN:
  // an allocation failure there would fail one rank's call alone).
  void prepare_measure(const collective::Plan& plan, std::span<const CodecSpec> candidates) override;
  void measure(const collective::Plan& plan, std::span<const collective::Segment> segments,
               collective::ElementSpan input, const float* residual, uint64_t residual_first,
               const Measure& m) override;
  // Grows the same scratch for TopK's selection (the largest encode any segments of the
  // plan could need), so that encode() allocates nothing either.
  void prepare_encode(const collective::Plan& plan) override;

  // Low rank: kernels/lowrank_cuda.h, one cuBLAS context per backend, created (with its
  // workspace, counted in device_bytes and the cap) by prepare_lowrank, which also grows
  // the scratch for the layers' staging and Gram-Schmidt. An operation that finds no
  // context or too small a scratch throws std::logic_error: the engine prepares first.
  void prepare_lowrank(std::span<const LowRankLayer> layers, std::span<const LowRankLayer> measured,
                       uint32_t max_measured_rank, DType dtype, bool residual) override;
  void lowrank_project(std::span<const LowRankLayer> layers, collective::ElementSpan input, const float* residual,
                       const uint8_t* flags, const float* q, float* p) override;
  void lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) override;
  void lowrank_back_project(std::span<const LowRankLayer> layers, collective::ElementSpan input, float* residual,
                            const uint8_t* flags, const float* p, float* q) override;
  void lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                           collective::ElementSpan out) override;
  void lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) override;
  void measure_lowrank(std::span<const LowRankLayer> layers, collective::ElementSpan input, const float* residual,
                       const collective::NoiseBase& key, const Measure& m) override;

  uint64_t mark() override;
  bool mark_ready(uint64_t mark) override;
  void wait_mark(uint64_t mark) override;
  double seconds_between(uint64_t first_mark, uint64_t second_mark) override;
  void release_mark(uint64_t mark) override;

  // Shared with the buffers, which may outlive the backend: the byte counts, the "last
  // work" event and the backend's own stream that frees run on (see the top).
  struct Shared;
  // Read-back events, shared with the Event objects for the same reason.
  struct EventPool;

 private:
  CudaBackend(int device, uint64_t memory_cap);
  // Throws std::bad_alloc (after one INFO line) when `bytes` more would pass the cap.
  void reserve(uint64_t bytes, const char* what);
  CUevent_st* mark_event(uint64_t mark, const char* what) const;
  // Re-records the "last work" event on the current stream, after an operation enqueued.
  void enqueued(const char* what);
  // Makes the kernels' scratch at least `bytes` (stream-ordered; the old one is freed
  // after everything enqueued so far). Throws std::bad_alloc.
  void grow_scratch(uint64_t bytes);
  // Fills quant_jobs_, topk_jobs_ and none_segments_ from the non-empty segments; a
  // low-rank segment is the engine's mistake (std::logic_error).
  void sort_segments(const collective::Plan& plan, std::span<const collective::Segment> segments,
                     uint64_t byte_offset_base, const char* op);
  // The scratch, at least `need` bytes: grown (one WARN) where the engine did not prepare.
  void* scratch_for(uint64_t need, const char* what);
  // The cuBLAS context on the current stream's device, or std::logic_error.
  lowrank::cuda::Handle& cublas(const char* what);
  // layers as the kernels' Layer list (a reused host vector, so one list at a time), with
  // `rank` in place of each layer's own when nonzero (measure_lowrank's basis rank).
  std::span<const lowrank::cuda::Layer> lowrank_layers(std::span<const LowRankLayer> layers, uint32_t rank = 0);
  // The candidates of m that it measures, by family, with their columns in its rows
  // (quant_candidates_ and none, topk_candidates_, lowrank_ranks_). Throws CodecError for
  // more PowerSGD ranks than the kernels measure at once.
  void split_candidates(const Measure& m, const char* what);

  int device_;
  uint64_t cap_;
  nccl::Stream stream_ = nullptr;
  std::string unusable_;
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<EventPool> read_back_events_;
  std::vector<CUevent_st*> marks_;  // handle i is marks_[i]
  std::vector<uint64_t> free_marks_;
  // The kernels' scratch, one buffer shared by whatever runs on the stream: the statistics,
  // TopK's selection, PowerSGD's staging and Gram-Schmidt.
  void* scratch_ = nullptr;
  uint64_t scratch_bytes_ = 0;
  // The cuBLAS context and its workspace (the destructor destroys the context first).
  void* cublas_workspace_ = nullptr;
  lowrank::cuda::Handle cublas_;
  // Reused host-side lists of jobs (no host allocation per call once they have grown).
  std::vector<quant::cuda::Job> quant_jobs_;
  std::vector<topk::cuda::Job> topk_jobs_;
  std::vector<collective::Segment> none_segments_;
  std::vector<lowrank::cuda::Layer> lowrank_layers_;
  std::vector<CodecSpec> quant_candidates_;
  std::vector<uint32_t> quant_columns_, topk_columns_, lowrank_ranks_, lowrank_columns_;
  std::vector<TopkParams> topk_candidates_;
};

}  // namespace lgreco::shim
