// CUDA kernels of the TopK codec (topk_cuda.h): the kernels and their launch order are in
// topk_kernels.cuh (shared with the CPU-side emulation tests); this file launches them on
// the caller's stream. docs/KERNELS.md ("TopK") describes the passes.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda_launch.h"
#include "kernels/topk_cuda.h"
#include "kernels/topk_cuda_plan.h"
#include "kernels/topk_kernels.cuh"

namespace lgreco::topk::cuda {
namespace {

// Launches on one stream of the current device.
class CudaLauncher {
 public:
  explicit CudaLauncher(Stream s) : stream_(reinterpret_cast<cudaStream_t>(s)) {}

  // min(tiles, kBlocksPerSm x multiprocessors): the sizes and the device decide, not the data.
  uint32_t full_grid(uint32_t tiles) {
    if (sms_ == 0) {
      int device = 0;
      cudaError_t e = cudaGetDevice(&device);
      if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device);
      if (e != cudaSuccess || sms_ <= 0)
        throw CudaError(std::string("lgreco: topk cuda: querying the device's multiprocessors failed: ") +
                        cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
    }
    return std::max<uint32_t>(1, std::min<uint32_t>(tiles, static_cast<uint32_t>(sms_) * kernels::kBlocksPerSm));
  }

  void zero(void* p, uint64_t bytes) const {
    if (bytes == 0) return;
    const cudaError_t e = cudaMemsetAsync(p, 0, bytes, stream_);
    if (e != cudaSuccess)
      throw CudaError(std::string("lgreco: topk cuda: clearing the scratch failed: ") + cudaGetErrorName(e) + ": " +
                      cudaGetErrorString(e));
  }

  template <typename... Params>
  void launch(void (*kernel)(Params...), uint32_t grid, const char* name, const Params&... params) const {
    quant::cuda::launch_kernel(kernel, dim3(grid), kernels::kThreads, stream_, name, params...);
  }

 private:
  cudaStream_t stream_;
  int sms_ = 0;
};

}  // namespace

// encode_scratch_bytes and stats_scratch_bytes are host arithmetic: topk_cuda_plan.cc.

bool available() { return true; }

void encode(const EncodeBatch& batch, Stream stream) {
  CudaLauncher l(stream);
  kernels::run_encode(l, batch);
}

void decode(const DecodeBatch& batch, Stream stream) {
  CudaLauncher l(stream);
  kernels::run_decode(l, batch, false);
}

void decode_accumulate(const DecodeBatch& batch, Stream stream) {
  CudaLauncher l(stream);
  kernels::run_decode(l, batch, true);
}

void squared_errors(const StatsBatch& batch, Stream stream) {
  CudaLauncher l(stream);
  kernels::run_squared_errors(l, batch);
}

}  // namespace lgreco::topk::cuda
