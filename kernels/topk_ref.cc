#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/quant_math.h"
#include "kernels/topk.h"

namespace lgreco::topk {
namespace {

void check_buffer(uint64_t have, uint64_t need, const char* what) {
  if (have < need)
    throw CodecError(std::string(what) + ": buffer of " + std::to_string(have) + " bytes, needs " +
                     std::to_string(need));
}

void check_count(uint64_t count, const char* what) {
  if (count > std::numeric_limits<uint32_t>::max())
    throw CodecError(std::string(what) + ": " + std::to_string(count) +
                     " values; topk indexes a slice with u32, so at most 4294967295");
}

// x = input (+ residual) in float32, NaNs canonical: what is sent and what is measured.
std::vector<float> values_of(DType dtype, const Slice& input, const float* residual) {
  std::vector<float> x(input.count);
  for (uint64_t i = 0; i < input.count; ++i) {
    const float v = load_as_float(input.data, dtype, i);
    x[i] = quant::canonical_nan(residual ? v + residual[i] : v);
  }
  return x;
}

// The k-th largest key of x: a radix selection, 16 bits at a time (a histogram of the
// high halves finds the bin that holds it, a histogram of that bin's low halves the key),
// two reads of x instead of a sort. Also returns how many keys lie above it.
uint32_t kth_largest_key(const std::vector<float>& x, uint64_t k, uint64_t* above) {
  std::vector<uint64_t> histogram(1 << 16);
  for (float v : x) ++histogram[magnitude_key(v) >> 16];
  uint64_t seen = 0;
  uint32_t high = 0xFFFF;
  for (;; --high) {
    if (seen + histogram[high] >= k) break;
    seen += histogram[high];
  }
  std::fill(histogram.begin(), histogram.end(), 0);
  for (float v : x) {
    const uint32_t key = magnitude_key(v);
    if ((key >> 16) == high) ++histogram[key & 0xFFFF];
  }
  uint32_t low = 0xFFFF;
  for (;; --low) {
    if (seen + histogram[low] >= k) break;
    seen += histogram[low];
  }
  *above = seen;
  return high << 16 | low;
}

// The indices of the k largest keys, lower index first among equal keys, in increasing
// order: everything above the k-th largest key, and the first of those equal to it.
std::vector<uint32_t> select(const std::vector<float>& x, uint64_t k) {
  std::vector<uint32_t> kept;
  if (k == 0) return kept;
  kept.reserve(k);
  if (k >= x.size()) {
    for (uint64_t i = 0; i < x.size(); ++i) kept.push_back(static_cast<uint32_t>(i));
    return kept;
  }
  uint64_t above = 0;
  const uint32_t threshold = kth_largest_key(x, k, &above);
  uint64_t equal_left = k - above;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if (key > threshold || (key == threshold && equal_left > 0 && equal_left--)) kept.push_back(static_cast<uint32_t>(i));
  }
  return kept;
}

// Checks the payload's indices: strictly increasing, each below count.
void check_indices(const uint32_t* index, uint64_t k, uint64_t count, const char* what) {
  for (uint64_t j = 0; j < k; ++j)
    if (index[j] >= count || (j > 0 && index[j] <= index[j - 1]))
      throw CodecError(std::string(what) + ": index " + std::to_string(index[j]) + " at position " +
                       std::to_string(j) + " is " + (index[j] >= count ? "not below the count " + std::to_string(count)
                                                                       : "not above the one before it"));
}

}  // namespace

EncodeReport encode(const TopkParams& p, DType dtype, const Slice& input, float* residual, std::span<uint8_t> out) {
  p.validate();
  check_count(input.count, "topk encode");
  const uint64_t k = p.k(input.count);
  check_buffer(out.size(), encoded_bytes(p, input.count), "topk encode");
  const std::vector<float> x = values_of(dtype, input, residual);
  const std::vector<uint32_t> kept = select(x, k);
  // Byte copies: the payload need not be aligned.
  uint8_t* index_out = out.data();
  uint8_t* value_out = out.data() + 4 * k;
  for (uint64_t j = 0; j < k; ++j) {
    memcpy(index_out + 4 * j, &kept[j], 4);
    memcpy(value_out + 4 * j, &x[kept[j]], 4);
  }
  EncodeReport report;
  size_t next = 0;
  for (uint64_t i = 0; i < x.size(); ++i) {
    const bool is_kept = next < kept.size() && kept[next] == i;
    next += is_kept;
    if (!quant::is_finite_value(x[i])) {
      ++report.nonfinite_buckets;
      continue;
    }
    if (residual) residual[i] = is_kept ? 0.0f : x[i];
  }
  return report;
}

void decode(const TopkParams& p, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) {
  check_count(count, "topk decode");
  const uint64_t k = p.k(count);
  check_buffer(in.size(), encoded_bytes(p, count), "topk decode");
  std::vector<uint32_t> index(k);
  if (k) memcpy(index.data(), in.data(), 4 * k);
  check_indices(index.data(), k, count, "topk decode");
  if (count) memset(out, 0, count * dtype_size(out_dtype));
  for (uint64_t j = 0; j < k; ++j) {
    float v;
    memcpy(&v, in.data() + 4 * k + 4 * j, 4);
    store_from_float(out, out_dtype, index[j], v);
  }
}

void decode_accumulate(const TopkParams& p, std::span<const uint8_t> in, uint64_t count, float* acc) {
  check_count(count, "topk decode_accumulate");
  const uint64_t k = p.k(count);
  check_buffer(in.size(), encoded_bytes(p, count), "topk decode_accumulate");
  std::vector<uint32_t> index(k);
  if (k) memcpy(index.data(), in.data(), 4 * k);
  check_indices(index.data(), k, count, "topk decode_accumulate");
  for (uint64_t j = 0; j < k; ++j) {
    float v;
    memcpy(&v, in.data() + 4 * k + 4 * j, 4);
    acc[index[j]] = quant::canonical_nan(acc[index[j]] + v);
  }
}

uint64_t squared_errors(std::span<const TopkParams> candidates, DType dtype, const Slice& input, const float* residual,
                        std::span<double> squared_error_out) {
  if (squared_error_out.size() < candidates.size())
    throw CodecError("topk squared_errors: " + std::to_string(candidates.size()) + " candidates, " +
                     std::to_string(squared_error_out.size()) + " outputs");
  const std::vector<float> x = values_of(dtype, input, residual);
  uint64_t nonfinite = 0;
  for (float v : x) nonfinite += !quant::is_finite_value(v);
  if (nonfinite) {
    for (size_t c = 0; c < candidates.size(); ++c) squared_error_out[c] = std::numeric_limits<double>::infinity();
    return nonfinite;
  }
  uint64_t k_max = 0;
  for (const TopkParams& p : candidates) k_max = std::max(k_max, std::min<uint64_t>(p.k(x.size()), x.size()));
  // Magnitudes, the k_max largest first and sorted; the rest in no order. A kept value
  // leaves no error (it is sent exactly), so candidate k's error is the sum of the squares
  // from sorted position k on; ties do not matter, equal keys have equal squares.
  std::vector<float> magnitude(x.size());
  for (size_t i = 0; i < x.size(); ++i) magnitude[i] = std::fabs(x[i]);
  const auto top = magnitude.begin() + static_cast<ptrdiff_t>(k_max);
  if (top != magnitude.end()) std::nth_element(magnitude.begin(), top, magnitude.end(), std::greater<>());
  std::sort(magnitude.begin(), top, std::greater<>());
  double tail = 0.0;  // beyond the k_max largest
  for (auto it = top; it != magnitude.end(); ++it) tail += double(*it) * double(*it);
  // suffix[j] = error of keeping the j largest, for j in [0, k_max].
  std::vector<double> suffix(k_max + 1);
  suffix[k_max] = tail;
  for (uint64_t j = k_max; j-- > 0;) suffix[j] = suffix[j + 1] + double(magnitude[j]) * double(magnitude[j]);
  for (size_t c = 0; c < candidates.size(); ++c)
    squared_error_out[c] = suffix[std::min<uint64_t>(candidates[c].k(x.size()), x.size())];
  return 0;
}

}  // namespace lgreco::topk
