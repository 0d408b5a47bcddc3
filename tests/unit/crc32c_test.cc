#include "kernels/crc32c.h"

#include <boost/test/unit_test.hpp>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

using namespace lgreco;

namespace {
// Bit-at-a-time CRC-32C straight from the definition, to check the table version.
uint32_t crc_slow(const std::vector<uint8_t>& d) {
  uint32_t c = 0xffffffffu;
  for (uint8_t byte : d) {
    c ^= byte;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(crc)

BOOST_AUTO_TEST_CASE(check_value) {
  const std::string s = "123456789";
  BOOST_TEST(crc32c({reinterpret_cast<const uint8_t*>(s.data()), s.size()}) == 0xE3069283u);
  BOOST_TEST(crc32c({}) == 0u);
}

BOOST_AUTO_TEST_CASE(matches_bitwise_definition_and_continues) {
  std::mt19937_64 rng(test::run_seed());
  for (size_t n : {1, 3, 4, 5, 63, 64, 1000, 4097}) {
    std::vector<uint8_t> d(n);
    for (auto& b : d) b = static_cast<uint8_t>(rng());
    BOOST_TEST(crc32c(d) == crc_slow(d));
    const size_t cut = n / 3;
    const std::span<const uint8_t> all(d);
    BOOST_TEST(crc32c(all.subspan(cut), crc32c(all.subspan(0, cut))) == crc32c(d));
  }
}

BOOST_AUTO_TEST_SUITE_END()
