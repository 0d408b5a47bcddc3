#include "plugin/collective/plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "kernels/lowrank.h"
#include "kernels/quant.h"
#include "kernels/topk.h"

namespace lgreco::collective {

Exchange exchange_of(const CodecSpec& spec) {
  switch (spec.family()) {
    case CodecFamily::kTopk: return Exchange::kGather;
    case CodecFamily::kPowersgd: return Exchange::kLowRank;
    default: return Exchange::kReduce;
  }
}

uint64_t split_granule(const CodecSpec& spec) {
  switch (spec.family()) {
    case CodecFamily::kQuant: return spec.quant_params().bucket;
    // Never split (exchange_of): its candidates are measured on whole layers, so it puts
    // no constraint on where another codec's partitions may cut.
    case CodecFamily::kTopk:
    case CodecFamily::kPowersgd: return 1;
    default: return 1024;
  }
}

uint64_t layer_granule(const LayerLayout& layer, const CodecSpec& assigned) {
  uint64_t granule = split_granule(assigned);
  for (const CodecSpec& c : layer.candidates) granule = std::lcm(granule, split_granule(c));
  return granule;
}

uint64_t encoded_bytes(const CodecSpec& spec, DType dtype, const LayerLayout& layer) {
  return encoded_bytes(spec, dtype, layer.numel, layer.rows);
}

uint64_t encoded_bytes(const CodecSpec& spec, DType dtype, uint64_t count, uint64_t rows) {
  switch (spec.family()) {
    case CodecFamily::kNone: return count * dtype_size(dtype);
    case CodecFamily::kQuant: return quant::encoded_bytes(spec.quant_params(), count);
    case CodecFamily::kTopk: return topk::encoded_bytes(spec.topk_params(), count);
    case CodecFamily::kPowersgd: {
      const PowersgdParams& p = spec.powersgd_params();
      const uint64_t n = p.rows ? p.rows : rows;
      if (n == 0 || count % n != 0)
        throw std::invalid_argument("plan: " + spec.str() + " on " + std::to_string(count) +
                                    " elements needs rows that divide them (got " + std::to_string(n) + ")");
      return lowrank::encoded_bytes(lowrank::Shape{n, count / n}, p.rank);
    }
  }
  throw std::invalid_argument("plan: unknown codec family in " + spec.str());
}

std::vector<uint64_t> Plan::partition_bytes() const {
  std::vector<uint64_t> bytes;
  bytes.reserve(partitions.size());
  for (const Partition& p : partitions) bytes.push_back(p.bytes);
  return bytes;
}

namespace {

// Element boundaries of the partitions: boundary p is where the encoded bytes before it
// come closest to p/P of the total, among the points a layer may be split at.
std::vector<uint64_t> partition_boundaries(const BucketLayout& bucket, std::span<const CodecSpec> codecs,
                                           std::span<const uint64_t> layer_bytes, uint64_t total, uint32_t parts) {
  std::vector<uint64_t> bounds(parts + 1, bucket.count);
  bounds[0] = 0;
  size_t layer = 0;
  uint64_t before = 0;  // encoded bytes of the layers before `layer`
  for (uint32_t p = 1; p < parts; ++p) {
    // The target as a fraction of the total; 128-bit so that huge buckets cannot overflow.
    const uint64_t target = static_cast<uint64_t>(static_cast<unsigned __int128>(total) * p / parts);
    while (layer < bucket.layers.size() && before + layer_bytes[layer] <= target) before += layer_bytes[layer++];
    if (layer == bucket.layers.size()) break;  // the rest stay at count
    const LayerLayout& l = bucket.layers[layer];
    const uint64_t granule = layer_granule(l, codecs[layer]);
    const uint64_t granule_bytes = encoded_bytes(codecs[layer], bucket.dtype, granule);
    const uint64_t granules = (l.numel + granule - 1) / granule;
    // Whole granules before the split point, rounded to the nearest.
    uint64_t k = (target - before + granule_bytes / 2) / granule_bytes;
    k = std::min(k, granules);
    bounds[p] = std::max(bounds[p - 1], l.offset + std::min(k * granule, l.numel));
  }
  return bounds;
}

}  // namespace

Plan make_plan(const BucketLayout& bucket, std::span<const CodecSpec> layer_codecs, uint32_t parts,
               std::span<const uint8_t> included) {
  if (layer_codecs.size() != bucket.layers.size())
    throw std::invalid_argument("plan: " + std::to_string(layer_codecs.size()) + " codecs for " +
                                std::to_string(bucket.layers.size()) + " layers");
  if (!included.empty() && included.size() != bucket.layers.size())
    throw std::invalid_argument("plan: " + std::to_string(included.size()) + " inclusion flags for " +
                                std::to_string(bucket.layers.size()) + " layers");
  auto in_plan = [&](size_t l) { return included.empty() || included[l] != 0; };
  if (parts == 0) throw std::invalid_argument("plan: no partitions");
  Plan plan;
  plan.dtype = bucket.dtype;
  std::vector<uint32_t> codec_of(layer_codecs.size());
  std::vector<uint64_t> layer_bytes(layer_codecs.size());
  uint64_t total = 0;
  for (size_t l = 0; l < layer_codecs.size(); ++l) {
    auto it = std::find(plan.codecs.begin(), plan.codecs.end(), layer_codecs[l]);
    if (it == plan.codecs.end()) it = plan.codecs.insert(plan.codecs.end(), layer_codecs[l]);
    codec_of[l] = static_cast<uint32_t>(it - plan.codecs.begin());
    layer_bytes[l] = in_plan(l) ? encoded_bytes(layer_codecs[l], bucket.dtype, bucket.layers[l]) : 0;
    total += layer_bytes[l];
  }

  const std::vector<uint64_t> bounds = partition_boundaries(bucket, layer_codecs, layer_bytes, total, parts);
  size_t layer = 0;
  for (uint32_t p = 0; p < parts; ++p) {
    Partition part;
    part.begin = bounds[p];
    part.end = bounds[p + 1];
    part.first_segment = static_cast<uint32_t>(plan.segments.size());
    while (layer < bucket.layers.size() && bucket.layers[layer].offset + bucket.layers[layer].numel <= part.begin)
      ++layer;
    for (size_t l = layer; l < bucket.layers.size() && bucket.layers[l].offset < part.end; ++l) {
      if (!in_plan(l)) continue;
      const LayerLayout& ll = bucket.layers[l];
      Segment s;
      s.layer = static_cast<uint32_t>(l);
      s.codec = codec_of[l];
      s.offset = std::max(part.begin, ll.offset);
      s.first_element = s.offset - ll.offset;
      s.count = std::min(part.end, ll.offset + ll.numel) - s.offset;
      if (s.count == 0) continue;
      s.byte_offset = part.bytes;
      // Each segment starts on a 4-byte boundary: the CUDA kernels read and write the
      // quantization payload's metadata and code words as 32-bit words. Only `none` on a
      // 16-bit type with an odd count needs the (zero) padding.
      s.bytes = (encoded_bytes(layer_codecs[l], bucket.dtype, s.count, ll.rows) + 3) / 4 * 4;
      part.bytes += s.bytes;
      plan.segments.push_back(s);
    }
    part.segment_count = static_cast<uint32_t>(plan.segments.size()) - part.first_segment;
    plan.total_bytes += part.bytes;
    plan.partitions.push_back(part);
  }
  return plan;
}

}  // namespace lgreco::collective
