// CPU reference of the quantization codec. Layout and arithmetic: docs/FORMAT.md and
// quant_math.h. The loops are written so that g++ vectorizes them (fixed-width lane
// arrays for the min/max reduction, Philox blocks eight at a time) and are compiled for
// baseline x86-64 and AVX2 (cpu_dispatch.h); both give the same bytes.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu_dispatch.h"
#include "kernels/quant.h"
#include "kernels/quant_math.h"

namespace lgreco::quant {
namespace {

constexpr int kLanes = 8;  // width of the explicit min/max lanes (one AVX2 vector)
constexpr uint32_t kGroup = kGroupElements;

// The value that is compressed: the input, plus the error-feedback residual if any.
// Without a residual the input is used as is (no "+ 0.0f", which would turn -0 into +0).
template <DType T, bool kResidual>
LGRECO_CLONE_INLINE float corrected(const void* x, const float* residual, uint64_t i) {
  const float v = load_as_float<T>(x, i);
  if constexpr (kResidual) return v + residual[i];
  return v;
}

struct Range {
  float min;
  float max;
  bool finite;
};

// Min and max of the finite values of elements [begin, begin + n), and whether all are
// finite. NaN compares false, so it never becomes min or max; the `finite` flag catches it.
template <DType T, bool kResidual>
LGRECO_CLONE_INLINE Range bucket_range(const void* x, const float* residual, uint64_t begin, uint64_t n) {
  std::array<float, kLanes> lo, hi;
  std::array<uint32_t, kLanes> bad{};
  lo.fill(std::numeric_limits<float>::infinity());
  hi.fill(-std::numeric_limits<float>::infinity());
  uint64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = corrected<T, kResidual>(x, residual, begin + i + l);
      lo[l] = v < lo[l] ? v : lo[l];
      hi[l] = v > hi[l] ? v : hi[l];
      bad[l] |= is_finite_value(v) ? 0u : 1u;
    }
  }
  for (; i < n; ++i) {
    const float v = corrected<T, kResidual>(x, residual, begin + i);
    lo[0] = v < lo[0] ? v : lo[0];
    hi[0] = v > hi[0] ? v : hi[0];
    bad[0] |= is_finite_value(v) ? 0u : 1u;
  }
  Range r{lo[0], hi[0], bad[0] == 0};
  for (int l = 1; l < kLanes; ++l) {
    r.min = lo[l] < r.min ? lo[l] : r.min;
    r.max = hi[l] > r.max ? hi[l] : r.max;
    r.finite = r.finite && bad[l] == 0;
  }
  return r;
}

// Rounding thresholds of the 32 elements of the group starting at layer element
// `group_first` (a multiple of 32): eight Philox blocks, four words each.
LGRECO_CLONE_INLINE void group_thresholds(const NoiseKey& noise, uint64_t group_first, float* threshold) {
  const uint64_t block0 = group_first / 4;
  for (int j = 0; j < 8; ++j) {
    const PhiloxBlock b = noise_block(noise, block0 + j);
    for (int w = 0; w < 4; ++w) threshold[4 * j + w] = uniform24(b.v[w]);
  }
}

// Bit planes: word j of a group holds bit j of each of its 32 codes, element l at bit l.
// Packing gathers bit j of eight one-byte codes into a byte with one multiply: after
// masking, byte k of m is bit j of code k; the product with 0x0102040810204080 moves
// byte k's bit to bit 56 + k with no carries (each (byte, multiplier byte) pair lands on
// a distinct bit position).
LGRECO_CLONE_INLINE void pack_planes(const uint8_t* codes, int bits, uint32_t* words) {
  uint64_t eight[4];
  memcpy(eight, codes, sizeof eight);
  for (int j = 0; j < bits; ++j) {
    uint32_t word = 0;
    for (int q = 0; q < 4; ++q) {
      const uint64_t m = (eight[q] >> j) & 0x0101010101010101ull;
      word |= static_cast<uint32_t>((m * 0x0102040810204080ull) >> 56) << (8 * q);
    }
    words[j] = word;
  }
}

// spread[b]: byte k is bit k of b. Used to rebuild codes from bit planes.
struct SpreadTable {
  uint64_t spread[256];
  constexpr SpreadTable() : spread{} {
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < 8; ++k)
        if (b & (1 << k)) spread[b] |= uint64_t{1} << (8 * k);
  }
};
constexpr SpreadTable kSpread;

LGRECO_CLONE_INLINE void unpack_planes(const uint32_t* words, int bits, uint8_t* codes) {
  uint64_t eight[4] = {0, 0, 0, 0};
  for (int j = 0; j < bits; ++j) {
    const uint32_t word = words[j];
    for (int q = 0; q < 4; ++q) eight[q] |= kSpread.spread[(word >> (8 * q)) & 0xffu] << j;
  }
  memcpy(codes, eight, sizeof eight);
}

void check_input(const QuantParams& p, const Slice& in, const char* what) {
  p.validate();
  if (in.count > 0 && in.data == nullptr) throw CodecError(std::string(what) + ": input is null");
  if (in.first_element % p.bucket != 0)
    throw CodecError(std::string(what) + ": first element " + std::to_string(in.first_element) +
                     " is not on a bucket boundary (bucket=" + std::to_string(p.bucket) + ")");
  if (in.first_element + in.count > kMaxLayerElements)
    throw CodecError(std::string(what) + ": a layer may hold at most 2^34 elements");
}

// ---------------------------------------------------------------------------------------
// Encode

// Codes of one group of `lanes` (<= 32) elements starting at element `first`; padding
// lanes get code 0. With a residual, error feedback for each element.
template <DType T, bool kResidual, bool kRanged>
LGRECO_CLONE_INLINE void quantize_group(const void* x, float* residual, uint64_t first, uint32_t lanes,
                                        const BucketMeta& meta, uint32_t top, const float* threshold, uint8_t* codes) {
  const auto element = [&](uint32_t l) {
    const float v = corrected<T, kResidual>(x, residual, first + l);
    const uint32_t code = kRanged ? quantize_ranged(v, meta, top, threshold[l]) : 0u;
    codes[l] = static_cast<uint8_t>(code);
    if constexpr (kResidual) residual[first + l] = v - dequantize(code, meta);
  };
  if (lanes == kGroup) {  // a fixed trip count the compiler vectorizes
    for (uint32_t l = 0; l < kGroup; ++l) element(l);
  } else {  // the last group of the input
    for (uint32_t l = 0; l < lanes; ++l) element(l);
    std::fill(codes + lanes, codes + kGroup, uint8_t{0});
  }
}

template <DType T, bool kResidual>
LGRECO_CLONE_INLINE uint64_t encode_loop(const QuantParams& p, const NoiseKey& noise, const Slice& in, float* residual,
                                         uint8_t* out) {
  const uint64_t count = in.count;
  const uint32_t top = max_code(p.bits);
  const bool stochastic = p.rounding == Rounding::kStochastic;
  auto* meta_out = out;
  auto* words_out = out + meta_bytes(p, count);
  uint64_t nonfinite = 0;
  alignas(32) float threshold[kGroup];
  alignas(32) uint8_t codes[kGroup];
  if (!stochastic) std::fill(threshold, threshold + kGroup, kNearestThreshold);

  for (uint64_t begin = 0, b = 0; begin < count; begin += p.bucket, ++b) {
    const uint64_t n = std::min<uint64_t>(p.bucket, count - begin);
    const Range range = bucket_range<T, kResidual>(in.data, residual, begin, n);
    const BucketMeta meta = bucket_meta(range.min, range.max, range.finite, p.bits);
    memcpy(meta_out + 8 * b, &meta.min, 4);
    memcpy(meta_out + 8 * b + 4, &meta.unit, 4);

    const uint64_t groups = ceil_div(n, kGroup);
    uint8_t* words = words_out + 4 * p.bits * (begin / kGroup);
    if (!is_finite_bucket(meta)) {
      ++nonfinite;  // codes all zero; the residual keeps its value
      memset(words, 0, 4 * p.bits * groups);
      continue;
    }
    const bool ranged = meta.unit > 0.0f;  // else a constant bucket: every code is 0
    for (uint64_t g = 0; g < groups; ++g) {
      const uint64_t first = begin + g * kGroup;
      const uint32_t lanes = static_cast<uint32_t>(std::min<uint64_t>(kGroup, count - first));
      if (stochastic && ranged) group_thresholds(noise, in.first_element + first, threshold);
      if (ranged)
        quantize_group<T, kResidual, true>(in.data, residual, first, lanes, meta, top, threshold, codes);
      else
        quantize_group<T, kResidual, false>(in.data, residual, first, lanes, meta, top, threshold, codes);
      uint32_t planes[QuantParams::kMaxBits];
      pack_planes(codes, p.bits, planes);
      memcpy(words + 4 * p.bits * g, planes, 4 * p.bits);  // little-endian host
    }
  }
  return nonfinite;
}

template <DType T>
LGRECO_MULTIVERSION uint64_t encode_typed(const QuantParams& p, const NoiseKey& noise, const Slice& in, float* residual,
                                          uint8_t* out) {
  return residual ? encode_loop<T, true>(p, noise, in, residual, out)
                  : encode_loop<T, false>(p, noise, in, residual, out);
}

// ---------------------------------------------------------------------------------------
// Decode

LGRECO_CLONE_INLINE BucketMeta read_meta(const uint8_t* in, uint64_t b) {
  BucketMeta m;
  memcpy(&m.min, in + 8 * b, 4);
  memcpy(&m.unit, in + 8 * b + 4, 4);
  return m;
}

// Calls sink(element index, decoded value) for every element of a finite bucket and
// sink_nan(begin, end) for the elements of each non-finite bucket.
template <typename Sink, typename NanSink>
LGRECO_CLONE_INLINE void decode_loop(const QuantParams& p, const uint8_t* in, uint64_t count, Sink&& sink,
                                     NanSink&& sink_nan) {
  const uint8_t* words_in = in + meta_bytes(p, count);
  alignas(32) uint8_t codes[kGroup];
  uint32_t planes[QuantParams::kMaxBits];
  for (uint64_t begin = 0, b = 0; begin < count; begin += p.bucket, ++b) {
    const BucketMeta meta = read_meta(in, b);
    const uint64_t end = std::min<uint64_t>(begin + p.bucket, count);
    if (!is_finite_bucket(meta)) {
      sink_nan(begin, end);
      continue;
    }
    for (uint64_t first = begin; first < end; first += kGroup) {
      memcpy(planes, words_in + 4 * p.bits * (first / kGroup), 4 * p.bits);
      unpack_planes(planes, p.bits, codes);
      const uint32_t lanes = static_cast<uint32_t>(std::min<uint64_t>(kGroup, end - first));
      if (lanes == kGroup) {
        for (uint32_t l = 0; l < kGroup; ++l) sink(first + l, dequantize(codes[l], meta));
      } else {
        for (uint32_t l = 0; l < lanes; ++l) sink(first + l, dequantize(codes[l], meta));
      }
    }
  }
}

const float kDecodedNaN = bits_float(kDecodedNaNBits);

LGRECO_MULTIVERSION void decode_f32(const QuantParams& p, const uint8_t* in, uint64_t count, float* out) {
  decode_loop(
      p, in, count, [out](uint64_t i, float y) { out[i] = y; },
      [out](uint64_t begin, uint64_t end) { std::fill(out + begin, out + end, kDecodedNaN); });
}

void decode_narrow(const QuantParams& p, const uint8_t* in, uint64_t count, DType t, void* out) {
  decode_loop(
      p, in, count, [out, t](uint64_t i, float y) { store_from_float(out, t, i, y); },
      [out, t](uint64_t begin, uint64_t end) {
        for (uint64_t i = begin; i < end; ++i) store_from_float(out, t, i, kDecodedNaN);
      });
}

// A non-finite bucket replaces the sum by the canonical NaN rather than adding it, and a
// NaN sum (an accumulator that already held a NaN) is written as that NaN too: x86 would
// keep the accumulator's NaN payload, a GPU gives its canonical NaN, and the bits must not
// depend on where the sum was taken.
LGRECO_MULTIVERSION void decode_accumulate_f32(const QuantParams& p, const uint8_t* in, uint64_t count, float* acc) {
  decode_loop(
      p, in, count,
      [acc](uint64_t i, float y) {
        const float sum = acc[i] + y;
        acc[i] = sum == sum ? sum : kDecodedNaN;
      },
      [acc](uint64_t begin, uint64_t end) { std::fill(acc + begin, acc + end, kDecodedNaN); });
}

// ---------------------------------------------------------------------------------------
// Error statistics

// Squared error of one candidate over one bucket whose corrected values are v[0..n).
// Scaling by unit^2 and the squares of nearest rounding's errors are in float64: with a
// range near float32's limit, unit^2 (or a sum of d^2) would overflow float32 and turn a
// finite error into +inf, or 0 x inf into NaN.
LGRECO_CLONE_INLINE double bucket_squared_error(const float* v, uint64_t n, const BucketMeta& meta,
                                                const QuantParams& c) {
  const uint32_t top = max_code(c.bits);
  if (meta.unit == 0.0f) {  // constant bucket (or a range below float32's resolution): code 0
    float acc[kLanes] = {};
    for (uint64_t i = 0; i < n; ++i) {
      const float d = v[i] - meta.min;
      acc[i % kLanes] += d * d;
    }
    float total = 0.0f;
    for (float a : acc) total += a;
    return total;
  }
  if (c.rounding == Rounding::kStochastic) {
    // E[(v - decoded)^2] = unit^2 * f * (1 - f) for a value f of the way between two codes.
    float acc[kLanes] = {};
    uint64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float position = code_position(v[i + l], meta);
        const float f = position - std::floor(position);
        acc[l] += f * (1.0f - f);
      }
    }
    for (; i < n; ++i) {
      const float position = code_position(v[i], meta);
      const float f = position - std::floor(position);
      acc[0] += f * (1.0f - f);
    }
    float total = 0.0f;
    for (float a : acc) total += a;
    return static_cast<double>(total) * meta.unit * meta.unit;
  }
  double acc[kLanes] = {};
  uint64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double d = v[i + l] - dequantize(quantize_ranged(v[i + l], meta, top, kNearestThreshold), meta);
      acc[l] += d * d;
    }
  }
  for (; i < n; ++i) {
    const double d = v[i] - dequantize(quantize_ranged(v[i], meta, top, kNearestThreshold), meta);
    acc[0] += d * d;
  }
  double total = 0.0;
  for (double a : acc) total += a;
  return total;
}

// One sweep over the input for all candidates sharing bucket size `bucket`.
template <DType T, bool kResidual>
LGRECO_CLONE_INLINE uint64_t stats_sweep(uint32_t bucket, std::span<const QuantParams> candidates,
                                         std::span<const size_t> members, const Slice& in, const float* residual,
                                         std::vector<float>& values, std::span<double> squared_error) {
  uint64_t nonfinite = 0;
  for (uint64_t begin = 0; begin < in.count; begin += bucket) {
    const uint64_t n = std::min<uint64_t>(bucket, in.count - begin);
    const Range range = bucket_range<T, kResidual>(in.data, residual, begin, n);
    if (!range.finite || !is_finite_value(range.max - range.min)) {  // a NaN, an inf, or overflow
      ++nonfinite;
      for (size_t m : members) squared_error[m] = std::numeric_limits<double>::infinity();
      continue;
    }
    for (uint64_t i = 0; i < n; ++i) values[i] = corrected<T, kResidual>(in.data, residual, begin + i);
    for (size_t m : members) {
      const BucketMeta meta = bucket_meta(range.min, range.max, true, candidates[m].bits);
      squared_error[m] += bucket_squared_error(values.data(), n, meta, candidates[m]);
    }
  }
  return nonfinite;
}

template <DType T>
LGRECO_MULTIVERSION uint64_t stats_typed(uint32_t bucket, std::span<const QuantParams> candidates,
                                         std::span<const size_t> members, const Slice& in, const float* residual,
                                         std::vector<float>& values, std::span<double> squared_error) {
  return residual ? stats_sweep<T, true>(bucket, candidates, members, in, residual, values, squared_error)
                  : stats_sweep<T, false>(bucket, candidates, members, in, residual, values, squared_error);
}

}  // namespace

void check_payload(const QuantParams& p, uint64_t bytes, uint64_t count, const char* what) {
  p.validate();
  const uint64_t need = encoded_bytes(p, count);
  if (bytes < need)
    throw CodecError(std::string(what) + ": buffer of " + std::to_string(bytes) + " bytes is too small for " +
                     std::to_string(count) + " values with bits=" + std::to_string(p.bits) +
                     ", bucket=" + std::to_string(p.bucket) + " (needs " + std::to_string(need) + ")");
}


EncodeReport encode(const QuantParams& p, const NoiseKey& noise, DType dtype, const Slice& in, float* residual,
                    std::span<uint8_t> out) {
  check_input(p, in, "quant encode");
  check_payload(p, out.size(), in.count, "quant encode");
  EncodeReport report;
  switch (dtype) {
    case DType::kFloat32:
      report.nonfinite_buckets = encode_typed<DType::kFloat32>(p, noise, in, residual, out.data());
      break;
    case DType::kFloat16:
      report.nonfinite_buckets = encode_typed<DType::kFloat16>(p, noise, in, residual, out.data());
      break;
    case DType::kBFloat16:
      report.nonfinite_buckets = encode_typed<DType::kBFloat16>(p, noise, in, residual, out.data());
      break;
  }
  return report;
}

void decode(const QuantParams& p, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) {
  check_payload(p, in.size(), count, "quant decode");
  if (out_dtype == DType::kFloat32)
    decode_f32(p, in.data(), count, static_cast<float*>(out));
  else
    decode_narrow(p, in.data(), count, out_dtype, out);
}

void decode_accumulate(const QuantParams& p, std::span<const uint8_t> in, uint64_t count, float* acc) {
  check_payload(p, in.size(), count, "quant decode_accumulate");
  decode_accumulate_f32(p, in.data(), count, acc);
}

ErrorStats squared_errors(std::span<const QuantParams> candidates, DType dtype, const Slice& in, const float* residual,
                          std::span<double> squared_error) {
  if (squared_error.size() != candidates.size())
    throw CodecError("quant squared_errors: " + std::to_string(squared_error.size()) + " outputs for " +
                     std::to_string(candidates.size()) + " candidates");
  for (const QuantParams& c : candidates) check_input(c, in, "quant squared_errors");
  std::fill(squared_error.begin(), squared_error.end(), 0.0);

  // Candidates with the same bucket size share min/max, so one sweep serves them all.
  std::vector<uint32_t> buckets;
  for (const QuantParams& c : candidates) buckets.push_back(c.bucket);
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());

  ErrorStats stats;
  std::vector<float> values;
  std::vector<size_t> members;
  for (uint32_t bucket : buckets) {
    members.clear();
    for (size_t m = 0; m < candidates.size(); ++m)
      if (candidates[m].bucket == bucket) members.push_back(m);
    values.resize(bucket);
    uint64_t nonfinite = 0;
    switch (dtype) {
      case DType::kFloat32:
        nonfinite = stats_typed<DType::kFloat32>(bucket, candidates, members, in, residual, values, squared_error);
        break;
      case DType::kFloat16:
        nonfinite = stats_typed<DType::kFloat16>(bucket, candidates, members, in, residual, values, squared_error);
        break;
      case DType::kBFloat16:
        nonfinite = stats_typed<DType::kBFloat16>(bucket, candidates, members, in, residual, values, squared_error);
        break;
    }
    stats.nonfinite_buckets = std::max(stats.nonfinite_buckets, nonfinite);
  }
  return stats;
}

}  // namespace lgreco::quant
