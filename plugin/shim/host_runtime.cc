#include "plugin/shim/host_runtime.h"

#include <stdexcept>

namespace lgreco::shim {

std::unique_ptr<collective::Backend::Buffer> HostBackend::counted(uint64_t bytes, uint64_t& held) {
  if (cap_ && device_ + host_ + bytes > cap_) throw std::bad_alloc();
  auto buffer = cpu_.allocate(bytes);
  held += bytes;
  return buffer;
}

std::unique_ptr<collective::Backend::Buffer> HostBackend::allocate(uint64_t bytes) { return counted(bytes, device_); }
std::unique_ptr<collective::Backend::Buffer> HostBackend::allocate_host(uint64_t bytes) {
  return counted(bytes, host_);
}

bool HostRuntime::capturing(nccl::Stream stream, std::string*) {
  std::lock_guard<std::mutex> lock(mutex_);
  return capturing_.count(stream) > 0;
}

std::unique_ptr<StreamBackend> HostRuntime::create_backend(int, uint64_t memory_cap) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (unusable_) throw std::runtime_error("the host runtime was told to fail (test)");
  }
  return std::make_unique<HostBackend>(memory_cap);
}

void HostRuntime::set_capturing(nccl::Stream stream, bool capturing) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capturing) capturing_.insert(stream);
  else capturing_.erase(stream);
}

void HostRuntime::set_unusable(bool unusable) {
  std::lock_guard<std::mutex> lock(mutex_);
  unusable_ = unusable;
}

}  // namespace lgreco::shim
