#include "kernels/philox.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <vector>

#include "kernels/noise.h"

using namespace lgreco;

BOOST_AUTO_TEST_SUITE(philox)

// Random123's published known-answer vectors for Philox-4x32-10 (tests/kat_vectors).
BOOST_AUTO_TEST_CASE(known_answer_vectors) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  } kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const PhiloxBlock b = philox4x32_10(k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], k.key[0], k.key[1]);
    for (int w = 0; w < 4; ++w) BOOST_TEST(b.v[w] == k.out[w]);
  }
}

BOOST_AUTO_TEST_CASE(noise_key_maps_onto_counter_and_key) {
  const NoiseKey key{0x0123456789abcdefull, 7, 0x100000005ull, 11};
  const PhiloxBlock a = noise_block(key, 0x400000003ull);  // block index above 2^32: low 32 bits
  const PhiloxBlock b = philox4x32_10(3, 11, 5, 7, 0x89abcdef, 0x01234567);
  for (int w = 0; w < 4; ++w) BOOST_TEST(a.v[w] == b.v[w]);
}

BOOST_AUTO_TEST_CASE(uniform24_range_and_mean) {
  BOOST_TEST(uniform24(0) == 0.0f);
  BOOST_TEST(uniform24(0xffffffffu) < 1.0f);
  BOOST_TEST(uniform24(0xffffffffu) == 1.0f - 0x1p-24f);
  // Mean and variance of 4e5 draws against U[0,1): mean 1/2 +- 5 sigma, var 1/12.
  const NoiseKey key{42, 1, 2, 3};
  double sum = 0, sum2 = 0;
  const int blocks = 100000;
  for (int i = 0; i < blocks; ++i) {
    const PhiloxBlock b = noise_block(key, i);
    for (uint32_t w : b.v) {
      const double u = uniform24(w);
      sum += u;
      sum2 += u * u;
    }
  }
  const double n = 4.0 * blocks, mean = sum / n, var = sum2 / n - mean * mean;
  BOOST_TEST(std::fabs(mean - 0.5) < 5 * std::sqrt(1.0 / 12 / n));
  BOOST_TEST(std::fabs(var - 1.0 / 12) < 0.002);
}

BOOST_AUTO_TEST_SUITE_END()
