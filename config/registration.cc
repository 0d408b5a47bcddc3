#include "config/registration.h"

#include <map>

#include "config/json_strict.h"
#include "config/text_file.h"

namespace lgreco::config {

namespace {

std::string num(uint64_t v) { return std::to_string(v); }

// "buckets[0].layers[1] (fc2.bias)": the path, and the name once it is known.
std::string layer_label(size_t bucket, size_t layer, const std::string& name) {
  std::string label = "buckets[" + num(bucket) + "].layers[" + num(layer) + "]";
  if (!name.empty()) label += " (" + name + ")";
  return label;
}

CompressRule parse_compress(const std::string& text, const std::string& path) {
  CompressRule rule;
  if (text == "auto") return rule;
  if (text == "never") {
    rule.kind = CompressRule::Kind::kNever;
    return rule;
  }
  try {
    rule.codec = CodecSpec::parse(text);
  } catch (const CodecError& e) {
    throw JsonError(path + ": " + e.what() + " (expected \"auto\", \"never\" or a codec spec)");
  }
  if (const std::string problem = training_spec_problem(rule.codec); !problem.empty())
    throw JsonError(path + ": " + problem);
  rule.kind = CompressRule::Kind::kPinned;
  return rule;
}

std::vector<uint64_t> parse_shape(const json& layer, const std::string& path) {
  const json& shape = array_field(layer, "shape", path);
  std::vector<uint64_t> dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    const json& dim = shape[d];
    const std::string p = path + ".shape[" + num(d) + "]";
    if (!dim.is_number_unsigned()) throw JsonError(p + ": " + json_shown(dim) + "; expected a non-negative integer");
    dims.push_back(dim.get<uint64_t>());
  }
  return dims;
}

RegisteredLayer parse_layer(const json& j, size_t bucket, size_t index) {
  std::string path = layer_label(bucket, index, "");
  expect_object(j, path);
  RegisteredLayer layer;
  layer.name = string_field(j, "name", path, std::nullopt);
  if (layer.name.empty()) throw JsonError(path + ".name: empty; every layer needs a name");
  path = layer_label(bucket, index, layer.name);
  expect_keys(j, path, {"name", "offset", "numel", "shape", "compress"});
  layer.offset = unsigned_field(j, "offset", path, std::nullopt);
  layer.numel = unsigned_field(j, "numel", path, std::nullopt);
  layer.shape = parse_shape(j, path);
  layer.compress = parse_compress(string_field(j, "compress", path, "auto"), path + ".compress");
  return layer;
}

RegisteredBucket parse_bucket(const json& j, size_t index) {
  const std::string path = "buckets[" + num(index) + "]";
  expect_object(j, path);
  expect_keys(j, path, {"count", "dtype", "layers"});
  RegisteredBucket bucket;
  bucket.count = unsigned_field(j, "count", path, std::nullopt);
  const std::string dtype = string_field(j, "dtype", path, std::nullopt);
  const std::optional<DType> parsed = parse_dtype(dtype);
  if (!parsed)
    throw JsonError(path + ".dtype: \"" + dtype + "\" is not a dtype lgreco compresses (float32, float16, bfloat16)");
  bucket.dtype = *parsed;
  const json& layers = array_field(j, "layers", path);
  for (size_t l = 0; l < layers.size(); ++l) bucket.layers.push_back(parse_layer(layers[l], index, l));
  return bucket;
}

// Multiplies the dimensions, or returns false past 2^64.
bool shape_product(const std::vector<uint64_t>& shape, uint64_t* product) {
  uint64_t p = 1;
  for (uint64_t d : shape)
    if (__builtin_mul_overflow(p, d, &p)) return false;
  *product = p;
  return true;
}

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + num(shape[i]);
  return s + "]";
}

void validate_bucket(const RegisteredBucket& bucket, size_t b, std::map<std::string, std::string>* names) {
  const std::string path = "buckets[" + num(b) + "]";
  if (bucket.count == 0) throw JsonError(path + ".count: 0; a bucket holds at least one element");
  if (bucket.count > Registration::kMaxCount)
    throw JsonError(path + ".count: " + num(bucket.count) + " is larger than lgreco accepts (2^48)");
  if (bucket.layers.empty()) throw JsonError(path + ".layers: empty; a bucket holds at least one layer");
  uint64_t next = 0;  // where the next layer must begin
  for (size_t l = 0; l < bucket.layers.size(); ++l) {
    const RegisteredLayer& layer = bucket.layers[l];
    const std::string label = layer_label(b, l, layer.name);
    if (layer.name.empty()) throw JsonError(label + ".name: empty; every layer needs a name");
    const auto [seen, fresh] = names->emplace(layer.name, label);
    if (!fresh) throw JsonError(label + ".name: \"" + layer.name + "\" is also the name of " + seen->second);
    if (layer.numel == 0) throw JsonError(label + ".numel: 0; a layer holds at least one element");
    if (layer.offset != next) {
      const std::string previous = l == 0 ? "" : layer_label(b, l - 1, bucket.layers[l - 1].name);
      if (l == 0) throw JsonError(label + ".offset: " + num(layer.offset) + "; the first layer must begin at 0");
      if (layer.offset < bucket.layers[l - 1].offset)
        throw JsonError(label + ".offset: " + num(layer.offset) + " is out of order (before " + previous +
                        " at " + num(bucket.layers[l - 1].offset) + "); list layers in offset order");
      if (layer.offset < next)
        throw JsonError(label + ".offset: " + num(layer.offset) + " overlaps " + previous + ", which ends at " +
                        num(next));
      throw JsonError(label + ".offset: " + num(layer.offset) + " leaves a gap of " + num(layer.offset - next) +
                      " elements after " + previous + ", which ends at " + num(next));
    }
    if (layer.numel > bucket.count - next)
      throw JsonError(label + ".numel: " + num(layer.numel) + " runs past the bucket's count (" + num(bucket.count) +
                      ")");
    next += layer.numel;
    if (layer.has_shape) {
      uint64_t product = 0;
      const bool fits = shape_product(layer.shape, &product);
      if (!fits || product != layer.numel)
        throw JsonError(label + ".shape: " + shape_text(layer.shape) + " holds " +
                        (fits ? num(product) : std::string("more than 2^64")) + " elements, but numel is " +
                        num(layer.numel));
    }
    if (layer.compress.kind == CompressRule::Kind::kPinned && layer.compress.codec.family() == CodecFamily::kPowersgd &&
        (!layer.has_shape || layer.shape.size() < 2 || layer.shape[0] == 0))
      throw JsonError(label + ".compress: " + layer.compress.codec.str() +
                      " needs the layer as a matrix: give it a shape of two or more dimensions");
  }
  if (next != bucket.count)
    throw JsonError(path + ": the layers hold " + num(next) + " elements, but count is " + num(bucket.count));
}

bool same_layers(const RegisteredBucket& a, const RegisteredBucket& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const RegisteredLayer &x = a.layers[l], &y = b.layers[l];
    if (x.numel != y.numel || x.shape != y.shape || x.has_shape != y.has_shape || x.compress.str() != y.compress.str())
      return false;
  }
  return true;
}

// The matcher finds where a step begins from the sequence of counts and dtypes. If that
// sequence repeats with a shorter period (buckets 0 and r alike, 1 and r+1, ...), calls
// alone cannot tell bucket j from bucket j+r; that is harmless only if their layers are
// alike too.
void check_rotations(const std::vector<RegisteredBucket>& buckets) {
  const size_t n = buckets.size();
  for (size_t r = 1; r < n; ++r) {
    if (n % r != 0) continue;  // a rotation maps the sequence onto itself only for divisors
    bool kinds_repeat = true, layers_repeat = true;
    for (size_t b = 0; b < n && kinds_repeat; ++b) {
      const RegisteredBucket &x = buckets[b], &y = buckets[(b + r) % n];
      kinds_repeat = x.count == y.count && x.dtype == y.dtype;
      layers_repeat = layers_repeat && same_layers(x, y);
    }
    if (kinds_repeat && !layers_repeat)
      throw JsonError("buckets: the counts and dtypes repeat every " + num(r) + " bucket" + (r == 1 ? "" : "s") +
                      " but the layers do not, so a call cannot tell buckets[0] from buckets[" + num(r) +
                      "]; register each bucket's layers in one file per layout, or keep the buckets' counts apart "
                      "(DDP's bucket_cap_mb)");
  }
}

void validate_all(const Registration& registration) {
  if (registration.buckets.empty()) throw JsonError("buckets: empty; a registration needs at least one bucket");
  if (registration.buckets.size() > Registration::kMaxBuckets)
    throw JsonError("buckets: " + num(registration.buckets.size()) + " buckets; lgreco accepts at most " +
                    num(Registration::kMaxBuckets));
  std::map<std::string, std::string> names;
  for (size_t b = 0; b < registration.buckets.size(); ++b) validate_bucket(registration.buckets[b], b, &names);
  check_rotations(registration.buckets);
}

std::string prefixed(const std::string& source, const char* what) {
  return source.empty() ? std::string(what) : source + ": " + what;
}

}  // namespace

std::string CompressRule::str() const {
  switch (kind) {
    case Kind::kAuto: return "auto";
    case Kind::kNever: return "never";
    case Kind::kPinned: return codec.str();
  }
  return "?";
}

size_t Registration::layer_count() const {
  size_t n = 0;
  for (const RegisteredBucket& b : buckets) n += b.layers.size();
  return n;
}

Registration parse_registration(std::string_view text, const std::string& source) {
  try {
    const json root = parse_strict_json(text);
    expect_object(root, "");
    expect_keys(root, "", {"version", "model", "generator", "buckets"});
    const uint64_t version = unsigned_field(root, "version", "", std::nullopt);
    if (version != Registration::kVersion)
      throw JsonError("version: " + num(version) + "; this lgreco reads version " + num(Registration::kVersion));
    Registration registration;
    registration.source = source;
    registration.model = string_field(root, "model", "", "");
    if (const json* generator = find_field(root, "generator", "", false)) expect_object(*generator, "generator");
    const json& buckets = array_field(root, "buckets", "");
    for (size_t b = 0; b < buckets.size(); ++b) registration.buckets.push_back(parse_bucket(buckets[b], b));
    validate_all(registration);
    return registration;
  } catch (const JsonError& e) {
    throw RegistrationError(prefixed(source, e.what()));
  }
}

Registration load_registration(const std::string& path) {
  const TextFile file = read_text_file(path, Registration::kMaxFileBytes);
  switch (file.status) {
    case TextFile::Status::kOk: return parse_registration(file.text, path);
    case TextFile::Status::kCannotOpen: throw RegistrationError(path + ": cannot open: " + file.error);
    case TextFile::Status::kCannotRead: throw RegistrationError(path + ": cannot read: " + file.error);
    case TextFile::Status::kTooLarge: break;
  }
  throw RegistrationError(path + ": larger than " + num(Registration::kMaxFileBytes >> 20) +
                          " MiB; not a registration file");
}

void validate(const Registration& registration) {
  try {
    validate_all(registration);
  } catch (const JsonError& e) {
    throw RegistrationError(prefixed(registration.source, e.what()));
  }
}

LayerPolicy layer_policy(const RegisteredLayer& layer) {
  LayerPolicy policy;
  switch (layer.compress.kind) {
    case CompressRule::Kind::kNever:
      policy.kind = LayerPolicy::Kind::kNever;
      policy.reason = "registered as never";
      return policy;
    case CompressRule::Kind::kPinned:
      policy.kind = LayerPolicy::Kind::kPinned;
      policy.codec = layer.compress.codec;
      return policy;
    case CompressRule::Kind::kAuto: break;
  }
  if (layer.has_shape && layer.shape.size() <= 1) {
    policy.kind = LayerPolicy::Kind::kNever;
    policy.reason = layer.shape.empty() ? "a scalar" : "one dimension";
  } else if (layer.numel < kMinCompressedElements) {
    policy.kind = LayerPolicy::Kind::kNever;
    policy.reason = "under 1024 elements";
  }
  return policy;
}

bool low_rank_pays_off(const RegisteredLayer& layer, uint64_t rank) {
  if (!layer.has_shape || layer.shape.size() < 2 || layer.shape[0] == 0) return false;
  const unsigned __int128 n = layer.shape[0];
  const unsigned __int128 m = layer.numel / layer.shape[0];
  return (n + m) * rank * 2 < n * m;
}

}  // namespace lgreco::config
