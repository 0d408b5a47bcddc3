// The compressed-allreduce engine over the in-process fabric and the CPU backend.
//
// Outputs are checked byte for byte against a reference written here from the codec
// interface alone (kernels/codec.h): the algorithm as docs/ENGINE.md describes it, with
// no engine, backend or fabric code. Then: bit-identical outputs across ranks, error
// feedback keeping the accumulated error bounded, overflow steps, the controller's
// switches, and the failure cases (configurations that differ, an invalid one, a rank
// that stops).
#include "plugin/collective/engine.h"

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "kernels/codec.h"
#include "kernels/lowrank.h"
#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/inproc_fabric.h"
#include "tests/unit/pinned_run.h"
#include "tests/unit/test_util.h"

namespace lgreco::collective {
namespace {

using namespace std::chrono_literals;
using Bytes = std::vector<uint8_t>;

CodecSpec quant(int bits, uint32_t bucket = 1024, Rounding rounding = Rounding::kStochastic) {
  QuantParams q;
  q.bits = bits;
  q.bucket = bucket;
  q.rounding = rounding;
  return CodecSpec::quant(q);
}

// A bucket of fixed codecs (one candidate per layer: no controller).
BucketLayout fixed_layout(const std::vector<uint64_t>& sizes, const std::vector<CodecSpec>& codecs, DType dtype) {
  BucketLayout b;
  b.dtype = dtype;
  for (size_t l = 0; l < sizes.size(); ++l) {
    b.layers.push_back({"layer" + std::to_string(l), b.count, sizes[l], {codecs[l]}, 0});
    b.count += sizes[l];
  }
  return b;
}

EngineOptions fixed_options(Algorithm algorithm, bool error_feedback) {
  EngineOptions o;
  o.mode = config::Mode::kUniform;
  o.algorithm = algorithm;
  o.error_feedback = error_feedback;
  o.parameters_text = "test";
  return o;
}

// Adaptive mode around quant:bits=4 with a short schedule: warm-up 2, a re-solve every 4
// steps from a window of 2, switching 1 step after it.
EngineOptions adaptive_options(const std::vector<CodecSpec>& candidates, const std::string& text) {
  EngineOptions o;
  o.codec = quant(4);
  o.candidates = candidates;
  o.parameters_text = text;
  o.controller.schedule = {2, 4, 2, 1};
  return o;
}

Bytes to_dtype(const std::vector<float>& v, DType dtype) {
  Bytes out(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) store_from_float(out.data(), dtype, i, v[i]);
  return out;
}
std::vector<double> to_double(const Bytes& raw, DType dtype) {
  std::vector<double> out(raw.size() / dtype_size(dtype));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(raw.data(), dtype, i);
  return out;
}

// ---------------------------------------------------------------------------------------
// The reference (error feedback off): what every rank's output must be, byte for byte.

Bytes encode_with(const CodecSpec& spec, DType dtype, const NoiseKey& key, const void* data, uint64_t count,
                  uint64_t first_element) {
  auto codec = Codec::create(spec, dtype);
  Bytes out(codec->encoded_bytes(count));
  codec->encode(key, Slice{data, count, first_element}, nullptr, out);
  return out;
}

Bytes reference(const BucketLayout& b, const std::vector<Bytes>& inputs, Algorithm algorithm, uint64_t step,
                ReduceOp op, uint64_t seed, uint32_t layer_base = 0) {
  const int n = static_cast<int>(inputs.size());
  const DType dtype = b.dtype;
  const size_t es = dtype_size(dtype);
  std::vector<CodecSpec> codecs;
  for (const LayerLayout& l : b.layers) codecs.push_back(l.candidates[l.default_index]);
  Bytes out(b.count * es);
  if (algorithm == Algorithm::kAllGather) {
    std::vector<float> acc(b.count, 0.0f);
    for (int r = 0; r < n; ++r)
      for (size_t l = 0; l < b.layers.size(); ++l) {
        const LayerLayout& layer = b.layers[l];
        if (exchange_of(codecs[l]) == Exchange::kLowRank) continue;
        const NoiseKey key{seed, static_cast<uint32_t>(r), step, layer_base + static_cast<uint32_t>(l)};
        const Bytes enc = encode_with(codecs[l], dtype, key, inputs[r].data() + layer.offset * es, layer.numel, 0);
        Codec::create(codecs[l], dtype)->decode_accumulate(enc, layer.numel, acc.data() + layer.offset);
      }
    for (uint64_t i = 0; i < b.count; ++i)
      store_from_float(out.data(), dtype, i, op == ReduceOp::kAvg ? acc[i] / static_cast<float>(n) : acc[i]);
    return out;
  }
  // sra: gathered layers (TopK) travel whole to every rank, as in all-gather; the
  // reducible ones are partitioned among owners; low-rank layers are not covered here
  // (their bytes stay 0: powersgd_layers_match_the_reference_step_after_step).
  std::vector<uint8_t> reduced(b.layers.size());
  for (size_t l = 0; l < b.layers.size(); ++l) {
    reduced[l] = exchange_of(codecs[l]) == Exchange::kReduce;
    if (reduced[l] || exchange_of(codecs[l]) == Exchange::kLowRank) continue;
    const LayerLayout& layer = b.layers[l];
    std::vector<float> acc(layer.numel, 0.0f);
    for (int r = 0; r < n; ++r) {
      const NoiseKey key{seed, static_cast<uint32_t>(r), step, layer_base + static_cast<uint32_t>(l)};
      const Bytes enc = encode_with(codecs[l], dtype, key, inputs[r].data() + layer.offset * es, layer.numel, 0);
      Codec::create(codecs[l], dtype)->decode_accumulate(enc, layer.numel, acc.data());
    }
    for (uint64_t i = 0; i < layer.numel; ++i)
      store_from_float(out.data(), dtype, layer.offset + i, op == ReduceOp::kAvg ? acc[i] / static_cast<float>(n) : acc[i]);
  }
  const Plan plan = make_plan(b, codecs, static_cast<uint32_t>(n), reduced);
  for (int owner = 0; owner < n; ++owner)
    for (const Segment& s : plan.segments_of(plan.partitions[owner])) {
      const CodecSpec& spec = codecs[s.layer];
      std::vector<float> acc(s.count, 0.0f);
      for (int r = 0; r < n; ++r) {
        const uint8_t* x = inputs[r].data() + s.offset * es;
        if (r == owner) {
          for (uint64_t i = 0; i < s.count; ++i) acc[i] += load_as_float(x, dtype, i);
          continue;
        }
        const NoiseKey key{seed, static_cast<uint32_t>(r), step, layer_base + s.layer};
        const Bytes enc = encode_with(spec, dtype, key, x, s.count, s.first_element);
        Codec::create(spec, dtype)->decode_accumulate(enc, s.count, acc.data());
      }
      if (op == ReduceOp::kAvg)
        for (float& v : acc) v = v / static_cast<float>(n);
      if (spec.family() == CodecFamily::kNone) {
        for (uint64_t i = 0; i < s.count; ++i) store_from_float(out.data(), dtype, s.offset + i, acc[i]);
        continue;
      }
      const NoiseKey key{seed, NoiseBase::kReencodeRankBit | static_cast<uint32_t>(owner), step, layer_base + s.layer};
      const Bytes enc = encode_with(spec, DType::kFloat32, key, acc.data(), s.count, s.first_element);
      Codec::create(spec, DType::kFloat32)->decode(enc, s.count, dtype, out.data() + s.offset * es);
    }
  return out;
}

// ---------------------------------------------------------------------------------------
// Running ranks as threads

struct RankResult {
  std::vector<Bytes> outputs;  // per call
  std::vector<CallOutcome> outcomes;
  std::vector<std::vector<float>> residuals;  // bucket 0's residual after each call
  uint64_t epoch = 0;
  std::vector<std::string> codecs;  // bucket 0's layer codecs at the end
  EngineCounters counters;
};

struct Job {
  int ranks = 2;
  std::vector<BucketLayout> buckets;
  std::function<EngineOptions(int rank)> options;
  // The input of (rank, step, bucket), in the bucket's dtype.
  std::function<Bytes(int rank, uint64_t step, uint32_t bucket)> input;
  uint64_t steps = 1;
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout = 10000ms;
  // A rank that returns true here stops before (step, bucket): it "dies".
  std::function<bool(int rank, uint64_t step)> stops = [](int, uint64_t) { return false; };
  bool in_place = false;
  bool snapshot_residuals = false;
  // Each rank's backend; null: a CpuBackend.
  std::function<std::unique_ptr<Backend>(int rank)> backend;
  // Called on each rank before its calls of each step.
  std::function<void(int rank, uint64_t step, Backend& backend)> before_step;
};

std::vector<RankResult> run_job(const Job& job) {
  auto hub = std::make_shared<InProcHub>(job.ranks, job.timeout);
  std::vector<RankResult> results(job.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < job.ranks; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      const std::unique_ptr<Backend> backend = job.backend ? job.backend(r) : std::make_unique<CpuBackend>();
      Engine engine(job.options(r), job.buckets, fabric, *backend);
      RankResult& mine = results[r];
      for (uint64_t step = 0; step < job.steps; ++step) {
        if (job.stops(r, step)) break;
        if (job.before_step) job.before_step(r, step, *backend);
        for (uint32_t b = 0; b < job.buckets.size(); ++b) {
          const Bytes in = job.input(r, step, b);
          Bytes out(in.size(), 0xA5);  // poisoned
          if (job.in_place) out = in;
          EngineCall call{b, step, job.in_place ? out.data() : in.data(), out.data(), job.buckets[b].count,
                          job.buckets[b].dtype, job.op, false};
          mine.outcomes.push_back(engine.allreduce(call));
          mine.outputs.push_back(std::move(out));
          if (job.snapshot_residuals && b == 0) mine.residuals.push_back(engine.residual_snapshot(0));
        }
      }
      mine.epoch = engine.epoch();
      for (const CodecSpec& c : engine.layer_codecs(0)) mine.codecs.push_back(c.str());
      mine.counters = engine.counters();
    });
  for (auto& t : threads) t.join();
  return results;
}

// Fresh inputs of a distribution drawn per (rank, step, bucket) from the run's seed.
std::function<Bytes(int, uint64_t, uint32_t)> random_inputs(const std::vector<BucketLayout>& buckets, uint64_t seed,
                                                            test::Dist dist = test::Dist::kNormal) {
  return [buckets, seed, dist](int r, uint64_t step, uint32_t b) {
    std::mt19937_64 rng(seed ^ (uint64_t(r) << 48) ^ (step << 24) ^ b);
    return to_dtype(test::draw(dist, buckets[b].count, rng, 512), buckets[b].dtype);
  };
}

BOOST_AUTO_TEST_SUITE(engine)

BOOST_AUTO_TEST_CASE(matches_the_reference_byte_for_byte) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  int cases = 0;
  BOOST_TEST_CONTEXT("seed " << seed) {
    for (int ranks : {1, 2, 3, 4, 8})
      for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather})
        for (int trial = 0; trial < 3; ++trial) {
          const DType dtype = static_cast<DType>(trial);  // every type for every rank count and algorithm
          // Two buckets per step: the second one's layers continue the noise keys.
          Job job;
          job.ranks = ranks;
          for (int bucket = 0; bucket < 2; ++bucket) {
            std::vector<uint64_t> sizes(1 + rng() % 5);
            std::vector<CodecSpec> codecs;
            for (auto& s : sizes) {
              s = 1 + rng() % (rng() % 3 ? 20000 : 300);
              const int kind = static_cast<int>(rng() % 6);
              const char* densities[] = {"0.001", "0.01", "0.1", "0.5", "1"};
              codecs.push_back(kind == 0   ? CodecSpec::none()
                               : kind == 1 ? quant(1 + rng() % 8, 32 * (1 + rng() % 40), Rounding::kNearest)
                               : kind == 5 ? CodecSpec::parse(std::string("topk:density=") + densities[rng() % 5])
                                           : quant(1 + rng() % 8, 32 * (1 + rng() % 40)));
            }
            job.buckets.push_back(fixed_layout(sizes, codecs, dtype));
          }
          job.options = [&](int) { return fixed_options(algorithm, false); };
          job.input = random_inputs(job.buckets, seed + cases, test::kAllDists[(cases + trial) % 5]);
          job.steps = 2;
          job.op = rng() % 2 ? ReduceOp::kAvg : ReduceOp::kSum;
          job.in_place = rng() % 2;
          const auto results = run_job(job);
          for (uint64_t step = 0; step < job.steps; ++step)
            for (uint32_t b = 0; b < 2; ++b) {
              std::vector<Bytes> inputs;
              for (int r = 0; r < ranks; ++r) inputs.push_back(job.input(r, step, b));
              const uint32_t layer_base = b == 0 ? 0 : static_cast<uint32_t>(job.buckets[0].layers.size());
              const Bytes expected =
                  reference(job.buckets[b], inputs, algorithm, step, job.op, EngineOptions{}.seed, layer_base);
              const size_t call = step * 2 + b;
              for (int r = 0; r < ranks; ++r)
                BOOST_TEST_CONTEXT("ranks " << ranks << " " << algorithm_name(algorithm) << " " << dtype_name(dtype)
                                            << " bucket " << b << " count " << job.buckets[b].count << " step "
                                            << step << " rank " << r << (job.in_place ? " in place" : "")) {
                  BOOST_TEST_REQUIRE(results[r].outcomes[call].message == "");
                  BOOST_TEST((results[r].outcomes[call].kind == CallOutcome::Kind::kDone));
                  BOOST_TEST((results[r].outputs[call] == expected));
                }
            }
          ++cases;
        }
  }
}

BOOST_AUTO_TEST_CASE(auto_algorithm_and_tiny_calls) {
  // Auto: all-gather for 2 ranks and small encodings, sra otherwise.
  for (auto [ranks, count, expected] : {std::tuple{2, 1u << 20, Algorithm::kAllGather},
                                        std::tuple{4, 1000u, Algorithm::kAllGather},
                                        std::tuple{4, 1u << 20, Algorithm::kScatterReduceAllGather}}) {
    auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
    std::vector<Algorithm> seen(ranks);
    std::vector<CallOutcome> outcomes(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        InProcFabric fabric(hub, r);
        CpuBackend backend;
        Engine engine(fixed_options(Algorithm::kAuto, true), {fixed_layout({count}, {quant(4)}, DType::kFloat32)},
                      fabric, backend);
        std::vector<float> x(count, 1.0f + r);
        outcomes[r] = engine.allreduce({0, 0, x.data(), x.data(), count, DType::kFloat32, ReduceOp::kSum, false});
        seen[r] = engine.algorithm(0);
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      BOOST_TEST((outcomes[r].kind == CallOutcome::Kind::kDone), outcomes[r].message);
      BOOST_TEST(algorithm_name(seen[r]) == algorithm_name(expected));
    }
  }
  // Counts of 1 and of 0 (a bucket of nothing), on many ranks.
  for (int ranks : {3, 8})
    for (uint64_t count : {1u, 0u}) {
      Job job;
      job.ranks = ranks;
      job.buckets = {count ? fixed_layout({count}, {quant(4)}, DType::kFloat16) : BucketLayout{0, DType::kFloat16, {}}};
      job.options = [](int) { return fixed_options(Algorithm::kScatterReduceAllGather, true); };
      job.input = random_inputs(job.buckets, test::run_seed());
      const auto results = run_job(job);
      for (const auto& r : results) {
        BOOST_TEST((r.outcomes[0].kind == CallOutcome::Kind::kDone), r.outcomes[0].message);
        BOOST_TEST((r.outputs[0] == results[0].outputs[0]));
      }
    }
}

// One rank has nothing to exchange: auto passes through (a copy is exact); a forced
// algorithm still runs, for tests. LGRECO_MODE=off on every rank passes through quietly.
BOOST_AUTO_TEST_CASE(one_rank_and_mode_off_pass_through) {
  Job job;
  job.ranks = 1;
  job.buckets = {fixed_layout({5000}, {quant(4)}, DType::kFloat32)};
  job.options = [](int) { return fixed_options(Algorithm::kAuto, true); };
  job.input = random_inputs(job.buckets, test::run_seed());
  job.steps = 2;
  auto results = run_job(job);
  for (const CallOutcome& o : results[0].outcomes) {
    BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough));
    BOOST_TEST(test::contains(o.message, "one rank"), o.message);
  }
  job.ranks = 3;
  job.options = [](int) {
    EngineOptions o = fixed_options(Algorithm::kAuto, true);
    o.mode = config::Mode::kOff;
    return o;
  };
  results = run_job(job);
  for (const auto& r : results)
    for (const CallOutcome& o : r.outcomes) {
      BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough));
      BOOST_TEST(o.message == "LGRECO_MODE=off");
    }
}

// With error feedback the error of the sum over many steps stays at about one step's
// error; without it, it grows like the square root of the steps.
BOOST_AUTO_TEST_CASE(error_feedback_keeps_the_accumulated_error_bounded) {
  const uint64_t seed = test::run_seed();
  const int ranks = 4, steps = 60;
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather}) {
    double accumulated_error[2], one_step_error = 0;
    for (int ef = 0; ef < 2; ++ef) {
      Job job;
      job.ranks = ranks;
      job.buckets = {fixed_layout({5000, 20000}, {quant(2, 256), quant(3)}, DType::kFloat32)};
      job.options = [&](int) { return fixed_options(algorithm, ef == 1); };
      job.input = random_inputs(job.buckets, seed);
      job.steps = steps;
      const auto results = run_job(job);
      std::vector<double> exact(job.buckets[0].count, 0.0), got(job.buckets[0].count, 0.0);
      for (int s = 0; s < steps; ++s) {
        double step_error = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto x = to_double(job.input(r, s, 0), DType::kFloat32);
          for (size_t i = 0; i < x.size(); ++i) exact[i] += x[i];
        }
        const auto out = to_double(results[0].outputs[s], DType::kFloat32);
        for (int r = 1; r < ranks; ++r) BOOST_TEST((results[r].outputs[s] == results[0].outputs[s]));
        for (size_t i = 0; i < out.size(); ++i) got[i] += out[i];
        if (s == 0 && ef == 0) {
          for (size_t i = 0; i < out.size(); ++i) step_error += (out[i] - exact[i]) * (out[i] - exact[i]);
          one_step_error = std::sqrt(step_error);
        }
      }
      double e = 0;
      for (size_t i = 0; i < got.size(); ++i) e += (got[i] - exact[i]) * (got[i] - exact[i]);
      accumulated_error[ef] = std::sqrt(e);
    }
    BOOST_TEST_CONTEXT(algorithm_name(algorithm) << ": one step " << one_step_error << ", " << steps
                                                 << " steps without feedback " << accumulated_error[0] << ", with "
                                                 << accumulated_error[1]) {
      BOOST_TEST(accumulated_error[0] > 3.0 * one_step_error);  // grows like sqrt(steps) ~ 7.7
      BOOST_TEST(accumulated_error[1] < 2.0 * one_step_error);  // bounded by the last residuals
    }
  }
}

BOOST_AUTO_TEST_CASE(an_overflow_step_is_non_finite_everywhere_and_keeps_residuals) {
  const uint64_t seed = test::run_seed();
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather}) {
    Job job;
    job.ranks = 3;
    job.buckets = {fixed_layout({8192, 8192}, {quant(4), quant(4)}, DType::kFloat16)};
    job.options = [&](int) { return fixed_options(algorithm, true); };
    auto clean = random_inputs(job.buckets, seed);
    job.input = [clean](int r, uint64_t step, uint32_t b) {
      Bytes x = clean(r, step, b);
      if (step == 2 && r == 1) store_from_float(x.data(), DType::kFloat16, 100, INFINITY);   // layer 0
      if (step == 2 && r == 2) store_from_float(x.data(), DType::kFloat16, 5000, NAN);       // layer 0
      return x;
    };
    job.steps = 4;
    job.snapshot_residuals = true;
    const auto results = run_job(job);
    BOOST_TEST_CONTEXT(algorithm_name(algorithm)) {
      for (int r = 0; r < 3; ++r) {
        BOOST_TEST((results[r].outputs[2] == results[0].outputs[2]));
        const auto out = to_double(results[r].outputs[2], DType::kFloat16);
        BOOST_TEST(!std::isfinite(out[100]));
        BOOST_TEST(!std::isfinite(out[5000]));
        bool layer1_finite = true;
        for (size_t i = 8192; i < out.size(); ++i) layer1_finite &= std::isfinite(out[i]);
        BOOST_TEST(layer1_finite);
        const auto next = to_double(results[r].outputs[3], DType::kFloat16);
        bool all_finite = true;
        for (double v : next) all_finite &= std::isfinite(v);
        BOOST_TEST(all_finite);  // nothing non-finite was kept
      }
      // Ranks 1 and 2 saw the overflow in layer 0: its residual is the one of step 1.
      for (int r : {1, 2}) {
        const auto& before = results[r].residuals[1];
        const auto& after = results[r].residuals[2];
        BOOST_TEST(memcmp(before.data(), after.data(), 8192 * 4) == 0);
        BOOST_TEST(memcmp(before.data() + 8192, after.data() + 8192, 8192 * 4) != 0);  // layer 1 moved on
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(configurations_that_differ_pass_through_on_every_rank) {
  const auto layout = fixed_layout({4096}, {quant(4)}, DType::kFloat32);
  struct Case {
    const char* name;
    std::function<EngineOptions(int)> options;
    std::vector<BucketLayout> (*buckets)(const BucketLayout&, int);
    const char* expected;
  };
  auto same = [](const BucketLayout& b, int) { return std::vector<BucketLayout>{b}; };
  const Case cases[] = {
      {"parameters",
       [](int r) {
         EngineOptions o = fixed_options(Algorithm::kAuto, true);
         if (r == 2) o.parameters_text = "other";
         return o;
       },
       same, "LGRECO_* parameters that differ from rank 0's on rank(s) 2"},
      {"invalid",
       [](int r) {
         EngineOptions o = fixed_options(Algorithm::kAuto, true);
         if (r == 1) {
           o.valid = false;
           o.invalid_reason = "LGRECO_ALPHA=-1";
         }
         return o;
       },
       same, "invalid configuration or a local failure (that rank's WARN says which) on rank(s) 1"},
      {"layouts", [](int) { return fixed_options(Algorithm::kAuto, true); },
       [](const BucketLayout& b, int r) {
         BucketLayout other = b;
         if (r == 0) other.layers[0].candidates = {quant(2)};
         return std::vector<BucketLayout>{other};
       },
       "bucket layouts (registration file) that differ from rank 0's on rank(s) 1, 2"},
  };
  for (const Case& c : cases) {
    auto hub = std::make_shared<InProcHub>(3, 10000ms);
    std::vector<std::vector<CallOutcome>> outcomes(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r)
      threads.emplace_back([&, r] {
        InProcFabric fabric(hub, r);
        CpuBackend backend;
        Engine engine(c.options(r), c.buckets(layout, r), fabric, backend);
        std::vector<float> x(4096, 1.0f);
        for (uint64_t step = 0; step < 3; ++step)
          outcomes[r].push_back(engine.allreduce({0, step, x.data(), x.data(), 4096, DType::kFloat32, ReduceOp::kSum}));
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < 3; ++r)
      BOOST_TEST_CONTEXT(c.name << ", rank " << r) {
        for (const CallOutcome& o : outcomes[r]) BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough));
        BOOST_TEST(test::contains(outcomes[r][0].message, c.expected), outcomes[r][0].message);
      }
  }
}

// A layout that one rank's engine rejects (a layer past the bucket's end) is that rank's
// own mistake: make_engine_or_pass_through gives it an invalid engine that still joins
// the agreement, so all three ranks pass through together rather than rank 1 failing
// alone and the others waiting for it.
BOOST_AUTO_TEST_CASE(a_layout_one_rank_rejects_passes_through_on_every_rank) {
  const BucketLayout good = fixed_layout({4096}, {quant(4)}, DType::kFloat32);
  BucketLayout bad = good;
  bad.layers[0].numel = good.count + 1;
  {
    auto hub = std::make_shared<InProcHub>(1, 1000ms);
    InProcFabric fabric(hub, 0);
    CpuBackend backend;
    BOOST_CHECK_THROW(Engine(fixed_options(Algorithm::kAuto, true), {bad}, fabric, backend), std::invalid_argument);
  }
  auto hub = std::make_shared<InProcHub>(3, 10000ms);
  std::vector<std::vector<CallOutcome>> outcomes(3);
  std::vector<std::vector<float>> data(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      CpuBackend backend;
      const auto engine =
          make_engine_or_pass_through(fixed_options(Algorithm::kAuto, true), {r == 1 ? bad : good}, fabric, backend);
      data[r].assign(4096, 0.5f + static_cast<float>(r));
      for (uint64_t step = 0; step < 3; ++step)
        outcomes[r].push_back(
            engine->allreduce({0, step, data[r].data(), data[r].data(), 4096, DType::kFloat32, ReduceOp::kSum}));
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) BOOST_TEST_CONTEXT("rank " << r) {
      for (const CallOutcome& o : outcomes[r]) BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough));
      BOOST_TEST(test::contains(outcomes[r][0].message, "invalid configuration or a local failure"),
                 outcomes[r][0].message);
      BOOST_TEST(test::contains(outcomes[r][0].message, "on rank(s) 1"), outcomes[r][0].message);
      BOOST_TEST(data[r][17] == 0.5f + static_cast<float>(r));  // untouched: the caller reduces
    }
}

BOOST_AUTO_TEST_CASE(a_rank_that_stops_gives_errors_not_a_hang) {
  Job job;
  job.ranks = 4;
  job.buckets = {fixed_layout({1 << 16}, {quant(4)}, DType::kFloat32)};
  job.options = [](int) { return fixed_options(Algorithm::kScatterReduceAllGather, true); };
  job.input = random_inputs(job.buckets, test::run_seed());
  job.steps = 5;
  job.timeout = 300ms;
  job.stops = [](int r, uint64_t step) { return r == 3 && step == 2; };
  const auto start = std::chrono::steady_clock::now();
  const auto results = run_job(job);
  BOOST_TEST(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 10.0);
  for (int r = 0; r < 3; ++r) {
    BOOST_TEST_REQUIRE(results[r].outcomes.size() == 5u);
    BOOST_TEST((results[r].outcomes[1].kind == CallOutcome::Kind::kDone));
    BOOST_TEST((results[r].outcomes[2].kind == CallOutcome::Kind::kError));
    BOOST_TEST(test::contains(results[r].outcomes[2].message, "dead or stalled"), results[r].outcomes[2].message);
    BOOST_TEST((results[r].outcomes[4].kind == CallOutcome::Kind::kError));
    BOOST_TEST(test::contains(results[r].outcomes[4].message, "an earlier compressed allreduce failed"));
  }
}

// The CPU backend behind another class's overrides (the test backends below).
class ForwardingBackend : public Backend {
 public:
  std::string name() const override { return cpu_.name(); }
  std::string unsupported(const CodecSpec& spec) const override { return cpu_.unsupported(spec); }
  std::unique_ptr<Buffer> allocate(uint64_t bytes) override { return cpu_.allocate(bytes); }
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override { return cpu_.allocate_host(bytes); }
  void fill_zero(void* d, uint64_t n) override { cpu_.fill_zero(d, n); }
  void copy(void* d, const void* s, uint64_t n) override { cpu_.copy(d, s, n); }
  void upload(void* d, const void* s, uint64_t n) override { cpu_.upload(d, s, n); }
  std::unique_ptr<Event> read_back(void* d, const void* s, uint64_t n) override { return cpu_.read_back(d, s, n); }
  void find_nonfinite(const Plan& p, std::span<const Segment> g, ElementSpan in, uint8_t* f) override {
    cpu_.find_nonfinite(p, g, in, f);
  }
  void encode(const Plan& p, std::span<const Segment> g, ElementSpan in, float* r, uint64_t rf, const uint8_t* f,
              const NoiseBase& nb, uint8_t* out, uint64_t base) override {
    cpu_.encode(p, g, in, r, rf, f, nb, out, base);
  }
  void decode(const Plan& p, std::span<const Segment> g, const uint8_t* in, uint64_t base, ElementSpan out) override {
    cpu_.decode(p, g, in, base, out);
  }
  void decode_accumulate(const Plan& p, std::span<const Segment> g, const uint8_t* in, uint64_t base,
                         ElementSpan acc) override {
    cpu_.decode_accumulate(p, g, in, base, acc);
  }
  void accumulate_exact(const Plan& p, std::span<const Segment> g, ElementSpan in, float* r, uint64_t rf,
                        const uint8_t* f, ElementSpan acc) override {
    cpu_.accumulate_exact(p, g, in, r, rf, f, acc);
  }
  void divide(float* a, uint64_t n, float d) override { cpu_.divide(a, n, d); }
  void narrow(const float* a, uint64_t n, ElementSpan out) override { cpu_.narrow(a, n, out); }
  void gather(std::span<const Run> r, ElementSpan src, uint64_t end, float scale, bool acc, float* dst) override {
    cpu_.gather(r, src, end, scale, acc, dst);
  }
  void distance(std::span<const Segment> g, ElementSpan a, const float* b, int power, double w, double* out,
                uint8_t* nf) override {
    cpu_.distance(g, a, b, power, w, out, nf);
  }
  void sketch(std::span<const SketchRun> r, const float* src, float* dst) override { cpu_.sketch(r, src, dst); }
  void measure(const Plan& p, std::span<const Segment> g, ElementSpan in, const float* r, uint64_t rf,
               const Measure& m) override {
    cpu_.measure(p, g, in, r, rf, m);
  }
  void lowrank_project(std::span<const LowRankLayer> l, ElementSpan in, const float* r, const uint8_t* f,
                       const float* q, float* p) override {
    cpu_.lowrank_project(l, in, r, f, q, p);
  }
  void lowrank_orthonormalize(std::span<const LowRankLayer> l, float* p) override { cpu_.lowrank_orthonormalize(l, p); }
  void lowrank_back_project(std::span<const LowRankLayer> l, ElementSpan in, float* r, const uint8_t* f,
                            const float* p, float* q) override {
    cpu_.lowrank_back_project(l, in, r, f, p, q);
  }
  void lowrank_reconstruct(std::span<const LowRankLayer> l, const float* p, const float* q, float scale,
                           ElementSpan out) override {
    cpu_.lowrank_reconstruct(l, p, q, scale, out);
  }
  void lowrank_keep(std::span<const LowRankLayer> l, const float* q_new, const float* q0, float* q) override {
    cpu_.lowrank_keep(l, q_new, q0, q);
  }
  void measure_lowrank(std::span<const LowRankLayer> l, ElementSpan in, const float* r, const NoiseBase& key,
                       const Measure& m) override {
    cpu_.measure_lowrank(l, in, r, key, m);
  }
  uint64_t mark() override { return cpu_.mark(); }
  bool mark_ready(uint64_t m) override { return cpu_.mark_ready(m); }
  void wait_mark(uint64_t m) override { cpu_.wait_mark(m); }
  double seconds_between(uint64_t a, uint64_t b) override { return cpu_.seconds_between(a, b); }
  void release_mark(uint64_t m) override { cpu_.release_mark(m); }

 protected:
  CpuBackend cpu_;
};

// A backend that fails, as a CUDA error would, in the middle of a call: after the
// all-to-all, while the peers wait for this rank's re-encoded partition.
class FailingBackend final : public ForwardingBackend {
 public:
  explicit FailingBackend(uint64_t fail_at_step) : fail_at_step_(fail_at_step) {}
  uint64_t step = 0;
  bool lacks_topk = false;  // as a backend without TopK kernels
  std::string name() const override { return "failing"; }
  std::string unsupported(const CodecSpec& spec) const override {
    if (lacks_topk && spec.family() == CodecFamily::kTopk) return "this backend has no TopK kernels";
    return Backend::unsupported(spec);  // no low-rank operations here
  }
  void decode_accumulate(const Plan& p, std::span<const Segment> g, const uint8_t* in, uint64_t base,
                         ElementSpan acc) override {
    if (step == fail_at_step_) throw std::runtime_error("CUDA error: an illegal memory access was encountered");
    cpu_.decode_accumulate(p, g, in, base, acc);
  }

 private:
  uint64_t fail_at_step_;
};

BOOST_AUTO_TEST_CASE(a_rank_that_fails_mid_call_fails_its_peers_at_once) {
  const int ranks = 3;
  auto hub = std::make_shared<InProcHub>(ranks, 20000ms);  // far longer than the test may take
  std::vector<std::vector<CallOutcome>> outcomes(ranks);
  std::vector<double> seconds(ranks);
  std::vector<std::thread> threads;
  const auto layout = fixed_layout({1 << 16}, {quant(4)}, DType::kFloat32);
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      FailingBackend backend(r == 1 ? 2 : UINT64_MAX);
      Engine engine(fixed_options(Algorithm::kScatterReduceAllGather, true), {layout}, fabric, backend);
      std::vector<float> x(layout.count, 1.0f), y(layout.count);
      const auto start = std::chrono::steady_clock::now();
      for (uint64_t step = 0; step < 4; ++step) {
        backend.step = step;
        outcomes[r].push_back(
            engine.allreduce({0, step, x.data(), y.data(), layout.count, DType::kFloat32, ReduceOp::kSum}));
      }
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r)
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(seconds[r] < 5.0);  // not the 20 s timeout
      BOOST_TEST((outcomes[r][1].kind == CallOutcome::Kind::kDone));
      BOOST_TEST((outcomes[r][2].kind == CallOutcome::Kind::kError));
      BOOST_TEST((outcomes[r][3].kind == CallOutcome::Kind::kError));
      BOOST_TEST(test::contains(outcomes[r][2].message, r == 1 ? "illegal memory access" : "rank 1 aborted"),
                 outcomes[r][2].message);
    }
}

// A backend whose queue runs a step behind the host, as a GPU's may: what was queued in
// a step is done once the host has reached the next step (the test says when), not
// before, so a wait for a read-back or a mark of the current step is a stall. The CPU
// does the work at once, so the bytes are right either way. From a given step it can also
// refuse to prepare for a plan, as a backend without the kernels or the memory would.
class LaggingBackend final : public ForwardingBackend {
 public:
  uint64_t step = 0;  // the host's step (before_step)
  uint64_t refuse_prepare_from = UINT64_MAX;
  std::string name() const override { return "lagging"; }
  std::unique_ptr<Event> read_back(void* d, const void* s, uint64_t n) override {
    cpu_.read_back(d, s, n)->wait();
    return std::make_unique<StepEvent>(*this, step);
  }
  void prepare_encode(const Plan& plan) override {
    if (step >= refuse_prepare_from) throw std::runtime_error("no room for this plan's kernels");
    cpu_.prepare_encode(plan);
  }
  uint64_t mark() override {
    const uint64_t m = cpu_.mark();
    marked_at_[m] = step;
    return m;
  }
  bool mark_ready(uint64_t m) override { return marked_at_.at(m) < step; }
  void release_mark(uint64_t m) override {
    marked_at_.erase(m);
    cpu_.release_mark(m);
  }

 private:
  class StepEvent final : public Event {
   public:
    StepEvent(const LaggingBackend& backend, uint64_t queued_at) : backend_(backend), queued_at_(queued_at) {}
    bool ready() override { return queued_at_ < backend_.step; }
    void wait() override {}

   private:
    const LaggingBackend& backend_;
    uint64_t queued_at_;
  };
  std::map<uint64_t, uint64_t> marked_at_;
};

// Quantization at 2..8 bits: the candidates of the adaptive jobs below.
std::vector<CodecSpec> quant_bit_candidates() {
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  return candidates;
}

// Layers of these sizes ("layer0", ...), each with these candidates, the default the one
// at `default_candidate`.
BucketLayout candidate_bucket(const std::vector<uint64_t>& sizes, const std::vector<CodecSpec>& candidates,
                              uint32_t default_candidate = 2) {
  BucketLayout bucket;
  for (size_t l = 0; l < sizes.size(); ++l) {
    bucket.layers.push_back({"layer" + std::to_string(l), bucket.count, sizes[l], candidates, default_candidate});
    bucket.count += sizes[l];
  }
  return bucket;
}

// Four layers of 30000, 50000, 20000 and 4096 values with these candidates.
BucketLayout four_layer_bucket(const std::vector<CodecSpec>& candidates) {
  return candidate_bucket({30000, 50000, 20000, 4096}, candidates);
}

// Adaptive, 3 ranks, sra with the error probe: windows end at steps 1, 7, 13 (warm-up 2,
// period 6, window 2) and their assignments take effect `lag` steps later.
Job lagging_job(uint64_t lag, uint64_t seed) {
  const std::vector<CodecSpec> candidates = quant_bit_candidates();
  const BucketLayout bucket = four_layer_bucket(candidates);
  Job job;
  job.ranks = 3;
  job.buckets = {bucket, fixed_layout({7000, 9000}, {quant(4), quant(4)}, DType::kFloat32)};
  job.buckets[1].layers[0].candidates = candidates;
  job.options = [lag, candidates](int) {
    EngineOptions o = adaptive_options(candidates, "lagging");
    o.algorithm = Algorithm::kScatterReduceAllGather;
    o.controller.schedule = {2, 6, 2, lag};
    return o;
  };
  job.input = [seed, bucket](int r, uint64_t step, uint32_t b) {
    std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ (step << 8) ^ b);
    std::vector<float> x = test::draw(test::Dist::kNormal, b == 0 ? bucket.count : 16000, rng);
    for (size_t i = 0; i < x.size(); ++i) x[i] *= b == 1 || i < 30000 ? 100.0f : i < 80000 ? 0.01f : 1.0f;
    return to_dtype(x, DType::kFloat32);
  };
  job.steps = 18;
  return job;
}

// Issue "ready for the first GPU run", finding 3: the statistics' sum is read a step after
// it was queued, the agreement on an assignment is queued a step before it takes effect.
// With a lag of 3 or more the only stall is the first call's comparison of configurations;
// a lag of 2 waits for the sum at each switch, a lag of 1 for the agreement too. The
// results are those of a backend that is never behind.
BOOST_AUTO_TEST_CASE(the_host_waits_for_nothing_it_just_queued) {
  const uint64_t seed = test::run_seed();
  for (uint64_t lag : {1, 2, 3, 4}) {
    BOOST_TEST_CONTEXT("switch lag " << lag << " seed " << seed) {
      Job job = lagging_job(lag, seed);
      const auto prompt = run_job(job);  // CpuBackend: every wait finds the work done
      job.before_step = [](int, uint64_t step, Backend& b) { static_cast<LaggingBackend&>(b).step = step; };
      job.backend = [](int) { return std::make_unique<LaggingBackend>(); };
      const auto lagging = run_job(job);
      const uint64_t switches = 3;  // at 1 + lag, 7 + lag, 13 + lag (all < 18)
      const uint64_t per_switch = lag == 1 ? 2 : lag == 2 ? 1 : 0;
      for (int r = 0; r < job.ranks; ++r) BOOST_TEST_CONTEXT("rank " << r) {
          for (const CallOutcome& o : lagging[r].outcomes) BOOST_TEST((o.kind == CallOutcome::Kind::kDone), o.message);
          BOOST_TEST(lagging[r].outputs == prompt[r].outputs);
          BOOST_TEST(lagging[r].outputs == lagging[0].outputs);
          BOOST_TEST(lagging[r].codecs == prompt[r].codecs);
          BOOST_TEST(lagging[r].epoch == switches);
          BOOST_TEST(prompt[r].counters.host_stalls == 0u);
          BOOST_TEST(lagging[r].counters.host_stalls == 1 + switches * per_switch);
          // Every window's samples and timings, every sum and agreement were waited for.
          BOOST_TEST(lagging[r].counters.host_waits > 3 * switches);
        }
      BOOST_TEST(lagging[0].codecs != std::vector<std::string>(4, quant(4).str()));
    }
  }
}

// Staged a step ahead, an assignment that one rank cannot prepare for still makes every
// rank pass through together, from the step it was due at; the step before it runs the
// assignment in effect on every rank.
BOOST_AUTO_TEST_CASE(an_assignment_one_rank_cannot_stage_passes_through_on_every_rank) {
  const uint64_t seed = test::run_seed();
  Job job = lagging_job(3, seed);
  job.steps = 8;
  job.before_step = [](int, uint64_t step, Backend& b) { static_cast<LaggingBackend&>(b).step = step; };
  job.backend = [](int r) {
    auto b = std::make_unique<LaggingBackend>();
    if (r == 1) b->refuse_prepare_from = 3;  // the first switch is staged at step 3, due at 4
    return b;
  };
  const auto results = run_job(job);
  for (int r = 0; r < job.ranks; ++r) BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(results[r].outcomes.size() == 16u);
      for (size_t c = 0; c < results[r].outcomes.size(); ++c) {
        const CallOutcome& o = results[r].outcomes[c];
        if (c < 8) {
          BOOST_TEST((o.kind == CallOutcome::Kind::kDone), o.message);
          BOOST_TEST((results[r].outputs[c] == results[0].outputs[c]));
        } else {
          BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough), o.message);
          BOOST_TEST(test::contains(o.message,
                                    "from step 4: an invalid configuration or a local failure (that rank's "
                                    "WARN says which) on rank(s) 1"),
                     o.message);
        }
      }
      BOOST_TEST(results[r].epoch == 0u);
      BOOST_TEST(results[r].counters.errors == 0u);
    }
}

// A sum that overflows float16 in a `none` layer (finite inputs) is infinite once, like
// NCCL's, and later steps are right again: the residual must not keep the infinity.
BOOST_AUTO_TEST_CASE(a_float16_sum_overflow_does_not_stick) {
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather}) {
    Job job;
    job.ranks = 3;
    job.buckets = {fixed_layout({4096, 4096}, {CodecSpec::none(), quant(4)}, DType::kFloat16)};
    job.options = [&](int) { return fixed_options(algorithm, true); };
    job.input = [](int, uint64_t step, uint32_t) {
      return to_dtype(std::vector<float>(8192, step == 0 ? 30000.0f : 1.0f), DType::kFloat16);
    };
    job.steps = 4;
    const auto results = run_job(job);
    BOOST_TEST_CONTEXT(algorithm_name(algorithm)) {
      for (int r = 0; r < 3; ++r) {
        const auto first = to_double(results[r].outputs[0], DType::kFloat16);
        BOOST_TEST(std::isinf(first[0]));  // 90000 > 65504
        for (uint64_t step = 1; step < 4; ++step) {
          const auto out = to_double(results[r].outputs[step], DType::kFloat16);
          BOOST_TEST(out[0] == 3.0, "step " << step);
          BOOST_TEST(out[4095] == 3.0, "step " << step);
        }
      }
    }
  }
}

// The engine's options from the LGRECO_* parameters, and registered buckets as layouts.
BOOST_AUTO_TEST_CASE(options_from_parameters_and_layouts_from_registrations) {
  config::ParamSources sources;
  sources.read_file = [](const std::string&, bool* missing, std::string*) -> std::optional<std::string> {
    *missing = true;
    return std::nullopt;
  };
  sources.environment = {{"LGRECO_CODEC", "quant:bits=3"}, {"LGRECO_OBJECTIVE", "time"},
                         {"LGRECO_ALGORITHM", "sra"}, {"LGRECO_ERROR_FEEDBACK", "0"}};
  EngineOptions o = EngineOptions::from_params(config::load_params(sources), 0);
  BOOST_TEST(o.valid);
  BOOST_TEST(o.codec.str() == quant(3).str());
  BOOST_TEST(!o.error_feedback);
  BOOST_TEST(algorithm_name(o.algorithm) == "sra");
  BOOST_TEST(o.candidates.size() == 8u);  // 2..8 bits and `none`, added by the time objective
  BOOST_TEST(o.candidates.back().str() == "none");
  sources.environment.push_back({"LGRECO_ALPHA", "2"});
  BOOST_TEST(EngineOptions::from_params(config::load_params(sources), 0).parameters_text != o.parameters_text);
  sources.environment.push_back({"LGRECO_TIMEOUT", "5"});  // may differ between ranks
  const std::string with_alpha = EngineOptions::from_params(config::load_params(sources), 0).parameters_text;
  sources.environment.pop_back();
  BOOST_TEST(EngineOptions::from_params(config::load_params(sources), 0).parameters_text == with_alpha);
  sources.environment.push_back({"LGRECO_WINDOW", "0"});
  const EngineOptions invalid = EngineOptions::from_params(config::load_params(sources), 0);
  BOOST_TEST(!invalid.valid);
  BOOST_TEST(test::contains(invalid.invalid_reason, "LGRECO_WINDOW=0"), invalid.invalid_reason);
  // PowerSGD applies where a layer is a matrix whose factors are smaller than it; elsewhere
  // its candidates are left out, and a powersgd default becomes `none`.
  {
    config::ParamSources lowrank = sources;
    lowrank.environment = {{"LGRECO_CODEC", "powersgd:rank=4"}, {"LGRECO_CANDIDATES", "quant:bits=2;powersgd:rank=2"}};
    const EngineOptions lo = EngineOptions::from_params(config::load_params(lowrank), 0);
    BOOST_TEST(lo.valid, lo.invalid_reason);
    config::RegisteredBucket b;
    b.count = 4096 + 2048 + 300 * 4;
    b.layers.push_back({"square", 0, 4096, {64, 64}, true, {}});          // (64 + 64) x 4 x 2 < 4096: pays
    b.layers.push_back({"wide", 4096, 2048, {2, 1024}, true, {}});        // (2 + 1024) x 2 x 2 > 2048: never
    b.layers.push_back({"segment", 6144, 1200, {}, false, {}});           // no shape: no low rank
    const BucketLayout layout = layout_from_registration(b, lo);
    auto names = [](const LayerLayout& l) {
      std::string t;
      for (const CodecSpec& c : l.candidates) t += c.str() + ";";
      return t + " default " + l.candidates[l.default_index].str();
    };
    BOOST_TEST(layout.layers[0].rows == 64u);
    BOOST_TEST(names(layout.layers[0]) == "quant:bits=2,bucket=1024,rounding=stochastic;powersgd:rank=2;powersgd:rank=4; default powersgd:rank=4");
    BOOST_TEST(layout.layers[1].rows == 2u);
    BOOST_TEST(names(layout.layers[1]) == "quant:bits=2,bucket=1024,rounding=stochastic;none; default none");
    BOOST_TEST(layout.layers[2].rows == 0u);
    BOOST_TEST(names(layout.layers[2]) == "quant:bits=2,bucket=1024,rounding=stochastic;none; default none");
  }

  config::RegisteredBucket bucket;
  bucket.count = 4096 + 64 + 2048;
  bucket.layers.push_back({"fc.weight", 0, 4096, {64, 64}, true, {}});
  bucket.layers.push_back({"fc.bias", 4096, 64, {64}, true, {}});
  bucket.layers.push_back({"head.weight", 4160, 2048, {32, 64}, true, {}});
  bucket.layers.back().compress.kind = config::CompressRule::Kind::kPinned;
  bucket.layers.back().compress.codec = quant(8);
  const BucketLayout adaptive = layout_from_registration(bucket, o);
  BOOST_TEST(adaptive.layers[0].candidates.size() == o.candidates.size());
  BOOST_TEST(adaptive.layers[0].candidates[adaptive.layers[0].default_index].str() == quant(3).str());
  BOOST_TEST(adaptive.layers[1].candidates.size() == 1u);  // 1-D: never compressed
  BOOST_TEST(adaptive.layers[1].candidates[0].str() == "none");
  BOOST_TEST(adaptive.layers[2].candidates.size() == 1u);  // pinned
  BOOST_TEST(adaptive.layers[2].candidates[0].str() == quant(8).str());
  o.mode = config::Mode::kUniform;
  const BucketLayout uniform = layout_from_registration(bucket, o);
  BOOST_TEST(uniform.layers[0].candidates.size() == 1u);
  BOOST_TEST(uniform.layers[0].candidates[0].str() == quant(3).str());
}

// The squared error of one layer of an allreduce's output against the exact sum (or with
// `average`, the mean) of the ranks' inputs, `input(r)` each rank's whole bucket.
template <typename Input>
double output_error(const std::vector<double>& out, const LayerLayout& layer, int ranks, bool average,
                    const Input& input) {
  std::vector<double> exact(layer.numel, 0.0);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<float> x = input(r);
    for (uint64_t i = 0; i < layer.numel; ++i) exact[i] += x[layer.offset + i];
  }
  double error = 0;
  for (uint64_t i = 0; i < layer.numel; ++i) {
    const double want = average ? exact[i] / ranks : exact[i];
    error += (out[layer.offset + i] - want) * (out[layer.offset + i] - want);
  }
  return error;
}

// What the controller is told a layer's default codec costs in error is what the output
// of the allreduce really carries: both quantizations of sra counted, and for ncclAvg the
// first scaled by 1/P^2 like the sum it belongs to.
BOOST_AUTO_TEST_CASE(measured_errors_are_the_output_errors) {
  const uint64_t seed = test::run_seed();
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      const int ranks = 4;
      const BucketLayout bucket = candidate_bucket({60000, 90000}, candidates);
      auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
      std::vector<std::vector<Bytes>> outputs(ranks);
      std::optional<controller::ErrorStats> stats;
      auto input = [&](int r, uint64_t step) {
        std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
        std::vector<float> x = test::draw(test::Dist::kNormal, bucket.count, rng);
        for (size_t i = 0; i < x.size(); ++i) x[i] += 3.0f;  // correlated ranks: the sum's range grows
        return x;
      };
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          InProcFabric fabric(hub, r);
          CpuBackend backend;
          EngineOptions o;
          o.codec = quant(4);
          o.candidates = candidates;
          o.error_feedback = false;
          o.algorithm = algorithm;
          o.parameters_text = "measure";
          o.controller.schedule = {3, 100, 2, 2};  // measures steps 1 and 2, submits at step 3
          Engine engine(o, {bucket}, fabric, backend);
          for (uint64_t step = 0; step < 4; ++step) {
            const std::vector<float> x = input(r, step);
            std::vector<float> y(x.size());
            engine.allreduce({0, step, x.data(), y.data(), bucket.count, DType::kFloat32, op});
            outputs[r].push_back(to_dtype(y, DType::kFloat32));
          }
          if (r == 0) stats = engine.last_window_stats();
        });
      for (auto& t : threads) t.join();
      BOOST_TEST_REQUIRE(stats.has_value());
      for (size_t l = 0; l < 2; ++l) {
        double realized = 0;
        for (uint64_t step : {1u, 2u})
          realized += output_error(to_double(outputs[0][step], DType::kFloat32), bucket.layers[l], ranks,
                                   op == ReduceOp::kAvg, [&](int r) { return input(r, step); });
        BOOST_TEST(stats->samples(l) == 2u);  // one per step: the probe's rank counts it
        const double measured = stats->mean(l, 2) * static_cast<double>(stats->samples(l));  // 4 bits, the default
        BOOST_TEST_CONTEXT(algorithm_name(algorithm) << (op == ReduceOp::kAvg ? " avg" : " sum") << " layer " << l
                                                     << ": measured " << measured << ", realized " << realized) {
          BOOST_TEST(measured > 0.9 * realized);
          BOOST_TEST(measured < 1.1 * realized);
        }
      }
    }
}

// Where windows are short (Controller::pools_lead), the steps that lead a later window are
// measured too, the same way, and reach the controller beside the window's: the quantizers'
// pools take them in. The first window's lead is not (its shadows are young).
BOOST_AUTO_TEST_CASE(the_lead_steps_of_short_windows_are_measured_for_the_pools) {
  const uint64_t seed = test::run_seed();
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  const int ranks = 3;
  const BucketLayout bucket = candidate_bucket({50000, 70000}, candidates);
  auto input = [&](int r, uint64_t step) {
    std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
    std::vector<float> x = test::draw(test::Dist::kNormal, bucket.count, rng);
    for (float& v : x) v = v * (1.0f + 0.1f * static_cast<float>(step)) + 2.0f;
    return x;
  };
  for (uint64_t window : {2u, 8u}) {
    auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
    // Warmup 3, period window + 3: the first window ends at step 2, the second at step
    // window + 5 and is submitted a step later; its lead is steps 3, 4 and 5.
    const uint64_t last = window + 6;
    std::vector<std::vector<float>> outputs;
    std::optional<controller::ErrorStats> first_lead, lead, stats;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        InProcFabric fabric(hub, r);
        CpuBackend backend;
        EngineOptions o;
        o.codec = quant(4);
        o.candidates = candidates;
        o.error_feedback = false;  // each step's error is its output's alone
        o.parameters_text = "measure";
        o.controller.schedule = {3, window + 3, window, 1};
        Engine engine(o, {bucket}, fabric, backend);
        for (uint64_t step = 0; step <= last; ++step) {
          const std::vector<float> x = input(r, step);
          std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
          engine.allreduce({0, step, x.data(), y.data(), bucket.count, DType::kFloat32, ReduceOp::kSum});
          if (r == 0) outputs.push_back(y);
          if (r == 0 && !first_lead && engine.last_window_stats()) first_lead = engine.last_lead_stats();
        }
        if (r == 0) lead = engine.last_lead_stats(), stats = engine.last_window_stats();
      });
    for (auto& t : threads) t.join();
    BOOST_TEST_REQUIRE(stats.has_value());
    BOOST_TEST_CONTEXT("window " << window) {
      BOOST_TEST(stats->samples(0) == window);  // the second window's, submitted
      if (window == 8) {                        // not pooled: no lead measured
        BOOST_TEST(!lead.has_value());
        continue;
      }
      BOOST_TEST_REQUIRE(lead.has_value());
      BOOST_TEST_REQUIRE(first_lead.has_value());
      for (size_t l = 0; l < 2; ++l) {
        BOOST_TEST(first_lead->samples(l) == 0u);  // step 0 leads the first window: not measured
        double realized = 0;
        for (uint64_t step : {3u, 4u, 5u})
          realized += output_error(std::vector<double>(outputs[step].begin(), outputs[step].end()), bucket.layers[l],
                                   ranks, false, [&](int r) { return input(r, step); });
        BOOST_TEST(lead->samples(l) == 3u);
        const double measured = lead->mean(l, 2) * static_cast<double>(lead->samples(l));  // 4 bits, the default
        BOOST_TEST_CONTEXT("layer " << l << ": measured " << measured << ", realized " << realized) {
          BOOST_TEST(measured > 0.9 * realized);
          BOOST_TEST(measured < 1.1 * realized);
        }
        // The candidates' errors are ordered as their bit widths.
        for (uint32_t c = 1; c < candidates.size(); ++c) BOOST_TEST(lead->mean(l, c) < lead->mean(l, c - 1));
      }
    }
  }
}

// The first window has no window before it to give the first solve a drift; the probe
// steps before it (its lead) measure the gradient's magnitude alone, on every rank alike.
// Each rank's gradient here is one fixed vector times a per-step factor, so the lead's
// mean magnitude over the window's is the factors' mean ratio; the lead adds no error
// sample.
BOOST_AUTO_TEST_CASE(the_first_windows_lead_measures_the_gradients_magnitude) {
  const uint64_t seed = test::run_seed();
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  const std::vector<double> factor = {5.0, 1.7, 1.5, 1.3, 1.1, 0.8, 0.6};  // steps 0..6
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather}) {
    const int ranks = 3;
    const BucketLayout bucket = candidate_bucket({50000, 70000}, candidates);
    auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
    std::optional<controller::ErrorStats> stats;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        InProcFabric fabric(hub, r);
        CpuBackend backend;
        EngineOptions o;
        o.codec = quant(4);
        o.candidates = candidates;
        o.algorithm = algorithm;
        o.parameters_text = "lead";
        // Window 4..5 (submitted at step 5), its lead 1..3 (never step 0).
        o.controller.schedule = {6, 100, 2, 2, 3};
        Engine engine(o, {bucket}, fabric, backend);
        std::mt19937_64 rng(seed ^ (uint64_t(r) << 40));
        const std::vector<float> base = test::draw(test::Dist::kHeavyTailed, bucket.count, rng);
        for (uint64_t step = 0; step < factor.size(); ++step) {
          std::vector<float> x(base.size()), y(base.size());
          for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(base[i] * factor[step]);
          engine.allreduce({0, step, x.data(), y.data(), bucket.count, DType::kFloat32, ReduceOp::kSum});
        }
        if (r == 0) stats = engine.last_window_stats();
      });
    for (auto& t : threads) t.join();
    BOOST_TEST_REQUIRE(stats.has_value());
    for (size_t l = 0; l < 2; ++l)
      BOOST_TEST_CONTEXT(algorithm_name(algorithm) << " layer " << l) {
        BOOST_TEST(stats->samples(l) == 2u);  // the window's steps alone
        BOOST_TEST(stats->lead_magnitude_mean(l) > 0);
        const double lead = (factor[1] + factor[2] + factor[3]) / 3, window = (factor[4] + factor[5]) / 2;
        BOOST_TEST(stats->lead_magnitude_mean(l) / stats->magnitude_mean(l) == lead / window,
                   boost::test_tools::tolerance(1e-5));
      }
  }
}

// The error budget holds as measured (docs/CONTROLLER.md): over several epochs, with error
// feedback, on layers whose gradients differ in scale (four decades) and tails (normal,
// Laplace, Student's t with 4 degrees of freedom), lgreco's compression error (output
// minus the exact reduction of what was encoded, computed here from the residuals) stays
// within that of a uniform 4-bit run of the same gradients, for fewer bytes; with the
// closed loop off too, so the model is right and not only corrected. Before the error
// probe the narrow codecs were measured on the default's residuals, and this overspent:
// on the code before it, in two runs, 1.065 and 1.021 over the steady epochs, and 1.18 in
// the worst epoch of each.
// (Not under ThreadSanitizer: its threads are those of the other engine tests, and its
// size would take minutes there.)
#if !defined(__SANITIZE_THREAD__)
BOOST_AUTO_TEST_CASE(the_realized_error_stays_within_budget_over_epochs) {
  const uint64_t seed = test::run_seed();
  constexpr size_t kLayers = 16;
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  BucketLayout bucket;
  std::vector<double> scale;
  for (size_t l = 0; l < kLayers; ++l) {
    const uint64_t size = (8 + (l * 7) % 29) * 1024 + (l % 3) * 100;
    bucket.layers.push_back({"layer" + std::to_string(l), bucket.count, size, candidates, 2});
    bucket.count += size;
    scale.push_back(std::pow(10.0, -2.0 + 3.0 * static_cast<double>((l * 5) % kLayers) / (kLayers - 1)));
  }
  // Rank r's gradient: per layer, its scale times a mean shared by the ranks (80%) plus the
  // rank's own noise, of the layer's tail family (l % 3: normal, Laplace, t with 4 dof).
  const auto draw = [](size_t family, std::mt19937_64& rng) {
    if (family == 0) return std::normal_distribution<double>(0, 1)(rng);
    if (family == 1) {
      const double e = std::exponential_distribution<double>(std::sqrt(2.0))(rng);
      return rng() & 1 ? e : -e;
    }
    return std::student_t_distribution<double>(4)(rng) / std::sqrt(2.0);
  };
  const auto input = [&](int r, uint64_t step, uint32_t) {
    std::mt19937_64 shared_rng(seed ^ (step << 8)), own_rng(seed ^ (uint64_t(r + 1) << 40) ^ (step << 8));
    std::vector<float> x(bucket.count);
    for (size_t l = 0; l < kLayers; ++l)
      for (uint64_t i = 0; i < bucket.layers[l].numel; ++i) {
        const double shared = draw(l % 3, shared_rng), own = draw(l % 3, own_rng);
        x[bucket.layers[l].offset + i] = static_cast<float>(scale[l] * (std::sqrt(0.8) * shared + std::sqrt(0.2) * own));
      }
    return x;
  };
  test::PinnedRun run;
  run.ranks = 4;
  run.buckets = {bucket};
  run.steps = 36;  // switches at 7, 13, 19, 25, 31
  run.input = input;
  const auto options = [&](bool loop) {
    return [loop](int) {
      EngineOptions o;
      o.codec = quant(4);
      o.candidates.clear();
      for (int bits = 2; bits <= 8; ++bits) o.candidates.push_back(quant(bits));
      o.algorithm = Algorithm::kScatterReduceAllGather;
      o.parameters_text = "budget";
      o.controller.schedule = {6, 6, 2, 2};
      o.controller.budget_loop = loop;
      return o;
    };
  };
  test::PinnedRun uniform = run;
  uniform.options = [&](int r) {
    EngineOptions o = options(true)(r);
    o.mode = config::Mode::kUniform;
    return o;
  };
  const test::PinnedResult reference = test::run_pinned(uniform);
  BOOST_TEST_REQUIRE(reference.failures.empty(), reference.failures.front());
  const auto total = [](const test::PinnedResult& r, uint64_t from, uint64_t to) {
    double e = 0;
    for (uint64_t step = from; step < std::min<uint64_t>(to, r.error.size()); ++step)
      for (double v : r.error[step][0]) e += v;
    return e;
  };
  for (bool loop : {true, false}) {
    run.options = options(loop);
    const test::PinnedResult adaptive = test::run_pinned(run);
    BOOST_TEST_REQUIRE(adaptive.failures.empty(), adaptive.failures.front());
    // From the second adaptive epoch on (the first starts from the default's residuals).
    const double ratio = total(adaptive, 13, 36) / total(reference, 13, 36);
    std::string epochs;
    double worst = 0;
    for (uint64_t from : {7, 13, 19, 25, 31}) {
      const double epoch = total(adaptive, from, from + 6) / total(reference, from, from + 6);
      epochs += " " + std::to_string(epoch);
      worst = std::max(worst, epoch);
    }
    BOOST_TEST_CONTEXT("seed " << seed << ", loop " << (loop ? "on" : "off") << ": compression error over the uniform "
                               << "run's " << ratio << "; per epoch" << epochs) {
      BOOST_TEST_MESSAGE("loop " << (loop ? "on" : "off") << ": compression error over the uniform run's " << ratio
                                 << "; per epoch" << epochs);
      BOOST_TEST(ratio <= 1.05);
      BOOST_TEST(ratio >= 0.80);  // the budget used, not wasted
      // Every adaptive epoch. An epoch's ratio is noisy: 6 steps, solved from a 2-step
      // window, with the error carried by the few largest-scale layers, so one of them
      // on either side of a bit width's step moves it by several percent. Over seeds 1-40
      // (at 18f9004): the second adaptive epoch's ratio (the noisiest)
      // 1.00 +- 0.05, the worst epoch of a run at most 1.126, 1.08 exceeded in 7 of 80
      // runs; 1.15 is three deviations above. (Before the probe: 1.15-1.18 in every run.)
      BOOST_TEST(worst <= 1.15);
      const uint64_t bytes = adaptive.encoded_bytes[35] - adaptive.encoded_bytes[12];
      const uint64_t uniform_bytes = reference.encoded_bytes[35] - reference.encoded_bytes[12];
      BOOST_TEST(bytes * 1.1 < uniform_bytes);
    }
  }
}
#endif

// The same with PowerSGD among the candidates: matrix layers whose gradients are a shared
// low-rank signal (of a strength that differs per layer) under each rank's own noise, at
// scales over two decades, quantization 2..8 bits and ranks 1, 2, 4, 8 to choose from.
// PowerSGD's residual piles up what its basis misses; before the low-rank probe its
// candidates were measured on the default's state, 0.04-0.16 of what they make once they
// run (probe/lowrank_shadows_give_powersgd_its_own_steady_state_error), and this run
// spent 1.11-1.86 of its budget (seeds 1-6 at 1397e33; its first adaptive epoch 5.1-9.6x).
#if !defined(__SANITIZE_THREAD__)
BOOST_AUTO_TEST_CASE(the_realized_error_stays_within_budget_with_powersgd_candidates) {
  const uint64_t seed = test::run_seed();
  std::vector<CodecSpec> candidates;
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  for (int rank : {1, 2, 4, 8}) candidates.push_back(CodecSpec::parse("powersgd:rank=" + std::to_string(rank)));
  const std::vector<uint64_t> rows = {64, 32, 128, 48, 96, 64, 32, 80},
                              cols = {512, 768, 256, 640, 384, 448, 1024, 320};
  BucketLayout bucket;
  std::vector<double> scale, signal;
  for (size_t l = 0; l < rows.size(); ++l) {
    LayerLayout x{"matrix" + std::to_string(l), bucket.count, rows[l] * cols[l], candidates, 2};
    x.rows = rows[l];
    bucket.layers.push_back(x);
    bucket.count += x.numel;
    scale.push_back(std::pow(10.0, -1.0 + 2.0 * static_cast<double>((l * 3) % rows.size()) / (rows.size() - 1)));
    signal.push_back(0.5 + 3.0 * static_cast<double>((l * 5) % rows.size()) / (rows.size() - 1));
  }
  const auto input = [&](int r, uint64_t step, uint32_t) {
    std::vector<float> x(bucket.count);
    std::normal_distribution<double> normal;
    for (size_t l = 0; l < rows.size(); ++l) {
      std::mt19937_64 fixed(seed * 31 + l), own(seed ^ (uint64_t(r + 1) << 40) ^ (step << 8) ^ l);
      std::vector<double> u(rows[l] * 4), v(cols[l] * 4);
      for (double& e : u) e = normal(fixed);
      for (double& e : v) e = normal(fixed);
      for (uint64_t i = 0; i < rows[l]; ++i)
        for (uint64_t j = 0; j < cols[l]; ++j) {
          double low = 0;
          for (int k = 0; k < 4; ++k)
            low += u[i * 4 + k] * v[j * 4 + k] / (1.0 + k) * (1 + 0.1 * std::sin(0.3 * step + k));
          x[bucket.layers[l].offset + i * cols[l] + j] =
              static_cast<float>(scale[l] * (signal[l] * low / 2 + normal(own)));
        }
    }
    return x;
  };
  const uint64_t period = 10, window = 2;
  const uint64_t first = period + 1, steps = 6 * period;
  test::PinnedRun run;
  run.ranks = 4;
  run.buckets = {bucket};
  run.steps = steps;  // switches at 11, 21, 31, 41, 51
  run.input = input;
  const auto options = [&](int) {
    EngineOptions o;
    o.codec = quant(4);
    o.candidates = candidates;
    o.algorithm = Algorithm::kAllGather;
    o.parameters_text = "budget powersgd";
    o.controller.schedule = {period, period, window, 2};
    return o;
  };
  test::PinnedRun uniform = run;
  uniform.options = [&](int r) {
    EngineOptions o = options(r);
    o.mode = config::Mode::kUniform;
    return o;
  };
  const test::PinnedResult reference = test::run_pinned(uniform);
  BOOST_TEST_REQUIRE(reference.failures.empty(), reference.failures.front());
  run.options = options;
  const test::PinnedResult adaptive = test::run_pinned(run);
  BOOST_TEST_REQUIRE(adaptive.failures.empty(), adaptive.failures.front());
  const auto total = [](const test::PinnedResult& r, uint64_t from, uint64_t to) {
    double e = 0;
    for (uint64_t step = from; step < std::min<uint64_t>(to, r.error.size()); ++step)
      for (double v : r.error[step][0]) e += v;
    return e;
  };
  const double ratio = total(adaptive, first + period, steps) / total(reference, first + period, steps);
  std::string epochs;
  double worst = 0;
  for (uint64_t from = first; from < steps; from += period) {
    const double epoch = total(adaptive, from, from + period) / total(reference, from, from + period);
    epochs += " " + std::to_string(epoch);
    if (from > first) worst = std::max(worst, epoch);
  }
  const uint64_t bytes = adaptive.encoded_bytes[steps - 1] - adaptive.encoded_bytes[first + period - 1];
  const uint64_t uniform_bytes = reference.encoded_bytes[steps - 1] - reference.encoded_bytes[first + period - 1];
  const std::string summary = "compression error over the uniform run's " + std::to_string(ratio) + "; per epoch" +
                              epochs + "; bytes over uniform's " +
                              std::to_string(double(bytes) / double(uniform_bytes));
  BOOST_TEST_CONTEXT("seed " << seed << ": " << summary) {
    BOOST_TEST_MESSAGE("powersgd: " << summary);
    // Over seeds 1-12: the whole run 0.91-1.03 (median 0.96), with 20-step epochs and
    // 4-step windows 0.92-1.05. Before the low-rank probe 1.11-1.86 (seeds 1-6). Seeds
    // 13-36 (2026-12-07): 0.88-1.09, median 0.98; one CI seed, 12844643912526912156,
    // 1.105 (its second epoch 1.53). The bound was 1.10, at the edge of that spread;
    // PowerSGD's switch epochs are issue 19's open item, and 1.15 still fails a probe
    // that misjudges them (before it: 1.11-1.86).
    BOOST_TEST(ratio <= 1.15);
    BOOST_TEST(ratio >= 0.80);
    // A single epoch is not held as tightly (docs/PERF.md, issue 19): a layer switched to a
    // low rank starts a transient that its shadow, running since step 0, has left behind
    // (seed 4: moved from 2 bits to rank 1, its error rose within 8 steps to twice its
    // shadow's level and the epoch realized 2.5x its prediction). The worst later epoch
    // over seeds 1-12: 1.02-1.46 (20-step epochs: 0.97-1.46), each taken back by the loop
    // in the next; seeds 13-36: up to 1.51, the CI seed above 1.53; before the probe,
    // 5.1-9.6 in the first.
    BOOST_TEST(worst <= 1.6);
    BOOST_TEST(bytes * 1.1 < uniform_bytes);
  }
}
#endif

// The controller switches every rank to the same assignment at the same step.
BOOST_AUTO_TEST_CASE(adaptive_switches_are_the_same_on_every_rank) {
  const uint64_t seed = test::run_seed();
  const std::vector<CodecSpec> candidates = quant_bit_candidates();
  const BucketLayout bucket = four_layer_bucket(candidates);
  Job job;
  job.ranks = 4;
  job.buckets = {bucket};
  job.options = [&](int) { return adaptive_options(candidates, "adaptive"); };
  // Layers of very different scales: the search moves bits to where they pay.
  job.input = [&](int r, uint64_t step, uint32_t) {
    std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
    std::vector<float> x = test::draw(test::Dist::kNormal, bucket.count, rng);
    for (size_t i = 0; i < x.size(); ++i) x[i] *= i < 30000 ? 100.0f : i < 80000 ? 0.01f : 1.0f;
    return to_dtype(x, DType::kFloat32);
  };
  job.steps = 12;
  const auto results = run_job(job);
  for (int r = 0; r < 4; ++r) {
    for (size_t c = 0; c < results[r].outcomes.size(); ++c) {
      BOOST_TEST((results[r].outcomes[c].kind == CallOutcome::Kind::kDone), results[r].outcomes[c].message);
      BOOST_TEST((results[r].outputs[c] == results[0].outputs[c]));
    }
    BOOST_TEST(results[r].epoch == results[0].epoch);
    BOOST_TEST(results[r].codecs == results[0].codecs);
  }
  BOOST_TEST(results[0].epoch >= 2u);
  // The default (4 bits everywhere) is not what the solver keeps for such layers.
  BOOST_TEST(results[0].codecs != std::vector<std::string>(4, quant(4).str()));
}

CodecSpec topk(const char* density) { return CodecSpec::parse(std::string("topk:density=") + density); }

// TopK layers are measured on whole layers, as each rank sends them: the measured error of
// the default equals what the output loses (the ranks' errors are independent here, so
// their squares add), under both algorithms and both ops, with quantization candidates
// beside them.
BOOST_AUTO_TEST_CASE(topk_measured_errors_are_the_output_errors) {
  const uint64_t seed = test::run_seed();
  const std::vector<CodecSpec> candidates = {topk("0.01"), topk("0.05"), topk("0.2"), quant(2), quant(4), quant(8)};
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      const int ranks = 4;
      const BucketLayout bucket = candidate_bucket({60000, 90000}, candidates, 1);
      auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
      std::vector<std::vector<std::vector<float>>> outputs(ranks);
      std::vector<std::vector<CallOutcome>> outcomes(ranks);
      std::optional<controller::ErrorStats> stats;
      auto input = [&](int r, uint64_t step) {
        std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
        return test::draw(test::Dist::kNormal, bucket.count, rng);
      };
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
          InProcFabric fabric(hub, r);
          CpuBackend backend;
          EngineOptions o;
          o.codec = topk("0.05");
          o.candidates = candidates;
          o.error_feedback = false;
          o.algorithm = algorithm;
          o.parameters_text = "measure topk";
          o.controller.schedule = {3, 100, 2, 2};  // measures steps 1 and 2, submits at step 3
          Engine engine(o, {bucket}, fabric, backend);
          for (uint64_t step = 0; step < 4; ++step) {
            const std::vector<float> x = input(r, step);
            std::vector<float> y(x.size(), std::nanf(""));
            // Asserted after the join: Boost.Test's assertions are not thread-safe.
            outcomes[r].push_back(engine.allreduce({0, step, x.data(), y.data(), bucket.count, DType::kFloat32, op}));
            outputs[r].push_back(std::move(y));
          }
          if (r == 0) stats = engine.last_window_stats();
        });
      for (auto& t : threads) t.join();
      for (const auto& rank_outcomes : outcomes)
        for (const CallOutcome& outcome : rank_outcomes)
          BOOST_TEST((outcome.kind == CallOutcome::Kind::kDone), outcome.message);
      BOOST_TEST_REQUIRE(stats.has_value());
      for (int r = 1; r < ranks; ++r) BOOST_TEST((outputs[r] == outputs[0]));
      for (size_t l = 0; l < 2; ++l) {
        double realized = 0;
        for (uint64_t step : {1u, 2u}) {
          std::vector<double> exact(bucket.count, 0.0);
          for (int r = 0; r < ranks; ++r) {
            const auto x = input(r, step);
            for (size_t i = 0; i < x.size(); ++i) exact[i] += x[i];
          }
          const LayerLayout& layer = bucket.layers[l];
          for (uint64_t i = layer.offset; i < layer.offset + layer.numel; ++i) {
            const double want = op == ReduceOp::kAvg ? exact[i] / ranks : exact[i];
            realized += (outputs[0][step][i] - want) * (outputs[0][step][i] - want);
          }
        }
        BOOST_TEST(stats->samples(l) == 2u);  // one per step: the probe's rank counts it
        const double samples = static_cast<double>(stats->samples(l));
        const double measured = stats->mean(l, 1) * samples;  // topk 0.05, the default
        BOOST_TEST_CONTEXT(algorithm_name(algorithm) << (op == ReduceOp::kAvg ? " avg" : " sum") << " layer " << l
                                                     << ": measured " << measured << ", realized " << realized) {
          BOOST_TEST(measured > 0.95 * realized);
          BOOST_TEST(measured < 1.05 * realized);
          // Every candidate has a finite measurement, ordered as the family's parameter says.
          for (uint32_t c = 0; c < candidates.size(); ++c) BOOST_TEST(std::isfinite(stats->mean(l, c)));
          BOOST_TEST(stats->mean(l, 0) > stats->mean(l, 1));
          BOOST_TEST(stats->mean(l, 1) > stats->mean(l, 2));
          BOOST_TEST(stats->mean(l, 3) > stats->mean(l, 4));
          BOOST_TEST(stats->mean(l, 4) > stats->mean(l, 5));
        }
      }
    }
}

// With candidates of two families, each layer gets the family that suits it: a sparse
// layer TopK, a dense one quantization; every rank switches alike, in one call whose
// layers travel by different exchanges.
BOOST_AUTO_TEST_CASE(adaptive_choice_across_families_is_the_same_on_every_rank) {
  const uint64_t seed = test::run_seed();
  std::vector<CodecSpec> candidates = {topk("0.001"), topk("0.005"), topk("0.01"), topk("0.05")};
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  BucketLayout bucket;
  const std::vector<uint64_t> sizes = {40000, 50000, 30000};
  for (size_t l = 0; l < sizes.size(); ++l) {
    bucket.layers.push_back({"layer" + std::to_string(l), bucket.count, sizes[l], candidates, 6});  // quant 4
    bucket.count += sizes[l];
  }
  for (int ranks : {2, 4}) {
    BOOST_TEST_CONTEXT("seed " << seed << ", " << ranks << " ranks") {
      Job job;
      job.ranks = ranks;
      job.buckets = {bucket};
      job.options = [&](int) { return adaptive_options(candidates, "families"); };
      // Layer 0 is sparse: 200 nonzero values (TopK at 0.5% keeps them all, exactly, for
      // 1600 bytes, where 4-bit quantization spends 20 KB and still errs on the zeros);
      // layers 1 and 2 are dense, where TopK would lose most of the energy and
      // quantization is the affordable choice. All of the same scale, so that no layer's
      // error dwarfs the budget.
      job.input = [&](int r, uint64_t step, uint32_t) {
        std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
        std::vector<float> x = test::draw(test::Dist::kNormal, bucket.count, rng);
        for (size_t i = 0; i < 40000; ++i)
          if (i % 200 != 0) x[i] = 0.0f;
        return to_dtype(x, DType::kFloat32);
      };
      job.steps = 12;
      job.snapshot_residuals = true;
      const auto results = run_job(job);
      for (int r = 0; r < ranks; ++r) {
        for (size_t c = 0; c < results[r].outcomes.size(); ++c) {
          BOOST_TEST((results[r].outcomes[c].kind == CallOutcome::Kind::kDone), results[r].outcomes[c].message);
          BOOST_TEST((results[r].outputs[c] == results[0].outputs[c]), "call " << c << " rank " << r);
        }
        BOOST_TEST(results[r].epoch == results[0].epoch);
        BOOST_TEST(results[r].codecs == results[0].codecs);
      }
      BOOST_TEST(results[0].epoch >= 2u);
      BOOST_TEST_REQUIRE(results[0].codecs.size() == 3u);
      BOOST_TEST(results[0].codecs[0].rfind("topk:", 0) == 0u, results[0].codecs[0]);
      BOOST_TEST(results[0].codecs[1].rfind("quant:", 0) == 0u, results[0].codecs[1]);
      BOOST_TEST(results[0].codecs[2].rfind("quant:", 0) == 0u, results[0].codecs[2]);
      // Against the uniform default (4 bits everywhere) on the same inputs: fewer bytes, and
      // an output error of the same size (the budget is the default's error; the realized
      // error of one step is a sample of it).
      Job uniform = job;
      uniform.options = [&](int r) {
        EngineOptions o = job.options(r);
        o.mode = config::Mode::kUniform;
        return o;
      };
      const auto baseline = run_job(uniform);
      auto output_error = [&](const std::vector<RankResult>& res, uint64_t step) {
        std::vector<double> exact(bucket.count, 0.0);
        for (int r = 0; r < ranks; ++r) {
          const auto x = to_double(job.input(r, step, 0), DType::kFloat32);
          for (size_t i = 0; i < x.size(); ++i) exact[i] += x[i];
        }
        const auto out = to_double(res[0].outputs[step], DType::kFloat32);
        double err = 0;
        for (size_t i = 0; i < exact.size(); ++i) err += (out[i] - exact[i]) * (out[i] - exact[i]);
        return err;
      };
      double adaptive_error = 0, uniform_error = 0;
      for (uint64_t step = 8; step < job.steps; ++step)  // after the switch
        adaptive_error += output_error(results, step), uniform_error += output_error(baseline, step);
      BOOST_TEST(adaptive_error < 1.5 * uniform_error, adaptive_error << " against " << uniform_error);
      BOOST_TEST(results[0].counters.encoded_bytes < baseline[0].counters.encoded_bytes);
    }
  }
}

// PowerSGD layers beside quantized and TopK ones, against a reference written here from
// the algorithm (kernels/lowrank.h's steps, sums in rank order as the fabric makes them):
// the same bits on every rank, step after step, with the warm start carried over.
BucketLayout matrix_layout(const std::vector<std::pair<uint64_t, uint64_t>>& shapes, const std::vector<CodecSpec>& codecs,
                           DType dtype) {
  std::vector<uint64_t> sizes;
  for (const auto& [rows, cols] : shapes) sizes.push_back(rows * cols);
  BucketLayout b = fixed_layout(sizes, codecs, dtype);
  for (size_t l = 0; l < shapes.size(); ++l) b.layers[l].rows = shapes[l].first;
  return b;
}

BOOST_AUTO_TEST_CASE(powersgd_layers_match_the_reference_step_after_step) {
  const uint64_t seed = test::run_seed();
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      const int ranks = 3;
      const BucketLayout bucket = matrix_layout({{64, 40}, {50, 30}, {30, 70}, {48, 48}},
                                                {CodecSpec::parse("powersgd:rank=3"), quant(4), topk("0.05"),
                                                 CodecSpec::parse("powersgd:rank=1")},
                                                DType::kFloat32);
      Job job;
      job.ranks = ranks;
      job.buckets = {bucket};
      job.options = [&](int) { return fixed_options(algorithm, false); };
      job.input = random_inputs(job.buckets, seed);
      job.steps = 3;
      job.op = op;
      job.in_place = op == ReduceOp::kAvg;
      const auto results = run_job(job);
      BOOST_TEST_CONTEXT("seed " << seed << ", " << algorithm_name(algorithm) << (op == ReduceOp::kAvg ? " avg" : " sum")) {
        // The reference of the low-rank layers: warm Q per layer, from Q0 of the engine's seed.
        struct State {
          uint64_t offset, rows, cols;
          uint32_t rank, layer;
          std::vector<float> q, q0;
        };
        std::vector<State> states;
        for (uint32_t l : {0u, 3u}) {
          const LayerLayout& layer = bucket.layers[l];
          State st{layer.offset, layer.rows, layer.numel / layer.rows, bucket.layers[l].candidates[0].powersgd_params().rank,
                   l, {}, {}};
          st.q0.resize(st.cols * st.rank);
          lowrank::initial_q(NoiseKey{EngineOptions{}.seed, 0, 0, l}, st.cols, st.rank, st.q0.data());
          st.q = st.q0;
          states.push_back(std::move(st));
        }
        for (uint64_t step = 0; step < job.steps; ++step) {
          std::vector<std::vector<float>> x(ranks);
          for (int r = 0; r < ranks; ++r) {
            const Bytes in = job.input(r, step, 0);
            x[r].resize(bucket.count);
            memcpy(x[r].data(), in.data(), in.size());
          }
          for (int r = 0; r < ranks; ++r) {
            BOOST_TEST_REQUIRE((results[r].outcomes[step].kind == CallOutcome::Kind::kDone), results[r].outcomes[step].message);
            BOOST_TEST((results[r].outputs[step] == results[0].outputs[step]), "step " << step << " rank " << r);
          }
          std::vector<float> out(bucket.count);
          memcpy(out.data(), results[0].outputs[step].data(), bucket.count * 4);
          for (State& st : states) {
            const lowrank::Shape shape{st.rows, st.cols};
            std::vector<float> p(st.rows * st.rank, 0.0f), q(st.cols * st.rank, 0.0f), part_p(p.size()), part_q(q.size());
            for (int r = 0; r < ranks; ++r) {
              lowrank::project(x[r].data() + st.offset, shape, st.q.data(), st.rank, part_p.data());
              for (size_t k = 0; k < p.size(); ++k) p[k] += part_p[k];
            }
            lowrank::orthonormalize(p.data(), st.rows, st.rank);
            for (int r = 0; r < ranks; ++r) {
              lowrank::back_project(x[r].data() + st.offset, shape, p.data(), st.rank, part_q.data());
              for (size_t k = 0; k < q.size(); ++k) q[k] += part_q[k];
            }
            std::vector<float> want(st.rows * st.cols);
            lowrank::reconstruct(p.data(), q.data(), shape, st.rank, op == ReduceOp::kAvg ? 1.0f / ranks : 1.0f, want.data());
            for (size_t i = 0; i < want.size(); ++i)
              BOOST_TEST(float_bits(out[st.offset + i]) == float_bits(want[i]), "step " << step << " layer " << st.layer << " element " << i);
            st.q = q;  // every column nonzero and finite here: kept as the warm start
          }
          // The other layers are what the reference of the fixed codecs says.
          std::vector<Bytes> inputs;
          for (int r = 0; r < ranks; ++r) inputs.push_back(job.input(r, step, 0));
          const Bytes expected = reference(bucket, inputs, algorithm, step, op, EngineOptions{}.seed);
          for (uint32_t l : {1u, 2u}) {
            const LayerLayout& layer = bucket.layers[l];
            BOOST_TEST(std::equal(expected.begin() + layer.offset * 4, expected.begin() + (layer.offset + layer.numel) * 4,
                                  results[0].outputs[step].begin() + layer.offset * 4),
                       "step " << step << " layer " << l);
          }
        }
      }
    }
}

// Error feedback with the warm start: a fixed gradient's sum over steps reaches the
// output's sum up to the ranks' residuals, which stay bounded: the distance does not grow
// from the first half of the run to the second.
BOOST_AUTO_TEST_CASE(powersgd_error_feedback_keeps_the_accumulated_error_bounded) {
  const uint64_t seed = test::run_seed();
  const BucketLayout bucket = matrix_layout({{30, 40}}, {CodecSpec::parse("powersgd:rank=2")}, DType::kFloat32);
  Job job;
  job.ranks = 2;
  job.buckets = {bucket};
  job.options = [&](int) { return fixed_options(Algorithm::kAuto, true); };
  const auto fixed = random_inputs(job.buckets, seed);
  job.input = [&](int r, uint64_t, uint32_t b) { return fixed(r, 0, b); };  // the same every step
  job.steps = 240;
  const auto results = run_job(job);
  std::vector<double> exact(bucket.count, 0.0), sent(bucket.count, 0.0);
  for (int r = 0; r < 2; ++r) {
    const auto x = to_double(job.input(r, 0, 0), DType::kFloat32);
    for (size_t i = 0; i < x.size(); ++i) exact[i] += x[i];
  }
  double worst_early = 0, worst_late = 0, norm = 0;
  for (double v : exact) norm += v * v;
  for (uint64_t step = 0; step < job.steps; ++step) {
    BOOST_TEST_REQUIRE((results[0].outcomes[step].kind == CallOutcome::Kind::kDone), results[0].outcomes[step].message);
    const auto out = to_double(results[0].outputs[step], DType::kFloat32);
    double err = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      sent[i] += out[i];
      const double d = sent[i] - (step + 1) * exact[i];
      err += d * d;
    }
    if (step >= 60) (step < 150 ? worst_early : worst_late) = std::max(step < 150 ? worst_early : worst_late, std::sqrt(err));
  }
  BOOST_TEST(worst_late <= 1.25 * worst_early, worst_late << " after " << worst_early);
  // And the mean output is the gradient: the distance is a few gradients, not 240.
  BOOST_TEST(worst_late < 30 * std::sqrt(norm), worst_late << " against one gradient's " << std::sqrt(norm));
}

// With all three families as candidates, each layer gets one that suits it: a layer of
// low rank PowerSGD, a dense full-rank one quantization, a sparse one a sparse codec.
BOOST_AUTO_TEST_CASE(adaptive_choice_among_three_families) {
  const uint64_t seed = test::run_seed();
  // No two candidates of different families cost the same bytes on these layers (TopK at
  // 0.5% of 40000 values would cost what rank 1 of 200 x 200 does, and a tie may go
  // either way).
  std::vector<CodecSpec> candidates = {topk("0.01"), topk("0.05")};
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  for (int rank : {1, 2, 4}) candidates.push_back(CodecSpec::parse("powersgd:rank=" + std::to_string(rank)));
  BucketLayout bucket = matrix_layout({{200, 200}, {200, 200}, {200, 200}}, {quant(4), quant(4), quant(4)},
                                      DType::kFloat32);
  for (LayerLayout& l : bucket.layers) {
    l.candidates = candidates;
    l.default_index = 4;  // quant 4 bits (after the two TopK densities and 2, 3 bits)
  }
  const int ranks = 4;
  Job job;
  job.ranks = ranks;
  job.buckets = {bucket};
  job.options = [&](int) {
    EngineOptions o = adaptive_options(candidates, "three families");
    // Without error feedback the sparse layer stays sparse: with it, the default's
    // quantization residual spreads over every element, and which family wins that layer
    // depends on the draw.
    o.error_feedback = false;
    return o;
  };
  // Layer 0: rank 1 (a shared outer product, scaled per rank) plus faint noise; layer 1:
  // 200 nonzeros; layer 2: dense noise. All of one scale.
  std::mt19937_64 shape_rng(seed);
  const std::vector<float> u = test::draw(test::Dist::kNormal, 200, shape_rng), v = test::draw(test::Dist::kNormal, 200, shape_rng);
  job.input = [&](int r, uint64_t step, uint32_t) {
    std::mt19937_64 rng(seed ^ (uint64_t(r) << 40) ^ step);
    std::vector<float> x = test::draw(test::Dist::kNormal, bucket.count, rng);
    const float scale = 1.0f + 0.1f * static_cast<float>(rng() % 10);
    for (size_t i = 0; i < 40000; ++i) x[i] = scale * u[i / 200] * v[i % 200] + 1e-3f * x[i];
    for (size_t i = 40000; i < 80000; ++i)
      if (i % 200 != 0) x[i] = 0.0f;
    return to_dtype(x, DType::kFloat32);
  };
  job.steps = 12;
  const auto results = run_job(job);
  for (int r = 0; r < ranks; ++r) {
    for (size_t c = 0; c < results[r].outcomes.size(); ++c) {
      BOOST_TEST((results[r].outcomes[c].kind == CallOutcome::Kind::kDone), results[r].outcomes[c].message);
      BOOST_TEST((results[r].outputs[c] == results[0].outputs[c]), "call " << c << " rank " << r);
    }
    BOOST_TEST(results[r].codecs == results[0].codecs);
  }
  BOOST_TEST(results[0].epoch >= 2u);
  BOOST_TEST_REQUIRE(results[0].codecs.size() == 3u);
  // The low-rank layer: rank 1 is both the fewest bytes and almost no error. The dense
  // layer: only quantization keeps its error within the budget. The sparse layer: TopK at
  // 1% sends it exactly for 3200 bytes, but the budget has room (the default's error on
  // the other layers is freed), so the solver may also take rank 1's 1600 bytes there;
  // never quantization, which costs more than either.
  BOOST_TEST(results[0].codecs[0].rfind("powersgd:", 0) == 0u, results[0].codecs[0]);
  BOOST_TEST(results[0].codecs[1].rfind("quant:", 0) != 0u, results[0].codecs[1]);
  BOOST_TEST(results[0].codecs[2].rfind("quant:", 0) == 0u, results[0].codecs[2]);
}

// A backend without a family's kernels: every rank passes through, with one WARN saying
// which layer and codec, instead of failing in the middle of a call.
BOOST_AUTO_TEST_CASE(a_family_the_backend_lacks_passes_through_on_every_rank) {
  const BucketLayout bucket = fixed_layout({5000, 7000}, {quant(4), topk("0.01")}, DType::kFloat32);
  const int ranks = 3;
  auto hub = std::make_shared<InProcHub>(ranks, 10000ms);
  std::vector<CallOutcome> outcomes(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      FailingBackend backend(~uint64_t{0});
      backend.lacks_topk = r == 1;  // one rank alone is enough
      Engine engine(fixed_options(Algorithm::kAuto, true), {bucket}, fabric, backend);
      std::vector<float> x(bucket.count, 1.0f), y(bucket.count);
      outcomes[r] = engine.allreduce({0, 0, x.data(), y.data(), bucket.count, DType::kFloat32, ReduceOp::kSum});
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    BOOST_TEST((outcomes[r].kind == CallOutcome::Kind::kPassThrough), outcomes[r].message);
    BOOST_TEST(test::contains(outcomes[r].message, "a local failure"), outcomes[r].message);
  }
}

// A GPU backend must not allocate in the middle of a call (one rank's failure there breaks
// every rank's call): the engine prepares it, where all ranks still agree, for every plan
// it will encode or measure and every low-rank layer. This backend checks that each
// operation finds its plan or layers prepared as they are, and can fail a preparation.
class StrictBackend final : public ForwardingBackend {
 public:
  struct Seen {
    std::vector<std::string> problems;
    int topk_encodes = 0, lowrank_projects = 0, lowrank_measures = 0;
  };
  explicit StrictBackend(Seen& seen) : seen_(seen), problems_(seen.problems) {}
  bool fail_prepare_lowrank = false;
  std::string name() const override { return "strict"; }

  void prepare_measure(const Plan& plan, std::span<const CodecSpec> candidates) override {
    measure_plans_.push_back(seen_as(plan));
    prepared_candidates_.assign(candidates.begin(), candidates.end());
  }
  void prepare_encode(const Plan& plan) override { encode_plans_.push_back(seen_as(plan)); }
  void prepare_lowrank(std::span<const LowRankLayer> layers, std::span<const LowRankLayer> measured,
                       uint32_t max_measured_rank, DType dtype, bool residual) override {
    if (fail_prepare_lowrank) throw std::runtime_error("lgreco: PowerSGD needs cuBLAS: libcublas.so.13: not found");
    // Preparations add up, as a GPU's grow-only scratch does: the error probe prepares its
    // shadows' layers, the exchange its own.
    lowrank_.insert(lowrank_.end(), layers.begin(), layers.end());
    if (!measured.empty()) measured_.assign(measured.begin(), measured.end());
    if (max_measured_rank) max_measured_rank_ = max_measured_rank;
    kinds_.emplace_back(dtype, residual);
  }

  void encode(const Plan& p, std::span<const Segment> g, ElementSpan in, float* r, uint64_t rf, const uint8_t* f,
              const NoiseBase& nb, uint8_t* out, uint64_t base) override {
    const bool topk = std::any_of(g.begin(), g.end(), [&](const Segment& s) {
      return s.count && p.codecs[s.codec].family() == CodecFamily::kTopk;
    });
    if (topk && !prepared(encode_plans_, p)) problems_.push_back("encode of TopK segments of a plan not prepared");
    seen_.topk_encodes += topk;
    ForwardingBackend::encode(p, g, in, r, rf, f, nb, out, base);
  }
  void measure(const Plan& p, std::span<const Segment> g, ElementSpan in, const float* r, uint64_t rf,
               const Measure& m) override {
    if (!prepared(measure_plans_, p)) problems_.push_back("measure on a plan not prepared");
    if (!std::equal(m.candidates.begin(), m.candidates.end(), prepared_candidates_.begin(),
                    prepared_candidates_.end()))
      problems_.push_back("measure of candidates not prepared");
    ForwardingBackend::measure(p, g, in, r, rf, m);
  }
  void lowrank_project(std::span<const LowRankLayer> l, ElementSpan in, const float* r, const uint8_t* f,
                       const float* q, float* p) override {
    for (const LowRankLayer& x : l)
      if (!has_layer(lowrank_, x, true)) problems_.push_back("a low-rank layer not prepared");
    if (std::find(kinds_.begin(), kinds_.end(), std::pair{in.dtype, r != nullptr}) == kinds_.end())
      problems_.push_back("low rank: another dtype or residual");
    ++seen_.lowrank_projects;
    ForwardingBackend::lowrank_project(l, in, r, f, q, p);
  }
  void measure_lowrank(std::span<const LowRankLayer> l, ElementSpan in, const float* r, const NoiseBase& key,
                       const Measure& m) override {
    for (const LowRankLayer& x : l)
      if (m.measured[x.layer] && !has_layer(measured_, x, false)) problems_.push_back("a measured layer not prepared");
    for (size_t k = 0; k < m.candidates.size(); ++k)
      if (m.candidates[k].family() == CodecFamily::kPowersgd && m.candidates[k].powersgd_params().rank > max_measured_rank_)
        problems_.push_back("a rank above the prepared one measured");
    ++seen_.lowrank_measures;
    ForwardingBackend::measure_lowrank(l, in, r, key, m);
  }

 private:
  // A plan by its content (the engine prepares a staged copy, then moves it into effect).
  using PlanSeen = std::string;
  static PlanSeen seen_as(const Plan& p) {
    std::string text = std::to_string(p.total_bytes) + ":";
    for (const Segment& s : p.segments)
      text += std::to_string(s.offset) + "+" + std::to_string(s.count) + "@" + p.codecs[s.codec].str() + ",";
    return text;
  }
  static bool prepared(const std::vector<PlanSeen>& seen, const Plan& p) {
    return std::find(seen.begin(), seen.end(), seen_as(p)) != seen.end();
  }
  static bool has_layer(const std::vector<LowRankLayer>& list, const LowRankLayer& x, bool same_rank) {
    return std::any_of(list.begin(), list.end(), [&](const LowRankLayer& y) {
      return y.layer == x.layer && y.rows == x.rows && y.cols == x.cols && (!same_rank || y.rank == x.rank);
    });
  }
  Seen& seen_;
  std::vector<std::string>& problems_;
  std::vector<PlanSeen> measure_plans_, encode_plans_;
  std::vector<CodecSpec> prepared_candidates_;
  std::vector<LowRankLayer> lowrank_, measured_;
  uint32_t max_measured_rank_ = 0;
  std::vector<std::pair<DType, bool>> kinds_;  // (input dtype, residual) prepared
};

Job three_family_job(int ranks, Algorithm algorithm, uint64_t seed) {
  std::vector<CodecSpec> candidates = {topk("0.01"), topk("0.05")};
  for (int bits = 2; bits <= 8; ++bits) candidates.push_back(quant(bits));
  for (int rank : {1, 2, 4}) candidates.push_back(CodecSpec::parse("powersgd:rank=" + std::to_string(rank)));
  BucketLayout bucket =
      matrix_layout({{64, 48}, {100, 30}, {1, 5000}}, {quant(4), quant(4), quant(4)}, DType::kFloat32);
  for (LayerLayout& l : bucket.layers) {
    l.candidates = candidates;
    l.default_index = 4;
  }
  bucket.layers[0].default_index = 10;  // powersgd:rank=2 until the first solve
  bucket.layers[1].default_index = 0;   // topk 1%
  bucket.layers[2].rows = 0;            // a vector: no low rank there
  bucket.layers[2].candidates.resize(9);
  Job job;
  job.ranks = ranks;
  job.buckets = {bucket};
  job.options = [=](int) {
    EngineOptions o = adaptive_options(candidates, "three families");
    o.algorithm = algorithm;
    return o;
  };
  job.input = random_inputs(job.buckets, seed);
  job.steps = 12;
  return job;
}

BOOST_AUTO_TEST_CASE(the_backend_is_prepared_for_every_plan_and_low_rank_layer) {
  const uint64_t seed = test::run_seed();
  for (Algorithm algorithm : {Algorithm::kScatterReduceAllGather, Algorithm::kAllGather}) {
    BOOST_TEST_CONTEXT("algorithm " << static_cast<int>(algorithm) << " seed " << seed) {
      Job job = three_family_job(3, algorithm, seed);
      std::vector<StrictBackend::Seen> seen(job.ranks);
      job.backend = [&](int r) { return std::make_unique<StrictBackend>(seen[r]); };
      const auto results = run_job(job);
      for (int r = 0; r < job.ranks; ++r) {
        for (const CallOutcome& o : results[r].outcomes)
          BOOST_TEST((o.kind == CallOutcome::Kind::kDone), o.message);
        const std::vector<std::string>& problems = seen[r].problems;
        BOOST_TEST(problems.empty(), "rank " << r << ": " << (problems.empty() ? "" : problems.front()));
        BOOST_TEST(seen[r].topk_encodes > 0);
        BOOST_TEST(seen[r].lowrank_projects > 0);
        BOOST_TEST(seen[r].lowrank_measures > 0);
        BOOST_TEST(results[r].outputs == results[0].outputs);
      }
      BOOST_TEST(results[0].epoch >= 2u);
    }
  }
}

// A backend that cannot prepare on one rank (a GPU without cuBLAS, say): every rank passes
// through at the first call, before anything is sent, instead of failing in the middle.
BOOST_AUTO_TEST_CASE(a_backend_that_cannot_prepare_passes_through_on_every_rank) {
  Job job = three_family_job(3, Algorithm::kAuto, test::run_seed());
  job.steps = 2;
  std::vector<StrictBackend::Seen> seen(job.ranks);
  job.backend = [&](int r) {
    auto b = std::make_unique<StrictBackend>(seen[r]);
    b->fail_prepare_lowrank = r == 2;
    return b;
  };
  const auto results = run_job(job);
  for (int r = 0; r < job.ranks; ++r)
    for (const CallOutcome& o : results[r].outcomes) {
      BOOST_TEST((o.kind == CallOutcome::Kind::kPassThrough), o.message);
      BOOST_TEST(test::contains(o.message, "a local failure (that rank's WARN says which) on rank(s) 2"), o.message);
    }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco::collective
