// The registration file: which layers make up each gradient bucket a framework
// allreduces (docs/REGISTRATION.md). The shim sees only (pointer, count, dtype); this
// file gives it the layers, their shapes and how each may be compressed.
//
//   {"version": 1, "model": "mlp", "buckets": [
//     {"count": 4195328, "dtype": "float32", "layers": [
//       {"name": "fc2.weight", "offset": 0, "numel": 4194304, "shape": [1024, 4096]},
//       {"name": "fc2.bias", "offset": 4194304, "numel": 1024, "shape": [1024], "compress": "never"}]}]}
//
// Parsing is strict and every error names the file, the JSON path and the problem.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"

namespace lgreco::config {

class RegistrationError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The `compress` field of a layer, as written.
struct CompressRule {
  enum class Kind : uint8_t { kAuto, kNever, kPinned };
  Kind kind = Kind::kAuto;
  CodecSpec codec;  // kPinned: the codec every step uses for this layer
  std::string str() const;  // "auto", "never" or the canonical codec spec
};

struct RegisteredLayer {
  std::string name;
  uint64_t offset = 0;  // in elements, within the bucket
  uint64_t numel = 0;
  // The tensor's shape. Layers that lgreco made up itself (auto-mode segments) have
  // none: has_shape is false, and nothing shape-dependent (low rank) applies to them.
  std::vector<uint64_t> shape;
  bool has_shape = true;
  CompressRule compress;
};

struct RegisteredBucket {
  uint64_t count = 0;  // elements of the allreduce call
  DType dtype = DType::kFloat32;
  std::vector<RegisteredLayer> layers;  // contiguous, in offset order
};

struct Registration {
  static constexpr int kVersion = 1;
  // Larger counts are surely a mistake, and keep every sum of counts far from overflow.
  static constexpr uint64_t kMaxCount = uint64_t{1} << 48;
  // The matcher learns the call pattern from its last few thousand calls.
  static constexpr size_t kMaxBuckets = 4096;
  static constexpr size_t kMaxFileBytes = size_t{256} << 20;

  std::string source;  // file name, for messages
  std::string model;
  std::vector<RegisteredBucket> buckets;  // in the order the framework calls them each step

  size_t layer_count() const;
};

// Parses and validates a registration document. `source` names it in messages
// ("resnet50.json: buckets[3].layers[2] (layer1.0.conv2.weight).offset: ...").
Registration parse_registration(std::string_view text, const std::string& source);
// Reads and parses a file; a file that cannot be read is a RegistrationError too.
Registration load_registration(const std::string& path);

// Checks the invariants parse_registration guarantees (for registrations built in code,
// such as auto-mode layouts): contiguous layers covering exactly `count`, shapes whose
// product is numel, unique names, at most kMaxBuckets buckets, and a sequence of counts
// and dtypes that tells the buckets apart (if it repeats with a shorter period, the
// buckets it confuses must have the same layers). Throws RegistrationError.
void validate(const Registration& registration);

// ---------------------------------------------------------------------------------------
// Which layers are compressed when `compress` is `auto`.

// CGX's rule: tensors with one dimension (biases, norms) and tensors under 1024 elements
// carry little of the traffic and much of the sensitivity; they stay uncompressed.
inline constexpr uint64_t kMinCompressedElements = 1024;

struct LayerPolicy {
  enum class Kind : uint8_t { kAdaptive, kNever, kPinned };
  Kind kind = Kind::kAdaptive;
  CodecSpec codec;               // kPinned
  const char* reason = nullptr;  // kNever: why, for logs and `lgreco-config check`
};
LayerPolicy layer_policy(const RegisteredLayer& layer);

// The L-GreCo reference's rule for low-rank compression: a layer viewed as an n x m
// matrix (n = shape[0], m = numel / n) is worth compressing at rank r only when
// (n + m) * r * 2 < n * m. False for layers with fewer than two dimensions or no shape.
bool low_rank_pays_off(const RegisteredLayer& layer, uint64_t rank);

}  // namespace lgreco::config
