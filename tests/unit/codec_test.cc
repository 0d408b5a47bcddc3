// The family-neutral Codec interface and measure_candidates().
#include "kernels/codec.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "kernels/quant.h"
#include "test_util.h"

using namespace lgreco;
using lgreco::test::Dist;

BOOST_AUTO_TEST_SUITE(codec)

BOOST_AUTO_TEST_CASE(none_round_trips_in_the_layer_type) {
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 777;
  const std::vector<float> x = test::draw(Dist::kMixedScales, n, rng, 64);
  // float32: exact, and error feedback leaves a zero residual.
  const auto f32 = Codec::create(CodecSpec::none(), DType::kFloat32);
  BOOST_TEST(f32->encoded_bytes(n) == 4 * n);
  std::vector<uint8_t> enc(f32->encoded_bytes(n));
  std::vector<float> residual = test::draw(Dist::kNormal, n, rng), y(n);
  const std::vector<float> r0 = residual;
  f32->encode(NoiseKey{}, Slice{x.data(), n, 0}, residual.data(), enc);
  test::poison(y);
  f32->decode(enc, n, DType::kFloat32, y.data());
  for (uint64_t i = 0; i < n; ++i) {
    BOOST_TEST_REQUIRE(float_bits(y[i]) == float_bits(x[i] + r0[i]));
    BOOST_TEST_REQUIRE(residual[i] == 0.0f);
  }
  // float16: the payload is binary16; the residual keeps the rounding error.
  std::vector<uint16_t> half(n);
  const std::vector<float> small = test::draw(Dist::kNormal, n, rng);  // well inside float16's range
  for (uint64_t i = 0; i < n; ++i) half[i] = float_to_half_rn(small[i]);
  const auto f16 = Codec::create(CodecSpec::none(), DType::kFloat16);
  BOOST_TEST(f16->encoded_bytes(n) == 2 * n);
  std::vector<uint8_t> enc16(2 * n);
  std::vector<float> r16(n, 1e-9f);
  f16->encode(NoiseKey{}, Slice{half.data(), n, 0}, r16.data(), enc16);
  test::poison(y);
  f16->decode(enc16, n, DType::kFloat32, y.data());
  for (uint64_t i = 0; i < n; ++i) {
    const float v = half_to_float(half[i]) + 1e-9f;
    BOOST_TEST_REQUIRE(y[i] == half_to_float(float_to_half_rn(v)));
    BOOST_TEST_REQUIRE(r16[i] == v - y[i]);
  }
  std::vector<float> acc(n, 2.0f);
  f16->decode_accumulate(enc16, n, acc.data());
  for (uint64_t i = 0; i < n; ++i) BOOST_TEST_REQUIRE(acc[i] == 2.0f + y[i]);
}

// A NaN that arithmetic makes is stored as 0x7FFFFFFF whatever the operands' NaN bits
// (x86 would keep an operand's payload, a GPU writes its canonical NaN); a NaN that is
// only copied keeps its bits.
BOOST_AUTO_TEST_CASE(none_stores_computed_nans_canonically_and_copies_others) {
  auto none = Codec::create(CodecSpec::none(), DType::kFloat32);
  auto bits_of = [](float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
  };
  auto float_of = [](uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
  };
  const std::vector<float> input = {float_of(0x7fa00001u), 1.0f, float_of(0xffc00123u), 2.0f};
  std::vector<float> residual = {0.5f, float_of(0x7f812345u), 0.25f, 0.0f};
  std::vector<uint8_t> out(16, 0xEE);
  none->encode(NoiseKey{}, Slice{input.data(), 4, 0}, residual.data(), out);
  std::vector<float> sent(4);
  memcpy(sent.data(), out.data(), 16);
  BOOST_TEST(bits_of(sent[0]) == 0x7fffffffu);
  BOOST_TEST(bits_of(sent[1]) == 0x7fffffffu);
  BOOST_TEST(bits_of(sent[2]) == 0x7fffffffu);
  BOOST_TEST(sent[3] == 2.0f);
  // Without a residual nothing is computed: the input's own bits are sent.
  none->encode(NoiseKey{}, Slice{input.data(), 4, 0}, nullptr, out);
  memcpy(sent.data(), out.data(), 16);
  BOOST_TEST(bits_of(sent[0]) == 0x7fa00001u);
  // Decode-accumulate into a NaN accumulator, and a NaN value into a finite one.
  std::vector<float> acc = {float_of(0x7fc0abcdu), 3.0f, 4.0f, 5.0f};
  none->decode_accumulate(out, 4, acc.data());
  BOOST_TEST(bits_of(acc[0]) == 0x7fffffffu);
  BOOST_TEST(acc[1] == 4.0f);
  BOOST_TEST(bits_of(acc[2]) == 0x7fffffffu);
  BOOST_TEST(acc[3] == 7.0f);
}

BOOST_AUTO_TEST_CASE(quant_codec_is_the_quant_functions) {
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 3333;
  const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
  const CodecSpec spec = CodecSpec::parse("quant:bits=3,bucket=128");
  const auto codec = Codec::create(spec, DType::kFloat32);
  BOOST_TEST(codec->encoded_bytes(n) == lgreco::quant::encoded_bytes(spec.quant_params(), n));
  const NoiseKey key{rng(), 1, 2, 3};
  std::vector<uint8_t> a(codec->encoded_bytes(n)), b(a.size());
  codec->encode(key, Slice{x.data(), n, 0}, nullptr, a);
  lgreco::quant::encode(spec.quant_params(), key, DType::kFloat32, Slice{x.data(), n, 0}, nullptr, b);
  BOOST_TEST((a == b));
  BOOST_CHECK_THROW(Codec::create(spec, static_cast<DType>(7)), CodecError);
}

BOOST_AUTO_TEST_CASE(measure_candidates_matches_each_codec_alone) {
  std::mt19937_64 rng(test::run_seed());
  const uint64_t n = 20000;
  const std::vector<float> x = test::draw(Dist::kHeavyTailed, n, rng);
  const std::vector<float> residual = test::draw(Dist::kHeavyTailed, n, rng);
  std::vector<CodecSpec> specs = {CodecSpec::none()};
  for (int bits = 2; bits <= 8; ++bits) specs.push_back(CodecSpec::parse("quant:bits=" + std::to_string(bits)));
  specs.push_back(CodecSpec::parse("quant:bits=4,bucket=32,rounding=nearest"));
  specs.push_back(CodecSpec::parse("quant:bits=4,bucket=256"));
  const CandidateReport report = measure_candidates(specs, DType::kFloat32, Slice{x.data(), n, 0}, residual.data());
  BOOST_TEST_REQUIRE(report.candidates.size() == specs.size());
  BOOST_TEST(report.nonfinite_buckets == 0u);
  for (size_t i = 0; i < specs.size(); ++i) {
    BOOST_TEST_INFO_SCOPE(specs[i].str());
    BOOST_TEST(report.candidates[i].bytes == Codec::create(specs[i], DType::kFloat32)->encoded_bytes(n));
    if (specs[i].family() == CodecFamily::kNone) {
      BOOST_TEST(report.candidates[i].squared_error == 0.0);
      continue;
    }
    std::vector<double> alone(1);
    const std::vector<QuantParams> one = {specs[i].quant_params()};
    lgreco::quant::squared_errors(one, DType::kFloat32, Slice{x.data(), n, 0}, residual.data(), alone);
    BOOST_TEST(report.candidates[i].squared_error == alone[0]);
    BOOST_TEST(alone[0] > 0.0);
  }
  // More bits, less error: a sanity check on the candidate ladder.
  for (size_t i = 1; i <= 6; ++i)
    BOOST_TEST(report.candidates[i + 1].squared_error < report.candidates[i].squared_error);
}

BOOST_AUTO_TEST_CASE(measure_candidates_flags_non_finite_input) {
  std::vector<float> x(4096, 1.5f);
  x[100] = std::numeric_limits<float>::infinity();
  const std::vector<CodecSpec> specs = {CodecSpec::none(), CodecSpec::parse("quant")};
  const CandidateReport r = measure_candidates(specs, DType::kFloat32, Slice{x.data(), x.size(), 0}, nullptr);
  BOOST_TEST(r.nonfinite_buckets == 1u);
  BOOST_TEST(std::isinf(r.candidates[0].squared_error));
  BOOST_TEST(std::isinf(r.candidates[1].squared_error));
}

BOOST_AUTO_TEST_SUITE_END()
