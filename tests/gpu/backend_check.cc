// lgreco-gpu-backend-check: the engine's CUDA backend (plugin/shim/cuda_backend.h) on a
// real GPU, against the CPU backend (plugin/collective/cpu_backend.h), operation by
// operation.
//
//   --check [--quick]  fresh random plans (collective::make_plan over random bucket layouts
//                      of quant, TopK and `none` layers, float32/float16/bfloat16, random bits,
//                      buckets, roundings and partitions), ElementSpans whose first
//                      element is not 0, flags with some layers set, NaN/Inf/overflow
//                      injections and poisoned outputs; every operation's bytes compared
//                      with the CPU backend's (measure: within the tolerance of
//                      docs/KERNELS.md; a fresh backend after prepare_measure must
//                      measure the same bytes without allocating; likewise encode after
//                      prepare_encode; a random subset of the candidates measured, the
//                      other columns untouched); PowerSGD's operations through the backend
//                      on random matrix layers (docs/KERNELS.md's cuBLAS tolerances, the
//                      rest bit for bit, nothing allocated after prepare_lowrank); the error
//                      probe's gather, distance and sketch, and a probe step on random layers and
//                      candidates (simulated, reference and realized errors). Then set_stream's
//                      ordering across two streams, stream-ordered frees (a buffer freed
//                      while work on it is queued, its memory reused at once), set_stream
//                      away from a destroyed and from a capturing stream, the memory cap
//                      (std::bad_alloc, prepare_measure included), read-back events,
//                      marks, the device guard and the runtime (capturing,
//                      create_backend, unusable_reason).
//                      --quick: fewer random plans.
//
// One PASS/FAIL line per check, `# failed:` lines, SUMMARY and RESULT lines, and a short
// table last. Exit status: 0 every check passed, 1 a check failed, 2 usage error or no
// CUDA device (the reason is printed), 3 the --time-limit ran out. Built only with CUDA
// (Makefile), run by tests/gpu/run.sh backend; about 10-30 s on an H200 by estimate.
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
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tests/gpu/check_util.h"
#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/quant.h"
#include "kernels/quant_cuda.h"
#include "kernels/quant_math.h"
#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/inproc_fabric.h"
#include "plugin/collective/layout.h"
#include "plugin/collective/probe.h"
#include "plugin/collective/plan.h"
#include "plugin/shim/cuda_backend.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

using collective::CpuBackend;
using collective::ElementSpan;
using collective::NoiseBase;
using collective::Plan;
using collective::Segment;
using shim::CudaBackend;

constexpr char kProgram[] = "lgreco-gpu-backend-check";

// The statistics' tolerance, as tests/gpu/quant_cuda_check.cc and docs/KERNELS.md state
// it: relative to the CPU's value, plus float32's resolution of the statistic (per
// bucket of a quant candidate: n x unit x (range + max |v|) x 2^-21), plus one 2^-149
// per element (float32 underflow of a squared rounding error).
constexpr double kStatsRelTolerance = 1e-4;
constexpr double kStatsResolution = 0x1p-21;

constexpr uint8_t kPoison = 0xA5;

// ---------------------------------------------------------------------------------------
// Small helpers

using namespace gpu_check;

// Host bytes onto the device; waits for the whole device, so that nothing the backend
// enqueues later on its own (non-blocking) stream can overtake the copy.
DeviceBuffer to_device(const std::vector<uint8_t>& host) {
  DeviceBuffer d(host.size());
  if (!host.empty()) LGRECO_CUDA_CHECK(cudaMemcpy(d.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}
// After everything enqueued anywhere has run.
std::vector<uint8_t> from_device(const void* d, uint64_t bytes) {
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> host(bytes);
  if (bytes) LGRECO_CUDA_CHECK(cudaMemcpy(host.data(), d, bytes, cudaMemcpyDeviceToHost));
  return host;
}
std::vector<uint8_t> from_device(const DeviceBuffer& d) { return from_device(d.get(), d.size()); }

float f32_at(const std::vector<uint8_t>& b, uint64_t i) {
  float f;
  memcpy(&f, b.data() + i * 4, 4);
  return f;
}

// ---------------------------------------------------------------------------------------
// Results: one row per operation or property, cases and failures counted.

class Report {
 public:
  struct Row {
    uint64_t cases = 0;
    uint64_t failed = 0;
    uint64_t values = 0;
    std::string note;
  };
  void pass(const std::string& row, uint64_t values = 0) {
    Row& r = row_(row);
    ++r.cases;
    r.values += values;
  }
  void fail(const std::string& row, const std::string& what) {
    Row& r = row_(row);
    ++r.cases;
    ++r.failed;
    printf("FAIL %s: %s\n", row.c_str(), what.c_str());
    if (failures_.size() < 20) failures_.push_back(row + ": " + what);
  }
  void check(bool ok, const std::string& row, const std::string& what) {
    if (ok)
      pass(row);
    else
      fail(row, what);
  }
  void note(const std::string& row, const std::string& text) {
    Row& r = row_(row);
    if (r.note.find(text) == std::string::npos) r.note += (r.note.empty() ? "" : "; ") + text;
  }
  uint64_t cases() const {
    uint64_t n = 0;
    for (const auto& [name, r] : rows_) n += r.cases;
    return n;
  }
  uint64_t failed() const {
    uint64_t n = 0;
    for (const auto& [name, r] : rows_) n += r.failed;
    return n;
  }
  const std::vector<std::string>& failures() const { return failures_; }
  const std::vector<std::pair<std::string, Row>>& rows() const { return rows_; }

 private:
  Row& row_(const std::string& name) {
    for (auto& [n, r] : rows_)
      if (n == name) return r;
    rows_.emplace_back(name, Row{});
    return rows_.back().second;
  }
  std::vector<std::pair<std::string, Row>> rows_;  // in first-use order
  std::vector<std::string> failures_;
};

// Byte-for-byte comparison of what the CPU and the GPU left in one array (NaN results
// included: both store quant::kDecodedNaNBits, docs/FORMAT.md).
struct Compared {
  uint64_t differing = 0;
  std::string first;
};
Compared compare(const std::vector<uint8_t>& cpu, const std::vector<uint8_t>& gpu, size_t width) {
  Compared c;
  if (cpu.size() != gpu.size()) {
    c.differing = 1;
    c.first = strf("sizes differ: %zu vs %zu bytes", cpu.size(), gpu.size());
    return c;
  }
  const uint64_t n = cpu.size() / width;
  for (uint64_t i = 0; i < n; ++i) {
    if (memcmp(cpu.data() + i * width, gpu.data() + i * width, width) == 0) continue;
    if (c.differing++ == 0) {
      uint64_t a = 0, b = 0;
      memcpy(&a, cpu.data() + i * width, width);
      memcpy(&b, gpu.data() + i * width, width);
      c.first = strf("element %llu: cpu 0x%0*llx, gpu 0x%0*llx", static_cast<ull>(i), static_cast<int>(2 * width),
                     static_cast<ull>(a), static_cast<int>(2 * width), static_cast<ull>(b));
    }
  }
  return c;
}

// ---------------------------------------------------------------------------------------
// Random plans and data

struct Trial {
  std::string name;
  collective::BucketLayout layout;
  std::vector<CodecSpec> layer_codecs;
  std::vector<CodecSpec> candidates;  // every layer's candidates (measure needs one list)
  Plan plan;
  uint32_t partition = 0;
  std::vector<Segment> segments;  // those of `partition`
  uint64_t lo = 0, hi = 0;        // elements the segments cover
  std::vector<float> layer_scale;
  std::vector<uint8_t> layer_injects;  // 1: NaN/Inf in this layer's data, 2: values near the 16-bit limits
};

CodecSpec random_quant(Rng& rng) {
  QuantParams p;
  p.bits = static_cast<int>(1 + below(rng, 8));
  p.bucket = pick<uint32_t>(rng, {32, 64, 96, 128, 256, 512, 1024, 1024, 1024, 2048, 4096});
  p.rounding = chance(rng, 0.7) ? Rounding::kStochastic : Rounding::kNearest;
  return CodecSpec::quant(p);
}

CodecSpec random_topk(Rng& rng) {
  return CodecSpec::parse(std::string("topk:density=") + pick<const char*>(rng, {"0.001", "0.01", "0.01", "0.05", "0.3", "1"}));
}

Trial random_trial(Rng& rng, bool quick, int index) {
  Trial t;
  t.layout.dtype = kDTypes[below(rng, 3)];
  // One candidate list for every layer: none and/or a few quant and TopK specs (the
  // backend measures both families into one table, each in its own columns).
  const size_t n_quant = below(rng, 5), n_topk = chance(rng, 0.5) ? below(rng, 4) : 0;
  if (n_quant + n_topk == 0 || chance(rng, 0.6)) t.candidates.push_back(CodecSpec::none());
  for (size_t k = 0; k < n_quant; ++k) t.candidates.push_back(random_quant(rng));
  for (size_t k = 0; k < n_topk; ++k) {
    const CodecSpec c = random_topk(rng);
    if (std::find(t.candidates.begin(), t.candidates.end(), c) == t.candidates.end()) t.candidates.push_back(c);
  }
  std::shuffle(t.candidates.begin(), t.candidates.end(), rng);
  const uint32_t layers = static_cast<uint32_t>(1 + below(rng, quick ? 6 : 14));
  uint64_t offset = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    collective::LayerLayout layer;
    layer.name = "layer" + std::to_string(l);
    const int size_class = static_cast<int>(below(rng, 10));
    layer.numel = size_class < 4   ? 1 + below(rng, 3000)
                  : size_class < 9 ? 1 + below(rng, 120000)
                                   : 200000 + below(rng, 300000);
    layer.offset = offset;
    offset += layer.numel;
    layer.candidates = t.candidates;
    t.layout.layers.push_back(layer);
    t.layer_codecs.push_back(chance(rng, 0.5)    ? t.candidates[below(rng, t.candidates.size())]
                             : chance(rng, 0.25) ? CodecSpec::none()
                             : chance(rng, 0.3)  ? random_topk(rng)
                                                 : random_quant(rng));
    t.layer_scale.push_back(pick<float>(rng, {1e-3f, 1.0f, 1.0f, 30.0f, 1e4f}));
    t.layer_injects.push_back(chance(rng, 0.25) ? 1 : chance(rng, 0.15) ? 2 : 0);
  }
  t.layout.count = offset;
  collective::validate(t.layout, 0);
  const uint32_t parts = static_cast<uint32_t>(1 + below(rng, 5));
  t.plan = collective::make_plan(t.layout, t.layer_codecs, parts);
  // A partition with segments (the call has at least one element, so one has).
  std::vector<uint32_t> nonempty;
  for (uint32_t p = 0; p < t.plan.partitions.size(); ++p)
    if (t.plan.partitions[p].segment_count > 0) nonempty.push_back(p);
  t.partition = nonempty[below(rng, nonempty.size())];
  const auto segs = t.plan.segments_of(t.plan.partitions[t.partition]);
  t.segments.assign(segs.begin(), segs.end());
  t.lo = t.segments.front().offset;
  t.hi = t.segments.back().offset + t.segments.back().count;
  std::string codecs;
  for (size_t l = 0; l < layers && l < 4; ++l) codecs += (l ? " " : "") + t.layer_codecs[l].str();
  if (layers > 4) codecs += " ...";
  t.name = strf("plan %d: %s, %u layers, %llu elements, partition %u of %u (%zu segments) [%s]", index,
                dtype_name(t.layout.dtype), layers, static_cast<ull>(t.layout.count), t.partition, parts,
                t.segments.size(), codecs.c_str());
  return t;
}

uint32_t layer_of(const Trial& t, uint64_t element) {
  const auto& layers = t.layout.layers;
  uint32_t lo = 0, hi = static_cast<uint32_t>(layers.size());
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (layers[mid].offset <= element)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// An array holding call elements [first, first + count): `first` at or before t.lo,
// mostly not 0, with a few elements of slack past t.hi.
struct Span {
  uint64_t first = 0;
  uint64_t count = 0;
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> host;
};
Span random_span(Rng& rng, const Trial& t, DType dtype) {
  Span s;
  s.dtype = dtype;
  s.first = t.lo - below(rng, std::min<uint64_t>(t.lo, 40) + 1);
  s.count = t.hi - s.first + below(rng, 40);
  s.host.assign(s.count * dtype_size(dtype), kPoison);
  return s;
}

uint32_t nan_bits(Rng& rng, DType t) {
  switch (t) {
    case DType::kFloat16: return pick<uint32_t>(rng, {0x7e00, 0x7c01, 0xfe00, 0x7d23, 0x7c00, 0xfc00});
    case DType::kBFloat16: return pick<uint32_t>(rng, {0x7fc0, 0x7f81, 0xffc0, 0x7fa3, 0x7f80, 0xff80});
    default:
      return pick<uint32_t>(rng, {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa00123u, 0xff812345u, 0x7fffffffu,
                                  0x7f800000u, 0xff800000u});
  }
}
void put_bits(Span& s, uint64_t i, uint32_t bits) {
  if (dtype_size(s.dtype) == 4)
    memcpy(s.host.data() + i * 4, &bits, 4);
  else {
    const uint16_t h = static_cast<uint16_t>(bits);
    memcpy(s.host.data() + i * 2, &h, 2);
  }
}

// Gradient-like values (each layer's scale, some heavy tails), and per the layer's
// injection kind NaN/Inf (any payload, signaling ones too) or values near the 16-bit
// types' limits (whose sums with a residual overflow).
void fill_values(Rng& rng, const Trial& t, Span& s, bool injections) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t i = 0; i < s.count; ++i) {
    const uint64_t e = s.first + i;
    const uint32_t l = layer_of(t, std::min<uint64_t>(e, t.layout.count - 1));
    float v = normal(rng) * t.layer_scale[l];
    if (chance(rng, 0.01)) v *= 40.0f;
    if (chance(rng, 0.002)) v = 0.0f;
    store_from_float(s.host.data(), s.dtype, i, v);
    if (!injections) continue;
    if (t.layer_injects[l] == 1 && chance(rng, 0.003)) put_bits(s, i, nan_bits(rng, s.dtype));
    if (t.layer_injects[l] == 2 && chance(rng, 0.05)) {
      const float big = pick<float>(rng, {65504.0f, 65519.0f, 65520.0f, -65504.0f, 70000.0f, 3.3e38f, -3.39e38f,
                                          1e38f, 6.0e-8f, 3.0e-39f});
      store_from_float(s.host.data(), s.dtype, i, big);
    }
  }
}

// A float32 residual: small, finite (the engine never lets a residual become
// non-finite), sometimes large enough to push values near 65504 over the float16 limit.
Span random_residual(Rng& rng, const Trial& t) {
  Span s = random_span(rng, t, DType::kFloat32);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t i = 0; i < s.count; ++i) {
    const uint32_t l = layer_of(t, std::min<uint64_t>(s.first + i, t.layout.count - 1));
    float v = 0.05f * normal(rng) * t.layer_scale[l];
    if (t.layer_injects[l] == 2 && chance(rng, 0.05)) v = pick<float>(rng, {20.0f, 40.0f, -40.0f, 1e3f});
    store_from_float(s.host.data(), DType::kFloat32, i, v);
  }
  return s;
}

// Accumulators: float32 values, a few NaN (canonical and others) and infinities when the
// trial injects them.
Span random_acc(Rng& rng, const Trial& t, bool injections) {
  Span s = random_span(rng, t, DType::kFloat32);
  fill_values(rng, t, s, false);
  if (injections)
    for (uint64_t i = 0; i < s.count; ++i)
      if (chance(rng, 0.001)) put_bits(s, i, nan_bits(rng, DType::kFloat32));
  return s;
}

std::vector<uint8_t> random_flags(Rng& rng, const Trial& t) {
  std::vector<uint8_t> f(t.layout.layers.size());
  for (uint32_t l = 0; l < f.size(); ++l) f[l] = chance(rng, 0.3) ? pick<uint8_t>(rng, {1, 2, 255}) : 0;
  return f;
}

ElementSpan cpu_span(Span& s) { return ElementSpan{s.host.data(), s.dtype, s.first}; }
ElementSpan gpu_span(const Span& s, const DeviceBuffer& d) { return ElementSpan{d.get(), s.dtype, s.first}; }
float* f32(const DeviceBuffer& d) { return reinterpret_cast<float*>(d.get()); }

// Payload bytes the segments need from their base (their offsets are within the partition).
uint64_t payload_bytes(const Trial& t) {
  uint64_t end = 0;
  for (const Segment& s : t.segments) end = std::max(end, s.byte_offset + s.bytes);
  return end;
}

// ---------------------------------------------------------------------------------------
// The operations on random plans

struct Ctx {
  Report& r;
  CpuBackend& cpu;
  CudaBackend& gpu;
  Rng& rng;
  cudaStream_t stream;
};

void expect_same(Ctx& c, const std::string& row, const std::string& what, const std::vector<uint8_t>& cpu,
                 const std::vector<uint8_t>& gpu, size_t width) {
  const Compared k = compare(cpu, gpu, width);
  if (k.differing)
    c.r.fail(row, strf("%s: %llu of %zu elements differ, first %s", what.c_str(), static_cast<ull>(k.differing),
                       cpu.size() / width, k.first.c_str()));
  else
    c.r.pass(row, cpu.size() / width);
}

void check_find_nonfinite(Ctx& c, const Trial& t) {
  DType dtype = t.layout.dtype;
  if (dtype != DType::kFloat32 && chance(c.rng, 0.3)) dtype = DType::kFloat32;  // a reduced sum
  Span in = random_span(c.rng, t, dtype);
  fill_values(c.rng, t, in, true);
  std::vector<uint8_t> flags(t.layout.layers.size(), kPoison);
  DeviceBuffer d_in = to_device(in.host), d_flags = to_device(flags);
  c.cpu.find_nonfinite(t.plan, t.segments, cpu_span(in), flags.data());
  c.gpu.find_nonfinite(t.plan, t.segments, gpu_span(in, d_in), d_flags.get());
  expect_same(c, "find_nonfinite", t.name + " flags", flags, from_device(d_flags.get(), flags.size()), 1);
}

// Encode, then decode and decode-accumulate the CPU's payload (the same as the GPU's
// when encode passed; decoding the CPU's keeps the checks apart).
void check_codec(Ctx& c, const Trial& t) {
  const bool reduced = t.layout.dtype != DType::kFloat32 && chance(c.rng, 0.35);
  Span in = random_span(c.rng, t, reduced ? DType::kFloat32 : t.layout.dtype);
  fill_values(c.rng, t, in, true);
  const bool with_residual = chance(c.rng, 0.75);
  Span res = random_residual(c.rng, t);
  std::vector<uint8_t> flags = random_flags(c.rng, t);
  const bool with_flags = chance(c.rng, 0.7);
  const NoiseBase noise{c.rng(), static_cast<uint32_t>(chance(c.rng, 0.3) ? NoiseBase::kReencodeRankBit | below(c.rng, 8)
                                                                           : below(c.rng, 8)),
                        c.rng(), static_cast<uint32_t>(below(c.rng, 1000))};
  const uint64_t base = 4 * below(c.rng, 17);
  std::vector<uint8_t> payload(base + payload_bytes(t) + 12, kPoison);

  DeviceBuffer d_in = to_device(in.host), d_res = to_device(res.host), d_flags = to_device(flags), d_payload = to_device(payload);
  const std::string what = strf("%s; input %s, %s, %s", t.name.c_str(), dtype_name(in.dtype),
                                with_residual ? "residual" : "no residual", with_flags ? "flags" : "no flags");
  c.cpu.encode(t.plan, t.segments, cpu_span(in), with_residual ? reinterpret_cast<float*>(res.host.data()) : nullptr,
               res.first, with_flags ? flags.data() : nullptr, noise, payload.data(), base);
  const std::vector<uint8_t> res_before = res.host, payload_before = payload;
  c.gpu.encode(t.plan, t.segments, gpu_span(in, d_in), with_residual ? f32(d_res) : nullptr, res.first,
               with_flags ? d_flags.get() : nullptr, noise, d_payload.get(), base);
  const std::vector<uint8_t> gpu_payload = from_device(d_payload), gpu_res = from_device(d_res);
  expect_same(c, "encode payload", what, payload, gpu_payload, 1);
  expect_same(c, "encode residual", what, res.host, gpu_res, 4);

  // prepare_encode: a fresh backend prepared for the whole plan encodes this partition's
  // segments (TopK's selection needs scratch) without allocating, to the same bytes.
  {
    auto fresh = CudaBackend::create(c.gpu.device(), 0);
    fresh->set_stream(c.stream);
    fresh->prepare_encode(t.plan);
    const uint64_t prepared = fresh->device_bytes();
    DeviceBuffer d_res2 = to_device(res_before), d_payload2 = to_device(payload_before);
    fresh->encode(t.plan, t.segments, gpu_span(in, d_in), with_residual ? f32(d_res2) : nullptr, res.first,
                  with_flags ? d_flags.get() : nullptr, noise, d_payload2.get(), base);
    c.r.check(fresh->device_bytes() == prepared, "prepare_encode",
              strf("%s: encode after prepare_encode changed device_bytes from %llu to %llu", t.name.c_str(),
                   static_cast<ull>(prepared), static_cast<ull>(fresh->device_bytes())));
    c.r.check(from_device(d_payload2) == gpu_payload && from_device(d_res2) == gpu_res, "prepare_encode",
              strf("%s: a prepared backend encoded other bytes than the unprepared one", t.name.c_str()));
  }

  // decode into any element type, poisoned around and between the segments.
  const DType out_dtype = kDTypes[below(c.rng, 3)];
  Span out = random_span(c.rng, t, out_dtype);
  DeviceBuffer d_pay = to_device(payload), d_out = to_device(out.host);
  c.cpu.decode(t.plan, t.segments, payload.data(), base, cpu_span(out));
  c.gpu.decode(t.plan, t.segments, d_pay.get(), base, gpu_span(out, d_out));
  expect_same(c, "decode", strf("%s; output %s", t.name.c_str(), dtype_name(out_dtype)), out.host, from_device(d_out),
              dtype_size(out_dtype));

  // decode_accumulate into float32 accumulators that may hold NaN already.
  Span acc = random_acc(c.rng, t, true);
  DeviceBuffer d_acc = to_device(acc.host);
  c.cpu.decode_accumulate(t.plan, t.segments, payload.data(), base, cpu_span(acc));
  c.gpu.decode_accumulate(t.plan, t.segments, d_pay.get(), base, gpu_span(acc, d_acc));
  expect_same(c, "decode_accumulate", t.name, acc.host, from_device(d_acc), 4);
}

void check_accumulate_exact(Ctx& c, const Trial& t) {
  const bool reduced = t.layout.dtype != DType::kFloat32 && chance(c.rng, 0.3);
  Span in = random_span(c.rng, t, reduced ? DType::kFloat32 : t.layout.dtype);
  fill_values(c.rng, t, in, true);
  const bool with_residual = chance(c.rng, 0.75);
  Span res = random_residual(c.rng, t);
  std::vector<uint8_t> flags = random_flags(c.rng, t);
  const bool with_flags = chance(c.rng, 0.7);
  Span acc = random_acc(c.rng, t, true);
  DeviceBuffer d_in = to_device(in.host), d_res = to_device(res.host), d_flags = to_device(flags), d_acc = to_device(acc.host);
  c.cpu.accumulate_exact(t.plan, t.segments, cpu_span(in),
                         with_residual ? reinterpret_cast<float*>(res.host.data()) : nullptr, res.first,
                         with_flags ? flags.data() : nullptr, cpu_span(acc));
  c.gpu.accumulate_exact(t.plan, t.segments, gpu_span(in, d_in), with_residual ? f32(d_res) : nullptr, res.first,
                         with_flags ? d_flags.get() : nullptr, gpu_span(acc, d_acc));
  const std::string what = strf("%s; input %s, %s, %s", t.name.c_str(), dtype_name(in.dtype),
                                with_residual ? "residual" : "no residual", with_flags ? "flags" : "no flags");
  expect_same(c, "accumulate_exact", what + " (sums)", acc.host, from_device(d_acc), 4);
  expect_same(c, "accumulate_exact", what + " (residual)", res.host, from_device(d_res), 4);
}

// The statistics: rows of unmeasured layers exactly as they were, nonfinite bytes exactly,
// measured rows within the tolerance.
void check_measure(Ctx& c, const Trial& t) {
  const bool reduced = t.layout.dtype != DType::kFloat32 && chance(c.rng, 0.3);
  Span in = random_span(c.rng, t, reduced ? DType::kFloat32 : t.layout.dtype);
  fill_values(c.rng, t, in, chance(c.rng, 0.5));
  const bool with_residual = chance(c.rng, 0.7);
  Span res = random_residual(c.rng, t);
  const size_t layers = t.layout.layers.size(), nc = t.candidates.size();
  std::vector<uint8_t> measured(layers);
  for (auto& m : measured) m = chance(c.rng, 0.75);
  std::vector<double> squared(layers * nc);
  for (auto& v : squared) v = std::uniform_real_distribution<double>(0.0, 2.0)(c.rng);
  std::vector<uint8_t> nonfinite(layers);
  for (auto& v : nonfinite) v = chance(c.rng, 0.1);
  const double weight = pick<double>(c.rng, {1.0, 1.0, 1.0 / 16, 0.37});
  const std::vector<double> squared_before = squared;
  const std::vector<uint8_t> nonfinite_before = nonfinite;
  // Sometimes a subset of the candidates (the engine measures families at different
  // stages): the others' columns must stay as they were.
  std::vector<uint8_t> mask;
  if (chance(c.rng, 0.4))
    for (size_t k = 0; k < nc; ++k) mask.push_back(chance(c.rng, 0.6));

  DeviceBuffer d_in = to_device(in.host), d_res = to_device(res.host), d_sq = to_device(bytes_of(squared)),
      d_nf = to_device(nonfinite);
  collective::Backend::Measure m_cpu{t.candidates, measured, squared.data(), nonfinite.data(), weight, mask};
  collective::Backend::Measure m_gpu{t.candidates, measured, reinterpret_cast<double*>(d_sq.get()), d_nf.get(), weight,
                                     mask};
  c.cpu.measure(t.plan, t.segments, cpu_span(in), with_residual ? reinterpret_cast<const float*>(res.host.data()) : nullptr,
                res.first, m_cpu);
  c.gpu.measure(t.plan, t.segments, gpu_span(in, d_in), with_residual ? f32(d_res) : nullptr, res.first, m_gpu);
  const std::vector<uint8_t> got_sq_bytes = from_device(d_sq), got_nf = from_device(d_nf);

  // prepare_measure: a fresh backend prepared for the whole plan and these candidates
  // then measures this partition's segments and this random subset of layers (which packs
  // its job tables differently from the plan) without allocating, and to the same bytes.
  {
    auto fresh = CudaBackend::create(c.gpu.device(), 0);
    fresh->set_stream(c.stream);
    fresh->prepare_measure(t.plan, t.candidates);
    const uint64_t prepared = fresh->device_bytes();
    DeviceBuffer d_sq2 = to_device(bytes_of(squared_before)), d_nf2 = to_device(nonfinite_before);
    collective::Backend::Measure m2{t.candidates, measured, reinterpret_cast<double*>(d_sq2.get()), d_nf2.get(),
                                    weight, mask};
    fresh->measure(t.plan, t.segments, gpu_span(in, d_in), with_residual ? f32(d_res) : nullptr, res.first, m2);
    c.r.check(fresh->device_bytes() == prepared, "prepare_measure",
              strf("%s: measure after prepare_measure changed device_bytes from %llu to %llu", t.name.c_str(),
                   static_cast<ull>(prepared), static_cast<ull>(fresh->device_bytes())));
    c.r.check(from_device(d_sq2) == got_sq_bytes && from_device(d_nf2) == got_nf, "prepare_measure",
              strf("%s: a prepared backend measured other bytes than the unprepared one", t.name.c_str()));
  }
  std::vector<double> got(layers * nc);
  memcpy(got.data(), got_sq_bytes.data(), got.size() * sizeof(double));

  // The allowance per layer and candidate (docs/KERNELS.md, "Tolerance against the CPU").
  std::vector<double> slack(layers * nc, 0.0);
  for (const Segment& s : t.segments) {
    if (!measured[s.layer]) continue;
    std::vector<float> v(s.count);
    for (uint64_t i = 0; i < s.count; ++i) {
      const float x = load_as_float(in.host.data(), in.dtype, s.offset - in.first + i);
      v[i] = with_residual ? x + f32_at(res.host, s.offset - res.first + i) : x;
    }
    for (size_t k = 0; k < nc; ++k) {
      double sum = static_cast<double>(s.count) * 0x1p-149;
      if (t.candidates[k].family() == CodecFamily::kQuant) {
        const QuantParams& p = t.candidates[k].quant_params();
        const double top = static_cast<double>(quant::max_code(p.bits));
        for (uint64_t b = 0; b < s.count; b += p.bucket) {
          const uint64_t n = std::min<uint64_t>(p.bucket, s.count - b);
          double lo = INFINITY, hi = -INFINITY;
          bool finite = true;
          for (uint64_t i = b; i < b + n; ++i) {
            finite = finite && quant::is_finite_value(v[i]);
            lo = std::min(lo, static_cast<double>(v[i]));
            hi = std::max(hi, static_cast<double>(v[i]));
          }
          if (!finite) continue;
          const double range = hi - lo;
          sum += static_cast<double>(n) * (range / top) * (range + std::max(std::fabs(lo), std::fabs(hi))) *
                 kStatsResolution;
        }
      }
      slack[s.layer * nc + k] += weight * sum;
    }
  }
  uint64_t bad = 0;
  std::string first;
  for (size_t l = 0; l < layers; ++l) {
    for (size_t k = 0; k < nc; ++k) {
      const size_t i = l * nc + k;
      const double want = squared[i], have = got[i];
      bool ok;
      if (!measured[l] || (!mask.empty() && !mask[k]) || std::isinf(want) || std::isnan(want)) {
        ok = memcmp(&want, &have, sizeof want) == 0 || (std::isnan(want) && std::isnan(have));
      } else {
        const double added_cpu = want - squared_before[i];
        ok = std::isfinite(have) && std::fabs(have - want) <= kStatsRelTolerance * std::fabs(added_cpu) + slack[i] +
                                                                  1e-15 * std::fabs(squared_before[i]);
      }
      if (!ok && bad++ == 0)
        first = strf("layer %zu candidate %s: cpu %.9g, gpu %.9g (allowed %.3g)", l, t.candidates[k].str().c_str(), want,
                     have, kStatsRelTolerance * std::fabs(want - squared_before[i]) + slack[i]);
    }
  }
  const std::string what = strf("%s; input %s, %s, weight %g", t.name.c_str(), dtype_name(in.dtype),
                                with_residual ? "residual" : "no residual", weight);
  if (bad)
    c.r.fail("measure", strf("%s: %llu of %zu values out of tolerance, first %s", what.c_str(), static_cast<ull>(bad),
                             got.size(), first.c_str()));
  else
    c.r.pass("measure", got.size());
  expect_same(c, "measure nonfinite", what, nonfinite, got_nf, 1);
}

// ---------------------------------------------------------------------------------------
// Low rank: the lowrank_* operations and measure_lowrank on a few matrix layers placed at
// random offsets of a call, each against the CPU backend given the same inputs (so that
// one operation's tolerance does not carry into the next), with docs/KERNELS.md's
// tolerances where cuBLAS's float32 sums differ from the CPU's float64 ones. What this
// adds to lgreco-gpu-lowrank-check (the kernels themselves): the backend's wiring (layer
// offsets, P and Q offsets, flags, residual, scale, output type, the candidate columns),
// and that after prepare_lowrank nothing is allocated.

using LowRankLayer = collective::Backend::LowRankLayer;

// ||a - b|| / ||b|| over [at, at + n) of two float32 arrays (0 when both are 0).
double relative_error(const std::vector<float>& a, const std::vector<float>& b, uint64_t at, uint64_t n) {
  double diff = 0, norm = 0;
  for (uint64_t i = at; i < at + n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}
std::vector<float> floats_of(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  if (!f.empty()) memcpy(f.data(), b.data(), f.size() * 4);
  return f;
}
std::vector<float> normal_floats(Rng& rng, uint64_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void check_lowrank(Report& r, CpuBackend& cpu, int device, cudaStream_t stream, Rng& rng, int index) {
  // 1..4 layers, shapes from vectors to 1024 x 512, ranks up to 8 (some above a side).
  const DType dtype = kDTypes[below(rng, 3)];
  const bool with_residual = chance(rng, 0.75);
  std::vector<LowRankLayer> layers;
  uint64_t offset = below(rng, 100), p_floats = 0, q_floats = 0;
  const size_t n_layers = 1 + below(rng, 4);
  for (size_t i = 0; i < n_layers; ++i) {
    LowRankLayer l;
    l.layer = static_cast<uint32_t>(2 * i + below(rng, 2));  // not every bucket layer is low rank
    l.rows = pick<uint64_t>(rng, {1, 3, 37, 64, 300, 1024});
    l.cols = pick<uint64_t>(rng, {1, 5, 48, 64, 257, 512});
    l.rank = static_cast<uint32_t>(pick<uint64_t>(rng, {1, 2, 4, 8}));
    l.offset = offset;
    l.p_offset = p_floats;
    l.q_offset = q_floats;
    offset += l.rows * l.cols + below(rng, 50);  // gaps the operations must leave alone
    p_floats += l.rows * l.rank;
    q_floats += l.cols * l.rank;
    layers.push_back(l);
  }
  const uint64_t count = offset + below(rng, 20);
  const uint32_t bucket_layers = 2 * static_cast<uint32_t>(n_layers) + 1;
  std::string shapes;
  for (const LowRankLayer& l : layers)
    shapes += strf("%s%llux%llu@%u", shapes.empty() ? "" : " ", static_cast<ull>(l.rows), static_cast<ull>(l.cols), l.rank);
  const std::string name = strf("low rank %d: %s, %s, %s", index, dtype_name(dtype), shapes.c_str(),
                                with_residual ? "residual" : "no residual");

  // Input: gradient-like values; a flagged layer (an overflow step) ignores its residual.
  Trial shape;  // fill_values needs a layout: one layer of the whole call, scale 1
  shape.layout.count = count;
  shape.layout.layers.push_back(collective::LayerLayout{"all", 0, count, {}, 0});
  shape.layer_scale = {1.0f};
  shape.layer_injects = {0};
  Span in{0, count, dtype, std::vector<uint8_t>(count * dtype_size(dtype))};
  fill_values(rng, shape, in, false);
  std::vector<float> residual = normal_floats(rng, count);
  for (float& v : residual) v *= 0.05f;
  std::vector<uint8_t> flags(bucket_layers, 0);
  for (auto& f : flags) f = chance(rng, 0.25) ? 1 : 0;
  const std::vector<float> q_in = normal_floats(rng, q_floats);
  const std::vector<float> p_poison(p_floats, std::numeric_limits<float>::quiet_NaN());

  auto gpu = CudaBackend::create(device, 0);
  gpu->set_stream(stream);
  // Without prepare_lowrank there is no cuBLAS context: the engine's mistake, refused.
  {
    DeviceBuffer d_in = to_device(in.host), d_q = to_device(bytes_of(q_in)), d_p = to_device(bytes_of(p_poison));
    bool refused = false;
    try {
      gpu->lowrank_project(layers, gpu_span(in, d_in), nullptr, nullptr, f32(d_q), f32(d_p));
    } catch (const std::logic_error&) {
      refused = true;
    }
    r.check(refused, "lowrank unprepared", name + ": lowrank_project before prepare_lowrank did not throw");
  }
  gpu->prepare_lowrank(layers, layers, 8, dtype, with_residual);
  const uint64_t prepared = gpu->device_bytes();

  DeviceBuffer d_in = to_device(in.host), d_res = to_device(bytes_of(residual)), d_flags = to_device(flags);
  float* const cpu_res = with_residual ? residual.data() : nullptr;
  float* const gpu_res = with_residual ? f32(d_res) : nullptr;
  const uint8_t* const cpu_flags = with_residual ? flags.data() : nullptr;
  const uint8_t* const gpu_flags = with_residual ? d_flags.get() : nullptr;
  // Per layer: the worst relative error of an operation, checked against its bound.
  const auto within = [&](const char* row, const std::vector<float>& got, const std::vector<float>& want, bool by_p,
                          double bound) {
    double worst = 0;
    for (const LowRankLayer& l : layers) {
      const uint64_t at = by_p ? l.p_offset : l.q_offset, n = (by_p ? l.rows : l.cols) * l.rank;
      worst = std::max(worst, relative_error(got, want, at, n));
    }
    r.check(worst <= bound, row, strf("%s: relative error %.3g above %.0e", name.c_str(), worst, bound));
    r.note(row, strf("worst %.1e", worst));
  };

  // project: P = M Q.
  std::vector<float> p_cpu(p_floats);
  cpu.lowrank_project(layers, cpu_span(in), cpu_res, cpu_flags, q_in.data(), p_cpu.data());
  DeviceBuffer d_q = to_device(bytes_of(q_in)), d_p = to_device(bytes_of(p_poison));
  gpu->lowrank_project(layers, gpu_span(in, d_in), gpu_res, gpu_flags, f32(d_q), f32(d_p));
  within("lowrank_project", floats_of(from_device(d_p)), p_cpu, true, 1e-5);

  // orthonormalize the CPU's P on both sides.
  DeviceBuffer d_p2 = to_device(bytes_of(p_cpu));
  cpu.lowrank_orthonormalize(layers, p_cpu.data());
  gpu->lowrank_orthonormalize(layers, f32(d_p2));
  within("lowrank_orthonormalize", floats_of(from_device(d_p2)), p_cpu, true, 1e-6);

  // back_project from the same P: Q' within cuBLAS's tolerance; the residual of an
  // unflagged layer within 1e-5 ||M|| (each side subtracts its own Q'), of a flagged layer
  // and of the gaps bit for bit untouched.
  std::vector<float> q_cpu(q_floats);
  std::vector<float> res_cpu = residual;
  DeviceBuffer d_p3 = to_device(bytes_of(p_cpu)), d_q2 = to_device(std::vector<uint8_t>(q_floats * 4, kPoison));
  cpu.lowrank_back_project(layers, cpu_span(in), with_residual ? res_cpu.data() : nullptr, cpu_flags, p_cpu.data(),
                           q_cpu.data());
  gpu->lowrank_back_project(layers, gpu_span(in, d_in), gpu_res, gpu_flags, f32(d_p3), f32(d_q2));
  within("lowrank_back_project", floats_of(from_device(d_q2)), q_cpu, false, 1e-5);
  if (with_residual) {
    const std::vector<float> res_gpu = floats_of(from_device(d_res));
    std::vector<uint8_t> in_layer(count, 0);
    double worst = 0;
    for (const LowRankLayer& l : layers) {
      for (uint64_t i = l.offset; i < l.offset + l.rows * l.cols; ++i) in_layer[i] = flags[l.layer] ? 0 : 1;
      double m2 = 0, d2 = 0;
      for (uint64_t i = l.offset; i < l.offset + l.rows * l.cols; ++i) {
        const double m = load_as_float(in.host.data(), dtype, i) + static_cast<double>(residual[i]);
        m2 += m * m;
        d2 += (static_cast<double>(res_gpu[i]) - res_cpu[i]) * (static_cast<double>(res_gpu[i]) - res_cpu[i]);
      }
      if (!flags[l.layer] && m2 > 0) worst = std::max(worst, std::sqrt(d2 / m2));
    }
    uint64_t moved = 0;
    for (uint64_t i = 0; i < count; ++i)
      if (!in_layer[i] && memcmp(&res_gpu[i], &res_cpu[i], 4) != 0) ++moved;
    r.check(worst <= 1e-5, "lowrank residual", strf("%s: residual off by %.3g x ||M||", name.c_str(), worst));
    r.check(moved == 0, "lowrank residual",
            strf("%s: %llu residual values outside unflagged layers changed", name.c_str(), static_cast<ull>(moved)));
    r.note("lowrank residual", strf("worst %.1e", worst));
  }

  // reconstruct from the same P and Q': bit for bit, gaps poisoned and untouched.
  const float scale = pick<float>(rng, {1.0f, 0.25f, 1.0f / 3.0f});
  const DType out_dtype = kDTypes[below(rng, 3)];
  Span out_cpu{0, count, out_dtype, std::vector<uint8_t>(count * dtype_size(out_dtype), kPoison)};
  DeviceBuffer d_out = to_device(out_cpu.host), d_p4 = to_device(bytes_of(p_cpu)), d_q3 = to_device(bytes_of(q_cpu));
  cpu.lowrank_reconstruct(layers, p_cpu.data(), q_cpu.data(), scale, cpu_span(out_cpu));
  gpu->lowrank_reconstruct(layers, f32(d_p4), f32(d_q3), scale, gpu_span(out_cpu, d_out));
  {
    const Compared k = compare(out_cpu.host, from_device(d_out), dtype_size(out_dtype));
    r.check(k.differing == 0, "lowrank_reconstruct",
            strf("%s; scale %g, output %s: %llu elements differ, first %s", name.c_str(), scale, dtype_name(out_dtype),
                 static_cast<ull>(k.differing), k.first.c_str()));
  }

  // keep: Q' with a zero column and a NaN column restarts them from Q0, bit for bit.
  std::vector<float> q_new = q_cpu, q0 = normal_floats(rng, q_floats), q_kept(q_floats, -7.0f);
  for (const LowRankLayer& l : layers) {
    const uint32_t c = static_cast<uint32_t>(below(rng, l.rank));
    const bool nan = chance(rng, 0.5);
    if (chance(rng, 0.6))
      for (uint64_t j = 0; j < l.cols; ++j)
        q_new[l.q_offset + j * l.rank + c] = nan && j == l.cols / 2 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  DeviceBuffer d_qn = to_device(bytes_of(q_new)), d_q0 = to_device(bytes_of(q0)), d_qk = to_device(bytes_of(q_kept));
  cpu.lowrank_keep(layers, q_new.data(), q0.data(), q_kept.data());
  gpu->lowrank_keep(layers, f32(d_qn), f32(d_q0), f32(d_qk));
  {
    const Compared k = compare(bytes_of(q_kept), from_device(d_qk), 4);
    r.check(k.differing == 0, "lowrank_keep",
            strf("%s: %llu values differ, first %s", name.c_str(), static_cast<ull>(k.differing), k.first.c_str()));
  }

  // measure_lowrank: the PowerSGD columns of a mixed candidate list (the others untouched),
  // layers measured at random; |gpu - cpu| <= 1e-5 x weight x ||M||^2 per layer and rank.
  const std::vector<CodecSpec> candidates = {CodecSpec::parse("quant:bits=4"), CodecSpec::parse("powersgd:rank=1"),
                                             CodecSpec::parse("topk:density=0.01"), CodecSpec::parse("powersgd:rank=3"),
                                             CodecSpec::parse("powersgd:rank=8")};
  const std::vector<uint8_t> mask = {0, 1, 0, 1, 1};
  std::vector<uint8_t> measured(bucket_layers);
  for (auto& m : measured) m = chance(rng, 0.8);
  std::vector<double> squared(bucket_layers * candidates.size());
  for (double& v : squared) v = std::uniform_real_distribution<double>(0.0, 2.0)(rng);
  std::vector<uint8_t> nonfinite(bucket_layers, 0);
  const std::vector<double> before = squared;
  const double weight = pick<double>(rng, {1.0, 1.0 / 16});
  const NoiseBase key{rng(), 0, rng(), static_cast<uint32_t>(below(rng, 1000))};
  DeviceBuffer d_sq = to_device(bytes_of(squared)), d_nf = to_device(nonfinite);
  cpu.measure_lowrank(layers, cpu_span(in), cpu_res, key,
                      collective::Backend::Measure{candidates, measured, squared.data(), nonfinite.data(), weight, mask});
  gpu->measure_lowrank(layers, gpu_span(in, d_in), gpu_res, key,
                       collective::Backend::Measure{candidates, measured, reinterpret_cast<double*>(d_sq.get()),
                                                    d_nf.get(), weight, mask});
  {
    std::vector<double> got(squared.size());
    memcpy(got.data(), from_device(d_sq).data(), got.size() * 8);
    uint64_t bad = 0;
    std::string first;
    double worst = 0;
    for (uint32_t l = 0; l < bucket_layers; ++l) {
      const auto it = std::find_if(layers.begin(), layers.end(), [&](const LowRankLayer& x) { return x.layer == l; });
      double m2 = 0;
      if (it != layers.end())
        for (uint64_t i = it->offset; i < it->offset + it->rows * it->cols; ++i) {
          const double m = load_as_float(in.host.data(), dtype, i) + (with_residual ? residual[i] : 0.0);
          m2 += m * m;
        }
      for (size_t k = 0; k < candidates.size(); ++k) {
        const size_t i = l * candidates.size() + k;
        const bool exact = it == layers.end() || !measured[l] || !mask[k];
        const double diff = std::fabs(got[i] - squared[i]);
        const bool ok = exact ? memcmp(&got[i], &squared[i], 8) == 0 && got[i] == before[i]
                              : diff <= 1e-5 * weight * m2 + 1e-12 * std::fabs(before[i]);
        if (!exact && m2 > 0) worst = std::max(worst, diff / (weight * m2));
        if (!ok && bad++ == 0)
          first = strf("layer %u %s: cpu %.9g, gpu %.9g", l, candidates[k].str().c_str(), squared[i], got[i]);
      }
    }
    r.check(bad == 0, "measure_lowrank", strf("%s: %llu values out of tolerance, first %s", name.c_str(),
                                               static_cast<ull>(bad), first.c_str()));
    r.note("measure_lowrank", strf("worst %.1e ||M||^2", worst));
    const Compared k = compare(nonfinite, from_device(d_nf), 1);
    r.check(k.differing == 0, "measure_lowrank", name + ": nonfinite flags differ: " + k.first);
  }
  r.check(gpu->device_bytes() == prepared, "prepare_lowrank",
          strf("%s: the operations after prepare_lowrank changed device_bytes from %llu to %llu", name.c_str(),
               static_cast<ull>(prepared), static_cast<ull>(gpu->device_bytes())));
}

// divide and narrow over flat arrays, starting at an odd element (no 16-byte alignment).
std::vector<uint8_t> flat_values(Rng& rng, uint64_t n) {
  std::vector<uint8_t> b(n * 4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t i = 0; i < n; ++i) {
    float v = normal(rng) * pick<float>(rng, {1e-6f, 1.0f, 1e3f, 6e4f});
    uint32_t bits = float_bits(v);
    const int kind = static_cast<int>(below(rng, 1000));
    if (kind < 4) bits = pick<uint32_t>(rng, {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa00123u, 0xff812345u});
    else if (kind < 8) bits = pick<uint32_t>(rng, {0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u});
    else if (kind < 20) bits = pick<uint32_t>(rng, {0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u, 0x00000001u,
                                                     0x7f7fffffu, 0x7f7f8000u, 0x387fc000u, 0x3f808000u, 0x3f818000u});
    else if (kind < 30) bits = static_cast<uint32_t>(rng());  // anything at all
    memcpy(b.data() + i * 4, &bits, 4);
  }
  return b;
}

void check_divide(Ctx& c) {
  const uint64_t n = 1 + below(c.rng, 300000), skip = below(c.rng, 3);
  std::vector<uint8_t> acc = flat_values(c.rng, n + skip);
  const float divisor = pick<float>(c.rng, {1.0f, 2.0f, 3.0f, 4.0f, 7.0f, 8.0f, 0.1f, 3e-39f, 0.0f, -5.0f});
  DeviceBuffer d = to_device(acc);
  c.cpu.divide(reinterpret_cast<float*>(acc.data()) + skip, n, divisor);
  c.gpu.divide(f32(d) + skip, n, divisor);
  expect_same(c, "divide", strf("%llu values / %g", static_cast<ull>(n), divisor), acc, from_device(d), 4);
}

void check_narrow(Ctx& c) {
  const uint64_t n = 1 + below(c.rng, 300000), skip = below(c.rng, 3);
  const DType dtype = kDTypes[below(c.rng, 3)];
  std::vector<uint8_t> acc = flat_values(c.rng, n + skip);
  std::vector<uint8_t> out((n + 9) * dtype_size(dtype), kPoison);
  DeviceBuffer d_acc = to_device(acc), d_out = to_device(out);
  c.cpu.narrow(reinterpret_cast<const float*>(acc.data()) + skip, n,
               ElementSpan{out.data() + dtype_size(dtype), dtype, 12345});
  c.gpu.narrow(f32(d_acc) + skip, n, ElementSpan{d_out.get() + dtype_size(dtype), dtype, 12345});
  expect_same(c, "narrow", strf("%llu values to %s", static_cast<ull>(n), dtype_name(dtype)), out, from_device(d_out),
              dtype_size(dtype));
}

// gather: runs (some reaching outside the source's clip range) of any element type into
// float32, scaled, copied or accumulated: the same bits as the CPU's.
void check_gather(Ctx& c) {
  const DType dtype = kDTypes[below(c.rng, 3)];
  const uint64_t n = 1 + below(c.rng, 200000), first = below(c.rng, 5000);
  std::vector<uint8_t> src(n * dtype_size(dtype));
  const std::vector<uint8_t> values = flat_values(c.rng, n);
  for (uint64_t i = 0; i < n; ++i) store_from_float(src.data(), dtype, i, f32_at(values, i));
  std::vector<collective::Backend::Run> runs;
  uint64_t to = 0;
  const size_t count = 1 + below(c.rng, 150);  // more than one launch's table
  for (size_t k = 0; k < count; ++k) {
    const uint64_t len = 1 + below(c.rng, 3000);
    runs.push_back({first + below(c.rng, n + 100) - (chance(c.rng, 0.1) ? std::min<uint64_t>(first, 50) : 0), to, len});
    to += len + below(c.rng, 3);
  }
  const uint64_t end = first + n - below(c.rng, std::min<uint64_t>(n, 200));
  const float scale = pick<float>(c.rng, {1.0f, 0.25f, -1.0f, 1e-30f, 3.0f});
  const bool accumulate = chance(c.rng, 0.5);
  std::vector<uint8_t> dst = flat_values(c.rng, to + 7);
  DeviceBuffer d_src = to_device(src), d_dst = to_device(dst);
  c.cpu.gather(runs, ElementSpan{src.data(), dtype, first}, end, scale, accumulate, reinterpret_cast<float*>(dst.data()));
  c.gpu.gather(runs, ElementSpan{d_src.get(), dtype, first}, end, scale, accumulate, f32(d_dst));
  expect_same(c, "gather",
              strf("%zu runs of %s x %g%s", runs.size(), dtype_name(dtype), scale, accumulate ? ", accumulated" : ""),
              dst, from_device(d_dst), 4);
}

// distance: per layer the sum of |a - b|^power in double, of segments that share layers
// (more than one launch's table), a of any element type, b null or not; within 1e-12 of
// the sum of the terms' magnitudes (the GPU adds in a tree, the CPU in order), and the
// same non-finite flags.
void check_distance(Ctx& c) {
  const DType dtype = kDTypes[below(c.rng, 3)];
  const uint64_t n = 1 + below(c.rng, 300000), first = below(c.rng, 1000);
  const uint32_t layers = static_cast<uint32_t>(1 + below(c.rng, 40));
  const std::vector<uint8_t> av = flat_values(c.rng, n), bv = flat_values(c.rng, n);
  std::vector<uint8_t> a(n * dtype_size(dtype));
  for (uint64_t i = 0; i < n; ++i) store_from_float(a.data(), dtype, i, f32_at(av, i));
  const bool with_b = chance(c.rng, 0.6);
  const int power = chance(c.rng, 0.5) ? 1 : 2;
  std::vector<Segment> segments;
  for (uint64_t at = 0; at < n;) {
    Segment s;
    s.layer = static_cast<uint32_t>(below(c.rng, layers));
    s.offset = first + at;
    s.count = std::min<uint64_t>(n - at, 1 + below(c.rng, 20000));
    at += s.count;
    segments.push_back(s);
  }
  std::vector<double> out(layers, 0.25);
  std::vector<uint8_t> flags(layers, 0);
  DeviceBuffer d_a = to_device(a), d_b = to_device(bv), d_out(layers * sizeof(double)), d_flags = to_device(flags);
  LGRECO_CUDA_CHECK(cudaMemcpy(d_out.get(), out.data(), layers * sizeof(double), cudaMemcpyHostToDevice));
  const double weight = pick<double>(c.rng, {1.0, 0.0625, 16.0});
  const float* b_cpu = with_b ? reinterpret_cast<const float*>(bv.data()) : nullptr;
  c.cpu.distance(segments, ElementSpan{a.data(), dtype, first}, b_cpu, power, weight, out.data(), flags.data());
  c.gpu.distance(segments, ElementSpan{d_a.get(), dtype, first}, with_b ? f32(d_b) : nullptr, power, weight,
                 reinterpret_cast<double*>(d_out.get()), d_flags.get());
  const std::vector<uint8_t> got = from_device(d_out), got_flags = from_device(d_flags);
  // The terms' magnitudes per layer, for the tolerance.
  std::vector<double> scale(layers, 0.0);
  for (const Segment& s : segments)
    for (uint64_t i = 0; i < s.count; ++i) {
      const double x = load_as_float(a.data(), dtype, s.offset - first + i);
      const double d = std::fabs(with_b ? x - static_cast<double>(f32_at(bv, s.offset - first + i)) : x);
      if (std::isfinite(d)) scale[s.layer] += weight * (power == 2 ? d * d : d);
    }
  std::string bad;
  for (uint32_t l = 0; l < layers && bad.empty(); ++l) {
    double g;
    memcpy(&g, got.data() + l * 8, 8);
    if (got_flags[l] != flags[l]) bad = strf("layer %u: nonfinite %d on the cpu, %d on the gpu", l, flags[l], got_flags[l]);
    else if (!flags[l] && !(std::fabs(g - out[l]) <= 1e-12 * scale[l] + 1e-300))
      bad = strf("layer %u: cpu %.17g, gpu %.17g", l, out[l], g);
  }
  const std::string what = strf("%zu segments of %s over %u layers, power %d%s", segments.size(), dtype_name(dtype),
                                layers, power, with_b ? ", a - b" : "");
  if (bad.empty()) c.r.pass("distance", n);
  else c.r.fail("distance", what + ": " + bad);
}

// sketch: signed runs of float32 values into buckets (kernels/sketch.h), more runs than
// one launch's table, widths from 1 to beyond the runs' lengths, poisoned outputs between
// the runs left alone: the same bits as the CPU's (both sum in double in the same order,
// and each term is exact).
void check_sketch(Ctx& c) {
  const uint64_t n = 1 + below(c.rng, 300000);
  const std::vector<uint8_t> src = flat_values(c.rng, n);
  std::vector<collective::Backend::SketchRun> runs;
  uint64_t to = 0;
  const size_t count = 1 + below(c.rng, 80);
  for (size_t k = 0; k < count; ++k) {
    collective::Backend::SketchRun r;
    r.from = below(c.rng, n);
    r.count = below(c.rng, std::min<uint64_t>(n - r.from, 40000) + 1);
    r.width = pick<uint64_t>(c.rng, {1, 7, 256, 1024, 1 + below(c.rng, 5000)});
    r.to = to;
    r.key = c.rng();
    to += r.width + below(c.rng, 3);
    runs.push_back(r);
  }
  std::vector<uint8_t> dst = flat_values(c.rng, to + 5);
  DeviceBuffer d_src = to_device(src), d_dst = to_device(dst);
  c.cpu.sketch(runs, reinterpret_cast<const float*>(src.data()), reinterpret_cast<float*>(dst.data()));
  c.gpu.sketch(runs, f32(d_src), f32(d_dst));
  expect_same(c, "sketch", strf("%zu runs over %llu values", runs.size(), static_cast<ull>(n)), dst, from_device(d_dst),
              4);
}

// One rank's fabric over device memory: the probe's exchange is a copy on the stream.
class DeviceLoopback final : public collective::Fabric {
 public:
  explicit DeviceLoopback(cudaStream_t stream) : stream_(stream) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "device loopback"; }
  void all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                    std::span<const uint64_t>) override {
    if (send_bytes[0]) LGRECO_CUDA_CHECK(cudaMemcpyAsync(recv, send, send_bytes[0], cudaMemcpyDeviceToDevice, stream_));
  }
  void all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) override {
    if (bytes[0]) LGRECO_CUDA_CHECK(cudaMemcpyAsync(recv, send, bytes[0], cudaMemcpyDeviceToDevice, stream_));
  }
  void all_reduce_sum(std::span<float>) override {}
  void all_reduce_sum(std::span<double>) override {}
  collective::FabricCounters counters() const override { return {}; }
  void abort(const std::string&) override {}

 private:
  cudaStream_t stream_;
};

// The error probe (plugin/collective/probe.h) through the backend: one rank (every layer
// simulated here), random quant and TopK candidates, both algorithms; a probe step and the
// realized error on the GPU against the same on the CPU. Simulated and realized errors
// come from bit-identical encodes, so they agree within distance's tolerance; reference
// (Backend::measure) within the statistics' tolerance.
void check_probe(Ctx& c, int index) {
  std::vector<CodecSpec> candidates = {CodecSpec::parse("quant:bits=4")};
  for (size_t k = 0; k < 1 + below(c.rng, 4); ++k) {
    const CodecSpec q = chance(c.rng, 0.7) ? random_quant(c.rng) : random_topk(c.rng);
    if (std::find(candidates.begin(), candidates.end(), q) == candidates.end()) candidates.push_back(q);
  }
  collective::BucketLayout layout;
  const uint32_t layers = static_cast<uint32_t>(1 + below(c.rng, 6));
  std::vector<uint8_t> measured;
  std::vector<std::vector<uint32_t>> columns;
  for (uint32_t l = 0; l < layers; ++l) {
    collective::LayerLayout layer;
    layer.name = "layer" + std::to_string(l);
    layer.offset = layout.count;
    layer.numel = 4096 + below(c.rng, 200000);
    layer.candidates = candidates;
    layout.count += layer.numel;
    layout.layers.push_back(layer);
    measured.push_back(1);
    columns.emplace_back();
    for (uint32_t k = 0; k < candidates.size(); ++k) columns.back().push_back(k);
  }
  const bool sra = chance(c.rng, 0.5), average = chance(c.rng, 0.5);
  collective::ProbeSettings settings;
  settings.seed = c.rng();
  settings.fraction = pick<double>(c.rng, {1.0 / 16, 0.25, 1.0});
  std::vector<CodecSpec> current;
  for (uint32_t l = 0; l < layers; ++l) current.push_back(candidates[below(c.rng, candidates.size())]);
  collective::BucketProbe cpu_probe(layout, 0, measured, columns, candidates, 1, 0, settings);
  collective::BucketProbe gpu_probe(layout, 0, measured, columns, candidates, 1, 0, settings);
  cpu_probe.set_assignment(current, sra);
  gpu_probe.set_assignment(current, sra);
  cpu_probe.prepare(c.cpu, candidates);
  gpu_probe.prepare(c.gpu, candidates);
  const collective::BucketProbe::Scratch need = cpu_probe.scratch_bytes();
  struct Side {
    std::vector<std::unique_ptr<collective::Backend::Buffer>> held;
    collective::BucketProbe::Buffers buf;
    collective::ProbeOutput out;
    uint8_t* tables = nullptr;
  };
  const uint64_t cells = layers * candidates.size();
  const uint64_t table_bytes = cells * 8 * 3 + layers * 8 + cells + 2 * layers;
  const auto make = [&](collective::Backend& b) {
    Side s;
    const auto get = [&](uint64_t bytes) {
      s.held.push_back(b.allocate(std::max<uint64_t>(bytes, 64)));
      return static_cast<uint8_t*>(s.held.back()->data());
    };
    s.buf = {reinterpret_cast<float*>(get(need.send)),   reinterpret_cast<float*>(get(need.recv)),
             reinterpret_cast<float*>(get(need.inputs)), reinterpret_cast<float*>(get(need.sum)),
             reinterpret_cast<float*>(get(need.error)),  get(need.payload),
             get(need.flags),                            reinterpret_cast<float*>(get(need.sample)),
             reinterpret_cast<float*>(get(need.sample)), reinterpret_cast<float*>(get(need.sample)),
             reinterpret_cast<float*>(get(need.sample)), reinterpret_cast<float*>(get(need.sample))};
    s.tables = get(table_bytes);
    s.out.simulated = reinterpret_cast<double*>(s.tables);
    s.out.reference = reinterpret_cast<double*>(s.tables + cells * 8);
    s.out.simulated_independent = reinterpret_cast<double*>(s.tables + cells * 16);
    s.out.realized = reinterpret_cast<double*>(s.tables + cells * 24);
    s.out.simulated_nonfinite = s.tables + cells * 24 + layers * 8;
    s.out.reference_nonfinite = s.out.simulated_nonfinite + cells;
    s.out.realized_nonfinite = s.out.reference_nonfinite + layers;
    return s;
  };
  Side on_cpu = make(c.cpu), on_gpu = make(c.gpu);
  auto hub_cpu = std::make_shared<collective::InProcHub>(1, std::chrono::seconds(10));
  collective::InProcFabric fabric_cpu(hub_cpu, 0);
  DeviceLoopback fabric_gpu(c.stream);
  std::vector<uint8_t> residual = flat_values(c.rng, layout.count), input = flat_values(c.rng, layout.count);
  // Finite, gradient-like values: the probe's statistics of NaNs are flags only.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t i = 0; i < layout.count; ++i) {
    const float g = normal(c.rng), r = 0.05f * normal(c.rng);
    memcpy(input.data() + i * 4, &g, 4);
    memcpy(residual.data() + i * 4, &r, 4);
  }
  DeviceBuffer d_input = to_device(input), d_residual = to_device(residual), d_output = to_device(input);
  for (uint64_t step = 0; step < 3; ++step) {
    for (Side* s : {&on_cpu, &on_gpu}) {
      collective::Backend& b = s == &on_cpu ? static_cast<collective::Backend&>(c.cpu) : c.gpu;
      b.fill_zero(s->tables, table_bytes);
      collective::BucketProbe::Call call;
      call.input = ElementSpan{s == &on_cpu ? input.data() : d_input.get(), DType::kFloat32, 0};
      call.count = layout.count;
      call.residual = reinterpret_cast<const float*>(s == &on_cpu ? residual.data() : d_residual.get());
      call.average = average;
      call.step = step;
      call.candidates = candidates;
      collective::BucketProbe& probe = s == &on_cpu ? cpu_probe : gpu_probe;
      probe.step(b, s == &on_cpu ? static_cast<collective::Fabric&>(fabric_cpu) : fabric_gpu, call, s->buf, &s->out);
      probe.realized(b, ElementSpan{s == &on_cpu ? input.data() : d_output.get(), DType::kFloat32, 0}, layout.count,
                     s->buf, s->out);
    }
    const std::vector<uint8_t> got = from_device(on_gpu.tables, table_bytes);
    const std::vector<uint8_t> want(on_cpu.tables, on_cpu.tables + table_bytes);
    std::string bad;
    static const char* const kTables[] = {"simulated", "reference", "simulated_independent", "realized"};
    for (uint64_t k = 0; k < 3 * cells + layers && bad.empty(); ++k) {
      double x, y;
      memcpy(&x, want.data() + k * 8, 8);
      memcpy(&y, got.data() + k * 8, 8);
      const uint64_t table = std::min<uint64_t>(k / cells, 3);
      const double tolerance = table == 1 ? kStatsRelTolerance : 1e-9;  // reference: measure's
      if (!(std::fabs(x - y) <= tolerance * std::fabs(x) + 1e-30))
        bad = strf("%s %llu: cpu %.17g, gpu %.17g", kTables[table], static_cast<ull>(k - table * cells), x, y);
    }
    if (bad.empty() && memcmp(want.data() + cells * 24 + layers * 8, got.data() + cells * 24 + layers * 8,
                              cells + 2 * layers) != 0)
      bad = "non-finite flags differ";
    const std::string what = strf("probe %d: %u layers, %zu candidates, %s%s, fraction %g, step %llu", index, layers,
                                  candidates.size(), sra ? "sra" : "allgather", average ? " avg" : "",
                                  settings.fraction, static_cast<ull>(step));
    if (bad.empty()) c.r.pass("probe", cpu_probe.sampled_total());
    else c.r.fail("probe", what + ": " + bad);
  }
}

// allocate (zero-filled), fill_zero, copy, upload and read_back (pinned and pageable).
void check_memory_ops(Ctx& c) {
  const uint64_t bytes = 64 + below(c.rng, 1 << 20);
  std::vector<uint8_t> data(bytes);
  for (auto& b : data) b = static_cast<uint8_t>(c.rng());
  {
    // A freed buffer poisoned, then a new one of the same size (often the same memory).
    auto first = c.gpu.allocate(bytes);
    LGRECO_CUDA_CHECK(cudaMemset(first->data(), 0xff, bytes));
    LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto buf = c.gpu.allocate(bytes);
  auto pinned = c.gpu.allocate_host(bytes);
  c.r.check(std::all_of(static_cast<uint8_t*>(pinned->data()), static_cast<uint8_t*>(pinned->data()) + bytes,
                        [](uint8_t b) { return b == 0; }),
            "allocate", "allocate_host's memory is not zero");
  const std::vector<uint8_t> zero = from_device(buf->data(), bytes);
  c.r.check(std::all_of(zero.begin(), zero.end(), [](uint8_t b) { return b == 0; }), "allocate",
            strf("allocate(%llu)'s memory is not zero", static_cast<ull>(bytes)));
  c.r.check(buf->bytes() == bytes && pinned->bytes() == bytes, "allocate", "Buffer::bytes() is not the size asked for");

  // The CPU's view of the same sequence: an upload into the first half, a zeroed range
  // anywhere, a copy from the first half into the second (never overlapping).
  std::vector<uint8_t> want(bytes, 0);
  const uint64_t half = bytes / 2;
  const uint64_t a = below(c.rng, half / 2), len = 1 + below(c.rng, half / 2);
  const uint64_t z = below(c.rng, bytes), zlen = below(c.rng, bytes - z + 1);
  const uint64_t dst = half + below(c.rng, bytes - half - len + 1);
  c.cpu.upload(want.data() + a, data.data(), len);
  c.cpu.fill_zero(want.data() + z, zlen);
  c.cpu.copy(want.data() + dst, want.data() + a, len);
  auto* d = static_cast<uint8_t*>(buf->data());
  c.gpu.upload(d + a, data.data(), len);
  c.gpu.fill_zero(d + z, zlen);
  c.gpu.copy(d + dst, d + a, len);
  auto event = c.gpu.read_back(pinned->data(), d, bytes);
  event->wait();
  c.r.check(event->ready(), "read_back", "ready() is false after wait()");
  expect_same(c, "upload/fill_zero/copy", strf("%llu bytes", static_cast<ull>(bytes)), want,
              std::vector<uint8_t>(static_cast<uint8_t*>(pinned->data()), static_cast<uint8_t*>(pinned->data()) + bytes),
              1);
  std::vector<uint8_t> pageable(bytes, kPoison);
  auto event2 = c.gpu.read_back(pageable.data(), d, bytes);
  event2->wait();
  expect_same(c, "read_back", "into pageable memory", want, pageable, 1);
}

// ---------------------------------------------------------------------------------------
// Streams, events, marks, the cap, the device guard, the runtime

// 2^20 in every element, halved `passes` times on the current stream: exact, so the
// expected value is known, and slow enough (a 256 MB array) that a read on another
// stream that did not wait would see a partial result.
constexpr uint64_t kBig = uint64_t{1} << 26;
constexpr int kPasses = 48;

bool all_equal(const float* v, uint64_t n, float want) {
  for (uint64_t i = 0; i < n; ++i)
    if (float_bits(v[i]) != float_bits(want)) return false;
  return true;
}

void check_streams_events_marks(Report& r, CudaBackend& gpu, int device) {
  CudaStream a, b;
  std::vector<float> init(kBig, 0x1p20f);
  DeviceBuffer d(kBig * 4);
  LGRECO_CUDA_CHECK(cudaMemcpy(d.get(), init.data(), kBig * 4, cudaMemcpyHostToDevice));
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  init.clear();
  init.shrink_to_fit();
  const uint64_t tail = uint64_t{1} << 20;  // the last 4 MB, written by the last blocks
  auto pinned = gpu.allocate_host(tail * 4);
  float* host = static_cast<float*>(pinned->data());
  float* acc = f32(d);

  // A then B: B's read-back must see every division enqueued on A.
  gpu.set_stream(a.get());
  const uint64_t m1 = gpu.mark();
  for (int k = 0; k < kPasses; ++k) gpu.divide(acc, kBig, 2.0f);
  const uint64_t m2 = gpu.mark();
  const bool m2_early = gpu.mark_ready(m2);
  gpu.set_stream(b.get());
  auto event = gpu.read_back(host, acc + kBig - tail, tail * 4);
  const bool early = event->ready();
  event->wait();
  r.check(event->ready(), "read_back event", "ready() is false after wait()");
  r.check(all_equal(host, tail, std::ldexp(1.0f, 20 - kPasses)), "set_stream ordering",
          strf("a read-back on stream B after set_stream(B) saw %.9g, not 2^%d: B did not wait for A", host[0],
               20 - kPasses));
  r.note("read_back event", early ? "ready before wait (the copy was fast)" : "not ready before wait, as expected");

  // B then A again: work enqueued on B comes before A's read-back.
  for (int k = 0; k < 8; ++k) gpu.divide(acc, kBig, 2.0f);
  gpu.set_stream(a.get());
  gpu.set_stream(a.get());  // the same stream again: nothing to do
  auto event2 = gpu.read_back(host, acc + kBig - tail, tail * 4);
  event2->wait();
  r.check(all_equal(host, tail, std::ldexp(1.0f, 20 - kPasses - 8)), "set_stream ordering",
          strf("a read-back on stream A after B's divisions saw %.9g, not 2^%d", host[0], 20 - kPasses - 8));

  // Marks: m1..m2 spans the divisions on A.
  gpu.wait_mark(m2);
  r.check(gpu.mark_ready(m1) && gpu.mark_ready(m2), "marks", "mark_ready is false after wait_mark");
  const double seconds = gpu.seconds_between(m1, m2);
  r.check(seconds > 0.0 && seconds < 30.0, "marks",
          strf("seconds_between over %d divisions of 256 MB is %.6g s", kPasses, seconds));
  r.note("marks", strf("%d divisions of 256 MB: %.2f ms (%.0f GB/s); mark ready at once: %s", kPasses, seconds * 1e3,
                       kPasses * 2.0 * kBig * 4 / seconds * 1e-9, m2_early ? "yes" : "no"));
  gpu.release_mark(m1);
  gpu.release_mark(m2);
  const uint64_t m3 = gpu.mark();
  r.check(m3 == m1 || m3 == m2, "marks", "a released mark was not reused");
  gpu.wait_mark(m3);
  gpu.release_mark(m3);
  bool threw = false;
  try {
    gpu.release_mark(m3);
  } catch (const std::logic_error&) {
    threw = true;
  }
  r.check(threw, "marks", "releasing a mark twice did not throw std::logic_error");

  // An Event dropped before its copy completes (returns to the pool) and the backend's
  // device stays the caller's current one.
  for (int k = 0; k < 4; ++k) gpu.divide(acc, kBig, 2.0f);
  { auto dropped = gpu.read_back(host, acc, 4); }
  auto last = gpu.read_back(host, acc, 4);
  last->wait();
  int current = -1;
  LGRECO_CUDA_CHECK(cudaGetDevice(&current));
  r.check(current == device, "device guard", strf("the current device is %d after the backend's calls, not %d", current,
                                                  device));
  gpu.set_stream(nullptr);
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
}

// Stream-ordered memory and streams that go away or are captured:
// - a buffer dropped while work using it is still queued (a read-back behind slow
//   divisions), then a new buffer of the same size (the pool's memory, often the same
//   bytes) allocated and poisoned at once: the queued read-back still sees its own data;
// - the free does not wait for the device (noted, with pools);
// - set_stream away from a stream the framework has destroyed, and away from one now
//   being captured (the capture must stay empty and end cleanly), still orders the work.
void check_stream_ordered_memory(Report& r, int device) {
  auto gpu = CudaBackend::create(device, 0);
  r.check(gpu->stream_ordered(), "stream-ordered memory",
          "the device has no memory pools: cudaMalloc/cudaFree fallback (unexpected on an H200)");
  r.check(gpu->unusable_reason().empty(), "unusable_reason", "not empty: " + gpu->unusable_reason());
  auto pinned = gpu->allocate_host(4 * 1024);
  float* host = static_cast<float*>(pinned->data());
  constexpr uint64_t kTail = 1024;
  {
    CudaStream a, b;
    gpu->set_stream(a.get());
    auto x = gpu->allocate(kBig * 4);
    std::vector<float> init(kBig, 0x1p20f);
    gpu->upload(x->data(), init.data(), kBig * 4);
    float* xd = static_cast<float*>(x->data());
    for (int k = 0; k < kPasses; ++k) gpu->divide(xd, kBig, 2.0f);
    auto event = gpu->read_back(host, xd + kBig - kTail, kTail * 4);
    const uint64_t held = gpu->device_bytes();
    const double t0 = cli::seconds_now();
    x.reset();  // while the divisions and the read-back are queued
    const double free_s = cli::seconds_now() - t0;
    const bool queued = !event->ready();
    r.check(gpu->device_bytes() == held - kBig * 4, "stream-ordered memory", "a freed buffer is still counted");
    // Reuse at once, on the same stream and on another one, poisoned by the backend's own
    // operations (ordered after the read-back, whatever memory the pool hands out).
    auto y = gpu->allocate(kBig * 4);
    gpu->divide(static_cast<float*>(y->data()), kBig, 0.0f);  // 0/0: NaN everywhere
    gpu->set_stream(b.get());
    auto z = gpu->allocate(kBig * 4);
    gpu->divide(static_cast<float*>(z->data()), kBig, 0.0f);
    event->wait();
    r.check(all_equal(host, kTail, std::ldexp(1.0f, 20 - kPasses)), "stream-ordered memory",
            strf("a read-back queued before its buffer was freed saw %.9g, not 2^%d: the memory was reused early",
                 host[0], 20 - kPasses));
    r.note("stream-ordered memory", strf("a free behind %d queued divisions of 256 MB took %.3f ms (work still "
                                         "queued then: %s)",
                                         kPasses, free_s * 1e3, queued ? "yes" : "no"));
    gpu->read_back(host, z->data(), 4)->wait();
    r.check(std::isnan(host[0]), "stream-ordered memory", "a new buffer's queued work did not run");
    gpu->set_stream(nullptr);
  }
  // The framework destroys the stream the backend used last; set_stream must not touch
  // it, and the next stream still sees the work enqueued there.
  {
    CudaStream b;
    auto buf = gpu->allocate(kBig * 4);
    float* d = static_cast<float*>(buf->data());
    {
      CudaStream doomed;
      gpu->set_stream(doomed.get());
      std::vector<float> init(kBig, 0x1p20f);
      gpu->upload(d, init.data(), kBig * 4);
      for (int k = 0; k < 16; ++k) gpu->divide(d, kBig, 2.0f);
    }  // cudaStreamDestroy with work queued
    bool ok = true;
    try {
      gpu->set_stream(b.get());
    } catch (const std::exception& e) {
      ok = false;
      r.fail("set_stream lifetimes", std::string("set_stream after the old stream was destroyed threw: ") + e.what());
    }
    if (ok) {
      gpu->read_back(host, d + kBig - kTail, kTail * 4)->wait();
      r.check(all_equal(host, kTail, 0x1p4f), "set_stream lifetimes",
              strf("after a destroyed stream, the next stream saw %.9g, not 2^4", host[0]));
    }
    // The stream the backend used last is now captured (thread-local mode) by the
    // framework: switching away must add nothing to the capture.
    CudaStream captured;
    gpu->set_stream(captured.get());
    gpu->divide(d, kBig, 2.0f);
    LGRECO_CUDA_CHECK(cudaStreamBeginCapture(captured.get(), cudaStreamCaptureModeThreadLocal));
    cudaError_t switched = cudaSuccess;
    try {
      gpu->set_stream(b.get());
    } catch (const std::exception& e) {
      switched = cudaErrorUnknown;
      r.fail("set_stream lifetimes", std::string("set_stream away from a capturing stream threw: ") + e.what());
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(captured.get(), &graph);
    size_t nodes = 0;
    if (graph) {
      cudaGraphGetNodes(graph, nullptr, &nodes);
      cudaGraphDestroy(graph);
    }
    r.check(switched == cudaSuccess && ended == cudaSuccess && nodes == 0, "set_stream lifetimes",
            strf("switching away from a capturing stream: capture ended with %s, %zu nodes", cudaGetErrorName(ended),
                 nodes));
    cudaGetLastError();
    gpu->read_back(host, d + kBig - kTail, kTail * 4)->wait();
    r.check(all_equal(host, kTail, 0x1p3f), "set_stream lifetimes",
            strf("after a captured stream, the next stream saw %.9g, not 2^3", host[0]));
    gpu->set_stream(nullptr);
  }
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
}

void check_cap(Report& r, int device) {
  constexpr uint64_t kCap = 1 << 20;
  auto gpu = CudaBackend::create(device, kCap);
  auto d1 = gpu->allocate(600 << 10);
  auto h1 = gpu->allocate_host(300 << 10);
  r.check(gpu->device_bytes() == (600 << 10) && gpu->host_bytes() == (300 << 10), "memory cap",
          strf("device_bytes %llu, host_bytes %llu after 600 KiB + 300 KiB", static_cast<ull>(gpu->device_bytes()),
               static_cast<ull>(gpu->host_bytes())));
  const auto throws_bad_alloc = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::bad_alloc&) {
      return true;
    }
    return false;
  };
  r.check(throws_bad_alloc([&] { gpu->allocate(200 << 10); }), "memory cap",
          "allocate past the cap did not throw std::bad_alloc");
  r.check(throws_bad_alloc([&] { gpu->allocate_host(200 << 10); }), "memory cap",
          "allocate_host past the cap did not throw std::bad_alloc");
  r.check(gpu->device_bytes() == (600 << 10) && gpu->host_bytes() == (300 << 10), "memory cap",
          "a refused allocation changed the counts");
  d1.reset();
  r.check(gpu->device_bytes() == 0, "memory cap", "a freed buffer is still counted");
  std::unique_ptr<collective::Backend::Buffer> d2;
  try {
    d2 = gpu->allocate(600 << 10);
  } catch (const std::bad_alloc&) {
  }
  r.check(d2 != nullptr, "memory cap", "allocate within the cap after a free threw");

  // The statistics' scratch counts too: 2^20 elements in buckets of 32, 2 candidates,
  // 512 KiB of partial sums where 900 KiB of the 1 MiB are held.
  {
    collective::BucketLayout layout;
    layout.count = 1 << 20;
    collective::LayerLayout layer;
    layer.name = "big";
    layer.numel = layout.count;
    layer.candidates = {CodecSpec::quant(QuantParams{2, 32, Rounding::kStochastic}),
                        CodecSpec::quant(QuantParams{4, 32, Rounding::kNearest})};
    layout.layers.push_back(layer);
    const Plan plan = collective::make_plan(layout, std::vector<CodecSpec>{layer.candidates[0]}, 1);
    DeviceBuffer in(layout.count * 4), sq(2 * sizeof(double)), nf(1);
    LGRECO_CUDA_CHECK(cudaMemset(in.get(), 0, in.size()));
    LGRECO_CUDA_CHECK(cudaMemset(sq.get(), 0, sq.size()));
    LGRECO_CUDA_CHECK(cudaMemset(nf.get(), 0, nf.size()));
    LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> measured{1};
    const collective::Backend::Measure m{layer.candidates, measured, reinterpret_cast<double*>(sq.get()), nf.get(), 1.0, {}};
    r.check(throws_bad_alloc([&] { gpu->prepare_measure(plan, layer.candidates); }), "memory cap",
            "prepare_measure whose statistics scratch passes the cap did not throw std::bad_alloc");
    r.check(throws_bad_alloc([&] {
              gpu->measure(plan, plan.segments, ElementSpan{in.get(), DType::kFloat32, 0}, nullptr, 0, m);
            }),
            "memory cap", "measure whose statistics scratch passes the cap did not throw std::bad_alloc");
    r.check(gpu->device_bytes() == (600 << 10), "memory cap", "a refused statistics scratch changed device_bytes");
    auto roomy = CudaBackend::create(device, 0);
    roomy->measure(plan, plan.segments, ElementSpan{in.get(), DType::kFloat32, 0}, nullptr, 0, m);
    LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
    r.check(roomy->device_bytes() > 0, "memory cap", "the statistics scratch is not counted in device_bytes");
  }

  // A cudaMalloc failure without a cap: std::bad_alloc, the runtime's error cleared, the
  // backend still usable.
  auto free_gpu = CudaBackend::create(device, 0);
  r.check(throws_bad_alloc([&] { free_gpu->allocate(uint64_t{1} << 50); }), "memory cap",
          "a 1 PiB allocation did not throw std::bad_alloc");
  const cudaError_t last = cudaGetLastError();
  r.check(last == cudaSuccess, "memory cap",
          strf("the out-of-memory error was left for the framework to find: %s", cudaGetErrorName(last)));
  auto small = free_gpu->allocate(4096);
  free_gpu->fill_zero(small->data(), 4096);
  LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  r.pass("memory cap");
}

void check_runtime(Report& r, int device, int device_count) {
  auto runtime = shim::cuda_runtime();
  r.check(runtime->name() == "cuda", "runtime", "name() is " + runtime->name());
  CudaStream s;
  std::string error;
  r.check(!runtime->capturing(s.get(), &error), "runtime", "capturing() is true on an idle stream: " + error);
  LGRECO_CUDA_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  const bool during = runtime->capturing(s.get(), &error);
  cudaGraph_t graph = nullptr;
  LGRECO_CUDA_CHECK(cudaStreamEndCapture(s.get(), &graph));
  if (graph) cudaGraphDestroy(graph);
  r.check(during, "runtime", "capturing() is false during a capture");
  bool threw = false;
  try {
    runtime->create_backend(device_count + 7, 0);
  } catch (const std::runtime_error& e) {
    threw = true;
    r.note("runtime", strf("bad device: \"%.80s\"", e.what()));
  }
  r.check(threw, "runtime", "create_backend on a device that does not exist did not throw std::runtime_error");
  r.check(cudaGetLastError() == cudaSuccess, "runtime", "create_backend's failure left an error set");
  auto backend = runtime->create_backend(device, 0);
  r.check(backend && backend->name() == "cuda", "runtime", "create_backend did not give a cuda backend");
  r.check(backend && backend->unusable_reason().empty(), "unusable_reason",
          "the runtime's backend says the device is unusable: " + (backend ? backend->unusable_reason() : ""));

  // The guard with two devices: the backend on the other one, the caller's current device
  // unchanged by its calls.
  if (device_count < 2) {
    r.note("device guard", "one device: the two-device case was skipped");
    return;
  }
  const int other = device == 0 ? 1 : 0;
  LGRECO_CUDA_CHECK(cudaSetDevice(other));
  CudaStream other_stream;
  LGRECO_CUDA_CHECK(cudaSetDevice(device));
  auto gpu = CudaBackend::create(other, 0);
  gpu->set_stream(other_stream.get());
  auto buf = gpu->allocate(4096 * 4);
  std::vector<float> v(4096, 6.0f);
  gpu->upload(buf->data(), v.data(), v.size() * 4);
  gpu->divide(static_cast<float*>(buf->data()), v.size(), 3.0f);
  std::vector<float> back(4096);
  gpu->read_back(back.data(), buf->data(), back.size() * 4)->wait();
  int current = -1;
  LGRECO_CUDA_CHECK(cudaGetDevice(&current));
  r.check(current == device, "device guard", strf("current device %d after calls on device %d's backend", current, other));
  r.check(all_equal(back.data(), back.size(), 2.0f), "device guard", "the other device's backend computed wrongly");
}

// ---------------------------------------------------------------------------------------

struct Options {
  bool check = false;
  bool quick = false;
  std::optional<uint64_t> seed;
  int device = 0;
  unsigned time_limit = 300;
};

int run_check(const Options& o) {
  const uint64_t seed = check_seed(o.seed, kProgram, o.quick);
  Rng rng(seed);
  Report r;
  int count = 0;
  LGRECO_CUDA_CHECK(cudaGetDeviceCount(&count));
  const double start = cli::seconds_now();
  std::string stage = "setup";
  try {
    LGRECO_CUDA_CHECK(cudaSetDevice(o.device));
    CpuBackend cpu;
    auto gpu = CudaBackend::create(o.device, 0);
    CudaStream stream;
    gpu->set_stream(stream.get());
    Ctx c{r, cpu, *gpu, rng, stream.get()};
    const int trials = o.quick ? 12 : 60;
    for (int i = 0; i < trials; ++i) {
      stage = strf("random plan %d", i);
      const Trial t = random_trial(rng, o.quick, i);
      const std::vector<std::pair<const char*, std::function<void()>>> ops = {
          {"find_nonfinite", [&] { check_find_nonfinite(c, t); }},
          {"encode payload", [&] { check_codec(c, t); }},
          {"accumulate_exact", [&] { check_accumulate_exact(c, t); }},
          {"measure", [&] { check_measure(c, t); }},
      };
      for (const auto& [row, op] : ops) {
        stage = strf("%s on %s", row, t.name.c_str());
        try {
          op();
        } catch (const CudaFailure&) {
          throw;
        } catch (const std::exception& e) {
          // A host-side refusal (CodecError, bad_alloc): that operation failed, the next runs.
          r.fail(row, strf("%s threw: %s", t.name.c_str(), e.what()));
          if (cudaGetLastError() != cudaSuccess) throw;
        }
      }
      stage = strf("low rank %d", i);
      try {
        check_lowrank(r, cpu, o.device, stream.get(), rng, i);
      } catch (const CudaFailure&) {
        throw;
      } catch (const std::exception& e) {
        r.fail("lowrank", strf("low rank %d threw: %s", i, e.what()));
        if (cudaGetLastError() != cudaSuccess) throw;
      }
      stage = "divide, narrow, gather, distance, sketch, memory operations";
      check_divide(c);
      check_narrow(c);
      check_gather(c);
      check_distance(c);
      check_sketch(c);
      if (i % 3 == 0) {
        stage = strf("probe %d", i);
        try {
          check_probe(c, i);
        } catch (const CudaFailure&) {
          throw;
        } catch (const std::exception& e) {
          r.fail("probe", strf("probe %d threw: %s", i, e.what()));
          if (cudaGetLastError() != cudaSuccess) throw;
        }
      }
      if (i % 4 == 0) check_memory_ops(c);
    }
    stage = "streams, events and marks";
    check_streams_events_marks(r, *gpu, o.device);
    stage = "stream-ordered memory and stream lifetimes";
    check_stream_ordered_memory(r, o.device);
    stage = "memory cap";
    check_cap(r, o.device);
    stage = "runtime";
    check_runtime(r, o.device, count);
    LGRECO_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const CudaFailure& e) {
    r.fail("cuda", stage + ": " + e.what() + " (a kernel fault surfaces at the next synchronisation; later checks skipped)");
  } catch (const std::exception& e) {
    r.fail("harness", stage + ": " + e.what() + " (later checks skipped)");
  }
  const double seconds = cli::seconds_now() - start;
  printf("\n");
  for (const std::string& f : r.failures()) printf("# failed: %s\n", f.c_str());
  printf("SUMMARY: %llu checks, %llu passed, %llu failed in %.1f s (seed 0x%016llx)\n", static_cast<ull>(r.cases()),
         static_cast<ull>(r.cases() - r.failed()), static_cast<ull>(r.failed()), seconds, static_cast<ull>(seed));
  printf("RESULT: %s\n", r.failed() == 0 ? "PASS" : "FAIL");
  printf("\n== %s --check%s: CudaBackend against CpuBackend ==\n", kProgram, o.quick ? " --quick" : "");
  printf("%-24s %6s %6s %14s  %s\n", "check", "cases", "failed", "values", "note");
  for (const auto& [name, row] : r.rows())
    printf("%-24s %6llu %6llu %14s  %s\n", name.c_str(), static_cast<ull>(row.cases), static_cast<ull>(row.failed),
           row.values ? cli::thousands(row.values).c_str() : "-", row.note.c_str());
  return r.failed() == 0 ? 0 : kExitFailed;
}

constexpr char kUsage[] = R"(usage: lgreco-gpu-backend-check --check [--quick] [--seed S] [--device N] [--time-limit S]

Compares the engine's CUDA backend (plugin/shim/cuda_backend.h) with its CPU backend on a
GPU: every operation on fresh random plans byte for byte (measure within the statistics'
tolerance), set_stream's ordering across streams, the memory cap, read-back events,
marks, the device guard and the runtime.

  --check        run the checks: FAIL lines, SUMMARY and RESULT lines, a table last
  --quick        fewer random plans
  --seed S       seed of the random plans (default: drawn and printed)
  --device N     CUDA device (default 0)
  --time-limit S exit with status 3 after S seconds (default 300, 0: none)

Exit status: 0 all passed, 1 a check failed, 2 usage error or no CUDA device, 3 the time
limit ran out.
)";

int run(int argc, char** argv) {
  Options o;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--check") {
      o.check = true;
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--seed") {
      o.seed = cli::parse_u64(arg, args.value());
    } else if (arg == "--device") {
      o.device = static_cast<int>(std::min<uint32_t>(cli::parse_u32(arg, args.value()), INT32_MAX));
    } else if (arg == "--time-limit") {
      o.time_limit = cli::parse_u32(arg, args.value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  if (!o.check) throw cli::UsageError("say what to do: --check");
  setvbuf(stdout, nullptr, _IOLBF, 0);
  arm_time_limit(kProgram, o.time_limit);
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0 || o.device >= count) {
    const std::string why = e != cudaSuccess ? strf("cudaGetDeviceCount failed: %s: %s", cudaGetErrorName(e),
                                                    cudaGetErrorString(e))
                            : count == 0     ? std::string("no CUDA device")
                                             : strf("device %d does not exist (%d devices)", o.device, count);
    printf("%s: no usable GPU: %s\nRESULT: SKIP (no GPU)\n", kProgram, why.c_str());
    fprintf(stderr, "%s: no usable GPU: %s\n", kProgram, why.c_str());
    return kExitNoDevice;
  }
  cudaDeviceProp prop{};
  LGRECO_CUDA_CHECK(cudaGetDeviceProperties(&prop, o.device));
  printf("# device %d: %s, sm_%d%d, %.1f GiB\n", o.device, prop.name, prop.major, prop.minor,
         static_cast<double>(prop.totalGlobalMem) / 1073741824.0);
  return run_check(o);
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main(lgreco::kProgram, [&] { return lgreco::run(argc, argv); });
}
