// A checked kernel launch, shared by the .cu files (kernels/quant_cuda.cu,
// plugin/shim/cuda_backend.cu). Needs <cuda_runtime.h>: include it from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/quant_cuda.h"

namespace lgreco::quant::cuda {

// Launches through cudaLaunchKernel and checks what it returns for this launch, rather
// than <<<>>> followed by cudaGetLastError(), which would also report (and clear) an
// earlier error of someone else's call on this thread as ours. Throws CudaError naming
// the kernel (`name`) and the runtime's error.
template <typename... Params>
void launch_kernel(void (*kernel)(Params...), dim3 grid, uint32_t threads, cudaStream_t stream, const char* name,
                   const Params&... params) {
  void* args[] = {const_cast<void*>(static_cast<const void*>(&params))...};
  const cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, dim3(threads), args, 0, stream);
  if (e != cudaSuccess)
    throw CudaError(std::string("lgreco: launching ") + name + " failed: " + cudaGetErrorName(e) + ": " +
                    cudaGetErrorString(e) +
                    " (an earlier fault on this device, e.g. an illegal address, is reported by every later launch)");
}

}  // namespace lgreco::quant::cuda
