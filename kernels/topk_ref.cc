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
  // The radix selection of select(), for every density at once: a histogram of the keys'
  // high halves with each bin's sum of squares, then one of the low halves within the
  // bins that hold a candidate's k-th largest key. Candidate k's error is the squares of
  // every bin below that key's, of the lower keys in its bin, and of the equal keys it
  // does not keep (equal keys have equal squares). A kept value is sent exactly.
  constexpr size_t kBins = size_t{1} << 16;
  std::vector<uint64_t> count(kBins);
  std::vector<double> squares(kBins);
  for (float v : x) {
    const uint32_t high = magnitude_key(v) >> 16;
    ++count[high];
    squares[high] += double(v) * double(v);
  }
  struct Cut {
    uint64_t k = 0;
    uint32_t high = 0;     // the bin of the k-th largest key
    uint64_t above = 0;    // keys in higher bins
    double below = 0;      // squares of the lower bins
  };
  std::vector<Cut> cuts(candidates.size());
  for (size_t c = 0; c < candidates.size(); ++c) {
    Cut& cut = cuts[c];
    cut.k = std::min<uint64_t>(candidates[c].k(x.size()), x.size());
    if (cut.k == 0 || cut.k == x.size()) continue;
    uint32_t high = kBins - 1;
    while (cut.above + count[high] < cut.k) cut.above += count[high--];
    cut.high = high;
    for (uint32_t b = 0; b < high; ++b) cut.below += squares[b];
  }
  // Low-half histograms of the bins some candidate cuts in.
  std::vector<uint32_t> cut_bins;
  for (const Cut& cut : cuts)
    if (cut.k > 0 && cut.k < x.size() &&
        std::find(cut_bins.begin(), cut_bins.end(), cut.high) == cut_bins.end())
      cut_bins.push_back(cut.high);
  std::vector<std::vector<uint64_t>> low_count(cut_bins.size(), std::vector<uint64_t>(kBins));
  for (float v : x) {
    const uint32_t key = magnitude_key(v);
    for (size_t i = 0; i < cut_bins.size(); ++i)
      if ((key >> 16) == cut_bins[i]) ++low_count[i][key & 0xFFFF];
  }
  for (size_t c = 0; c < candidates.size(); ++c) {
    const Cut& cut = cuts[c];
    if (cut.k == x.size()) {
      squared_error_out[c] = 0.0;
      continue;
    }
    if (cut.k == 0) {
      double all = 0;
      for (double v : squares) all += v;
      squared_error_out[c] = all;
      continue;
    }
    const std::vector<uint64_t>& low =
        low_count[static_cast<size_t>(std::find(cut_bins.begin(), cut_bins.end(), cut.high) - cut_bins.begin())];
    // The key's low half: keys of the bin from the top until k are reached.
    uint64_t seen = cut.above;
    uint32_t l = kBins - 1;
    while (seen + low[l] < cut.k) seen += low[l--];
    double error = cut.below;
    const auto square_of = [&](uint32_t low_half) {
      const double m = double(bits_float(cut.high << 16 | low_half));
      return m * m;
    };
    for (uint32_t b = 0; b < l; ++b)
      if (low[b]) error += double(low[b]) * square_of(b);
    error += double(seen + low[l] - cut.k) * square_of(l);  // equal keys left out
    squared_error_out[c] = error;
  }
  return 0;
}

}  // namespace lgreco::topk
