// The quantization codec's statistics kernels for bfloat16 inputs (quant_cuda_launch.h:
// why the kernels are split across files).
#include "kernels/quant_cuda_kernels.cuh"

namespace lgreco::quant::cuda::detail {

template void launch_stats<DType::kBFloat16>(const JobTable&, const warp::StatsArgs&, cudaStream_t);

}  // namespace lgreco::quant::cuda::detail
