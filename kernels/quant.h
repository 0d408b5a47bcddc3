// Max-min bucketed quantization, CPU reference (docs/FORMAT.md defines the payload).
//
// Per bucket of B values: min and unit = (max - min) / (2^bits - 1) as two float32, then
// a bits-wide code per value, stored as bit planes. Encoded sizes depend only on
// (params, count), so collectives know them on the host before any data exists.
//
// These functions are the arithmetic ground truth: the CUDA kernels must reproduce their
// bytes exactly for the same parameters, noise key and input.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"
#include "kernels/slice.h"

namespace lgreco::quant {

constexpr uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

constexpr uint64_t bucket_count(const QuantParams& p, uint64_t count) { return ceil_div(count, p.bucket); }
constexpr uint64_t meta_bytes(const QuantParams& p, uint64_t count) { return 8 * bucket_count(p, count); }
constexpr uint64_t code_bytes(const QuantParams& p, uint64_t count) {
  return 4 * static_cast<uint64_t>(p.bits) * ceil_div(count, 32);
}
constexpr uint64_t encoded_bytes(const QuantParams& p, uint64_t count) {
  return meta_bytes(p, count) + code_bytes(p, count);
}

// Throws CodecError, prefixed with `what`, unless a buffer of `bytes` holds the payload of
// `count` values (and p is valid).
void check_payload(const QuantParams& p, uint64_t bytes, uint64_t count, const char* what);

// The slice's first_element must be a multiple of the bucket size, so that the slice's
// buckets are the layer's buckets.

// Encodes the slice (+ residual, when residual is not null) into out, which must hold
// encoded_bytes(p, count). With a residual, error feedback: the residual becomes
// (input + residual) - decoded for every finite bucket. Throws CodecError on bad sizes.
EncodeReport encode(const QuantParams& p, const NoiseKey& noise, DType dtype, const Slice& input, float* residual,
                    std::span<uint8_t> out);

// Decodes `count` values into out (float32, float16 or bfloat16; rounded to nearest even).
void decode(const QuantParams& p, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out);

// acc[i] += decoded[i], in float32: the building block of a reduction.
void decode_accumulate(const QuantParams& p, std::span<const uint8_t> in, uint64_t count, float* acc);

// Squared L2 compression error of each candidate on x (+ residual), in one read of the
// input per distinct bucket size. For stochastic rounding the value is the expectation
// over the rounding noise, sum over elements of unit^2 * f * (1 - f) with f the fractional
// code position; for round to nearest it is the error of the actual compression. A
// non-finite bucket makes that candidate's result +infinity.
struct ErrorStats {
  // Non-finite buckets seen (the largest count when candidates differ in bucket size).
  uint64_t nonfinite_buckets = 0;
};
ErrorStats squared_errors(std::span<const QuantParams> candidates, DType dtype, const Slice& input,
                          const float* residual, std::span<double> squared_error_out);

}  // namespace lgreco::quant
