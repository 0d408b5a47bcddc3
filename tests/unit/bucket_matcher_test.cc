// Matching allreduce calls to registered buckets and auto-mode buffers, and counting
// steps, on call sequences shaped like DDP's (first iteration, bucket rebuild, steady
// state) and on the sequences that must not be mistaken for them.
#include "config/bucket_matcher.h"

#include <boost/test/unit_test.hpp>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using config::CallKey;
using config::Match;
using Calls = std::vector<std::pair<uintptr_t, uint64_t>>;  // (address, count), float32

// A registration of buckets with the given counts (float32): a 2-D layer plus a bias whose
// size depends on the bucket's index, so that layouts differ between buckets.
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
  return r;
}

config::MatcherSettings small_min() {
  config::MatcherSettings s;
  s.min_bytes = 4096;
  return s;
}

std::vector<Match> iterate(config::BucketMatcher& m, const Calls& calls) {
  std::vector<Match> out;
  for (const auto& [address, count] : calls) out.push_back(m.match(CallKey{address, count, DType::kFloat32}));
  return out;
}

bool all_pass(const std::vector<Match>& ms) {
  for (const Match& m : ms)
    if (m.kind != Match::Kind::kPassThrough || !m.reason) return false;
  return true;
}

// Checks that calls[i] was compressed as bucket expected[i] (-1: passed through), all in
// one step.
void expect_buckets(const std::vector<Match>& ms, const std::vector<int>& expected, const std::string& what) {
  BOOST_TEST_REQUIRE(ms.size() == expected.size());
  for (size_t i = 0; i < ms.size(); ++i) {
    if (expected[i] < 0) {
      BOOST_TEST((ms[i].kind == Match::Kind::kPassThrough), what << " call " << i);
      continue;
    }
    BOOST_TEST_REQUIRE((ms[i].kind != Match::Kind::kPassThrough),
                       what << " call " << i << ": " << (ms[i].reason ? ms[i].reason : ""));
    BOOST_TEST(ms[i].bucket == static_cast<uint32_t>(expected[i]), what << " call " << i);
    BOOST_TEST(ms[i].step == ms[0].step, what);
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_matcher)

BOOST_AUTO_TEST_CASE(ddp_first_iteration_rebuild_and_steady_state) {
  // Registered: the rebuilt layout. Buckets 0 and 2 share a count.
  const std::vector<uint64_t> counts = {50000, 80000, 50000, 30000};
  const auto registration = registration_of(counts);
  config::validate(*registration);
  config::BucketMatcher m(registration, small_min());
  // Iteration 0: DDP's first layout (other buckets; one happens to have bucket 1's count).
  const Calls first = {{0x9000, 70000}, {0xA000, 80000}, {0xB000, 60000}};
  // Iterations 1..: the rebuilt buckets at the same addresses, with a metric in between
  // that matches nothing.
  const Calls rebuilt = {{0x1000, 50000}, {0x2000, 80000}, {0x5000, 1234}, {0x3000, 50000}, {0x4000, 30000}};
  BOOST_TEST(all_pass(iterate(m, first)));
  BOOST_TEST(all_pass(iterate(m, rebuilt)));  // first calls of these buffers
  BOOST_TEST(all_pass(iterate(m, rebuilt)));  // they recur
  BOOST_TEST(!m.has_pattern());
  BOOST_TEST(all_pass(iterate(m, rebuilt)));  // and repeat: learned at its last call
  BOOST_TEST(m.has_pattern());
  for (int iteration = 4; iteration < 10; ++iteration) {
    const std::vector<Match> ms = iterate(m, rebuilt);
    expect_buckets(ms, {0, 1, -1, 2, 3}, "iteration " + std::to_string(iteration));
    for (size_t c : {0, 1, 3, 4}) {
      BOOST_TEST(ms[c].layout == &registration->buckets[ms[c].bucket]);
      BOOST_TEST(ms[c].new_address == (iteration == 4));
    }
    BOOST_TEST(ms[0].step == static_cast<uint64_t>(iteration - 3));  // one step per iteration
  }
}

BOOST_AUTO_TEST_CASE(a_first_layout_that_looks_registered_is_never_compressed) {
  // Iteration 0's buffers have exactly the registered counts, at other addresses, and
  // iteration 1 reuses one of its addresses for another bucket (the caching allocator).
  config::BucketMatcher m(registration_of({50000, 80000}), small_min());
  BOOST_TEST(all_pass(iterate(m, {{0x9000, 50000}, {0x1000, 80000}})));
  for (int i = 0; i < 3; ++i) BOOST_TEST(all_pass(iterate(m, {{0x1000, 50000}, {0x2000, 80000}})));
  expect_buckets(iterate(m, {{0x1000, 50000}, {0x2000, 80000}}), {0, 1}, "steady");
}

BOOST_AUTO_TEST_CASE(a_stray_call_cannot_shift_which_buffer_is_which_bucket) {
  // Buckets 0 and 2 share a count; a stray call of that count comes first (the review's
  // case: it used to lock x2 in as bucket 0 and x0 as bucket 2 for good).
  config::BucketMatcher m(registration_of({50000, 80000, 50000}), small_min());
  iterate(m, {{0x9000, 50000}});
  const Calls loop = {{0x1000, 50000}, {0x2000, 80000}, {0x3000, 50000}};
  for (int i = 0; i < 3; ++i) BOOST_TEST(all_pass(iterate(m, loop)));
  for (int i = 0; i < 4; ++i) expect_buckets(iterate(m, loop), {0, 1, 2}, "steady");
}

BOOST_AUTO_TEST_CASE(learning_mid_step_starts_compressing_at_the_next_step) {
  // The loop is seen twice from its second call on: the pattern is known mid-iteration,
  // rotated so that bucket 0 begins each step.
  config::BucketMatcher m(registration_of({40000, 80000, 60000}), small_min());
  iterate(m, {{0x2000, 80000}, {0x3000, 60000}});
  const Calls loop = {{0x1000, 40000}, {0x2000, 80000}, {0x3000, 60000}};
  iterate(m, loop);  // 0x1000's first call; the others recur
  iterate(m, loop);
  const std::vector<Match> ms = iterate(m, loop);  // learned at its first call
  BOOST_TEST(all_pass(ms));
  BOOST_TEST(std::string(ms[1].reason) == "call pattern just learned; compression starts with its next step");
  expect_buckets(iterate(m, loop), {0, 1, 2}, "next step");
}

BOOST_AUTO_TEST_CASE(a_moved_bucket_passes_until_the_new_layout_repeats) {
  config::BucketMatcher m(registration_of({50000, 80000}), small_min());
  for (int i = 0; i < 4; ++i) iterate(m, {{0x1000, 50000}, {0x2000, 80000}});
  const Calls moved = {{0x1000, 50000}, {0x7000, 80000}};  // bucket 1 reallocated
  std::vector<Match> ms = iterate(m, moved);
  BOOST_TEST((ms[0].kind == Match::Kind::kRegistered));
  BOOST_TEST((ms[1].kind == Match::Kind::kPassThrough));
  // Bucket 0 comes instead of bucket 1: the pattern breaks; the new one repeats in this
  // iteration and the next.
  BOOST_TEST(all_pass(iterate(m, moved)));
  BOOST_TEST(all_pass(iterate(m, moved)));
  ms = iterate(m, moved);
  expect_buckets(ms, {0, 1}, "after the move");
  BOOST_TEST(!ms[0].new_address);
  BOOST_TEST(ms[1].new_address);
}

BOOST_AUTO_TEST_CASE(foreign_calls_with_a_registered_count_are_never_compressed) {
  // One-off tensors of a registered count (fresh addresses) do not disturb the pattern.
  config::BucketMatcher m(registration_of({50000, 80000}), small_min());
  uintptr_t fresh = 0x100000;
  for (int i = 0; i < 6; ++i) {
    std::vector<Match> ms = iterate(m, {{0x1000, 50000}, {fresh += 0x1000, 80000}, {0x2000, 80000}});
    if (i >= 3) expect_buckets(ms, {0, -1, 1}, "with a fresh foreign call");
  }
  // A foreign buffer of bucket 0's count at a fixed address every step makes the pattern
  // longer than the registration: nothing is compressed (rather than guessing).
  config::BucketMatcher stable(registration_of({50000, 80000}), small_min());
  for (int i = 0; i < 8; ++i) BOOST_TEST(all_pass(iterate(stable, {{0x1000, 50000}, {0x9000, 50000}, {0x2000, 80000}})));
}

BOOST_AUTO_TEST_CASE(registered_buckets_below_min_bytes_and_other_dtypes_pass) {
  config::MatcherSettings s;
  s.min_bytes = 300000;  // bucket 0 (200000 bytes) is below it
  config::BucketMatcher m(registration_of({50000, 80000}), s);
  for (int i = 0; i < 6; ++i) {
    const Match a = m.match({0x1000, 50000, DType::kFloat32});
    const Match f16 = m.match({0x8000, 80000, DType::kFloat16});
    const Match b = m.match({0x2000, 80000, DType::kFloat32});
    BOOST_TEST((a.kind == Match::Kind::kPassThrough));
    BOOST_TEST(std::string(f16.reason) == "matches no registered bucket (count and dtype)");
    if (i >= 3) {
      BOOST_TEST(std::string(a.reason) == "smaller than LGRECO_MIN_BYTES");
      BOOST_TEST((b.kind == Match::Kind::kRegistered));
      BOOST_TEST(a.step == static_cast<uint64_t>(i - 2));
    }
  }
  BOOST_TEST(std::string(m.match({0x1000, 0, DType::kFloat32}).reason) == "an empty call");
}

BOOST_AUTO_TEST_CASE(auto_mode_compresses_buffers_called_once_per_step) {
  config::BucketMatcher m(nullptr, small_min());
  uintptr_t fresh = 0x100000;
  std::vector<Match> last;
  uint64_t previous_step = 0;
  for (int iteration = 0; iteration < 70; ++iteration) {
    last.clear();
    last.push_back(m.match({0x1000, 300000, DType::kFloat32}));          // gradient bucket
    for (int use = 0; use < 3; ++use)
      last.push_back(m.match({0xB000, 500000, DType::kFloat32}));        // a workspace, 3 times
    last.push_back(m.match({fresh += 0x1000, 300000, DType::kFloat32}));  // activation, fresh address
    last.push_back(m.match({0x2000, 70000, DType::kBFloat16}));          // gradient bucket
    last.push_back(m.match({0x3000, 4, DType::kFloat32}));               // metric, below min_bytes
    // A pattern needs kMinAutoRun (64) repeating calls of evidence, 5 per iteration here,
    // after the period has been proposed.
    if (iteration < 50) continue;
    BOOST_TEST_REQUIRE((last[0].kind == Match::Kind::kAuto), "iteration " << iteration << ": " << last[0].reason);
    BOOST_TEST_REQUIRE((last[5].kind == Match::Kind::kAuto), "iteration " << iteration << ": " << last[5].reason);
    for (int c : {1, 2, 3, 4, 6}) BOOST_TEST((last[c].kind == Match::Kind::kPassThrough), "call " << c);
    BOOST_TEST(last[0].bucket != last[5].bucket);
    BOOST_TEST(last[0].layout->count == 300000u);
    BOOST_TEST((last[5].layout->dtype == DType::kBFloat16));
    // A step may begin at any buffer of the pattern in auto mode; there is one per iteration.
    if (iteration > 50) BOOST_TEST(last[0].step == previous_step + 1);
    BOOST_TEST((last[5].step == last[0].step || last[5].step == last[0].step + 1));
    previous_step = last[0].step;
  }

  config::MatcherSettings off = small_min();
  off.auto_mode = false;
  config::BucketMatcher none(nullptr, off);
  for (int i = 0; i < 4; ++i) BOOST_TEST((none.match({0x1000, 300000, DType::kFloat32}).kind == Match::Kind::kPassThrough));
}

BOOST_AUTO_TEST_CASE(auto_mode_ignores_a_rare_periodic_buffer) {
  // A large buffer allreduced every 7th iteration (an evaluation) must not stretch the
  // step to 7 iterations: after a bounded search it is ignored and compression resumes.
  config::BucketMatcher m(nullptr, small_min());
  int compressed_late = 0;
  for (int iteration = 0; iteration < 3000; ++iteration) {
    const Match a = m.match({0x1000, 300000, DType::kFloat32});
    const Match b = m.match({0x2000, 300000, DType::kFloat32});
    if (iteration % 7 == 6) m.match({0x9000, 400000, DType::kFloat32});
    if (iteration >= 2900) compressed_late += a.kind == Match::Kind::kAuto && b.kind == Match::Kind::kAuto;
  }
  BOOST_TEST(compressed_late == 100);
}

// Traces with the truth attached: each call's label is its bucket (registered), a
// gradient buffer's number (auto), or -1 for a buffer that is no gradient bucket.
struct Labeled {
  CallKey key;
  int label;
};
using Trace = std::vector<std::vector<Labeled>>;  // per iteration

struct Outcome {
  int wrong = 0;                // compressed with another bucket's layout, or not a gradient at all
  int first_all_compressed = -1;  // first iteration from which every gradient call was compressed
};

Outcome replay(config::BucketMatcher& m, const Trace& trace, bool registered) {
  Outcome o;
  for (size_t it = 0; it < trace.size(); ++it) {
    bool all = true;
    for (const Labeled& c : trace[it]) {
      const Match r = m.match(c.key);
      const bool compressed = r.kind != Match::Kind::kPassThrough;
      if (compressed && (c.label < 0 || (registered && r.bucket != static_cast<uint32_t>(c.label)))) ++o.wrong;
      if (c.label >= 0 && !compressed) all = false;
    }
    if (!all) o.first_all_compressed = -1;
    else if (o.first_all_compressed < 0) o.first_all_compressed = static_cast<int>(it);
  }
  return o;
}

CallKey f32(uintptr_t address, uint64_t count) { return {address, count, DType::kFloat32}; }

BOOST_AUTO_TEST_CASE(review_traces_registered) {
  const uint64_t A = 4195328, B = 4198400;  // the MLP's rebuilt buckets as measured under DDP
  const auto reg = registration_of({A, B});
  // Another buffer with B's count at a fixed address every iteration, in each position:
  // never compressed as a bucket (it used to take bucket 1's place).
  for (int position = 0; position < 3; ++position) {
    Trace t(30);
    for (auto& it : t) {
      it = {{f32(0x1000, A), 0}, {f32(0x2000, B), 1}};
      it.insert(it.begin() + position, {f32(0x9000, B), -1});
    }
    config::BucketMatcher m(reg, small_min());
    const Outcome o = replay(m, t, true);
    BOOST_TEST(o.wrong == 0, "position " << position);
    BOOST_TEST(o.first_all_compressed == -1);  // nothing is guessed
  }
  // DDP: the first iteration's single bucket, then the rebuilt ones; a new model (all new
  // addresses) at iteration 10 is followed within four iterations.
  Trace t(40);
  t[0] = {{f32(0x5000, 8393728), -1}};
  for (size_t it = 1; it < t.size(); ++it) {
    const uintptr_t base = it < 10 ? 0 : 0x7000000;
    t[it] = {{f32(base + 0x1000, A), 0}, {f32(0x3000, 1), -1}, {f32(base + 0x2000, B), 1}};
  }
  config::BucketMatcher m(reg, small_min());
  const Outcome o = replay(m, t, true);
  BOOST_TEST(o.wrong == 0);
  BOOST_TEST(o.first_all_compressed == 13);  // first calls at 10, recurring at 11 and 12
}

BOOST_AUTO_TEST_CASE(review_traces_auto) {
  const uint64_t mb = 1 << 18;
  std::mt19937_64 rng(test::run_seed());
  const auto grads = [&](std::vector<Labeled>& it, uintptr_t base) {
    for (int g = 0; g < 3; ++g) it.push_back({f32(base + 0x10000000ull * (g + 1), 8 * mb + g), g});
  };
  struct Case {
    const char* name;
    std::function<void(size_t, std::vector<Labeled>&)> iteration;
    int compressed_by;  // -1: never (no regular pattern)
  };
  uintptr_t fresh = 0x900000000ull;
  const Case cases[] = {
      {"a workspace called 5 times in a row",
       [&](size_t, auto& it) {
         for (int k = 0; k < 5; ++k) it.push_back({f32(0x5000, 4 * mb), -1});
         grads(it, 0);
       },
       40},
      {"a workspace between fresh activations",
       [&](size_t, auto& it) {
         for (int k = 0; k < 4; ++k) {
           it.push_back({f32(0x5000, 4 * mb), -1});
           it.push_back({f32(fresh += 0x1000, 4 * mb), -1});
         }
         grads(it, 0);
       },
       40},
      {"a workspace called 1 to 4 times at random",
       [&](size_t, auto& it) {
         grads(it, 0);
         for (int k = 0, n = 1 + rng() % 4; k < n; ++k) it.push_back({f32(0x5000, 4 * mb), -1});
       },
       -1},
      {"a buffer whose count changes every iteration",
       [&](size_t i, auto& it) {
         it.push_back({f32(0x50000000, 2 * mb + (i % 7) * 1024), -1});
         grads(it, 0);
       },
       40},
      {"an evaluation buffer every 10 iterations",
       [&](size_t i, auto& it) {
         grads(it, 0);
         if (i % 10 == 9) it.push_back({f32(0x70000000, 64 * mb), -1});
       },
       -2},  // only no mistakes checked: the iterations with the evaluation break "all compressed"
      {"a new model at iteration 20",
       [&](size_t i, auto& it) { grads(it, i < 20 ? 0 : 0x700000000ull); }, 45},
  };
  for (const Case& c : cases) {
    Trace t(120);
    for (size_t i = 0; i < t.size(); ++i) c.iteration(i, t[i]);
    config::BucketMatcher m(nullptr, small_min());
    const Outcome o = replay(m, t, false);
    BOOST_TEST(o.wrong == 0, c.name);
    if (c.compressed_by >= 0) BOOST_TEST((o.first_all_compressed >= 0 && o.first_all_compressed <= c.compressed_by),
                                         c.name << ": " << o.first_all_compressed);
    if (c.compressed_by == -1) BOOST_TEST(o.first_all_compressed == -1, c.name);
  }
}

BOOST_AUTO_TEST_CASE(auto_layouts_cover_the_buffer_in_whole_groups) {
  std::mt19937_64 rng(test::run_seed());
  for (int trial = 0; trial < 2000; ++trial) {
    const DType dtype = static_cast<DType>(rng() % 3);
    const uint64_t count = 1 + rng() % (trial % 2 ? 5000 : 5000000);
    const uint64_t segment_bytes = 4096 + rng() % (8 << 20);
    const config::RegisteredBucket b = config::auto_layout(count, dtype, segment_bytes);
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
  BOOST_TEST(config::auto_layout(1, DType::kFloat32, 4096).layers.size() == 1u);
  BOOST_TEST(config::auto_layout(1024 + 1023, DType::kFloat32, 4096).layers.size() == 1u);  // the tail joins
  BOOST_TEST(config::auto_layout(2048, DType::kFloat32, 4096).layers.size() == 2u);
  BOOST_TEST(config::auto_layout(10 << 20, DType::kFloat16, 1 << 20).layers.size() == 20u);
}

BOOST_AUTO_TEST_CASE(random_ddp_runs_agree_across_ranks_and_map_every_bucket) {
  // Two ranks with different addresses and the same calls: identical steps and decisions
  // (what the engine's agreement relies on), and every bucket found from the third
  // iteration of the rebuilt layout on, whatever the first layout and the stray calls.
  std::mt19937_64 rng(test::run_seed());
  int trials = 0;
  for (int trial = 0; trials < 60 && trial < 1000; ++trial) {
    std::vector<uint64_t> counts;
    const int n = 1 + rng() % 6;
    for (int b = 0; b < n; ++b) counts.push_back(2000 + rng() % 3 * 1000);  // shared counts are common
    auto reg = registration_of(counts);
    try {
      config::validate(*reg);
    } catch (const config::RegistrationError&) {
      continue;  // counts that repeat with a shorter period: refused by validation
    }
    ++trials;
    config::BucketMatcher rank0(reg, small_min()), rank1(reg, small_min());
    const int first_calls = rng() % 5;
    std::vector<uint64_t> first;
    for (int c = 0; c < first_calls; ++c) first.push_back(counts[rng() % n]);
    for (size_t c = 0; c < first.size(); ++c) {  // DDP's first layout, elsewhere
      const Match a = rank0.match({0x900000 + c * 0x100, first[c], DType::kFloat32});
      const Match b = rank1.match({0x7900000 + c * 0x200, first[c], DType::kFloat32});
      BOOST_TEST((a.kind == Match::Kind::kPassThrough && b.kind == Match::Kind::kPassThrough));
    }
    for (int iteration = 1; iteration < 8; ++iteration) {
      for (int b = 0; b < n; ++b) {
        const Match a = rank0.match({0x1000 + static_cast<uintptr_t>(b) * 0x100, counts[b], DType::kFloat32});
        const Match c = rank1.match({0x7000000 + static_cast<uintptr_t>(b) * 0x200, counts[b], DType::kFloat32});
        BOOST_TEST((a.kind == c.kind && a.bucket == c.bucket && a.step == c.step));
        if (iteration >= 4) {
          BOOST_TEST_REQUIRE((a.kind == Match::Kind::kRegistered), a.reason);
          BOOST_TEST(a.bucket == static_cast<uint32_t>(b));
          BOOST_TEST(a.step == static_cast<uint64_t>(iteration - 3));
        }
      }
    }
  }
  BOOST_TEST(trials == 60);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco
