// The CUDA backend of the engine: the Backend operations of plugin/collective/backend.h
// as kernels and copies enqueued on the stream of the current NCCL call (set_stream),
// on one device, with device memory capped per communicator. docs/KERNELS.md ("The
// engine's CUDA backend") says how each operation maps to kernels, what is allocated
// when and what is not measured yet.
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

#include "kernels/quant_cuda.h"
#include "plugin/shim/device_runtime.h"

struct CUevent_st;  // cudaEvent_t

namespace lgreco::shim {

class CudaBackend final : public StreamBackend {
 public:
  // A backend on CUDA device `device`; allocations beyond memory_cap bytes in all (device
  // plus pinned host, 0: no cap) throw std::bad_alloc. Throws std::runtime_error when the
  // device cannot be made current (no GPU, a bad index). Its first stream is the legacy
  // default stream, until set_stream.
  static std::unique_ptr<CudaBackend> create(int device, uint64_t memory_cap);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  int device() const { return device_; }
  uint64_t memory_cap() const { return cap_; }

  // StreamBackend
  void set_stream(nccl::Stream stream) override;
  uint64_t device_bytes() const override;
  uint64_t host_bytes() const override;

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
  // The one operation that may allocate: the statistics' scratch (device memory the
  // backend owns, counted in device_bytes and the cap) grows when a call needs more than
  // any call before it; growing waits for the current stream once. Throws std::bad_alloc
  // like allocate.
  void measure(const collective::Plan& plan, std::span<const collective::Segment> segments,
               collective::ElementSpan input, const float* residual, uint64_t residual_first,
               const Measure& m) override;

  uint64_t mark() override;
  bool mark_ready(uint64_t mark) override;
  void wait_mark(uint64_t mark) override;
  double seconds_between(uint64_t first_mark, uint64_t second_mark) override;
  void release_mark(uint64_t mark) override;

  // Byte counts shared with the buffers, which may outlive the backend.
  struct Accounts;
  // Read-back events, shared with the Event objects for the same reason.
  struct EventPool;

 private:
  CudaBackend(int device, uint64_t memory_cap);
  // Throws std::bad_alloc (after one INFO line) when `bytes` more would pass the cap.
  void reserve(uint64_t bytes, const char* what);
  CUevent_st* mark_event(uint64_t mark, const char* what) const;

  int device_;
  uint64_t cap_;
  nccl::Stream stream_ = nullptr;
  CUevent_st* switch_event_ = nullptr;  // recorded on the old stream when set_stream switches
  std::shared_ptr<Accounts> accounts_;
  std::shared_ptr<EventPool> read_back_events_;
  std::vector<CUevent_st*> marks_;  // handle i is marks_[i]
  std::vector<uint64_t> free_marks_;
  void* scratch_ = nullptr;  // the statistics' scratch
  uint64_t scratch_bytes_ = 0;
  // Reused host-side lists of jobs (no host allocation per call once they have grown).
  std::vector<quant::cuda::Job> quant_jobs_;
  std::vector<collective::Segment> none_segments_;
};

}  // namespace lgreco::shim
