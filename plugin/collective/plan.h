// How one call of a bucket is cut into encoded segments and partitions, under one
// assignment of codecs to layers. Pure host-side arithmetic over fixed-rate codec sizes:
// every rank computes the same plan from the same assignment, so every byte count the
// fabric needs is known before any data exists.
//
// A segment is a run of one layer's elements encoded alone with that layer's codec. It
// starts on a codec bucket boundary of its layer (quantization: a multiple of the bucket
// size, counted from the layer's first element), so that its buckets and rounding noise
// are the layer's own: encoding a layer in segments gives the same values as encoding it
// whole.
//
// Partitions split the call's elements into contiguous ranges, one per rank for
// scatter-reduce-allgather (rank p owns partition p), balanced by encoded bytes, not by
// elements: layers at different bit widths make equal element ranges unequal on the wire.
// A plan with one partition encodes the whole call (the all-gather algorithm).
//
//   elements  |--- layer 0 ---|------- layer 1 -------|-- layer 2 --|
//   partition |---- 0 ----|----- 1 -----|------- 2 -------|--- 3 ---|
//   segments  |  s0       | s1| s2      |   s3          |s4|  s5    |
//
// Encoded bytes of a partition are its segments' payloads back to back, in element order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "plugin/collective/layout.h"

namespace lgreco::collective {

struct Segment {
  uint32_t layer = 0;           // index into the bucket's layers
  uint32_t codec = 0;           // index into Plan::codecs
  uint64_t offset = 0;          // first element, within the call
  uint64_t first_element = 0;   // first element, within its layer
  uint64_t count = 0;           // elements
  uint64_t byte_offset = 0;     // within its partition's encoded bytes
  uint64_t bytes = 0;           // encoded payload
};

struct Partition {
  uint64_t begin = 0, end = 0;  // elements of the call: [begin, end)
  uint32_t first_segment = 0, segment_count = 0;
  uint64_t bytes = 0;  // encoded

  uint64_t count() const { return end - begin; }
};

struct Plan {
  DType dtype = DType::kFloat32;
  std::vector<CodecSpec> codecs;  // the distinct codecs the segments use
  std::vector<Segment> segments;  // in element order
  std::vector<Partition> partitions;
  uint64_t total_bytes = 0;  // encoded bytes of the whole call (sum over partitions)

  std::span<const Segment> segments_of(const Partition& p) const {
    return {segments.data() + p.first_segment, p.segment_count};
  }
  std::vector<uint64_t> partition_bytes() const;
};

// How a codec's payloads combine across ranks. A reducible payload (none, quant) can be
// decoded and summed by a partition's owner, who re-encodes the sum (sra). A gathered
// one (topk: a sparse set that another rank's set does not line up with) travels whole
// to every rank, which scatter-adds all of them; its layer is encoded whole, never split
// between partitions.
// A low-rank one (powersgd) is linear in the gradient: its factors are summed with two
// float allreduces, and the layer is never split either.
enum class Exchange : uint8_t { kReduce, kGather, kLowRank };
Exchange exchange_of(const CodecSpec& spec);

// Elements a partition boundary inside a layer must be a multiple of (from the layer's
// first element): the codec's bucket for quantization, 1024 for `none` (keeps payloads
// aligned and segments from being tiny), 1 for gathered and low-rank codecs (never split).
uint64_t split_granule(const CodecSpec& spec);
// The granule of a layer: the least common multiple of its assigned codec's and every
// candidate's, so that a segment is whole buckets of every candidate too and the engine
// can measure candidates on the segments it owns.
uint64_t layer_granule(const LayerLayout& layer, const CodecSpec& assigned);

// Encoded bytes of `count` elements of `dtype` under `spec`. PowerSGD needs the matrix
// view: rows = 0 takes the spec's own rows; throws std::invalid_argument if neither
// gives rows that divide count.
uint64_t encoded_bytes(const CodecSpec& spec, DType dtype, uint64_t count, uint64_t rows = 0);
// A whole layer's encoded bytes under `spec` (its rows for low rank).
uint64_t encoded_bytes(const CodecSpec& spec, DType dtype, const LayerLayout& layer);

// The plan of `bucket` with codec layer_codecs[l] for layer l, cut into `partitions`
// ranges (>= 1) of near-equal encoded bytes. Some partitions may be empty when the
// bucket is small. With `included` (one byte per layer), only the layers marked 1 get
// segments and bytes; the others are left out of the plan (another exchange carries
// them) but still lie inside the partitions' element ranges. Throws
// std::invalid_argument on a size mismatch.
Plan make_plan(const BucketLayout& bucket, std::span<const CodecSpec> layer_codecs, uint32_t partitions,
               std::span<const uint8_t> included = {});

}  // namespace lgreco::collective
