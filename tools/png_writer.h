// A small self-contained PNG writer for the tools' plots: 8-bit RGB, no filtering, the
// zlib stream made of "stored" (uncompressed) deflate blocks. Files are larger than a
// compressing encoder's, but every viewer reads them and nothing beyond the standard
// library is needed. Also a tiny canvas (filled rectangles, a 3x5 pixel font for digits)
// to draw plots with.
//
//   png::Canvas c(200, 100, {255, 255, 255});
//   c.fill(10, 10, 20, 20, {68, 1, 84});
//   c.text(40, 10, "2", {0, 0, 0}, 2);
//   cli::write_file(path, png::encode_rgb(c.width(), c.height(), c.pixels()));
//
// Format references: PNG (ISO/IEC 15948, W3C), zlib (RFC 1950), deflate (RFC 1951).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lgreco::png {

// CRC-32 as PNG and zlib define it (IEEE polynomial, reflected, 0xEDB88320), continued
// from `crc` (0 to start).
inline uint32_t crc32(std::span<const uint8_t> data, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = ~crc;
  for (uint8_t byte : data) c = table[(c ^ byte) & 0xff] ^ (c >> 8);
  return ~c;
}

// Adler-32 (RFC 1950), the zlib stream's checksum of the uncompressed data.
inline uint32_t adler32(std::span<const uint8_t> data) {
  constexpr uint32_t kMod = 65521;
  uint32_t a = 1, b = 0;
  size_t i = 0;
  while (i < data.size()) {
    // 5552 bytes keep b below 2^32 before the reduction (zlib's NMAX).
    const size_t end = std::min(data.size(), i + 5552);
    for (; i < end; ++i) {
      a += data[i];
      b += a;
    }
    a %= kMod;
    b %= kMod;
  }
  return (b << 16) | a;
}

// A zlib stream (RFC 1950) whose deflate data is stored blocks of at most 65,535 bytes.
inline std::vector<uint8_t> zlib_stored(std::span<const uint8_t> data) {
  constexpr size_t kBlock = 65535;
  std::vector<uint8_t> out;
  out.reserve(data.size() + (data.size() / kBlock + 1) * 5 + 6);
  out.push_back(0x78);  // CMF: deflate, 32 KiB window
  out.push_back(0x01);  // FLG: no dictionary, fastest; (0x78 << 8 | 0x01) % 31 == 0
  size_t at = 0;
  do {
    const size_t n = std::min(kBlock, data.size() - at);
    const bool last = at + n == data.size();
    out.push_back(last ? 1 : 0);  // BFINAL, BTYPE = 00 (stored); the rest of the byte is padding
    const uint16_t len = static_cast<uint16_t>(n), nlen = static_cast<uint16_t>(~len);
    out.push_back(static_cast<uint8_t>(len & 0xff));
    out.push_back(static_cast<uint8_t>(len >> 8));
    out.push_back(static_cast<uint8_t>(nlen & 0xff));
    out.push_back(static_cast<uint8_t>(nlen >> 8));
    out.insert(out.end(), data.begin() + static_cast<ptrdiff_t>(at), data.begin() + static_cast<ptrdiff_t>(at + n));
    at += n;
  } while (at < data.size());
  const uint32_t adler = adler32(data);
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(adler >> shift));
  return out;
}

namespace detail {
inline void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}
inline void chunk(std::vector<uint8_t>& out, const char type[4], std::span<const uint8_t> data) {
  put_u32(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  put_u32(out, crc32(std::span<const uint8_t>(out.data() + start, out.size() - start)));
}
}  // namespace detail

// The PNG file of an 8-bit RGB image: `rgb` holds height rows of width pixels, top row
// first, 3 bytes (R, G, B) per pixel. Throws std::invalid_argument on a size mismatch or
// an empty or oversized image.
inline std::vector<uint8_t> encode_rgb(uint32_t width, uint32_t height, std::span<const uint8_t> rgb) {
  if (width == 0 || height == 0 || width > (1u << 24) || height > (1u << 24))
    throw std::invalid_argument("png: image of " + std::to_string(width) + " x " + std::to_string(height) + " pixels");
  const size_t row = size_t{width} * 3;
  if (rgb.size() != row * height)
    throw std::invalid_argument("png: " + std::to_string(rgb.size()) + " bytes of pixels for " + std::to_string(width) +
                                " x " + std::to_string(height) + " RGB");
  // Each scanline starts with its filter type: 0 (none).
  std::vector<uint8_t> raw;
  raw.reserve((row + 1) * height);
  for (uint32_t y = 0; y < height; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), rgb.begin() + static_cast<ptrdiff_t>(y * row),
               rgb.begin() + static_cast<ptrdiff_t>((y + 1) * row));
  }
  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  detail::put_u32(ihdr, width);
  detail::put_u32(ihdr, height);
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bits, colour type 2 (RGB), deflate, filter 0, no interlace
  detail::chunk(out, "IHDR", ihdr);
  detail::chunk(out, "IDAT", zlib_stored(raw));
  detail::chunk(out, "IEND", {});
  return out;
}

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

// An RGB image in memory with the few drawing operations plots need. Drawing outside the
// image is clipped.
class Canvas {
 public:
  Canvas(uint32_t width, uint32_t height, Rgb background)
      : width_(width), height_(height), pixels_(size_t{width} * height * 3) {
    fill(0, 0, static_cast<int>(width), static_cast<int>(height), background);
  }
  uint32_t width() const { return width_; }
  uint32_t height() const { return height_; }
  std::span<const uint8_t> pixels() const { return pixels_; }

  void fill(int x, int y, int w, int h, Rgb c) {
    const int x0 = std::max(x, 0), y0 = std::max(y, 0);
    const int x1 = std::min<int64_t>(int64_t{x} + w, width_), y1 = std::min<int64_t>(int64_t{y} + h, height_);
    for (int yy = y0; yy < y1; ++yy)
      for (int xx = x0; xx < x1; ++xx) {
        uint8_t* p = &pixels_[(size_t{static_cast<uint32_t>(yy)} * width_ + static_cast<uint32_t>(xx)) * 3];
        p[0] = c.r, p[1] = c.g, p[2] = c.b;
      }
  }

  // Digits, '.', '-', ' ' and 'x' in a 3x5 pixel font, each pixel a scale x scale square,
  // one blank column between characters. Other characters draw as blanks. Returns the
  // x just past the text.
  int text(int x, int y, std::string_view s, Rgb c, int scale = 1) {
    for (char ch : s) {
      const uint16_t glyph = glyph_of(ch);
      for (int row = 0; row < 5; ++row)
        for (int col = 0; col < 3; ++col)
          if (glyph >> (14 - (row * 3 + col)) & 1) fill(x + col * scale, y + row * scale, scale, scale, c);
      x += 4 * scale;
    }
    return x;
  }
  static int text_width(std::string_view s, int scale = 1) { return static_cast<int>(s.size()) * 4 * scale - scale; }

 private:
  // 15 bits, row by row from the top, most significant bit first.
  static uint16_t glyph_of(char ch) {
    static constexpr uint16_t kDigits[10] = {0b111'101'101'101'111, 0b010'110'010'010'111, 0b111'001'111'100'111,
                                             0b111'001'111'001'111, 0b101'101'111'001'001, 0b111'100'111'001'111,
                                             0b111'100'111'101'111, 0b111'001'010'010'010, 0b111'101'111'101'111,
                                             0b111'101'111'001'111};
    if (ch >= '0' && ch <= '9') return kDigits[ch - '0'];
    if (ch == '.') return 0b000'000'000'000'010;
    if (ch == '-') return 0b000'000'111'000'000;
    if (ch == 'x') return 0b000'101'010'101'000;
    return 0;
  }

  uint32_t width_, height_;
  std::vector<uint8_t> pixels_;
};

}  // namespace lgreco::png
