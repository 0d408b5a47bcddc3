// What the engine needs to know about a gradient bucket: its element type and count, and
// the layers it is made of, each with the codecs it may use. Built from a registered
// bucket (config/registration.h) or an auto-mode layout; nothing here knows the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"

namespace lgreco::collective {

struct LayerLayout {
  std::string name;
  uint64_t offset = 0;  // elements, within the bucket
  uint64_t numel = 0;
  // The codecs this layer may use; candidates[default_index] is its default. One
  // candidate: the layer's codec is fixed (a `never` layer has {none}, a pinned one its
  // codec); more: the L-GreCo controller chooses among them.
  std::vector<CodecSpec> candidates;
  uint32_t default_index = 0;
  // The layer as a matrix for low-rank codecs: rows = its shape's first dimension, the
  // columns the rest (numel / rows). 0: no shape (an auto-mode segment, a 1-D tensor), and
  // then no powersgd candidate.
  uint64_t rows = 0;

  bool adaptive() const { return candidates.size() > 1; }
};

struct BucketLayout {
  uint64_t count = 0;  // elements of the allreduce call
  DType dtype = DType::kFloat32;
  std::vector<LayerLayout> layers;  // contiguous, in offset order, covering [0, count)
};

// Throws std::invalid_argument naming the bucket and layer when layers are out of order,
// overlap, leave gaps, do not cover the count, have no candidates, or have a powersgd
// candidate without rows that divide numel.
void validate(const BucketLayout& bucket, size_t bucket_index);

}  // namespace lgreco::collective
