#include "kernels/lgc_file.h"

#include <bit>
#include <cstring>

#include "kernels/codec.h"
#include "kernels/crc32c.h"

namespace lgreco {
namespace {

static_assert(std::endian::native == std::endian::little, "lgreco supports little-endian hosts only");

constexpr uint8_t kMagic[8] = {0x89, 'L', 'G', 'C', '\r', '\n', 0x1a, '\n'};

// Field offsets of the fixed header part (docs/FORMAT.md).
enum : size_t {
  kOffMagic = 0,
  kOffVersion = 8,
  kOffHeaderBytes = 12,
  kOffCount = 16,
  kOffPayloadBytes = 24,
  kOffSeed = 32,
  kOffStep = 40,
  kOffRank = 48,
  kOffLayer = 52,
  kOffDType = 56,
  kOffSpecBytes = 60,
  kOffSpec = 64,
};

template <typename T>
void put(std::vector<uint8_t>& out, size_t offset, T value) {
  memcpy(out.data() + offset, &value, sizeof value);
}
template <typename T>
T get(std::span<const uint8_t> in, size_t offset) {
  T value;
  memcpy(&value, in.data() + offset, sizeof value);
  return value;
}

constexpr uint64_t header_size_for(uint64_t spec_bytes) { return (kOffSpec + spec_bytes + 8 + 7) / 8 * 8; }

}  // namespace

std::vector<uint8_t> serialize_lgc(const LgcHeader& h, std::span<const uint8_t> payload) {
  const std::string spec = h.spec.str();
  const uint64_t expected = Codec::create(h.spec, h.dtype)->encoded_bytes(h.count);
  if (payload.size() != expected)
    throw CodecError("lgc: payload of " + std::to_string(payload.size()) + " bytes, but " + spec + " encodes " +
                     std::to_string(h.count) + " values in " + std::to_string(expected));
  const size_t header_bytes = header_size_for(spec.size());
  std::vector<uint8_t> out(header_bytes + payload.size(), 0);
  memcpy(out.data() + kOffMagic, kMagic, sizeof kMagic);
  put<uint32_t>(out, kOffVersion, kLgcFormatVersion);
  put<uint32_t>(out, kOffHeaderBytes, static_cast<uint32_t>(header_bytes));
  put<uint64_t>(out, kOffCount, h.count);
  put<uint64_t>(out, kOffPayloadBytes, payload.size());
  put<uint64_t>(out, kOffSeed, h.noise.seed);
  put<uint64_t>(out, kOffStep, h.noise.step);
  put<uint32_t>(out, kOffRank, h.noise.rank);
  put<uint32_t>(out, kOffLayer, h.noise.layer);
  put<uint32_t>(out, kOffDType, static_cast<uint32_t>(h.dtype));
  put<uint32_t>(out, kOffSpecBytes, static_cast<uint32_t>(spec.size()));
  memcpy(out.data() + kOffSpec, spec.data(), spec.size());
  if (!payload.empty()) memcpy(out.data() + header_bytes, payload.data(), payload.size());
  put<uint32_t>(out, header_bytes - 8, crc32c(payload));
  put<uint32_t>(out, header_bytes - 4, crc32c(std::span<const uint8_t>(out.data(), header_bytes - 4)));
  return out;
}

LgcFile parse_lgc(std::span<const uint8_t> in, const std::string& source) {
  const auto fail = [&](const std::string& what) -> CodecError { return CodecError(source + ": " + what); };
  if (in.size() < sizeof kMagic || memcmp(in.data(), kMagic, sizeof kMagic) != 0)
    throw fail("not an .lgc file (bad magic number)");
  if (in.size() < kOffSpec) throw fail("truncated header: " + std::to_string(in.size()) + " bytes");
  const uint32_t version = get<uint32_t>(in, kOffVersion);
  if (version != kLgcFormatVersion)
    throw fail("unsupported .lgc format version " + std::to_string(version) + " (this build reads version " +
               std::to_string(kLgcFormatVersion) + ")");
  const uint32_t spec_bytes = get<uint32_t>(in, kOffSpecBytes);
  const uint32_t header_bytes = get<uint32_t>(in, kOffHeaderBytes);
  if (spec_bytes > kLgcMaxSpecBytes || header_bytes != header_size_for(spec_bytes))
    throw fail("corrupt header: header size " + std::to_string(header_bytes) + " with a codec spec of " +
               std::to_string(spec_bytes) + " bytes");
  if (in.size() < header_bytes)
    throw fail("truncated header: " + std::to_string(in.size()) + " of " + std::to_string(header_bytes) + " bytes");
  const uint32_t header_crc = get<uint32_t>(in, header_bytes - 4);
  if (crc32c(in.subspan(0, header_bytes - 4)) != header_crc)
    throw fail("header checksum mismatch: the file is corrupt");

  LgcFile file;
  LgcHeader& h = file.header;
  const std::string spec(reinterpret_cast<const char*>(in.data() + kOffSpec), spec_bytes);
  try {
    h.spec = CodecSpec::parse(spec);
  } catch (const CodecError& e) {
    throw fail(std::string("header names an invalid codec: ") + e.what());
  }
  const uint32_t dtype = get<uint32_t>(in, kOffDType);
  if (!is_valid_dtype(dtype)) throw fail("unknown element type " + std::to_string(dtype));
  h.dtype = static_cast<DType>(dtype);
  h.count = get<uint64_t>(in, kOffCount);
  if (h.count > kMaxLayerElements) throw fail("element count " + std::to_string(h.count) + " exceeds 2^34");
  h.noise.seed = get<uint64_t>(in, kOffSeed);
  h.noise.step = get<uint64_t>(in, kOffStep);
  h.noise.rank = get<uint32_t>(in, kOffRank);
  h.noise.layer = get<uint32_t>(in, kOffLayer);

  const uint64_t payload_bytes = get<uint64_t>(in, kOffPayloadBytes);
  const uint64_t expected = Codec::create(h.spec, h.dtype)->encoded_bytes(h.count);
  if (payload_bytes != expected)
    throw fail("payload size " + std::to_string(payload_bytes) + " does not match " + h.spec.str() + " for " +
               std::to_string(h.count) + " values (" + std::to_string(expected) + " bytes)");
  const uint64_t available = in.size() - header_bytes;
  if (available < payload_bytes)
    throw fail("truncated payload: " + std::to_string(available) + " of " + std::to_string(payload_bytes) + " bytes");
  if (available > payload_bytes)
    throw fail(std::to_string(available - payload_bytes) + " unexpected bytes after the payload");
  const auto payload = in.subspan(header_bytes, payload_bytes);
  if (crc32c(payload) != get<uint32_t>(in, header_bytes - 8))
    throw fail("payload checksum mismatch: the file is corrupt");
  file.payload.assign(payload.begin(), payload.end());
  return file;
}

}  // namespace lgreco
