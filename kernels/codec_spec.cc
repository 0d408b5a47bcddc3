#include "kernels/codec_spec.h"

#include <charconv>
#include <string>
#include <vector>

namespace lgreco {
namespace {

std::string quoted(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q.push_back('"');
  q.append(s);
  q.push_back('"');
  return q;
}

[[noreturn]] void fail(std::string_view spec, const std::string& what) {
  throw CodecError("codec spec " + quoted(spec) + ": " + what);
}

// Decimal digits only: no sign, no spaces, no suffix, no overflow.
bool parse_unsigned(std::string_view text, uint64_t* value) {
  if (text.empty() || text.size() > 19) return false;
  for (char c : text)
    if (c < '0' || c > '9') return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *value);
  return ec == std::errc() && end == text.data() + text.size();
}

struct KeyValue {
  std::string_view key;
  std::string_view value;
};

std::vector<KeyValue> split_options(std::string_view spec, std::string_view options) {
  std::vector<KeyValue> pairs;
  if (options.empty()) fail(spec, "nothing after ':'; expected key=value pairs or no ':'");
  size_t start = 0;
  while (start <= options.size()) {
    size_t comma = options.find(',', start);
    if (comma == std::string_view::npos) comma = options.size();
    const std::string_view item = options.substr(start, comma - start);
    const size_t eq = item.find('=');
    if (item.empty()) fail(spec, "empty option between commas");
    if (eq == std::string_view::npos) fail(spec, "option " + quoted(item) + " is not of the form key=value");
    KeyValue kv{item.substr(0, eq), item.substr(eq + 1)};
    if (kv.key.empty()) fail(spec, "option " + quoted(item) + " has no key");
    if (kv.value.empty()) fail(spec, "option " + quoted(kv.key) + " has no value");
    for (const KeyValue& seen : pairs)
      if (seen.key == kv.key) fail(spec, "option " + quoted(kv.key) + " is given twice");
    pairs.push_back(kv);
    start = comma + 1;
  }
  return pairs;
}

QuantParams parse_quant(std::string_view spec, const std::vector<KeyValue>& options) {
  QuantParams p;
  for (const KeyValue& kv : options) {
    uint64_t number = 0;
    if (kv.key == "bits") {
      if (!parse_unsigned(kv.value, &number) || number < QuantParams::kMinBits || number > QuantParams::kMaxBits)
        fail(spec, "bits=" + std::string(kv.value) + " is out of range; expected an integer " +
                       std::to_string(QuantParams::kMinBits) + ".." + std::to_string(QuantParams::kMaxBits));
      p.bits = static_cast<int>(number);
    } else if (kv.key == "bucket") {
      if (!parse_unsigned(kv.value, &number) || number < QuantParams::kMinBucket || number > QuantParams::kMaxBucket ||
          number % QuantParams::kBucketMultiple != 0)
        fail(spec, "bucket=" + std::string(kv.value) + " is invalid; expected a multiple of " +
                       std::to_string(QuantParams::kBucketMultiple) + " in " + std::to_string(QuantParams::kMinBucket) +
                       ".." + std::to_string(QuantParams::kMaxBucket));
      p.bucket = static_cast<uint32_t>(number);
    } else if (kv.key == "rounding") {
      if (kv.value == "stochastic")
        p.rounding = Rounding::kStochastic;
      else if (kv.value == "nearest")
        p.rounding = Rounding::kNearest;
      else
        fail(spec, "rounding=" + std::string(kv.value) + " is unknown; expected stochastic or nearest");
    } else {
      fail(spec, "unknown option " + quoted(kv.key) + " for quant; expected bits, bucket or rounding");
    }
  }
  return p;
}

// A decimal in (0, 1] with at most 9 digits after the point, as parts per billion:
// "0.01", "1", "1.0" and "0.000000001" parse; ".5", "1.", "1e-3", "-0.1", "0" and
// "0.0000000001" do not.
bool parse_density(std::string_view text, uint32_t* ppb) {
  const size_t dot = text.find('.');
  const std::string_view whole = text.substr(0, dot);
  const std::string_view fraction = dot == std::string_view::npos ? std::string_view{} : text.substr(dot + 1);
  if (whole.empty() || (dot != std::string_view::npos && fraction.empty())) return false;
  if (fraction.size() > 9 || whole.size() > 9) return false;
  uint64_t w = 0, f = 0;
  if (!parse_unsigned(whole, &w)) return false;
  if (!fraction.empty() && !parse_unsigned(fraction, &f)) return false;
  for (size_t i = fraction.size(); i < 9; ++i) f *= 10;
  const uint64_t value = w * TopkParams::kPartsPerUnit + f;
  if (value == 0 || value > TopkParams::kPartsPerUnit) return false;
  *ppb = static_cast<uint32_t>(value);
  return true;
}

TopkParams parse_topk(std::string_view spec, const std::vector<KeyValue>& options) {
  TopkParams p;
  for (const KeyValue& kv : options) {
    if (kv.key == "density") {
      if (!parse_density(kv.value, &p.density_ppb))
        fail(spec, "density=" + std::string(kv.value) +
                       " is invalid; expected a decimal in (0, 1] with at most 9 digits after the point, "
                       "such as 0.01");
    } else {
      fail(spec, "unknown option " + quoted(kv.key) + " for topk; expected density");
    }
  }
  return p;
}

PowersgdParams parse_powersgd(std::string_view spec, const std::vector<KeyValue>& options) {
  PowersgdParams p;
  for (const KeyValue& kv : options) {
    uint64_t number = 0;
    if (kv.key == "rank") {
      if (!parse_unsigned(kv.value, &number) || number < PowersgdParams::kMinRank || number > PowersgdParams::kMaxRank)
        fail(spec, "rank=" + std::string(kv.value) + " is out of range; expected an integer " +
                       std::to_string(PowersgdParams::kMinRank) + ".." + std::to_string(PowersgdParams::kMaxRank));
      p.rank = static_cast<uint32_t>(number);
    } else if (kv.key == "rows") {
      if (!parse_unsigned(kv.value, &number) || number == 0 || number > (uint64_t{1} << 32))
        fail(spec, "rows=" + std::string(kv.value) + " is invalid; expected an integer 1..4294967296");
      p.rows = number;
    } else {
      fail(spec, "unknown option " + quoted(kv.key) + " for powersgd; expected rank or rows");
    }
  }
  return p;
}

}  // namespace

void PowersgdParams::validate() const {
  if (rank < kMinRank || rank > kMaxRank)
    throw CodecError("powersgd: rank=" + std::to_string(rank) + " is out of range " + std::to_string(kMinRank) + ".." +
                     std::to_string(kMaxRank));
  if (rows > (uint64_t{1} << 32)) throw CodecError("powersgd: rows=" + std::to_string(rows) + " is too large");
}

CodecSpec CodecSpec::powersgd(const PowersgdParams& p) {
  p.validate();
  return CodecSpec{p};
}

std::string training_spec_problem(const CodecSpec& spec) {
  if (spec.family() == CodecFamily::kPowersgd && spec.powersgd_params().rows != 0)
    return "codec spec \"" + spec.str() +
           "\": rows= is for standalone encodings (lgreco-codec --shape); in training each layer's registered "
           "shape gives its rows";
  return "";
}

std::string density_text(uint32_t ppb) {
  if (ppb >= TopkParams::kPartsPerUnit) return "1";
  std::string digits = std::to_string(ppb);
  digits.insert(0, 9 - digits.size(), '0');
  while (!digits.empty() && digits.back() == '0') digits.pop_back();
  return "0." + digits;
}

void TopkParams::validate() const {
  if (density_ppb == 0 || density_ppb > kPartsPerUnit)
    throw CodecError("topk: density " + std::to_string(density_ppb) + " parts per billion is outside (0, 1]");
}

CodecSpec CodecSpec::topk(const TopkParams& p) {
  p.validate();
  return CodecSpec{p};
}

void QuantParams::validate() const {
  if (bits < kMinBits || bits > kMaxBits)
    throw CodecError("quant: bits=" + std::to_string(bits) + " is out of range 1..8");
  if (bucket < kMinBucket || bucket > kMaxBucket || bucket % kBucketMultiple != 0)
    throw CodecError("quant: bucket=" + std::to_string(bucket) + " must be a multiple of 32 in 32.." +
                     std::to_string(kMaxBucket));
  if (rounding != Rounding::kStochastic && rounding != Rounding::kNearest)
    throw CodecError("quant: invalid rounding mode");
}

CodecSpec CodecSpec::quant(const QuantParams& p) {
  p.validate();
  return CodecSpec{p};
}

CodecSpec CodecSpec::parse(std::string_view text) {
  const size_t colon = text.find(':');
  const std::string_view family = text.substr(0, colon);
  const bool has_options = colon != std::string_view::npos;
  const std::vector<KeyValue> options =
      has_options ? split_options(text, text.substr(colon + 1)) : std::vector<KeyValue>{};
  if (family == "none") {
    if (has_options) fail(text, "none takes no options");
    return none();
  }
  if (family == "quant") return CodecSpec{parse_quant(text, options)};
  if (family == "topk") return CodecSpec{parse_topk(text, options)};
  if (family == "powersgd") return CodecSpec{parse_powersgd(text, options)};
  if (family.empty()) fail(text, "missing codec family; expected none, quant, topk or powersgd");
  fail(text, "unknown codec family " + quoted(family) + "; expected none, quant, topk or powersgd");
}

std::string CodecSpec::str() const {
  switch (family()) {
    case CodecFamily::kNone: return "none";
    case CodecFamily::kQuant: {
      const QuantParams& p = quant_params();
      return "quant:bits=" + std::to_string(p.bits) + ",bucket=" + std::to_string(p.bucket) +
             ",rounding=" + rounding_name(p.rounding);
    }
    case CodecFamily::kTopk: return "topk:density=" + density_text(topk_params().density_ppb);
    case CodecFamily::kPowersgd: {
      const PowersgdParams& p = powersgd_params();
      return "powersgd:rank=" + std::to_string(p.rank) + (p.rows ? ",rows=" + std::to_string(p.rows) : "");
    }
  }
  return "invalid";
}

const char* family_name(CodecFamily f) {
  switch (f) {
    case CodecFamily::kNone: return "none";
    case CodecFamily::kQuant: return "quant";
    case CodecFamily::kTopk: return "topk";
    case CodecFamily::kPowersgd: return "powersgd";
  }
  return "invalid";
}

const char* rounding_name(Rounding r) { return r == Rounding::kNearest ? "nearest" : "stochastic"; }

}  // namespace lgreco
