// The quantization codec's statistics kernels for float16 inputs (quant_cuda_launch.h:
// why the kernels are split across files).
#include "kernels/quant_cuda_kernels.cuh"

namespace lgreco::quant::cuda::detail {

template void launch_stats<DType::kFloat16>(const JobTable&, const warp::StatsArgs&, cudaStream_t);

}  // namespace lgreco::quant::cuda::detail
