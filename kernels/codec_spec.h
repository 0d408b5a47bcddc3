// Codec spec strings: the one way a codec is named everywhere (CLI, environment,
// registration file, logs).
//
//   none
//   quant[:bits=B][,bucket=N][,rounding=stochastic|nearest]
//   topk[:density=D]
//   powersgd[:rank=R][,rows=N]
//
// A family name, then optional comma-separated key=value pairs; missing keys take their
// defaults. `CodecSpec::str()` prints the canonical form with every key, so a parsed spec
// round-trips. Each family is one alternative of `Params`.
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

// TopK sparsification (docs/FORMAT.md): the k = ceil(density x count) values of largest
// magnitude, with their indices. The density is a decimal with at most 9 digits after
// the point, kept exactly as parts per billion, so that k is exact integer arithmetic
// (the same on every rank, the host and the GPU) and the spec prints back as written.
struct TopkParams {
  static constexpr uint64_t kPartsPerUnit = 1'000'000'000;
  uint32_t density_ppb = 10'000'000;  // 1%; in 1..kPartsPerUnit

  // k of `count` values: ceil(count x density), at least 1 for a non-empty slice.
  constexpr uint64_t k(uint64_t count) const {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(count) * density_ppb + kPartsPerUnit - 1) /
                                 kPartsPerUnit);
  }
  constexpr double density() const { return static_cast<double>(density_ppb) / static_cast<double>(kPartsPerUnit); }
  void validate() const;
  friend bool operator==(const TopkParams&, const TopkParams&) = default;
};

// PowerSGD low-rank compression (docs/FORMAT.md, kernels/lowrank.h): a layer viewed as an
// n x m matrix M (n = rows, m = count / n) is sent as two factors of rank R. `rows` = 0
// (the default, and the only value the engine accepts) takes n from the layer's
// registered shape; a fixed `rows` names the view of a standalone encoding (lgreco-codec
// --shape, an .lgc file), where no registration exists.
struct PowersgdParams {
  static constexpr uint32_t kMinRank = 1;
  static constexpr uint32_t kMaxRank = 256;
  uint32_t rank = 4;
  uint64_t rows = 0;

  void validate() const;
  friend bool operator==(const PowersgdParams&, const PowersgdParams&) = default;
};

enum class CodecFamily : uint8_t { kNone = 0, kQuant = 1, kTopk = 2, kPowersgd = 3 };

struct CodecSpec {
  using Params = std::variant<NoneParams, QuantParams, TopkParams, PowersgdParams>;  // index == CodecFamily
  Params params;

  // Parses a spec string; throws CodecError quoting the spec and naming the bad part.
  static CodecSpec parse(std::string_view text);
  static CodecSpec none() { return CodecSpec{NoneParams{}}; }
  static CodecSpec quant(const QuantParams& p);  // validates
  static CodecSpec topk(const TopkParams& p);    // validates
  static CodecSpec powersgd(const PowersgdParams& p);  // validates

  CodecFamily family() const { return static_cast<CodecFamily>(params.index()); }
  const QuantParams& quant_params() const { return std::get<QuantParams>(params); }
  const TopkParams& topk_params() const { return std::get<TopkParams>(params); }
  const PowersgdParams& powersgd_params() const { return std::get<PowersgdParams>(params); }
  std::string str() const;  // canonical form
  friend bool operator==(const CodecSpec&, const CodecSpec&) = default;
};

const char* family_name(CodecFamily f);
const char* rounding_name(Rounding r);
// "" when `spec` may name a layer's codec in training, else why not: powersgd with rows=
// (a standalone encoding's matrix view; in training each layer's registered shape gives
// it).
std::string training_spec_problem(const CodecSpec& spec);
// "0.01" for 10,000,000 parts per billion: the shortest decimal that parses back.
std::string density_text(uint32_t density_ppb);

}  // namespace lgreco
