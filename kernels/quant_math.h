// The arithmetic of max-min bucketed quantization, shared verbatim by the CPU reference
// (quant_ref.cc) and the CUDA kernels, so that both produce the same bytes.
//
// Rules that keep it reproducible (docs/FORMAT.md, "Arithmetic"):
//  - float32 throughout, each operation rounded to nearest even, no fused multiply-add
//    (g++ builds with -ffp-contract=off; device code spells the rounding out with the
//    __f*_rn intrinsics), no flush of subnormals;
//  - min/max only over finite values: a bucket with a NaN or an infinity is "non-finite"
//    and stored as (NaN, NaN), whatever order min/max met its values in;
//  - -0.0 and +0.0 are made +0.0 before use, so the order of equal values cannot matter.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/hd.h"

namespace lgreco::quant {

// Codes are stored as bit planes of 32 consecutive elements (see docs/FORMAT.md).
constexpr uint32_t kGroupElements = 32;

// The NaN stored in both metadata fields of a non-finite bucket.
constexpr uint32_t kNonFiniteBits = 0x7fc00000u;

// The NaN every element of a non-finite bucket decodes to in float32: CUDA's canonical
// NaN, written explicitly by both implementations, so their bits agree (x86 arithmetic
// would pass the stored NaN's bits through, a GPU would produce its canonical one).
constexpr uint32_t kDecodedNaNBits = 0x7fffffffu;

// A float32 sum, difference or quotient as lgreco stores it: a NaN result becomes
// kDecodedNaNBits. x86 arithmetic passes a NaN operand's bits through (which one, when
// both are NaN, is the compiler's choice of operand order), a GPU writes its canonical
// NaN; every float32 arithmetic result lgreco stores goes through this, so the CPU
// reference and the CUDA kernels agree bit for bit (docs/FORMAT.md).
LGRECO_HD float canonical_nan(float v) { return v == v ? v : bits_float(kDecodedNaNBits); }

struct BucketMeta {
  float min;
  float unit;  // (max - min) / (2^bits - 1); 0 for a constant bucket
};

LGRECO_HD uint32_t max_code(int bits) { return (1u << bits) - 1u; }

LGRECO_HD float f32_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LGRECO_HD float f32_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
LGRECO_HD float f32_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
LGRECO_HD float f32_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// True for every finite float, false for +-inf and NaN (the comparison is false for NaN).
LGRECO_HD bool is_finite_value(float v) { return std::fabs(v) <= 3.40282347e+38f; }

// The stored metadata of a bucket, from the min and max of its values and whether all of
// them were finite. A range that overflows float32 counts as non-finite too.
LGRECO_HD BucketMeta bucket_meta(float min_value, float max_value, bool all_finite, int bits) {
  const float nan = bits_float(kNonFiniteBits);
  if (!all_finite) return BucketMeta{nan, nan};
  const float lo = f32_add(min_value, 0.0f);  // -0.0 -> +0.0
  const float hi = f32_add(max_value, 0.0f);
  const float unit = f32_div(f32_sub(hi, lo), static_cast<float>(max_code(bits)));
  if (!is_finite_value(unit)) return BucketMeta{nan, nan};
  return BucketMeta{lo, unit};
}

// False for a bucket stored as non-finite (and for any corrupt metadata that is not
// finite): all its elements decode to kDecodedNaNBits.
LGRECO_HD bool is_finite_bucket(const BucketMeta& m) { return is_finite_value(m.min) && is_finite_value(m.unit); }

// Where v lies on the code scale of a bucket with unit > 0: in [0, top_code] up to rounding.
LGRECO_HD float code_position(float v, const BucketMeta& m) { return f32_div(f32_sub(v, m.min), m.unit); }

// The code of value v in a bucket with unit > 0 (a constant bucket, unit 0, has only code
// 0). `threshold` is the rounding noise: a uniform value in [0, 1) for stochastic rounding
// (rounds up with probability equal to the fractional position), 0.5 for round to nearest
// (ties round down).
LGRECO_HD uint32_t quantize_ranged(float v, const BucketMeta& m, uint32_t top_code, float threshold) {
  const float position = code_position(v, m);
  const float whole = floorf(position);
  const float frac = f32_sub(position, whole);  // exact
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(whole)) + (frac > threshold ? 1u : 0u);
  return code < top_code ? code : top_code;
}

// min + code x unit, rounded twice (no FMA). `code` is a whole number as a float.
LGRECO_HD float dequantize_value(float code, float min, float unit) { return f32_add(min, f32_mul(code, unit)); }

LGRECO_HD float dequantize(uint32_t code, const BucketMeta& m) {
  return dequantize_value(static_cast<float>(code), m.min, m.unit);
}

// Rounding threshold for round-to-nearest.
constexpr float kNearestThreshold = 0.5f;

}  // namespace lgreco::quant
