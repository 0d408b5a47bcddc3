#include <cuda_runtime_api.h>

#include "kernels/cuda_env.h"

namespace lgreco {

CudaVersions cuda_versions() {
  CudaVersions v;
  v.built_with_cuda = true;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  return v;
}

}  // namespace lgreco
