// Partition plans: segments cover the call exactly, start on codec bucket boundaries,
// add up to the whole encoding, and partitions balance encoded bytes.
#include "plugin/collective/plan.h"

#include <boost/test/unit_test.hpp>
#include <random>

#include "kernels/quant.h"
#include "tests/unit/test_util.h"

namespace lgreco::collective {
namespace {

CodecSpec quant(int bits, uint32_t bucket = 1024) {
  QuantParams q;
  q.bits = bits;
  q.bucket = bucket;
  return CodecSpec::quant(q);
}

BucketLayout layout_of(const std::vector<uint64_t>& sizes, DType dtype = DType::kFloat32) {
  BucketLayout b;
  b.dtype = dtype;
  for (size_t i = 0; i < sizes.size(); ++i) {
    b.layers.push_back({"l" + std::to_string(i), b.count, sizes[i], {CodecSpec::none()}, 0});
    b.count += sizes[i];
  }
  return b;
}

void check_plan(const BucketLayout& b, const std::vector<CodecSpec>& codecs, const Plan& plan, uint32_t parts) {
  BOOST_TEST_REQUIRE(plan.partitions.size() == parts);
  uint64_t next = 0, total = 0;
  for (const Partition& p : plan.partitions) {
    BOOST_TEST(p.begin == next);
    BOOST_TEST(p.end >= p.begin);
    next = p.end;
    uint64_t elements = p.begin, bytes = 0;
    for (const Segment& s : plan.segments_of(p)) {
      BOOST_TEST(s.offset == elements);
      const LayerLayout& l = b.layers[s.layer];
      BOOST_TEST(s.offset == l.offset + s.first_element);
      BOOST_TEST(s.first_element % split_granule(codecs[s.layer]) == 0);
      BOOST_TEST(s.first_element + s.count <= l.numel);
      BOOST_TEST(s.count > 0u);
      BOOST_TEST(plan.codecs[s.codec].str() == codecs[s.layer].str());
      BOOST_TEST(s.byte_offset == bytes);
      // The payload, padded to a multiple of 4 so that every segment starts 4-byte aligned.
      BOOST_TEST(s.bytes == (encoded_bytes(codecs[s.layer], b.dtype, s.count) + 3) / 4 * 4);
      BOOST_TEST(s.byte_offset % 4 == 0u);
      bytes += s.bytes;
      elements += s.count;
    }
    BOOST_TEST(elements == p.end);
    BOOST_TEST(bytes == p.bytes);
    total += p.bytes;
  }
  BOOST_TEST(next == b.count);
  BOOST_TEST(total == plan.total_bytes);
  uint64_t whole = 0;
  for (size_t l = 0; l < b.layers.size(); ++l) whole += encoded_bytes(codecs[l], b.dtype, b.layers[l].numel);
  // Splitting on bucket boundaries costs no bytes beyond each segment's padding to 4.
  BOOST_TEST(total >= whole);
  BOOST_TEST(total - whole <= 3 * plan.segments.size());
}

BOOST_AUTO_TEST_SUITE(plan)

BOOST_AUTO_TEST_CASE(random_layouts_cover_the_call_and_balance_bytes) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("seed " << test::run_seed()) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<uint64_t> sizes(1 + rng() % 8);
      for (auto& s : sizes) s = 1 + rng() % (rng() % 2 ? 300000 : 3000);
      const DType dtype = static_cast<DType>(rng() % 3);
      BucketLayout b = layout_of(sizes, dtype);
      std::vector<CodecSpec> codecs;
      uint64_t largest_granule_bytes = 0;
      for (size_t l = 0; l < sizes.size(); ++l) {
        codecs.push_back(rng() % 4 == 0 ? CodecSpec::none() : quant(1 + rng() % 8, 32 * (1 + rng() % 64)));
        b.layers[l].candidates = {codecs.back()};
        largest_granule_bytes =
            std::max(largest_granule_bytes, encoded_bytes(codecs.back(), dtype, split_granule(codecs.back())));
      }
      const uint32_t parts = 1 + rng() % 9;
      const Plan plan = make_plan(b, codecs, parts);
      check_plan(b, codecs, plan, parts);
      // Balance: each partition within one granule's bytes of its share (boundaries move
      // in whole granules).
      for (const Partition& p : plan.partitions)
        BOOST_TEST(static_cast<double>(p.bytes) <=
                   static_cast<double>(plan.total_bytes) / parts + 2.0 * largest_granule_bytes + 1);
    }
  }
}

BOOST_AUTO_TEST_CASE(partitions_follow_bytes_not_elements) {
  // One layer at 8 bits and one, as large, at 1 bit: a two-way split must fall inside
  // the 8-bit layer, far from the element midpoint.
  const BucketLayout b = layout_of({1 << 20, 1 << 20});
  const std::vector<CodecSpec> codecs = {quant(8), quant(1)};
  const Plan plan = make_plan(b, codecs, 2);
  check_plan(b, codecs, plan, 2);
  BOOST_TEST(plan.partitions[0].end < (1u << 20));
  const double ratio = static_cast<double>(plan.partitions[0].bytes) / plan.partitions[1].bytes;
  BOOST_TEST(ratio > 0.98);
  BOOST_TEST(ratio < 1.02);
}

BOOST_AUTO_TEST_CASE(boundaries_are_whole_buckets_of_every_candidate) {
  // Candidates with buckets of 1024 and 1536 values: boundaries inside the layer fall on
  // multiples of 3072, so every candidate can be measured on each segment.
  BucketLayout b = layout_of({100000, 70000});
  for (auto& l : b.layers) l.candidates = {quant(4, 1024), quant(2, 1536), CodecSpec::none()};
  BOOST_TEST(layer_granule(b.layers[0], quant(4, 1024)) == 3072u);
  const std::vector<CodecSpec> codecs = {quant(4, 1024), quant(2, 1536)};
  const Plan plan = make_plan(b, codecs, 7);
  check_plan(b, codecs, plan, 7);
  for (const Segment& s : plan.segments) BOOST_TEST(s.first_element % 3072 == 0u);
}

BOOST_AUTO_TEST_CASE(tiny_and_empty_calls) {
  for (uint64_t n : {0ull, 1ull, 31ull, 1024ull, 1025ull}) {
    const BucketLayout b = n ? layout_of({n}) : BucketLayout{};
    const std::vector<CodecSpec> codecs(b.layers.size(), quant(4));
    const Plan plan = make_plan(b, codecs, 4);
    check_plan(b, codecs, plan, 4);
  }
  BOOST_CHECK_THROW(make_plan(layout_of({10}), {}, 2), std::invalid_argument);
  BOOST_CHECK_THROW(make_plan(layout_of({10}), std::vector<CodecSpec>{quant(4)}, 0), std::invalid_argument);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco::collective
