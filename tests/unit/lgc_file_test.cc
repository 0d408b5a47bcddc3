// The .lgc container: round trips, and every kind of damage is a clear CodecError.
#include "kernels/lgc_file.h"

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <random>
#include <string>

#include "kernels/codec.h"
#include "kernels/crc32c.h"
#include "test_util.h"

using namespace lgreco;
using lgreco::test::Dist;

namespace {

std::vector<uint8_t> make_file(const CodecSpec& spec, DType dtype, uint64_t n, std::mt19937_64& rng,
                               LgcHeader* header_out = nullptr) {
  const std::vector<float> x = test::draw(Dist::kNormal, n, rng);
  std::vector<uint16_t> narrow(n);
  for (uint64_t i = 0; i < n; ++i) narrow[i] = float_to_half_rn(x[i]);
  const void* data = dtype == DType::kFloat32 ? static_cast<const void*>(x.data()) : narrow.data();
  const auto codec = Codec::create(spec, dtype);
  std::vector<uint8_t> payload(codec->encoded_bytes(n));
  const NoiseKey key{rng(), static_cast<uint32_t>(rng()), rng(), static_cast<uint32_t>(rng())};
  codec->encode(key, Slice{data, n, 0}, nullptr, payload);
  const LgcHeader h{spec, dtype, n, key};
  if (header_out) *header_out = h;
  return serialize_lgc(h, payload);
}

std::string error_of(const std::vector<uint8_t>& bytes) {
  try {
    parse_lgc(bytes, "f.lgc");
  } catch (const CodecError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Rewrites the header checksum after a deliberate edit, to reach the checks behind it.
void reseal_header(std::vector<uint8_t>& f) {
  uint32_t h;
  memcpy(&h, &f[12], 4);
  const uint32_t crc = crc32c(std::span<const uint8_t>(f.data(), h - 4));
  memcpy(&f[h - 4], &crc, 4);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(lgc_file)

BOOST_AUTO_TEST_CASE(round_trip_keeps_header_and_payload) {
  std::mt19937_64 rng(test::run_seed());
  for (const char* spec : {"none", "quant", "quant:bits=1,bucket=32,rounding=nearest", "quant:bits=8,bucket=1048576"})
    for (DType t : {DType::kFloat32, DType::kFloat16})
      for (uint64_t n : {0, 1, 100, 5000}) {
        LgcHeader h;
        const auto file = make_file(CodecSpec::parse(spec), t, n, rng, &h);
        const LgcFile f = parse_lgc(file, "x");
        BOOST_TEST((f.header.spec == h.spec));
        BOOST_TEST((f.header.dtype == t));
        BOOST_TEST(f.header.count == n);
        BOOST_TEST(f.header.noise.seed == h.noise.seed);
        BOOST_TEST(f.header.noise.rank == h.noise.rank);
        BOOST_TEST(f.header.noise.step == h.noise.step);
        BOOST_TEST(f.header.noise.layer == h.noise.layer);
        BOOST_TEST(f.payload.size() == Codec::create(h.spec, t)->encoded_bytes(n));
        BOOST_TEST(file.size() % 8 == f.payload.size() % 8);  // header is a multiple of 8
      }
}

BOOST_AUTO_TEST_CASE(every_truncation_and_every_single_byte_change_is_rejected) {
  std::mt19937_64 rng(test::run_seed());
  const auto file = make_file(CodecSpec::parse("quant:bits=3,bucket=64"), DType::kFloat32, 150, rng);
  for (size_t len = 0; len < file.size(); ++len) {
    const std::vector<uint8_t> cut(file.begin(), file.begin() + len);
    const std::string e = error_of(cut);
    BOOST_TEST_INFO_SCOPE("length " << len << ": " << e);
    BOOST_TEST_REQUIRE((contains(e, "truncated") || contains(e, "bad magic")));
    BOOST_TEST_REQUIRE(contains(e, "f.lgc: "));
  }
  for (size_t i = 0; i < file.size(); ++i)
    for (uint8_t flip : {0x01, 0x80, 0xff}) {
      std::vector<uint8_t> bad = file;
      bad[i] ^= flip;
      BOOST_TEST_INFO_SCOPE("byte " << i << " ^ " << int(flip));
      BOOST_TEST_REQUIRE(!error_of(bad).empty());
    }
}

BOOST_AUTO_TEST_CASE(messages_name_the_problem) {
  std::mt19937_64 rng(test::run_seed());
  const auto file = make_file(CodecSpec::parse("quant"), DType::kFloat32, 3000, rng);
  std::vector<uint8_t> longer = file;
  longer.push_back(0);
  BOOST_TEST(contains(error_of(longer), "1 unexpected bytes after the payload"));
  std::vector<uint8_t> foreign(100, 'x');
  BOOST_TEST(contains(error_of(foreign), "not an .lgc file"));
  std::vector<uint8_t> v2 = file;
  v2[8] = 2;
  BOOST_TEST(contains(error_of(v2), "unsupported .lgc format version 2"));
  std::vector<uint8_t> header_flip = file;
  header_flip[20] ^= 1;  // count
  BOOST_TEST(contains(error_of(header_flip), "header checksum mismatch"));
  std::vector<uint8_t> payload_flip = file;
  payload_flip.back() ^= 1;
  BOOST_TEST(contains(error_of(payload_flip), "payload checksum mismatch"));
  std::vector<uint8_t> count = file;
  count[16] ^= 0x80;  // 3000 -> 2872 elements: another payload size
  reseal_header(count);
  BOOST_TEST(contains(error_of(count), "does not match quant:bits=4,bucket=1024,rounding=stochastic for 2872"));
  std::vector<uint8_t> spec = file;
  spec[64 + 11] = '9';  // "quant:bits=9..."
  reseal_header(spec);
  BOOST_TEST(contains(error_of(spec), "header names an invalid codec"));
  BOOST_TEST(contains(error_of(spec), "bits=9"));
  std::vector<uint8_t> dtype = file;
  dtype[56] = 5;
  reseal_header(dtype);
  BOOST_TEST(contains(error_of(dtype), "unknown element type 5"));
}

BOOST_AUTO_TEST_CASE(serialize_rejects_a_payload_of_the_wrong_size) {
  std::vector<uint8_t> payload(10);
  BOOST_CHECK_THROW(serialize_lgc(LgcHeader{CodecSpec::parse("quant"), DType::kFloat32, 100, {}}, payload), CodecError);
}

BOOST_AUTO_TEST_SUITE_END()
