// lgreco-gpu-topk-check: the CUDA kernels of the TopK codec (kernels/topk_cuda.h) on a real
// GPU, against the CPU reference (kernels/topk.h), and their speed.
//
//   --check [--quick]  parity on fresh random inputs of every element type: encode payloads,
//                      residuals and the non-finite counter, decode (every output type) and
//                      decode-accumulate byte for byte; the error statistics within
//                      kStatsRelTolerance. Sizes 1, 31, 1000, 4097, ~1e5, 1e6 and 1e7;
//                      densities 1e-9 to 1; ties (many equal magnitudes, all zeros: the
//                      selection's fallback over the full data), NaN and infinities in the
//                      input and the residual, skipped residuals, batches of many jobs
//                      (several launch tables) with gaps that must stay poisoned, the same
//                      calls captured into a CUDA graph and replayed on new data, argument
//                      errors thrown before any launch. Outputs and the scratch are poisoned
//                      before every call. One PASS/FAIL line per check, a SUMMARY line and a
//                      RESULT line last. --quick: sizes up to ~1e5 (for compute-sanitizer).
//   --bench            encode of --count (1e8) float32 values at densities 0.01 and 0.001
//                      (and, for information, with error feedback, bfloat16, decode,
//                      decode-accumulate and the statistics), timed with CUDA events one call
//                      at a time: the median of --reps (21) calls after warm-up; one line per
//                      case, a TARGET line for the issue's target (encode of 1e8 float32 at
//                      density 0.01 in <= 0.5 ms on an H200; torch.topk took 2.2 ms).
//   --info             the device, and one small encode (a trivial run, e.g. to see that
//                      compute-sanitizer works on this machine).
//
// Built only when nvcc is found (Makefile); it needs a GPU and is run by tests/gpu/run.sh
// (section families). Exit status: 0 every check passed, 1 a check or a CUDA call failed,
// 2 usage error or no CUDA device, 3 the --time-limit ran out.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "config/version.h"
#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/slice.h"
#include "kernels/topk.h"
#include "kernels/topk_cuda.h"
#include "tests/gpu/check_util.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

namespace tc = topk::cuda;
using namespace gpu_check;

constexpr char kProgram[] = "lgreco-gpu-topk-check";

// How far the GPU's statistics may be from the CPU's, relative: both add the same exact
// float64 squares, in different orders (the CPU in sorted order, the GPU per tile and bin).
constexpr double kStatsRelTolerance = 1e-9;
constexpr uint8_t kPoisonByte = 0xA5;
// The non-finite counter starts here: the kernels must add to it, not overwrite it.
constexpr unsigned long long kCounterStart = 1000003;
// The target of the TopK kernels' issue, and what torch.topk took (docs/DESIGN.md).
constexpr double kTargetMs = 0.5;
constexpr double kTorchTopkMs = 2.2;

// ---------------------------------------------------------------------------------------
// CUDA helpers

void poison(const DeviceBuffer& d, const CudaStream& s) {
  LGRECO_CUDA_CHECK(cudaMemsetAsync(d.get(), kPoisonByte, std::max<uint64_t>(d.size(), 1), s.get()));
}

std::optional<cudaDeviceProp> open_device(int device) {
  if (!tc::available()) {
    fprintf(stderr, "%s: this build of lgreco has no CUDA kernels (nvcc was not found at build time)\n", kProgram);
    return std::nullopt;
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    fprintf(stderr, "%s: no CUDA device (%s); this program runs the kernels and needs a GPU\n", kProgram,
            e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
    return std::nullopt;
  }
  if (device < 0 || device >= count) {
    fprintf(stderr, "%s: --device %d: this machine has %d CUDA device(s)\n", kProgram, device, count);
    return std::nullopt;
  }
  const DeviceFacts d = use_device(device);
  const cudaDeviceProp& prop = d.prop;
  printf("# device %d: %s, compute capability %d.%d, %d SMs, %.1f GiB; %s; lgreco %s; %s\n", device, prop.name,
         prop.major, prop.minor, prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1 << 30),
         d.versions().c_str(), version_string(), bench::utc_now().c_str());
  return prop;
}

// ---------------------------------------------------------------------------------------
// Results

class Report {
 public:
  void check(bool ok, const char* kind, const std::string& name, const std::string& detail) {
    printf("%s %-10s %s: %s\n", ok ? "PASS" : "FAIL", kind, name.c_str(), detail.c_str());
    if (ok) {
      ++passed_;
    } else {
      ++failed_;
      if (failures_.size() < 12) failures_.push_back(std::string(kind) + " " + name + ": " + detail.substr(0, 200));
    }
  }
  void stats_difference(double relative) { worst_stats_ = std::max(worst_stats_, relative); }
  int passed() const { return passed_; }
  int failed() const { return failed_; }
  double worst_stats() const { return worst_stats_; }
  const std::vector<std::string>& failures() const { return failures_; }

 private:
  int passed_ = 0, failed_ = 0;
  double worst_stats_ = 0.0;
  std::vector<std::string> failures_;
};

// "" when equal, else how many `width`-byte elements differ and the first few.
std::string differences(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, uint32_t width,
                        const std::function<std::string(uint64_t)>& where) {
  if (got.size() != want.size()) return strf("%zu bytes came back, %zu expected", got.size(), want.size());
  uint64_t count = 0;
  std::string first;
  for (uint64_t i = 0; i < got.size() / width; ++i) {
    if (memcmp(got.data() + i * width, want.data() + i * width, width) == 0) continue;
    if (count++ < 3) {
      uint32_t g = 0, w = 0;
      memcpy(&g, got.data() + i * width, width);
      memcpy(&w, want.data() + i * width, width);
      const int digits = static_cast<int>(2 * width);
      first += strf("; at %s: GPU 0x%0*x, CPU 0x%0*x", where(i).c_str(), digits, g, digits, w);
    }
  }
  if (count == 0) return "";
  return strf("%s of %s elements differ", cli::thousands(count).c_str(), cli::thousands(got.size() / width).c_str()) + first;
}

// ---------------------------------------------------------------------------------------
// Inputs

enum class Dist { kNormal, kHeavy, kTies, kZeros, kSparse, kTiny, kCluster, kConstant };
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavy: return "heavy-tailed";
    case Dist::kTies: return "ties";
    case Dist::kZeros: return "zeros";
    case Dist::kSparse: return "sparse";
    case Dist::kTiny: return "subnormal";
    case Dist::kCluster: return "cluster";
    case Dist::kConstant: return "constant";
  }
  return "?";
}
Dist random_dist(Rng& rng) {
  const uint64_t x = below(rng, 100);
  if (x < 40) return Dist::kNormal;
  if (x < 50) return Dist::kHeavy;
  if (x < 60) return Dist::kTies;
  if (x < 66) return Dist::kZeros;
  if (x < 76) return Dist::kSparse;
  if (x < 82) return Dist::kTiny;
  if (x < 94) return Dist::kCluster;
  return Dist::kConstant;
}

// Values of one job, as float32 before narrowing to the element type.
void draw(Dist d, float* out, uint64_t n, Rng& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> student(1.5f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const float scale = static_cast<float>(std::pow(10.0, -3.0 + 4.0 * uniform(rng)));
  static constexpr float kLevels[] = {0.0f, 0.25f, 0.5f, 1.0f, -0.5f, -1.0f, -0.0f};
  for (uint64_t i = 0; i < n; ++i) {
    switch (d) {
      case Dist::kNormal: out[i] = scale * normal(rng); break;
      case Dist::kHeavy: out[i] = scale * student(rng); break;
      case Dist::kTies: out[i] = kLevels[rng() % 7]; break;
      case Dist::kZeros: out[i] = rng() % 2 ? 0.0f : -0.0f; break;
      case Dist::kSparse: out[i] = rng() % 10 == 0 ? scale * normal(rng) : 0.0f; break;
      case Dist::kTiny: out[i] = static_cast<float>(1e-40 * normal(rng)); break;
      case Dist::kCluster: {
        const float v = bits_float(float_bits(scale) + static_cast<uint32_t>(rng() % 3000));
        out[i] = rng() % 2 ? v : -v;
        break;
      }
      case Dist::kConstant: out[i] = scale; break;
    }
  }
}

constexpr uint32_t kSpecials[] = {0x7fc00000u, 0xffc12345u, 0x7f800001u, 0x7f800000u, 0xff800000u};

enum class Feedback { kNone, kResidual, kSkips };
const char* feedback_name(Feedback f) {
  return f == Feedback::kNone ? "no residual" : f == Feedback::kResidual ? "residual" : "residual, some layers skipped";
}

struct JobSpec {
  uint64_t count;
  uint32_t ppb;
  Dist dist;
  bool specials = false;
};

struct Case {
  std::string name;
  DType dtype = DType::kFloat32;
  Feedback feedback = Feedback::kNone;
  std::vector<tc::Job> jobs;
  uint64_t elements = 0;
  uint64_t payload_bytes = 0;
  uint32_t layers = 1;
  std::vector<uint8_t> input;
  std::vector<float> residual;
  std::vector<uint8_t> skip;
};

uint64_t total_count(const Case& c) {
  uint64_t n = 0;
  for (const tc::Job& j : c.jobs) n += j.count;
  return n;
}

Case make_case(std::string name, DType dtype, Feedback feedback, const std::vector<JobSpec>& specs, Rng& rng) {
  Case c;
  c.dtype = dtype;
  c.feedback = feedback;
  uint64_t e = below(rng, 5), b = 4 * below(rng, 3);
  for (size_t i = 0; i < specs.size(); ++i) {
    tc::Job job;
    job.element_offset = e;
    job.count = specs[i].count;
    job.byte_offset = b;
    job.layer = static_cast<uint32_t>(i % 7);
    job.params = TopkParams{specs[i].ppb};
    c.jobs.push_back(job);
    c.layers = std::max(c.layers, job.layer + 1);
    e += job.count + (chance(rng, 0.5) ? below(rng, 9) : 0);
    b += topk::encoded_bytes(job.params, job.count) + (chance(rng, 0.5) ? 4 * below(rng, 3) : 0);
  }
  c.elements = e + 1 + below(rng, 8);
  c.payload_bytes = b + 4 * (1 + below(rng, 4));
  const size_t width = dtype_size(dtype);
  c.input.assign(c.elements * width, 0);
  if (feedback != Feedback::kNone) c.residual.assign(c.elements, 0.0f);
  // The gaps between jobs hold values no kernel may read into a result.
  for (uint64_t i = 0; i < c.elements; ++i) store_from_float(c.input.data(), dtype, i, 1e30f);
  std::vector<float> values;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < specs.size(); ++i) {
    const tc::Job& job = c.jobs[i];
    values.resize(job.count);
    draw(specs[i].dist, values.data(), job.count, rng);
    for (uint64_t k = 0; k < job.count; ++k) store_from_float(c.input.data(), dtype, job.element_offset + k, values[k]);
    if (feedback != Feedback::kNone) {
      const bool keep_ties = specs[i].dist != Dist::kNormal && specs[i].dist != Dist::kHeavy;
      for (uint64_t k = 0; k < job.count; ++k)
        c.residual[job.element_offset + k] = keep_ties ? 0.0f : 0.01f * std::fabs(values[k]) * normal(rng);
    }
    if (specs[i].specials && job.count > 0) {
      const uint64_t n = 1 + below(rng, 5);
      for (uint64_t s = 0; s < n; ++s) {
        const uint64_t at = job.element_offset + below(rng, job.count);
        const uint32_t bits = kSpecials[below(rng, std::size(kSpecials))];
        if (feedback != Feedback::kNone && chance(rng, 0.3)) {
          memcpy(&c.residual[at], &bits, 4);
        } else if (feedback != Feedback::kNone && dtype != DType::kFloat16 && chance(rng, 0.3)) {
          store_from_float(c.input.data(), dtype, at, 3.0e38f);  // finite + finite = inf
          c.residual[at] = 3.0e38f;
        } else {
          store_from_float(c.input.data(), dtype, at, bits_float(bits));
        }
      }
    }
  }
  if (feedback == Feedback::kSkips) {
    c.skip.assign(c.layers, 0);
    for (uint8_t& s : c.skip) s = chance(rng, 0.5) ? 1 : 0;
  }
  c.name = strf("%s: %zu job%s, %s values, %s, %s", name.c_str(), c.jobs.size(), c.jobs.size() == 1 ? "" : "s",
                cli::thousands(total_count(c)).c_str(), dtype_name(dtype), feedback_name(feedback));
  return c;
}

// ---------------------------------------------------------------------------------------
// The CPU reference

struct Encoded {
  std::vector<uint8_t> payload;
  std::vector<uint8_t> residual;  // bytes of the float32 residual
  unsigned long long nonfinite = kCounterStart;
};

Encoded cpu_encode(const Case& c) {
  Encoded out;
  out.payload.assign(c.payload_bytes, kPoisonByte);
  std::vector<float> residual = c.residual;
  const size_t width = dtype_size(c.dtype);
  for (const tc::Job& job : c.jobs) {
    const bool skip = !c.skip.empty() && c.skip[job.layer] != 0;
    float* r = residual.empty() || skip ? nullptr : residual.data() + job.element_offset;
    const EncodeReport rep =
        topk::encode(job.params, c.dtype, Slice{c.input.data() + job.element_offset * width, job.count, 0}, r,
                     std::span<uint8_t>(out.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)));
    out.nonfinite += rep.nonfinite_buckets;
  }
  out.residual.resize(residual.size() * 4);
  if (!residual.empty()) memcpy(out.residual.data(), residual.data(), out.residual.size());
  return out;
}

std::string describe_payload(const Case& c, uint64_t word) {
  const uint64_t at = word * 4;
  for (size_t j = 0; j < c.jobs.size(); ++j) {
    const tc::Job& job = c.jobs[j];
    const uint64_t k = job.params.k(job.count);
    if (at < job.byte_offset || at >= job.byte_offset + 8 * k) continue;
    const uint64_t e = (at - job.byte_offset) / 4;
    return strf("job %zu (%llu values, k %llu), %s %llu", j, static_cast<ull>(job.count), static_cast<ull>(k),
                e < k ? "index" : "value", static_cast<ull>(e < k ? e : e - k));
  }
  return strf("payload byte %llu, a gap (must stay poisoned)", static_cast<ull>(at));
}

std::string describe_element(const Case& c, uint64_t i) {
  for (size_t j = 0; j < c.jobs.size(); ++j) {
    const tc::Job& job = c.jobs[j];
    if (i >= job.element_offset && i < job.element_offset + job.count)
      return strf("job %zu, element %llu", j, static_cast<ull>(i - job.element_offset));
  }
  return strf("element %llu, a gap", static_cast<ull>(i));
}

// ---------------------------------------------------------------------------------------
// One case on the GPU

struct DeviceCase {
  DeviceBuffer input, residual, skip, payload, counter, scratch;
  explicit DeviceCase(const Case& c)
      : input(c.input.size()),
        residual(c.residual.size() * 4),
        skip(c.skip.size()),
        payload(c.payload_bytes),
        counter(8),
        scratch(tc::encode_scratch_bytes(c.jobs)) {}
};

// Uploads the inputs, poisons the outputs and the scratch.
void prepare(const Case& c, const DeviceCase& d, const CudaStream& s) {
  upload(d.input, c.input.data(), c.input.size(), s);
  upload(d.residual, c.residual.data(), c.residual.size() * 4, s);
  upload(d.skip, c.skip.data(), c.skip.size(), s);
  upload(d.counter, &kCounterStart, 8, s);
  poison(d.payload, s);
  poison(d.scratch, s);
}

tc::EncodeBatch encode_batch(const Case& c, const DeviceCase& d) {
  tc::EncodeBatch b;
  b.jobs = c.jobs;
  b.input = d.input.get();
  b.input_dtype = c.dtype;
  b.residual = c.residual.empty() ? nullptr : reinterpret_cast<float*>(d.residual.get());
  b.skip_residual = c.skip.empty() ? nullptr : d.skip.get();
  b.payload = d.payload.get();
  b.nonfinite_values = reinterpret_cast<unsigned long long*>(d.counter.get());
  b.scratch = d.scratch.get();
  b.scratch_bytes = d.scratch.size();
  return b;
}

Encoded download_encoded(const Case& c, const DeviceCase& d, const CudaStream& s) {
  Encoded out;
  out.payload = download<uint8_t>(d.payload, c.payload_bytes, s);
  out.residual = download<uint8_t>(d.residual, c.residual.size() * 4, s);
  const std::vector<uint8_t> counter = download<uint8_t>(d.counter, 8, s);
  memcpy(&out.nonfinite, counter.data(), 8);
  return out;
}

// Compares an encode's outputs with the CPU's; true when all agree.
bool compare_encoded(Report& r, const char* kind, const Case& c, const Encoded& got, const Encoded& want) {
  bool ok = true;
  std::string d = differences(got.payload, want.payload, 4, [&](uint64_t w) { return describe_payload(c, w); });
  if (!d.empty()) {
    r.check(false, kind, c.name, "payload: " + d);
    ok = false;
  }
  d = differences(got.residual, want.residual, 4, [&](uint64_t i) { return describe_element(c, i); });
  if (!d.empty()) {
    r.check(false, kind, c.name, "residual: " + d);
    ok = false;
  }
  if (got.nonfinite != want.nonfinite) {
    r.check(false, kind, c.name,
            strf("non-finite counter %llu, CPU %llu (started at %llu)", got.nonfinite, want.nonfinite, kCounterStart));
    ok = false;
  }
  return ok;
}

void check_encode(Report& r, const Case& c, const DeviceCase& d, const CudaStream& s, const Encoded& want) {
  prepare(c, d, s);
  tc::encode(encode_batch(c, d), s.get());
  const Encoded got = download_encoded(c, d, s);
  if (compare_encoded(r, "encode", c, got, want))
    r.check(true, "encode", c.name,
            strf("payload, residual and non-finite counter (%llu) as the CPU's", want.nonfinite - kCounterStart));
}

void check_decode(Report& r, const Case& c, const Encoded& enc, const CudaStream& s, Rng& rng) {
  DeviceBuffer payload(c.payload_bytes), out(c.elements * 4);
  upload(payload, enc.payload.data(), c.payload_bytes, s);
  std::string details;
  bool ok = true;
  for (DType t : kDTypes) {
    const size_t width = dtype_size(t);
    std::vector<uint8_t> want(c.elements * width, kPoisonByte);
    for (const tc::Job& job : c.jobs)
      topk::decode(job.params,
                   std::span<const uint8_t>(enc.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)),
                   job.count, t, want.data() + job.element_offset * width);
    poison(out, s);
    tc::decode(tc::DecodeBatch{c.jobs, payload.get(), out.get(), t, 0}, s.get());
    const std::string d = differences(download<uint8_t>(out, want.size(), s), want, static_cast<uint32_t>(width),
                                      [&](uint64_t i) { return describe_element(c, i); });
    if (!d.empty()) {
      r.check(false, "decode", c.name, std::string("to ") + dtype_name(t) + ": " + d);
      ok = false;
    }
  }
  if (ok) r.check(true, "decode", c.name, "float32, float16 and bfloat16 outputs as the CPU's");
  // Accumulators: random, a NaN among them (its sum stays the canonical NaN).
  std::vector<float> acc(c.elements);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& a : acc) a = normal(rng);
  acc[below(rng, acc.size())] = bits_float(0x7fc00000u);
  std::vector<float> want = acc;
  for (const tc::Job& job : c.jobs)
    topk::decode_accumulate(job.params,
                            std::span<const uint8_t>(enc.payload.data() + job.byte_offset, topk::encoded_bytes(job.params, job.count)),
                            job.count, want.data() + job.element_offset);
  upload(out, acc.data(), acc.size() * 4, s);
  tc::decode_accumulate(tc::DecodeBatch{c.jobs, payload.get(), out.get(), DType::kFloat32, 0}, s.get());
  std::vector<uint8_t> want_bytes(want.size() * 4);
  memcpy(want_bytes.data(), want.data(), want_bytes.size());
  const std::string d = differences(download<uint8_t>(out, want_bytes.size(), s), want_bytes, 4,
                                    [&](uint64_t i) { return describe_element(c, i); });
  r.check(d.empty(), "decode_acc", c.name, d.empty() ? "accumulators as the CPU's" : d);
}

// The statistics of `candidates` on the case's jobs, against topk::squared_errors.
void check_stats(Report& r, const Case& c, const std::vector<TopkParams>& candidates, const CudaStream& s, Rng& rng) {
  const uint32_t stride = static_cast<uint32_t>(candidates.size()) + 3;
  std::vector<uint32_t> columns(candidates.size());
  for (size_t i = 0; i < columns.size(); ++i) columns[i] = static_cast<uint32_t>(i + 2);
  std::shuffle(columns.begin(), columns.end(), rng);
  const double weight = 0.25 * static_cast<double>(1 + below(rng, 8));
  std::vector<double> initial(uint64_t{c.layers} * stride);
  for (double& v : initial) v = static_cast<double>(below(rng, 1000));
  std::vector<double> want = initial;
  std::vector<uint8_t> want_flags(c.layers, 0);
  const size_t width = dtype_size(c.dtype);
  for (const tc::Job& job : c.jobs) {
    if (job.count == 0) continue;
    std::vector<double> errors(candidates.size());
    const uint64_t bad =
        topk::squared_errors(candidates, c.dtype, Slice{c.input.data() + job.element_offset * width, job.count, 0},
                             c.residual.empty() ? nullptr : c.residual.data() + job.element_offset, errors);
    if (bad) want_flags[job.layer] = 1;
    for (size_t k = 0; k < candidates.size(); ++k) want[uint64_t{job.layer} * stride + columns[k]] += weight * errors[k];
  }
  DeviceBuffer input(c.input.size()), residual(c.residual.size() * 4), squared(initial.size() * 8), flags(c.layers),
      scratch(tc::stats_scratch_bytes(c.jobs, candidates));
  upload(input, c.input.data(), c.input.size(), s);
  upload(residual, c.residual.data(), c.residual.size() * 4, s);
  upload(squared, initial.data(), initial.size() * 8, s);
  LGRECO_CUDA_CHECK(cudaMemsetAsync(flags.get(), 0, flags.size(), s.get()));
  poison(scratch, s);
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
  tc::squared_errors(b, s.get());
  const std::vector<uint8_t> got_bytes = download<uint8_t>(squared, initial.size() * 8, s);
  const std::vector<uint8_t> got_flags = download<uint8_t>(flags, c.layers, s);
  // A second call on the same data must give the same bits (no atomics decide a sum).
  upload(squared, initial.data(), initial.size() * 8, s);
  tc::squared_errors(b, s.get());
  const std::vector<uint8_t> again = download<uint8_t>(squared, initial.size() * 8, s);
  std::vector<double> got(initial.size());
  memcpy(got.data(), got_bytes.data(), got_bytes.size());
  std::string bad;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = got[i] == want[i] ? 0.0 : std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), 1e-300);
    if (!(diff <= kStatsRelTolerance) && bad.size() < 300)
      bad += strf("; row %zu column %zu: GPU %.17g, CPU %.17g", i / stride, i % stride, got[i], want[i]);
    if (std::isfinite(diff)) worst = std::max(worst, diff);
  }
  r.stats_difference(worst);
  if (got_flags != want_flags) bad += "; the nonfinite flags differ from the CPU's";
  if (again != got_bytes) bad += "; a second call gave other bits";
  const std::string name = c.name + strf(", %zu candidates", candidates.size());
  r.check(bad.empty(), "stats", name,
          bad.empty() ? strf("within %.0e of the CPU (worst %.2g), flags equal, deterministic", kStatsRelTolerance, worst)
                      : bad.substr(2));
}

std::vector<TopkParams> random_candidates(Rng& rng, size_t count) {
  static constexpr uint32_t kUsual[] = {1'000'000, 2'000'000, 5'000'000, 10'000'000, 20'000'000, 50'000'000, 100'000'000};
  std::vector<TopkParams> out;
  for (size_t i = 0; i < count; ++i)
    out.push_back(TopkParams{chance(rng, 0.6) ? kUsual[below(rng, std::size(kUsual))]
                                              : static_cast<uint32_t>(1 + below(rng, 1'000'000'000))});
  return out;
}

void check_case(Report& r, const Case& c, const CudaStream& s, Rng& rng, size_t stats_candidates) {
  const Encoded want = cpu_encode(c);
  {
    DeviceCase d(c);
    check_encode(r, c, d, s, want);
  }
  check_decode(r, c, want, s, rng);
  if (stats_candidates > 0) check_stats(r, c, random_candidates(rng, stats_candidates), s, rng);
}

DType dtype_at(size_t i) { return kDTypes[i % 3]; }
Feedback feedback_at(size_t i) {
  static constexpr Feedback kAll[] = {Feedback::kResidual, Feedback::kNone, Feedback::kSkips};
  return kAll[i % 3];
}

// ---------------------------------------------------------------------------------------
// The cases

void check_single_jobs(Report& r, bool quick, const CudaStream& s, Rng& rng) {
  std::vector<uint64_t> sizes = {1, 31, 1000, 4097, 100'003};
  if (!quick) {
    sizes.push_back(1'000'000);
    sizes.push_back(10'000'000);
  }
  const uint32_t densities[] = {1, 1'000'000, 10'000'000, 100'000'000, 500'000'000, 1'000'000'000};
  size_t i = 0;
  for (uint64_t n : sizes) {
    for (uint32_t ppb : densities) {
      if (n >= 1'000'000 && ppb != 1'000'000 && ppb != 10'000'000 && ppb != 100'000'000) continue;
      const Dist dist = n >= 1'000'000 && i % 2 == 0 ? Dist::kNormal : random_dist(rng);
      const Case c = make_case(strf("single n=%llu density_ppb=%u %s", static_cast<ull>(n), ppb, dist_name(dist)), dtype_at(i),
                               feedback_at(i), {{n, ppb, dist, false}}, rng);
      check_case(r, c, s, rng, n <= 1'000'000 && i % 2 == 0 ? 1 + below(rng, 8) : 0);
      ++i;
    }
  }
}

// Ties everywhere, all zeros, mostly zeros (the candidate list overflows and the selection
// runs over the full data), subnormals, clusters of nearby keys, NaN and infinities.
void check_hard_inputs(Report& r, bool quick, const CudaStream& s, Rng& rng) {
  const uint64_t big = quick ? 50'000 : 1'000'000;
  const Dist dists[] = {Dist::kTies, Dist::kZeros, Dist::kSparse, Dist::kTiny, Dist::kCluster, Dist::kConstant, Dist::kHeavy};
  size_t i = 0;
  for (Dist d : dists)
    for (bool specials : {false, true}) {
      const uint64_t n = i % 2 == 0 ? big : 5000 + below(rng, 20000);
      const uint32_t ppb = pick<uint32_t>(rng, {1'000'000, 10'000'000, 300'000'000});
      const Case c = make_case(strf("hard %s%s density_ppb=%u", dist_name(d), specials ? " with NaN/inf" : "", ppb),
                               dtype_at(i), i % 3 == 1 ? Feedback::kNone : Feedback::kResidual,
                               {{n, ppb, d, specials}, {n / 7 + 1, ppb, Dist::kNormal, specials}}, rng);
      check_case(r, c, s, rng, 1 + below(rng, 4));
      ++i;
    }
}

// Many jobs: several launch tables of 64, shared layers, empty jobs, gaps.
void check_batches(Report& r, bool quick, const CudaStream& s, Rng& rng) {
  for (size_t round = 0; round < (quick ? 2u : 4u); ++round) {
    std::vector<JobSpec> specs;
    const size_t jobs = 60 + below(rng, 80);
    for (size_t j = 0; j < jobs; ++j) {
      const uint64_t n = chance(rng, 0.05) ? 0 : chance(rng, 0.1) ? below(rng, 200'000) : below(rng, 5000) + 1;
      specs.push_back(JobSpec{n, static_cast<uint32_t>(1 + below(rng, 1'000'000'000)), random_dist(rng), chance(rng, 0.1)});
    }
    const Case c = make_case("batch", dtype_at(round), feedback_at(round), specs, rng);
    check_case(r, c, s, rng, round == 0 ? 16 : 1 + below(rng, 10));
  }
}

// The calls captured into a CUDA graph, replayed twice on new inputs in the same buffers:
// nothing may depend on the host seeing the data.
void check_graph(Report& r, bool quick, const CudaStream& s, Rng& rng) {
  const uint64_t n = quick ? 30'000 : 2'000'000;
  Case c = make_case("graph", DType::kFloat32, Feedback::kResidual,
                     {{n, 10'000'000, Dist::kNormal, false}, {n / 3, 1'000'000, Dist::kSparse, true}}, rng);
  DeviceCase d(c);
  prepare(c, d, s);
  s.sync();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  LGRECO_CUDA_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  try {
    tc::encode(encode_batch(c, d), s.get());
  } catch (...) {
    cudaStreamEndCapture(s.get(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  LGRECO_CUDA_CHECK(cudaStreamEndCapture(s.get(), &graph));
  LGRECO_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  bool ok = true;
  for (int replay = 0; replay < 2 && ok; ++replay) {
    if (replay > 0) {  // new values in the same buffers, a NaN and an infinity among them
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (uint64_t i = 0; i < c.elements; ++i) {
        store_from_float(c.input.data(), c.dtype, i, 100.0f * normal(rng));
        c.residual[i] = normal(rng);
      }
      store_from_float(c.input.data(), c.dtype, c.jobs[0].element_offset + below(rng, n), bits_float(0x7fc00000u));
      c.residual[c.jobs[1].element_offset] = bits_float(0xff800000u);
    }
    prepare(c, d, s);
    LGRECO_CUDA_CHECK(cudaGraphLaunch(exec, s.get()));
    const Encoded got = download_encoded(c, d, s);
    ok = compare_encoded(r, "graph", c, got, cpu_encode(c));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (ok) r.check(true, "graph", c.name, "a captured encode, replayed on two inputs, as the CPU's");
}

// Errors are thrown on the host, before anything is launched.
void check_errors(Report& r, const CudaStream& s) {
  const auto expect = [&](const std::string& name, const std::string& part, const std::function<void()>& call) {
    try {
      call();
      r.check(false, "errors", name, "no exception");
    } catch (const CodecError& e) {
      const bool ok = std::string(e.what()).find(part) != std::string::npos;
      r.check(ok, "errors", name, ok ? e.what() : std::string("message lacks '") + part + "': " + e.what());
    }
  };
  tc::Job job;
  job.count = 1000;
  DeviceBuffer in(4000), payload(64), scratch(tc::encode_scratch_bytes(std::span<const tc::Job>(&job, 1)));
  tc::EncodeBatch b;
  b.jobs = std::span<const tc::Job>(&job, 1);
  b.input = in.get();
  b.payload = payload.get();
  b.scratch = scratch.get();
  b.scratch_bytes = scratch.size() - 1;
  expect("scratch too small", "is too small", [&] { tc::encode(b, s.get()); });
  b.scratch_bytes = scratch.size();
  b.payload = payload.get() + 2;
  expect("misaligned payload", "4-byte aligned", [&] { tc::encode(b, s.get()); });
  b.payload = payload.get();
  tc::Job huge = job;
  huge.count = uint64_t{1} << 32;
  b.jobs = std::span<const tc::Job>(&huge, 1);
  expect("2^32 values", "at most 4294967295", [&] { tc::encode(b, s.get()); });
  tc::Job odd = job;
  odd.byte_offset = 6;
  b.jobs = std::span<const tc::Job>(&odd, 1);
  expect("payload offset", "not a multiple of 4", [&] { tc::encode(b, s.get()); });
  s.sync();
}

struct Options {
  enum class Mode { kNone, kCheck, kBench, kInfo };
  Mode mode = Mode::kNone;
  bool quick = false;
  std::optional<uint64_t> seed;
  int device = 0;
  uint64_t count = 100'000'000;
  int reps = 21;
  int warmup = 3;
  unsigned time_limit = 600;
};

int run_check(const Options& o, const CudaStream& s) {
  const uint64_t seed = check_seed(o.seed, kProgram, o.quick);
  Rng rng(seed);
  Report r;
  const double start = cli::seconds_now();
  std::string stage = "setup";
  try {
    stage = "single jobs";
    check_single_jobs(r, o.quick, s, rng);
    stage = "hard inputs";
    check_hard_inputs(r, o.quick, s, rng);
    stage = "batches";
    check_batches(r, o.quick, s, rng);
    stage = "graph capture";
    check_graph(r, o.quick, s, rng);
    stage = "argument errors";
    check_errors(r, s);
  } catch (const CudaFailure& e) {
    r.check(false, "cuda", stage, std::string(e.what()) + " (a kernel fault surfaces at the next synchronisation; later checks skipped)");
  } catch (const tc::CudaError& e) {
    r.check(false, "cuda", stage, std::string(e.what()) + " (later checks skipped)");
  } catch (const std::exception& e) {
    r.check(false, "harness", stage, std::string(e.what()) + " (later checks skipped)");
  }
  const double seconds = cli::seconds_now() - start;
  printf("\n");
  for (const std::string& f : r.failures()) printf("# failed: %s\n", f.c_str());
  printf("SUMMARY: %d checks, %d passed, %d failed in %.1f s (seed 0x%016llx); statistics: worst relative difference "
         "%.2g (allowed %.0e)\n",
         r.passed() + r.failed(), r.passed(), r.failed(), seconds, static_cast<ull>(seed), r.worst_stats(),
         kStatsRelTolerance);
  printf("RESULT: %s\n", r.failed() == 0 ? "PASS" : "FAIL");
  return r.failed() == 0 ? 0 : kExitFailed;
}

// ---------------------------------------------------------------------------------------
// --bench: each call timed alone with CUDA events on the stream, after warm-up calls; the
// median of the repetitions.

struct Timing {
  double median_ms, min_ms, max_ms;
};

Timing time_calls(const Options& o, const CudaStream& s, const std::function<void()>& op) {
  CudaEvent start, stop;
  for (int i = 0; i < o.warmup; ++i) op();
  s.sync();
  std::vector<double> ms;
  for (int rep = 0; rep < o.reps; ++rep) {
    LGRECO_CUDA_CHECK(cudaEventRecord(start.get(), s.get()));
    op();
    LGRECO_CUDA_CHECK(cudaEventRecord(stop.get(), s.get()));
    LGRECO_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float t = 0.0f;
    LGRECO_CUDA_CHECK(cudaEventElapsedTime(&t, start.get(), stop.get()));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return Timing{ms[ms.size() / 2], ms.front(), ms.back()};
}

int run_bench(const Options& o, const cudaDeviceProp& prop, const CudaStream& s) {
  const uint64_t n = o.count;
  const TopkParams p1{10'000'000}, p01{1'000'000};
  std::vector<tc::Job> jobs(1);
  jobs[0].count = n;
  jobs[0].params = p1;
  const std::vector<TopkParams> candidates = {TopkParams{1'000'000},  TopkParams{2'000'000},  TopkParams{5'000'000},
                                              TopkParams{10'000'000}, TopkParams{20'000'000}, TopkParams{50'000'000},
                                              TopkParams{100'000'000}};
  const uint64_t scratch_bytes = std::max(tc::encode_scratch_bytes(jobs), tc::stats_scratch_bytes(jobs, candidates));
  const uint64_t need = n * 4 * 3 + n * 2 + topk::encoded_bytes(p1, n) + scratch_bytes;
  size_t free_bytes = 0, total_bytes = 0;
  LGRECO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (static_cast<double>(need) > 0.9 * static_cast<double>(free_bytes))
    throw std::runtime_error(strf("--bench with %s values needs %.2f GiB of device memory, %.2f GiB are free",
                                  cli::thousands(n).c_str(), need / 1073741824.0, free_bytes / 1073741824.0));
  printf("# --bench: %s values a call, median of %d calls (each timed alone with CUDA events) after %d warm-up calls; "
         "scratch %.1f MiB\n",
         cli::thousands(n).c_str(), o.reps, o.warmup, scratch_bytes / 1048576.0);
  DeviceBuffer in32(n * 4), in16(n * 2), residual(n * 4), out(n * 4), payload(topk::encoded_bytes(p1, n)),
      scratch(scratch_bytes), squared(candidates.size() * 8), flags(1);
  {
    // Gaussian values (a gradient's shape), drawn on the host in chunks.
    Rng rng(12345);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const uint64_t chunk = uint64_t{1} << 22;
    std::vector<float> x(chunk), r(chunk);
    std::vector<uint16_t> h(chunk);
    for (uint64_t at = 0; at < n; at += chunk) {
      const uint64_t m = std::min(chunk, n - at);
      for (uint64_t i = 0; i < m; ++i) {
        x[i] = normal(rng);
        r[i] = 0.01f * normal(rng);
        h[i] = float_to_bf16_rn(x[i]);
      }
      LGRECO_CUDA_CHECK(cudaMemcpy(in32.get() + at * 4, x.data(), m * 4, cudaMemcpyHostToDevice));
      LGRECO_CUDA_CHECK(cudaMemcpy(residual.get() + at * 4, r.data(), m * 4, cudaMemcpyHostToDevice));
      LGRECO_CUDA_CHECK(cudaMemcpy(in16.get() + at * 2, h.data(), m * 2, cudaMemcpyHostToDevice));
    }
    LGRECO_CUDA_CHECK(cudaMemset(squared.get(), 0, squared.size()));
  }
  struct Row {
    std::string name;
    Timing t;
    double target_ms;  // 0: none
  };
  std::vector<Row> rows;
  const auto add = [&](const std::string& name, const Timing& t, double target) {
    rows.push_back(Row{name, t, target});
    printf("bench %-44s median %8.3f ms  (min %.3f, max %.3f) over %d calls%s\n", name.c_str(), t.median_ms, t.min_ms,
           t.max_ms, o.reps,
           target > 0 ? strf("; target <= %.2f ms: %s", target, t.median_ms <= target ? "met" : "MISSED").c_str() : "");
  };
  add("copy float32 (device to device, baseline)", time_calls(o, s, [&] {
        LGRECO_CUDA_CHECK(cudaMemcpyAsync(out.get(), in32.get(), n * 4, cudaMemcpyDeviceToDevice, s.get()));
      }), 0.0);
  const auto encode_row = [&](const TopkParams& p, DType t, bool ef, double target) {
    jobs[0].params = p;
    tc::EncodeBatch b;
    b.jobs = jobs;
    b.input = t == DType::kFloat32 ? in32.get() : in16.get();
    b.input_dtype = t;
    b.residual = ef ? reinterpret_cast<float*>(residual.get()) : nullptr;
    b.payload = payload.get();
    b.scratch = scratch.get();
    b.scratch_bytes = scratch.size();
    add(strf("encode %s density %s%s", dtype_name(t), density_text(p.density_ppb).c_str(), ef ? " +EF" : ""),
        time_calls(o, s, [&] { tc::encode(b, s.get()); }), target);
  };
  encode_row(p1, DType::kFloat32, false, kTargetMs);
  encode_row(p01, DType::kFloat32, false, 0.0);
  encode_row(p1, DType::kFloat32, true, 0.0);
  encode_row(p1, DType::kBFloat16, false, 0.0);
  jobs[0].params = p1;
  {
    tc::EncodeBatch b;
    b.jobs = jobs;
    b.input = in32.get();
    b.payload = payload.get();
    b.scratch = scratch.get();
    b.scratch_bytes = scratch.size();
    tc::encode(b, s.get());
    const tc::DecodeBatch d{jobs, payload.get(), out.get(), DType::kFloat32, 0};
    add("decode float32 density 0.01", time_calls(o, s, [&] { tc::decode(d, s.get()); }), 0.0);
    add("decode_accumulate density 0.01", time_calls(o, s, [&] { tc::decode_accumulate(d, s.get()); }), 0.0);
  }
  {
    std::vector<uint32_t> columns(candidates.size());
    for (size_t i = 0; i < columns.size(); ++i) columns[i] = static_cast<uint32_t>(i);
    tc::StatsBatch b;
    b.jobs = jobs;
    b.candidates = candidates;
    b.columns = columns;
    b.row_stride = static_cast<uint32_t>(candidates.size());
    b.input = in32.get();
    b.residual = reinterpret_cast<const float*>(residual.get());
    b.squared = reinterpret_cast<double*>(squared.get());
    b.nonfinite = flags.get();
    b.scratch = scratch.get();
    b.scratch_bytes = scratch.size();
    add("squared_errors 7 densities +residual", time_calls(o, s, [&] { tc::squared_errors(b, s.get()); }), 0.0);
  }
  s.sync();
  printf("\n== lgreco-gpu-topk-check --bench: %s, %d SMs, %s values a call ==\n", prop.name, prop.multiProcessorCount,
         cli::thousands(n).c_str());
  printf("%-44s %10s %10s %10s %s\n", "case", "median_ms", "min_ms", "GB/s_read", "target");
  const double copy_gbs = 2.0 * static_cast<double>(n) * 4 / (rows.front().t.median_ms * 1e-3) * 1e-9;
  for (const Row& row : rows) {
    // GB/s of one read of the float32 input, for comparison with the copy's read + write.
    printf("%-44s %10.3f %10.3f %10.0f %s\n", row.name.c_str(), row.t.median_ms, row.t.min_ms,
           static_cast<double>(n) * 4 / (row.t.median_ms * 1e-3) * 1e-9,
           row.target_ms > 0 ? strf("<= %.2f ms %s", row.target_ms, row.t.median_ms <= row.target_ms ? "met" : "MISSED").c_str()
                             : "-");
  }
  printf("copy: %.0f GB/s counting read + write; torch.topk of 1e8 float32 took %.1f ms at 0.1%% and 1%% on the H200 "
         "(docs/DESIGN.md)\n",
         copy_gbs, kTorchTopkMs);
  const Row& target = rows[1];
  printf("TARGET: encode float32 %s values at density 0.01: median %.3f ms, target <= %.2f ms: %s (torch.topk %.1f ms)\n",
         cli::thousands(n).c_str(), target.t.median_ms, kTargetMs, target.t.median_ms <= kTargetMs ? "met" : "missed",
         kTorchTopkMs);
  return 0;
}

const char kUsage[] = R"(usage: lgreco-gpu-topk-check --check [--quick] [--seed S] | --bench | --info  [options]

Runs lgreco's CUDA TopK kernels (kernels/topk_cuda.h) on a GPU.

  --check        parity with the CPU reference (kernels/topk.h) on fresh random inputs:
                 payloads, residuals, non-finite counters, decode and decode-accumulate
                 outputs byte for byte, error statistics within 1e-9, CUDA graph capture,
                 argument errors; PASS/FAIL lines, then SUMMARY and RESULT lines
  --quick        with --check: sizes up to ~1e5 (for compute-sanitizer)
  --bench        encode of --count float32 values at densities 0.01 and 0.001 and the other
                 kernels, median of --reps calls, one line per case and a TARGET line
  --info         print the device, run one small encode, exit
  --seed S       seed of --check's inputs (default: drawn and printed)
  --device N     CUDA device (default 0)
  --count N      --bench: values a call (default 100000000)
  --reps R       --bench: calls timed, the median is reported (default 21, at least 20)
  --time-limit S exit with status 3 after S seconds (default 600, 0: none)

Exit status: 0 all passed, 1 a check or a CUDA call failed, 2 usage error or no CUDA
device, 3 the time limit ran out.
)";

int run(int argc, char** argv) {
  Options o;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (parse_mode(arg, o.mode)) {
      // --check, --bench or --info
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--seed") {
      o.seed = cli::parse_u64(arg, args.value());
    } else if (arg == "--device") {
      o.device = cli::parse_int(arg, args.value(), 0, 1024);
    } else if (arg == "--count") {
      o.count = cli::parse_u64(arg, args.value());
    } else if (arg == "--reps") {
      o.reps = cli::parse_int(arg, args.value(), 1, 1000);
    } else if (arg == "--time-limit") {
      o.time_limit = cli::parse_u32(arg, args.value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  require_mode(o.mode, o.quick);
  if (o.count < 1 || o.count > uint64_t{0xffffffffu}) throw cli::UsageError("--count must be in 1..4294967295");

  setvbuf(stdout, nullptr, _IOLBF, 0);  // every line reaches the log, even if the time limit ends the process
  arm_time_limit(kProgram, o.time_limit);
  const std::optional<cudaDeviceProp> prop = open_device(o.device);
  if (!prop) return kExitNoDevice;
  CudaStream s;
  if (o.mode == Options::Mode::kInfo) {
    Rng rng(1);
    const Case c = make_case("info", DType::kFloat32, Feedback::kResidual, {{5000, 10'000'000, Dist::kNormal, false}}, rng);
    Report r;
    DeviceCase d(c);
    check_encode(r, c, d, s, cpu_encode(c));
    printf("# --info: one encode ran (%s)\n", r.failed() == 0 ? "as the CPU's" : "DIFFERENT from the CPU's");
    return 0;
  }
  if (o.mode == Options::Mode::kCheck) return run_check(o, s);
  return run_bench(o, *prop, s);
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main(lgreco::kProgram, [&] { return lgreco::run(argc, argv); });
}
