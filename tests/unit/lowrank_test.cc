// PowerSGD's building blocks and its one-shot codec against float64 references written
// here, on fresh random matrices (seed printed on failure); outputs poisoned first.
#include "kernels/lowrank.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "test_util.h"

using namespace lgreco;
using lgreco::lowrank::Shape;

namespace {

PowersgdParams psgd(uint32_t rank, uint64_t rows) { return PowersgdParams{rank, rows}; }

std::vector<float> normal(size_t n, std::mt19937_64& rng) { return test::draw(test::Dist::kNormal, n, rng); }

// M (rows x cols) times B (cols x r), in float64.
std::vector<double> product(const std::vector<float>& m, const Shape& s, const std::vector<float>& b, uint32_t r) {
  std::vector<double> out(s.rows * r, 0.0);
  for (uint64_t i = 0; i < s.rows; ++i)
    for (uint32_t c = 0; c < r; ++c)
      for (uint64_t j = 0; j < s.cols; ++j) out[i * r + c] += double(m[i * s.cols + j]) * b[j * r + c];
  return out;
}

// A matrix of exact rank `true_rank`: U V^T with normal factors.
std::vector<float> low_rank_matrix(const Shape& s, uint32_t true_rank, std::mt19937_64& rng) {
  const auto u = normal(s.rows * true_rank, rng), v = normal(s.cols * true_rank, rng);
  std::vector<float> m(s.rows * s.cols);
  for (uint64_t i = 0; i < s.rows; ++i)
    for (uint64_t j = 0; j < s.cols; ++j) {
      double x = 0;
      for (uint32_t c = 0; c < true_rank; ++c) x += double(u[i * true_rank + c]) * v[j * true_rank + c];
      m[i * s.cols + j] = static_cast<float>(x);
    }
  return m;
}

double squared_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return d;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(powersgd_codec)

BOOST_AUTO_TEST_CASE(spec_parses_and_prints_back) {
  BOOST_TEST(CodecSpec::parse("powersgd").str() == "powersgd:rank=4");
  BOOST_TEST(CodecSpec::parse("powersgd:rank=8,rows=100").str() == "powersgd:rank=8,rows=100");
  BOOST_TEST(CodecSpec::parse("powersgd:rows=3,rank=1").str() == "powersgd:rank=1,rows=3");
  BOOST_TEST(CodecSpec::parse("powersgd:rank=256").powersgd_params().rank == 256u);
  const std::pair<const char*, const char*> bad[] = {{"powersgd:rank=0", "rank=0 is out of range; expected an integer 1..256"},
                                                     {"powersgd:rank=257", "rank=257 is out of range"},
                                                     {"powersgd:rows=0", "rows=0 is invalid"},
                                                     {"powersgd:bits=4", "unknown option \"bits\" for powersgd"}};
  for (const auto& [spec, message] : bad) {
    try {
      CodecSpec::parse(spec);
      BOOST_ERROR(spec << " parsed");
    } catch (const CodecError& e) {
      BOOST_TEST(test::contains(e.what(), message), e.what());
    }
  }
}

BOOST_AUTO_TEST_CASE(the_starting_matrix_is_seeded_and_prefix_consistent) {
  std::vector<float> q8(100 * 8), q3(100 * 3), other(100 * 3);
  test::poison(q8);
  test::poison(q3);
  lgreco::lowrank::initial_q(NoiseKey{42, 0, 5, 7}, 100, 8, q8.data());
  lgreco::lowrank::initial_q(NoiseKey{42, 3, 5, 7}, 100, 3, q3.data());  // the key's rank plays no part
  for (uint64_t j = 0; j < 100; ++j)
    for (uint32_t c = 0; c < 3; ++c) BOOST_TEST(q3[j * 3 + c] == q8[j * 8 + c]);
  for (float v : q8) BOOST_TEST((v >= -1.0f && v < 1.0f));
  double mean = 0;
  for (float v : q8) mean += v;
  BOOST_TEST(std::fabs(mean / q8.size()) < 0.1);
  for (const NoiseKey& key : {NoiseKey{43, 0, 5, 7}, NoiseKey{42, 0, 6, 7}, NoiseKey{42, 0, 5, 8}}) {
    lgreco::lowrank::initial_q(key, 100, 3, other.data());
    BOOST_TEST((other != q3));
  }
}

BOOST_AUTO_TEST_CASE(products_and_gram_schmidt_match_float64) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 6; ++trial) {
    const Shape s{1 + rng() % 70, 1 + rng() % 90};
    const uint32_t r = 1 + static_cast<uint32_t>(rng() % 6);
    BOOST_TEST_CONTEXT("seed " << seed << ", " << s.rows << "x" << s.cols << " rank " << r) {
      const auto m = normal(s.rows * s.cols, rng), q = normal(s.cols * r, rng);
      std::vector<float> p(s.rows * r);
      test::poison(p);
      lgreco::lowrank::project(m.data(), s, q.data(), r, p.data());
      const auto want = product(m, s, q, r);
      for (size_t k = 0; k < p.size(); ++k) BOOST_TEST(p[k] == static_cast<float>(want[k]));
      // Orthonormal columns, then zero ones past the rank of M Q (at most the smaller side
      // of M: a random M has exactly that rank).
      lgreco::lowrank::orthonormalize(p.data(), s.rows, r);
      const uint64_t independent = std::min<uint64_t>({s.rows, s.cols, r});
      for (uint32_t a = 0; a < r; ++a)
        for (uint32_t b = 0; b < r; ++b) {
          double dot = 0;
          for (uint64_t i = 0; i < s.rows; ++i) dot += double(p[i * r + a]) * p[i * r + b];
          const double expect = a == b && a < independent ? 1.0 : 0.0;
          BOOST_TEST(std::fabs(dot - expect) < 1e-5, "columns " << a << ", " << b << ": " << dot);
        }
      std::vector<float> back(s.cols * r), out(s.rows * s.cols);
      test::poison(back);
      lgreco::lowrank::back_project(m.data(), s, p.data(), r, back.data());
      for (uint64_t j = 0; j < s.cols; ++j)
        for (uint32_t c = 0; c < r; ++c) {
          double v = 0;
          for (uint64_t i = 0; i < s.rows; ++i) v += double(m[i * s.cols + j]) * p[i * r + c];
          BOOST_TEST(back[j * r + c] == static_cast<float>(v));
        }
      test::poison(out);
      lgreco::lowrank::reconstruct(p.data(), back.data(), s, r, 0.5f, out.data());
      for (uint64_t i = 0; i < s.rows; ++i)
        for (uint64_t j = 0; j < s.cols; ++j) {
          double v = 0;
          for (uint32_t c = 0; c < r; ++c) v += double(p[i * r + c]) * back[j * r + c];
          BOOST_TEST(out[i * s.cols + j] == static_cast<float>(v * 0.5));
        }
    }
  }
  // Dependent and zero columns become zero, never NaN.
  std::vector<float> p = {1, 2, 0, 2, 4, 0, 3, 6, 0};  // 3 x 3: column 1 = 2 x column 0, column 2 zero
  lgreco::lowrank::orthonormalize(p.data(), 3, 3);
  for (int i = 0; i < 3; ++i) {
    BOOST_TEST(p[i * 3 + 1] == 0.0f);
    BOOST_TEST(p[i * 3 + 2] == 0.0f);
  }
  BOOST_TEST(std::fabs(p[0] * p[0] + p[3] * p[3] + p[6] * p[6] - 1.0f) < 1e-6);
}

BOOST_AUTO_TEST_CASE(one_shot_codec_recovers_low_rank_matrices_and_feeds_back_the_rest) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    BOOST_TEST_CONTEXT("seed " << seed << ", " << dtype_name(dtype)) {
      const Shape s{64, 48};
      const uint64_t n = s.rows * s.cols;
      // Exactly rank 3: rank 4 recovers it to float32's precision.
      const std::vector<float> exact = low_rank_matrix(s, 3, rng);
      std::vector<uint8_t> in(n * dtype_size(dtype));
      for (uint64_t i = 0; i < n; ++i) store_from_float(in.data(), dtype, i, exact[i]);
      std::vector<float> x(n);
      for (uint64_t i = 0; i < n; ++i) x[i] = load_as_float(in.data(), dtype, i);
      const CodecSpec spec = CodecSpec::powersgd(psgd(4, s.rows));
      auto codec = Codec::create(spec, dtype);
      BOOST_TEST(codec->encoded_bytes(n) == (64u + 48u) * 4u * 4u);
      std::vector<uint8_t> payload(codec->encoded_bytes(n));
      test::poison(payload);
      const NoiseKey key{seed, 0, 0, 5};
      std::vector<float> residual(n, 0.0f);
      BOOST_TEST(codec->encode(key, Slice{in.data(), n, 0}, residual.data(), payload).nonfinite_buckets == 0u);
      std::vector<float> decoded(n);
      test::poison(decoded);
      codec->decode(payload, n, DType::kFloat32, decoded.data());
      // float32: exact to rounding. bfloat16 rounding adds a full-rank part (relative
      // 1e-5 here) that no rank-4 factor holds and that tilts one power iteration's
      // subspace, by how much depends on how small the signal's third singular value is.
      const double norm = squared_distance(x, std::vector<float>(n, 0.0f));
      BOOST_TEST(squared_distance(decoded, x) <= (dtype == DType::kFloat32 ? 1e-8 : 1e-3) * norm);
      // The residual is exactly what decoding misses, and the payload is P then Q.
      for (uint64_t i = 0; i < n; ++i) BOOST_TEST(residual[i] == x[i] - decoded[i]);
      std::vector<float> p(s.rows * 4), q(s.cols * 4), again(n);
      memcpy(p.data(), payload.data(), 4 * p.size());
      memcpy(q.data(), payload.data() + 4 * p.size(), 4 * q.size());
      lgreco::lowrank::reconstruct(p.data(), q.data(), s, 4, 1.0f, again.data());
      BOOST_TEST((again == decoded));
      std::vector<float> acc(n, 1.0f);
      codec->decode_accumulate(payload, n, acc.data());
      for (uint64_t i = 0; i < n; ++i) BOOST_TEST(acc[i] == 1.0f + decoded[i]);
    }
  }
}

BOOST_AUTO_TEST_CASE(statistics_are_the_one_shot_error_at_every_rank) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 4; ++trial) {
    const Shape s{20 + rng() % 60, 20 + rng() % 60};
    const uint64_t n = s.rows * s.cols;
    BOOST_TEST_CONTEXT("seed " << seed << ", " << s.rows << "x" << s.cols) {
      // Low rank plus noise: errors fall with the rank.
      std::vector<float> x = low_rank_matrix(s, 6, rng);
      const auto noise = normal(n, rng);
      for (uint64_t i = 0; i < n; ++i) x[i] += 0.3f * noise[i];
      const auto residual = normal(n, rng);
      std::vector<CodecSpec> specs;
      for (uint32_t r : {1u, 2u, 4u, 8u}) specs.push_back(CodecSpec::powersgd(psgd(r, s.rows)));
      specs.push_back(CodecSpec::parse("quant:bits=4"));
      const NoiseKey key{seed ^ 99, 0, 0, 3};
      const CandidateReport report = measure_candidates(specs, DType::kFloat32, Slice{x.data(), n, 0}, residual.data(), key);
      BOOST_TEST(report.nonfinite_buckets == 0u);
      double previous = std::numeric_limits<double>::infinity();
      for (size_t c = 0; c < 4; ++c) {
        auto codec = Codec::create(specs[c], DType::kFloat32);
        std::vector<uint8_t> payload(codec->encoded_bytes(n));
        std::vector<float> r = residual;
        codec->encode(key, Slice{x.data(), n, 0}, r.data(), payload);
        double actual = 0;
        for (float v : r) actual += double(v) * v;  // the residual is x - C(x)
        BOOST_TEST(report.candidates[c].squared_error == actual, boost::test_tools::tolerance(1e-4));
        BOOST_TEST(report.candidates[c].bytes == codec->encoded_bytes(n));
        BOOST_TEST(report.candidates[c].squared_error < previous);
        previous = report.candidates[c].squared_error;
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(error_feedback_keeps_the_accumulated_error_bounded) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  BOOST_TEST_CONTEXT("seed " << seed) {
    const Shape s{40, 50};
    const uint64_t n = s.rows * s.cols;
    const auto g = normal(n, rng);  // full rank: rank 2 cannot send it in one step
    const PowersgdParams p = psgd(2, s.rows);
    std::vector<float> residual(n, 0.0f), decoded(n);
    std::vector<double> sent(n, 0.0);
    std::vector<uint8_t> payload(lgreco::lowrank::encoded_bytes(s, 2));
    double norm_g = 0;
    for (float v : g) norm_g += double(v) * v;
    double worst_early = 0, worst_late = 0;
    const int steps = 300;
    for (int t = 0; t < steps; ++t) {
      // A fresh starting matrix each step (the step is in the key), as the format says.
      lgreco::lowrank::encode(p, NoiseKey{seed, 0, static_cast<uint64_t>(t), 1}, DType::kFloat32, Slice{g.data(), n, 0},
                              residual.data(), payload);
      lgreco::lowrank::decode(p, payload, n, DType::kFloat32, decoded.data());
      for (uint64_t i = 0; i < n; ++i) sent[i] += decoded[i];
      double r = 0;
      for (float v : residual) r += double(v) * v;
      double& worst = t < steps / 2 ? worst_early : worst_late;
      worst = std::max(worst, std::sqrt(r));
    }
    BOOST_TEST(worst_late <= 1.25 * worst_early, worst_late << " after " << worst_early);
    double err = 0;
    for (uint64_t i = 0; i < n; ++i) err += (sent[i] / steps - g[i]) * (sent[i] / steps - g[i]);
    BOOST_TEST(std::sqrt(err) < 0.05 * std::sqrt(norm_g), "mean sent vs g: " << std::sqrt(err) << " of " << std::sqrt(norm_g));
  }
}

BOOST_AUTO_TEST_CASE(bad_shapes_and_non_finite_input) {
  std::vector<float> x(30, 1.0f);
  std::vector<uint8_t> out(4096);
  const auto expect = [&](const PowersgdParams& p, uint64_t count, const char* message) {
    try {
      lgreco::lowrank::encode(p, {}, DType::kFloat32, Slice{x.data(), count, 0}, nullptr, out);
      BOOST_ERROR("encoded: " << message);
    } catch (const CodecError& e) {
      BOOST_TEST(test::contains(e.what(), message), e.what());
    }
  };
  expect(psgd(2, 7), 30, "30 values are not a matrix of 7 rows");
  expect(psgd(2, 0), 30, "powersgd needs the matrix shape");
  BOOST_CHECK_THROW(Codec::create(CodecSpec::parse("powersgd"), DType::kFloat32)->encoded_bytes(30), CodecError);
  std::vector<uint8_t> small(8);
  BOOST_CHECK_THROW(lgreco::lowrank::encode(psgd(2, 5), {}, DType::kFloat32, Slice{x.data(), 30, 0}, nullptr, small), CodecError);
  // Non-finite: NaN factors (every value decodes to NaN), the residual kept, one count.
  x[4] = std::numeric_limits<float>::infinity();
  std::vector<float> residual(30, 0.5f), decoded(30);
  const EncodeReport r = lgreco::lowrank::encode(psgd(2, 5), {}, DType::kFloat32, Slice{x.data(), 30, 0}, residual.data(), out);
  BOOST_TEST(r.nonfinite_buckets == 1u);
  for (float v : residual) BOOST_TEST(v == 0.5f);
  lgreco::lowrank::decode(psgd(2, 5), out, 30, DType::kFloat32, decoded.data());
  for (float v : decoded) BOOST_TEST(std::isnan(v));
}

BOOST_AUTO_TEST_SUITE_END()
