// lowrank_cuda.h in a build without CUDA (nvcc was not found): available() is false,
// Handle::create throws, and every operation checks its arguments as the CUDA build does
// (the same CodecError messages, lowrank_cuda_plan.cc), then throws CudaError naming why.
// The scratch sizes answer in both builds (lowrank_cuda_plan.cc).
#include <string>

#include "kernels/lowrank_cuda.h"
#include "kernels/lowrank_cuda_plan.h"

namespace lgreco::lowrank::cuda {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw CudaError(std::string("lgreco: powersgd cuda ") + what +
                  ": this build of lgreco has no CUDA kernels (nvcc was not found)");
}
}  // namespace

bool available() { return false; }
std::string cublas_problem() { return "this build of lgreco has no CUDA kernels (nvcc was not found)"; }

Handle Handle::create(void* workspace, uint64_t workspace_bytes) {
  plan::check_workspace(workspace, workspace_bytes, "powersgd cuda Handle::create");
  unavailable("Handle::create");
}

void Handle::reset() {
  cublas_ = nullptr;
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  version_ = 0;
}

void project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* q, float* p,
             const Scratch& scratch, Stream) {
  if (plan::check_project(handle, layers, source, q, p, scratch)) unavailable("project");
}

void orthonormalize(std::span<const Layer> layers, float* p, const Scratch& scratch, Stream) {
  if (plan::check_orthonormalize(layers, p, scratch)) unavailable("orthonormalize");
}

void back_project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* p, float* q,
                  const Scratch& scratch, Stream) {
  if (plan::check_back_project(handle, layers, source, p, q, scratch)) unavailable("back_project");
}

void reconstruct(std::span<const Layer> layers, const float* p, const float* q, float, const Output& out, Stream) {
  if (plan::check_reconstruct(layers, p, q, out)) unavailable("reconstruct");
}

void keep(std::span<const Layer> layers, const float* q_new, const float* q0, float* q, Stream) {
  if (plan::check_keep(layers, q_new, q0, q)) unavailable("keep");
}

void initial_q(std::span<const Layer> layers, uint64_t, uint64_t, uint32_t, float* q0, Stream) {
  if (plan::check_initial_q(layers, q0)) unavailable("initial_q");
}

void squared_errors(Handle& handle, std::span<const Layer> layers, const Source& source, const Measure& m,
                    const Scratch& scratch, Stream) {
  uint32_t max_rank = 0;
  if (plan::check_squared_errors(handle, layers, source, m, scratch, &max_rank)) unavailable("squared_errors");
}

}  // namespace lgreco::lowrank::cuda
