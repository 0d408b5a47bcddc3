// cuda_runtime() in a build without CUDA (nvcc was not found): nothing is ever captured,
// and there is no backend or exchange memory to create (plugin/shim/cuda_backend.cu is the real one).
#include <memory>
#include <stdexcept>
#include <string>

#include "plugin/shim/device_runtime.h"

namespace lgreco::shim {
namespace {

class NoCudaRuntime final : public DeviceRuntime {
 public:
  std::string name() const override { return "cuda (not built)"; }
  bool capturing(nccl::Stream, std::string*) override { return false; }
  std::unique_ptr<StreamBackend> create_backend(int, uint64_t) override {
    throw std::runtime_error("lgreco was built without CUDA");
  }
  std::unique_ptr<ExchangeMemory> exchange_memory(int) override {
    throw std::runtime_error("lgreco was built without CUDA");
  }
};

}  // namespace

std::unique_ptr<DeviceRuntime> cuda_runtime() { return std::make_unique<NoCudaRuntime>(); }

}  // namespace lgreco::shim
