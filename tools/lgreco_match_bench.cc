// lgreco-match-bench: what matching an allreduce call to a bucket costs, per call, in the
// steady state and while a pattern is being learned (or never found). It runs once per
// allreduce call of a training job, on the caller's thread.
#include <cstdio>
#include <functional>
#include <random>
#include <string>

#include "config/bucket_matcher.h"
#include "config/version.h"
#include "tools/bench_util.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-match-bench [--calls N]

Times config::BucketMatcher::match() (median of 5 runs of N calls each, default 1000000,
continuing one sequence after 20000 calls that fill its history) on call sequences:
registered and auto mode in the steady state, and sequences that never form a pattern
(the learning path).
)";

using Generator = std::function<config::CallKey(uint64_t)>;

std::shared_ptr<const config::Registration> registration_of(uint64_t buckets, uint64_t first_count) {
  auto r = std::make_shared<config::Registration>();
  for (uint64_t b = 0; b < buckets; ++b) {
    config::RegisteredBucket bucket;
    bucket.count = first_count + b;
    bucket.layers.push_back({"w" + std::to_string(b), 0, bucket.count, {bucket.count}, true, {}});
    r->buckets.push_back(bucket);
  }
  return r;
}

// One matcher, its history filled first; each timed run continues the same sequence.
void row(const char* name, std::shared_ptr<const config::Registration> registration, uint64_t calls,
         const Generator& call) {
  config::BucketMatcher m(registration, config::MatcherSettings{});
  uint64_t next = 0;
  for (; next < 20000; ++next) m.match(call(next));
  uint64_t compressed = 0;
  const double seconds = bench::median_seconds(5, [&] {
    compressed = 0;
    for (const uint64_t end = next + calls; next < end; ++next)
      compressed += m.match(call(next)).kind != config::Match::Kind::kPassThrough;
  });
  printf("%-52s %9.0f %10.1f%%\n", name, seconds / calls * 1e9, 100.0 * compressed / calls);
}

int run(int argc, char** argv) {
  uint64_t calls = 1000000;
  for (cli::Args args(argc, argv, 1); args.next();) {
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (args.arg() == "--calls") {
      calls = cli::parse_u64("--calls", args.value());
    } else {
      throw cli::UsageError("unknown argument " + args.arg());
    }
  }
  const uint64_t mb = 1 << 18;  // float32 elements in 1 MiB
  printf("# lgreco-match-bench, lgreco %s, %s\n", version_string(), bench::utc_now().c_str());
  printf("# cpu: %s; one thread; median of 5 runs of %llu calls\n", bench::cpu_model().c_str(),
         static_cast<unsigned long long>(calls));
  printf("%-52s %9s %11s\n", "sequence", "ns/call", "compressed");
  row("registered, 2 buckets, steady", registration_of(2, 4 * mb), calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + (i % 2) * 0x100000, 4 * mb + i % 2}; });
  row("registered, 200 buckets, steady", registration_of(200, mb), calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + (i % 200) * 0x100000, mb + i % 200}; });
  row("auto, 50 buffers, steady", nullptr, calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + (i % 50) * 0x100000, 8 * mb}; });
  row("registered, never fits (a 3rd recurring buffer)", registration_of(2, 4 * mb), calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + (i % 3) * 0x100000, 4 * mb + (i % 3 == 1)}; });
  row("auto, fresh addresses forever", nullptr, calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + i * 0x100, 8 * mb}; });
  std::mt19937_64 rng(1);
  row("auto, random among 4000 recurring buffers", nullptr, calls,
      [&](uint64_t) { return config::CallKey{0x1000 + (rng() % 4000) * 0x100000, 8 * mb}; });
  row("registered, 4096 buckets, never fits", registration_of(4096, mb), calls,
      [&](uint64_t i) { return config::CallKey{0x1000 + (i % 4097) * 0x100000, mb + i % 4096}; });
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-match-bench", [&] { return lgreco::run(argc, argv); });
}
