// The host runtime: the shim's DeviceRuntime over host memory and the CPU backend
// (plugin/collective/cpu_backend.h). With it the whole shim runs where no GPU exists:
// the unit tests (over a test double of NCCL) and lgreco-shim-bench, which times the
// shim's own host cost. Buffers count against the cap as the CUDA backend's do.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "plugin/collective/cpu_backend.h"
#include "plugin/shim/device_runtime.h"

namespace lgreco::shim {

// The stream current at each device allocation, in order, of all the backends of one
// runtime: what a CUDA backend's stream-ordered allocation would be queued on (tests).
struct AllocationStreams {
  std::mutex mutex;
  std::vector<nccl::Stream> streams;
};

class HostBackend final : public StreamBackend {
 public:
  explicit HostBackend(uint64_t memory_cap, std::shared_ptr<AllocationStreams> log = nullptr)
      : cap_(memory_cap), allocation_log_(std::move(log)) {}
  std::string name() const override { return "host"; }
  void set_stream(nccl::Stream stream) override { stream_ = stream; }
  nccl::Stream stream() const { return stream_; }
  uint64_t device_bytes() const override { return held_->device; }
  uint64_t host_bytes() const override { return held_->host; }

  std::unique_ptr<Buffer> allocate(uint64_t bytes) override;
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override;
  void fill_zero(void* data, uint64_t bytes) override { cpu_.fill_zero(data, bytes); }
  void copy(void* dst, const void* src, uint64_t bytes) override { cpu_.copy(dst, src, bytes); }
  void upload(void* dst, const void* host_src, uint64_t bytes) override { cpu_.upload(dst, host_src, bytes); }
  std::unique_ptr<collective::Event> read_back(void* host_dst, const void* src, uint64_t bytes) override {
    return cpu_.read_back(host_dst, src, bytes);
  }
  void find_nonfinite(const collective::Plan& plan, std::span<const collective::Segment> segments,
                      collective::ElementSpan input, uint8_t* flags) override {
    cpu_.find_nonfinite(plan, segments, input, flags);
  }
  void encode(const collective::Plan& plan, std::span<const collective::Segment> segments,
              collective::ElementSpan input, float* residual_data, uint64_t residual_first, const uint8_t* flags,
              const collective::NoiseBase& noise, uint8_t* out, uint64_t byte_offset_base) override {
    cpu_.encode(plan, segments, input, residual_data, residual_first, flags, noise, out, byte_offset_base);
  }
  void decode(const collective::Plan& plan, std::span<const collective::Segment> segments, const uint8_t* in,
              uint64_t byte_offset_base, collective::ElementSpan out) override {
    cpu_.decode(plan, segments, in, byte_offset_base, out);
  }
  void decode_accumulate(const collective::Plan& plan, std::span<const collective::Segment> segments,
                         const uint8_t* in, uint64_t byte_offset_base, collective::ElementSpan acc) override {
    cpu_.decode_accumulate(plan, segments, in, byte_offset_base, acc);
  }
  void accumulate_exact(const collective::Plan& plan, std::span<const collective::Segment> segments,
                        collective::ElementSpan input, float* residual_data, uint64_t residual_first,
                        const uint8_t* flags, collective::ElementSpan acc) override {
    cpu_.accumulate_exact(plan, segments, input, residual_data, residual_first, flags, acc);
  }
  void divide(float* acc, uint64_t n, float divisor) override { cpu_.divide(acc, n, divisor); }
  void narrow(const float* acc, uint64_t n, collective::ElementSpan out) override { cpu_.narrow(acc, n, out); }
  void gather(std::span<const Run> runs, collective::ElementSpan src, uint64_t src_end, float scale, bool accumulate,
              float* dst) override {
    cpu_.gather(runs, src, src_end, scale, accumulate, dst);
  }
  void distance(std::span<const collective::Segment> segments, collective::ElementSpan a, const float* b, int power,
                double weight, double* out, uint8_t* nonfinite) override {
    cpu_.distance(segments, a, b, power, weight, out, nonfinite);
  }
  void sketch(std::span<const SketchRun> runs, const float* src, float* dst) override { cpu_.sketch(runs, src, dst); }
  void measure(const collective::Plan& plan, std::span<const collective::Segment> segments,
               collective::ElementSpan input, const float* residual, uint64_t residual_first,
               const Measure& m) override {
    cpu_.measure(plan, segments, input, residual, residual_first, m);
  }
  std::string unsupported(const CodecSpec& spec) const override { return cpu_.unsupported(spec); }
  void lowrank_project(std::span<const LowRankLayer> layers, collective::ElementSpan input, const float* residual,
                       const uint8_t* flags, const float* q, float* p) override {
    cpu_.lowrank_project(layers, input, residual, flags, q, p);
  }
  void lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) override {
    cpu_.lowrank_orthonormalize(layers, p);
  }
  void lowrank_back_project(std::span<const LowRankLayer> layers, collective::ElementSpan input, float* residual,
                            const uint8_t* flags, const float* p, float* q) override {
    cpu_.lowrank_back_project(layers, input, residual, flags, p, q);
  }
  void lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                           collective::ElementSpan out) override {
    cpu_.lowrank_reconstruct(layers, p, q, scale, out);
  }
  void lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) override {
    cpu_.lowrank_keep(layers, q_new, q0, q);
  }
  void measure_lowrank(std::span<const LowRankLayer> layers, collective::ElementSpan input, const float* residual,
                       const collective::NoiseBase& key, const Measure& m) override {
    cpu_.measure_lowrank(layers, input, residual, key, m);
  }
  uint64_t mark() override { return cpu_.mark(); }
  bool mark_ready(uint64_t mark) override { return cpu_.mark_ready(mark); }
  void wait_mark(uint64_t mark) override { cpu_.wait_mark(mark); }
  double seconds_between(uint64_t a, uint64_t b) override { return cpu_.seconds_between(a, b); }
  void release_mark(uint64_t mark) override { cpu_.release_mark(mark); }

 private:
  struct Held {
    uint64_t device = 0, host = 0;
  };
  class CountedBuffer;
  std::unique_ptr<Buffer> counted(uint64_t bytes, bool device);
  collective::CpuBackend cpu_;
  uint64_t cap_;
  // Shared with the buffers, which give their bytes back when freed (they may outlive
  // the backend).
  std::shared_ptr<Held> held_ = std::make_shared<Held>();
  nccl::Stream stream_ = nullptr;
  std::shared_ptr<AllocationStreams> allocation_log_;
};

class HostRuntime final : public DeviceRuntime {
 public:
  std::string name() const override { return "host"; }
  // No graphs on the host; tests name the streams that count as being captured, and
  // those whose query fails.
  bool capturing(nccl::Stream stream, std::string* error) override;
  std::unique_ptr<StreamBackend> create_backend(int device, uint64_t memory_cap) override;
  std::unique_ptr<ExchangeMemory> exchange_memory(int device) override;

  void set_capturing(nccl::Stream stream, bool capturing);
  // capturing(stream) fails, as cudaStreamIsCapturing does on the legacy stream while
  // another thread captures in global mode.
  void set_capture_query_fails(nccl::Stream stream, bool fails);
  // Failures to inject. fail_backend: create_backend() throws std::runtime_error(why), as
  // CudaBackend::create does when a stream, an event or the device's memory cannot be had
  // ("" clears it). set_no_device: exchange_memory() throws too, as without any device.
  void fail_backend(std::string why);
  void set_no_device(bool no_device);
  // How many times exchange_memory() was asked for.
  int exchange_memories_made() const;
  // The stream current at each device allocation of this runtime's backends, in order.
  std::vector<nccl::Stream> allocation_streams() const;

 private:
  std::shared_ptr<AllocationStreams> allocation_log_ = std::make_shared<AllocationStreams>();
  mutable std::mutex mutex_;
  std::set<nccl::Stream> capturing_, capture_query_fails_;
  std::string backend_failure_;
  bool no_device_ = false;
  int exchange_memories_ = 0;
};

}  // namespace lgreco::shim
