// The TopK codec against an independent reference written from docs/FORMAT.md (a full
// sort of (magnitude, index) pairs) and float64 error sums. Inputs are drawn fresh each
// run (seed printed on failure); outputs are poisoned before every call that fills them.
#include "kernels/topk.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "test_util.h"

using namespace lgreco;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TopkParams density(const char* text) { return CodecSpec::parse(std::string("topk:density=") + text).topk_params(); }

// What FORMAT.md says is kept: sort every index by (magnitude desc, NaN on top, index asc)
// and take the first k, then list them in index order.
std::vector<uint32_t> reference_kept(const std::vector<float>& x, uint64_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  auto rank = [](float v) { return std::isnan(v) ? std::numeric_limits<double>::infinity() * 2 : std::fabs(double(v)); };
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const double ra = rank(x[a]), rb = rank(x[b]);
    if (std::isnan(x[a]) != std::isnan(x[b])) return std::isnan(x[a]);
    return ra > rb;
  });
  order.resize(std::min<uint64_t>(k, order.size()));
  std::sort(order.begin(), order.end());
  return order;
}

struct Payload {
  std::vector<uint32_t> index;
  std::vector<float> value;
};
Payload parse_payload(const std::vector<uint8_t>& bytes, uint64_t k) {
  BOOST_REQUIRE_EQUAL(bytes.size(), 8 * k);
  Payload p{std::vector<uint32_t>(k), std::vector<float>(k)};
  if (k) {
    memcpy(p.index.data(), bytes.data(), 4 * k);
    memcpy(p.value.data(), bytes.data() + 4 * k, 4 * k);
  }
  return p;
}

std::vector<uint8_t> store(DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> bytes(x.size() * dtype_size(dtype));
  for (size_t i = 0; i < x.size(); ++i) store_from_float(bytes.data(), dtype, i, x[i]);
  return bytes;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(topk_codec)

BOOST_AUTO_TEST_CASE(spec_parses_prints_back_and_counts_k_exactly) {
  BOOST_TEST(CodecSpec::parse("topk").str() == "topk:density=0.01");
  for (const char* text : {"0.01", "0.005", "1", "0.000000001", "0.123456789", "0.5"})
    BOOST_TEST(CodecSpec::parse(std::string("topk:density=") + text).str() == std::string("topk:density=") + text);
  BOOST_TEST(density("1.0").density_ppb == 1'000'000'000u);
  BOOST_TEST(CodecSpec::parse("topk:density=0.0100").str() == "topk:density=0.01");
  // k = ceil(density x n), in exact integers: 0.01 x 100 is 1, not 2 by a rounding error.
  const TopkParams one_percent = density("0.01");
  BOOST_TEST(one_percent.k(0) == 0u);
  BOOST_TEST(one_percent.k(1) == 1u);
  BOOST_TEST(one_percent.k(100) == 1u);
  BOOST_TEST(one_percent.k(101) == 2u);
  BOOST_TEST(one_percent.k(100'000'000) == 1'000'000u);
  BOOST_TEST(density("0.333333333").k(3) == 1u);
  BOOST_TEST(density("0.7").k(10) == 7u);  // 0.7 x 10 in binary floating point is 7.000000000000001
  BOOST_TEST(density("1").k(12345) == 12345u);
  BOOST_TEST(lgreco::topk::encoded_bytes(one_percent, 1000) == 80u);
}

BOOST_AUTO_TEST_CASE(bad_specs_name_what_is_wrong) {
  const std::pair<const char*, const char*> cases[] = {
      {"topk:density=0", "density=0 is invalid"},     {"topk:density=1.5", "density=1.5 is invalid"},
      {"topk:density=1e-3", "density=1e-3"},          {"topk:density=-0.1", "density=-0.1"},
      {"topk:density=.5", "density=.5"},              {"topk:density=1.", "density=1."},
      {"topk:density=0.0000000001", "at most 9 digits"}, {"topk:k=10", "unknown option \"k\" for topk"},
      {"topk:density=0.1,density=0.2", "given twice"}, {"topk:", "nothing after ':'"},
      {"top", "unknown codec family \"top\"; expected none, quant, topk or powersgd"}};
  for (const auto& [spec, message] : cases) {
    BOOST_TEST_CONTEXT(spec) {
      try {
        CodecSpec::parse(spec);
        BOOST_ERROR("parsed");
      } catch (const CodecError& e) {
        BOOST_TEST(test::contains(e.what(), message), e.what());
      }
    }
  }
  BOOST_CHECK_THROW(CodecSpec::topk(TopkParams{0}), CodecError);
  BOOST_CHECK_THROW(CodecSpec::topk(TopkParams{1'000'000'001u}), CodecError);
}

BOOST_AUTO_TEST_CASE(encode_keeps_the_reference_set_and_feeds_back_the_rest) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (test::Dist dist : test::kAllDists)
      for (const char* d : {"0.001", "0.01", "0.05", "0.5", "1"}) {
        BOOST_TEST_CONTEXT("seed " << seed << ", " << dtype_name(dtype) << ", " << test::dist_name(dist)
                                   << ", density " << d) {
          const size_t n = 1 + rng() % 5000;
          std::vector<float> input = test::draw(dist, n, rng, 64);
          // Ties: copy some magnitudes (with either sign) onto other positions.
          for (size_t t = 0; t < n / 20; ++t) input[rng() % n] = (rng() % 2 ? -1.0f : 1.0f) * std::fabs(input[rng() % n]);
          const std::vector<uint8_t> in = store(dtype, input);
          std::vector<float> residual = test::draw(test::Dist::kNormal, n, rng);
          for (float& r : residual) r *= 0.1f;
          std::vector<float> x(n);
          for (size_t i = 0; i < n; ++i) x[i] = load_as_float(in.data(), dtype, i) + residual[i];

          const TopkParams p = density(d);
          const uint64_t k = p.k(n);
          std::vector<uint8_t> out(lgreco::topk::encoded_bytes(p, n));
          test::poison(out);
          const std::vector<float> residual_before = residual;
          const EncodeReport report = lgreco::topk::encode(p, dtype, Slice{in.data(), n, 0}, residual.data(), out);
          // float16 cannot hold the largest mixed-scale values: they arrive as infinities.
          BOOST_TEST(report.nonfinite_buckets ==
                     static_cast<uint64_t>(std::count_if(x.begin(), x.end(), [](float v) { return !std::isfinite(v); })));
          const Payload got = parse_payload(out, k);
          const std::vector<uint32_t> want = reference_kept(x, k);
          BOOST_TEST(got.index == want, boost::test_tools::per_element());
          for (uint64_t j = 0; j < k; ++j) BOOST_TEST(float_bits(got.value[j]) == float_bits(x[want[j]]));
          std::vector<bool> kept(n, false);
          for (uint32_t i : want) kept[i] = true;
          for (size_t i = 0; i < n; ++i)
            BOOST_TEST(float_bits(residual[i]) ==
                           float_bits(!std::isfinite(x[i]) ? residual_before[i] : kept[i] ? 0.0f : x[i]),
                       "residual " << i);

          // Decoding puts each kept value in its place and zeros elsewhere.
          std::vector<float> decoded(n);
          test::poison(decoded);
          lgreco::topk::decode(p, out, n, DType::kFloat32, decoded.data());
          for (size_t i = 0; i < n; ++i)
            BOOST_TEST(float_bits(decoded[i]) == float_bits(kept[i] ? x[i] : 0.0f), "decoded " << i);
          // Decode-accumulate adds exactly that, one float32 addition per kept value.
          std::vector<float> acc = test::draw(test::Dist::kNormal, n, rng), before = acc;
          lgreco::topk::decode_accumulate(p, out, n, acc.data());
          for (size_t i = 0; i < n; ++i)
            BOOST_TEST(float_bits(acc[i]) == float_bits(kept[i] ? before[i] + x[i] : before[i]), "acc " << i);
        }
      }
}

BOOST_AUTO_TEST_CASE(ties_keep_the_lower_index_and_non_finite_values_go_first) {
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 2 ? -1.0f : 1.0f;
  const TopkParams p = density("0.125");  // k = 8
  std::vector<uint8_t> out(lgreco::topk::encoded_bytes(p, x.size()));
  test::poison(out);
  lgreco::topk::encode(p, DType::kFloat32, Slice{x.data(), x.size(), 0}, nullptr, out);
  const Payload got = parse_payload(out, 8);
  for (uint32_t j = 0; j < 8; ++j) BOOST_TEST(got.index[j] == j);

  // NaN above +-infinity above everything finite; a NaN is sent as the canonical 0x7FFFFFFF;
  // a non-finite value keeps its residual, kept or not.
  x.assign(40, 0.5f);
  x[30] = kInf;
  x[3] = kNaN;
  x[7] = -kInf;
  x[20] = 2.0f;
  std::vector<float> residual(x.size(), 0.25f);
  const TopkParams k2 = density("0.05");  // k = 2
  out.assign(lgreco::topk::encoded_bytes(k2, x.size()), 0);
  test::poison(out);
  const EncodeReport report = lgreco::topk::encode(k2, DType::kFloat32, Slice{x.data(), x.size(), 0}, residual.data(), out);
  BOOST_TEST(report.nonfinite_buckets == 3u);
  const Payload nonfinite = parse_payload(out, 2);
  BOOST_TEST(nonfinite.index[0] == 3u);
  BOOST_TEST(nonfinite.index[1] == 7u);  // -inf before +inf: the lower index among equal magnitudes
  BOOST_TEST(float_bits(nonfinite.value[0]) == 0x7FFFFFFFu);
  BOOST_TEST(nonfinite.value[1] == -kInf);
  BOOST_TEST(residual[3] == 0.25f);
  BOOST_TEST(residual[7] == 0.25f);
  BOOST_TEST(residual[30] == 0.25f);
  BOOST_TEST(residual[20] == 2.25f);  // finite, not kept
}

BOOST_AUTO_TEST_CASE(error_feedback_keeps_the_accumulated_error_bounded) {
  // A gradient that repeats: what is sent over T steps is T g minus the final residual,
  // so the residual staying bounded means every coordinate gets through on average.
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  BOOST_TEST_CONTEXT("seed " << seed) {
    const size_t n = 2000;
    const std::vector<float> g = test::draw(test::Dist::kHeavyTailed, n, rng);
    const TopkParams p = density("0.02");
    std::vector<float> residual(n, 0.0f);
    std::vector<double> sent(n, 0.0);
    std::vector<uint8_t> out(lgreco::topk::encoded_bytes(p, n));
    double norm_g = 0, max_g = 0;
    for (float v : g) norm_g += double(v) * v, max_g = std::max(max_g, double(std::fabs(v)));
    norm_g = std::sqrt(norm_g);
    double worst_late = 0, worst_early = 0;
    const int steps = 400;
    for (int t = 0; t < steps; ++t) {
      lgreco::topk::encode(p, DType::kFloat32, Slice{g.data(), n, 0}, residual.data(), out);
      const Payload got = parse_payload(out, p.k(n));
      for (size_t j = 0; j < got.index.size(); ++j) sent[got.index[j]] += got.value[j];
      double r = 0;
      for (float v : residual) r += double(v) * v;
      (t < steps / 2 ? worst_early : worst_late) = std::max(t < steps / 2 ? worst_early : worst_late, std::sqrt(r));
    }
    // Bounded: no steady growth from the first half to the second (growing linearly it
    // would double), and within n/k steps' worth of g.
    BOOST_TEST(worst_late <= 1.25 * worst_early, worst_late << " after " << worst_early);
    BOOST_TEST(worst_late <= (double(n) / p.k(n)) * norm_g);
    // The mean of what was sent approaches g: the error is the residual over T.
    double err = 0;
    for (size_t i = 0; i < n; ++i) {
      const double d = sent[i] / steps - g[i];
      err += d * d;
    }
    BOOST_TEST(std::sqrt(err) <= 1.1 * worst_late / steps + 1e-6 * norm_g);
  }
}

BOOST_AUTO_TEST_CASE(squared_errors_match_the_float64_error_of_each_encoding) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  const std::vector<TopkParams> candidates = {density("0.001"), density("0.0025"), density("0.005"), density("0.01"),
                                              density("0.02"),  density("0.05"),   density("1")};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (test::Dist dist : test::kAllDists) {
      BOOST_TEST_CONTEXT("seed " << seed << ", " << dtype_name(dtype) << ", " << test::dist_name(dist)) {
        const size_t n = 1 + rng() % 20000;
        const std::vector<uint8_t> in = store(dtype, test::draw(dist, n, rng, 128));
        const std::vector<float> residual = test::draw(test::Dist::kNormal, n, rng);
        std::vector<double> measured(candidates.size(), -1.0);
        BOOST_TEST(lgreco::topk::squared_errors(candidates, dtype, Slice{in.data(), n, 0}, residual.data(), measured) == 0u);
        for (size_t c = 0; c < candidates.size(); ++c) {
          // The error of the real encoding of x = input + residual, in float64.
          std::vector<float> r = residual;
          std::vector<uint8_t> enc(lgreco::topk::encoded_bytes(candidates[c], n));
          lgreco::topk::encode(candidates[c], dtype, Slice{in.data(), n, 0}, r.data(), enc);
          std::vector<float> decoded(n);
          lgreco::topk::decode(candidates[c], enc, n, DType::kFloat32, decoded.data());
          double want = 0;
          for (size_t i = 0; i < n; ++i) {
            const double xi = double(load_as_float(in.data(), dtype, i) + residual[i]);
            want += (xi - decoded[i]) * (xi - decoded[i]);
          }
          BOOST_TEST(measured[c] == want, boost::test_tools::tolerance(1e-9));
        }
        // Through the family-neutral entry point, beside another family.
        std::vector<CodecSpec> specs;
        for (const TopkParams& p : candidates) specs.push_back(CodecSpec::topk(p));
        specs.push_back(CodecSpec::parse("quant:bits=4"));
        const CandidateReport report = measure_candidates(specs, dtype, Slice{in.data(), n, 0}, residual.data());
        for (size_t c = 0; c < candidates.size(); ++c) {
          BOOST_TEST(report.candidates[c].squared_error == measured[c]);
          BOOST_TEST(report.candidates[c].bytes == lgreco::topk::encoded_bytes(candidates[c], n));
        }
        BOOST_TEST(report.candidates.back().squared_error > 0.0);
      }
    }
  // A non-finite value makes every error infinite and is counted.
  std::vector<float> x(100, 1.0f);
  x[17] = kNaN;
  std::vector<double> errors(2);
  BOOST_TEST(lgreco::topk::squared_errors(std::vector<TopkParams>{density("0.1"), density("0.5")}, DType::kFloat32,
                                  Slice{x.data(), x.size(), 0}, nullptr, errors) == 1u);
  BOOST_TEST(std::isinf(errors[0]));
  BOOST_TEST(std::isinf(errors[1]));
}

BOOST_AUTO_TEST_CASE(corrupt_and_short_payloads_are_errors_naming_the_position) {
  const TopkParams p = density("0.1");
  std::vector<float> x(50);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i) - 20.5f;
  std::vector<uint8_t> out(lgreco::topk::encoded_bytes(p, x.size()));
  lgreco::topk::encode(p, DType::kFloat32, Slice{x.data(), x.size(), 0}, nullptr, out);
  std::vector<float> y(x.size());
  auto expect = [&](std::vector<uint8_t> bytes, uint64_t count, const char* message) {
    try {
      lgreco::topk::decode(p, bytes, count, DType::kFloat32, y.data());
      BOOST_ERROR("decoded: " << message);
    } catch (const CodecError& e) {
      BOOST_TEST(test::contains(e.what(), message), e.what());
    }
    std::vector<float> acc(x.size(), 1.0f);
    BOOST_CHECK_THROW(lgreco::topk::decode_accumulate(p, bytes, count, acc.data()), CodecError);
  };
  std::vector<uint8_t> bad = out;
  const uint32_t big = 50;
  memcpy(bad.data() + 4 * 2, &big, 4);
  expect(bad, x.size(), "index 50 at position 2 is not below the count 50");
  bad = out;
  memcpy(bad.data() + 4 * 3, bad.data() + 4 * 2, 4);
  expect(bad, x.size(), "at position 3 is not above the one before it");
  expect(std::vector<uint8_t>(out.begin(), out.end() - 1), x.size(), "buffer of 39 bytes, needs 40");
  expect(out, uint64_t{1} << 32, "at most 4294967295");
  std::vector<uint8_t> small(8);
  BOOST_CHECK_THROW(lgreco::topk::encode(p, DType::kFloat32, Slice{x.data(), x.size(), 0}, nullptr, small), CodecError);
}

BOOST_AUTO_TEST_SUITE_END()
