// quant_cuda.h in a build without CUDA (nvcc was not found): available() is false and
// every kernel entry point throws, naming why. stats_scratch_bytes still answers (it is
// pure host arithmetic).
#include "kernels/quant_batch.h"
#include "kernels/quant_cuda.h"

namespace lgreco::quant::cuda {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw CudaError(std::string("lgreco: ") + what + ": this build of lgreco has no CUDA kernels (nvcc was not found)");
}
}  // namespace

bool available() { return false; }
void encode(const EncodeBatch&, Stream) { unavailable("quant cuda encode"); }
void decode(const DecodeBatch&, Stream) { unavailable("quant cuda decode"); }
void decode_accumulate(const DecodeBatch&, Stream) { unavailable("quant cuda decode_accumulate"); }
uint64_t stats_scratch_bytes(std::span<const Job> jobs, std::span<const CodecSpec> candidates) {
  return stats_scratch_bytes(stats_launches(jobs, candidates, "quant cuda stats_scratch_bytes"));
}
void squared_errors(const StatsBatch&, Stream) { unavailable("quant cuda squared_errors"); }
void encode(const QuantParams&, const NoiseKey&, DType, const Slice&, float*, uint8_t*, uint64_t, Stream,
            unsigned long long*) {
  unavailable("quant cuda encode");
}
void decode(const QuantParams&, const uint8_t*, uint64_t, uint64_t, DType, void*, Stream) {
  unavailable("quant cuda decode");
}
void decode_accumulate(const QuantParams&, const uint8_t*, uint64_t, uint64_t, float*, Stream) {
  unavailable("quant cuda decode_accumulate");
}
void half_to_float(const uint16_t*, float*, uint64_t, Stream) { unavailable("quant cuda half_to_float"); }
void float_to_half_rn(const float*, uint16_t*, uint64_t, Stream) { unavailable("quant cuda float_to_half_rn"); }

}  // namespace lgreco::quant::cuda
