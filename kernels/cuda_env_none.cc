// cuda_env for builds without nvcc.
#include "kernels/cuda_env.h"

namespace lgreco {

CudaVersions cuda_versions() { return CudaVersions{}; }

}  // namespace lgreco
