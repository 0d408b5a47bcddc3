// Matching allreduce calls to registered buckets and auto-mode buffers, and counting
// steps, on call sequences shaped like DDP's (first iteration, bucket rebuild, steady
// state) and on the sequences that must not be mistaken for them.
#include "config/bucket_matcher.h"

#include <boost/test/unit_test.hpp>
#include <memory>
#include <random>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using config::CallKey;
using config::Match;

// A registration of buckets with the given counts (float32), one 2-D layer each plus a
// bias, so that layouts differ between buckets.
std::shared_ptr<const config::Registration> registration_of(const std::vector<uint64_t>& counts) {
  auto r = std::make_shared<config::Registration>();
  for (size_t b = 0; b < counts.size(); ++b) {
    config::RegisteredBucket bucket;
    bucket.count = counts[b];
    const uint64_t bias = 16 + b;
    bucket.layers.push_back({"w" + std::to_string(b), 0, counts[b] - bias, {counts[b] - bias, 1}, true, {}});
    bucket.layers.push_back({"b" + std::to_string(b), counts[b] - bias, bias, {bias}, true, {}});
    r->buckets.push_back(bucket);
  }
  config::validate(*r);
  return r;
}

config::MatcherSettings small_min() {
  config::MatcherSettings s;
  s.min_bytes = 4096;
  return s;
}

// One iteration: a call per (address, count).
std::vector<Match> iterate(config::BucketMatcher& m, const std::vector<std::pair<uintptr_t, uint64_t>>& calls) {
  std::vector<Match> out;
  for (const auto& [address, count] : calls) out.push_back(m.match(CallKey{address, count, DType::kFloat32}));
  return out;
}

bool all_pass(const std::vector<Match>& ms) {
  for (const Match& m : ms)
    if (m.kind != Match::Kind::kPassThrough || !m.reason) return false;
  return true;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_matcher)

BOOST_AUTO_TEST_CASE(ddp_first_iteration_rebuild_and_steady_state) {
  // Registered: the rebuilt layout. Buckets 0 and 2 share a count.
  const std::vector<uint64_t> counts = {50000, 80000, 50000, 30000};
  const auto registration = registration_of(counts);
  config::BucketMatcher m(registration, small_min());
  // Iteration 0: DDP's first layout (other buckets; one happens to have bucket 1's count).
  const std::vector<std::pair<uintptr_t, uint64_t>> first = {{0x9000, 70000}, {0xA000, 80000}, {0xB000, 60000}};
  // Iterations 1..: the rebuilt buckets, always at the same addresses, with an unrelated
  // call in between (a metric) that matches nothing.
  const std::vector<std::pair<uintptr_t, uint64_t>> rebuilt = {
      {0x1000, 50000}, {0x2000, 80000}, {0x5000, 1234}, {0x3000, 50000}, {0x4000, 30000}};
  BOOST_TEST(all_pass(iterate(m, first)));
  BOOST_TEST(all_pass(iterate(m, rebuilt)));  // not confirmed yet: the first time these buffers are seen
  uint64_t last_step = 0;
  for (int iteration = 2; iteration < 8; ++iteration) {
    const std::vector<Match> ms = iterate(m, rebuilt);
    BOOST_TEST((ms[2].kind == Match::Kind::kPassThrough));
    const size_t expected_bucket[] = {0, 1, 99, 2, 3};
    for (size_t c : {0, 1, 3, 4}) {
      BOOST_TEST_REQUIRE((ms[c].kind == Match::Kind::kRegistered), "iteration " << iteration << " call " << c
                                                                                << ": " << (ms[c].reason ? ms[c].reason : ""));
      BOOST_TEST(ms[c].bucket == expected_bucket[c]);
      BOOST_TEST(ms[c].layout == &registration->buckets[expected_bucket[c]]);
      BOOST_TEST(ms[c].new_address == (iteration == 2));
      BOOST_TEST(ms[c].step == ms[0].step);
    }
    if (iteration > 2) BOOST_TEST(ms[0].step == last_step + 1);  // one step per iteration
    last_step = ms[0].step;
  }
}

BOOST_AUTO_TEST_CASE(a_first_layout_that_looks_registered_is_never_compressed) {
  // Iteration 0's buffers have exactly the registered counts, at other addresses, and
  // iteration 1 reuses one of them for a different bucket (the caching allocator).
  const std::vector<uint64_t> counts = {50000, 80000};
  config::BucketMatcher m(registration_of(counts), small_min());
  BOOST_TEST(all_pass(iterate(m, {{0x9000, 50000}, {0x1000, 80000}})));
  BOOST_TEST(all_pass(iterate(m, {{0x1000, 50000}, {0x2000, 80000}})));
  std::vector<Match> ms = iterate(m, {{0x1000, 50000}, {0x2000, 80000}});
  BOOST_TEST((ms[0].kind == Match::Kind::kRegistered && ms[1].kind == Match::Kind::kRegistered));
  BOOST_TEST((ms[0].bucket == 0u && ms[1].bucket == 1u));
}

BOOST_AUTO_TEST_CASE(a_moved_bucket_passes_one_step_then_starts_afresh) {
  config::BucketMatcher m(registration_of({50000, 80000}), small_min());
  for (int i = 0; i < 3; ++i) iterate(m, {{0x1000, 50000}, {0x2000, 80000}});
  std::vector<Match> ms = iterate(m, {{0x1000, 50000}, {0x7000, 80000}});  // bucket 1 reallocated
  BOOST_TEST((ms[0].kind == Match::Kind::kRegistered));
  BOOST_TEST((ms[1].kind == Match::Kind::kPassThrough));
  ms = iterate(m, {{0x1000, 50000}, {0x7000, 80000}});
  BOOST_TEST((ms[1].kind == Match::Kind::kRegistered));
  BOOST_TEST(ms[1].new_address);
  BOOST_TEST(!ms[0].new_address);
}

BOOST_AUTO_TEST_CASE(registered_buckets_below_min_bytes_and_other_dtypes_pass) {
  config::MatcherSettings s;
  s.min_bytes = 300000;  // bucket 0 (200000 bytes) is below it
  config::BucketMatcher m(registration_of({50000, 80000}), s);
  for (int i = 0; i < 4; ++i) {
    const Match a = m.match({0x1000, 50000, DType::kFloat32});
    const Match f16 = m.match({0x8000, 80000, DType::kFloat16});
    const Match b = m.match({0x2000, 80000, DType::kFloat32});
    BOOST_TEST((a.kind == Match::Kind::kPassThrough));
    BOOST_TEST((f16.kind == Match::Kind::kPassThrough));
    BOOST_TEST(std::string(f16.reason) == "matches no registered bucket (count and dtype)");
    if (i >= 2) {
      BOOST_TEST(std::string(a.reason) == "smaller than LGRECO_MIN_BYTES");
      BOOST_TEST((b.kind == Match::Kind::kRegistered));
    }
    BOOST_TEST(a.step == static_cast<uint64_t>(i));
  }
}

BOOST_AUTO_TEST_CASE(auto_mode_compresses_only_buffers_that_recur) {
  config::BucketMatcher m(nullptr, small_min());
  uintptr_t fresh = 0x100000;
  for (int iteration = 0; iteration < 6; ++iteration) {
    const Match grad_a = m.match({0x1000, 300000, DType::kFloat32});
    const Match activation = m.match({fresh += 0x1000, 300000, DType::kFloat32});  // new address every time
    const Match grad_b = m.match({0x2000, 70000, DType::kBFloat16});
    const Match metric = m.match({0x3000, 4, DType::kFloat32});                   // below min_bytes
    BOOST_TEST((activation.kind == Match::Kind::kPassThrough));
    BOOST_TEST((metric.kind == Match::Kind::kPassThrough));
    BOOST_TEST(grad_a.step == static_cast<uint64_t>(iteration));
    if (iteration == 0) {
      BOOST_TEST((grad_a.kind == Match::Kind::kPassThrough && grad_b.kind == Match::Kind::kPassThrough));
      continue;
    }
    BOOST_TEST_REQUIRE((grad_a.kind == Match::Kind::kAuto && grad_b.kind == Match::Kind::kAuto));
    BOOST_TEST(grad_a.bucket != grad_b.bucket);
    BOOST_TEST(grad_a.new_address == (iteration == 1));
    BOOST_TEST(grad_a.layout->count == 300000u);
    BOOST_TEST((grad_b.layout->dtype == DType::kBFloat16));
  }
  config::MatcherSettings off;
  off.auto_mode = false;
  config::BucketMatcher none(nullptr, off);
  for (int i = 0; i < 3; ++i) BOOST_TEST((none.match({0x1000, 300000, DType::kFloat32}).kind == Match::Kind::kPassThrough));
}

BOOST_AUTO_TEST_CASE(auto_layouts_cover_the_buffer_in_whole_groups) {
  std::mt19937_64 rng(test::run_seed());
  for (int trial = 0; trial < 2000; ++trial) {
    const DType dtype = static_cast<DType>(rng() % 3);
    const uint64_t count = 1 + rng() % (trial % 2 ? 5000 : 5000000);
    const uint64_t segment_bytes = 4096 + rng() % (8 << 20);
    const config::RegisteredBucket b = config::auto_layout(count, dtype, segment_bytes, 3);
    const uint64_t segment = std::max<uint64_t>(1024, segment_bytes / dtype_size(dtype) / 1024 * 1024);
    uint64_t next = 0;
    for (size_t l = 0; l < b.layers.size(); ++l) {
      const config::RegisteredLayer& layer = b.layers[l];
      BOOST_TEST(layer.offset == next);
      BOOST_TEST(!layer.has_shape);
      const bool last = l + 1 == b.layers.size();
      if (!last) BOOST_TEST(layer.numel == segment);
      if (last) BOOST_TEST((layer.numel <= segment + 1023 && (layer.numel >= 1024 || b.layers.size() == 1)));
      next += layer.numel;
    }
    BOOST_TEST_REQUIRE(next == count);
    config::Registration r;
    r.buckets.push_back(b);
    config::validate(r);
  }
  BOOST_TEST(config::auto_layout(1, DType::kFloat32, 4096, 0).layers.size() == 1u);
  BOOST_TEST(config::auto_layout(1024 + 1023, DType::kFloat32, 4096, 0).layers.size() == 1u);  // the tail joins
  BOOST_TEST(config::auto_layout(2048, DType::kFloat32, 4096, 0).layers.size() == 2u);
  BOOST_TEST(config::auto_layout(10 << 20, DType::kFloat16, 1 << 20, 0).layers.size() == 20u);
}

BOOST_AUTO_TEST_CASE(random_ddp_runs_agree_across_ranks) {
  // Two ranks with different addresses but the same call pattern: identical steps and
  // decisions (what the engine's agreement relies on).
  std::mt19937_64 rng(test::run_seed());
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<uint64_t> counts;
    const int n = 1 + rng() % 6;
    for (int b = 0; b < n; ++b) counts.push_back(2000 + rng() % 4 * 1000);  // shared counts are common
    auto reg = registration_of(counts);
    config::BucketMatcher rank0(reg, small_min()), rank1(reg, small_min());
    for (int iteration = 0; iteration < 6; ++iteration) {
      for (int b = 0; b < n; ++b) {
        const uintptr_t offset = iteration == 0 ? 0x90000 : 0;  // the first layout elsewhere
        const Match a = rank0.match({0x1000 + offset + b * 0x100, counts[b], DType::kFloat32});
        const Match c = rank1.match({0x7000000 + offset + b * 0x200, counts[b], DType::kFloat32});
        BOOST_TEST((a.kind == c.kind && a.bucket == c.bucket && a.step == c.step));
        if (iteration >= 2) {
          BOOST_TEST_REQUIRE((a.kind == Match::Kind::kRegistered), a.reason);
          BOOST_TEST(a.bucket == static_cast<uint32_t>(b));
          BOOST_TEST(a.step == static_cast<uint64_t>(iteration));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco
