// The .lgc file: one encoded layer with everything needed to decode it (docs/FORMAT.md).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"

namespace lgreco {

constexpr uint32_t kLgcFormatVersion = 1;
constexpr uint32_t kLgcMaxSpecBytes = 1024;
constexpr uint32_t kLgcFixedHeaderBytes = 64;

struct LgcHeader {
  CodecSpec spec;
  DType dtype = DType::kFloat32;  // element type of the encoded values
  uint64_t count = 0;             // number of elements
  NoiseKey noise;                 // the key the rounding noise was drawn with
};

struct LgcFile {
  LgcHeader header;
  std::vector<uint8_t> payload;
};

// Header + payload, ready to write. Throws CodecError if the payload size does not match
// the codec's encoded size for header.count.
std::vector<uint8_t> serialize_lgc(const LgcHeader& header, std::span<const uint8_t> payload);

// Parses and verifies a whole file image. Throws CodecError starting with `source`
// (usually the file name) and naming what is wrong: not an .lgc file, unsupported
// version, truncated, trailing bytes, checksum mismatch, invalid codec or sizes.
LgcFile parse_lgc(std::span<const uint8_t> bytes, const std::string& source);

}  // namespace lgreco
