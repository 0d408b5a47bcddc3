// tools/png_writer.h: checksums against their published check values, and whole files
// read back by a decoder written here from the PNG, zlib and deflate specifications
// (signature, chunk lengths and CRCs, IHDR, stored blocks, Adler-32, scanlines), and by
// Python's zlib when an interpreter is available.
#include "tools/png_writer.h"

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

using namespace lgreco;

namespace {

std::span<const uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return uint32_t{b.at(at)} << 24 | uint32_t{b.at(at + 1)} << 16 | uint32_t{b.at(at + 2)} << 8 | b.at(at + 3);
}

// Bit-at-a-time CRC-32 (PNG's), from the definition.
uint32_t crc_slow(std::span<const uint8_t> d) {
  uint32_t c = 0xffffffffu;
  for (uint8_t byte : d) {
    c ^= byte;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

struct Decoded {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
  size_t stored_blocks = 0;
};

// Decodes what encode_rgb writes (stored blocks only), checking every field on the way.
Decoded decode(const std::vector<uint8_t>& file) {
  Decoded out;
  const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  BOOST_TEST_REQUIRE(file.size() >= 8);
  BOOST_TEST_REQUIRE(memcmp(file.data(), signature, 8) == 0);
  std::vector<std::string> types;
  std::vector<uint8_t> idat;
  size_t at = 8;
  while (at < file.size()) {
    BOOST_TEST_REQUIRE(at + 12 <= file.size());
    const uint32_t length = be32(file, at);
    BOOST_TEST_REQUIRE(at + 12 + length <= file.size());
    const std::string type(file.begin() + at + 4, file.begin() + at + 8);
    const std::span<const uint8_t> typed(file.data() + at + 4, 4 + length);
    BOOST_TEST(be32(file, at + 8 + length) == crc_slow(typed), "CRC of chunk " << type);
    const std::vector<uint8_t> data(file.begin() + at + 8, file.begin() + at + 8 + length);
    if (type == "IHDR") {
      BOOST_TEST_REQUIRE(length == 13u);
      out.width = be32(data, 0);
      out.height = be32(data, 4);
      BOOST_TEST(data[8] == 8);   // bit depth
      BOOST_TEST(data[9] == 2);   // RGB
      BOOST_TEST(data[10] == 0);  // deflate
      BOOST_TEST(data[11] == 0);  // filter method
      BOOST_TEST(data[12] == 0);  // no interlace
    } else if (type == "IDAT") {
      idat.insert(idat.end(), data.begin(), data.end());
    }
    types.push_back(type);
    at += 12 + length;
  }
  BOOST_TEST_REQUIRE(types.size() >= 3u);
  BOOST_TEST(types.front() == "IHDR");
  BOOST_TEST(types.back() == "IEND");

  // zlib: CMF/FLG, stored blocks, Adler-32.
  BOOST_TEST_REQUIRE(idat.size() >= 2u + 5u + 4u);
  BOOST_TEST((idat[0] & 0x0f) == 8);  // deflate
  BOOST_TEST(((idat[0] << 8) | idat[1]) % 31 == 0);
  BOOST_TEST((idat[1] & 0x20) == 0);  // no preset dictionary
  std::vector<uint8_t> raw;
  size_t p = 2;
  for (bool last = false; !last;) {
    BOOST_TEST_REQUIRE(p + 5 <= idat.size());
    last = idat[p] & 1;
    BOOST_TEST(((idat[p] >> 1) & 3) == 0, "block type (stored)");
    const uint16_t len = static_cast<uint16_t>(idat[p + 1] | idat[p + 2] << 8);
    const uint16_t nlen = static_cast<uint16_t>(idat[p + 3] | idat[p + 4] << 8);
    BOOST_TEST(static_cast<uint16_t>(~len) == nlen);
    BOOST_TEST_REQUIRE(p + 5 + len <= idat.size());
    raw.insert(raw.end(), idat.begin() + p + 5, idat.begin() + p + 5 + len);
    p += 5 + len;
    ++out.stored_blocks;
  }
  BOOST_TEST_REQUIRE(p + 4 == idat.size());
  BOOST_TEST(be32(idat, p) == png::adler32(raw));

  const size_t row = size_t{out.width} * 3;
  BOOST_TEST_REQUIRE(raw.size() == (row + 1) * out.height);
  for (uint32_t y = 0; y < out.height; ++y) {
    BOOST_TEST(raw[y * (row + 1)] == 0, "filter type of row " << y);
    out.rgb.insert(out.rgb.end(), raw.begin() + y * (row + 1) + 1, raw.begin() + (y + 1) * (row + 1));
  }
  return out;
}

std::vector<uint8_t> random_image(uint32_t w, uint32_t h, std::mt19937_64& rng) {
  std::vector<uint8_t> rgb(size_t{w} * h * 3);
  for (auto& b : rgb) b = static_cast<uint8_t>(rng());
  return rgb;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(png_writer)

BOOST_AUTO_TEST_CASE(checksums_match_their_check_values) {
  BOOST_TEST(png::crc32(bytes_of("123456789")) == 0xCBF43926u);
  BOOST_TEST(png::crc32({}) == 0u);
  BOOST_TEST(png::adler32(bytes_of("Wikipedia")) == 0x11E60398u);
  BOOST_TEST(png::adler32({}) == 1u);
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("seed " << test::run_seed()) {
    // Long inputs cross Adler-32's reduction interval; CRC continues across pieces.
    std::vector<uint8_t> d(100000, 0xff);
    for (size_t i = 0; i < d.size(); i += 7) d[i] = static_cast<uint8_t>(rng());
    uint32_t a = 1, b = 0;
    for (uint8_t x : d) a = (a + x) % 65521, b = (b + a) % 65521;
    BOOST_TEST(png::adler32(d) == (b << 16 | a));
    const std::span<const uint8_t> all(d);
    BOOST_TEST(png::crc32(all.subspan(333), png::crc32(all.subspan(0, 333))) == crc_slow(all));
  }
}

BOOST_AUTO_TEST_CASE(files_decode_to_the_pixels) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("seed " << test::run_seed()) {
    // Raw data (3 w + 1) h bytes: one pixel; small; exactly one full stored block (65,535);
    // one byte more (65,536: two blocks); several blocks.
    for (auto [w, h] :
         {std::pair{1u, 1u}, std::pair{7u, 3u}, std::pair{1456u, 15u}, std::pair{21845u, 1u}, std::pair{300u, 250u}}) {
      BOOST_TEST_INFO_SCOPE(w << " x " << h);
      const std::vector<uint8_t> rgb = random_image(w, h, rng);
      const Decoded d = decode(png::encode_rgb(w, h, rgb));
      BOOST_TEST(d.width == w);
      BOOST_TEST(d.height == h);
      BOOST_TEST((d.rgb == rgb));
      const size_t raw = (size_t{w} * 3 + 1) * h;
      BOOST_TEST(d.stored_blocks == (raw + 65534) / 65535);
    }
  }
}

BOOST_AUTO_TEST_CASE(python_zlib_reads_the_file) {
  // LGRECO_TEST_PYTHON (make test sets it), else the system python3 if there is one.
  const std::string python = test::env_or("LGRECO_TEST_PYTHON", "/usr/bin/python3");
  if (!std::filesystem::exists(python)) {
    BOOST_TEST_MESSAGE("no " << python << ": the Python check is skipped");
    return;
  }
  std::mt19937_64 rng(test::run_seed());
  test::TempDir dir;
  const uint32_t w = 123, h = 200;  // 74,000 raw bytes: two stored blocks
  const std::vector<uint8_t> rgb = random_image(w, h, rng);
  const std::vector<uint8_t> file = png::encode_rgb(w, h, rgb);
  test::write_bytes(dir.file("x.png"), file.data(), file.size());
  test::write_bytes(dir.file("x.rgb"), rgb.data(), rgb.size());
  const std::string script = R"(
import struct, sys, zlib
data = open(sys.argv[1], 'rb').read()
assert data[:8] == b'\x89PNG\r\n\x1a\n', 'signature'
at, idat, width, height = 8, b'', 0, 0
while at < len(data):
    (length,) = struct.unpack('>I', data[at:at + 4])
    kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
    (crc,) = struct.unpack('>I', data[at + 8 + length:at + 12 + length])
    assert zlib.crc32(kind + body) == crc, 'CRC of %r' % kind
    if kind == b'IHDR':
        width, height, depth, colour, _, _, _ = struct.unpack('>IIBBBBB', body)
        assert (depth, colour) == (8, 2), 'IHDR'
    elif kind == b'IDAT':
        idat += body
    at += 12 + length
raw = zlib.decompress(idat)
stride = 3 * width + 1
assert len(raw) == stride * height, 'size'
assert all(raw[y * stride] == 0 for y in range(height)), 'filter'
pixels = b''.join(raw[y * stride + 1:(y + 1) * stride] for y in range(height))
assert pixels == open(sys.argv[2], 'rb').read(), 'pixels'
print('ok', width, height)
)";
  test::write_bytes(dir.file("check.py"), script.data(), script.size());
  const auto r =
      test::run_command(python + " " + dir.file("check.py") + " " + dir.file("x.png") + " " + dir.file("x.rgb"));
  BOOST_TEST(r.exit_code == 0, r.output);
  BOOST_TEST(test::contains(r.output, "ok 123 200"), r.output);
}

BOOST_AUTO_TEST_CASE(canvas_draws_clips_and_rejects_bad_sizes) {
  png::Canvas c(10, 8, {255, 255, 255});
  c.fill(-5, -5, 7, 7, {1, 2, 3});                // clipped to the top-left 2 x 2
  c.fill(9, 7, 100, 100, {4, 5, 6});              // clipped to the bottom-right pixel
  c.fill(20, 20, 3, 3, {7, 8, 9});                // entirely outside
  const int end = c.text(3, 1, "10", {0, 0, 0});  // '1' at x 3..5, '0' at x 7..9, rows 1..5
  BOOST_TEST(end == 11);
  BOOST_TEST(png::Canvas::text_width("10") == 7);
  const auto px = [&](int x, int y) {
    const uint8_t* p = c.pixels().data() + (size_t(y) * c.width() + x) * 3;
    return std::vector<int>{p[0], p[1], p[2]};
  };
  BOOST_TEST((px(0, 0) == std::vector<int>{1, 2, 3}));
  BOOST_TEST((px(1, 1) == std::vector<int>{1, 2, 3}));
  BOOST_TEST((px(2, 2) == std::vector<int>{255, 255, 255}));
  BOOST_TEST((px(9, 7) == std::vector<int>{4, 5, 6}));
  BOOST_TEST((px(4, 1) == std::vector<int>{0, 0, 0}));        // top of the '1'
  BOOST_TEST((px(3, 1) == std::vector<int>{255, 255, 255}));  // left of it
  BOOST_TEST((px(7, 3) == std::vector<int>{0, 0, 0}));        // the '0''s left side
  BOOST_TEST((px(8, 3) == std::vector<int>{255, 255, 255}));  // its hole
  const Decoded d = decode(png::encode_rgb(c.width(), c.height(), c.pixels()));
  BOOST_TEST((d.rgb == std::vector<uint8_t>(c.pixels().begin(), c.pixels().end())));

  const std::vector<uint8_t> three(3);
  BOOST_CHECK_THROW(png::encode_rgb(0, 1, {}), std::invalid_argument);
  BOOST_CHECK_THROW(png::encode_rgb(2, 1, three), std::invalid_argument);
  BOOST_CHECK_NO_THROW(png::encode_rgb(1, 1, three));
}

BOOST_AUTO_TEST_SUITE_END()
