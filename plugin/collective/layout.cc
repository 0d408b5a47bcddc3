#include "plugin/collective/layout.h"

#include <stdexcept>
#include <string>

#include "kernels/noise.h"

namespace lgreco::collective {

void validate(const BucketLayout& bucket, size_t bucket_index) {
  const std::string where = "bucket " + std::to_string(bucket_index);
  uint64_t next = 0;
  for (size_t l = 0; l < bucket.layers.size(); ++l) {
    const LayerLayout& layer = bucket.layers[l];
    const std::string at = where + " layer " + std::to_string(l) + " (" + layer.name + ")";
    if (layer.offset != next)
      throw std::invalid_argument(at + ": offset " + std::to_string(layer.offset) + ", expected " +
                                  std::to_string(next) + " (layers must be contiguous, in order)");
    if (layer.numel == 0) throw std::invalid_argument(at + ": no elements");
    if (layer.numel > kMaxLayerElements)  // the rounding noise counts elements in 34 bits
      throw std::invalid_argument(at + ": " + std::to_string(layer.numel) + " elements; at most " +
                                  std::to_string(kMaxLayerElements) + " per layer");
    if (layer.candidates.empty() || layer.default_index >= layer.candidates.size())
      throw std::invalid_argument(at + ": no codec, or the default is not among its candidates");
    for (const CodecSpec& c : layer.candidates)
      if (c.family() == CodecFamily::kPowersgd &&
          (layer.rows == 0 || layer.numel % layer.rows != 0 || c.powersgd_params().rows != 0))
        throw std::invalid_argument(at + ": " + c.str() + " needs the layer's rows (" + std::to_string(layer.rows) +
                                    ") to divide its " + std::to_string(layer.numel) +
                                    " elements, and takes no rows= of its own");
    next = layer.offset + layer.numel;
  }
  if (next != bucket.count)
    throw std::invalid_argument(where + ": layers cover " + std::to_string(next) + " elements of " +
                                std::to_string(bucket.count));
}

}  // namespace lgreco::collective
