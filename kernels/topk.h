// TopK sparsification, CPU reference (docs/FORMAT.md defines the payload).
//
// A slice of n values keeps the k = ceil(density x n) of largest magnitude: k u32 indices
// in increasing order, then their k values as f32. The size depends only on (density, n),
// so collectives know it on the host. Which values are kept is fixed by one total order,
// magnitude first (a NaN above an infinity above every finite value), then the lower
// index: every implementation (this one, the CUDA kernels) keeps the same set and writes
// the same bytes.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/hd.h"
#include "kernels/slice.h"

namespace lgreco::topk {

constexpr uint64_t encoded_bytes(const TopkParams& p, uint64_t count) { return 8 * p.k(count); }

// The selection key of a value: its magnitude's float32 bits, with every NaN mapped to
// one key above +infinity's. Larger key = kept first; equal keys go by the lower index.
constexpr uint32_t kNaNKey = 0x7FC00000u;
LGRECO_HD uint32_t magnitude_key(float v) {
  const uint32_t bits = float_bits(v) & 0x7FFFFFFFu;
  return bits > 0x7F800000u ? kNaNKey : bits;
}

// Encodes the slice (+ residual, when not null) into out (at least encoded_bytes). The sent
// value is x = input + residual in float32, exactly; with a residual, error feedback: a
// finite x that is kept leaves residual 0, one that is not leaves residual x, and a
// non-finite x leaves the residual unchanged (counted in nonfinite_buckets, one per value).
// Throws CodecError on a short buffer or a slice too long for u32 indices.
EncodeReport encode(const TopkParams& p, DType dtype, const Slice& input, float* residual, std::span<uint8_t> out);

// Writes the `count` values into out (zeros where nothing was kept), in out_dtype.
// Throws CodecError naming the position of an index that is out of order or >= count.
void decode(const TopkParams& p, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out);

// acc[index] += value for each kept value (float32; a NaN sum is written canonically).
void decode_accumulate(const TopkParams& p, std::span<const uint8_t> in, uint64_t count, float* acc);

// The squared error ||x - C(x)||^2 of each candidate on x = input + residual: the sum of
// the squares of the values it does not keep. One partial sort serves every density.
// Returns the count of non-finite values (then every error is +infinity).
uint64_t squared_errors(std::span<const TopkParams> candidates, DType dtype, const Slice& input, const float* residual,
                        std::span<double> squared_error_out);

}  // namespace lgreco::topk
