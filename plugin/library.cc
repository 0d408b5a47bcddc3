// What happens when liblgreco.so is loaded into a process: one VERSION line saying which
// lgreco, which NCCL and which CUDA it finds. Nothing here may create a CUDA context or
// load NCCL: the framework decides when those happen.
#include "config/log.h"
#include "config/version.h"
#include "kernels/cuda_env.h"
#include "plugin/shim/nccl_locator.h"

namespace lgreco {
namespace {

void log_versions() {
  if (!log::enabled(log::Level::kVersion)) return;
  const auto nccl = shim::find_loaded_nccl();
  const std::string nccl_text = nccl ? "NCCL " + shim::nccl_version_name(nccl->version_code) + " at " + nccl->path
                                     : std::string("NCCL not loaded yet");
  const CudaVersions cuda = cuda_versions();
  if (cuda.built_with_cuda)
    LGRECO_VERSION_LOG("INIT", "lgreco %s; %s; built against nccl.h %s; CUDA runtime %d (static), driver supports %d",
                       version_string(), nccl_text.c_str(), shim::nccl_version_name(nccl_header_version_code()).c_str(),
                       cuda.runtime, cuda.driver);
  else
    LGRECO_VERSION_LOG("INIT", "lgreco %s; %s; built without CUDA", version_string(), nccl_text.c_str());
}

__attribute__((constructor)) void on_library_load() { log_versions(); }

}  // namespace
}  // namespace lgreco

// For programs and scripts that want to know which lgreco they loaded.
extern "C" __attribute__((visibility("default"))) const char* lgreco_version() { return lgreco::version_string(); }
