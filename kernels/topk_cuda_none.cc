// topk_cuda.h in a build without CUDA (nvcc was not found): available() is false and
// every kernel entry point throws, naming why. The scratch sizes still answer (they are
// host arithmetic, in topk_cuda_plan.cc).
#include <string>

#include "kernels/topk_cuda.h"

namespace lgreco::topk::cuda {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw CudaError(std::string("lgreco: ") + what + ": this build of lgreco has no CUDA kernels (nvcc was not found)");
}
}  // namespace

bool available() { return false; }
void encode(const EncodeBatch&, Stream) { unavailable("topk cuda encode"); }
void decode(const DecodeBatch&, Stream) { unavailable("topk cuda decode"); }
void decode_accumulate(const DecodeBatch&, Stream) { unavailable("topk cuda decode_accumulate"); }
void squared_errors(const StatsBatch&, Stream) { unavailable("topk cuda squared_errors"); }

}  // namespace lgreco::topk::cuda
