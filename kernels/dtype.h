// Element types a gradient may have, and exact conversions between them and float32.
//
// All codec arithmetic is float32. float16 and bfloat16 inputs are widened exactly;
// outputs are narrowed with round-to-nearest-even, NaN becoming the canonical 0x7FFF that
// CUDA's conversions produce, so host and device give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#include "kernels/hd.h"
#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

namespace lgreco {

// Values are part of the .lgc file format (docs/FORMAT.md): never renumber.
enum class DType : uint32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

LGRECO_HD constexpr size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType t);
std::optional<DType> parse_dtype(std::string_view name);  // "float32", "float16", "bfloat16"
bool is_valid_dtype(uint32_t raw);

LGRECO_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
LGRECO_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

LGRECO_HD float half_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  // The hardware's conversion (exact: every half is a float), with a NaN's payload kept as
  // below whatever the hardware does with it. The bit-level version costs some twenty
  // instructions per element and made nvcc's float16 statistics kernels 5x slower to build.
  if ((h & 0x7fffu) > 0x7c00u)
    return bits_float((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24 is exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return bits_float(sign | float_bits(magnitude));
#endif
}

LGRECO_HD uint16_t float_to_half_rn(float f) {
#ifdef __CUDA_ARCH__
  // The hardware's round-to-nearest-even (cvt.rn.f16.f32: subnormals, overflow to
  // infinity), NaN made canonical as below.
  if ((float_bits(f) & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;                        // NaN: canonical, as CUDA
  if (a >= 0x477ff000u) return sign | 0x7c00u;                // >= 65520 rounds to infinity
  if (a >= 0x38800000u) {                                     // normal half (>= 2^-14)
    const uint32_t rounded = a + 0x0fffu + ((a >> 13) & 1u);  // nearest, ties to even
    return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
  }
  const uint32_t exponent = a >> 23;
  if (exponent < 102) return sign;  // below 2^-25 (or exactly 2^-25 after the tie rule)
  // Half subnormal: units of 2^-24.
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24
  uint32_t result = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
#endif
}

LGRECO_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

LGRECO_HD uint16_t float_to_bf16_rn(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN: canonical, as CUDA
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// v rounded to type t (nearest even) and widened back: what storing it as t keeps.
LGRECO_HD float round_to_dtype(float v, DType t) {
  switch (t) {
    case DType::kFloat16: return half_to_float(float_to_half_rn(v));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16_rn(v));
    default: return v;
  }
}

// Element i of a buffer of type t, widened to float32.
LGRECO_HD float load_as_float(const void* data, DType t, size_t i) {
  switch (t) {
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

// load_as_float with the type known at compile time (the codecs' hot loops).
template <DType T>
LGRECO_HD float load_as_float(const void* data, size_t i) {
  if constexpr (T == DType::kFloat32)
    return static_cast<const float*>(data)[i];
  else if constexpr (T == DType::kFloat16)
    return half_to_float(static_cast<const uint16_t*>(data)[i]);
  else
    return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
}

// Store a float32 into element i of a buffer of type t, rounding to nearest even.
LGRECO_HD void store_from_float(void* data, DType t, size_t i, float value) {
  switch (t) {
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_half_rn(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16_rn(value); break;
    default: static_cast<float*>(data)[i] = value; break;
  }
}

}  // namespace lgreco
