// Codec spec strings: the one way a codec is named everywhere (CLI, environment,
// registration file, logs).
//
//   none
//   quant[:bits=B][,bucket=N][,rounding=stochastic|nearest]
//
// A family name, then optional comma-separated key=value pairs; missing keys take their
// defaults. `CodecSpec::str()` prints the canonical form with every key, so a parsed spec
// round-trips. Later families (topk, powersgd) add an alternative to `Params`.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>

namespace lgreco {

// Every error a codec reports about its input: a bad spec, a buffer too small, a corrupt
// or foreign file. The message names what is wrong and where.
class CodecError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Rounding : uint8_t { kStochastic, kNearest };

struct NoneParams {
  friend bool operator==(const NoneParams&, const NoneParams&) = default;
};

// Max-min bucketed quantization (docs/FORMAT.md).
struct QuantParams {
  static constexpr int kMinBits = 1;
  static constexpr int kMaxBits = 8;
  // Buckets are whole groups of 32 elements, so that one bucket's codes never share a
  // 32-bit word with another's (a CUDA block owns its bucket's words).
  static constexpr uint32_t kBucketMultiple = 32;
  static constexpr uint32_t kMinBucket = 32;
  static constexpr uint32_t kMaxBucket = uint32_t{1} << 20;

  int bits = 4;
  uint32_t bucket = 1024;
  Rounding rounding = Rounding::kStochastic;

  // Throws CodecError naming the offending field.
  void validate() const;
  friend bool operator==(const QuantParams&, const QuantParams&) = default;
};

enum class CodecFamily : uint8_t { kNone = 0, kQuant = 1 };

struct CodecSpec {
  using Params = std::variant<NoneParams, QuantParams>;  // index == CodecFamily
  Params params;

  // Parses a spec string; throws CodecError quoting the spec and naming the bad part.
  static CodecSpec parse(std::string_view text);
  static CodecSpec none() { return CodecSpec{NoneParams{}}; }
  static CodecSpec quant(const QuantParams& p);  // validates

  CodecFamily family() const { return static_cast<CodecFamily>(params.index()); }
  const QuantParams& quant_params() const { return std::get<QuantParams>(params); }
  std::string str() const;  // canonical form
  friend bool operator==(const CodecSpec&, const CodecSpec&) = default;
};

const char* family_name(CodecFamily f);
const char* rounding_name(Rounding r);

}  // namespace lgreco
