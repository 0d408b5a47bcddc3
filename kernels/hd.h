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
