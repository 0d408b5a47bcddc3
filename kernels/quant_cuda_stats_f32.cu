// The quantization codec's statistics kernels for float32 inputs (quant_cuda_launch.h:
// why the kernels are split across files).
#include "kernels/quant_cuda_kernels.cuh"

namespace lgreco::quant::cuda::detail {

template void launch_stats<DType::kFloat32>(const JobTable&, const warp::StatsArgs&, cudaStream_t);

}  // namespace lgreco::quant::cuda::detail
