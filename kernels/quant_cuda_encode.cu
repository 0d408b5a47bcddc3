// The quantization codec's encode and decode kernels, one instance per element type
// (quant_cuda_launch.h: why the kernels are split across files).
#include "kernels/quant_cuda_kernels.cuh"

namespace lgreco::quant::cuda::detail {

template void launch_encode<DType::kFloat32>(const JobTable&, const warp::EncodeArgs&, bool, cudaStream_t);
template void launch_encode<DType::kFloat16>(const JobTable&, const warp::EncodeArgs&, bool, cudaStream_t);
template void launch_encode<DType::kBFloat16>(const JobTable&, const warp::EncodeArgs&, bool, cudaStream_t);
template void launch_decode<DType::kFloat32>(const JobTable&, const warp::DecodeArgs&, bool, cudaStream_t);
template void launch_decode<DType::kFloat16>(const JobTable&, const warp::DecodeArgs&, bool, cudaStream_t);
template void launch_decode<DType::kBFloat16>(const JobTable&, const warp::DecodeArgs&, bool, cudaStream_t);

}  // namespace lgreco::quant::cuda::detail
