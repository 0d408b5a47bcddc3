// Host/device qualifiers for code shared by the CPU reference and the CUDA kernels.
//
// The quantization arithmetic must give the same bits on both sides, so the per-element
// and per-bucket formulas live in headers compiled by g++ and by nvcc alike. Under nvcc
// they become __host__ __device__ functions; under g++ plain inline functions.
#pragma once

#if defined(__CUDACC__)
#define LGRECO_HD __host__ __device__ __forceinline__
#else
#define LGRECO_HD inline __attribute__((always_inline))
#endif

// Fully unrolls the loop that follows on the device, where register arrays indexed by
// the loop variable must see constant indices (a run-time index moves the array to local
// memory). No effect on the host.
#if defined(__CUDA_ARCH__)
#define LGRECO_UNROLL _Pragma("unroll")
#else
#define LGRECO_UNROLL
#endif
