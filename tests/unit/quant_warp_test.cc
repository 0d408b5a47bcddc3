// The warp programs of the CUDA quantization kernels (kernels/quant_warp.h), run on a
// 32-lane warp emulated on the CPU (warp_emulator.h), against the CPU reference.
//
// Each emulated launch does what the kernels of kernels/quant_cuda.cu do: the host side
// (codec_tables / stats_launches of quant_batch.h) builds the job tables, and work item w
// of a table runs the bucket program on bucket w - work_begin of job find_job(w), one
// warp per work item. Encode, decode and decode-accumulate must give the reference's
// bytes exactly (payloads, residuals, outputs, and untouched bytes between jobs); the
// statistics agree with measure_candidates within a tolerance (StatsTolerance, slack()).
//
// What this cannot check: the CUDA intrinsics themselves, the vector loads and stores
// (on the host every access is scalar), the grid arithmetic and the reduction kernel's
// tree order; tests/gpu/ covers those on a device.
#include "kernels/quant_warp.h"

#include <algorithm>
#include <bit>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/quant.h"
#include "kernels/quant_batch.h"
#include "kernels/quant_cuda.h"
#include "test_util.h"
#include "warp_emulator.h"

using namespace lgreco;
using lgreco::test::Dist;
using lgreco::test::EmulatedWarp;
using quant::cuda::DecodeBatch;
using quant::cuda::EncodeBatch;
using quant::cuda::Job;
using quant::cuda::StatsBatch;
namespace warp = lgreco::quant::warp;

namespace {

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
// 4096 + 32: a bucket of more than one register window whose last window is partial.
constexpr uint32_t kBuckets[] = {32, 64, 96, 128, 1024, 2048, 4096 + 32};
// A NaN no computation here produces, for float arrays that must stay untouched.
constexpr uint32_t kPoisonBits = 0x7fa5a5a5u;

float poison_float() { return bits_float(kPoisonBits); }
// A signalling-NaN pattern no statistics kernel can produce, for the per-bucket scratch.
constexpr uint64_t kPoisonDoubleBits = 0x7ff5a5a5a5a5a5a5ull;
double poison_double() { return std::bit_cast<double>(kPoisonDoubleBits); }
uint64_t double_bits(double d) { return std::bit_cast<uint64_t>(d); }

// ---------------------------------------------------------------------------------------
// Emulated launches: every work item of every table, one emulated warp each.

template <class Program>
void run_tables(const std::vector<warp::JobTable>& tables, Program&& program) {
  for (const warp::JobTable& t : tables)
    for (uint32_t w = 0; w < t.total_work; ++w) {
      const warp::KernelJob& job = t.jobs[warp::find_job(t, w)];
      test::run_warp([&](const EmulatedWarp& lanes) { program(lanes, job, w - job.work_begin, w); });
    }
}

template <DType T>
void encode_tables(const std::vector<warp::JobTable>& tables, const warp::EncodeArgs& a, bool residual) {
  run_tables(tables, [&](const EmulatedWarp& lanes, const warp::KernelJob& job, uint64_t b, uint32_t) {
    if (residual)
      warp::encode_bucket<T, true>(lanes, a, job, b);
    else
      warp::encode_bucket<T, false>(lanes, a, job, b);
  });
}

// quant::cuda::encode, with the emulated warp for the hardware one.
void emulate_encode(const EncodeBatch& batch) {
  const std::vector<warp::JobTable> tables = quant::cuda::codec_tables(batch.jobs, "quant cuda encode");
  const warp::EncodeArgs args = quant::cuda::encode_args(batch, "quant cuda encode");
  switch (batch.input_dtype) {
    case DType::kFloat32: encode_tables<DType::kFloat32>(tables, args, batch.residual != nullptr); break;
    case DType::kFloat16: encode_tables<DType::kFloat16>(tables, args, batch.residual != nullptr); break;
    case DType::kBFloat16: encode_tables<DType::kBFloat16>(tables, args, batch.residual != nullptr); break;
  }
}

template <DType T, bool kAccumulate>
void decode_tables(const std::vector<warp::JobTable>& tables, const warp::DecodeArgs& a) {
  run_tables(tables, [&](const EmulatedWarp& lanes, const warp::KernelJob& job, uint64_t b, uint32_t) {
    warp::decode_bucket<T, kAccumulate>(lanes, a, job, b);
  });
}

// quant::cuda::decode / decode_accumulate.
void emulate_decode(const DecodeBatch& batch, bool accumulate) {
  const std::vector<warp::JobTable> tables = quant::cuda::codec_tables(batch.jobs, "quant cuda decode");
  const warp::DecodeArgs args = quant::cuda::decode_args(batch, "quant cuda decode");
  if (accumulate) return decode_tables<DType::kFloat32, true>(tables, args);
  switch (batch.output_dtype) {
    case DType::kFloat32: decode_tables<DType::kFloat32, false>(tables, args); break;
    case DType::kFloat16: decode_tables<DType::kFloat16, false>(tables, args); break;
    case DType::kBFloat16: decode_tables<DType::kBFloat16, false>(tables, args); break;
  }
}

template <DType T, bool kResidual, uint32_t kCapacity>
void stats_table(const warp::JobTable& t, const warp::StatsArgs& a) {
  run_tables(std::vector<warp::JobTable>{t},
             [&](const EmulatedWarp& lanes, const warp::KernelJob& job, uint64_t b, uint32_t w) {
               warp::stats_bucket<T, kResidual, kCapacity>(lanes, a, job, b, w);
             });
}

template <DType T>
void stats_table_typed(const warp::JobTable& t, const warp::StatsArgs& a) {
  // As launch_stats: the 8-candidate instance when it suffices.
  if (a.residual) {
    if (a.candidate_count <= 8)
      stats_table<T, true, 8>(t, a);
    else
      stats_table<T, true, warp::kMaxCandidates>(t, a);
  } else {
    if (a.candidate_count <= 8)
      stats_table<T, false, 8>(t, a);
    else
      stats_table<T, false, warp::kMaxCandidates>(t, a);
  }
}

// quant::cuda::squared_errors: the statistics kernel per table, then what
// stats_reduce_kernel does (each job's bucket partials summed in double, in job order,
// weight x that added into the job's layer row).
void emulate_stats(const StatsBatch& batch) {
  const auto launches = quant::cuda::stats_launches(batch.jobs, batch.candidates, "quant cuda squared_errors");
  const uint64_t scratch_doubles = quant::cuda::stats_scratch_bytes(launches) / sizeof(double);
  for (const quant::cuda::StatsLaunch& launch : launches) {
    warp::StatsArgs args = quant::cuda::stats_args(batch, launch, nullptr, "quant cuda squared_errors");
    const quant::cuda::StatsOutput output = quant::cuda::stats_output(batch, launch, "quant cuda squared_errors");
    for (const warp::JobTable& t : launch.tables) {
      const uint64_t used = uint64_t{t.total_work} * args.candidate_count;
      BOOST_TEST_REQUIRE(used <= scratch_doubles);  // stats_scratch_bytes covers every table
      std::vector<double> partial(used, poison_double());
      args.partial = partial.data();
      switch (batch.input_dtype) {
        case DType::kFloat32: stats_table_typed<DType::kFloat32>(t, args); break;
        case DType::kFloat16: stats_table_typed<DType::kFloat16>(t, args); break;
        case DType::kBFloat16: stats_table_typed<DType::kBFloat16>(t, args); break;
      }
      for (double p : partial) BOOST_TEST_REQUIRE(double_bits(p) != kPoisonDoubleBits);  // every slot written
      for (uint32_t j = 0; j < t.count; ++j) {
        const warp::KernelJob& job = t.jobs[j];
        for (uint32_t c = 0; c < args.candidate_count; ++c) {
          double sum = 0.0;
          for (uint64_t i = 0; i < warp::bucket_count_of(job); ++i)
            sum += partial[(job.work_begin + i) * args.candidate_count + c];
          batch.squared[uint64_t{job.layer} * output.row_stride + output.columns[c]] += batch.weight * sum;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Batches: jobs laid out in shared arrays with gaps, random data.

struct Batch {
  std::vector<Job> jobs;
  uint64_t elements = 0;  // length of the element arrays
  uint64_t bytes = 0;     // length of the payload
  uint32_t layers = 1;
};

std::string describe(const Job& j, size_t index) {
  return "job " + std::to_string(index) + " {bits=" + std::to_string(j.params.bits) +
         " bucket=" + std::to_string(j.params.bucket) + " " + rounding_name(j.params.rounding) +
         " count=" + std::to_string(j.count) + " first=" + std::to_string(j.first_element) +
         " element_offset=" + std::to_string(j.element_offset) + " byte_offset=" + std::to_string(j.byte_offset) +
         " layer=" + std::to_string(j.layer) + "}";
}

// Places the jobs one after another with small random gaps: element offsets of every
// alignment (an odd offset takes the kernels' scalar-load path) and payload offsets at
// any multiple of 4.
void lay_out(Batch& b, std::mt19937_64& rng) {
  uint64_t element = rng() % 5, byte = 4 * (rng() % 3);
  for (Job& j : b.jobs) {
    j.element_offset = element;
    j.byte_offset = byte;
    element += j.count + rng() % 7;
    byte += quant::encoded_bytes(j.params, j.count) + 4 * (rng() % 3);
  }
  b.elements = element + rng() % 5;
  b.bytes = byte + 4 * (rng() % 3);
  b.layers = 1;
  for (const Job& j : b.jobs) b.layers = std::max(b.layers, j.layer + 1);
}

// Counts that hit the edges (empty, one element, part of a group, a bucket and one
// either side), then random ones; `k` cycles through them.
uint64_t pick_count(uint32_t bucket, size_t k, std::mt19937_64& rng) {
  // Small buckets cost a collective round per few elements in the emulator: keep them shorter.
  const uint64_t most = bucket < 128 ? 5000 : 20000;
  switch (k % 10) {
    case 0: return 0;
    case 1: return 1;
    case 2: return 31;
    case 3: return 33;
    case 4: return bucket - 1;
    case 5: return bucket;
    case 6: return bucket + 1;
    case 7: return 3 * bucket + rng() % bucket;
    default: return 1 + rng() % most;
  }
}

Job make_job(const QuantParams& p, uint64_t count, uint32_t layer, std::mt19937_64& rng) {
  Job j;
  j.params = p;
  j.count = count;
  j.layer = layer;
  j.first_element = uint64_t{p.bucket} * (rng() % 3 == 0 ? 0 : 1 + rng() % 3000);
  return j;
}

// A typed element array, as bytes.
struct Elements {
  DType dtype;
  std::vector<uint8_t> bytes;
  Elements(DType t, uint64_t n) : dtype(t), bytes(n * dtype_size(t), uint8_t{0xA5}) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  void* at(uint64_t i) { return bytes.data() + i * dtype_size(dtype); }
  const void* at(uint64_t i) const { return bytes.data() + i * dtype_size(dtype); }
  void set(uint64_t i, float v) { store_from_float(bytes.data(), dtype, i, v); }
};

// Values of one job: a test distribution (never all zeros), sometimes scaled down so far
// that a bucket's unit is subnormal.
std::vector<float> job_values(DType dtype, uint64_t n, uint32_t bucket, std::mt19937_64& rng) {
  Dist d = test::kAllDists[rng() % std::size(test::kAllDists)];
  if (dtype == DType::kFloat16 && d == Dist::kMixedScales) d = Dist::kNormal;  // 10^+-12 is outside float16
  std::vector<float> x = test::draw(d, n, rng, bucket);
  if (dtype != DType::kFloat16 && d == Dist::kNormal && rng() % 4 == 0)
    for (float& v : x) v *= 1e-38f;
  return x;
}

// Puts a NaN, an infinity or (with `pairs`) a pair of values whose difference overflows
// float32 into a few buckets of x. A pair lies within one group of 32, so that it is in
// one bucket for every bucket size (the statistics measure other sizes than the data was
// drawn for): one huge value alone would make a finite range whose unit^2 overflows
// float32, where the kernel's float32 error is +inf or NaN (0 x inf), not a value to
// compare.
void inject_nonfinite(std::vector<float>& x, uint32_t bucket, bool pairs, std::mt19937_64& rng) {
  if (x.empty()) return;
  const uint64_t buckets = (x.size() + bucket - 1) / bucket;
  for (int k = 0; k < 3; ++k) {
    const uint64_t begin = (rng() % buckets) * bucket, n = std::min<uint64_t>(bucket, x.size() - begin);
    const uint64_t group = begin + 32 * (rng() % ((n + 31) / 32)), m = std::min<uint64_t>(32, x.size() - group);
    const uint64_t i = group + rng() % m, i2 = group + (i - group + 1 + rng() % std::max<uint64_t>(m - 1, 1)) % m;
    switch (m == 1 || !pairs ? rng() % 3 : rng() % 4) {
      case 0: x[i] = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: x[i] = std::numeric_limits<float>::infinity(); break;
      case 2: x[i] = -std::numeric_limits<float>::infinity(); break;
      default:  // finite values whose range is not (a float16 input makes them infinities)
        x[i] = -3e38f;
        x[i2] = 3e38f;
        break;
    }
  }
}

// A random array start (the batches' *_first) at or before every non-empty job's first
// element: the kernels must address element e of a job at array[e - first].
uint64_t random_first(const Batch& b, std::mt19937_64& rng) {
  uint64_t lowest = b.elements;
  for (const Job& j : b.jobs)
    if (j.count > 0) lowest = std::min(lowest, j.element_offset);
  return rng() % (lowest + 1);
}

struct Data {
  Elements input;
  std::vector<float> residual;  // empty: none
};

// Input (and residual) for every job of b; gaps hold random values (never read) in the
// input and poison in the residual (must stay untouched). `nonfinite`: probability that a
// job gets non-finite buckets.
Data make_data(const Batch& b, DType dtype, bool with_residual, double nonfinite, std::mt19937_64& rng) {
  Data d{Elements(dtype, b.elements), {}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (uint64_t i = 0; i < b.elements; ++i) d.input.set(i, normal(rng));
  if (with_residual) d.residual.assign(b.elements, poison_float());
  for (const Job& j : b.jobs) {
    std::vector<float> x = job_values(dtype, j.count, j.params.bucket, rng);
    if (unit(rng) < nonfinite) inject_nonfinite(x, j.params.bucket, true, rng);
    for (uint64_t i = 0; i < j.count; ++i) d.input.set(j.element_offset + i, x[i]);
    if (!with_residual) continue;
    std::vector<float> r = test::draw(Dist::kNormal, j.count, rng);
    for (float& e : r) e *= 0.01f;
    // Non-finite only once added. No overflowing pairs: one could cancel half of an
    // input's pair and leave a lone huge value.
    if (unit(rng) < nonfinite / 2) inject_nonfinite(r, j.params.bucket, false, rng);
    std::copy(r.begin(), r.end(), d.residual.begin() + static_cast<ptrdiff_t>(j.element_offset));
  }
  return d;
}

// The job and place of byte `at` of a batch's payload, for failure messages.
std::string payload_place(const Batch& b, uint64_t at) {
  for (size_t i = 0; i < b.jobs.size(); ++i) {
    const Job& j = b.jobs[i];
    const uint64_t size = quant::encoded_bytes(j.params, j.count);
    if (at < j.byte_offset || at >= j.byte_offset + size) continue;
    const uint64_t off = at - j.byte_offset, meta = quant::meta_bytes(j.params, j.count);
    if (off < meta) return describe(j, i) + ", metadata of bucket " + std::to_string(off / 8);
    const uint64_t word = (off - meta) / 4;
    return describe(j, i) + ", code word of group " + std::to_string(word / j.params.bits) + " plane " +
           std::to_string(word % j.params.bits);
  }
  return "between jobs (must stay untouched)";
}

// The job and element of element `at` of a batch's arrays.
std::string element_place(const Batch& b, uint64_t at) {
  for (size_t i = 0; i < b.jobs.size(); ++i) {
    const Job& j = b.jobs[i];
    if (at >= j.element_offset && at < j.element_offset + j.count)
      return describe(j, i) + ", element " + std::to_string(at - j.element_offset);
  }
  return "between jobs (must stay untouched)";
}

// Index of the first differing byte, or -1.
int64_t first_difference(const void* a, const void* b, uint64_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  for (uint64_t i = 0; i < n; ++i)
    if (x[i] != y[i]) return static_cast<int64_t>(i);
  return -1;
}

NoiseKey random_key(std::mt19937_64& rng) {
  return NoiseKey{rng(), static_cast<uint32_t>(rng()), rng(), static_cast<uint32_t>(rng())};
}

// ---------------------------------------------------------------------------------------
// Encode: the emulated batch against quant::encode job by job. Returns the reference's
// non-finite bucket count (so callers can check their cases had some).

uint64_t check_encode(const Batch& b, DType dtype, bool with_residual, bool with_skip, double nonfinite,
                      std::mt19937_64& rng) {
  Data data = make_data(b, dtype, with_residual, nonfinite, rng);
  std::vector<uint8_t> skip(b.layers);
  for (uint8_t& s : skip) s = rng() % 3 == 0 ? 1 : 0;
  const NoiseKey key = random_key(rng);

  std::vector<uint8_t> payload_ref(b.bytes, uint8_t{0xA5}), payload_emu = payload_ref;
  std::vector<float> residual_ref = data.residual, residual_emu = data.residual;
  uint64_t nonfinite_ref = 0;
  for (const Job& j : b.jobs) {
    NoiseKey k = key;
    k.layer += j.layer;  // the batch's key, layer + job layer
    const bool use_residual = with_residual && !(with_skip && skip[j.layer]);
    const uint64_t size = quant::encoded_bytes(j.params, j.count);
    nonfinite_ref += quant::encode(j.params, k, dtype, Slice{data.input.at(j.element_offset), j.count, j.first_element},
                                   use_residual ? residual_ref.data() + j.element_offset : nullptr,
                                   std::span(payload_ref).subspan(j.byte_offset, size))
                         .nonfinite_buckets;
  }

  const unsigned long long counter_start = rng() % 1000;  // the kernels add to the counter
  unsigned long long counter = counter_start;
  EncodeBatch batch;
  batch.jobs = b.jobs;
  batch.input_first = random_first(b, rng);
  batch.input = data.input.at(batch.input_first);
  batch.input_dtype = dtype;
  batch.residual_first = random_first(b, rng);
  batch.residual = with_residual ? residual_emu.data() + batch.residual_first : nullptr;
  batch.skip_residual = with_skip ? skip.data() : nullptr;
  batch.payload = payload_emu.data();
  batch.noise = key;
  batch.nonfinite_buckets = &counter;
  emulate_encode(batch);

  BOOST_TEST_INFO_SCOPE(dtype_name(dtype) << " residual=" << with_residual << " skip=" << with_skip << " jobs="
                                          << b.jobs.size());
  const int64_t at = first_difference(payload_emu.data(), payload_ref.data(), b.bytes);
  BOOST_TEST_INFO_SCOPE("first payload difference at byte " << at << ": "
                                                            << (at < 0 ? "-" : payload_place(b, at)));
  BOOST_TEST_REQUIRE(at == -1);
  if (with_residual) {
    const int64_t r = first_difference(residual_emu.data(), residual_ref.data(), 4 * b.elements);
    BOOST_TEST_INFO_SCOPE("first residual difference at element " << r / 4 << ": "
                                                                  << (r < 0 ? "-" : element_place(b, r / 4)));
    BOOST_TEST_REQUIRE(r == -1);
  }
  BOOST_TEST_REQUIRE(counter - counter_start == nonfinite_ref);
  return nonfinite_ref;
}

// ---------------------------------------------------------------------------------------
// Decode: payloads from the reference encoder, decoded by both.

void check_decode(const Batch& b, DType out_dtype, bool accumulate, std::mt19937_64& rng) {
  const DType in_dtype = kDTypes[rng() % 3];
  Data data = make_data(b, in_dtype, false, 0.3, rng);
  std::vector<uint8_t> payload(b.bytes, uint8_t{0xA5});
  const NoiseKey key = random_key(rng);
  for (const Job& j : b.jobs)
    quant::encode(j.params, key, in_dtype, Slice{data.input.at(j.element_offset), j.count, j.first_element}, nullptr,
                  std::span(payload).subspan(j.byte_offset, quant::encoded_bytes(j.params, j.count)));

  const DType t = accumulate ? DType::kFloat32 : out_dtype;
  Elements out_ref(t, b.elements);  // 0xA5 bytes: the poison between jobs
  if (accumulate) {
    // Accumulators hold random values, and a few NaN (with a payload the decoded NaN does
    // not have: a non-finite bucket must overwrite, not add) and infinities.
    std::normal_distribution<float> normal(0.0f, 10.0f);
    const float specials[] = {bits_float(0x7fc01234u), bits_float(0xffc05678u), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
    for (const Job& j : b.jobs)
      for (uint64_t i = 0; i < j.count; ++i)
        out_ref.set(j.element_offset + i, rng() % 200 == 0 ? specials[rng() % 4] : normal(rng));
  }
  Elements out_emu = out_ref;
  for (const Job& j : b.jobs) {
    const auto in = std::span<const uint8_t>(payload).subspan(j.byte_offset, quant::encoded_bytes(j.params, j.count));
    if (accumulate)
      quant::decode_accumulate(j.params, in, j.count, static_cast<float*>(out_ref.at(j.element_offset)));
    else
      quant::decode(j.params, in, j.count, t, out_ref.at(j.element_offset));
  }
  const uint64_t output_first = random_first(b, rng);
  emulate_decode(DecodeBatch{b.jobs, payload.data(), out_emu.at(output_first), t, output_first}, accumulate);

  BOOST_TEST_INFO_SCOPE(dtype_name(t) << " accumulate=" << accumulate << " jobs=" << b.jobs.size());
  const int64_t at = first_difference(out_emu.data(), out_ref.data(), out_ref.bytes.size());
  BOOST_TEST_INFO_SCOPE("first output difference at element " << at / static_cast<int64_t>(dtype_size(t)) << ": "
                                                              << (at < 0 ? "-" : element_place(b, at / dtype_size(t))));
  BOOST_TEST_REQUIRE(at == -1);
}

// A batch of jobs with random parameters from the whole range.
Batch random_batch(size_t jobs, uint64_t max_count, std::mt19937_64& rng, uint32_t layers) {
  Batch b;
  for (size_t i = 0; i < jobs; ++i) {
    const QuantParams p{1 + static_cast<int>(rng() % 8), kBuckets[rng() % std::size(kBuckets)],
                        rng() % 2 ? Rounding::kStochastic : Rounding::kNearest};
    const uint64_t count = i % 5 == 0 ? pick_count(p.bucket, rng(), rng) % (max_count + 1) : rng() % (max_count + 1);
    b.jobs.push_back(make_job(p, count, static_cast<uint32_t>(rng() % layers), rng));
  }
  lay_out(b, rng);
  return b;
}

// ---------------------------------------------------------------------------------------
// Statistics.

// How far the kernels' statistics may be from measure_candidates (docs/KERNELS.md):
//  - `relative` of the reference's value: float32 partial sums in another order;
//  - plus, per element of each job, what the two definitions of a position can differ
//    by (slack() below), scaled by `slack` (1 = the bound as derived).
struct StatsTolerance {
  double relative;
  double slack;
};

// Largest differences seen per kind of candidate (relative to the reference, and as a
// fraction of the allowed slack), reported at the end of a case.
struct Worst {
  double none = 0, nearest = 0, stochastic = 0;
  double slack_used = 0;   // largest (diff - relative part) / slack
  uint64_t beyond_relative = 0, compared = 0;  // comparisons that needed the slack
};

// What the kernel's error of candidate `spec` on one job may differ by from the
// reference's beyond the relative term, summed over the job's buckets:
//  - the kernel multiplies by a rounded reciprocal of the unit where the reference
//    divides: a position p <= L moves by up to a few ulps of L, taken as
//    dp = L x 2^-21, and with it f (1 - f) (stochastic) and |d| (nearest) by at most dp;
//    an element exactly on a code is 0 in the reference and up to dp x unit^2 here;
//  - for round to nearest the reference's error is the actual v - (min + code x unit),
//    and that decoded value is rounded to float32 (half an ulp of the larger of |min|,
//    |max|, twice for the product and the sum), which the kernel's (p - round(p)) x unit
//    leaves out; it matters when |min| is large next to the unit;
//  - the kernel squares and scales in float32: where unit^2 (for `none`, an element's
//    squared rounding error) is below float32's normal range, it may be lost, where the
//    reference (float64 there) keeps it: at most n unit^2 / 4 a bucket, plus the decoded
//    rounding for nearest.
// Non-finite buckets are left out (both sides are +inf there). Computed in double from
// the float32 values v = x + residual.
double slack(const CodecSpec& spec, DType dtype, const void* x, const float* residual, uint64_t count) {
  if (spec.family() == CodecFamily::kNone) {
    double total = 0.0;
    for (uint64_t i = 0; i < count; ++i) {
      const float v = residual ? load_as_float(x, dtype, i) + residual[i] : load_as_float(x, dtype, i);
      const double d = double(v) - double(round_to_dtype(v, dtype));
      if (d * d < 0x1p-126) total += d * d;
    }
    return total;
  }
  const QuantParams& p = spec.quant_params();
  const double top = std::ldexp(1.0, p.bits) - 1, dp = top * 0x1p-21;
  double total = 0.0;
  for (uint64_t begin = 0; begin < count; begin += p.bucket) {
    const uint64_t n = std::min<uint64_t>(p.bucket, count - begin);
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    bool finite = true;
    for (uint64_t i = begin; i < begin + n; ++i) {
      const float v = residual ? load_as_float(x, dtype, i) + residual[i] : load_as_float(x, dtype, i);
      finite = finite && std::isfinite(v);
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
    if (!finite || !std::isfinite(hi - lo)) continue;
    const double unit = (double(hi) - double(lo)) / top;
    const bool underflows = unit * unit < 0x1p-126;
    if (p.rounding == Rounding::kStochastic) {
      total += double(n) * unit * unit * (underflows ? 0.25 : dp);
    } else {
      const double d = unit * dp + 0x1p-23 * std::max(std::fabs(double(lo)), std::fabs(double(hi)));
      total += double(n) * (underflows ? (0.5 * unit + d) * (0.5 * unit + d) : (unit + d) * d);
    }
  }
  return total;
}

// measure_candidates job by job against the emulated squared_errors. Returns whether any
// job had non-finite buckets.
bool check_stats(const Batch& b, const std::vector<CodecSpec>& candidates, const Data& data, bool with_residual,
                 StatsTolerance tol, Worst& worst, std::mt19937_64& rng) {
  const DType dtype = data.input.dtype;
  const size_t C = candidates.size();
  // From zero: the adding into the rows is the emulation's (stats_reduce_kernel is not
  // under test here), and a base value would swamp errors far below it.
  std::vector<double> squared_emu(b.layers * C, 0.0), squared_ref = squared_emu;
  const double weight = 0.25 + std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  std::vector<uint8_t> nonfinite_ref(b.layers, 0), nonfinite_emu(b.layers, 0);
  std::vector<double> allowed(b.layers * C, 0.0);
  bool any_nonfinite = false;
  for (const Job& j : b.jobs) {
    const float* r = with_residual ? data.residual.data() + j.element_offset : nullptr;
    const CandidateReport report =
        measure_candidates(candidates, dtype, Slice{data.input.at(j.element_offset), j.count, j.first_element}, r);
    for (size_t c = 0; c < C; ++c) {
      squared_ref[j.layer * C + c] += weight * report.candidates[c].squared_error;
      allowed[j.layer * C + c] += weight * slack(candidates[c], dtype, data.input.at(j.element_offset), r, j.count);
    }
    if (report.nonfinite_buckets > 0) nonfinite_ref[j.layer] = 1, any_nonfinite = true;
  }
  StatsBatch batch;
  batch.jobs = b.jobs;
  batch.candidates = candidates;
  batch.input = data.input.data();
  batch.input_dtype = dtype;
  batch.residual = with_residual ? data.residual.data() : nullptr;
  batch.squared = squared_emu.data();
  batch.nonfinite = nonfinite_emu.data();
  batch.weight = weight;
  emulate_stats(batch);

  BOOST_TEST_INFO_SCOPE(dtype_name(dtype) << " residual=" << with_residual << " jobs=" << b.jobs.size());
  for (uint32_t layer = 0; layer < b.layers; ++layer) {
    BOOST_TEST_INFO_SCOPE("layer " << layer);
    BOOST_TEST_REQUIRE(nonfinite_emu[layer] == nonfinite_ref[layer]);
    for (size_t c = 0; c < C; ++c) {
      const size_t k = layer * C + c;
      const double want = squared_ref[k], got = squared_emu[k];
      BOOST_TEST_INFO_SCOPE(candidates[c].str() << ": emulated " << got << ", reference " << want);
      if (std::isinf(want)) {
        BOOST_TEST_REQUIRE((std::isinf(squared_emu[k]) && squared_emu[k] > 0));
        continue;
      }
      BOOST_TEST_REQUIRE(std::isfinite(got));
      const double diff = std::fabs(got - want);
      const double relative = want > 0 ? diff / want : (diff > 0 ? 1.0 : 0.0);
      const bool none = candidates[c].family() == CodecFamily::kNone;
      double& w = none ? worst.none
                       : (candidates[c].quant_params().rounding == Rounding::kNearest ? worst.nearest
                                                                                       : worst.stochastic);
      if (want > 1e-30) w = std::max(w, relative);  // below, float32 cannot hold the error (see slack())
      ++worst.compared;
      if (diff > tol.relative * want) {
        ++worst.beyond_relative;
        worst.slack_used = std::max(worst.slack_used, (diff - tol.relative * want) / allowed[k]);
      }
      BOOST_TEST_INFO_SCOPE("allowed slack " << allowed[k]);
      BOOST_TEST_REQUIRE(diff <= tol.relative * want + tol.slack * allowed[k]);
    }
  }
  return any_nonfinite;
}

std::vector<CodecSpec> specs(std::initializer_list<const char*> texts) {
  std::vector<CodecSpec> out;
  for (const char* t : texts) out.push_back(CodecSpec::parse(t));
  return out;
}

// Jobs for statistics: first elements on a boundary of every candidate bucket (their
// least common multiple), random layers shared by several jobs.
Batch stats_batch(const std::vector<CodecSpec>& candidates, size_t jobs, uint64_t max_count, uint32_t layers,
                  std::mt19937_64& rng) {
  uint64_t step = 1;
  for (const CodecSpec& c : candidates)
    if (c.family() == CodecFamily::kQuant) step = std::lcm(step, uint64_t{c.quant_params().bucket});
  Batch b;
  for (size_t i = 0; i < jobs; ++i) {
    Job j;
    j.count = i % 4 == 0 ? pick_count(1024, rng(), rng) % (max_count + 1) : 1 + rng() % max_count;
    j.first_element = step * (rng() % 50);
    j.layer = static_cast<uint32_t>(rng() % layers);
    // Ignored by the statistics; the bucket sets the data's constant and non-finite blocks.
    j.params = QuantParams{1 + static_cast<int>(rng() % 8), kBuckets[rng() % std::size(kBuckets)], Rounding::kNearest};
    b.jobs.push_back(j);
  }
  lay_out(b, rng);
  b.layers = std::max(b.layers, layers);
  return b;
}

template <class F>
bool throws_naming(F&& f, const std::string& part) {
  try {
    f();
  } catch (const CodecError& e) {
    BOOST_TEST_INFO_SCOPE("message: " << e.what());
    BOOST_TEST(test::contains(e.what(), part));
    return true;
  }
  return false;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(quant_warp)

// ---------------------------------------------------------------------------------------
// The emulator itself: what it computes and what it refuses.

BOOST_AUTO_TEST_CASE(emulator_ballots_and_shuffles_like_a_warp) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    uint32_t predicate = static_cast<uint32_t>(rng()), values[32];
    for (uint32_t& v : values) v = static_cast<uint32_t>(rng());
    const int mask = 1 + static_cast<int>(rng() % 31);
    uint32_t ballots[32], shuffled[32], lanes[32];
    float shuffled_f[32];
    test::run_warp([&](const EmulatedWarp& w) {
      const uint32_t l = w.lane();
      lanes[l] = l;
      ballots[l] = w.ballot((predicate >> l) & 1u);
      shuffled[l] = w.shfl_xor(values[l], mask);
      shuffled_f[l] = w.shfl_xor(bits_float(values[l]), mask);
    });
    for (uint32_t l = 0; l < 32; ++l) {
      BOOST_TEST(lanes[l] == l);
      BOOST_TEST(ballots[l] == predicate);
      BOOST_TEST(shuffled[l] == values[l ^ mask]);
      BOOST_TEST(float_bits(shuffled_f[l]) == values[l ^ mask]);  // bits, NaN payloads included
    }
    // The reductions of quant_warp.h end with the same value on every lane.
    float sums[32];
    float inputs[32];
    for (float& v : inputs) v = static_cast<float>(rng() % 1000);
    test::run_warp([&](const EmulatedWarp& w) { sums[w.lane()] = warp::warp_sum(w, inputs[w.lane()]); });
    const float total = std::accumulate(std::begin(inputs), std::end(inputs), 0.0f);  // integers: exact
    for (float s : sums) BOOST_TEST(s == total);
  }
}

BOOST_AUTO_TEST_CASE(emulator_reports_divergence_and_lane_exceptions) {
  // Some lanes skip a collective the others wait at.
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) {
                      if (w.lane() != 17) w.ballot(true);
                    }),
                    test::WarpDivergence);
  // Different kinds of collective at once.
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) {
                      if (w.lane() < 16)
                        w.ballot(true);
                      else
                        w.shfl_xor(1u, 1);
                    }),
                    test::WarpDivergence);
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) {
                      if (w.lane() == 3)
                        w.shfl_xor(1.0f, 1);
                      else
                        w.shfl_xor(1u, 1);
                    }),
                    test::WarpDivergence);
  // Different masks, and a mask no lane has.
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) { w.shfl_xor(1u, w.lane() == 31 ? 2 : 1); }),
                    test::WarpDivergence);
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) { w.shfl_xor(1u, 32); }), test::WarpDivergence);
  // A later collective reached by a different number of iterations.
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) {
                      for (uint32_t i = 0; i < 3 + (w.lane() == 5 ? 1u : 0u); ++i) w.ballot(i % 2 == 0);
                    }),
                    test::WarpDivergence);
  // An exception in a lane reaches the caller, and the emulator stays usable after it.
  BOOST_CHECK_THROW(test::run_warp([](const EmulatedWarp& w) {
                      w.ballot(true);
                      if (w.lane() == 9) throw CodecError("lane 9");
                      w.ballot(false);
                    }),
                    CodecError);
  uint32_t seen = 0;
  test::run_warp([&](const EmulatedWarp& w) {
    const uint32_t b = w.ballot(w.lane() % 2 == 0);
    if (w.lane() == 0) seen = b;
  });
  BOOST_TEST(seen == 0x55555555u);
}

// ---------------------------------------------------------------------------------------
// Job tables.

BOOST_AUTO_TEST_CASE(codec_tables_split_in_order_and_find_every_work_item) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    const size_t n = 64 * 3 + 1 + rng() % 40;
    std::vector<Job> jobs;
    for (size_t i = 0; i < n; ++i) {
      const QuantParams p{1 + static_cast<int>(rng() % 8), kBuckets[rng() % std::size(kBuckets)],
                          rng() % 2 ? Rounding::kStochastic : Rounding::kNearest};
      jobs.push_back(make_job(p, rng() % 4 == 0 ? 0 : 1 + rng() % 50000, static_cast<uint32_t>(rng() % 500), rng));
      jobs.back().element_offset = rng() % 1000000;
      jobs.back().byte_offset = 4 * (rng() % 1000000);
    }
    const std::vector<warp::JobTable> tables = quant::cuda::codec_tables(jobs, "test");
    size_t next = 0;  // the next non-empty job
    for (const warp::JobTable& t : tables) {
      BOOST_TEST_REQUIRE(t.count >= 1u);
      BOOST_TEST_REQUIRE(t.count <= warp::kMaxJobsPerLaunch);
      uint32_t work = 0;
      for (uint32_t k = 0; k < t.count; ++k) {
        while (jobs[next].count == 0) ++next;  // empty jobs are dropped
        const Job& j = jobs[next++];
        const warp::KernelJob& kj = t.jobs[k];
        BOOST_TEST_INFO_SCOPE("table job " << k);
        BOOST_TEST_REQUIRE(kj.work_begin == work);
        BOOST_TEST_REQUIRE(kj.element_offset == j.element_offset);
        BOOST_TEST_REQUIRE(kj.byte_offset == j.byte_offset);
        BOOST_TEST_REQUIRE(kj.count == j.count);
        BOOST_TEST_REQUIRE(uint64_t{kj.first_bucket} * j.params.bucket == j.first_element);
        BOOST_TEST_REQUIRE(kj.layer == j.layer);
        BOOST_TEST_REQUIRE(kj.bucket == j.params.bucket);
        BOOST_TEST_REQUIRE(int{kj.bits} == j.params.bits);
        BOOST_TEST_REQUIRE((kj.stochastic != 0) == (j.params.rounding == Rounding::kStochastic));
        BOOST_TEST_REQUIRE(warp::bucket_count_of(kj) == quant::bucket_count(j.params, j.count));
        work += static_cast<uint32_t>(warp::bucket_count_of(kj));
      }
      BOOST_TEST_REQUIRE(t.total_work == work);
      // find_job against a linear scan, for every work item.
      uint32_t owner = 0;
      for (uint32_t w = 0; w < t.total_work; ++w) {
        while (owner + 1 < t.count && t.jobs[owner + 1].work_begin <= w) ++owner;
        BOOST_TEST_REQUIRE(warp::find_job(t, w) == owner);
      }
    }
    while (next < n && jobs[next].count == 0) ++next;
    BOOST_TEST(next == n);  // every non-empty job is in a table
    BOOST_TEST(tables.size() >= 3u);
  }
}

BOOST_AUTO_TEST_CASE(codec_tables_split_before_work_items_overflow) {
  // Four jobs of 2^29 buckets each (a layer's maximum at bucket 32): a table holds fewer
  // than 2^31 work items, so the fourth starts a new one.
  std::vector<Job> jobs(4);
  for (Job& j : jobs) {
    j.count = kMaxLayerElements;
    j.params = QuantParams{4, 32, Rounding::kNearest};
  }
  const auto tables = quant::cuda::codec_tables(jobs, "test");
  BOOST_TEST_REQUIRE(tables.size() == 2u);
  BOOST_TEST(tables[0].count == 3u);
  BOOST_TEST(tables[1].count == 1u);
  for (const warp::JobTable& t : tables) BOOST_TEST(uint64_t{t.total_work} < (uint64_t{1} << 31));
  BOOST_TEST(warp::find_job(tables[0], 3u << 29) == 2u);
  BOOST_TEST(warp::find_job(tables[0], (3u << 29) - 1) == 2u);
  BOOST_TEST(warp::find_job(tables[0], (2u << 29) - 1) == 1u);
}

BOOST_AUTO_TEST_CASE(jobs_before_an_arrays_first_element_are_codec_errors) {
  std::vector<Job> jobs(3);
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].count = 100;
    jobs[i].element_offset = 1000 * (i + 1);
  }
  jobs[2].element_offset = 10;
  EncodeBatch e;
  e.jobs = jobs;
  e.input_first = 500;
  BOOST_CHECK_EXCEPTION(quant::cuda::encode_args(e, "enc"), CodecError, [](const CodecError& x) {
    return std::string(x.what()).find("enc: job 2: element offset 10 is before input's first element 500") !=
           std::string::npos;
  });
  e.input_first = 10;
  e.residual_first = 11;
  BOOST_CHECK_NO_THROW(quant::cuda::encode_args(e, "enc"));  // no residual: its first does not matter
  float r = 0.0f;
  e.residual = &r;
  BOOST_CHECK_THROW(quant::cuda::encode_args(e, "enc"), CodecError);
  DecodeBatch d;
  d.jobs = jobs;
  d.output_first = 11;
  BOOST_CHECK_THROW(quant::cuda::decode_args(d, "dec"), CodecError);
  jobs[2].count = 0;  // empty jobs address nothing
  BOOST_CHECK_NO_THROW(quant::cuda::decode_args(d, "dec"));
}

BOOST_AUTO_TEST_CASE(bad_jobs_are_codec_errors_naming_the_job) {
  std::vector<Job> jobs(3);
  for (Job& j : jobs) j.count = 100, j.params = QuantParams{4, 64, Rounding::kNearest};
  const auto tables = [&] { return quant::cuda::codec_tables(jobs, "quant cuda encode"); };
  BOOST_TEST_REQUIRE(tables().size() == 1u);

  jobs[2].first_element = 96;  // not a multiple of 64
  BOOST_TEST(throws_naming(tables, "quant cuda encode: job 2"));
  BOOST_TEST(throws_naming(tables, "bucket boundary"));
  jobs[2].first_element = 128;
  jobs[1].count = kMaxLayerElements + 1;
  BOOST_TEST(throws_naming(tables, "job 1"));
  jobs[1].count = 64;
  jobs[1].first_element = kMaxLayerElements;  // first + count past 2^34
  BOOST_TEST(throws_naming(tables, "job 1"));
  jobs[1].first_element = kMaxLayerElements - 64;  // exactly 2^34: allowed
  BOOST_TEST(tables().size() == 1u);
  jobs[0].byte_offset = 6;
  BOOST_TEST(throws_naming(tables, "job 0"));
  jobs[0].byte_offset = 8;
  for (const QuantParams bad : {QuantParams{0, 64, Rounding::kNearest}, QuantParams{9, 64, Rounding::kNearest},
                                QuantParams{4, 48, Rounding::kNearest}, QuantParams{4, 0, Rounding::kNearest}}) {
    jobs[2].params = bad;
    jobs[2].first_element = 0;
    BOOST_TEST(throws_naming(tables, "job 2"));
  }
  jobs[2].params = QuantParams{4, 64, Rounding::kNearest};
  // An empty job is checked too.
  jobs[0].count = 0;
  jobs[0].first_element = 1;
  BOOST_TEST(throws_naming(tables, "job 0"));
  jobs[0].first_element = 0;
  BOOST_TEST(tables().size() == 1u);
  BOOST_TEST(tables()[0].count == 2u);

  // Statistics: every candidate's bucket boundary, at most 16 candidates.
  std::vector<CodecSpec> cand = specs({"none", "quant:bits=2,bucket=64", "quant:bits=3,bucket=96"});
  const auto launches = [&] { return quant::cuda::stats_launches(jobs, cand, "quant cuda squared_errors"); };
  jobs[1].first_element = 192;
  BOOST_TEST(launches().size() == 2u);
  jobs[1].first_element = 64;  // a multiple of 64, not of 96
  BOOST_TEST(throws_naming(launches, "quant cuda squared_errors: job 1"));
  jobs[1].first_element = 0;
  cand.assign(17, CodecSpec::parse("quant:bits=3"));
  BOOST_TEST(throws_naming(launches, "17 candidates"));
  cand.resize(16);
  BOOST_TEST(launches().size() == 1u);
}

BOOST_AUTO_TEST_CASE(stats_launches_group_candidates_by_bucket) {
  std::mt19937_64 rng(test::run_seed());
  const std::vector<CodecSpec> cand =
      specs({"quant:bits=4,bucket=1024", "none", "quant:bits=2,bucket=64,rounding=nearest", "quant:bits=8,bucket=1024",
             "none", "quant:bits=3,bucket=4128"});
  std::vector<Job> jobs;
  for (int i = 0; i < 80; ++i) {
    Job j;
    j.count = i % 10 == 3 ? 0 : 1 + rng() % 10000;
    j.first_element = 132096 * (rng() % 10);  // lcm(1024, 64, 4128)
    j.layer = static_cast<uint32_t>(rng() % 7);
    jobs.push_back(j);
  }
  const auto launches = quant::cuda::stats_launches(jobs, cand, "test");
  BOOST_TEST_REQUIRE(launches.size() == 3u);
  const uint32_t want_buckets[] = {64, 1024, 4128};
  std::vector<int> seen(cand.size(), 0);
  uint64_t scratch = 0;
  for (size_t l = 0; l < 3; ++l) {
    const auto& launch = launches[l];
    BOOST_TEST(launch.bucket == want_buckets[l]);
    BOOST_TEST(launch.has_quant);
    BOOST_TEST_REQUIRE(launch.columns.size() == launch.candidates.size());
    for (size_t k = 0; k < launch.candidates.size(); ++k) {
      const CodecSpec& spec = cand[launch.columns[k]];
      ++seen[launch.columns[k]];
      if (spec.family() == CodecFamily::kNone) {
        BOOST_TEST(l == 0u);  // `none` rides along the first launch
        BOOST_TEST(launch.candidates[k].bits == 0);
      } else {
        BOOST_TEST(spec.quant_params().bucket == launch.bucket);
        BOOST_TEST(int{launch.candidates[k].bits} == spec.quant_params().bits);
        BOOST_TEST((launch.candidates[k].stochastic != 0) ==
                   (spec.quant_params().rounding == Rounding::kStochastic));
      }
    }
    uint64_t work = 0;
    for (const warp::JobTable& t : launch.tables) {
      BOOST_TEST(t.count <= warp::kMaxJobsPerLaunch);
      for (uint32_t k = 0; k < t.count; ++k) {
        BOOST_TEST(t.jobs[k].bucket == launch.bucket);
        BOOST_TEST(t.jobs[k].bits == 0);
      }
      work += t.total_work;
      scratch = std::max<uint64_t>(scratch, uint64_t{t.total_work} * launch.candidates.size() * sizeof(double));
    }
    uint64_t want_work = 0;
    for (const Job& j : jobs) want_work += (j.count + launch.bucket - 1) / launch.bucket;
    BOOST_TEST(work == want_work);
    BOOST_TEST(launch.tables.size() == 2u);  // 72 non-empty jobs
  }
  for (int s : seen) BOOST_TEST(s == 1);  // every candidate measured exactly once
  BOOST_TEST(quant::cuda::stats_scratch_bytes(launches) == scratch);

  // Only `none`: one launch of the default bucket, no quant, any first element.
  jobs[0].first_element = 7;
  const auto none_only = quant::cuda::stats_launches(jobs, specs({"none"}), "test");
  BOOST_TEST_REQUIRE(none_only.size() == 1u);
  BOOST_TEST(!none_only[0].has_quant);
  BOOST_TEST(none_only[0].bucket == QuantParams{}.bucket);
}

// ---------------------------------------------------------------------------------------
// Encode.

BOOST_AUTO_TEST_CASE(encode_matches_the_reference_byte_for_byte) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    size_t k = rng();  // where the cycle of edge counts starts
    for (DType dtype : kDTypes)
      for (bool residual : {false, true})
        for (uint32_t bucket : kBuckets) {
          // One job per bit width (so every width meets every bucket, type and residual),
          // each rounding at random, several jobs per layer.
          Batch b;
          int bits[8];
          std::iota(std::begin(bits), std::end(bits), 1);
          std::shuffle(std::begin(bits), std::end(bits), rng);
          for (int width : bits) {
            const QuantParams p{width, bucket, rng() % 2 ? Rounding::kStochastic : Rounding::kNearest};
            b.jobs.push_back(make_job(p, pick_count(bucket, k++, rng), static_cast<uint32_t>(rng() % 3), rng));
          }
          lay_out(b, rng);
          BOOST_TEST_INFO_SCOPE("bucket " << bucket);
          check_encode(b, dtype, residual, residual && rng() % 2, 0.2, rng);
        }
  }
}

BOOST_AUTO_TEST_CASE(encode_batches_of_many_jobs_and_layers) {
  // More than 64 jobs (several tables), mixed parameters, layers whose residual is
  // skipped, element offsets of every alignment.
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (DType dtype : kDTypes) {
      const Batch b = random_batch(100, 1200, rng, 20);
      BOOST_TEST_REQUIRE(quant::cuda::codec_tables(b.jobs, "test").size() >= 2u);
      check_encode(b, dtype, true, true, 0.1, rng);
      check_encode(b, dtype, false, false, 0.1, rng);
    }
  }
}

BOOST_AUTO_TEST_CASE(encode_non_finite_buckets) {
  // NaN, infinities and overflowing ranges in many buckets, in the input and in the
  // residual: metadata NaN, codes 0, residual kept, and the counter.
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    uint64_t seen = 0;
    for (DType dtype : kDTypes)
      for (bool residual : {false, true}) {
        const Batch b = random_batch(12, 6000, rng, 4);
        seen += check_encode(b, dtype, residual, residual, 1.0, rng);
      }
    BOOST_TEST(seen > 0u);
  }
}

// ---------------------------------------------------------------------------------------
// Decode.

BOOST_AUTO_TEST_CASE(decode_and_decode_accumulate_match_the_reference) {
  std::mt19937_64 rng(test::run_seed());
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (int round = 0; round < 2; ++round) {
      for (DType t : kDTypes) {
        const Batch b = random_batch(round == 0 ? 20 : 100, round == 0 ? 20000 : 2000, rng, 8);
        check_decode(b, t, false, rng);
      }
      const Batch b = random_batch(round == 0 ? 20 : 100, round == 0 ? 20000 : 2000, rng, 8);
      check_decode(b, DType::kFloat32, true, rng);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Statistics.

// The tolerance: see StatsTolerance and slack().
constexpr StatsTolerance kStatsTolerance{1e-4, 1.0};

void report(const char* what, const Worst& w) {
  BOOST_TEST_MESSAGE("quant_warp " << what << ": largest relative difference none " << w.none << ", nearest "
                                   << w.nearest << ", stochastic " << w.stochastic << "; "
                                   << w.beyond_relative << " of " << w.compared
                                   << " comparisons beyond the relative term, using up to " << w.slack_used
                                   << " of their slack");
}

BOOST_AUTO_TEST_CASE(stats_match_measure_candidates) {
  std::mt19937_64 rng(test::run_seed());
  const std::vector<std::vector<CodecSpec>> sets = {
      // The controller's usual set: none and quant bits 2..8 (bucket 1024, stochastic).
      specs({"none", "quant:bits=2", "quant:bits=3", "quant:bits=4", "quant:bits=5", "quant:bits=6", "quant:bits=7",
             "quant:bits=8"}),
      // Mixed buckets and roundings, several launches.
      specs({"quant:bits=4,bucket=64,rounding=nearest", "none", "quant:bits=2,bucket=96",
             "quant:bits=8,bucket=4128,rounding=nearest", "quant:bits=1,bucket=32", "quant:bits=6,bucket=2048",
             "quant:bits=3,bucket=96,rounding=nearest"}),
      // Sixteen candidates: the larger register capacity.
      specs({"quant:bits=1,rounding=nearest", "quant:bits=2,rounding=nearest", "quant:bits=3,rounding=nearest",
             "quant:bits=4,rounding=nearest", "quant:bits=5,rounding=nearest", "quant:bits=6,rounding=nearest",
             "quant:bits=7,rounding=nearest", "quant:bits=8,rounding=nearest", "quant:bits=1", "quant:bits=2",
             "quant:bits=3", "quant:bits=4", "quant:bits=5", "quant:bits=6", "quant:bits=7", "none"}),
      // `none` alone: a launch of its own.
      specs({"none"}),
  };
  Worst worst;
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (size_t s = 0; s < sets.size(); ++s)
      for (DType dtype : kDTypes)
        for (bool residual : {false, true}) {
          BOOST_TEST_INFO_SCOPE("candidate set " << s);
          // Buckets of 32..96 cost the emulator a few collectives per element: fewer elements.
          const Batch b = stats_batch(sets[s], 10, s == 1 ? 3000 : 12000, 4, rng);
          check_stats(b, sets[s], make_data(b, dtype, residual, 0.0, rng), residual, kStatsTolerance, worst, rng);
        }
  }
  report("statistics", worst);
}

// The engine's CUDA backend measures quantization candidates into a table whose rows also
// hold other families' columns: each candidate's sum lands in its given column, the same
// bits as without the mapping, and the other columns stay as they were.
BOOST_AUTO_TEST_CASE(stats_write_into_the_callers_columns) {
  std::mt19937_64 rng(test::run_seed());
  const std::vector<CodecSpec> cand = specs({"quant:bits=3", "none", "quant:bits=6,bucket=64,rounding=nearest"});
  const Batch b = stats_batch(cand, 6, 5000, 3, rng);
  const Data data = make_data(b, DType::kFloat32, true, 0.0, rng);
  StatsBatch batch;
  batch.jobs = b.jobs;
  batch.candidates = cand;
  batch.input = data.input.data();
  batch.residual = data.residual.data();
  batch.weight = 0.5;
  std::vector<uint8_t> nonfinite(b.layers, 0);
  batch.nonfinite = nonfinite.data();
  const uint32_t stride = 7;
  const std::vector<uint32_t> columns = {5, 0, 3};
  std::vector<double> mapped(b.layers * stride);
  for (double& v : mapped) v = std::uniform_real_distribution<double>(1.0, 2.0)(rng);  // added to, not replaced
  const std::vector<double> before = mapped;
  // The same additions in the same order onto the same starting values, column by column.
  std::vector<double> plain(b.layers * cand.size());
  for (uint32_t l = 0; l < b.layers; ++l)
    for (size_t c = 0; c < cand.size(); ++c) plain[l * cand.size() + c] = before[l * stride + columns[c]];
  batch.squared = plain.data();
  emulate_stats(batch);
  batch.columns = columns;
  batch.row_stride = stride;
  batch.squared = mapped.data();
  emulate_stats(batch);
  for (uint32_t l = 0; l < b.layers; ++l)
    for (uint32_t col = 0; col < stride; ++col) {
      const auto it = std::find(columns.begin(), columns.end(), col);
      const double want = it == columns.end() ? before[l * stride + col] : plain[l * cand.size() + (it - columns.begin())];
      BOOST_TEST_INFO_SCOPE("layer " << l << " column " << col);
      BOOST_TEST(mapped[l * stride + col] == want);
    }

  const auto launches = quant::cuda::stats_launches(b.jobs, cand, "test");
  const auto output = [&] { return quant::cuda::stats_output(batch, launches.front(), "quant cuda squared_errors"); };
  const std::vector<uint32_t> too_few = {1, 2}, too_wide = {1, 7, 2}, shared = {4, 2, 4};
  batch.columns = too_few;
  BOOST_TEST(throws_naming(output, "3 candidates but 2 columns"));
  batch.columns = too_wide;
  BOOST_TEST(throws_naming(output, "candidate 1's column 7 is not below the row stride 7"));
  batch.columns = shared;
  BOOST_TEST(throws_naming(output, "candidates 0 and 2 share column 4"));
}

BOOST_AUTO_TEST_CASE(stats_non_finite_inputs) {
  std::mt19937_64 rng(test::run_seed());
  const std::vector<std::vector<CodecSpec>> sets = {
      specs({"none", "quant:bits=2", "quant:bits=4,rounding=nearest", "quant:bits=8"}),
      specs({"none", "quant:bits=3,bucket=32", "quant:bits=5,bucket=2048,rounding=nearest"}),
      specs({"none"}),
  };
  Worst worst;
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    bool seen = false;
    for (size_t s = 0; s < sets.size(); ++s)
      for (DType dtype : kDTypes)
        for (bool residual : {false, true}) {
          BOOST_TEST_INFO_SCOPE("candidate set " << s);
          // Many layers, so that some stay finite next to the ones that are not.
          const Batch b = stats_batch(sets[s], 12, s == 1 ? 2000 : 5000, 8, rng);
          seen = check_stats(b, sets[s], make_data(b, dtype, residual, 0.4, rng), residual, kStatsTolerance, worst,
                             rng) ||
                 seen;
        }
    BOOST_TEST(seen);
  }
  report("statistics with non-finite inputs", worst);
}

BOOST_AUTO_TEST_CASE(stats_of_tiny_values) {
  // Layers of values so small that a bucket's unit is subnormal (its reciprocal overflows
  // float32) or the values themselves are: errors far below float32's range, which must
  // come out finite (not NaN) and agree within the slack.
  std::mt19937_64 rng(test::run_seed());
  Worst worst;
  const std::vector<CodecSpec> cand = specs({"none", "quant:bits=2", "quant:bits=5", "quant:bits=8",
                                             "quant:bits=3,bucket=64,rounding=nearest", "quant:bits=8,rounding=nearest"});
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16})  // float16 has none of these values
      for (bool residual : {false, true}) {
        Batch b;
        for (uint32_t layer = 0; layer < 3; ++layer) {
          b.jobs.push_back(make_job(QuantParams{4, 1024, Rounding::kNearest}, 1000 + rng() % 5000, layer, rng));
          b.jobs.back().first_element = 1024 * (rng() % 100);
        }
        lay_out(b, rng);
        Data data = make_data(b, dtype, residual, 0.0, rng);
        const float scale[] = {1e-38f, 1e-40f, 1.0f};  // unit subnormal; values subnormal; a normal layer
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (uint32_t layer = 0; layer < 3; ++layer) {
          const Job& j = b.jobs[layer];
          for (uint64_t i = j.element_offset; i < j.element_offset + j.count; ++i) {
            data.input.set(i, normal(rng) * scale[layer]);
            if (residual) data.residual[i] = 0.01f * normal(rng) * scale[layer];
          }
        }
        check_stats(b, cand, data, residual, kStatsTolerance, worst, rng);
      }
  }
  report("statistics of tiny values", worst);
}

BOOST_AUTO_TEST_CASE(stats_of_huge_values) {
  // A lone +-3e38 among ordinary values: every value and the range are finite, but unit^2
  // overflows float32 (unit above ~1.8e19). Both sides scale by unit^2 in float64, so the
  // errors must come out finite (not +inf, not 0 x inf = NaN) and agree.
  std::mt19937_64 rng(test::run_seed());
  Worst worst;
  const std::vector<CodecSpec> cand = specs({"none", "quant:bits=2", "quant:bits=8", "quant:bits=1,rounding=nearest",
                                             "quant:bits=8,rounding=nearest"});
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (bool residual : {false, true}) {
      Batch b;
      for (uint32_t layer = 0; layer < 2; ++layer) {
        b.jobs.push_back(make_job(QuantParams{4, 1024, Rounding::kNearest}, 3000 + rng() % 3000, layer, rng));
        b.jobs.back().first_element = 1024 * (rng() % 100);
      }
      lay_out(b, rng);
      Data data = make_data(b, DType::kFloat32, residual, 0.0, rng);
      for (const Job& j : b.jobs)
        for (uint64_t at = 0; at < j.count; at += 2048) data.input.set(j.element_offset + at + rng() % std::min<uint64_t>(1024, j.count - at), rng() % 2 ? 3e38f : -3e38f);
      check_stats(b, cand, data, residual, kStatsTolerance, worst, rng);
      for (const Job& j : b.jobs) {
        const CandidateReport want = measure_candidates(cand, DType::kFloat32, Slice{data.input.at(j.element_offset), j.count, 0},
                                                        residual ? data.residual.data() + j.element_offset : nullptr);
        BOOST_TEST(want.nonfinite_buckets == 0u);
        for (const CandidateError& e : want.candidates) BOOST_TEST(std::isfinite(e.squared_error));
      }
    }
  }
  report("statistics of huge values", worst);
}

BOOST_AUTO_TEST_CASE(stats_layers_whose_range_overflows) {
  // A finite range that overflows float32 makes a layer non-finite for `quant`, not for
  // `none` (docs/KERNELS.md): layer 0 has only such a bucket, layer 1 a NaN, layer 2
  // nothing, each with `none` measured alone and next to quant candidates.
  std::mt19937_64 rng(test::run_seed());
  Worst worst;
  BOOST_TEST_CONTEXT("run seed " << test::run_seed()) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16})  // float16 has no 3e38
      for (bool residual : {false, true})
        for (const auto& cand : {specs({"none", "quant:bits=4", "quant:bits=2,bucket=64,rounding=nearest"}),
                                 specs({"none"})}) {
          Batch b;
          for (uint32_t layer = 0; layer < 3; ++layer) {
            b.jobs.push_back(make_job(QuantParams{4, 1024, Rounding::kNearest}, 3000 + rng() % 3000, layer, rng));
            b.jobs.back().first_element = 1024 * (rng() % 100);
          }
          lay_out(b, rng);
          Data data = make_data(b, dtype, residual, 0.0, rng);
          const uint64_t at0 = b.jobs[0].element_offset + 32 * (rng() % 90);  // one group: one bucket of every size
          data.input.set(at0 + rng() % 16, -3e38f);
          data.input.set(at0 + 16 + rng() % 16, 3e38f);
          data.input.set(b.jobs[1].element_offset + rng() % 3000, std::numeric_limits<float>::quiet_NaN());
          check_stats(b, cand, data, residual, kStatsTolerance, worst, rng);
          // What check_stats compared against, spelled out: the flags of the reference.
          std::vector<uint8_t> flags(3, 0);
          for (uint32_t layer = 0; layer < 3; ++layer) {
            const Job& j = b.jobs[layer];
            flags[layer] = measure_candidates(cand, dtype, Slice{data.input.at(j.element_offset), j.count, 0},
                                              residual ? data.residual.data() + j.element_offset : nullptr)
                                   .nonfinite_buckets > 0;
          }
          BOOST_TEST(flags[0] == (cand.size() > 1 ? 1 : 0));
          BOOST_TEST(flags[1] == 1);
          BOOST_TEST(flags[2] == 0);
        }
  }
}

BOOST_AUTO_TEST_SUITE_END()
