// lgreco-gpu-codec-check: the CUDA quantization kernels (kernels/quant_cuda.h) on a real
// GPU, against the CPU reference (kernels/quant.h, kernels/codec.h), and their throughput.
//
//   --check [--quick]  parity on fresh random inputs: encode payloads and residuals, decode
//                      (every output type) and decode-accumulate outputs byte for byte, the
//                      non-finite counter exactly, the error statistics within
//                      kStatsRelTolerance (+ float32's resolution, kStatsResolution); batches
//                      of many jobs (several launches) at odd
//                      offsets, poisoned gaps that must stay untouched, NaN/Inf/overflow
//                      buckets, argument errors thrown before any launch, and the same calls
//                      captured into a CUDA graph; the device's float16 conversions
//                      against the host's over every float16 and every float32 (--quick:
//                      2^24 of them). One PASS/FAIL line per check, a SUMMARY
//                      line and a RESULT line last. --quick: a smaller set, for the
//                      compute-sanitizer pass.
//   --bench            throughput of every kernel on 2^28 elements, against a device-to-device
//                      copy (nccl-tests style: warm-up, CUDA events, median of repetitions);
//                      a compact table last, with the targets of the kernels' issue.
//   --info             the device, nothing else (a trivial CUDA run, e.g. to see that
//                      compute-sanitizer works on this machine).
//
// Built only when nvcc is found (Makefile), by `make test` too so that CI compiles it; it
// needs a GPU and is run by tests/gpu/run.sh (section codec). Exit status: 0 every check
// passed, 1 a check or a CUDA call failed, 2 usage error or no CUDA device, 3 the
// --time-limit ran out (a hung kernel cannot hold the GPU script).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tests/gpu/check_util.h"
#include "config/version.h"
#include "kernels/codec.h"
#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"
#include "kernels/quant.h"
#include "kernels/quant_cuda.h"
#include "kernels/quant_math.h"
#include "kernels/slice.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

namespace qc = quant::cuda;

constexpr char kProgram[] = "lgreco-gpu-codec-check";

// How far the GPU's error statistics may be from the CPU reference's (measure_candidates),
// relative to the CPU's value. The kernels multiply by a reciprocal where the reference
// divides and sum in another order (quant_cuda.h, StatsBatch); the bound is being settled
// (docs/KERNELS.md), and this is the one place to change it.
constexpr double kStatsRelTolerance = 1e-4;
// Plus float32's own resolution of the statistic, which no relative bound covers where the
// error is itself near zero (values sitting on codes: a bucket of one or two distinct
// values, a grid of ties), the CPU giving exactly 0 where the GPU's reciprocal puts a
// position one ulp off a code, or the reverse. Per element, both sides compute the code
// position of v to a few ulps of (v - min) / unit, and round to nearest measures v against
// a decoded value rounded in float32, so the element's squared error is known only to
// about unit x (range + max |v|) x 2^-22; the allowance is that times 2, summed over the
// layer's elements (per bucket: n x unit x (range + max |v|) x kStatsResolution). On
// Gaussian data it is ~1e-5 (4 bits) to ~2e-3 (8 bits) of the error itself; the summary
// reports how many values needed it, and the largest relative difference among values far
// above it (--verbose lists each value that needed it).
constexpr double kStatsResolution = 0x1p-21;

// What untouched output bytes hold: any write the kernels should not make shows up.
constexpr uint8_t kPoisonByte = 0xA5;
// The non-finite counter starts here: the kernels must add to it, not overwrite it.
constexpr unsigned long long kCounterStart = 1000003;

// ---------------------------------------------------------------------------------------
// Small helpers

using namespace gpu_check;

// An instantiated graph and the graph it came from.
class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  cudaGraph_t* graph_slot() { return &graph_; }
  cudaGraph_t graph() const { return graph_; }
  cudaGraphExec_t* exec_slot() { return &exec_; }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Ends a stream capture that an exception left open, so the stream can be used again.
class CaptureGuard {
 public:
  explicit CaptureGuard(cudaStream_t s) : stream_(s) {}
  ~CaptureGuard() {
    if (!open_) return;
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's error was reported by whoever threw
  }
  CaptureGuard(const CaptureGuard&) = delete;
  CaptureGuard& operator=(const CaptureGuard&) = delete;
  void begin() {
    LGRECO_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    open_ = true;
  }
  void end(cudaGraph_t* graph) {
    open_ = false;
    LGRECO_CUDA_CHECK(cudaStreamEndCapture(stream_, graph));
  }

 private:
  cudaStream_t stream_;
  bool open_ = false;
};

// ---------------------------------------------------------------------------------------
// The device

struct DeviceInfo {
  int device = 0;
  cudaDeviceProp prop{};
  int sm_clock_khz = 0;
  int memory_clock_khz = 0;
  int bus_width_bits = 0;
  int runtime_version = 0;
  int driver_version = 0;
};

// The device, or an exit status: 2 with a clear message when there is no usable device.
std::optional<DeviceInfo> open_device(int device) {
  if (!qc::available()) {
    fprintf(stderr, "%s: this build of lgreco has no CUDA kernels (nvcc was not found at build time)\n", kProgram);
    return std::nullopt;
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    const std::string why = e != cudaSuccess ? strf("cudaGetDeviceCount: %s: %s", cudaGetErrorName(e), cudaGetErrorString(e))
                                             : std::string("cudaGetDeviceCount found 0 devices");
    fprintf(stderr, "%s: no CUDA device (%s); this program runs the kernels and needs a GPU\n", kProgram, why.c_str());
    return std::nullopt;
  }
  if (device < 0 || device >= count) {
    fprintf(stderr, "%s: --device %d: this machine has %d CUDA device(s)\n", kProgram, device, count);
    return std::nullopt;
  }
  DeviceInfo info;
  info.device = device;
  LGRECO_CUDA_CHECK(cudaSetDevice(device));
  LGRECO_CUDA_CHECK(cudaGetDeviceProperties(&info.prop, device));
  // Clocks are attributes (CUDA 13 dropped them from cudaDeviceProp); 0 when not reported.
  if (cudaDeviceGetAttribute(&info.sm_clock_khz, cudaDevAttrClockRate, device) != cudaSuccess) info.sm_clock_khz = 0;
  if (cudaDeviceGetAttribute(&info.memory_clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess)
    info.memory_clock_khz = 0;
  if (cudaDeviceGetAttribute(&info.bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
    info.bus_width_bits = 0;
  cudaGetLastError();  // an unsupported attribute leaves nothing to carry
  LGRECO_CUDA_CHECK(cudaRuntimeGetVersion(&info.runtime_version));
  LGRECO_CUDA_CHECK(cudaDriverGetVersion(&info.driver_version));
  return info;
}

void print_device(const DeviceInfo& d) {
  printf("# device %d: %s, compute capability %d.%d, %d SMs, SM clock %d MHz, memory clock %d MHz x %d bit, "
         "%.1f GiB\n",
         d.device, d.prop.name, d.prop.major, d.prop.minor, d.prop.multiProcessorCount, d.sm_clock_khz / 1000,
         d.memory_clock_khz / 1000, d.bus_width_bits, static_cast<double>(d.prop.totalGlobalMem) / (1 << 30));
  printf("# CUDA runtime %d.%d (linked), driver supports %d.%d; lgreco %s; %s\n", d.runtime_version / 1000,
         (d.runtime_version % 1000) / 10, d.driver_version / 1000, (d.driver_version % 1000) / 10, version_string(),
         bench::utc_now().c_str());
}

// ---------------------------------------------------------------------------------------
// Results

class Report {
 public:
  void check(bool ok, const char* kind, const std::string& name, const std::string& detail) {
    printf("%s %-12s %s: %s\n", ok ? "PASS" : "FAIL", kind, name.c_str(), detail.c_str());
    if (ok) {
      ++passed_;
    } else {
      ++failed_;
      if (failures_.size() < 12) failures_.push_back(std::string(kind) + " " + name);
    }
  }
  void pass(const char* kind, const std::string& name, const std::string& detail) { check(true, kind, name, detail); }
  void fail(const char* kind, const std::string& name, const std::string& detail) { check(false, kind, name, detail); }

  // One compared statistic: its relative difference to the CPU's, whether it passed only
  // thanks to the float32 resolution allowance, and whether it is far above that
  // resolution (only those count for the worst relative difference: near the resolution,
  // relative differences mean nothing).
  void stats_value(int kind, double relative, bool resolution_only, bool well_resolved, const std::string& where) {
    ++stats_values_;
    if (resolution_only) ++resolution_only_;
    if (std::isnan(relative)) relative = std::numeric_limits<double>::infinity();
    if (well_resolved && relative > worst_[kind]) {
      worst_[kind] = relative;
      worst_where_[kind] = where;
    }
  }

  // --verbose: a NOTE line (counted nowhere), e.g. each statistic that needed the float32
  // resolution allowance, for whoever settles the statistics' tolerance.
  void set_verbose(bool v) { verbose_ = v; }
  void note(const std::string& line) {
    if (verbose_ && notes_++ < 2000) printf("NOTE %s\n", line.c_str());
  }

  int passed() const { return passed_; }
  int failed() const { return failed_; }
  const std::vector<std::string>& failures() const { return failures_; }
  uint64_t stats_values() const { return stats_values_; }
  uint64_t resolution_only() const { return resolution_only_; }
  double worst(int kind) const { return worst_[kind]; }
  const std::string& worst_where(int kind) const { return worst_where_[kind]; }

 private:
  bool verbose_ = false;
  int notes_ = 0;
  int passed_ = 0;
  int failed_ = 0;
  std::vector<std::string> failures_;
  uint64_t stats_values_ = 0;
  uint64_t resolution_only_ = 0;
  double worst_[3] = {0.0, 0.0, 0.0};
  std::string worst_where_[3];
};

// Statistic kinds, for the worst relative differences in the summary.
constexpr int kKindNone = 0;
constexpr int kKindStochastic = 1;
constexpr int kKindNearest = 2;
constexpr const char* kKindNames[] = {"none", "quant stochastic", "quant nearest"};

// ---------------------------------------------------------------------------------------
// Batches: jobs laid out in the element arrays and the payload with gaps between them

struct Layout {
  std::vector<qc::Job> jobs;
  uint64_t elements = 0;       // length of the element arrays
  uint64_t payload_bytes = 0;  // length of the payload
};

// Pointer shifts from the start of each device allocation (which cudaMalloc aligns to 256
// bytes): elements for the element arrays, bytes (a multiple of 4) for the payload. A
// shift that is not a multiple of 4 elements turns the kernels' vector accesses off.
struct Shifts {
  uint64_t input = 0;
  uint64_t residual = 0;
  uint64_t output = 0;
  uint64_t payload = 0;
};

// kVector: every job starts on a multiple of 4 elements of aligned arrays (the kernels'
// 16-/8-byte accesses); kMisaligned: none does; kMixed: random per job, random shifts.
enum class Alignment { kVector, kMisaligned, kMixed };
const char* alignment_name(Alignment a) {
  switch (a) {
    case Alignment::kVector: return "aligned";
    case Alignment::kMisaligned: return "misaligned";
    case Alignment::kMixed: return "mixed alignment";
  }
  return "?";
}

struct JobShape {
  uint64_t count = 0;
  uint64_t first_element = 0;
  uint32_t layer = 0;
  QuantParams params;
};

Layout lay_out(const std::vector<JobShape>& shapes, Alignment alignment, Rng& rng) {
  Layout l;
  uint64_t e = below(rng, 8);
  uint64_t b = 4 * below(rng, 4);
  for (const JobShape& s : shapes) {
    if (chance(rng, 0.5)) e += 1 + below(rng, 9);  // a gap that must stay untouched
    Alignment a = alignment;
    if (a == Alignment::kMixed) a = chance(rng, 0.5) ? Alignment::kVector : Alignment::kMisaligned;
    if (a == Alignment::kVector)
      e = (e + 3) / 4 * 4;
    else if (e % 4 == 0)
      e += 1 + below(rng, 3);
    if (chance(rng, 0.5)) b += 4 * (1 + below(rng, 4));
    qc::Job job;
    job.element_offset = e;
    job.count = s.count;
    job.first_element = s.first_element;
    job.byte_offset = b;
    job.layer = s.layer;
    job.params = s.params;
    l.jobs.push_back(job);
    e += s.count;
    b += quant::encoded_bytes(s.params, s.count);
  }
  l.elements = e + 1 + below(rng, 16);
  l.payload_bytes = b + 4 * (1 + below(rng, 16));
  return l;
}

Shifts random_shifts(Alignment a, Rng& rng) {
  Shifts s;
  s.payload = 4 * below(rng, 4);
  if (a == Alignment::kMixed) {
    s.input = below(rng, 4);
    s.residual = below(rng, 4);
    s.output = below(rng, 4);
  }
  return s;
}

uint32_t layer_count(const Layout& l) {
  uint32_t n = 1;
  for (const qc::Job& j : l.jobs) n = std::max(n, j.layer + 1);
  return n;
}

size_t nonempty_jobs(const Layout& l) {
  return static_cast<size_t>(std::count_if(l.jobs.begin(), l.jobs.end(), [](const qc::Job& j) { return j.count > 0; }));
}

uint64_t total_count(const Layout& l) {
  uint64_t n = 0;
  for (const qc::Job& j : l.jobs) n += j.count;
  return n;
}

std::string params_text(const QuantParams& p) {
  return strf("bits %d, bucket %u, %s", p.bits, p.bucket, rounding_name(p.rounding));
}

std::string job_text(const qc::Job& j) {
  return strf("count %llu, first element %llu, layer %u, %s", static_cast<ull>(j.count), static_cast<ull>(j.first_element),
              j.layer, params_text(j.params).c_str());
}

std::string layout_text(const Layout& l) {
  const size_t jobs = nonempty_jobs(l);
  // Launches of one kind: 64 jobs a table (warp::kMaxJobsPerLaunch).
  return strf("%zu jobs (%zu non-empty, %zu launch%s), %s values", l.jobs.size(), jobs, (jobs + 63) / 64,
              (jobs + 63) / 64 == 1 ? "" : "es", cli::thousands(total_count(l)).c_str());
}

// Where byte `index` of a payload buffer is, for a failure message.
std::string describe_payload_byte(const Layout& l, uint64_t shift, uint64_t index) {
  if (index < shift) return strf("byte %llu, before the payload pointer (shift %llu)", static_cast<ull>(index), static_cast<ull>(shift));
  const uint64_t at = index - shift;
  for (size_t j = 0; j < l.jobs.size(); ++j) {
    const qc::Job& job = l.jobs[j];
    const uint64_t size = quant::encoded_bytes(job.params, job.count);
    if (at < job.byte_offset || at >= job.byte_offset + size) continue;
    const uint64_t rel = at - job.byte_offset;
    const uint64_t meta = quant::meta_bytes(job.params, job.count);
    if (rel < meta)
      return strf("payload byte %llu: job %zu (%s), metadata of bucket %llu (%s)", static_cast<ull>(at), j,
                  job_text(job).c_str(), static_cast<ull>(rel / 8), rel % 8 < 4 ? "min" : "unit");
    const uint64_t word = (rel - meta) / 4;
    const uint64_t group = word / job.params.bits;
    return strf("payload byte %llu: job %zu (%s), code word of group %llu plane %llu (bucket %llu)", static_cast<ull>(at),
                j, job_text(job).c_str(), static_cast<ull>(group), static_cast<ull>(word % job.params.bits),
                static_cast<ull>(group * quant::kGroupElements / job.params.bucket));
  }
  return strf("payload byte %llu, in a gap between jobs (must stay poisoned)", static_cast<ull>(at));
}

// Where element `index` of an element array is, for a failure message.
std::string describe_element(const Layout& l, uint64_t shift, uint64_t index) {
  if (index < shift) return strf("element %llu, before the array pointer (shift %llu)", static_cast<ull>(index), static_cast<ull>(shift));
  const uint64_t at = index - shift;
  for (size_t j = 0; j < l.jobs.size(); ++j) {
    const qc::Job& job = l.jobs[j];
    if (at < job.element_offset || at >= job.element_offset + job.count) continue;
    const uint64_t rel = at - job.element_offset;
    return strf("element %llu: job %zu (%s), its element %llu (bucket %llu)", static_cast<ull>(at), j, job_text(job).c_str(),
                static_cast<ull>(rel), static_cast<ull>(rel / job.params.bucket));
  }
  return strf("element %llu, in a gap between jobs (must stay untouched)", static_cast<ull>(at));
}

// Element-wise comparison of two buffers of `width`-byte elements: the first differing
// elements (up to 3), and how many differ.
struct Diff {
  std::vector<uint64_t> first;
  uint64_t count = 0;
};

Diff diff_elements(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, uint32_t width) {
  Diff d;
  if (a.size() != b.size()) {
    d.count = std::numeric_limits<uint64_t>::max();
    return d;
  }
  const uint64_t n = a.size() / width;
  for (uint64_t i = 0; i < n; ++i) {
    if (memcmp(a.data() + i * width, b.data() + i * width, width) == 0) continue;
    if (d.first.size() < 3) d.first.push_back(i);
    ++d.count;
  }
  return d;
}

std::string hex_element(const std::vector<uint8_t>& v, uint64_t i, uint32_t width) {
  uint64_t x = 0;
  memcpy(&x, v.data() + i * width, width);  // little-endian host
  return strf("0x%0*llx", static_cast<int>(2 * width), static_cast<ull>(x));
}

// Checks got == want element by element; on a difference, says where (describe) and shows
// both values. Returns whether they were equal.
bool compare_buffers(Report& r, const char* kind, const std::string& name, const std::string& what,
                     const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, uint32_t width,
                     const std::function<std::string(uint64_t)>& describe, const std::string& pass_detail) {
  if (got.size() != want.size()) {
    r.fail(kind, name, strf("%s: %zu bytes came back, %zu expected", what.c_str(), got.size(), want.size()));
    return false;
  }
  const Diff d = diff_elements(got, want, width);
  if (d.count == 0) {
    if (!pass_detail.empty()) r.pass(kind, name, pass_detail);
    return true;
  }
  std::string detail = strf("%s: %s of %s elements differ from the CPU reference", what.c_str(),
                            cli::thousands(d.count).c_str(), cli::thousands(got.size() / width).c_str());
  for (uint64_t i : d.first)
    detail += strf("; at %s: GPU %s, CPU %s", describe(i).c_str(), hex_element(got, i, width).c_str(),
                   hex_element(want, i, width).c_str());
  r.fail(kind, name, detail);
  return false;
}

// ---------------------------------------------------------------------------------------
// Inputs

enum class Dist { kNormal, kHeavyTailed, kConstant, kSignedZeros, kOffset, kTiny, kMixedScales, kTwoValues, kGrid };
constexpr Dist kAllDists[] = {Dist::kNormal,      Dist::kHeavyTailed, Dist::kConstant,  Dist::kSignedZeros, Dist::kOffset,
                              Dist::kTiny,        Dist::kMixedScales, Dist::kTwoValues, Dist::kGrid};

const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavyTailed: return "heavy-tailed";
    case Dist::kConstant: return "constant buckets";
    case Dist::kSignedZeros: return "signed zeros";
    case Dist::kOffset: return "positive offset";
    case Dist::kTiny: return "subnormal";
    case Dist::kMixedScales: return "mixed scales";
    case Dist::kTwoValues: return "two values";
    case Dist::kGrid: return "grid (ties)";
  }
  return "?";
}

Dist random_dist(Rng& rng) {
  const uint64_t x = below(rng, 100);
  if (x < 35) return Dist::kNormal;
  if (x < 45) return Dist::kHeavyTailed;
  if (x < 52) return Dist::kConstant;
  if (x < 56) return Dist::kSignedZeros;
  if (x < 64) return Dist::kOffset;
  if (x < 70) return Dist::kTiny;
  if (x < 85) return Dist::kMixedScales;
  if (x < 90) return Dist::kTwoValues;
  return Dist::kGrid;
}

// One job's values before narrowing to the element type, and its typical magnitude.
struct Drawn {
  std::vector<float> values;
  double scale = 1.0;
};

Drawn draw(Dist d, DType t, uint64_t count, uint32_t bucket, Rng& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::student_t_distribution<double> student(2.0);  // infinite variance: heavy tails
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const bool half = t == DType::kFloat16;  // float16 tops out at 65504, and is subnormal below 6.1e-5
  Drawn out;
  out.scale = std::pow(10.0, -3.0 + uniform(rng) * (half ? 5.0 : 9.0));
  out.values.resize(count);
  const double a = normal(rng) * out.scale;
  const double b = normal(rng) * out.scale;
  double block_value = 0.0;
  double block_scale = 1.0;
  for (uint64_t i = 0; i < count; ++i) {
    if (i % bucket == 0) {
      block_value = normal(rng) * out.scale;
      block_scale = std::pow(10.0, half ? -6.0 + uniform(rng) * 10.0 : -8.0 + uniform(rng) * 16.0);
    }
    double v = 0.0;
    switch (d) {
      case Dist::kNormal: v = normal(rng) * out.scale; break;
      case Dist::kHeavyTailed: v = student(rng) * out.scale; break;
      case Dist::kConstant: v = block_value; break;
      case Dist::kSignedZeros: v = chance(rng, 0.5) ? -0.0 : 0.0; break;
      case Dist::kOffset: v = 100.0 + uniform(rng); break;
      case Dist::kTiny: v = normal(rng) * (half ? 3e-6 : 1e-38); break;
      case Dist::kMixedScales: v = normal(rng) * block_scale; break;
      case Dist::kTwoValues: v = chance(rng, 0.5) ? a : b; break;
      case Dist::kGrid: v = static_cast<double>(below(rng, 9)) * 0.125; break;
    }
    out.values[i] = static_cast<float>(v);
  }
  if (d == Dist::kOffset || d == Dist::kGrid) out.scale = 1.0;
  if (d == Dist::kTiny) out.scale = half ? 3e-6 : 1e-38;
  if (d == Dist::kMixedScales) out.scale = 1.0;
  return out;
}

// The element arrays of a case: input in its element type, residual in float32 (empty
// without error feedback). Indexed with the pointer shift included.
struct Dataset {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> input;
  std::vector<float> residual;
};

// Non-finite input values, as bits of each element type.
struct Special {
  uint32_t f32;
  uint16_t f16;
  uint16_t bf16;
};
constexpr Special kNonFinite[] = {
    {0x7fc00000u, 0x7e00u, 0x7fc0u},  // NaN
    {0xffc12345u, 0xfe01u, 0xffc1u},  // negative NaN with a payload
    {0x7f800001u, 0x7c01u, 0x7f81u},  // signalling NaN
    {0x7f800000u, 0x7c00u, 0x7f80u},  // +inf
    {0xff800000u, 0xfc00u, 0xff80u},  // -inf
};

void put_special(Dataset& d, uint64_t i, const Special& s) {
  switch (d.dtype) {
    case DType::kFloat32: memcpy(d.input.data() + 4 * i, &s.f32, 4); break;
    case DType::kFloat16: memcpy(d.input.data() + 2 * i, &s.f16, 2); break;
    case DType::kBFloat16: memcpy(d.input.data() + 2 * i, &s.bf16, 2); break;
  }
}

// A few values of one job that make their buckets non-finite: NaN or infinity in the input
// or the residual, a range max - min that overflows float32, a sum x + r that overflows.
// `adjacent`: the two values of an overflowing range sit in one group of 32, so that they
// share a bucket of every size (statistics cases: candidates differ in bucket size, and a
// lone +-3e38 in a bucket is a separate edge case, check_stats_huge_values).
void inject_specials(Dataset& d, const qc::Job& job, const Shifts& s, bool adjacent, Rng& rng) {
  if (job.count == 0) return;
  const bool residual = !d.residual.empty();
  const uint64_t in0 = s.input + job.element_offset;
  const uint64_t res0 = s.residual + job.element_offset;
  // Each value is touched once: a later special overwriting half of an earlier one (one of
  // an overflowing pair) could leave a lone +-3e38, which is check_stats_huge_values' case.
  std::vector<uint64_t> used;
  const auto fresh = [&](uint64_t at) { return std::find(used.begin(), used.end(), at) == used.end(); };
  const uint64_t k = 1 + below(rng, 3);
  for (uint64_t n = 0; n < k; ++n) {
    const uint64_t i = below(rng, job.count);
    if (!fresh(i)) continue;
    used.push_back(i);
    switch (below(rng, 5)) {
      case 0:
      case 1: put_special(d, in0 + i, kNonFinite[below(rng, std::size(kNonFinite))]); break;
      case 2: {  // a range that overflows: +3e38 and -3e38 in one bucket
        const uint64_t unit = adjacent ? quant::kGroupElements : job.params.bucket;
        const uint64_t bucket_first = i / unit * unit;
        const uint64_t n_bucket = std::min<uint64_t>(unit, job.count - bucket_first);
        if (n_bucket < 2) break;
        const uint64_t i1 = bucket_first + below(rng, n_bucket);
        uint64_t i2 = bucket_first + below(rng, n_bucket);
        if (i2 == i1) i2 = i1 + 1 < bucket_first + n_bucket ? i1 + 1 : bucket_first;
        if ((i1 != i && !fresh(i1)) || (i2 != i && !fresh(i2))) break;
        used.push_back(i1);
        used.push_back(i2);
        if (d.dtype != DType::kFloat16) {  // bfloat16 keeps float32's range
          store_from_float(d.input.data(), d.dtype, in0 + i1, 3.0e38f);
          store_from_float(d.input.data(), d.dtype, in0 + i2, -3.0e38f);
        } else if (residual) {
          d.residual[res0 + i1] = 3.0e38f;
          d.residual[res0 + i2] = -3.0e38f;
        }
        break;
      }
      case 3:
        if (residual) d.residual[res0 + i] = bits_float(0x7fc00000u);
        break;
      case 4:  // finite input and residual whose float32 sum overflows to infinity
        if (residual && d.dtype != DType::kFloat16) {
          store_from_float(d.input.data(), d.dtype, in0 + i, 3.0e38f);
          d.residual[res0 + i] = 3.0e38f;
        }
        break;
    }
  }
}

// Fills a case's arrays: each job's range from a distribution (random per job unless
// `dist` is given) with a residual of a random kind, some jobs with non-finite values;
// the gaps with other values (no kernel may read them).
void fill(Dataset& d, const Layout& l, const Shifts& s, bool residual, std::optional<Dist> dist, double special_chance,
          bool adjacent_pairs, Rng& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const uint64_t n_in = s.input + l.elements;
  d.input.assign(n_in * dtype_size(d.dtype), 0);
  for (uint64_t i = 0; i < n_in; ++i) store_from_float(d.input.data(), d.dtype, i, normal(rng));
  d.residual.clear();
  if (residual) {
    d.residual.resize(s.residual + l.elements);
    for (float& v : d.residual) v = 0.01f * normal(rng);
  }
  for (const qc::Job& job : l.jobs) {
    const Dist jd = dist ? *dist : random_dist(rng);
    const Drawn v = draw(jd, d.dtype, job.count, job.params.bucket, rng);
    for (uint64_t i = 0; i < job.count; ++i)
      store_from_float(d.input.data(), d.dtype, s.input + job.element_offset + i, v.values[i]);
    if (residual) {
      // Mostly a small fraction of the value (what error feedback leaves), sometimes +0 or
      // -0 (constant buckets stay constant, signed zeros meet), sometimes independent.
      const uint64_t kind = jd == Dist::kConstant && chance(rng, 0.5) ? 1 : below(rng, 10);
      float* r = d.residual.data() + s.residual + job.element_offset;
      for (uint64_t i = 0; i < job.count; ++i) {
        if (kind < 6)
          r[i] = v.values[i] * 0.01f * normal(rng);
        else if (kind < 8)
          r[i] = kind == 6 ? 0.0f : -0.0f;
        else
          r[i] = static_cast<float>(v.scale * 0.01) * normal(rng);
      }
    }
    if (chance(rng, special_chance)) inject_specials(d, job, s, adjacent_pairs, rng);
  }
}

QuantParams random_params(Rng& rng, std::initializer_list<uint32_t> buckets) {
  QuantParams p;
  p.bits = static_cast<int>(1 + below(rng, 8));
  p.bucket = pick(rng, buckets);
  p.rounding = chance(rng, 0.5) ? Rounding::kStochastic : Rounding::kNearest;
  return p;
}

// Sizes that stress the edges: tiny, around a group, around 1024 (one window), around the
// bucket, a few buckets and a bit, or anything up to cap.
uint64_t random_count(Rng& rng, uint32_t bucket, uint64_t cap) {
  switch (below(rng, 6)) {
    case 0: return pick<uint64_t>(rng, {0, 1, 2, 3, 31, 32, 33, 127, 128, 129});
    case 1: return pick<uint64_t>(rng, {1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097});
    case 2: {
      const int64_t v = static_cast<int64_t>((1 + below(rng, 4)) * bucket) + static_cast<int64_t>(below(rng, 7)) - 3;
      return static_cast<uint64_t>(std::max<int64_t>(v, 0));
    }
    default: return 1 + below(rng, cap);
  }
}

// A first element on a multiple of `unit` (a bucket, or a multiple of every candidate's
// bucket), such that first + count stays within the 2^34 elements of a layer: often 0,
// sometimes far into the layer (the noise counter's high bits) or at its very end.
uint64_t random_first(Rng& rng, uint64_t unit, uint64_t count) {
  const uint64_t last = (kMaxLayerElements - count) / unit;  // largest multiple index allowed
  switch (below(rng, 4)) {
    case 0: return 0;
    case 1: return unit * std::min<uint64_t>(below(rng, 8), last);
    case 2: return unit * std::min<uint64_t>(below(rng, 1000000), last);
    default: return unit * (last - below(rng, std::min<uint64_t>(last + 1, 4)));
  }
}

NoiseKey random_noise(Rng& rng) {
  NoiseKey k;
  k.seed = rng();
  k.rank = static_cast<uint32_t>(below(rng, 2) ? rng() : below(rng, 8));
  k.step = below(rng, 2) ? rng() : below(rng, 1000);
  k.layer = static_cast<uint32_t>(below(rng, 2) ? rng() : below(rng, 100));
  return k;
}

// ---------------------------------------------------------------------------------------
// Encode, decode and decode-accumulate

struct EncodeCase {
  std::string name;
  DType dtype = DType::kFloat32;
  Layout layout;
  Shifts shift;
  Dataset data;
  bool residual = false;        // error feedback
  bool use_skip = false;        // pass skip_residual flags
  bool use_counter = true;      // pass a non-finite bucket counter
  std::vector<uint8_t> skip;    // per layer index (all 0 when !use_skip)
  NoiseKey noise;
  bool single = false;          // through the one-slice functions (one job, layer 0)
  Alignment alignment = Alignment::kVector;
};

struct EncodeCaseOptions {
  bool residual = false;
  bool skip = false;
  bool counter = true;
  bool single = false;
  double special_chance = 0.2;
  std::optional<Dist> dist;
};

EncodeCase make_encode_case(std::string name, DType dtype, const std::vector<JobShape>& shapes, Alignment alignment,
                            const EncodeCaseOptions& o, Rng& rng) {
  EncodeCase c;
  c.dtype = dtype;
  c.alignment = alignment;
  c.layout = lay_out(shapes, alignment, rng);
  c.shift = random_shifts(alignment, rng);
  c.residual = o.residual;
  c.use_skip = o.skip && o.residual;
  c.use_counter = o.counter;
  c.single = o.single;
  c.noise = random_noise(rng);
  c.skip.assign(layer_count(c.layout), 0);
  if (c.use_skip)
    for (uint8_t& f : c.skip)
      if (chance(rng, 0.3)) f = pick<uint8_t>(rng, {1, 2, 0x80, 0xff});  // any nonzero byte skips
  c.data.dtype = dtype;
  fill(c.data, c.layout, c.shift, o.residual, o.dist, o.special_chance, false, rng);
  c.name = strf("%s [%s%s%s%s, %s, %s]", name.c_str(), dtype_name(dtype), o.residual ? ", error feedback" : "",
                c.use_skip ? ", skip flags" : "", o.counter ? "" : ", no counter", alignment_name(alignment),
                layout_text(c.layout).c_str());
  return c;
}

struct EncodeOutput {
  std::vector<uint8_t> payload;  // the whole buffer, shift included
  std::vector<float> residual;   // the whole buffer (empty without error feedback)
  unsigned long long counter = kCounterStart;
};

std::vector<uint8_t> poisoned_payload(const EncodeCase& c) {
  return std::vector<uint8_t>(c.shift.payload + c.layout.payload_bytes, kPoisonByte);
}

// What the CPU reference makes of the case, job by job (quant::encode on each slice).
EncodeOutput cpu_encode(const EncodeCase& c) {
  EncodeOutput out;
  out.payload = poisoned_payload(c);
  out.residual = c.data.residual;
  const size_t width = dtype_size(c.dtype);
  for (const qc::Job& job : c.layout.jobs) {
    NoiseKey key = c.noise;
    key.layer += job.layer;  // the batch key's layer plus the job's (uint32 arithmetic, as the kernels)
    const bool use_residual = c.residual && !(c.use_skip && c.skip[job.layer] != 0);
    const Slice in{c.data.input.data() + (c.shift.input + job.element_offset) * width, job.count, job.first_element};
    float* residual = use_residual ? out.residual.data() + c.shift.residual + job.element_offset : nullptr;
    const std::span<uint8_t> payload(out.payload.data() + c.shift.payload + job.byte_offset,
                                     quant::encoded_bytes(job.params, job.count));
    out.counter += quant::encode(job.params, key, c.dtype, in, residual, payload).nonfinite_buckets;
  }
  return out;
}

struct EncodeDevice {
  DeviceBuffer input, residual, payload, skip, counter;
};

EncodeDevice upload_encode(const EncodeCase& c, const CudaStream& s) {
  EncodeDevice d;
  d.input = DeviceBuffer(c.data.input.size());
  d.residual = DeviceBuffer(c.data.residual.size() * sizeof(float));
  d.payload = DeviceBuffer(c.shift.payload + c.layout.payload_bytes);
  d.skip = DeviceBuffer(c.skip.size());
  d.counter = DeviceBuffer(sizeof(unsigned long long));
  upload(d.input, c.data.input, s);
  upload(d.residual, c.data.residual, s);
  upload(d.payload, poisoned_payload(c), s);
  upload(d.skip, c.skip, s);
  upload(d.counter, std::vector<unsigned long long>{kCounterStart}, s);
  return d;
}

qc::EncodeBatch encode_batch(const EncodeCase& c, const EncodeDevice& d, std::span<const qc::Job> jobs) {
  qc::EncodeBatch b;
  b.jobs = jobs;
  b.input = d.input.get() + c.shift.input * dtype_size(c.dtype);
  b.input_dtype = c.dtype;
  b.residual = c.residual ? reinterpret_cast<float*>(d.residual.get()) + c.shift.residual : nullptr;
  b.skip_residual = c.use_skip ? d.skip.get() : nullptr;
  b.payload = d.payload.get() + c.shift.payload;
  b.noise = c.noise;
  b.nonfinite_buckets = c.use_counter ? reinterpret_cast<unsigned long long*>(d.counter.get()) : nullptr;
  return b;
}

// Enqueues the case's encode on s (the batch call, or the one-slice call for c.single).
void enqueue_encode(const EncodeCase& c, const EncodeDevice& d, std::span<const qc::Job> jobs, const CudaStream& s) {
  const qc::EncodeBatch b = encode_batch(c, d, jobs);
  if (!c.single) {
    qc::encode(b, s.get());
    return;
  }
  const qc::Job& job = jobs[0];
  const Slice in{static_cast<const uint8_t*>(b.input) + job.element_offset * dtype_size(c.dtype), job.count,
                 job.first_element};
  qc::encode(job.params, c.noise, c.dtype, in, b.residual ? b.residual + job.element_offset : nullptr,
             b.payload + job.byte_offset, quant::encoded_bytes(job.params, job.count), s.get(), b.nonfinite_buckets);
}

EncodeOutput download_encode(const EncodeCase& c, const EncodeDevice& d, const CudaStream& s) {
  EncodeOutput out;
  out.payload = download<uint8_t>(d.payload, c.shift.payload + c.layout.payload_bytes, s);
  out.residual = download<float>(d.residual, c.data.residual.size(), s);
  out.counter = download<unsigned long long>(d.counter, 1, s)[0];
  return out;
}

// Compares an encode's results with the reference's; the counter only when one was passed.
void compare_encode(Report& r, const char* kind, const EncodeCase& c, const EncodeOutput& got, const EncodeOutput& want,
                    const std::string& label) {
  const std::string name = c.name + label;
  bool ok = compare_buffers(
      r, kind, name, "payload", got.payload, want.payload, 1,
      [&](uint64_t i) { return describe_payload_byte(c.layout, c.shift.payload, i); }, "");
  ok = compare_buffers(
           r, kind, name, "residual", bytes_of(got.residual), bytes_of(want.residual), 4,
           [&](uint64_t i) { return describe_element(c.layout, c.shift.residual, i); }, "") &&
       ok;
  const unsigned long long want_counter = c.use_counter ? want.counter : kCounterStart;
  if (got.counter != want_counter) {
    r.fail(kind, name,
           strf("non-finite bucket counter: GPU %llu, CPU report %llu (both counted from %llu)", got.counter,
                want_counter, kCounterStart));
    ok = false;
  }
  if (ok)
    r.pass(kind, name,
           strf("payload %s bytes and residual %s values identical, %llu non-finite bucket(s)%s",
                cli::thousands(got.payload.size()).c_str(), cli::thousands(got.residual.size()).c_str(),
                want.counter - kCounterStart, c.use_counter ? " counted" : ""));
}

// The output arrays of decode (poison everywhere) and decode-accumulate (poison in the
// gaps, accumulators with finite values and a few infinities in the jobs' ranges).
std::vector<uint8_t> initial_output(const EncodeCase& c, DType out, bool accumulate, Rng& rng) {
  const uint64_t n = c.shift.output + c.layout.elements;
  std::vector<uint8_t> o(n * dtype_size(out), kPoisonByte);
  if (!accumulate) return o;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* acc = reinterpret_cast<float*>(o.data());
  for (const qc::Job& job : c.layout.jobs)
    for (uint64_t i = 0; i < job.count; ++i) {
      float v = normal(rng) * 10.0f;
      if (chance(rng, 0.001)) v = chance(rng, 0.5) ? bits_float(0x7f800000u) : bits_float(0xff800000u);
      acc[c.shift.output + job.element_offset + i] = v;
    }
  return o;
}

std::vector<uint8_t> cpu_decode(const EncodeCase& c, const std::vector<uint8_t>& payload, DType out, bool accumulate,
                                std::vector<uint8_t> output) {
  const size_t width = dtype_size(out);
  for (const qc::Job& job : c.layout.jobs) {
    const std::span<const uint8_t> in(payload.data() + c.shift.payload + job.byte_offset,
                                      quant::encoded_bytes(job.params, job.count));
    uint8_t* at = output.data() + (c.shift.output + job.element_offset) * width;
    if (accumulate)
      quant::decode_accumulate(job.params, in, job.count, reinterpret_cast<float*>(at));
    else
      quant::decode(job.params, in, job.count, out, at);
  }
  return output;
}

void enqueue_decode(const EncodeCase& c, const uint8_t* device_payload, DType out, bool accumulate,
                    uint8_t* device_output, std::span<const qc::Job> jobs, const CudaStream& s) {
  const uint8_t* payload = device_payload + c.shift.payload;
  uint8_t* output = device_output + c.shift.output * dtype_size(out);
  if (!c.single) {
    const qc::DecodeBatch b{jobs, payload, output, out};
    if (accumulate)
      qc::decode_accumulate(b, s.get());
    else
      qc::decode(b, s.get());
    return;
  }
  const qc::Job& job = jobs[0];
  const uint64_t bytes = quant::encoded_bytes(job.params, job.count);
  uint8_t* at = output + job.element_offset * dtype_size(out);
  if (accumulate)
    qc::decode_accumulate(job.params, payload + job.byte_offset, bytes, job.count, reinterpret_cast<float*>(at), s.get());
  else
    qc::decode(job.params, payload + job.byte_offset, bytes, job.count, out, at, s.get());
}

void check_decode(Report& r, const EncodeCase& c, const std::vector<uint8_t>& payload, DType out, bool accumulate,
                  const CudaStream& s, Rng& rng) {
  const char* kind = accumulate ? "decode_acc" : "decode";
  const std::string name = c.name + (accumulate ? "" : strf(" -> %s", dtype_name(out)));
  const std::vector<uint8_t> initial = initial_output(c, out, accumulate, rng);
  const std::vector<uint8_t> want = cpu_decode(c, payload, out, accumulate, initial);
  DeviceBuffer p(payload.size()), o(initial.size());
  upload(p, payload, s);
  upload(o, initial, s);
  try {
    enqueue_decode(c, p.get(), out, accumulate, o.get(), c.layout.jobs, s);
  } catch (const CodecError& e) {
    r.fail(kind, name, std::string("the API rejected a valid batch: ") + e.what());
    return;
  } catch (const qc::CudaError& e) {
    r.fail(kind, name, std::string("launch failed: ") + e.what());
    return;
  }
  const std::vector<uint8_t> got = download<uint8_t>(o, initial.size(), s);
  const uint32_t width = static_cast<uint32_t>(dtype_size(out));
  compare_buffers(
      r, kind, name, accumulate ? "accumulators" : "output", got, want, width,
      [&](uint64_t i) { return describe_element(c.layout, c.shift.output, i); },
      strf("%s %s values identical, gaps untouched", cli::thousands(got.size() / width).c_str(), dtype_name(out)));
}

// One encode case: the GPU's encode against the CPU's, then every decode of the CPU's payload.
void check_encode_case(Report& r, const EncodeCase& c, const CudaStream& s, Rng& rng) {
  EncodeOutput want;
  try {
    want = cpu_encode(c);
  } catch (const CodecError& e) {
    r.fail("harness", c.name, std::string("the CPU reference rejected the case (a bug of this program): ") + e.what());
    return;
  }
  const EncodeDevice d = upload_encode(c, s);
  try {
    enqueue_encode(c, d, c.layout.jobs, s);
  } catch (const CodecError& e) {
    r.fail("encode", c.name, std::string("the API rejected a valid batch: ") + e.what());
    return;
  } catch (const qc::CudaError& e) {
    r.fail("encode", c.name, std::string("launch failed: ") + e.what());
    return;
  }
  const EncodeOutput got = download_encode(c, d, s);
  const std::vector<uint8_t> input_after = download<uint8_t>(d.input, c.data.input.size(), s);
  if (input_after != c.data.input) r.fail("encode", c.name, "the input array changed (encode must only read it)");
  compare_encode(r, "encode", c, got, want, "");
  for (DType out : kDTypes) check_decode(r, c, want.payload, out, false, s, rng);
  check_decode(r, c, want.payload, DType::kFloat32, true, s, rng);
}

// ---------------------------------------------------------------------------------------
// The encode cases

constexpr std::initializer_list<uint32_t> kMainBuckets = {32, 128, 1024, 4096};
constexpr std::initializer_list<uint32_t> kMoreBuckets = {32, 64, 96, 128, 256, 512, 992, 1024, 1056, 2048, 3072, 4096};

std::vector<EncodeCase> encode_cases(bool quick, Rng& rng) {
  std::vector<EncodeCase> cases;
  const Alignment alignments[] = {Alignment::kVector, Alignment::kMisaligned, Alignment::kMixed};
  size_t turn = 0;
  const auto next_alignment = [&] { return alignments[turn++ % 3]; };

  // Every bit width with each of the four main bucket sizes, in one batch per element type,
  // error feedback or not, and rounding.
  for (DType t : kDTypes)
    for (bool residual : {false, true})
      for (Rounding rounding : {Rounding::kStochastic, Rounding::kNearest}) {
        if (quick && !((t == DType::kFloat32 && residual && rounding == Rounding::kStochastic) ||
                       (t == DType::kFloat16 && !residual && rounding == Rounding::kNearest) ||
                       (t == DType::kBFloat16 && residual && rounding == Rounding::kNearest)))
          continue;
        std::vector<JobShape> shapes;
        for (int bits = 1; bits <= 8; ++bits)
          for (uint32_t bucket : kMainBuckets) {
            JobShape s;
            s.params = QuantParams{bits, bucket, rounding};
            s.count = random_count(rng, bucket, 6000);
            s.first_element = random_first(rng, bucket, s.count);
            s.layer = static_cast<uint32_t>(shapes.size());
            shapes.push_back(s);
          }
        EncodeCaseOptions o;
        o.residual = residual;
        o.skip = residual && chance(rng, 0.5);
        cases.push_back(make_encode_case(strf("bits 1-8 x buckets 32/128/1024/4096, %s", rounding_name(rounding)), t,
                                         shapes, next_alignment(), o, rng));
      }

  // Many jobs of random parameters: several launches of 64 jobs, shared layer indices.
  for (int n = 0; n < (quick ? 2 : 10); ++n) {
    const uint64_t jobs = 65 + below(rng, quick ? 40 : 140);
    std::vector<JobShape> shapes;
    for (uint64_t j = 0; j < jobs; ++j) {
      JobShape s;
      s.params = random_params(rng, kMoreBuckets);
      s.count = random_count(rng, s.params.bucket, 2500);
      s.first_element = random_first(rng, s.params.bucket, s.count);
      s.layer = static_cast<uint32_t>(below(rng, jobs / 2 + 1));
      shapes.push_back(s);
    }
    EncodeCaseOptions o;
    o.residual = n % 4 != 3;
    o.skip = chance(rng, 0.6);
    o.counter = n != 2;
    o.special_chance = 0.25;
    cases.push_back(make_encode_case("many jobs", kDTypes[n % 3], shapes, next_alignment(), o, rng));
  }

  // Only empty jobs: nothing is launched and nothing changes.
  {
    std::vector<JobShape> shapes(5);
    for (size_t j = 0; j < shapes.size(); ++j) shapes[j].layer = static_cast<uint32_t>(j);
    EncodeCaseOptions o;
    o.residual = true;
    cases.push_back(make_encode_case("empty jobs only", DType::kFloat32, shapes, Alignment::kVector, o, rng));
  }

  // One element.
  for (DType t : kDTypes) {
    if (quick && t != DType::kBFloat16) continue;
    JobShape s;
    s.params = random_params(rng, kMainBuckets);
    s.count = 1;
    EncodeCaseOptions o;
    o.residual = true;
    o.special_chance = 0.0;
    cases.push_back(make_encode_case("one element", t, {s}, Alignment::kVector, o, rng));
  }

  // Around one window (1024) with buckets of one, two and four windows.
  for (DType t : kDTypes) {
    if (quick && t != DType::kFloat32) continue;
    std::vector<JobShape> shapes;
    for (uint32_t bucket : {1024u, 2048u, 4096u})
      for (uint64_t count : {1023, 1024, 1025, 2047, 2048, 2049, 3071, 4095, 4096, 4097, 8193}) {
        JobShape s;
        s.params = QuantParams{static_cast<int>(1 + below(rng, 8)), bucket,
                               chance(rng, 0.5) ? Rounding::kStochastic : Rounding::kNearest};
        s.count = count;
        s.first_element = random_first(rng, bucket, count);
        s.layer = static_cast<uint32_t>(shapes.size());
        shapes.push_back(s);
      }
    EncodeCaseOptions o;
    o.residual = t != DType::kFloat16;
    o.special_chance = 0.15;
    cases.push_back(make_encode_case("around 1024 values", t, shapes, next_alignment(), o, rng));
  }

  // Buckets of many windows, up to the largest bucket allowed.
  {
    std::vector<JobShape> shapes;
    const std::vector<std::pair<uint32_t, uint64_t>> big =
        quick ? std::vector<std::pair<uint32_t, uint64_t>>{{65536, 65536 + 1000}}
              : std::vector<std::pair<uint32_t, uint64_t>>{
                    {16384, 3 * 16384 - 7}, {65536, 2 * 65536 + 5}, {uint32_t{1} << 20, (uint64_t{1} << 20) + 77}};
    for (const auto& [bucket, count] : big) {
      JobShape s;
      s.params = QuantParams{static_cast<int>(1 + below(rng, 8)), bucket, Rounding::kStochastic};
      s.count = count;
      s.layer = static_cast<uint32_t>(shapes.size());
      shapes.push_back(s);
    }
    EncodeCaseOptions o;
    o.residual = true;
    o.special_chance = 0.3;
    cases.push_back(make_encode_case("large buckets", quick ? DType::kFloat32 : DType::kBFloat16, shapes,
                                     Alignment::kMixed, o, rng));
  }

  // Noise keys at their extremes: elements near 2^34 (the counter's top bits), a step
  // above 2^32 (only the low word counts), the batch layer wrapping around 2^32.
  {
    std::vector<JobShape> shapes;
    for (int j = 0; j < 24; ++j) {
      JobShape s;
      s.params = random_params(rng, kMainBuckets);
      s.params.rounding = Rounding::kStochastic;
      s.count = 1 + below(rng, 3000);
      s.first_element = (kMaxLayerElements - s.count) / s.params.bucket * s.params.bucket;
      s.layer = static_cast<uint32_t>(j);
      shapes.push_back(s);
    }
    EncodeCaseOptions o;
    o.residual = true;
    o.special_chance = 0.0;
    EncodeCase c = make_encode_case("noise key extremes", DType::kFloat32, shapes, Alignment::kVector, o, rng);
    c.noise.seed = 0xfedcba9876543210ull;
    c.noise.rank = 0xffffffffu;
    c.noise.step = (uint64_t{7} << 32) + 5;
    c.noise.layer = 0xfffffff0u;  // + job layers up to 23: wraps
    cases.push_back(std::move(c));
  }

  // Each distribution on its own.
  for (Dist dist : kAllDists) {
    if (quick && dist != Dist::kTiny && dist != Dist::kConstant && dist != Dist::kSignedZeros) continue;
    std::vector<JobShape> shapes;
    for (int j = 0; j < 12; ++j) {
      JobShape s;
      s.params = random_params(rng, kMoreBuckets);
      s.count = random_count(rng, s.params.bucket, 5000);
      s.first_element = random_first(rng, s.params.bucket, s.count);
      s.layer = static_cast<uint32_t>(j);
      shapes.push_back(s);
    }
    EncodeCaseOptions o;
    o.residual = dist != Dist::kConstant && dist != Dist::kSignedZeros ? chance(rng, 0.6) : false;
    o.special_chance = 0.0;
    o.dist = dist;
    // float32 for subnormal values (float16's subnormals are normal float32 values).
    const DType t = dist == Dist::kTiny ? DType::kFloat32 : kDTypes[turn % 3];
    cases.push_back(make_encode_case(strf("%s values", dist_name(dist)), t, shapes, next_alignment(), o, rng));
  }

  // Every bucket non-finite: the counter counts them all, residuals stay.
  {
    std::vector<JobShape> shapes;
    for (int j = 0; j < 6; ++j) {
      JobShape s;
      s.params = random_params(rng, kMainBuckets);
      s.count = 1 + below(rng, 5000);
      s.layer = static_cast<uint32_t>(j);
      shapes.push_back(s);
    }
    EncodeCaseOptions o;
    o.residual = true;
    o.special_chance = 0.0;
    EncodeCase c = make_encode_case("every bucket non-finite", DType::kFloat16, shapes, Alignment::kMixed, o, rng);
    for (const qc::Job& job : c.layout.jobs)
      for (uint64_t b = 0; b < job.count; b += job.params.bucket)
        put_special(c.data, c.shift.input + job.element_offset + b + below(rng, std::min<uint64_t>(job.params.bucket, job.count - b)),
                    kNonFinite[below(rng, std::size(kNonFinite))]);
    cases.push_back(std::move(c));
  }

  // The one-slice functions.
  for (int n = 0; n < (quick ? 2 : 6); ++n) {
    JobShape s;
    s.params = random_params(rng, kMainBuckets);
    s.count = n == 0 ? 0 : n == 1 ? 1 : random_count(rng, s.params.bucket, 20000);
    s.first_element = random_first(rng, s.params.bucket, s.count);
    EncodeCaseOptions o;
    o.residual = n % 2 == 0;
    o.counter = n != 3;
    o.single = true;
    o.special_chance = 0.3;
    cases.push_back(make_encode_case("one-slice API", kDTypes[n % 3], {s}, n % 2 ? Alignment::kMisaligned : Alignment::kVector, o, rng));
  }
  return cases;
}

// ---------------------------------------------------------------------------------------
// Error statistics

struct StatsCase {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<CodecSpec> candidates;
  Layout layout;  // jobs' params only say which bucket the input patterns follow
  Shifts shift;
  Dataset data;
  bool residual = false;
  uint32_t layers = 1;
  double weight = 1.0;
  std::vector<double> squared_init;  // layers x candidates
  std::vector<uint8_t> flags_init;   // layers
};

struct StatsOutput {
  std::vector<double> squared;
  std::vector<uint8_t> flags;
};

// What the CPU reference says, per layer: weight x the sum over the layer's jobs of each
// candidate's error (measure_candidates on the job's slice), whether any job saw a
// non-finite bucket, and float32's resolution of each value (kStatsResolution).
struct StatsExpected {
  std::vector<double> added;       // layers x candidates
  std::vector<double> resolution;  // layers x candidates
  std::vector<uint8_t> nonfinite;
  std::vector<uint32_t> jobs;  // non-empty jobs per layer (0: the layer's row must stay as it was)
};

// Adds weight x sum over the job's finite buckets of n x unit x (range + max |v|) x
// kStatsResolution to each quant candidate's resolution (`none` has no code positions: its
// GPU and CPU sums differ by summation order and float32 underflow only).
void add_resolution(const StatsCase& c, const qc::Job& job, const uint8_t* in, const float* residual,
                    std::vector<double>& resolution) {
  const size_t n_c = c.candidates.size();
  std::vector<float> v(job.count);
  for (uint64_t i = 0; i < job.count; ++i) {
    const float x = load_as_float(in, c.dtype, i);
    v[i] = residual ? x + residual[i] : x;
  }
  for (size_t k = 0; k < n_c; ++k) {
    // Any float32 square or product below 2^-149 is 0 (the GPU squares `none`'s rounding
    // error in float32, the CPU in double): one such unit per element.
    resolution[job.layer * n_c + k] += c.weight * static_cast<double>(job.count) * 0x1p-149;
    if (c.candidates[k].family() != CodecFamily::kQuant) continue;
    const QuantParams& p = c.candidates[k].quant_params();
    const double top = static_cast<double>(quant::max_code(p.bits));
    double sum = 0.0;
    for (uint64_t b = 0; b < job.count; b += p.bucket) {
      const uint64_t n = std::min<uint64_t>(p.bucket, job.count - b);
      double lo = INFINITY, hi = -INFINITY;
      bool finite = true;
      for (uint64_t i = b; i < b + n; ++i) {
        finite = finite && quant::is_finite_value(v[i]);
        lo = std::min(lo, static_cast<double>(v[i]));
        hi = std::max(hi, static_cast<double>(v[i]));
      }
      if (!finite) continue;  // the statistic is +inf there
      const double range = hi - lo;
      sum += static_cast<double>(n) * (range / top) * (range + std::max(std::fabs(lo), std::fabs(hi)));
    }
    resolution[job.layer * n_c + k] += c.weight * sum * kStatsResolution;
  }
}

StatsExpected cpu_stats(const StatsCase& c) {
  const size_t n_c = c.candidates.size();
  StatsExpected e;
  e.added.assign(c.layers * n_c, 0.0);
  e.resolution.assign(c.layers * n_c, 0.0);
  e.nonfinite.assign(c.layers, 0);
  e.jobs.assign(c.layers, 0);
  const size_t width = dtype_size(c.dtype);
  for (const qc::Job& job : c.layout.jobs) {
    if (job.count == 0) continue;
    const uint8_t* in = c.data.input.data() + (c.shift.input + job.element_offset) * width;
    const float* residual = c.residual ? c.data.residual.data() + c.shift.residual + job.element_offset : nullptr;
    const CandidateReport report =
        measure_candidates(c.candidates, c.dtype, Slice{in, job.count, job.first_element}, residual);
    for (size_t k = 0; k < n_c; ++k) e.added[job.layer * n_c + k] += c.weight * report.candidates[k].squared_error;
    if (report.nonfinite_buckets > 0) e.nonfinite[job.layer] = 1;
    ++e.jobs[job.layer];
    add_resolution(c, job, in, residual, e.resolution);
  }
  return e;
}

int candidate_kind(const CodecSpec& spec) {
  if (spec.family() != CodecFamily::kQuant) return kKindNone;
  return spec.quant_params().rounding == Rounding::kStochastic ? kKindStochastic : kKindNearest;
}

std::string bits_text(double v) {
  uint64_t u;
  memcpy(&u, &v, 8);
  return strf("%.9g (0x%016llx)", v, static_cast<ull>(u));
}

// Checks the GPU's rows and flags against the reference: untouched layers exactly as
// initialised, +inf where the CPU says +inf, otherwise within the tolerance.
bool compare_stats(Report& r, const StatsCase& c, const StatsExpected& e, const StatsOutput& got,
                   const std::string& label) {
  const size_t n_c = c.candidates.size();
  const std::string name = c.name + label;
  std::vector<std::string> problems;
  uint64_t bad = 0;
  uint64_t cpu_nan = 0;
  for (uint32_t l = 0; l < c.layers; ++l) {
    const uint8_t want_flag = (c.flags_init[l] != 0 || e.nonfinite[l] != 0) ? 1 : 0;
    const bool flag_ok = e.jobs[l] ? (got.flags[l] != 0) == (want_flag != 0) : got.flags[l] == c.flags_init[l];
    if (!flag_ok) {
      ++bad;
      if (problems.size() < 3)
        problems.push_back(strf("layer %u non-finite flag: GPU %u, expected %u", l, got.flags[l],
                                e.jobs[l] ? want_flag : c.flags_init[l]));
    }
    for (size_t k = 0; k < n_c; ++k) {
      const size_t at = l * n_c + k;
      const double init = c.squared_init[at];
      const double g = got.squared[at];
      const double added = e.added[at];
      const std::string where = strf("layer %u candidate %zu (%s)", l, k, c.candidates[k].str().c_str());
      bool ok;
      if (e.jobs[l] == 0) {
        ok = memcmp(&g, &init, 8) == 0;
      } else if (std::isinf(added)) {
        ok = std::isinf(g) && g > 0;
      } else {
        const double want = init + added;
        const double diff = std::fabs(g - want);
        // The kernels add each job's sum to the row in turn, the CPU sums the jobs first:
        // one double rounding per job apart.
        const double rounding = (e.jobs[l] + 1) * 0x1p-52 * (std::fabs(init) + std::fabs(added));
        const double relative_allowance = kStatsRelTolerance * std::fabs(added) + rounding;
        ok = std::isfinite(g) && std::isfinite(added) && diff <= relative_allowance + e.resolution[at];
        if (std::isfinite(g) && std::isfinite(added)) {
          const double beyond = std::max(0.0, diff - rounding);
          const double relative = added != 0.0 ? beyond / std::fabs(added) : (beyond == 0.0 ? 0.0 : INFINITY);
          r.stats_value(candidate_kind(c.candidates[k]), relative, ok && diff > relative_allowance,
                        std::fabs(added) > 100.0 * e.resolution[at], c.name + ", " + where);
          if (ok && diff > relative_allowance)
            r.note(strf("stats %s, %s: relative difference %.3g, %.3g of its float32 resolution (CPU %.9g, GPU %.9g)",
                        c.name.c_str(), where.c_str(), relative, diff / e.resolution[at], init + added, g));
        }
      }
      if (!ok) {
        ++bad;
        if (std::isnan(added)) ++cpu_nan;
        if (problems.size() < 3)
          problems.push_back(strf("%s: GPU %s, CPU %s (initial %g, allowed difference %.3g)", where.c_str(),
                                  bits_text(g).c_str(), bits_text(init + added).c_str(), init,
                                  kStatsRelTolerance * std::fabs(added) + e.resolution[at]));
      }
    }
  }
  if (bad == 0) {
    r.pass("stats", name,
           strf("%u layers x %zu candidates within %.0e relative (+ float32 resolution), flags equal", c.layers, n_c,
                kStatsRelTolerance));
    return true;
  }
  std::string detail = strf("%llu of %zu values or flags differ", static_cast<ull>(bad), c.layers * (n_c + 1));
  if (cpu_nan > 0)
    detail += strf(" (%llu of them NaN in the CPU reference itself)", static_cast<ull>(cpu_nan));
  for (const std::string& p : problems) detail += "; " + p;
  r.fail("stats", name, detail);
  return false;
}

struct StatsDevice {
  DeviceBuffer input, residual, squared, flags, scratch;
  uint64_t scratch_bytes = 0;
};

StatsDevice upload_stats(const StatsCase& c, const CudaStream& s) {
  StatsDevice d;
  d.input = DeviceBuffer(c.data.input.size());
  d.residual = DeviceBuffer(c.data.residual.size() * sizeof(float));
  d.squared = DeviceBuffer(c.squared_init.size() * sizeof(double));
  d.flags = DeviceBuffer(c.flags_init.size());
  d.scratch_bytes = qc::stats_scratch_bytes(c.layout.jobs, c.candidates);
  d.scratch = DeviceBuffer(d.scratch_bytes);
  upload(d.input, c.data.input, s);
  upload(d.residual, c.data.residual, s);
  upload(d.squared, c.squared_init, s);
  upload(d.flags, c.flags_init, s);
  return d;
}

qc::StatsBatch stats_batch(const StatsCase& c, const StatsDevice& d, std::span<const qc::Job> jobs,
                           std::span<const CodecSpec> candidates) {
  qc::StatsBatch b;
  b.jobs = jobs;
  b.candidates = candidates;
  b.input = d.input.get() + c.shift.input * dtype_size(c.dtype);
  b.input_dtype = c.dtype;
  b.residual = c.residual ? reinterpret_cast<const float*>(d.residual.get()) + c.shift.residual : nullptr;
  b.squared = reinterpret_cast<double*>(d.squared.get());
  b.nonfinite = d.flags.get();
  b.weight = c.weight;
  b.scratch = d.scratch.get();
  b.scratch_bytes = d.scratch_bytes;
  return b;
}

StatsOutput download_stats(const StatsCase& c, const StatsDevice& d, const CudaStream& s) {
  return StatsOutput{download<double>(d.squared, c.squared_init.size(), s), download<uint8_t>(d.flags, c.layers, s)};
}

CodecSpec quant_spec(int bits, uint32_t bucket, Rounding rounding) {
  return CodecSpec::quant(QuantParams{bits, bucket, rounding});
}

std::vector<CodecSpec> usual_candidates(Rounding rounding, bool with_none, uint32_t bucket = 1024) {
  std::vector<CodecSpec> c;
  if (with_none) c.push_back(CodecSpec::none());
  for (int bits = 2; bits <= 8; ++bits) c.push_back(quant_spec(bits, bucket, rounding));
  return c;
}

std::vector<CodecSpec> random_candidates(Rng& rng, size_t count) {
  const uint32_t sizes[] = {32, 64, 96, 128, 256, 1024, 2048, 4096, 16384};
  std::vector<uint32_t> buckets;
  const uint64_t distinct = 1 + below(rng, 3);
  for (uint64_t i = 0; i < distinct; ++i) buckets.push_back(sizes[below(rng, std::size(sizes))]);
  std::vector<CodecSpec> c;
  for (size_t i = 0; i < count; ++i) {
    if (chance(rng, 0.1)) {
      c.push_back(CodecSpec::none());
      continue;
    }
    c.push_back(quant_spec(static_cast<int>(1 + below(rng, 8)), buckets[below(rng, buckets.size())],
                           chance(rng, 0.5) ? Rounding::kStochastic : Rounding::kNearest));
  }
  return c;
}

struct StatsCaseOptions {
  uint64_t jobs = 20;
  uint64_t count_cap = 6000;
  std::optional<Dist> dist;
  double special_chance = 0.15;
  std::optional<DType> dtype;
  std::optional<bool> residual;
};

StatsCase make_stats_case(std::string name, std::vector<CodecSpec> candidates, const StatsCaseOptions& o, Rng& rng) {
  StatsCase c;
  c.candidates = std::move(candidates);
  c.dtype = o.dtype ? *o.dtype : kDTypes[below(rng, 3)];
  c.residual = o.residual ? *o.residual : chance(rng, 0.6);
  // Jobs start on a multiple of every candidate's bucket; their input patterns follow the
  // first quant candidate's bucket.
  uint64_t unit = 1;
  uint32_t pattern_bucket = 1024;
  bool has_quant = false;
  for (const CodecSpec& s : c.candidates)
    if (s.family() == CodecFamily::kQuant) {
      unit = std::lcm(unit, uint64_t{s.quant_params().bucket});
      if (!has_quant) pattern_bucket = s.quant_params().bucket;
      has_quant = true;
    }
  std::vector<JobShape> shapes;
  const uint32_t layers = static_cast<uint32_t>(std::max<uint64_t>(1, o.jobs / 2 + below(rng, o.jobs / 2 + 1)));
  for (uint64_t j = 0; j < o.jobs; ++j) {
    JobShape s;
    s.params.bucket = pattern_bucket;
    s.count = random_count(rng, pattern_bucket, o.count_cap);
    s.first_element = random_first(rng, unit, s.count);
    s.layer = static_cast<uint32_t>(below(rng, layers));  // shared rows: jobs of one layer add up
    shapes.push_back(s);
  }
  const Alignment alignment = pick(rng, {Alignment::kVector, Alignment::kMisaligned, Alignment::kMixed});
  c.layout = lay_out(shapes, alignment, rng);
  c.shift = random_shifts(alignment, rng);
  c.layers = layers;
  c.weight = pick(rng, {1.0, 0.25, 1.0 / 9.0, 0.37});
  c.data.dtype = c.dtype;
  fill(c.data, c.layout, c.shift, c.residual, o.dist, o.special_chance, true, rng);
  // Rows start at zero, or at values the kernels must add to; some flags already set
  // (the kernels never clear one).
  c.squared_init.assign(static_cast<size_t>(c.layers) * c.candidates.size(), 0.0);
  if (chance(rng, 0.5)) {
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (double& v : c.squared_init) v = u(rng) * 1e-3;
  }
  c.flags_init.assign(c.layers, 0);
  for (uint8_t& f : c.flags_init)
    if (chance(rng, 0.1)) f = 1;
  c.name = strf("%s [%zu candidates, %s%s, weight %.3g, %s, %s]", name.c_str(), c.candidates.size(),
                dtype_name(c.dtype), c.residual ? ", with residual" : "", c.weight, alignment_name(alignment),
                layout_text(c.layout).c_str());
  return c;
}

std::vector<StatsCase> stats_cases(bool quick, Rng& rng) {
  std::vector<StatsCase> cases;
  // The controller's usual set: none and bits 2..8 at bucket 1024.
  for (DType t : kDTypes)
    for (bool residual : {false, true}) {
      if (quick && residual == (t == DType::kFloat16)) continue;
      StatsCaseOptions o;
      o.dtype = t;
      o.residual = residual;
      o.jobs = 10 + below(rng, 60);
      cases.push_back(make_stats_case("none + bits 2-8 stochastic", usual_candidates(Rounding::kStochastic, true), o, rng));
    }
  for (int n = 0; n < (quick ? 1 : 2); ++n) {
    StatsCaseOptions o;
    o.jobs = 10 + below(rng, 40);
    cases.push_back(make_stats_case("none + bits 2-8 nearest", usual_candidates(Rounding::kNearest, true), o, rng));
  }
  // Random sets: 1..16 candidates over up to three bucket sizes (separate launches), windows > 1.
  for (int n = 0; n < (quick ? 2 : 10); ++n) {
    StatsCaseOptions o;
    o.jobs = 1 + below(rng, 50);
    cases.push_back(make_stats_case("random candidates", random_candidates(rng, 1 + below(rng, 16)), o, rng));
  }
  // 16 candidates: the kernels' larger register variant.
  for (int n = 0; n < (quick ? 1 : 2); ++n) {
    StatsCaseOptions o;
    o.jobs = 5 + below(rng, 30);
    cases.push_back(make_stats_case("16 candidates", random_candidates(rng, qc::kMaxStatsCandidates), o, rng));
  }
  // `none` alone (its own launch) on the narrow types, where it is not zero.
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    if (quick && t == DType::kBFloat16) continue;
    StatsCaseOptions o;
    o.dtype = t;
    o.residual = true;
    cases.push_back(make_stats_case("none only", {CodecSpec::none()}, o, rng));
  }
  // More than 64 jobs: several tables, rows shared across them.
  for (int n = 0; n < (quick ? 1 : 3); ++n) {
    StatsCaseOptions o;
    o.jobs = 65 + below(rng, 140);
    o.count_cap = 2500;
    o.special_chance = 0.1;
    cases.push_back(make_stats_case("many jobs", n == 0 ? usual_candidates(Rounding::kStochastic, true)
                                                          : random_candidates(rng, 1 + below(rng, 12)),
                                    o, rng));
  }
  // Each distribution with the usual candidates.
  for (Dist dist : kAllDists) {
    if (quick && dist != Dist::kTiny && dist != Dist::kConstant) continue;
    StatsCaseOptions o;
    o.dist = dist;
    o.special_chance = 0.0;
    o.jobs = 8;
    if (dist == Dist::kTiny) o.dtype = DType::kFloat32;  // float16's subnormals are normal float32 values
    cases.push_back(make_stats_case(strf("%s values", dist_name(dist)),
                                    usual_candidates(dist == Dist::kGrid ? Rounding::kNearest : Rounding::kStochastic, true),
                                    o, rng));
  }
  return cases;
}

void check_stats_case(Report& r, const StatsCase& c, const CudaStream& s) {
  StatsExpected want;
  try {
    want = cpu_stats(c);
  } catch (const CodecError& e) {
    r.fail("harness", c.name, std::string("the CPU reference rejected the case (a bug of this program): ") + e.what());
    return;
  }
  StatsDevice d;
  try {
    d = upload_stats(c, s);
    qc::squared_errors(stats_batch(c, d, c.layout.jobs, c.candidates), s.get());
  } catch (const CodecError& e) {
    r.fail("stats", c.name, std::string("the API rejected a valid batch: ") + e.what());
    return;
  } catch (const qc::CudaError& e) {
    r.fail("stats", c.name, std::string("launch failed: ") + e.what());
    return;
  }
  const StatsOutput got = download_stats(c, d, s);
  if (download<uint8_t>(d.input, c.data.input.size(), s) != c.data.input)
    r.fail("stats", c.name, "the input array changed (the statistics must only read it)");
  compare_stats(r, c, want, got, "");
}

// Buckets holding one value of +-3e38 among ordinary ones: every value is finite and so is
// the range, yet unit^2 overflows float32 (unit above ~1.8e19). The CPU reference measures
// round-to-nearest in value space (finite here); a statistic computed as (sum of squared
// code distances) x unit^2 overflows or becomes 0 x inf = NaN. A NaN statistic would
// reach the controller's solver, so NaN fails on either side.
void check_stats_huge_values(Report& r, const CudaStream& s, Rng& rng) {
  StatsCaseOptions o;
  o.dtype = DType::kFloat32;
  o.residual = false;
  o.jobs = 6;
  o.special_chance = 0.0;
  o.dist = Dist::kNormal;
  std::vector<CodecSpec> candidates = {CodecSpec::none()};
  for (int bits : {2, 4, 8}) candidates.push_back(quant_spec(bits, 1024, Rounding::kStochastic));
  for (int bits : {2, 4, 8}) candidates.push_back(quant_spec(bits, 1024, Rounding::kNearest));
  StatsCase c = make_stats_case("one value of +-3e38 in some buckets (unit^2 overflows float32)", candidates, o, rng);
  for (const qc::Job& job : c.layout.jobs)
    for (uint64_t b = 0; b < job.count; b += 2048)  // every other bucket of 1024
      store_from_float(c.data.input.data(), DType::kFloat32,
                       c.shift.input + job.element_offset + b + below(rng, std::min<uint64_t>(1024, job.count - b)),
                       chance(rng, 0.5) ? 3.0e38f : -3.0e38f);
  check_stats_case(r, c, s);
}

// ---------------------------------------------------------------------------------------
// Argument errors: CodecError, thrown before anything is launched. Each bad batch keeps
// 69 valid jobs in front of the bad one (two launches' worth), so an implementation that
// checked one launch's jobs at a time would have launched the first and changed the
// buffers, which are compared with their initial contents afterwards.

template <class Call>
void expect_codec_error(Report& r, const std::string& name, const CudaStream& s, Call&& call,
                        const std::function<std::string()>& changed) {
  try {
    call();
  } catch (const CodecError& e) {
    s.sync();
    const cudaError_t pending = cudaGetLastError();
    const std::string what_changed = changed();
    if (pending != cudaSuccess)
      r.fail("error", name, strf("CodecError thrown, but a CUDA error is pending: %s", cudaGetErrorName(pending)));
    else if (!what_changed.empty())
      r.fail("error", name, "CodecError thrown, but after a launch: " + what_changed + " changed");
    else
      r.pass("error", name, std::string("CodecError before any launch: ") + e.what());
    return;
  } catch (const std::exception& e) {
    s.sync();
    r.fail("error", name, std::string("threw something other than CodecError: ") + e.what());
    return;
  }
  s.sync();
  r.fail("error", name, "no exception: the bad argument was accepted");
}

void check_errors(Report& r, const CudaStream& s, Rng& rng) {
  // A valid batch of 70 jobs (two launches), f32 with error feedback and a counter.
  std::vector<JobShape> shapes;
  for (int j = 0; j < 70; ++j) {
    JobShape sh;
    sh.params = QuantParams{static_cast<int>(1 + below(rng, 8)), 1024, Rounding::kStochastic};
    sh.count = 1 + below(rng, 3000);
    sh.first_element = 1024 * below(rng, 4);
    sh.layer = static_cast<uint32_t>(j);
    shapes.push_back(sh);
  }
  EncodeCaseOptions o;
  o.residual = true;
  o.special_chance = 0.0;
  const EncodeCase c = make_encode_case("errors", DType::kFloat32, shapes, Alignment::kVector, o, rng);
  const EncodeDevice d = upload_encode(c, s);
  const std::vector<uint8_t> payload0 = poisoned_payload(c);
  DeviceBuffer out(c.layout.elements * 4);
  const std::vector<uint8_t> out0(c.layout.elements * 4, kPoisonByte);
  // Restores every buffer a bad call could reach; `changed` says which one differs after.
  const auto reset = [&] {
    upload(d.payload, payload0, s);
    upload(d.residual, c.data.residual, s);
    upload(d.counter, std::vector<unsigned long long>{kCounterStart}, s);
    upload(out, out0, s);
    s.sync();
  };
  const std::function<std::string()> changed = [&]() -> std::string {
    if (download<uint8_t>(d.payload, payload0.size(), s) != payload0) return "the payload";
    if (download<float>(d.residual, c.data.residual.size(), s) != c.data.residual) return "the residual";
    if (download<unsigned long long>(d.counter, 1, s)[0] != kCounterStart) return "the counter";
    if (download<uint8_t>(out, out0.size(), s) != out0) return "the decode output";
    return "";
  };
  const auto bad_encode = [&](const std::string& name, const std::function<void(std::vector<qc::Job>&, qc::EncodeBatch&)>& mutate) {
    reset();
    std::vector<qc::Job> jobs = c.layout.jobs;
    qc::EncodeBatch b = encode_batch(c, d, jobs);
    mutate(jobs, b);
    b.jobs = jobs;
    expect_codec_error(r, "encode: " + name, s, [&] { qc::encode(b, s.get()); }, changed);
  };
  bad_encode("first element off a bucket boundary", [](auto& jobs, auto&) { jobs.back().first_element += 16; });
  bad_encode("payload offset not a multiple of 4", [](auto& jobs, auto&) { jobs.back().byte_offset += 2; });
  bad_encode("bits 0", [](auto& jobs, auto&) { jobs.back().params.bits = 0; });
  bad_encode("bits 9", [](auto& jobs, auto&) { jobs.back().params.bits = 9; });
  bad_encode("bucket 48 (not a multiple of 32)", [](auto& jobs, auto&) { jobs.back().params.bucket = 48; });
  bad_encode("bucket 2^21", [](auto& jobs, auto&) { jobs.back().params.bucket = uint32_t{1} << 21; });
  bad_encode("elements beyond 2^34", [](auto& jobs, auto&) { jobs.back().first_element = kMaxLayerElements; });
  bad_encode("payload pointer not 4-byte aligned", [](auto&, auto& b) { b.payload += 2; });
  bad_encode("null input", [](auto&, auto& b) { b.input = nullptr; });
  bad_encode("null payload", [](auto&, auto& b) { b.payload = nullptr; });
  bad_encode("invalid element type", [](auto&, auto& b) { b.input_dtype = static_cast<DType>(7); });

  const std::vector<uint8_t> payload = cpu_encode(c).payload;
  const auto bad_decode = [&](const std::string& name, bool accumulate,
                              const std::function<void(std::vector<qc::Job>&, qc::DecodeBatch&)>& mutate) {
    reset();
    upload(d.payload, payload, s);  // a valid payload; "changed" then compares the output only
    std::vector<qc::Job> jobs = c.layout.jobs;
    qc::DecodeBatch b{jobs, d.payload.get(), out.get(), DType::kFloat32};
    mutate(jobs, b);
    b.jobs = jobs;
    expect_codec_error(
        r, (accumulate ? "decode_accumulate: " : "decode: ") + name, s,
        [&] { accumulate ? qc::decode_accumulate(b, s.get()) : qc::decode(b, s.get()); },
        [&]() -> std::string { return download<uint8_t>(out, out0.size(), s) != out0 ? "the output" : ""; });
  };
  bad_decode("first element off a bucket boundary", false, [](auto& jobs, auto&) { jobs.back().first_element += 32; });
  bad_decode("bits 9", true, [](auto& jobs, auto&) { jobs.back().params.bits = 9; });
  bad_decode("accumulators of float16", true, [](auto&, auto& b) { b.output_dtype = DType::kFloat16; });
  bad_decode("null output", false, [](auto&, auto& b) { b.output = nullptr; });
  bad_decode("invalid output type", false, [](auto&, auto& b) { b.output_dtype = static_cast<DType>(3); });

  // The one-slice functions: buffers one byte too small, a slice off a bucket boundary.
  {
    const qc::Job& job = c.layout.jobs.front();
    const uint64_t need = quant::encoded_bytes(job.params, job.count);
    const Slice in{d.input.get() + job.element_offset * 4, job.count, job.first_element};
    float* residual = reinterpret_cast<float*>(d.residual.get()) + job.element_offset;
    uint8_t* at = d.payload.get() + job.byte_offset;
    auto* counter = reinterpret_cast<unsigned long long*>(d.counter.get());
    reset();
    expect_codec_error(
        r, "one-slice encode: output one byte too small", s,
        [&] { qc::encode(job.params, c.noise, DType::kFloat32, in, residual, at, need - 1, s.get(), counter); }, changed);
    reset();
    Slice off = in;
    off.first_element += 32;
    expect_codec_error(
        r, "one-slice encode: first element off a bucket boundary", s,
        [&] { qc::encode(job.params, c.noise, DType::kFloat32, off, residual, at, need, s.get(), counter); }, changed);
    reset();
    expect_codec_error(
        r, "one-slice decode: input one byte too small", s,
        [&] { qc::decode(job.params, at, need - 1, job.count, DType::kFloat32, out.get(), s.get()); }, changed);
    reset();
    expect_codec_error(
        r, "one-slice decode_accumulate: input one byte too small", s,
        [&] {
          qc::decode_accumulate(job.params, at, need - 1, job.count, reinterpret_cast<float*>(out.get()), s.get());
        },
        changed);
  }

  // Statistics: 70 jobs on buckets of 4096 (multiples of every candidate's bucket).
  StatsCaseOptions so;
  so.jobs = 70;
  so.special_chance = 0.0;
  const std::vector<CodecSpec> candidates = {CodecSpec::none(), quant_spec(4, 1024, Rounding::kStochastic),
                                             quant_spec(2, 4096, Rounding::kNearest)};
  const StatsCase sc = make_stats_case("errors", candidates, so, rng);
  const StatsDevice sd = upload_stats(sc, s);
  const std::function<std::string()> stats_changed = [&]() -> std::string {
    if (download<double>(sd.squared, sc.squared_init.size(), s) != sc.squared_init) return "the squared errors";
    if (download<uint8_t>(sd.flags, sc.flags_init.size(), s) != sc.flags_init) return "the non-finite flags";
    return "";
  };
  const auto bad_stats = [&](const std::string& name,
                             const std::function<void(std::vector<qc::Job>&, std::vector<CodecSpec>&, qc::StatsBatch&)>& mutate) {
    upload(sd.squared, sc.squared_init, s);
    upload(sd.flags, sc.flags_init, s);
    s.sync();
    std::vector<qc::Job> jobs = sc.layout.jobs;
    std::vector<CodecSpec> specs = candidates;
    qc::StatsBatch b = stats_batch(sc, sd, jobs, specs);
    mutate(jobs, specs, b);
    b.jobs = jobs;
    b.candidates = specs;
    expect_codec_error(r, "squared_errors: " + name, s, [&] { qc::squared_errors(b, s.get()); }, stats_changed);
  };
  bad_stats("17 candidates", [](auto&, auto& specs, auto&) {
    while (specs.size() <= qc::kMaxStatsCandidates) specs.push_back(quant_spec(3, 1024, Rounding::kNearest));
  });
  bad_stats("job not on a multiple of every candidate's bucket", [](auto& jobs, auto&, auto&) {
    for (qc::Job& j : jobs)
      if (j.count > 0) j.first_element = 1024;  // a multiple of 1024, not of 4096
  });
  bad_stats("invalid candidate (bits 12)", [](auto&, auto& specs, auto&) {
    specs.push_back(CodecSpec{QuantParams{12, 1024, Rounding::kStochastic}});  // bypasses CodecSpec::quant's check
  });
  bad_stats("scratch one byte too small", [](auto&, auto&, auto& b) { b.scratch_bytes -= 1; });
  bad_stats("null scratch", [](auto&, auto&, auto& b) { b.scratch = nullptr; });
  bad_stats("null squared errors", [](auto&, auto&, auto& b) { b.squared = nullptr; });
  bad_stats("invalid element type", [](auto&, auto&, auto& b) { b.input_dtype = static_cast<DType>(9); });
}

// ---------------------------------------------------------------------------------------
// CUDA graph capture: encode -> decode -> decode-accumulate -> statistics, called directly,
// then the same calls captured into a graph (global capture mode: any call the API makes
// that is not allowed during capture, such as an allocation or a synchronisation, fails
// the capture), launched twice. All three runs must give the same bytes (the statistics
// too: they are documented as deterministic), and the direct run must match the CPU.

struct PipelineResult {
  std::vector<uint8_t> payload, residual, counter, decoded, accumulated, squared, flags;
};

void check_graph(Report& r, const CudaStream& s, bool quick, Rng& rng) {
  std::vector<JobShape> shapes;
  const uint64_t n_jobs = quick ? 70 : 150;
  for (uint64_t j = 0; j < n_jobs; ++j) {
    JobShape sh;
    sh.params = random_params(rng, kMoreBuckets);
    sh.count = random_count(rng, sh.params.bucket, 3000);
    sh.first_element = random_first(rng, sh.params.bucket, sh.count);
    sh.layer = static_cast<uint32_t>(below(rng, n_jobs / 2));
    shapes.push_back(sh);
  }
  EncodeCaseOptions o;
  o.residual = true;
  o.skip = true;
  o.special_chance = 0.2;
  const EncodeCase c = make_encode_case("graph capture", kDTypes[below(rng, 3)], shapes, Alignment::kMixed, o, rng);
  StatsCaseOptions so;
  so.jobs = quick ? 70 : 130;
  so.count_cap = 3000;
  const StatsCase sc = make_stats_case("graph capture", random_candidates(rng, 8), so, rng);

  const EncodeDevice d = upload_encode(c, s);
  const StatsDevice sd = upload_stats(sc, s);
  const std::vector<uint8_t> decoded0 = initial_output(c, DType::kFloat32, false, rng);
  const std::vector<uint8_t> accumulated0 = initial_output(c, DType::kFloat32, true, rng);
  DeviceBuffer decoded(decoded0.size()), accumulated(accumulated0.size());

  const auto reset = [&] {
    upload(d.payload, poisoned_payload(c), s);
    upload(d.residual, c.data.residual, s);
    upload(d.counter, std::vector<unsigned long long>{kCounterStart}, s);
    upload(decoded, decoded0, s);
    upload(accumulated, accumulated0, s);
    upload(sd.squared, sc.squared_init, s);
    upload(sd.flags, sc.flags_init, s);
    s.sync();
  };
  // The four calls, from copies of the job and candidate tables that the caller destroys
  // right after: the API takes them by value (kernel parameters), also into a graph.
  const auto enqueue = [&] {
    std::vector<qc::Job> jobs = c.layout.jobs;
    std::vector<qc::Job> stats_jobs = sc.layout.jobs;
    std::vector<CodecSpec> candidates = sc.candidates;
    enqueue_encode(c, d, jobs, s);
    enqueue_decode(c, d.payload.get(), DType::kFloat32, false, decoded.get(), jobs, s);
    enqueue_decode(c, d.payload.get(), DType::kFloat32, true, accumulated.get(), jobs, s);
    qc::squared_errors(stats_batch(sc, sd, stats_jobs, candidates), s.get());
    std::fill(jobs.begin(), jobs.end(), qc::Job{});
    std::fill(stats_jobs.begin(), stats_jobs.end(), qc::Job{});
  };
  const auto collect = [&] {
    PipelineResult p;
    const EncodeOutput e = download_encode(c, d, s);
    p.payload = e.payload;
    p.residual = bytes_of(e.residual);
    p.counter = bytes_of(std::vector<unsigned long long>{e.counter});
    p.decoded = download<uint8_t>(decoded, decoded0.size(), s);
    p.accumulated = download<uint8_t>(accumulated, accumulated0.size(), s);
    p.squared = bytes_of(download<double>(sd.squared, sc.squared_init.size(), s));
    p.flags = download<uint8_t>(sd.flags, sc.layers, s);
    return p;
  };
  const std::string name = strf("encode, decode, decode_acc, stats on one stream [encode: %s; stats: %s]",
                                layout_text(c.layout).c_str(), layout_text(sc.layout).c_str());

  PipelineResult direct;
  try {
    reset();
    enqueue();
    direct = collect();
  } catch (const CodecError& e) {
    r.fail("graph", name, std::string("the direct calls threw: ") + e.what());
    return;
  } catch (const qc::CudaError& e) {
    r.fail("graph", name, std::string("the direct calls failed to launch: ") + e.what());
    return;
  }
  // The direct run against the CPU: the chain decodes the GPU's own payload.
  EncodeOutput got;
  got.payload = direct.payload;
  got.residual.resize(direct.residual.size() / 4);
  if (!direct.residual.empty()) memcpy(got.residual.data(), direct.residual.data(), direct.residual.size());
  memcpy(&got.counter, direct.counter.data(), sizeof got.counter);
  const EncodeOutput want = cpu_encode(c);
  compare_encode(r, "graph", c, got, want, " (direct calls, encode)");
  const auto describe_out = [&](uint64_t i) { return describe_element(c.layout, c.shift.output, i); };
  compare_buffers(r, "graph", name, "decode of the GPU payload", direct.decoded,
                  cpu_decode(c, want.payload, DType::kFloat32, false, decoded0), 4, describe_out,
                  "direct calls: decode of the GPU payload identical to the CPU's");
  compare_buffers(r, "graph", name, "decode-accumulate of the GPU payload", direct.accumulated,
                  cpu_decode(c, want.payload, DType::kFloat32, true, accumulated0), 4, describe_out,
                  "direct calls: decode-accumulate identical to the CPU's");
  StatsOutput stats;
  stats.squared.resize(direct.squared.size() / 8);
  memcpy(stats.squared.data(), direct.squared.data(), direct.squared.size());
  stats.flags = direct.flags;
  compare_stats(r, sc, cpu_stats(sc), stats, " (direct call)");

  // Captured, then launched twice from the same initial state.
  CudaGraph graph;
  try {
    reset();
    CaptureGuard capture(s.get());
    capture.begin();
    enqueue();
    capture.end(graph.graph_slot());
  } catch (const CodecError& e) {
    r.fail("graph", name, std::string("a call during stream capture threw: ") + e.what());
    return;
  } catch (const qc::CudaError& e) {
    r.fail("graph", name, std::string("a launch during stream capture failed: ") + e.what());
    return;
  } catch (const CudaFailure& e) {
    r.fail("graph", name, std::string("the capture failed: ") + e.what());
    return;
  }
  // Nothing ran during capture: the buffers still hold their initial contents.
  const PipelineResult untouched = collect();
  if (untouched.payload != poisoned_payload(c) || untouched.decoded != decoded0 ||
      untouched.squared != bytes_of(sc.squared_init))
    r.fail("graph", name, "the buffers changed during capture: the calls ran instead of being recorded");
  LGRECO_CUDA_CHECK(cudaGraphInstantiate(graph.exec_slot(), graph.graph(), 0));
  const char* parts[] = {"payload", "residual", "counter", "decode output", "accumulators", "squared errors", "flags"};
  for (int launch = 1; launch <= 2; ++launch) {
    reset();
    LGRECO_CUDA_CHECK(cudaGraphLaunch(graph.exec(), s.get()));
    s.sync();
    const PipelineResult g = collect();
    const std::vector<uint8_t>* a[] = {&g.payload, &g.residual, &g.counter, &g.decoded, &g.accumulated, &g.squared, &g.flags};
    const std::vector<uint8_t>* b[] = {&direct.payload,    &direct.residual,    &direct.counter, &direct.decoded,
                                       &direct.accumulated, &direct.squared,     &direct.flags};
    std::string differ;
    for (size_t i = 0; i < std::size(parts); ++i)
      if (*a[i] != *b[i]) differ += std::string(differ.empty() ? "" : ", ") + parts[i];
    r.check(differ.empty(), "graph", name,
            differ.empty() ? strf("graph launch %d: every output identical to the direct calls' (statistics bit for bit)", launch)
                           : strf("graph launch %d: differs from the direct calls in: %s", launch, differ.c_str()));
  }
}

// ---------------------------------------------------------------------------------------
// --check

struct Options {
  enum class Mode { kNone, kCheck, kBench, kInfo };
  Mode mode = Mode::kNone;
  bool quick = false;
  std::optional<uint64_t> seed;
  int device = 0;
  uint64_t count = uint64_t{1} << 28;
  int reps = 7;
  int iters = 10;
  int warmup = 5;
  unsigned time_limit = 600;
  bool verbose = false;
};

// The device's float16 conversions (kernels/dtype.h: the hardware's, NaN as the CPU's)
// against the host's bit-level ones: every float16, and every float32 (--quick: 2^24 of
// them spread over all 2^32 bit patterns, a different low byte in each stride, plus the
// boundaries). Bits are compared, NaN payloads included.
void check_conversions(Report& r, const CudaStream& s, bool quick) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  DeviceBuffer hin(halves.size() * 2), hout(halves.size() * 4);
  upload(hin, halves, s);
  LGRECO_CUDA_CHECK(cudaMemsetAsync(hout.get(), 0xA5, hout.size(), s.get()));  // poisoned
  qc::half_to_float(reinterpret_cast<const uint16_t*>(hin.get()), reinterpret_cast<float*>(hout.get()), halves.size(),
                    s.get());
  const std::vector<uint32_t> widened = download<uint32_t>(hout, halves.size(), s);
  uint64_t bad = 0;
  std::string first;
  for (uint32_t i = 0; i < halves.size(); ++i) {
    uint32_t want;
    const float f = half_to_float(halves[i]);
    memcpy(&want, &f, 4);
    if (widened[i] != want && bad++ == 0) {
      char text[96];
      snprintf(text, sizeof text, "first at 0x%04x: device 0x%08x, host 0x%08x", i, widened[i], want);
      first = text;
    }
  }
  r.check(bad == 0, "conversion", "half_to_float, every float16",
          bad ? std::to_string(bad) + " differ; " + first : "65,536 values bit-identical");

  constexpr uint64_t kChunk = uint64_t{1} << 24;
  const uint64_t total = quick ? kChunk : uint64_t{1} << 32;
  DeviceBuffer fin(kChunk * 4), fout(kChunk * 2);
  std::vector<uint32_t> bits(kChunk);
  bad = 0;
  first.clear();
  for (uint64_t base = 0; base < total; base += kChunk) {
    for (uint64_t i = 0; i < kChunk; ++i)
      bits[i] = quick ? static_cast<uint32_t>((i << 8) | ((i * 37) & 0xffu)) : static_cast<uint32_t>(base + i);
    if (quick)  // the boundaries: rounding to infinity, to the smallest subnormal, ties
      for (uint32_t b : {0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u, 0x387fc000u, 0x38800000u, 0x7f800000u,
                         0x7f800001u, 0xffc00000u, 0x80000000u})
        bits[b & (kChunk - 1)] = b;
    upload(fin, bits, s);
    LGRECO_CUDA_CHECK(cudaMemsetAsync(fout.get(), 0xA5, fout.size(), s.get()));
    qc::float_to_half_rn(reinterpret_cast<const float*>(fin.get()), reinterpret_cast<uint16_t*>(fout.get()), kChunk,
                         s.get());
    const std::vector<uint16_t> narrowed = download<uint16_t>(fout, kChunk, s);
    for (uint64_t i = 0; i < kChunk; ++i) {
      float f;
      memcpy(&f, &bits[i], 4);
      const uint16_t want = float_to_half_rn(f);
      if (narrowed[i] != want && bad++ == 0) {
        char text[96];
        snprintf(text, sizeof text, "first at 0x%08x: device 0x%04x, host 0x%04x", bits[i], narrowed[i], want);
        first = text;
      }
    }
  }
  r.check(bad == 0, "conversion",
          quick ? "float_to_half_rn, 2^24 float32 spread over all bit patterns" : "float_to_half_rn, every float32",
          bad ? std::to_string(bad) + " differ; " + first : cli::thousands(total) + " values bit-identical");
}

int run_check(const Options& o, const CudaStream& s) {
  const uint64_t seed = check_seed(o.seed, kProgram, o.quick);
  printf("# statistics tolerance: %.0e relative to the CPU's value, plus float32's resolution (per bucket n x unit x "
         "(range + max |v|) x 2^%d)\n",
         kStatsRelTolerance, static_cast<int>(std::log2(kStatsResolution)));
  Rng rng(seed);
  Report r;
  r.set_verbose(o.verbose);
  const double start = cli::seconds_now();
  std::string stage = "setup";
  try {
    stage = "encode and decode cases";
    for (const EncodeCase& c : encode_cases(o.quick, rng)) {
      stage = "encode case " + c.name;
      check_encode_case(r, c, s, rng);
    }
    stage = "statistics cases";
    for (const StatsCase& c : stats_cases(o.quick, rng)) {
      stage = "statistics case " + c.name;
      check_stats_case(r, c, s);
    }
    stage = "float16 conversions";
    check_conversions(r, s, o.quick);
    stage = "statistics of huge values";
    check_stats_huge_values(r, s, rng);
    stage = "argument errors";
    check_errors(r, s, rng);
    stage = "graph capture";
    check_graph(r, s, o.quick, rng);
  } catch (const CudaFailure& e) {
    // A fault inside a kernel surfaces at the next synchronisation and poisons the context:
    // nothing after it can be trusted.
    r.fail("cuda", stage, std::string(e.what()) + " (a kernel fault surfaces at the next synchronisation; later checks skipped)");
  } catch (const qc::CudaError& e) {
    r.fail("cuda", stage, std::string(e.what()) + " (later checks skipped)");
  } catch (const std::exception& e) {
    r.fail("harness", stage, std::string(e.what()) + " (later checks skipped)");
  }
  const double seconds = cli::seconds_now() - start;
  printf("\n");
  for (int k = 0; k < 3; ++k)
    printf("# statistics, %s: worst relative difference %.3g (values over 100x their float32 resolution)%s%s\n",
           kKindNames[k], r.worst(k),
           r.worst_where(k).empty() ? "" : " at ", r.worst_where(k).c_str());
  printf("# statistics: %s finite values compared, %s of them beyond %.0e relative but within float32's resolution\n",
         cli::thousands(r.stats_values()).c_str(), cli::thousands(r.resolution_only()).c_str(), kStatsRelTolerance);
  for (const std::string& f : r.failures()) printf("# failed: %s\n", f.c_str());
  printf("SUMMARY: %d checks, %d passed, %d failed in %.1f s (seed 0x%016llx); statistics: worst relative difference "
         "%.2g where well above float32's resolution (allowed: %.0e + that resolution), %s values needed the resolution "
         "allowance\n",
         r.passed() + r.failed(), r.passed(), r.failed(), seconds, static_cast<ull>(seed),
         std::max({r.worst(0), r.worst(1), r.worst(2)}), kStatsRelTolerance, cli::thousands(r.resolution_only()).c_str());
  printf("RESULT: %s\n", r.failed() == 0 ? "PASS" : "FAIL");
  return r.failed() == 0 ? 0 : kExitFailed;
}

// ---------------------------------------------------------------------------------------
// --bench
//
// nccl-tests' conventions: warm-up calls, then R repetitions of I back-to-back calls timed
// with CUDA events on the stream, the median repetition's time per call. The ceiling is a
// device-to-device cudaMemcpyAsync of the float32 input (1 GiB at 2^28 elements), counted
// as read + write. Each kernel's "bytes" are the minimum it must move, each byte once:
//   encode+EF        input (4 or 2 B/value) + residual read (4) + residual write (4) + payload written
//   encode           input + payload written
//   decode           payload read + output written (4 or 2 B/value)
//   decode_acc       payload read + accumulator read (4) + write (4)
//   stats            input + residual read (4) when there is one; the per-bucket partial sums
//                    (candidates x 4 B per bucket, written then reduced) are not counted
// Buckets above 1024 values read their input twice (the range, then the codes), which the
// count does not include; those rows have no target.

struct BenchRow {
  std::string kernel;
  DType dtype = DType::kFloat32;
  int bits = 0;  // 0: several (statistics)
  uint32_t bucket = 0;
  uint32_t jobs = 1;
  double seconds = 0.0;
  uint64_t elements = 0;
  uint64_t bytes = 0;
  double target = 0.0;  // fraction of the copy's GB/s; 0: none
};

class Bench {
 public:
  Bench(const Options& o, const CudaStream& s) : o_(o), s_(s) {}

  // Median seconds per call of op (which only enqueues on the stream).
  double time(const std::function<void()>& op) {
    // The first call, timed alone, sizes the rest: a kernel far slower than expected (a
    // first version may be) gets 3 repetitions of one call, so that the whole table still
    // fits in the time limit.
    LGRECO_CUDA_CHECK(cudaEventRecord(start_.get(), s_.get()));
    op();
    LGRECO_CUDA_CHECK(cudaEventRecord(stop_.get(), s_.get()));
    LGRECO_CUDA_CHECK(cudaEventSynchronize(stop_.get()));
    float first_ms = 0.0f;
    LGRECO_CUDA_CHECK(cudaEventElapsedTime(&first_ms, start_.get(), stop_.get()));
    const bool slow = first_ms > 50.0f;
    const int iters = slow ? 1 : o_.iters;
    const int reps = slow ? std::min(o_.reps, 3) : o_.reps;
    if (slow) printf("# slow: the first call took %.1f ms; timing %d repetitions of one call\n", first_ms, reps);
    for (int i = 1; i < (slow ? 1 : o_.warmup); ++i) op();
    s_.sync();
    std::vector<double> per_call;
    for (int rep = 0; rep < reps; ++rep) {
      LGRECO_CUDA_CHECK(cudaEventRecord(start_.get(), s_.get()));
      for (int i = 0; i < iters; ++i) op();
      LGRECO_CUDA_CHECK(cudaEventRecord(stop_.get(), s_.get()));
      LGRECO_CUDA_CHECK(cudaEventSynchronize(stop_.get()));
      float ms = 0.0f;
      LGRECO_CUDA_CHECK(cudaEventElapsedTime(&ms, start_.get(), stop_.get()));
      per_call.push_back(static_cast<double>(ms) * 1e-3 / iters);
    }
    std::sort(per_call.begin(), per_call.end());
    return per_call[per_call.size() / 2];
  }

  void add(BenchRow row) {
    const double gbs = static_cast<double>(row.bytes) / row.seconds * 1e-9;
    const double copy = rows_.empty() ? gbs : gbs_of(rows_.front());
    printf("bench %-12s %-8s bits %-3s bucket %-7s jobs %-4u %10.1f us %8.2f Gelem/s %9.1f MB %8.1f GB/s %6.1f%% of copy\n",
           row.kernel.c_str(), dtype_name(row.dtype), bits_column(row).c_str(),
           row.bucket ? std::to_string(row.bucket).c_str() : "-", row.jobs, row.seconds * 1e6,
           static_cast<double>(row.elements) / row.seconds * 1e-9, static_cast<double>(row.bytes) * 1e-6, gbs,
           100.0 * gbs / copy);
    rows_.push_back(std::move(row));
  }

  static double gbs_of(const BenchRow& r) { return static_cast<double>(r.bytes) / r.seconds * 1e-9; }
  static std::string bits_column(const BenchRow& r) {
    if (r.kernel == "copy") return "-";
    return r.bits ? std::to_string(r.bits) : "2-8";
  }
  const std::vector<BenchRow>& rows() const { return rows_; }

 private:
  const Options& o_;
  const CudaStream& s_;
  CudaEvent start_, stop_;
  std::vector<BenchRow> rows_;
};

// Jobs covering [0, n) of one layer in pieces of `per` values (a multiple of the bucket),
// payloads back to back.
std::vector<qc::Job> bench_jobs(uint64_t n, uint64_t pieces, const QuantParams& p) {
  std::vector<qc::Job> jobs;
  const uint64_t per = std::max<uint64_t>(n / pieces / p.bucket, 1) * p.bucket;
  uint64_t bytes = 0;
  for (uint64_t first = 0; first < n; first += per) {
    qc::Job j;
    j.element_offset = first;
    j.count = std::min(per, n - first);
    j.first_element = first;
    j.byte_offset = bytes;
    j.layer = static_cast<uint32_t>(jobs.size());
    j.params = p;
    bytes += quant::encoded_bytes(p, j.count);
    jobs.push_back(j);
  }
  return jobs;
}

uint64_t payload_bytes(const std::vector<qc::Job>& jobs) {
  uint64_t b = 0;
  for (const qc::Job& j : jobs) b += quant::encoded_bytes(j.params, j.count);
  return b;
}

int run_bench(const Options& o, const DeviceInfo& info, const CudaStream& s) {
  uint64_t n = o.count;
  constexpr uint64_t kPieces = 256;  // the batched rows: 256 jobs, as a bucket of many layers
  const QuantParams widest{8, 32, Rounding::kStochastic};
  const std::vector<CodecSpec> stats1024 = usual_candidates(Rounding::kStochastic, false, 1024);
  const std::vector<CodecSpec> stats65536 = usual_candidates(Rounding::kStochastic, false, 65536);
  const auto scratch_for = [&](const std::vector<CodecSpec>& specs, uint64_t count, uint64_t pieces) {
    return qc::stats_scratch_bytes(bench_jobs(count, pieces, QuantParams{4, 1024, Rounding::kStochastic}), specs);
  };
  const auto need_bytes = [&](uint64_t count) {
    return count * 4 /*input*/ + count * 2 /*16-bit input*/ + count * 4 /*residual*/ +
           quant::encoded_bytes(widest, count) /*largest payload*/ + count * 4 /*output*/ +
           std::max(scratch_for(stats1024, count, kPieces), scratch_for(stats1024, count, 1));
  };
  size_t free_bytes = 0, total_bytes = 0;
  LGRECO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (need_bytes(n) > free_bytes * 0.9)
    throw std::runtime_error(strf("--bench with %s values needs %.2f GiB of device memory, %.2f GiB are free; "
                                  "use a smaller --count",
                                  cli::thousands(n).c_str(), need_bytes(n) / 1073741824.0, free_bytes / 1073741824.0));
  printf("# --bench: %s values a call (%.2f GiB of float32), device memory used %.2f GiB of %.2f GiB free\n",
         cli::thousands(n).c_str(), n * 4.0 / 1073741824.0, need_bytes(n) / 1073741824.0, free_bytes / 1073741824.0);
  printf("# median of %d repetitions of %d calls after %d warm-up calls, timed with CUDA events\n", o.reps, o.iters,
         o.warmup);

  DeviceBuffer in32(n * 4), in16(n * 2), residual(n * 4), payload(quant::encoded_bytes(widest, n)), out(n * 4);
  DeviceBuffer scratch(std::max(scratch_for(stats1024, n, kPieces), scratch_for(stats1024, n, 1)));
  DeviceBuffer squared(kPieces * 16 * sizeof(double)), flags(kPieces);
  // Inputs: a chunk of Gaussian values drawn on the host, repeated over the buffer by
  // doubling device copies (the data's variety does not change the kernels' traffic).
  {
    const uint64_t chunk = std::min<uint64_t>(n, uint64_t{1} << 22);
    Rng rng(12345);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(chunk), r(chunk);
    std::vector<uint16_t> h(chunk);
    for (uint64_t i = 0; i < chunk; ++i) {
      x[i] = normal(rng);
      r[i] = 0.01f * normal(rng);
      h[i] = float_to_half_rn(x[i]);
    }
    const auto replicate = [&](const DeviceBuffer& d, const void* host, uint64_t width) {
      LGRECO_CUDA_CHECK(cudaMemcpyAsync(d.get(), host, chunk * width, cudaMemcpyHostToDevice, s.get()));
      for (uint64_t have = chunk; have < n;) {
        const uint64_t copy = std::min(have, n - have);
        LGRECO_CUDA_CHECK(
            cudaMemcpyAsync(d.get() + have * width, d.get(), copy * width, cudaMemcpyDeviceToDevice, s.get()));
        have += copy;
      }
    };
    replicate(in32, x.data(), 4);
    replicate(residual, r.data(), 4);
    replicate(in16, h.data(), 2);  // float16 bits; bfloat16 rows read the same bits (any finite mix will do)
    LGRECO_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, n * 4, s.get()));
    LGRECO_CUDA_CHECK(cudaMemsetAsync(squared.get(), 0, squared.size(), s.get()));
    LGRECO_CUDA_CHECK(cudaMemsetAsync(flags.get(), 0, flags.size(), s.get()));
    s.sync();
  }
  const auto input_of = [&](DType t) -> const void* { return t == DType::kFloat32 ? in32.get() : in16.get(); };

  Bench bench(o, s);
  {
    BenchRow row;
    row.kernel = "copy";
    row.elements = n;
    row.bytes = 2 * n * 4;
    row.jobs = 0;
    row.seconds = bench.time([&] {
      LGRECO_CUDA_CHECK(cudaMemcpyAsync(out.get(), in32.get(), n * 4, cudaMemcpyDeviceToDevice, s.get()));
    });
    bench.add(row);
  }

  const auto encode_row = [&](DType t, int bits, uint32_t bucket, bool ef, uint64_t pieces) {
    const QuantParams p{bits, bucket, Rounding::kStochastic};
    const std::vector<qc::Job> jobs = bench_jobs(n, pieces, p);
    qc::EncodeBatch b;
    b.jobs = jobs;
    b.input = input_of(t);
    b.input_dtype = t;
    b.residual = ef ? reinterpret_cast<float*>(residual.get()) : nullptr;
    b.payload = payload.get();
    b.noise = NoiseKey{42, 0, 1, 0};
    BenchRow row;
    row.kernel = ef ? "encode+EF" : "encode";
    row.dtype = t;
    row.bits = bits;
    row.bucket = bucket;
    row.jobs = static_cast<uint32_t>(jobs.size());
    row.elements = n;
    row.bytes = n * dtype_size(t) + (ef ? 8 * n : 0) + payload_bytes(jobs);
    row.target = ef && bucket <= 1024 ? 0.85 : 0.0;
    row.seconds = bench.time([&] { qc::encode(b, s.get()); });
    bench.add(row);
  };
  const auto decode_row = [&](DType t, int bits, bool accumulate, uint64_t pieces) {
    const QuantParams p{bits, 1024, Rounding::kStochastic};
    const std::vector<qc::Job> jobs = bench_jobs(n, pieces, p);
    // A real payload of these parameters to decode.
    qc::EncodeBatch e;
    e.jobs = jobs;
    e.input = in32.get();
    e.payload = payload.get();
    qc::encode(e, s.get());
    s.sync();
    const qc::DecodeBatch b{jobs, payload.get(), out.get(), t};
    BenchRow row;
    row.kernel = accumulate ? "decode_acc" : "decode";
    row.dtype = t;
    row.bits = bits;
    row.bucket = 1024;
    row.jobs = static_cast<uint32_t>(jobs.size());
    row.elements = n;
    row.bytes = payload_bytes(jobs) + (accumulate ? 8 * n : n * dtype_size(t));
    row.target = accumulate ? 0.85 : 0.0;
    if (accumulate) LGRECO_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, n * 4, s.get()));
    row.seconds = bench.time([&] { accumulate ? qc::decode_accumulate(b, s.get()) : qc::decode(b, s.get()); });
    bench.add(row);
  };
  const auto stats_row = [&](DType t, bool with_residual, const std::vector<CodecSpec>& specs, uint64_t pieces) {
    const uint32_t bucket = specs.front().quant_params().bucket;
    const std::vector<qc::Job> jobs = bench_jobs(n, pieces, QuantParams{4, bucket, Rounding::kStochastic});
    qc::StatsBatch b;
    b.jobs = jobs;
    b.candidates = specs;
    b.input = input_of(t);
    b.input_dtype = t;
    b.residual = with_residual ? reinterpret_cast<const float*>(residual.get()) : nullptr;
    b.squared = reinterpret_cast<double*>(squared.get());
    b.nonfinite = flags.get();
    b.scratch = scratch.get();
    b.scratch_bytes = scratch.size();
    BenchRow row;
    row.kernel = with_residual ? "stats+res" : "stats";
    row.dtype = t;
    row.bits = 0;
    row.bucket = bucket;
    row.jobs = static_cast<uint32_t>(jobs.size());
    row.elements = n;
    row.bytes = n * dtype_size(t) + (with_residual ? 4 * n : 0);
    row.target = bucket <= 1024 ? 0.60 : 0.0;
    row.seconds = bench.time([&] { qc::squared_errors(b, s.get()); });
    bench.add(row);
  };

  for (int bits : {2, 4, 8}) encode_row(DType::kFloat32, bits, 1024, true, 1);
  encode_row(DType::kFloat16, 4, 1024, true, 1);
  encode_row(DType::kBFloat16, 4, 1024, true, 1);
  encode_row(DType::kFloat32, 4, 1024, false, 1);
  encode_row(DType::kFloat16, 4, 1024, false, 1);
  for (int bits : {2, 4, 8}) decode_row(DType::kFloat32, bits, false, 1);
  decode_row(DType::kFloat16, 4, false, 1);
  decode_row(DType::kBFloat16, 4, false, 1);
  for (int bits : {2, 4, 8}) decode_row(DType::kFloat32, bits, true, 1);
  stats_row(DType::kFloat32, true, stats1024, 1);
  stats_row(DType::kFloat32, false, stats1024, 1);
  stats_row(DType::kFloat16, false, stats1024, 1);
  stats_row(DType::kBFloat16, true, stats1024, 1);
  encode_row(DType::kFloat32, 4, 65536, true, 1);
  stats_row(DType::kFloat32, true, stats65536, 1);
  encode_row(DType::kFloat32, 4, 1024, true, kPieces);
  decode_row(DType::kFloat32, 4, true, kPieces);
  stats_row(DType::kFloat32, true, stats1024, kPieces);

  // The compact table, last.
  const BenchRow& copy = bench.rows().front();
  const double copy_gbs = Bench::gbs_of(copy);
  printf("\n== lgreco-gpu-codec-check --bench: %s, %d SMs, %s values a call, copy ceiling %.0f GB/s ==\n",
         info.prop.name, info.prop.multiProcessorCount, cli::thousands(n).c_str(), copy_gbs);
  printf("%-11s %-8s %4s %6s %4s %9s %8s %8s %7s %6s %s\n", "kernel", "dtype", "bits", "bucket", "jobs", "time_us",
         "Gelem/s", "GB", "GB/s", "%copy", "target");
  int met = 0, targets = 0;
  std::string missed;
  for (const BenchRow& row : bench.rows()) {
    const double gbs = Bench::gbs_of(row);
    const double percent = 100.0 * gbs / copy_gbs;
    std::string target = "-";
    if (row.target > 0.0) {
      ++targets;
      const bool ok = percent >= 100.0 * row.target;
      met += ok ? 1 : 0;
      target = strf(">=%.0f%% %s", 100.0 * row.target, ok ? "met" : "MISSED");
      if (!ok)
        missed += strf("%s%s %s bits %s jobs %u (%.1f%% < %.0f%%)", missed.empty() ? "" : "; ", row.kernel.c_str(),
                       dtype_name(row.dtype), Bench::bits_column(row).c_str(), row.jobs, percent, 100.0 * row.target);
    }
    printf("%-11s %-8s %4s %6s %4s %9.1f %8.2f %8.3f %7.0f %6.1f %s\n", row.kernel.c_str(), dtype_name(row.dtype),
           Bench::bits_column(row).c_str(),
           row.bucket ? std::to_string(row.bucket).c_str() : "-", row.jobs ? std::to_string(row.jobs).c_str() : "-",
           row.seconds * 1e6, static_cast<double>(row.elements) / row.seconds * 1e-9, static_cast<double>(row.bytes) * 1e-9,
           gbs, percent, target.c_str());
  }
  printf("bytes = the minimum each kernel moves: copy 2 x 4 B/value (read + write); encode+EF input (4 or 2 B) + "
         "residual 4 B read + 4 B written + payload; encode input + payload; decode payload + output (4 or 2 B); "
         "decode_acc payload + 4 B read + 4 B written; stats input (+ 4 B residual), partial sums not counted\n");
  printf("targets (the kernels' issue): encode+EF and decode_acc >= 85%% of the copy, statistics >= 60%%; buckets above "
         "1024 read their input twice and have none\n");
  printf("TARGETS: %d of %d met%s%s\n", met, targets, missed.empty() ? "" : "; missed: ", missed.c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------

const char kUsage[] = R"(usage: lgreco-gpu-codec-check --check [--quick] [--seed S] | --bench | --info  [options]

Runs lgreco's CUDA quantization kernels (kernels/quant_cuda.h) on a GPU.

  --check        parity with the CPU reference on fresh random inputs: payloads, residuals,
                 decode and decode-accumulate outputs byte for byte, non-finite counters,
                 error statistics within a tolerance, argument errors, CUDA graph capture;
                 PASS/FAIL lines, then SUMMARY and RESULT lines
  --quick        with --check: a smaller set (for compute-sanitizer)
  --bench        throughput of each kernel against a device-to-device copy, as a table,
                 with the targets of the kernels' issue (TARGETS line)
  --info         print the device and exit
  --seed S       seed of --check's inputs (default: drawn and printed)
  --device N     CUDA device (default 0)
  --count N      --bench: values a call (default 268435456 = 2^28, 1 GiB of float32)
  --reps R       --bench: repetitions, the median is reported (default 7)
  --iters I      --bench: calls a repetition (default 10)
  --time-limit S exit with status 3 after S seconds (default 600, 0: none)
  --verbose      --check: a NOTE line for each statistic that is further from the CPU's
                 than the relative tolerance but within float32's resolution

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
    } else if (arg == "--verbose") {
      o.verbose = true;
    } else if (arg == "--seed") {
      o.seed = cli::parse_u64(arg, args.value());
    } else if (arg == "--device") {
      o.device = static_cast<int>(std::min<uint32_t>(cli::parse_u32(arg, args.value()), INT32_MAX));
    } else if (arg == "--count") {
      o.count = cli::parse_u64(arg, args.value());
    } else if (arg == "--reps") {
      o.reps = static_cast<int>(std::min<uint32_t>(cli::parse_u32(arg, args.value()), 1000));
    } else if (arg == "--iters") {
      o.iters = static_cast<int>(std::min<uint32_t>(cli::parse_u32(arg, args.value()), 100000));
    } else if (arg == "--time-limit") {
      o.time_limit = cli::parse_u32(arg, args.value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  require_mode(o.mode, o.quick);
  if (o.count < 1024 || o.count > (uint64_t{1} << 32)) throw cli::UsageError("--count must be in 1024..2^32");
  if (o.reps < 1 || o.iters < 1) throw cli::UsageError("--reps and --iters must be at least 1");

  setvbuf(stdout, nullptr, _IOLBF, 0);  // every line reaches the log, even if the time limit ends the process
  arm_time_limit(kProgram, o.time_limit);
  const std::optional<DeviceInfo> info = open_device(o.device);
  if (!info) return kExitNoDevice;
  print_device(*info);
  if (o.mode == Options::Mode::kInfo) {
    // A little real work: one allocation, one copy and one kernel launch, so that a tool
    // wrapping this (compute-sanitizer) sees the whole path.
    CudaStream s;
    DeviceBuffer in(4096 * 4), payload(quant::encoded_bytes(QuantParams{}, 4096));
    LGRECO_CUDA_CHECK(cudaMemsetAsync(in.get(), 0, 4096 * 4, s.get()));
    qc::encode(QuantParams{}, NoiseKey{}, DType::kFloat32, Slice{in.get(), 4096, 0}, nullptr, payload.get(),
               payload.size(), s.get());
    s.sync();
    printf("# --info: one encode launch ran\n");
    return 0;
  }
  CudaStream s;
  if (o.mode == Options::Mode::kCheck) return run_check(o, s);
  return run_bench(o, *info, s);
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main(lgreco::kProgram, [&] { return lgreco::run(argc, argv); });
}
