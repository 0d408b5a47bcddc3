// What every codec encodes: a run of elements of one layer, and what encoding reports.
#pragma once

#include <cstdint>

namespace lgreco {

// `count` elements that are elements [first_element, first_element + count) of their
// layer. Codecs key their rounding noise on the element's index within the layer, so a
// layer encoded in slices (one per rank's partition, one per CUDA block) gets the same
// noise as the layer encoded whole. The element type belongs to the codec or the call.
struct Slice {
  const void* data = nullptr;
  uint64_t count = 0;
  uint64_t first_element = 0;
};

struct EncodeReport {
  // Buckets holding a NaN or an infinity (after adding the residual). They decode to NaN
  // and keep their residual unchanged, so an AMP overflow step cannot poison later steps.
  uint64_t nonfinite_buckets = 0;
};

}  // namespace lgreco
