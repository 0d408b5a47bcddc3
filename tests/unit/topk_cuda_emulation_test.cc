// The TopK CUDA kernels (kernels/topk_kernels.cuh), run on the CPU by a thread-block
// emulator (block_emulator.h), against the CPU reference (kernels/topk.h): payloads,
// residuals, decoded outputs and the non-finite counter byte for byte, the error
// statistics within summation-order rounding. The kernels and their launch order are the
// GPU's; the emulator cannot check the hardware itself (speed, memory ordering, the
// intrinsics' exact behaviour), which tests/gpu/topk_cuda_check.cc does on a GPU.
//
// Inputs are drawn fresh each run (seed printed on failure, LGRECO_TEST_SEED replays);
// every output buffer and the scratch are poisoned before each call.
#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/topk.h"
#include "kernels/topk_cuda.h"
#include "kernels/topk_cuda_plan.h"
#include "test_util.h"
// The emulator defines the CUDA vocabulary: after every other header.
#include "block_emulator.h"
#include "kernels/topk_kernels.cuh"

using namespace lgreco;
namespace tc = lgreco::topk::cuda;
namespace tk = lgreco::topk::cuda::emulated_kernels;

namespace {

// Launches on the emulator. `max_blocks` stands for the GPU's 4 x SMs: small, so that
// blocks walk several tiles and several jobs, as on the GPU with large inputs.
class EmulatedLauncher {
 public:
  explicit EmulatedLauncher(uint32_t max_blocks) : max_blocks_(max_blocks) {}
  uint32_t full_grid(uint32_t tiles) const { return std::max<uint32_t>(1, std::min(tiles, max_blocks_)); }
  void zero(void* p, uint64_t bytes) const { memset(p, 0, bytes); }
  template <class... P>
  void launch(void (*kernel)(P...), uint32_t grid, const char*, const P&... params) {
    emulator_.launch(kernel, grid, tk::kThreads, params...);
  }

 private:
  uint32_t max_blocks_;
  test::BlockEmulator emulator_;
};

// Memory the kernels address: 256-byte aligned, as cudaMalloc's.
class Buffer {
 public:
  explicit Buffer(uint64_t bytes, uint8_t fill = 0xA5)
      : size_(bytes), data_(static_cast<uint8_t*>(std::aligned_alloc(256, std::max<uint64_t>(256, (bytes + 255) / 256 * 256)))) {
    memset(data_.get(), fill, std::max<uint64_t>(256, (bytes + 255) / 256 * 256));
  }
  uint8_t* get() const { return data_.get(); }
  uint64_t size() const { return size_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  uint64_t size_;
  std::unique_ptr<uint8_t, Free> data_;
};

TopkParams density(uint32_t ppb) { return TopkParams{ppb}; }

// kCluster: magnitudes within a few thousand ulps of each other, so that the last digit
// of the select (the low 9 key bits) decides.
enum class Dist { kNormal, kHeavy, kTies, kZeros, kSparse, kTiny, kScales, kConstant, kCluster };
constexpr Dist kDists[] = {Dist::kNormal, Dist::kHeavy,  Dist::kTies,     Dist::kZeros,  Dist::kSparse,
                           Dist::kTiny,   Dist::kScales, Dist::kConstant, Dist::kCluster};
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavy: return "heavy-tailed";
    case Dist::kTies: return "ties";
    case Dist::kZeros: return "zeros";
    case Dist::kSparse: return "sparse";
    case Dist::kTiny: return "subnormal";
    case Dist::kScales: return "mixed scales";
    case Dist::kConstant: return "constant";
    case Dist::kCluster: return "cluster";
  }
  return "?";
}

float draw_value(Dist d, std::mt19937_64& rng, double scale) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::student_t_distribution<double> student(1.5);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  switch (d) {
    case Dist::kNormal: return static_cast<float>(scale * normal(rng));
    case Dist::kHeavy: return static_cast<float>(scale * student(rng));
    case Dist::kTies: {
      static constexpr float kLevels[] = {0.0f, 0.25f, 0.5f, 1.0f, -0.5f, -1.0f, -0.0f};
      return kLevels[rng() % 7];
    }
    case Dist::kZeros: return rng() % 2 ? 0.0f : -0.0f;
    case Dist::kSparse: return uniform(rng) < 0.9 ? 0.0f : static_cast<float>(scale * normal(rng));
    case Dist::kTiny: return static_cast<float>(1e-40 * normal(rng));
    case Dist::kScales: return static_cast<float>(std::pow(10.0, -20.0 + 40.0 * uniform(rng)) * normal(rng));
    case Dist::kConstant: return static_cast<float>(scale);
    case Dist::kCluster: {
      const float v = bits_float(float_bits(static_cast<float>(scale)) + static_cast<uint32_t>(rng() % 3000));
      return rng() % 2 ? v : -v;
    }
  }
  return 0.0f;
}

// Non-finite float32 bits, written into the input or the residual.
constexpr uint32_t kSpecials[] = {0x7fc00000u, 0xffc12345u, 0x7f800001u, 0x7f800000u, 0xff800000u};

// One batch: the element arrays, the jobs, and the expected results.
struct Case {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<tc::Job> jobs;
  uint64_t elements = 0;
  uint64_t payload_bytes = 0;
  std::vector<uint8_t> input;   // elements x dtype
  std::vector<float> residual;  // empty: no error feedback
  std::vector<uint8_t> skip;    // per layer, empty: none
  uint32_t layers = 1;
};

struct JobSpec {
  uint64_t count;
  uint32_t ppb;
  Dist dist;
  bool specials = false;
};

Case make_case(std::string name, DType dtype, const std::vector<JobSpec>& specs, bool residual, bool skips,
               std::mt19937_64& rng) {
  Case c;
  c.name = std::move(name);
  c.dtype = dtype;
  uint64_t e = rng() % 5, b = 4 * (rng() % 3);
  for (size_t i = 0; i < specs.size(); ++i) {
    tc::Job job;
    job.element_offset = e;
    job.count = specs[i].count;
    job.byte_offset = b;
    job.layer = static_cast<uint32_t>(i % 5);
    job.params = density(specs[i].ppb);
    c.jobs.push_back(job);
    e += job.count + (rng() % 2 ? rng() % 7 : 0);
    b += topk::encoded_bytes(job.params, job.count) + 4 * (rng() % 2);
    c.layers = std::max(c.layers, job.layer + 1);
  }
  c.elements = e + 3;
  c.payload_bytes = b + 8;
  std::normal_distribution<double> normal(0.0, 1.0);
  c.input.assign(c.elements * dtype_size(dtype), 0);
  for (uint64_t i = 0; i < c.elements; ++i) store_from_float(c.input.data(), dtype, i, static_cast<float>(normal(rng)));
  if (residual) {
    c.residual.resize(c.elements);
    for (float& r : c.residual) r = static_cast<float>(0.1 * normal(rng));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const tc::Job& job = c.jobs[i];
    const double scale = std::pow(10.0, -3.0 + 4.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    for (uint64_t k = 0; k < job.count; ++k) {
      const uint64_t at = job.element_offset + k;
      store_from_float(c.input.data(), dtype, at, draw_value(specs[i].dist, rng, scale));
      if (residual) {
        // Residuals that keep ties tied (zeros) for the tie cases, small noise otherwise.
        const bool keep_ties = specs[i].dist == Dist::kTies || specs[i].dist == Dist::kZeros ||
                               specs[i].dist == Dist::kConstant || specs[i].dist == Dist::kSparse ||
                               specs[i].dist == Dist::kCluster;
        c.residual[at] = keep_ties ? 0.0f : static_cast<float>(0.01 * scale * normal(rng));
      }
    }
    if (specs[i].specials && job.count > 0) {
      const uint64_t n = 1 + rng() % 4;
      for (uint64_t s = 0; s < n; ++s) {
        const uint64_t at = job.element_offset + rng() % job.count;
        const uint32_t bits = kSpecials[rng() % std::size(kSpecials)];
        if (residual && rng() % 3 == 0) {
          memcpy(&c.residual[at], &bits, 4);
        } else if (residual && dtype == DType::kFloat32 && rng() % 3 == 0) {
          store_from_float(c.input.data(), dtype, at, 3.0e38f);  // finite + finite = inf
          c.residual[at] = 3.0e38f;
        } else {
          store_from_float(c.input.data(), dtype, at, bits_float(bits));
        }
      }
    }
  }
  if (skips) {
    c.skip.resize(c.layers);
    for (uint8_t& s : c.skip) s = rng() % 2;
  }
  return c;
}

struct Encoded {
  std::vector<uint8_t> payload;
  std::vector<float> residual;
  unsigned long long nonfinite = 0;
};

constexpr unsigned long long kCounterStart = 1000003;

Encoded cpu_encode(const Case& c) {
  Encoded out;
  out.payload.assign(c.payload_bytes, 0xA5);
  out.residual = c.residual;
  out.nonfinite = kCounterStart;
  const size_t width = dtype_size(c.dtype);
  for (const tc::Job& job : c.jobs) {
    const bool skip = !c.skip.empty() && c.skip[job.layer] != 0;
    float* r = out.residual.empty() || skip ? nullptr : out.residual.data() + job.element_offset;
    const EncodeReport rep = topk::encode(job.params, c.dtype, Slice{c.input.data() + job.element_offset * width, job.count, 0}, r,
                                          std::span<uint8_t>(out.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)));
    out.nonfinite += rep.nonfinite_buckets;
  }
  return out;
}

Encoded emulated_encode(const Case& c, EmulatedLauncher& l) {
  Buffer input(c.input.size()), residual(c.residual.size() * 4), payload(c.payload_bytes), skip(c.skip.size()),
      counter(8), scratch(tc::encode_scratch_bytes(c.jobs));
  memcpy(input.get(), c.input.data(), c.input.size());
  if (!c.residual.empty()) memcpy(residual.get(), c.residual.data(), c.residual.size() * 4);
  if (!c.skip.empty()) memcpy(skip.get(), c.skip.data(), c.skip.size());
  memcpy(counter.get(), &kCounterStart, 8);
  tc::EncodeBatch b;
  b.jobs = c.jobs;
  b.input = input.get();
  b.input_dtype = c.dtype;
  b.residual = c.residual.empty() ? nullptr : reinterpret_cast<float*>(residual.get());
  b.skip_residual = c.skip.empty() ? nullptr : skip.get();
  b.payload = payload.get();
  b.nonfinite_values = reinterpret_cast<unsigned long long*>(counter.get());
  b.scratch = scratch.get();
  b.scratch_bytes = scratch.size();
  tk::run_encode(l, b);
  Encoded out;
  out.payload.assign(payload.get(), payload.get() + c.payload_bytes);
  out.residual.resize(c.residual.size());
  if (!c.residual.empty()) memcpy(out.residual.data(), residual.get(), c.residual.size() * 4);
  memcpy(&out.nonfinite, counter.get(), 8);
  return out;
}

// Where two byte buffers first differ ("" when equal), in `width`-byte elements.
std::string first_difference(const uint8_t* a, const uint8_t* b, uint64_t bytes, uint32_t width) {
  uint64_t count = 0, first = 0;
  for (uint64_t i = 0; i < bytes / width; ++i)
    if (memcmp(a + i * width, b + i * width, width) != 0 && count++ == 0) first = i;
  if (count == 0) return "";
  uint32_t x = 0, y = 0;
  memcpy(&x, a + first * width, width);
  memcpy(&y, b + first * width, width);
  char text[64];
  snprintf(text, sizeof text, ": emulated 0x%08x, CPU 0x%08x", x, y);
  return std::to_string(count) + " elements differ, the first at " + std::to_string(first) + text;
}

void check_encode(const Case& c, EmulatedLauncher& l) {
  const Encoded want = cpu_encode(c);
  const Encoded got = emulated_encode(c, l);
  BOOST_TEST(first_difference(got.payload.data(), want.payload.data(), c.payload_bytes, 4) == "", "payload");
  BOOST_TEST(first_difference(reinterpret_cast<const uint8_t*>(got.residual.data()),
                              reinterpret_cast<const uint8_t*>(want.residual.data()), want.residual.size() * 4, 4) == "",
             "residual");
  BOOST_TEST(got.nonfinite == want.nonfinite);
}

void check_decode(const Case& c, EmulatedLauncher& l, std::mt19937_64& rng) {
  const Encoded enc = cpu_encode(c);
  Buffer payload(c.payload_bytes);
  memcpy(payload.get(), enc.payload.data(), c.payload_bytes);
  for (DType out : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const size_t width = dtype_size(out);
    std::vector<uint8_t> want(c.elements * width, 0xA5);
    for (const tc::Job& job : c.jobs)
      topk::decode(job.params, std::span<const uint8_t>(enc.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)),
                   job.count, out, want.data() + job.element_offset * width);
    Buffer got(want.size());
    tk::run_decode(l, tc::DecodeBatch{c.jobs, payload.get(), got.get(), out, 0}, false);
    BOOST_TEST(first_difference(got.get(), want.data(), want.size(), static_cast<uint32_t>(width)) == "",
               "decode to " << dtype_name(out));
  }
  std::vector<float> acc(c.elements);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& a : acc) a = normal(rng);
  acc[rng() % acc.size()] = bits_float(0x7fc00000u);
  std::vector<float> want = acc;
  for (const tc::Job& job : c.jobs)
    topk::decode_accumulate(job.params, std::span<const uint8_t>(enc.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)),
                            job.count, want.data() + job.element_offset);
  Buffer got(acc.size() * 4);
  memcpy(got.get(), acc.data(), acc.size() * 4);
  tk::run_decode(l, tc::DecodeBatch{c.jobs, payload.get(), got.get(), DType::kFloat32, 0}, true);
  BOOST_TEST(first_difference(got.get(), reinterpret_cast<const uint8_t*>(want.data()), want.size() * 4, 4) == "",
             "decode_accumulate");
}

void check_stats(const Case& c, const std::vector<TopkParams>& candidates, EmulatedLauncher& l, std::mt19937_64& rng) {
  const uint32_t stride = static_cast<uint32_t>(candidates.size()) + 2;
  std::vector<uint32_t> columns(candidates.size());
  for (size_t i = 0; i < columns.size(); ++i) columns[i] = static_cast<uint32_t>(i + 1);
  std::shuffle(columns.begin(), columns.end(), rng);
  const double weight = 0.5 + static_cast<double>(rng() % 4);
  std::vector<double> want(c.layers * stride);
  for (double& v : want) v = static_cast<double>(rng() % 100);
  std::vector<uint8_t> want_flags(c.layers, 0);
  const std::vector<double> initial = want;
  const size_t width = dtype_size(c.dtype);
  for (const tc::Job& job : c.jobs) {
    if (job.count == 0) continue;
    std::vector<double> errors(candidates.size());
    const uint64_t bad = topk::squared_errors(candidates, c.dtype, Slice{c.input.data() + job.element_offset * width, job.count, 0},
                                              c.residual.empty() ? nullptr : c.residual.data() + job.element_offset, errors);
    if (bad) want_flags[job.layer] = 1;
    for (size_t k = 0; k < candidates.size(); ++k) want[job.layer * stride + columns[k]] += weight * errors[k];
  }
  Buffer input(c.input.size()), residual(c.residual.size() * 4), squared(want.size() * 8), flags(c.layers, 0),
      scratch(tc::stats_scratch_bytes(c.jobs, candidates));
  memcpy(input.get(), c.input.data(), c.input.size());
  if (!c.residual.empty()) memcpy(residual.get(), c.residual.data(), c.residual.size() * 4);
  memcpy(squared.get(), initial.data(), initial.size() * 8);
  tc::StatsBatch b;
  b.jobs = c.jobs;
  b.candidates = candidates;
  b.columns = columns;
  b.row_stride = stride;
  b.input = input.get();
  b.input_dtype = c.dtype;
  b.residual = c.residual.empty() ? nullptr : reinterpret_cast<const float*>(residual.get());
  b.squared = reinterpret_cast<double*>(squared.get());
  b.nonfinite = flags.get();
  b.weight = weight;
  b.scratch = scratch.get();
  b.scratch_bytes = scratch.size();
  tk::run_squared_errors(l, b);
  std::vector<double> got(want.size());
  memcpy(got.data(), squared.get(), got.size() * 8);
  for (size_t i = 0; i < want.size(); ++i) {
    const bool same = got[i] == want[i] || std::fabs(got[i] - want[i]) <= 1e-12 * std::fabs(want[i]) + 1e-300;
    BOOST_TEST(same, "squared[" << i << "]: emulated " << got[i] << ", CPU " << want[i]);
  }
  for (uint32_t layer = 0; layer < c.layers; ++layer) BOOST_TEST(flags.get()[layer] == want_flags[layer]);
}

DType random_dtype(std::mt19937_64& rng) {
  static constexpr DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  return kTypes[rng() % 3];
}

}  // namespace

BOOST_AUTO_TEST_SUITE(topk_cuda_emulation)

// One job at a time: every size class (one element, under a warp, partial tiles, several
// tiles), densities from 1e-9 to 1, every element type, with and without error feedback.
BOOST_AUTO_TEST_CASE(encode_and_decode_single_jobs_match_the_cpu) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  EmulatedLauncher l(3);
  const uint64_t sizes[] = {1, 31, 1000, 4097, 9000};
  const uint32_t densities[] = {1, 1'000'000, 10'000'000, 500'000'000, 1'000'000'000};
  for (uint64_t n : sizes)
    for (uint32_t ppb : densities) {
      const DType dtype = random_dtype(rng);
      const Dist dist = kDists[rng() % std::size(kDists)];
      const bool residual = rng() % 2;
      BOOST_TEST_CONTEXT("seed " << seed << ", n " << n << ", density_ppb " << ppb << ", " << dtype_name(dtype) << ", "
                                 << dist_name(dist) << (residual ? ", residual" : "")) {
        const Case c = make_case("single", dtype, {{n, ppb, dist}}, residual, false, rng);
        check_encode(c, l);
        check_decode(c, l, rng);
      }
    }
}

// Every distribution, including the adversarial ones (all equal, all zero, mostly zero:
// the candidate list overflows and the selection runs over the full data), NaN and
// infinities in the input and residual (tiles that keep their residual), skipped residuals.
BOOST_AUTO_TEST_CASE(encode_handles_ties_nonfinite_values_and_skipped_residuals) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  EmulatedLauncher l(2);
  for (Dist dist : kDists)
    for (int variant = 0; variant < 2; ++variant) {
      const DType dtype = random_dtype(rng);
      const uint64_t n = 2000 + rng() % 9000;
      const uint32_t ppb = variant == 0 ? 10'000'000 : 300'000'000;
      const bool specials = rng() % 2;
      BOOST_TEST_CONTEXT("seed " << seed << ", " << dist_name(dist) << ", n " << n << ", density_ppb " << ppb << ", "
                                 << dtype_name(dtype) << (specials ? ", non-finite values" : "")) {
        const Case c = make_case("ties", dtype, {{n, ppb, dist, specials}, {n / 3 + 1, ppb, Dist::kNormal, specials}},
                                 true, variant == 1, rng);
        check_encode(c, l);
        check_decode(c, l, rng);
      }
    }
}

// Many jobs in one batch: several launch tables (64 jobs each), layers shared by jobs, gaps
// between the jobs' elements and payloads that must stay untouched.
BOOST_AUTO_TEST_CASE(batches_of_many_jobs_match_the_cpu) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  EmulatedLauncher l(4);
  std::vector<JobSpec> specs;
  for (int i = 0; i < 70; ++i)
    specs.push_back(JobSpec{i % 17 == 0 ? 0 : 1 + rng() % 300, static_cast<uint32_t>(1 + rng() % 1'000'000'000),
                            kDists[rng() % std::size(kDists)], rng() % 10 == 0});
  specs.push_back(JobSpec{5000, 20'000'000, Dist::kNormal, false});
  for (bool residual : {false, true}) {
    const DType dtype = random_dtype(rng);
    BOOST_TEST_CONTEXT("seed " << seed << ", " << dtype_name(dtype) << (residual ? ", residual" : "")) {
      const Case c = make_case("batch", dtype, specs, residual, residual, rng);
      check_encode(c, l);
      check_decode(c, l, rng);
    }
  }
}

// The statistics: up to 16 candidates (two groups of 8), columns in any order, several
// jobs per layer, non-finite jobs.
BOOST_AUTO_TEST_CASE(squared_errors_match_the_cpu) {
  const uint64_t seed = test::run_seed();
  std::mt19937_64 rng(seed);
  EmulatedLauncher l(3);
  for (int round = 0; round < 6; ++round) {
    std::vector<TopkParams> candidates;
    const size_t count = round == 0 ? 16 : 1 + rng() % 10;
    for (size_t k = 0; k < count; ++k) candidates.push_back(density(static_cast<uint32_t>(1 + rng() % 1'000'000'000)));
    std::vector<JobSpec> specs;
    const size_t jobs = 1 + rng() % 6;
    // Round 1: float32 clusters, where the last digit's bins below the threshold count.
    for (size_t j = 0; j < jobs; ++j)
      specs.push_back(JobSpec{1 + rng() % 6000, 10'000'000, round == 1 ? Dist::kCluster : kDists[rng() % std::size(kDists)],
                              round != 1 && rng() % 5 == 0});
    const DType dtype = round == 1 ? DType::kFloat32 : random_dtype(rng);
    const bool residual = rng() % 2;
    BOOST_TEST_CONTEXT("seed " << seed << ", round " << round << ", " << count << " candidates, " << jobs << " jobs, "
                               << dtype_name(dtype) << (residual ? ", residual" : "")) {
      const Case c = make_case("stats", dtype, specs, residual, false, rng);
      check_stats(c, candidates, l, rng);
    }
  }
}

// A payload the CPU would refuse (an index out of range or out of order) is skipped entry
// by entry: nothing is written outside the job's elements.
BOOST_AUTO_TEST_CASE(decode_skips_corrupt_entries_without_writing_out_of_bounds) {
  EmulatedLauncher l(2);
  const TopkParams p = density(100'000'000);  // k = 10 of 100
  tc::Job job;
  job.element_offset = 8;
  job.count = 100;
  job.params = p;
  std::vector<uint32_t> payload(20);
  const uint32_t index[10] = {3, 7, 7, 2, 50, 1000, 60, 0xffffffffu, 99, 98};
  for (uint32_t e = 0; e < 10; ++e) {
    payload[e] = index[e];
    payload[10 + e] = float_bits(static_cast<float>(e + 1));
  }
  Buffer in(payload.size() * 4), out(4 * 120);
  memcpy(in.get(), payload.data(), payload.size() * 4);
  tk::run_decode(l, tc::DecodeBatch{std::span<const tc::Job>(&job, 1), in.get(), out.get(), DType::kFloat32, 0}, false);
  std::vector<float> got(120);
  memcpy(got.data(), out.get(), got.size() * 4);
  for (uint32_t i = 0; i < 120; ++i) {
    float want = 0.0f;
    if (i < 8 || i >= 108) want = bits_float(0xA5A5A5A5u);  // outside the job: untouched
    // Entries 0 (3) and 1 (7) are written; 2 (7 again) and 3 (2) are not above the index
    // before them; 4 (50) is; 5 (1000) is out of range; 6 (60), 7 (0xffffffff, out of
    // range), 8 (99, not above 0xffffffff) and 9 (98) are skipped.
    if (i == 8 + 3) want = 1.0f;
    if (i == 8 + 7) want = 2.0f;
    if (i == 8 + 50) want = 5.0f;
    BOOST_TEST(float_bits(got[i]) == float_bits(want), "element " << i);
  }
}

BOOST_AUTO_TEST_SUITE_END()
