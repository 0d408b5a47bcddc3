// float16/bfloat16 conversions, checked exhaustively against properties computed in
// float64: every narrowing is a nearest representable value, ties go to even, NaN is
// canonical; every widening is exact.
#include "kernels/dtype.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <limits>
#include <random>

#include "test_util.h"

using namespace lgreco;

namespace {

// Value of a binary16 bit pattern, computed independently in float64.
double half_value(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(m, -24);
  else
    v = std::ldexp(1024 + m, e - 25);
  return sign ? -v : v;
}

// Checks that `got` is the round-to-nearest-even narrowing of f, given the value function
// of the narrow type and that its finite magnitudes are ordered like their bit patterns.
template <typename ValueOf>
bool is_nearest_even(float f, uint16_t got, ValueOf value_of, double max_finite, double overflow_at) {
  const double x = f;
  if (std::isnan(x)) return got == 0x7fff;
  const bool negative = std::signbit(x);
  const double ax = std::fabs(x);
  if ((got >> 15) != (negative ? 1 : 0) && ax != 0) return false;
  const uint16_t mag = got & 0x7fff;
  if (ax >= overflow_at) return value_of(mag) == std::numeric_limits<double>::infinity();
  const double v = value_of(mag);
  if (!(v <= max_finite)) return false;
  const double err = std::fabs(v - ax);
  const double below = mag > 0 ? std::fabs(value_of(mag - 1) - ax) : std::numeric_limits<double>::infinity();
  const double above = std::fabs(value_of(mag + 1) - ax);  // may be inf: fine
  if (err > below || err > above) return false;
  if (err == below || err == above) return (mag & 1) == 0;  // a tie: the even one
  return true;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(dtype)

BOOST_AUTO_TEST_CASE(half_widening_is_exact_for_every_pattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = half_value(static_cast<uint16_t>(h));
    const float got = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want))
      BOOST_TEST_REQUIRE(std::isnan(got));
    else
      BOOST_TEST_REQUIRE(double(got) == want, "half 0x" << std::hex << h);
    if (want == 0) BOOST_TEST_REQUIRE(std::signbit(got) == bool(h >> 15));
  }
}

BOOST_AUTO_TEST_CASE(half_narrowing_is_nearest_even) {
  // Every half value, the midpoints between neighbours and one float ulp either side of
  // them (where rounding decides), plus random floats of every exponent.
  std::vector<float> probes;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double a = half_value(h), b = half_value(h + 1);
    const float mid = static_cast<float>((a + b) / 2);  // exact in float32
    for (float f : {static_cast<float>(a), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      probes.push_back(f);
      probes.push_back(-f);
    }
  }
  std::mt19937_64 rng(test::run_seed());
  for (int i = 0; i < 200000; ++i) probes.push_back(bits_float(static_cast<uint32_t>(rng())));
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e30f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
    probes.push_back(f);
  for (float f : probes)
    BOOST_TEST_REQUIRE(is_nearest_even(f, float_to_half_rn(f), half_value, 65504.0, 65520.0),
                       "float " << f << " -> 0x" << std::hex << float_to_half_rn(f));
}

BOOST_AUTO_TEST_CASE(bfloat16_round_trip_and_nearest_even) {
  const auto bf_value = [](uint16_t b) { return double(bits_float(uint32_t{b} << 16)); };
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    BOOST_TEST_REQUIRE(float_to_bf16_rn(f) == b);  // representable values survive exactly
  }
  std::mt19937_64 rng(test::run_seed());
  const double max_bf = bf_value(0x7f7f);
  const double overflow = max_bf + (bf_value(0x7f7f) - bf_value(0x7f7e)) / 2;  // halfway to 2^128
  for (int i = 0; i < 400000; ++i) {
    const float f = bits_float(static_cast<uint32_t>(rng()));
    BOOST_TEST_REQUIRE(is_nearest_even(f, float_to_bf16_rn(f), bf_value, max_bf, overflow),
                       "float bits 0x" << std::hex << float_bits(f));
  }
  BOOST_TEST(float_to_bf16_rn(std::numeric_limits<float>::quiet_NaN()) == 0x7fff);
}

BOOST_AUTO_TEST_CASE(names_parse_and_print) {
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) BOOST_TEST((parse_dtype(dtype_name(t)) == t));
  BOOST_TEST(!parse_dtype("float64").has_value());
  BOOST_TEST(!is_valid_dtype(3));
}

BOOST_AUTO_TEST_SUITE_END()
