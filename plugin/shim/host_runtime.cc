#include "plugin/shim/host_runtime.h"

#include <stdexcept>

namespace lgreco::shim {

class HostBackend::CountedBuffer final : public collective::Backend::Buffer {
 public:
  CountedBuffer(std::unique_ptr<Buffer> inner, std::shared_ptr<Held> held, bool device)
      : inner_(std::move(inner)), held_(std::move(held)), device_(device) {}
  ~CountedBuffer() override { (device_ ? held_->device : held_->host) -= inner_->bytes(); }
  void* data() override { return inner_->data(); }
  uint64_t bytes() const override { return inner_->bytes(); }

 private:
  std::unique_ptr<Buffer> inner_;
  std::shared_ptr<Held> held_;
  bool device_;
};

std::unique_ptr<collective::Backend::Buffer> HostBackend::counted(uint64_t bytes, bool device) {
  if (cap_ && held_->device + held_->host + bytes > cap_) throw std::bad_alloc();
  auto buffer = std::make_unique<CountedBuffer>(cpu_.allocate(bytes), held_, device);
  (device ? held_->device : held_->host) += bytes;
  return buffer;
}

std::unique_ptr<collective::Backend::Buffer> HostBackend::allocate(uint64_t bytes) {
  if (allocation_log_) {
    std::lock_guard<std::mutex> lock(allocation_log_->mutex);
    allocation_log_->streams.push_back(stream_);
  }
  return counted(bytes, true);
}
std::unique_ptr<collective::Backend::Buffer> HostBackend::allocate_host(uint64_t bytes) {
  return counted(bytes, false);
}

bool HostRuntime::capturing(nccl::Stream stream, std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capture_query_fails_.count(stream)) {
    if (error) *error = "cudaStreamIsCapturing failed: cudaErrorStreamCaptureImplicit (the host runtime was told to)";
    return true;
  }
  return capturing_.count(stream) > 0;
}

void HostRuntime::set_capture_query_fails(nccl::Stream stream, bool fails) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fails)
    capture_query_fails_.insert(stream);
  else
    capture_query_fails_.erase(stream);
}

namespace {
constexpr char kNoDevice[] = "no device (the host runtime was told so: test)";
}  // namespace

std::unique_ptr<StreamBackend> HostRuntime::create_backend(int, uint64_t memory_cap) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_device_) throw std::runtime_error(kNoDevice);
    if (!backend_failure_.empty()) throw std::runtime_error(backend_failure_);
  }
  return std::make_unique<HostBackend>(memory_cap, allocation_log_);
}

std::unique_ptr<ExchangeMemory> HostRuntime::exchange_memory(int) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++exchange_memories_;
  if (no_device_) throw std::runtime_error(kNoDevice);
  // Host memory through a backend of its own (no cap, no allocation log: not a backend's).
  return std::make_unique<BackendExchangeMemory>(std::make_unique<HostBackend>(0));
}

std::vector<nccl::Stream> HostRuntime::allocation_streams() const {
  std::lock_guard<std::mutex> lock(allocation_log_->mutex);
  return allocation_log_->streams;
}

void HostRuntime::set_capturing(nccl::Stream stream, bool capturing) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capturing) capturing_.insert(stream);
  else capturing_.erase(stream);
}

void HostRuntime::fail_backend(std::string why) {
  std::lock_guard<std::mutex> lock(mutex_);
  backend_failure_ = std::move(why);
}

void HostRuntime::set_no_device(bool no_device) {
  std::lock_guard<std::mutex> lock(mutex_);
  no_device_ = no_device;
}

int HostRuntime::exchange_memories_made() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exchange_memories_;
}

}  // namespace lgreco::shim
