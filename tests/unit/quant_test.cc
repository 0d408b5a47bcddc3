// The quantization codec against float64 references and an independent scalar encoder
// written from docs/FORMAT.md. Inputs are drawn fresh each run (seed printed on failure),
// outputs are poisoned before every call that should fill them.
#include "kernels/quant.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/crc32c.h"
#include "test_util.h"

using namespace lgreco;
using lgreco::test::Dist;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

QuantParams params(int bits, uint32_t bucket, Rounding r = Rounding::kStochastic) {
  return QuantParams{bits, bucket, r};
}

std::vector<uint8_t> encode(const QuantParams& p, const NoiseKey& key, const std::vector<float>& x,
                            float* residual = nullptr, uint64_t first = 0, EncodeReport* report = nullptr) {
  std::vector<uint8_t> out(lgreco::quant::encoded_bytes(p, x.size()));
  test::poison(out);
  const EncodeReport r =
      lgreco::quant::encode(p, key, DType::kFloat32, Slice{x.data(), x.size(), first}, residual, out);
  if (report) *report = r;
  return out;
}

std::vector<float> decode(const QuantParams& p, const std::vector<uint8_t>& enc, size_t n) {
  std::vector<float> y(n);
  test::poison(y);
  lgreco::quant::decode(p, enc, n, DType::kFloat32, y.data());
  return y;
}

// --- An independent scalar implementation of docs/FORMAT.md --------------------------------

float threshold_of(const NoiseKey& key, uint64_t element) {
  return uniform24(noise_block(key, element / 4).v[element % 4]);
}

// Encodes like FORMAT.md says, one element at a time, with std:: functions only.
std::vector<uint8_t> reference_encode(const QuantParams& p, const NoiseKey& key, const std::vector<float>& x,
                                      std::vector<float>* residual, uint64_t first = 0) {
  const uint64_t n = x.size(), nb = (n + p.bucket - 1) / p.bucket, ng = (n + 31) / 32;
  const uint32_t L = (1u << p.bits) - 1;
  std::vector<uint8_t> out(8 * nb + 4 * p.bits * ng, 0);
  std::vector<uint32_t> words(p.bits * ng, 0);
  for (uint64_t k = 0; k < nb; ++k) {
    const uint64_t begin = k * p.bucket, end = std::min<uint64_t>(n, begin + p.bucket);
    std::vector<float> v;
    for (uint64_t i = begin; i < end; ++i) v.push_back(residual ? x[i] + (*residual)[i] : x[i]);
    bool finite = true;
    for (float e : v) finite = finite && std::isfinite(e);
    float lo = 0, hi = 0, unit = 0;
    if (finite) {
      lo = *std::min_element(v.begin(), v.end()) + 0.0f;
      hi = *std::max_element(v.begin(), v.end()) + 0.0f;
      unit = (hi - lo) / static_cast<float>(L);
    }
    if (!finite || !std::isfinite(unit)) {
      const uint32_t nan = 0x7fc00000u;
      memcpy(&out[8 * k], &nan, 4);
      memcpy(&out[8 * k + 4], &nan, 4);
      continue;
    }
    memcpy(&out[8 * k], &lo, 4);
    memcpy(&out[8 * k + 4], &unit, 4);
    for (uint64_t i = begin; i < end; ++i) {
      const float e = v[i - begin];
      uint32_t code = 0;
      if (unit != 0.0f) {
        const float position = (e - lo) / unit;
        const float whole = std::floor(position);
        const float frac = position - whole;
        const float t = p.rounding == Rounding::kNearest ? 0.5f : threshold_of(key, first + i);
        code = std::min<uint32_t>(static_cast<uint32_t>(whole) + (frac > t ? 1 : 0), L);
      }
      for (int j = 0; j < p.bits; ++j) words[(i / 32) * p.bits + j] |= ((code >> j) & 1u) << (i % 32);
      if (residual) (*residual)[i] = e - (lo + static_cast<float>(code) * unit);
    }
  }
  memcpy(out.data() + 8 * nb, words.data(), 4 * words.size());
  return out;
}

struct BucketInfo {
  float min, unit;
};
BucketInfo meta_of(const std::vector<uint8_t>& enc, uint64_t k) {
  BucketInfo m;
  memcpy(&m.min, &enc[8 * k], 4);
  memcpy(&m.unit, &enc[8 * k + 4], 4);
  return m;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(quant_codec)

BOOST_AUTO_TEST_CASE(encoded_size_is_a_function_of_params_and_count) {
  std::mt19937_64 rng(test::run_seed());
  for (uint64_t n : {0, 1, 31, 32, 33, 1023, 1024, 1025, 5000})
    for (int bits = 1; bits <= 8; ++bits)
      for (uint32_t bucket : {32u, 96u, 1024u}) {
        const QuantParams p = params(bits, bucket);
        const uint64_t want = 8 * ((n + bucket - 1) / bucket) + 4 * bits * ((n + 31) / 32);
        BOOST_TEST_REQUIRE(lgreco::quant::encoded_bytes(p, n) == want);
        // Encoding writes exactly that many bytes: a poisoned tail stays untouched.
        const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
        std::vector<uint8_t> out(want + 64, 0xA5);
        lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{x.data(), n, 0}, nullptr,
                              std::span(out).first(want));
        for (uint64_t i = want; i < want + 64; ++i) BOOST_TEST_REQUIRE(out[i] == 0xA5);
      }
  BOOST_TEST(lgreco::quant::encoded_bytes(params(4, 1024), 1 << 20) * 8.0 / (1 << 20) == 4.0625);
}

BOOST_AUTO_TEST_CASE(matches_the_scalar_reference_bit_for_bit) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (Dist d : test::kAllDists)
      for (int bits : {1, 2, 3, 4, 5, 7, 8})
        for (uint32_t bucket : {32u, 96u, 1024u})
          for (Rounding r : {Rounding::kStochastic, Rounding::kNearest})
            for (bool with_residual : {false, true}) {
              const uint64_t n = 1 + rng() % 5000;
              const QuantParams p = params(bits, bucket, r);
              const NoiseKey key{rng(), static_cast<uint32_t>(rng()), rng(), static_cast<uint32_t>(rng())};
              const uint64_t first = bucket * (rng() % 1000);
              const std::vector<float> x = test::draw(d, n, rng, bucket);
              std::vector<float> r_lib = test::draw(Dist::kNormal, n, rng);
              for (float& e : r_lib) e *= 0.01f;
              std::vector<float> r_ref = r_lib;
              const auto lib = encode(p, key, x, with_residual ? r_lib.data() : nullptr, first);
              const auto ref = reference_encode(p, key, x, with_residual ? &r_ref : nullptr, first);
              BOOST_TEST_INFO_SCOPE(test::dist_name(d) << " bits=" << bits << " bucket=" << bucket << " n=" << n
                                                       << " residual=" << with_residual);
              BOOST_TEST_REQUIRE((lib == ref));
              BOOST_TEST_REQUIRE(memcmp(r_lib.data(), r_ref.data(), 4 * n) == 0);
            }
  }
}

BOOST_AUTO_TEST_CASE(decoded_values_lie_within_one_unit) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (Dist d : test::kAllDists)
      for (int bits = 1; bits <= 8; ++bits)
        for (uint32_t bucket : {32u, 1024u})
          for (Rounding r : {Rounding::kStochastic, Rounding::kNearest}) {
            const uint64_t n = 3000 + rng() % 3000;  // not a multiple of the bucket, mostly
            const QuantParams p = params(bits, bucket, r);
            const std::vector<float> x = test::draw(d, n, rng, bucket);
            const auto enc = encode(p, NoiseKey{rng(), 0, 0, 0}, x);
            const auto y = decode(p, enc, n);
            for (uint64_t k = 0; k * bucket < n; ++k) {
              const uint64_t begin = k * bucket, end = std::min<uint64_t>(n, begin + bucket);
              double lo = x[begin], hi = x[begin];
              for (uint64_t i = begin; i < end; ++i) lo = std::min<double>(lo, x[i]), hi = std::max<double>(hi, x[i]);
              const BucketInfo m = meta_of(enc, k);
              BOOST_TEST_INFO_SCOPE(test::dist_name(d) << " bits=" << bits << " bucket " << k);
              BOOST_TEST_REQUIRE(double(m.min) == lo);  // the exact minimum
              const double unit = (hi - lo) / ((1 << bits) - 1);
              BOOST_TEST_REQUIRE(std::fabs(m.unit - unit) <= 1e-6 * unit);
              // One unit (half for nearest), plus float32 rounding of position and value.
              const double allowed =
                  (r == Rounding::kNearest ? 0.5 : 1.0) * unit * (1 + 1e-5) + 0x1p-22 * (std::fabs(lo) + std::fabs(hi));
              for (uint64_t i = begin; i < end; ++i) BOOST_TEST_REQUIRE(std::fabs(double(y[i]) - x[i]) <= allowed);
            }
          }
  }
}

BOOST_AUTO_TEST_CASE(stochastic_rounding_is_unbiased) {
  // The mean decoded error over S seeds has, per element, standard deviation
  // unit * sqrt(f (1 - f) / S): it shrinks like 1/sqrt(S).
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 2048;
  const QuantParams p = params(3, 1024);
  const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
  double predicted_var = 0;  // mean over elements of the per-seed error variance
  {
    const auto enc = encode(p, NoiseKey{}, x);
    for (uint64_t i = 0; i < n; ++i) {
      const BucketInfo m = meta_of(enc, i / 1024);
      const double pos = (double(x[i]) - m.min) / m.unit, f = pos - std::floor(pos);
      predicted_var += m.unit * m.unit * f * (1 - f) / n;
    }
  }
  std::vector<double> rms_of_mean;
  for (int seeds : {16, 256, 4096}) {
    std::vector<double> mean_error(n, 0.0);
    for (int s = 0; s < seeds; ++s) {
      const uint64_t seed = rng();
      const auto y = decode(p, encode(p, NoiseKey{seed, 0, 0, 0}, x), n);
      for (uint64_t i = 0; i < n; ++i) mean_error[i] += (double(y[i]) - x[i]) / seeds;
    }
    double ms = 0;
    for (double e : mean_error) ms += e * e / n;
    const double predicted = std::sqrt(predicted_var / seeds);
    BOOST_TEST_INFO("seeds " << seeds << " rms of mean error " << std::sqrt(ms) << " predicted " << predicted);
    BOOST_TEST(std::sqrt(ms) < 1.2 * predicted);
    BOOST_TEST(std::sqrt(ms) > 0.8 * predicted);
    rms_of_mean.push_back(std::sqrt(ms));
  }
  BOOST_TEST(rms_of_mean[0] / rms_of_mean[2] > 16 * 0.8);  // sqrt(4096 / 16) = 16
  BOOST_TEST(rms_of_mean[0] / rms_of_mean[2] < 16 * 1.25);
}

BOOST_AUTO_TEST_CASE(same_key_same_bytes_and_independent_noise_otherwise) {
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 1 << 16;
  const QuantParams p = params(2, 1024);
  const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
  const NoiseKey base{rng(), 3, 100, 7};
  const auto ref = encode(p, base, x);
  BOOST_TEST((encode(p, base, x) == ref));
  const auto error_of = [&](const NoiseKey& k) {
    const auto y = decode(p, encode(p, k, x), n);
    std::vector<double> e(n);
    for (uint64_t i = 0; i < n; ++i) e[i] = double(y[i]) - x[i];
    return e;
  };
  const std::vector<double> e0 = error_of(base);
  NoiseKey other_seed = base, other_rank = base, other_step = base, other_layer = base;
  other_seed.seed ^= 1;
  other_rank.rank += 1;
  other_step.step += 1;
  other_layer.layer += 1;
  for (const NoiseKey& k : {other_seed, other_rank, other_step, other_layer}) {
    BOOST_TEST((encode(p, k, x) != ref));
    const std::vector<double> e1 = error_of(k);
    double s01 = 0, s00 = 0, s11 = 0;
    for (uint64_t i = 0; i < n; ++i) s01 += e0[i] * e1[i], s00 += e0[i] * e0[i], s11 += e1[i] * e1[i];
    const double correlation = s01 / std::sqrt(s00 * s11);
    BOOST_TEST_INFO("seed " << k.seed << " rank " << k.rank << " step " << k.step << " layer " << k.layer);
    BOOST_TEST(std::fabs(correlation) < 5 / std::sqrt(double(n)));  // 5 sigma of independence
  }
}

BOOST_AUTO_TEST_CASE(slices_on_bucket_boundaries_encode_like_the_whole_layer) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(5, 96);
  const uint64_t n = 96 * 37 + 17;
  const std::vector<float> x = test::draw(Dist::kMixedScales, n, rng, 96);
  const NoiseKey key{rng(), 1, 2, 3};
  const auto whole = decode(p, encode(p, key, x), n);
  for (uint64_t cut : {96ull, 96ull * 10, 96ull * 36}) {
    const std::vector<float> a(x.begin(), x.begin() + cut), b(x.begin() + cut, x.end());
    const auto ya = decode(p, encode(p, key, a, nullptr, 0), a.size());
    const auto yb = decode(p, encode(p, key, b, nullptr, cut), b.size());
    BOOST_TEST(memcmp(ya.data(), whole.data(), 4 * a.size()) == 0);
    BOOST_TEST(memcmp(yb.data(), whole.data() + cut, 4 * b.size()) == 0);
  }
  std::vector<uint8_t> out(lgreco::quant::encoded_bytes(p, 10));
  BOOST_CHECK_THROW(lgreco::quant::encode(p, key, DType::kFloat32, Slice{x.data(), 10, 95}, nullptr, out), CodecError);
}

BOOST_AUTO_TEST_CASE(statistics_agree_with_encode_and_decode) {
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 10000;
  std::vector<QuantParams> cands;
  for (int bits = 2; bits <= 8; ++bits) cands.push_back(params(bits, 1024, Rounding::kNearest));
  for (int bits = 2; bits <= 8; ++bits) cands.push_back(params(bits, 1024));
  cands.push_back(params(4, 96));
  for (Dist d : test::kAllDists) {
    const std::vector<float> x = test::draw(d, n, rng, 1024);
    std::vector<float> residual = test::draw(Dist::kNormal, n, rng);
    for (float& e : residual) e *= 0.01f;
    std::vector<float> v(n);
    for (uint64_t i = 0; i < n; ++i) v[i] = x[i] + residual[i];
    std::vector<double> stats(cands.size(), -1.0);
    const auto report =
        lgreco::quant::squared_errors(cands, DType::kFloat32, Slice{x.data(), n, 0}, residual.data(), stats);
    BOOST_TEST(report.nonfinite_buckets == 0u);
    for (size_t c = 0; c < cands.size(); ++c) {
      const QuantParams& p = cands[c];
      BOOST_TEST_INFO_SCOPE(test::dist_name(d)
                            << " bits=" << p.bits << " bucket=" << p.bucket << " " << rounding_name(p.rounding));
      const int seeds = p.rounding == Rounding::kNearest ? 1 : 200;
      double mean = 0;
      for (int s = 0; s < seeds; ++s) {
        const auto y = decode(p, encode(p, NoiseKey{rng(), 0, 0, 0}, v), n);
        for (uint64_t i = 0; i < n; ++i) mean += (double(v[i]) - y[i]) * (double(v[i]) - y[i]) / seeds;
      }
      if (p.rounding == Rounding::kNearest)
        BOOST_TEST(stats[c] == mean, boost::test_tools::tolerance(1e-4));
      else
        BOOST_TEST(stats[c] == mean, boost::test_tools::tolerance(0.03));
    }
  }
}

BOOST_AUTO_TEST_CASE(error_feedback_keeps_the_accumulated_error_bounded) {
  // With error feedback the sum of decoded values over steps equals the sum of inputs up
  // to the last residual (one step's error); without it the error grows like sqrt(steps).
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 4096;
  const QuantParams p = params(2, 1024);
  std::vector<float> residual(n, 0.0f);
  std::vector<double> drift_ef(n, 0.0), drift_plain(n, 0.0);
  double max_unit = 0;
  for (int step = 0; step < 400; ++step) {
    const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
    const NoiseKey key{7, 0, static_cast<uint64_t>(step), 0};
    const auto enc = encode(p, key, x, residual.data());
    for (uint64_t k = 0; k < n / 1024; ++k) max_unit = std::max<double>(max_unit, meta_of(enc, k).unit);
    const auto y = decode(p, enc, n);
    const auto y_plain = decode(p, encode(p, key, x), n);
    for (uint64_t i = 0; i < n; ++i) {
      drift_ef[i] += double(y[i]) - x[i];
      drift_plain[i] += double(y_plain[i]) - x[i];
      // The residual is exactly what this step's compression lost.
      BOOST_TEST_REQUIRE(std::fabs(drift_ef[i] + residual[i]) < 1e-3);
    }
  }
  double worst_ef = 0, worst_plain = 0;
  for (uint64_t i = 0; i < n; ++i) worst_ef = std::max(worst_ef, std::fabs(drift_ef[i]));
  for (uint64_t i = 0; i < n; ++i) worst_plain = std::max(worst_plain, std::fabs(drift_plain[i]));
  BOOST_TEST_INFO("max unit " << max_unit << ", drift with feedback " << worst_ef << ", without " << worst_plain);
  BOOST_TEST(worst_ef <= 1.01 * max_unit);
  BOOST_TEST(worst_plain > 5 * worst_ef);
}

BOOST_AUTO_TEST_CASE(non_finite_buckets_decode_to_nan_and_keep_their_residual) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(4, 64);
  const uint64_t n = 64 * 8 + 10;
  std::vector<float> x = test::draw(Dist::kNormal, n, rng, 64);
  x[64 + 5] = kNaN;
  x[3 * 64] = kInf;
  x[4 * 64 + 63] = -kInf;
  x[5 * 64 + 1] = -3e38f;  // finite values whose range overflows float32
  x[5 * 64 + 2] = 3e38f;
  std::vector<float> residual = test::draw(Dist::kNormal, n, rng);
  residual[7 * 64 + 4] = kInf;  // finite input, infinite residual: the sum is not finite
  const std::vector<float> before = residual;
  EncodeReport report;
  const auto enc = encode(p, NoiseKey{1, 2, 3, 4}, x, residual.data(), 0, &report);
  BOOST_TEST(report.nonfinite_buckets == 5u);
  const std::vector<bool> bad = {false, true, false, true, true, true, false, true, false};
  const auto y = decode(p, enc, n);
  std::vector<uint16_t> half(n), bf(n);
  lgreco::quant::decode(p, enc, n, DType::kFloat16, half.data());
  lgreco::quant::decode(p, enc, n, DType::kBFloat16, bf.data());
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t k = i / 64;
    BOOST_TEST_INFO_SCOPE("element " << i);
    if (bad[k]) {
      BOOST_TEST_REQUIRE(float_bits(y[i]) == 0x7fffffffu);  // the canonical NaN, exactly
      BOOST_TEST_REQUIRE(half[i] == 0x7fff);
      BOOST_TEST_REQUIRE(bf[i] == 0x7fff);
      BOOST_TEST_REQUIRE(float_bits(residual[i]) == float_bits(before[i]));  // untouched
    } else {
      BOOST_TEST_REQUIRE(std::isfinite(y[i]));
      BOOST_TEST_REQUIRE(residual[i] != before[i]);  // updated
    }
  }
  for (uint64_t k : {1, 3, 4, 5, 7}) BOOST_TEST(float_bits(meta_of(enc, k).min) == 0x7fc00000u);
  // Decode-accumulate replaces the sum by the canonical NaN there, whatever acc held.
  std::vector<float> acc(n, 1.0f);
  acc[64 + 1] = bits_float(0x7fc00001u);  // a NaN with another payload
  lgreco::quant::decode_accumulate(p, enc, n, acc.data());
  for (uint64_t i = 0; i < n; ++i)
    if (bad[i / 64]) BOOST_TEST_REQUIRE(float_bits(acc[i]) == 0x7fffffffu);
  // Statistics report the non-finite buckets and an infinite error.
  std::vector<double> err(1);
  const std::vector<QuantParams> one = {p};
  BOOST_TEST(
      lgreco::quant::squared_errors(one, DType::kFloat32, Slice{x.data(), n, 0}, nullptr, err).nonfinite_buckets == 4u);
  BOOST_TEST(std::isinf(err[0]));
}

BOOST_AUTO_TEST_CASE(edge_counts_constant_buckets_and_signed_zero) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(4, 32);
  // Count 0: nothing to write, nothing to read.
  BOOST_TEST(lgreco::quant::encoded_bytes(p, 0) == 0u);
  BOOST_CHECK_NO_THROW(lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{nullptr, 0, 0}, nullptr, {}));
  BOOST_CHECK_NO_THROW(lgreco::quant::decode(p, {}, 0, DType::kFloat32, nullptr));
  // Count 1 and constant buckets decode exactly.
  for (uint64_t n : {1, 31, 33, 64}) {
    const float c = static_cast<float>(std::normal_distribution<double>(0, 100)(rng));
    const std::vector<float> x(n, c);
    const auto y = decode(p, encode(p, NoiseKey{rng(), 0, 0, 0}, x), n);
    for (float e : y) BOOST_TEST_REQUIRE(e == c);
  }
  // -0.0 is stored as +0.0, whatever order min/max meet the zeros in.
  const std::vector<float> zeros = {-0.0f, 0.0f, -0.0f, 0.0f, -0.0f};
  const auto enc = encode(p, NoiseKey{}, zeros);
  BOOST_TEST(float_bits(meta_of(enc, 0).min) == 0u);
  BOOST_TEST(float_bits(meta_of(enc, 0).unit) == 0u);
  const std::vector<float> neg = {-0.0f, -0.0f};
  BOOST_TEST(float_bits(meta_of(encode(p, NoiseKey{}, neg), 0).min) == 0u);
  // Padding lanes of the last group hold code 0.
  const std::vector<float> three = {1.0f, 2.0f, 3.0f};
  const auto e3 = encode(p, NoiseKey{}, three);
  for (int j = 0; j < 4; ++j) {
    uint32_t word;
    memcpy(&word, &e3[8 + 4 * j], 4);
    BOOST_TEST((word >> 3) == 0u);
  }
}

BOOST_AUTO_TEST_CASE(float16_and_bfloat16_inputs) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(4, 1024);
  const uint64_t n = 3000;
  const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
  std::vector<uint16_t> half(n), bf(n);
  std::vector<float> half_wide(n), bf_wide(n);
  for (uint64_t i = 0; i < n; ++i) {
    half[i] = float_to_half_rn(x[i]);
    bf[i] = float_to_bf16_rn(x[i]);
    half_wide[i] = half_to_float(half[i]);
    bf_wide[i] = bf16_to_float(bf[i]);
  }
  const NoiseKey key{rng(), 0, 0, 0};
  for (bool with_residual : {false, true}) {
    std::vector<float> r1 = test::draw(Dist::kNormal, n, rng), r2 = r1, r3 = r1, r4 = r1;
    std::vector<uint8_t> a(lgreco::quant::encoded_bytes(p, n)), b(a.size());
    lgreco::quant::encode(p, key, DType::kFloat16, Slice{half.data(), n, 0}, with_residual ? r1.data() : nullptr, a);
    lgreco::quant::encode(p, key, DType::kFloat32, Slice{half_wide.data(), n, 0}, with_residual ? r2.data() : nullptr,
                          b);
    BOOST_TEST((a == b));
    BOOST_TEST((r1 == r2));
    lgreco::quant::encode(p, key, DType::kBFloat16, Slice{bf.data(), n, 0}, with_residual ? r3.data() : nullptr, a);
    lgreco::quant::encode(p, key, DType::kFloat32, Slice{bf_wide.data(), n, 0}, with_residual ? r4.data() : nullptr, b);
    BOOST_TEST((a == b));
    BOOST_TEST((r3 == r4));
  }
}

BOOST_AUTO_TEST_CASE(decode_to_narrow_types_rounds_the_float32_value) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(6, 1024);
  const uint64_t n = 5000;
  const std::vector<float> x = test::draw(Dist::kMixedScales, n, rng);
  const auto enc = encode(p, NoiseKey{rng(), 0, 0, 0}, x);
  const auto y = decode(p, enc, n);
  std::vector<uint16_t> half(n, 0xA5A5), bf(n, 0xA5A5);
  lgreco::quant::decode(p, enc, n, DType::kFloat16, half.data());
  lgreco::quant::decode(p, enc, n, DType::kBFloat16, bf.data());
  for (uint64_t i = 0; i < n; ++i) {
    BOOST_TEST_REQUIRE(half[i] == float_to_half_rn(y[i]));
    BOOST_TEST_REQUIRE(bf[i] == float_to_bf16_rn(y[i]));
  }
}

BOOST_AUTO_TEST_CASE(decode_accumulate_adds_in_float32) {
  std::mt19937_64 rng(test::run_seed());
  const QuantParams p = params(3, 1024);
  const uint64_t n = 4321;
  const std::vector<float> x = test::draw(Dist::kHeavyTailed, n, rng);
  const auto enc = encode(p, NoiseKey{rng(), 0, 0, 0}, x);
  const auto y = decode(p, enc, n);
  std::vector<float> acc = test::draw(Dist::kNormal, n, rng);
  const std::vector<float> before = acc;
  lgreco::quant::decode_accumulate(p, enc, n, acc.data());
  for (uint64_t i = 0; i < n; ++i) BOOST_TEST_REQUIRE(float_bits(acc[i]) == float_bits(before[i] + y[i]));
}

BOOST_AUTO_TEST_CASE(bad_arguments_are_errors_not_crashes) {
  const QuantParams p = params(4, 1024);
  std::vector<float> x(2048, 1.0f);
  std::vector<uint8_t> small(lgreco::quant::encoded_bytes(p, 2048) - 1);
  BOOST_CHECK_THROW(lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{x.data(), 2048, 0}, nullptr, small),
                    CodecError);
  BOOST_CHECK_THROW(lgreco::quant::decode(p, small, 2048, DType::kFloat32, x.data()), CodecError);
  BOOST_CHECK_THROW(lgreco::quant::decode_accumulate(p, small, 2048, x.data()), CodecError);
  std::vector<uint8_t> out(lgreco::quant::encoded_bytes(p, 2048));
  BOOST_CHECK_THROW(lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{nullptr, 2048, 0}, nullptr, out),
                    CodecError);
  BOOST_CHECK_THROW(
      lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{x.data(), 2048, (1ull << 34) - 1024}, nullptr, out),
      CodecError);
  BOOST_CHECK_THROW(
      lgreco::quant::encode(params(9, 1024), NoiseKey{}, DType::kFloat32, Slice{x.data(), 1, 0}, nullptr, out),
      CodecError);
  try {
    lgreco::quant::encode(p, NoiseKey{}, DType::kFloat32, Slice{x.data(), 2048, 0}, nullptr, small);
  } catch (const CodecError& e) {
    BOOST_TEST(std::string(e.what()).find("needs " + std::to_string(out.size())) != std::string::npos);
  }
}

// Pins the bytes of a few fixed encodings. The CUDA kernels must produce these too; a
// change here is a format change (bump the .lgc version and say so in docs/FORMAT.md).
BOOST_AUTO_TEST_CASE(golden_encodings_are_stable) {
  std::vector<float> x(5000);
  uint64_t state = 0x9E3779B97F4A7C15ull;  // a fixed LCG: the same input on every machine
  for (float& v : x) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<int32_t>(state >> 32)) * 0x1p-31f * 3.0f;
  }
  struct Golden {
    QuantParams p;
    uint32_t crc;
  } golden[] = {
      {params(4, 1024), 0x14d0002fu},
      {params(2, 32, Rounding::kNearest), 0xcb8e8b12u},
      {params(8, 96), 0x3bf010a3u},
  };
  for (const Golden& g : golden) {
    const auto enc = encode(g.p, NoiseKey{0x1234, 1, 5, 9}, x);
    BOOST_TEST_INFO("bits " << g.p.bits << " bucket " << g.p.bucket << " crc 0x" << std::hex << crc32c(enc));
    BOOST_TEST(crc32c(enc) == g.crc);
  }
}

BOOST_AUTO_TEST_SUITE_END()
