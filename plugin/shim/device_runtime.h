// What the shim needs from the GPU runtime, behind an interface: the CUDA runtime in
// production (cuda_backend.h), host memory and the CPU backend in the tests, which then
// run the whole shim (dispatch, engine, NCCL fabric over a test double of NCCL) without
// a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "plugin/collective/backend.h"
#include "plugin/shim/nccl_abi.h"

namespace lgreco::shim {

// A Backend whose queue is a stream the caller chooses per call: each NCCL call names
// its stream, and the engine's operations of that call go there.
class StreamBackend : public collective::Backend {
 public:
  // Operations from now on are enqueued on `stream`, ordered after everything enqueued
  // on the previous stream (CUDA: an event recorded there, waited for here), so that
  // residuals written by one call are read by the next whatever stream it uses.
  virtual void set_stream(nccl::Stream stream) = 0;
  // Memory this backend holds now: device memory (residuals, staging, samples) and
  // pinned host memory (read-backs), for the INFO report and the cap.
  virtual uint64_t device_bytes() const = 0;
  virtual uint64_t host_bytes() const = 0;
  // Why this backend's device cannot run lgreco's kernels (CUDA: a compute capability the
  // build has no code for), or "". The shim reports it through the configuration
  // exchange, so that every rank passes through instead of failing at the first launch.
  virtual std::string unusable_reason() const { return {}; }
};

// What the configuration exchange (shim.h) needs of a device: a little device and pinned
// host memory, a copy in, a copy back, on the stream the call names. A StreamBackend has
// all of it (BackendExchangeMemory below); DeviceRuntime::exchange_memory makes it alone,
// with nothing of lgreco's own on the device (CUDA: plain cudaMalloc and cudaMallocHost,
// no pool, stream or event), for a rank whose backend cannot be made, so that the rank
// still takes part and reports "cannot compress" instead of leaving its peers waiting.
class ExchangeMemory {
 public:
  using Buffer = collective::Backend::Buffer;
  virtual ~ExchangeMemory() = default;
  virtual void set_stream(nccl::Stream stream) = 0;
  virtual std::unique_ptr<Buffer> allocate(uint64_t bytes) = 0;
  virtual std::unique_ptr<Buffer> allocate_host(uint64_t bytes) = 0;  // what read_back copies into
  virtual void upload(void* dst, const void* host_src, uint64_t bytes) = 0;
  virtual std::unique_ptr<collective::Event> read_back(void* host_dst, const void* src, uint64_t bytes) = 0;
};

// A backend's own operations, as ExchangeMemory; the second form owns its backend.
class BackendExchangeMemory final : public ExchangeMemory {
 public:
  explicit BackendExchangeMemory(StreamBackend& backend) : backend_(backend) {}
  explicit BackendExchangeMemory(std::unique_ptr<StreamBackend> owned) : owned_(std::move(owned)), backend_(*owned_) {}
  void set_stream(nccl::Stream stream) override { backend_.set_stream(stream); }
  std::unique_ptr<Buffer> allocate(uint64_t bytes) override { return backend_.allocate(bytes); }
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override { return backend_.allocate_host(bytes); }
  void upload(void* dst, const void* host_src, uint64_t bytes) override { backend_.upload(dst, host_src, bytes); }
  std::unique_ptr<collective::Event> read_back(void* host_dst, const void* src, uint64_t bytes) override {
    return backend_.read_back(host_dst, src, bytes);
  }

 private:
  std::unique_ptr<StreamBackend> owned_;
  StreamBackend& backend_;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual std::string name() const = 0;

  // Whether work enqueued on `stream` is being captured into a CUDA graph. A query that
  // fails answers true, with *error saying why (the call then passes through).
  virtual bool capturing(nccl::Stream stream, std::string* error) = 0;

  // The backend of one communicator, on CUDA device `device`. Allocations beyond
  // memory_cap bytes in all (device plus pinned host; 0: no cap) throw std::bad_alloc,
  // as a failed allocation does, so that the engine makes every rank pass through.
  // Throws std::runtime_error when the device cannot be used.
  virtual std::unique_ptr<StreamBackend> create_backend(int device, uint64_t memory_cap) = 0;

  // The configuration exchange's memory on `device` without a backend (ExchangeMemory),
  // for when create_backend failed. Throws std::runtime_error when not even that works
  // (the device cannot be made current, or has no memory for a few hundred bytes): NCCL
  // itself cannot run there either.
  virtual std::unique_ptr<ExchangeMemory> exchange_memory(int device) = 0;
};

// The CUDA runtime (plugin/shim/cuda_backend.cu). In a build without CUDA, capturing()
// answers false and create_backend() and exchange_memory() throw.
std::unique_ptr<DeviceRuntime> cuda_runtime();

}  // namespace lgreco::shim
