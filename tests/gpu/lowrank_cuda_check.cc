// lgreco-gpu-lowrank-check: PowerSGD's CUDA module (kernels/lowrank_cuda.h) on a real GPU,
// against the CPU reference (kernels/lowrank.h, as plugin/collective/cpu_backend.cc uses
// it), and the time of one step.
//
//   --check [--quick]  every operation on fresh random matrices, batched over layers of
//                      several shapes (1 x n, n x 1, small, 1024 x 4096, 4096 x 1024) and
//                      ranks (1, 4, 32, and ranks above a dimension), float32 / float16 /
//                      bfloat16 inputs, with and without a residual, with per-layer flags;
//                      outputs and gaps between layers poisoned first. Each operation gets
//                      the CPU's own inputs, so its error is its own:
//                        project (P), back_project (Q'), orthonormalize: relative
//                        Frobenius error per layer within the tolerances below;
//                        back_project's residual (given the GPU's Q'), reconstruct, keep,
//                        initial_q: bit for bit;
//                        squared_errors: within kStatsTolerance x ||M||^2, +inf and the
//                        flag on a layer with a NaN, other cells untouched;
//                      then a whole step on the GPU's own results against the CPU's step,
//                      the step captured into a CUDA graph (bit-identical replay), and an
//                      argument error thrown before anything is enqueued. One PASS/FAIL
//                      line per check, the largest error per operation in a SUMMARY line,
//                      RESULT last. --quick: a smaller set (for compute-sanitizer).
//   --bench            one step (project + orthonormalize + back_project + reconstruct) of a
//                      4096 x 4096 float32 layer with a residual at rank 4 and 32, and of
//                      ResNet-50's 54 matrix layers at rank 4: median of --reps (>= 20)
//                      timings with CUDA events, one line per case with each operation's
//                      median.
//   --info             the device and cuBLAS, nothing else.
//
// Built only when nvcc is found (Makefile); run by tests/gpu/run.sh lowrank. Exit status:
// 0 every check passed, 1 a check or a CUDA call failed, 2 usage error or no CUDA device,
// 3 the --time-limit ran out.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
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
#include "kernels/lowrank.h"
#include "kernels/lowrank_cuda.h"
#include "kernels/noise.h"
#include "kernels/quant_math.h"
#include "tests/gpu/check_util.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

namespace lc = lowrank::cuda;
using namespace gpu_check;

constexpr char kProgram[] = "lgreco-gpu-lowrank-check";

// The tolerances of docs/KERNELS.md, "PowerSGD on the GPU". cuBLAS's SGEMM sums float32
// products in float32 (the CPU sums float64 products and rounds once); on random data a
// sequential float32 sum over k = 4096 terms was measured at up to 1.4e-6 relative
// Frobenius error on the CPU (the worst plausible order), so 1e-5 leaves a factor of 7.
constexpr double kGemmTolerance = 1e-5;   // project's P, back_project's Q': ||gpu - cpu||_F / ||cpu||_F per layer
// Gram-Schmidt in float64 on the same input: only the order of the float64 sums differs,
// so the float32 results differ by an ulp here and there.
constexpr double kOrthoTolerance = 1e-6;  // ||gpu - cpu||_F / ||cpu||_F per layer
// squared_errors: |gpu - cpu| / ||M||^2 per layer and rank (the error itself may be ~0
// where M has low rank: no relative bound on it is meaningful).
constexpr double kStatsTolerance = 1e-5;
// A whole step on each side's own results: output and residual, relative to ||M||_F.
constexpr double kStepTolerance = 1e-5;

constexpr uint8_t kPoisonByte = 0xA5;

// ---------------------------------------------------------------------------------------
// Small helpers

void poison(const DeviceBuffer& d, const CudaStream& s) {
  LGRECO_CUDA_CHECK(cudaMemsetAsync(d.get(), kPoisonByte, d.size(), s.get()));
}

float poison_float() {
  uint32_t u;
  memset(&u, kPoisonByte, 4);
  return bits_float(u);
}

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }

// ---------------------------------------------------------------------------------------
// Results

class Report {
 public:
  void check(bool ok, const char* kind, const std::string& name, const std::string& detail) {
    printf("%s %-15s %s: %s\n", ok ? "PASS" : "FAIL", kind, name.c_str(), detail.c_str());
    if (ok) {
      ++passed_;
    } else {
      ++failed_;
      if (failures_.size() < 12) failures_.push_back(std::string(kind) + " " + name + ": " + detail);
    }
  }
  void fail(const char* kind, const std::string& name, const std::string& detail) { check(false, kind, name, detail); }
  // The largest error of an operation over every layer of every case.
  void error(const std::string& op, double e, const std::string& where) {
    for (auto& w : worst_)
      if (w.op == op) {
        if (e > w.error || std::isnan(e)) w = {op, e, where};
        return;
      }
    worst_.push_back({op, e, where});
  }
  int passed() const { return passed_; }
  int failed() const { return failed_; }
  const std::vector<std::string>& failures() const { return failures_; }
  std::string worst() const {
    std::string s;
    for (const auto& w : worst_) s += strf("%s%s %.2e", s.empty() ? "" : ", ", w.op.c_str(), w.error);
    return s;
  }

 private:
  struct Worst {
    std::string op;
    double error;
    std::string where;
  };
  int passed_ = 0, failed_ = 0;
  std::vector<std::string> failures_;
  std::vector<Worst> worst_;
};

// ---------------------------------------------------------------------------------------
// A case: a bucket of low-rank layers with gaps between them (in the call's elements and
// in the factor arrays), an input of one type, maybe a residual and flags.

struct Shape {
  uint64_t rows, cols;
  uint32_t rank;
};

struct Case {
  std::string name;
  std::vector<Shape> shapes;
  DType dtype = DType::kFloat32;
  bool residual = false;
  bool flags = false;
  bool nan_layer = false;  // squared_errors: one layer holds a NaN
  bool graph = false;      // also capture the step into a CUDA graph
};

struct Bucket {
  std::vector<lc::Layer> layers;
  uint64_t count = 0;     // call elements
  uint64_t p_floats = 0, q_floats = 0;
  uint32_t layer_slots = 0;  // flags / statistics rows
  std::vector<uint8_t> input;  // dtype elements
  std::vector<float> input_f;  // the same, widened
  std::vector<float> residual;  // empty: none
  std::vector<uint8_t> flags;   // empty: none
  std::vector<float> q;         // warm start, q_floats
};

Bucket make_bucket(const Case& c, Rng& rng) {
  Bucket b;
  uint64_t offset = below(rng, 40), p = below(rng, 8), q = below(rng, 8);
  uint32_t slot = static_cast<uint32_t>(below(rng, 3));
  for (const Shape& s : c.shapes) {
    lc::Layer l;
    l.layer = slot;
    l.offset = offset;
    l.rows = s.rows;
    l.cols = s.cols;
    l.rank = s.rank;
    l.p_offset = p;
    l.q_offset = q;
    b.layers.push_back(l);
    offset += s.rows * s.cols + below(rng, 40);
    p += s.rows * s.rank + below(rng, 8);
    q += s.cols * s.rank + below(rng, 8);
    slot += 1 + static_cast<uint32_t>(below(rng, 2));
  }
  b.count = offset + below(rng, 40);
  b.p_floats = p + 3;
  b.q_floats = q + 3;
  b.layer_slots = slot + 1;
  b.input.resize(b.count * dtype_size(c.dtype));
  b.input_f.resize(b.count);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Each layer its own magnitude (1e-3 .. 10), a gradient's spread across layers.
  std::vector<float> magnitude(b.count, 1.0f);
  for (const lc::Layer& l : b.layers) {
    const float m = std::pow(10.0f, std::uniform_real_distribution<float>(-3.0f, 1.0f)(rng));
    std::fill(magnitude.begin() + static_cast<int64_t>(l.offset),
              magnitude.begin() + static_cast<int64_t>(l.offset + l.rows * l.cols), m);
  }
  for (uint64_t i = 0; i < b.count; ++i) {
    store_from_float(b.input.data(), c.dtype, i, normal(rng) * magnitude[i]);
    b.input_f[i] = load_as_float(b.input.data(), c.dtype, i);
  }
  if (c.residual) {
    b.residual.resize(b.count);
    for (uint64_t i = 0; i < b.count; ++i) b.residual[i] = 0.1f * normal(rng) * magnitude[i];
  }
  if (c.flags) {
    b.flags.assign(b.layer_slots, 0);
    for (const lc::Layer& l : b.layers) b.flags[l.layer] = chance(rng, 0.4) ? 1 : 0;
    b.flags[b.layers.front().layer] = 0;
    if (b.layers.size() > 1) b.flags[b.layers.back().layer] = 1;
  }
  b.q.resize(b.q_floats);
  for (float& v : b.q) v = normal(rng);
  return b;
}

bool flagged(const Bucket& b, const lc::Layer& l) { return !b.flags.empty() && b.flags[l.layer]; }

// M of a layer as the CPU backend forms it: input + residual (none where flagged).
std::vector<float> matrix_of(const Bucket& b, const lc::Layer& l, bool use_flags) {
  const uint64_t n = l.rows * l.cols;
  std::vector<float> x(n);
  const bool add = !b.residual.empty() && !(use_flags && flagged(b, l));
  for (uint64_t i = 0; i < n; ++i) {
    const float v = b.input_f[l.offset + i];
    x[i] = add ? v + b.residual[l.offset + i] : v;
  }
  return x;
}

std::string where(const Case& c, const lc::Layer& l) {
  return strf("%s, layer %u (%llu x %llu, rank %u)", c.name.c_str(), l.layer, static_cast<ull>(l.rows),
              static_cast<ull>(l.cols), l.rank);
}

double frobenius(const float* a, uint64_t n) {
  double s = 0;
  for (uint64_t i = 0; i < n; ++i) s += double(a[i]) * a[i];
  return std::sqrt(s);
}

// ||gpu - cpu||_F / scale; NaN anywhere counts as infinitely wrong.
double relative(const float* gpu, const float* cpu, uint64_t n, double scale) {
  double d = 0;
  for (uint64_t i = 0; i < n; ++i) {
    if (std::isnan(gpu[i]) != std::isnan(cpu[i])) return std::numeric_limits<double>::infinity();
    if (std::isnan(gpu[i])) continue;
    const double e = double(gpu[i]) - cpu[i];
    d += e * e;
  }
  d = std::sqrt(d);
  return scale > 0 ? d / scale : d;
}

// The first element whose bits differ, or "".
std::string first_difference(const float* gpu, const float* cpu, uint64_t n, uint64_t cols) {
  for (uint64_t i = 0; i < n; ++i)
    if (!same_bits(gpu[i], cpu[i]))
      return strf("element (%llu, %llu): GPU %.9g (0x%08x), CPU %.9g (0x%08x)", static_cast<ull>(i / cols),
                  static_cast<ull>(i % cols), gpu[i], float_bits(gpu[i]), cpu[i], float_bits(cpu[i]));
  return "";
}

// Indices of a factor array (P: rows x rank, Q: cols x rank) that some layer owns.
std::vector<uint8_t> owned(const Bucket& b, uint64_t floats, bool p_array) {
  std::vector<uint8_t> o(floats, 0);
  for (const lc::Layer& l : b.layers) {
    const uint64_t begin = p_array ? l.p_offset : l.q_offset;
    const uint64_t n = (p_array ? l.rows : l.cols) * l.rank;
    std::fill(o.begin() + static_cast<int64_t>(begin), o.begin() + static_cast<int64_t>(begin + n), 1);
  }
  return o;
}

// Floats of a factor array outside every layer still hold the poison.
uint64_t touched_gaps(const std::vector<float>& gpu, const std::vector<uint8_t>& own) {
  uint64_t bad = 0;
  for (size_t i = 0; i < gpu.size(); ++i)
    if (!own[i] && !same_bits(gpu[i], poison_float())) ++bad;
  return bad;
}

// ---------------------------------------------------------------------------------------
// --check

class Checker {
 public:
  Checker(Report& report, lc::Handle& handle, const CudaStream& s, Rng& rng)
      : report_(report), handle_(handle), s_(s), rng_(rng) {}

  void run(const Case& c) {
    const Bucket b = make_bucket(c, rng_);
    const auto& layers = b.layers;
    cudaStream_t st = s_.get();
    // Device arrays.
    DeviceBuffer input(b.input.size()), residual(4 * b.count), flags(b.layer_slots), p(4 * b.p_floats),
        q_in(4 * b.q_floats), q_out(4 * b.q_floats), out(b.count * dtype_size(c.dtype));
    const uint64_t scratch_bytes = lc::scratch_bytes(layers, c.dtype, c.residual);
    DeviceBuffer scratch(scratch_bytes);
    upload(input, b.input, s_);
    upload(q_in, b.q, s_);
    if (c.flags) upload(flags, b.flags, s_);
    lc::Source source;
    source.input = input.get();
    source.input_dtype = c.dtype;
    source.residual = c.residual ? reinterpret_cast<float*>(residual.get()) : nullptr;
    source.flags = c.flags ? flags.get() : nullptr;
    const lc::Scratch scr{scratch.get(), scratch_bytes};
    auto* pd = reinterpret_cast<float*>(p.get());
    auto* qd_in = reinterpret_cast<float*>(q_in.get());
    auto* qd_out = reinterpret_cast<float*>(q_out.get());
    const auto p_own = owned(b, b.p_floats, true), q_own = owned(b, b.q_floats, false);

    // CPU references, each operation on the CPU's own inputs.
    std::vector<std::vector<float>> m(layers.size());
    // Poison where no layer is: uploaded as inputs, the gaps must come back unchanged.
    std::vector<float> p_ref(b.p_floats, poison_float()), p_orth(b.p_floats, poison_float()),
        q_ref(b.q_floats, poison_float());
    for (size_t k = 0; k < layers.size(); ++k) {
      const lc::Layer& l = layers[k];
      m[k] = matrix_of(b, l, true);
      const lowrank::Shape shape{l.rows, l.cols};
      lowrank::project(m[k].data(), shape, b.q.data() + l.q_offset, l.rank, p_ref.data() + l.p_offset);
      std::copy_n(p_ref.data() + l.p_offset, l.rows * l.rank, p_orth.data() + l.p_offset);
      lowrank::orthonormalize(p_orth.data() + l.p_offset, l.rows, l.rank);
      lowrank::back_project(m[k].data(), shape, p_orth.data() + l.p_offset, l.rank, q_ref.data() + l.q_offset);
    }

    // An argument error is thrown before anything is enqueued (P stays poisoned).
    if (c.graph) {
      poison(p, s_);
      bool threw = false;
      try {
        lc::project(handle_, layers, source, qd_in, pd, lc::Scratch{scratch.get(), scratch_bytes - 1}, st);
      } catch (const CodecError&) {
        threw = true;
      }
      const auto after = download<float>(p, b.p_floats, s_);
      const bool untouched = std::all_of(after.begin(), after.end(), [](float v) { return same_bits(v, poison_float()); });
      report_.check(threw && untouched, "arguments", c.name,
                    threw ? (untouched ? "a scratch too small: CodecError, nothing enqueued" : "P was written")
                          : "a scratch too small was not refused");
    }

    // project
    if (c.residual) upload(residual, b.residual, s_);
    poison(p, s_);
    lc::project(handle_, layers, source, qd_in, pd, scr, st);
    std::vector<float> p_gpu = download<float>(p, b.p_floats, s_);
    compare_factor("project", c, b, p_gpu, p_ref, p_own, true, kGemmTolerance);

    // orthonormalize, on the CPU's P
    upload(p, p_ref, s_);
    lc::orthonormalize(layers, pd, lc::Scratch{scratch.get(), lc::scratch_bytes(layers, DType::kFloat32, false)}, st);
    p_gpu = download<float>(p, b.p_floats, s_);
    compare_factor("orthonormalize", c, b, p_gpu, p_orth, p_own, true, kOrthoTolerance);

    // back_project, on the CPU's orthonormal P
    upload(p, p_orth, s_);
    poison(q_out, s_);
    lc::back_project(handle_, layers, source, pd, qd_out, scr, st);
    const std::vector<float> q_gpu = download<float>(q_out, b.q_floats, s_);
    compare_factor("back_project", c, b, q_gpu, q_ref, q_own, false, kGemmTolerance);
    if (c.residual) check_residual(c, b, m, p_orth, q_gpu, download<float>(residual, b.count, s_));

    // reconstruct, on the CPU's P and Q, with a scale
    const float scale = pick(rng_, {1.0f, 0.25f, 1.0f / 3.0f});
    upload(q_out, q_ref, s_);
    poison(out, s_);
    lc::reconstruct(layers, pd, qd_out, scale, lc::Output{out.get(), c.dtype, 0}, st);
    const std::vector<uint8_t> out_gpu = download<uint8_t>(out, out.size(), s_);
    check_reconstruct(c, b, p_orth, q_ref, scale, out_gpu);

    check_keep(c, b, q_ref);
    check_initial_q(c, b);
    check_statistics(c, b);

    // A whole step on the GPU's own results, against the CPU's (the same inputs and Q),
    // its output in float32 (reconstruct's rounding to 16 bits is checked above).
    if (c.residual) upload(residual, b.residual, s_);
    DeviceBuffer out32(4 * b.count);
    auto step = [&] {
      lc::project(handle_, layers, source, qd_in, pd, scr, st);
      lc::orthonormalize(layers, pd, scr, st);
      lc::back_project(handle_, layers, source, pd, qd_out, scr, st);
      lc::reconstruct(layers, pd, qd_out, scale, lc::Output{out32.get(), DType::kFloat32, 0}, st);
    };
    poison(out32, s_);
    step();
    const std::vector<float> out_step = download<float>(out32, b.count, s_);
    const std::vector<float> residual_step = c.residual ? download<float>(residual, b.count, s_) : std::vector<float>{};
    check_step(c, b, m, p_orth, q_ref, scale, out_step, residual_step);

    if (c.graph) {
      // The same step captured into a graph: it must capture (nothing synchronises or
      // allocates), and replay to the same bits (deterministic).
      if (c.residual) upload(residual, b.residual, s_);
      poison(out32, s_);
      s_.sync();
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      std::string problem;
      LGRECO_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      try {
        step();
      } catch (const std::exception& e) {
        problem = strf("capturing the step threw: %s", e.what());
      }
      const cudaError_t end = cudaStreamEndCapture(st, &graph);
      if (problem.empty() && end != cudaSuccess)
        problem = strf("cudaStreamEndCapture: %s", cudaGetErrorString(end));
      cudaGetLastError();
      if (problem.empty()) {
        LGRECO_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        LGRECO_CUDA_CHECK(cudaGraphLaunch(exec, st));
        const auto out_graph = download<float>(out32, b.count, s_);
        const auto residual_graph = c.residual ? download<float>(residual, b.count, s_) : std::vector<float>{};
        if (memcmp(out_graph.data(), out_step.data(), 4 * b.count)) problem = "the replayed step's output differs from the direct step's";
        if (residual_graph.size() != residual_step.size() ||
            (!residual_graph.empty() && memcmp(residual_graph.data(), residual_step.data(), 4 * residual_step.size())))
          problem = "the replayed step's residual differs from the direct step's";
      }
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
      report_.check(problem.empty(), "graph", c.name,
                    problem.empty() ? "captured and replayed; output and residual bit-identical" : problem);
    }
  }

 private:
  // P or Q against the CPU's, per layer; the gaps stay poisoned.
  void compare_factor(const char* op, const Case& c, const Bucket& b, const std::vector<float>& gpu,
                      const std::vector<float>& cpu, const std::vector<uint8_t>& own, bool p_array, double tolerance) {
    double worst = 0;
    std::string at;
    for (const lc::Layer& l : b.layers) {
      const uint64_t begin = p_array ? l.p_offset : l.q_offset;
      const uint64_t n = (p_array ? l.rows : l.cols) * l.rank;
      const double e = relative(gpu.data() + begin, cpu.data() + begin, n, frobenius(cpu.data() + begin, n));
      report_.error(op, e, where(c, l));
      if (!(e <= worst)) {
        worst = e;
        at = where(c, l);
      }
    }
    const uint64_t gaps = touched_gaps(gpu, own);
    const bool ok = worst <= tolerance && gaps == 0;
    report_.check(ok, op, c.name,
                  strf("max rel err %.2e (tol %.0e)%s%s", worst, tolerance, at.empty() ? "" : (" at " + at).c_str(),
                       gaps ? strf("; %llu floats outside the layers written", static_cast<ull>(gaps)).c_str() : ""));
  }

  // residual = M - P Q'^T with the GPU's own Q', bit for bit; flagged layers and gaps keep
  // their residual.
  void check_residual(const Case& c, const Bucket& b, const std::vector<std::vector<float>>& m,
                      const std::vector<float>& p, const std::vector<float>& q_gpu, const std::vector<float>& gpu) {
    std::vector<float> expected = b.residual;
    for (size_t k = 0; k < b.layers.size(); ++k) {
      const lc::Layer& l = b.layers[k];
      if (flagged(b, l)) continue;
      std::vector<float> approx(l.rows * l.cols);
      lowrank::reconstruct(p.data() + l.p_offset, q_gpu.data() + l.q_offset, {l.rows, l.cols}, l.rank, 1.0f,
                           approx.data());
      for (uint64_t i = 0; i < approx.size(); ++i) expected[l.offset + i] = m[k][i] - approx[i];
    }
    std::string problem;
    for (uint64_t i = 0; i < b.count && problem.empty(); ++i)
      if (!same_bits(gpu[i], expected[i])) problem = strf("call element %llu: GPU %.9g, CPU %.9g", static_cast<ull>(i), gpu[i], expected[i]);
    report_.check(problem.empty(), "residual", c.name,
                  problem.empty() ? "bit for bit (M - P Q'^T with the GPU's Q'; flagged layers and gaps kept)" : problem);
  }

  void check_reconstruct(const Case& c, const Bucket& b, const std::vector<float>& p,
                                         const std::vector<float>& q, float scale, const std::vector<uint8_t>& gpu) {
    std::vector<uint8_t> expected(gpu.size(), kPoisonByte);
    for (const lc::Layer& l : b.layers) {
      std::vector<float> values(l.rows * l.cols);
      lowrank::reconstruct(p.data() + l.p_offset, q.data() + l.q_offset, {l.rows, l.cols}, l.rank, scale, values.data());
      for (uint64_t i = 0; i < values.size(); ++i)
        store_from_float(expected.data(), c.dtype, l.offset + i, quant::canonical_nan(values[i]));
    }
    std::string problem;
    const size_t size = dtype_size(c.dtype);
    for (uint64_t i = 0; i < b.count && problem.empty(); ++i)
      if (memcmp(gpu.data() + i * size, expected.data() + i * size, size))
        problem = strf("call element %llu: GPU %.9g, CPU %.9g", static_cast<ull>(i), load_as_float(gpu.data(), c.dtype, i),
                       load_as_float(expected.data(), c.dtype, i));
    report_.check(problem.empty(), "reconstruct", c.name,
                  problem.empty() ? strf("bit for bit (%s, scale %.6g; gaps untouched)", dtype_name(c.dtype), scale) : problem);
  }

  // q_new: the CPU's Q' with a zero column, a NaN and an infinity planted.
  void check_keep(const Case& c, const Bucket& b, std::vector<float> q_new) {
    std::vector<float> q0(b.q_floats, 0.0f);
    for (const lc::Layer& l : b.layers) {
      lowrank::initial_q(NoiseKey{11, 0, 5, 100 + l.layer}, l.cols, l.rank, q0.data() + l.q_offset);
      float* qn = q_new.data() + l.q_offset;
      const uint32_t c0 = static_cast<uint32_t>(below(rng_, l.rank));
      for (uint64_t j = 0; j < l.cols; ++j) qn[j * l.rank + c0] = 0.0f;
      if (l.rank >= 2) qn[below(rng_, l.cols) * l.rank + (c0 + 1) % l.rank] = std::numeric_limits<float>::quiet_NaN();
      if (l.rank >= 3) qn[below(rng_, l.cols) * l.rank + (c0 + 2) % l.rank] = -std::numeric_limits<float>::infinity();
    }
    std::vector<float> expected(b.q_floats, poison_float());
    for (const lc::Layer& l : b.layers)
      for (uint32_t c1 = 0; c1 < l.rank; ++c1) {
        bool usable = false, finite = true;
        for (uint64_t j = 0; j < l.cols; ++j) {
          const float v = q_new[l.q_offset + j * l.rank + c1];
          usable |= v != 0.0f;
          finite &= quant::is_finite_value(v);
        }
        const std::vector<float>& from = usable && finite ? q_new : q0;
        for (uint64_t j = 0; j < l.cols; ++j) expected[l.q_offset + j * l.rank + c1] = from[l.q_offset + j * l.rank + c1];
      }
    DeviceBuffer qn(4 * b.q_floats), qz(4 * b.q_floats), q(4 * b.q_floats);
    upload(qn, q_new, s_);
    upload(qz, q0, s_);
    poison(q, s_);
    lc::keep(b.layers, reinterpret_cast<const float*>(qn.get()), reinterpret_cast<const float*>(qz.get()),
             reinterpret_cast<float*>(q.get()), s_.get());
    const auto gpu = download<float>(q, b.q_floats, s_);
    const std::string problem = first_difference(gpu.data(), expected.data(), gpu.size(), 1);
    report_.check(problem.empty(), "keep", c.name,
                  problem.empty() ? "bit for bit (zero, NaN and infinite columns restart from Q0; gaps untouched)"
                                  : "float " + problem);
  }

  void check_initial_q(const Case& c, const Bucket& b) {
    const uint64_t seed = rng_(), step = rng_();
    const uint32_t base = static_cast<uint32_t>(rng_());
    std::vector<float> expected(b.q_floats, poison_float());
    for (const lc::Layer& l : b.layers)
      lowrank::initial_q(NoiseKey{seed, 0, step, base + l.layer}, l.cols, l.rank, expected.data() + l.q_offset);
    DeviceBuffer q(4 * b.q_floats);
    poison(q, s_);
    lc::initial_q(b.layers, seed, step, base, reinterpret_cast<float*>(q.get()), s_.get());
    const auto gpu = download<float>(q, b.q_floats, s_);
    const std::string problem = first_difference(gpu.data(), expected.data(), gpu.size(), 1);
    report_.check(problem.empty(), "initial_q", c.name,
                  problem.empty() ? "bit for bit (Philox Q0 of every layer; gaps untouched)" : "float " + problem);
  }

  void check_statistics(const Case& c, const Bucket& b) {
    // Ranks, their columns in a wider row, a weight, a measured mask.
    const std::vector<uint32_t> ranks{4, 1, 32, 2};
    const std::vector<uint32_t> columns{5, 0, 2, 3};
    const uint32_t stride = 6;
    std::vector<uint8_t> measured(b.layer_slots, 0);
    for (const lc::Layer& l : b.layers) measured[l.layer] = chance(rng_, 0.8) ? 1 : 0;
    measured[b.layers.front().layer] = 1;
    Bucket x = b;  // maybe a NaN in one measured layer
    const lc::Layer* nan_layer = nullptr;
    if (c.nan_layer) {
      nan_layer = &b.layers.back();
      measured[nan_layer->layer] = 1;
      const uint64_t e = nan_layer->offset + below(rng_, nan_layer->rows * nan_layer->cols);
      store_from_float(x.input.data(), c.dtype, e, std::numeric_limits<float>::quiet_NaN());
      x.input_f[e] = load_as_float(x.input.data(), c.dtype, e);
    }
    const double weight = 0.25;
    const uint64_t seed = rng_(), step = rng_() % 100000;
    const uint32_t base = static_cast<uint32_t>(below(rng_, 1000));
    std::vector<double> squared(static_cast<uint64_t>(b.layer_slots) * stride);
    for (double& v : squared) v = std::uniform_real_distribution<double>(0.0, 10.0)(rng_);
    std::vector<uint8_t> nonfinite(b.layer_slots, 0);
    nonfinite[0] = 7;  // never cleared
    // CPU: Backend::measure_lowrank.
    std::vector<double> expected = squared, bound(squared.size(), 0.0);
    std::vector<uint8_t> expected_nonfinite = nonfinite;
    std::vector<double> errors(ranks.size());
    const uint32_t basis_rank = 32;
    for (const lc::Layer& l : b.layers) {
      if (!measured[l.layer]) continue;
      const std::vector<float> mm = matrix_of(x, l, false);
      std::vector<float> basis(l.cols * basis_rank);
      lowrank::initial_q(NoiseKey{seed, 0, step, base + l.layer}, l.cols, basis_rank, basis.data());
      if (!lowrank::squared_errors(mm.data(), {l.rows, l.cols}, basis.data(), basis_rank, ranks, errors))
        expected_nonfinite[l.layer] = 1;
      double total = 0;
      for (float v : mm) total += double(v) * v;
      for (size_t k = 0; k < ranks.size(); ++k) {
        const uint64_t cell = static_cast<uint64_t>(l.layer) * stride + columns[k];
        expected[cell] += weight * errors[k];
        bound[cell] = kStatsTolerance * weight * total;
      }
    }
    DeviceBuffer input(x.input.size()), residual(4 * b.count), sq(8 * squared.size()), nf(nonfinite.size());
    upload(input, x.input, s_);
    if (c.residual) upload(residual, b.residual, s_);
    upload(sq, squared, s_);
    upload(nf, nonfinite, s_);
    lc::Source source;
    source.input = input.get();
    source.input_dtype = c.dtype;
    source.residual = c.residual ? reinterpret_cast<float*>(residual.get()) : nullptr;
    lc::Measure m;
    m.ranks = ranks;
    m.columns = columns;
    m.row_stride = stride;
    m.measured = measured;
    m.squared = reinterpret_cast<double*>(sq.get());
    m.nonfinite = nf.get();
    m.weight = weight;
    m.seed = seed;
    m.step = step;
    m.layer_base = base;
    const uint64_t bytes = lc::measure_scratch_bytes(b.layers, basis_rank, c.dtype, c.residual);
    DeviceBuffer scratch(bytes);
    lc::squared_errors(handle_, b.layers, source, m, lc::Scratch{scratch.get(), bytes}, s_.get());
    const auto gpu = download<double>(sq, squared.size(), s_);
    const auto gpu_nonfinite = download<uint8_t>(nf, nonfinite.size(), s_);
    std::string problem;
    double worst = 0;
    for (uint64_t cell = 0; cell < gpu.size(); ++cell) {
      const uint32_t slot = static_cast<uint32_t>(cell / stride);
      if (bound[cell] == 0.0 || std::isinf(expected[cell])) {
        // Not measured here (or +inf): exactly as expected.
        if (memcmp(&gpu[cell], &expected[cell], 8) && problem.empty())
          problem = strf("row %u column %u: GPU %.17g, expected %.17g exactly", slot, static_cast<uint32_t>(cell % stride),
                         gpu[cell], expected[cell]);
        continue;
      }
      const double e = std::fabs(gpu[cell] - expected[cell]) / (bound[cell] / kStatsTolerance);
      report_.error("squared_errors", e, strf("%s, row %u", c.name.c_str(), slot));
      worst = std::max(worst, std::isnan(e) ? std::numeric_limits<double>::infinity() : e);
      if (!(e <= kStatsTolerance) && problem.empty())
        problem = strf("row %u column %u: GPU %.17g, CPU %.17g: %.2e of weight x ||M||^2 (tol %.0e)", slot,
                       static_cast<uint32_t>(cell % stride), gpu[cell], expected[cell], e, kStatsTolerance);
    }
    if (gpu_nonfinite != expected_nonfinite && problem.empty()) problem = "the nonfinite flags differ from the CPU's";
    report_.check(problem.empty(), "squared_errors", c.name,
                  problem.empty() ? strf("max |err| %.2e of weight x ||M||^2 (tol %.0e)%s; other cells untouched", worst,
                                         kStatsTolerance, nan_layer ? "; the NaN layer +inf and flagged" : "")
                                  : problem);
  }

  // The GPU's step (on its own P, Q') against the CPU's, relative to ||M|| (x scale for the
  // output).
  void check_step(const Case& c, const Bucket& b, const std::vector<std::vector<float>>& m,
                  const std::vector<float>& p_orth, const std::vector<float>& q_ref, float scale,
                  const std::vector<float>& out_gpu, const std::vector<float>& residual_gpu) {
    double worst = 0;
    std::string at;
    for (size_t k = 0; k < b.layers.size(); ++k) {
      const lc::Layer& l = b.layers[k];
      const uint64_t n = l.rows * l.cols;
      const double norm = frobenius(m[k].data(), n);
      std::vector<float> approx(n), expected(n);
      lowrank::reconstruct(p_orth.data() + l.p_offset, q_ref.data() + l.q_offset, {l.rows, l.cols}, l.rank, scale,
                           expected.data());
      double e = relative(out_gpu.data() + l.offset, expected.data(), n, norm * scale);
      if (!residual_gpu.empty() && !flagged(b, l)) {
        lowrank::reconstruct(p_orth.data() + l.p_offset, q_ref.data() + l.q_offset, {l.rows, l.cols}, l.rank, 1.0f,
                             approx.data());
        for (uint64_t i = 0; i < n; ++i) expected[i] = m[k][i] - approx[i];
        e = std::max(e, relative(residual_gpu.data() + l.offset, expected.data(), n, norm));
      }
      report_.error("step", e, where(c, l));
      if (!(e <= worst)) {
        worst = e;
        at = where(c, l);
      }
    }
    report_.check(worst <= kStepTolerance, "step", c.name,
                  strf("output and residual of a whole step: max rel err %.2e of ||M|| (tol %.0e)%s", worst,
                       kStepTolerance, at.empty() ? "" : (" at " + at).c_str()));
  }

  Report& report_;
  lc::Handle& handle_;
  const CudaStream& s_;
  Rng& rng_;
};

std::vector<Case> check_cases(bool quick) {
  // Small shapes, with ranks above a dimension (1 x n at rank 4, n x 1 at rank 32, 3 x 5
  // at rank 32) and each of 1, 4, 32.
  const std::vector<Shape> small{{1, 777, 4},  {513, 1, 32}, {3, 5, 32},    {37, 300, 1},
                                 {64, 64, 32}, {256, 1152, 4}, {300, 37, 4}, {1, 4096, 1}};
  std::vector<Case> cases;
  cases.push_back({"small f32 +residual +flags", small, DType::kFloat32, true, true, true, true});
  cases.push_back({"small bf16", small, DType::kBFloat16, false, false, false, false});
  if (!quick) {
    cases.push_back({"small f32", small, DType::kFloat32, false, false, false, false});
    cases.push_back({"small f16 +residual +flags", small, DType::kFloat16, true, true, true, false});
    cases.push_back({"small bf16 +residual", small, DType::kBFloat16, true, false, false, false});
    cases.push_back({"small f16", small, DType::kFloat16, false, false, true, false});
  }
  for (uint32_t rank : {1u, 4u, 32u}) {
    if (quick && rank != 4) continue;
    cases.push_back({strf("1024x4096 + 4096x1024 f32 +residual +flags rank %u", rank),
                     {{1024, 4096, rank}, {4096, 1024, rank}}, DType::kFloat32, true, true, false, rank == 4});
  }
  if (!quick) {
    cases.push_back({"1024x4096 + 4096x1024 bf16 +residual rank 4", {{1024, 4096, 4}, {4096, 1024, 4}},
                     DType::kBFloat16, true, false, true, false});
    cases.push_back({"1024x4096 + 4096x1024 f16 rank 32", {{1024, 4096, 32}, {4096, 1024, 32}}, DType::kFloat16, false,
                     false, false, false});
  }
  return cases;
}

int run_check(bool quick, uint64_t seed, lc::Handle& handle, const CudaStream& s) {
  printf("# --check%s, seed %llu (replay: --seed %llu)\n", quick ? " --quick" : "", static_cast<ull>(seed),
         static_cast<ull>(seed));
  printf("# tolerances: project / back_project %.0e, orthonormalize %.0e, squared_errors %.0e of ||M||^2, step %.0e of "
         "||M||; residual, reconstruct, keep, initial_q bit for bit\n",
         kGemmTolerance, kOrthoTolerance, kStatsTolerance, kStepTolerance);
  Report report;
  Rng rng(seed);
  Checker checker(report, handle, s, rng);
  for (const Case& c : check_cases(quick)) {
    try {
      checker.run(c);
    } catch (const CudaFailure& e) {
      report.fail("cuda", c.name, e.what());
      break;  // the context may be unusable
    } catch (const std::exception& e) {
      report.fail("exception", c.name, e.what());
    }
  }
  printf("SUMMARY: %d passed, %d failed; largest errors: %s\n", report.passed(), report.failed(), report.worst().c_str());
  for (const std::string& f : report.failures()) printf("# failed: %s\n", f.c_str());
  printf("RESULT: %s\n", report.failed() ? "FAIL" : "PASS");
  return report.failed() ? kExitFailed : 0;
}

// ---------------------------------------------------------------------------------------
// --bench

// ResNet-50's convolutions and fc as matrices (out channels x in channels x k x k), the
// powersgd layers of a bucket at rank 4.
std::vector<Shape> resnet50(uint32_t rank) {
  std::vector<Shape> s{{64, 147, rank}};
  const uint64_t widths[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  uint64_t in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const uint64_t w = widths[stage], out = 4 * w;
    for (int block = 0; block < blocks[stage]; ++block) {
      s.push_back({w, in, rank});
      s.push_back({w, 9 * w, rank});
      s.push_back({out, w, rank});
      if (block == 0) s.push_back({out, in, rank});  // the downsampling shortcut
      in = out;
    }
  }
  s.push_back({1000, 2048, rank});
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void bench_case(const std::string& name, const std::vector<Shape>& shapes, int reps, lc::Handle& handle,
                const CudaStream& s) {
  std::vector<lc::Layer> layers;
  uint64_t count = 0, p_floats = 0, q_floats = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    layers.push_back({static_cast<uint32_t>(i), count, shapes[i].rows, shapes[i].cols, shapes[i].rank, p_floats, q_floats});
    count += shapes[i].rows * shapes[i].cols;
    p_floats += shapes[i].rows * shapes[i].rank;
    q_floats += shapes[i].cols * shapes[i].rank;
  }
  Rng rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> host(count), q(q_floats);
  for (float& v : host) v = normal(rng);
  for (float& v : q) v = normal(rng);
  DeviceBuffer input(4 * count), residual(4 * count), out(4 * count), p(4 * p_floats), qw(4 * q_floats),
      qn(4 * q_floats), flags(layers.size());
  const uint64_t scratch_bytes = lc::scratch_bytes(layers, DType::kFloat32, true);
  DeviceBuffer scratch(scratch_bytes);
  upload(input, host, s);
  for (float& v : host) v *= 0.1f;
  upload(residual, host, s);
  upload(qw, q, s);
  LGRECO_CUDA_CHECK(cudaMemsetAsync(flags.get(), 0, flags.size(), s.get()));
  lc::Source source;
  source.input = input.get();
  source.residual = reinterpret_cast<float*>(residual.get());
  source.flags = flags.get();
  const lc::Scratch scr{scratch.get(), scratch_bytes};
  auto* pd = reinterpret_cast<float*>(p.get());
  cudaStream_t st = s.get();
  CudaEvent e[5];
  std::vector<double> t[5];
  for (int rep = -3; rep < reps; ++rep) {
    LGRECO_CUDA_CHECK(cudaEventRecord(e[0].get(), st));
    lc::project(handle, layers, source, reinterpret_cast<float*>(qw.get()), pd, scr, st);
    LGRECO_CUDA_CHECK(cudaEventRecord(e[1].get(), st));
    lc::orthonormalize(layers, pd, scr, st);
    LGRECO_CUDA_CHECK(cudaEventRecord(e[2].get(), st));
    lc::back_project(handle, layers, source, pd, reinterpret_cast<float*>(qn.get()), scr, st);
    LGRECO_CUDA_CHECK(cudaEventRecord(e[3].get(), st));
    lc::reconstruct(layers, pd, reinterpret_cast<float*>(qn.get()), 1.0f, lc::Output{out.get(), DType::kFloat32, 0}, st);
    LGRECO_CUDA_CHECK(cudaEventRecord(e[4].get(), st));
    LGRECO_CUDA_CHECK(cudaEventSynchronize(e[4].get()));
    if (rep < 0) continue;  // warm-up
    for (int k = 0; k < 4; ++k) {
      float ms = 0;
      LGRECO_CUDA_CHECK(cudaEventElapsedTime(&ms, e[k].get(), e[k + 1].get()));
      t[k].push_back(ms * 1e3);
    }
    float ms = 0;
    LGRECO_CUDA_CHECK(cudaEventElapsedTime(&ms, e[0].get(), e[4].get()));
    t[4].push_back(ms * 1e3);
  }
  const double step = median(t[4]);
  // What a step must move at least: M read twice (input + residual, 8 B per element each
  // time), the residual written, the output written: 24 B per element.
  printf("bench %-44s step %9.1f us (project %8.1f, orthonormalize %8.1f, back_project %8.1f, reconstruct %8.1f), "
         "%5.0f GB/s at 24 B/element, median of %d\n",
         name.c_str(), step, median(t[0]), median(t[1]), median(t[2]), median(t[3]),
         24.0 * static_cast<double>(count) / (step * 1e-6) / 1e9, reps);
}

int run_bench(int reps, lc::Handle& handle, const CudaStream& s) {
  printf("# --bench: one step = project + orthonormalize + back_project + reconstruct, float32 input with a "
         "residual (flags all clear), output float32; CUDA events, median of %d after 3 warm-ups\n",
         reps);
  bench_case("4096x4096 f32 +residual rank 4", {{4096, 4096, 4}}, reps, handle, s);
  bench_case("4096x4096 f32 +residual rank 32", {{4096, 4096, 32}}, reps, handle, s);
  const std::vector<Shape> r50 = resnet50(4);
  uint64_t elements = 0;
  for (const Shape& x : r50) elements += x.rows * x.cols;
  bench_case(strf("ResNet-50 (%zu layers, %.1fM values) rank 4", r50.size(), elements / 1e6), r50, reps, handle, s);
  return 0;
}

// ---------------------------------------------------------------------------------------

const char kUsage[] = R"(usage: lgreco-gpu-lowrank-check --check [--quick] [--seed S] | --bench [--reps R] | --info  [options]

Runs lgreco's PowerSGD CUDA module (kernels/lowrank_cuda.h) on a GPU.

  --check        every operation against the CPU reference on fresh random matrices
                 (PASS/FAIL lines, then SUMMARY and RESULT lines)
  --quick        with --check: a smaller set (for compute-sanitizer)
  --bench        one step's time, 4096 x 4096 at rank 4 and 32, ResNet-50's layers at rank 4
  --info         print the device and cuBLAS's version and exit
  --seed S       seed of --check's inputs (default: drawn and printed)
  --reps R       --bench: timed repetitions, the median is reported (default 30, at least 20)
  --device N     CUDA device (default 0)
  --time-limit S exit with status 3 after S seconds (default 600, 0: none)

Exit status: 0 all passed, 1 a check or a CUDA call failed, 2 usage error or no CUDA
device, 3 the time limit ran out.
)";

int run(int argc, char** argv) {
  enum class Mode { kNone, kCheck, kBench, kInfo } mode = Mode::kNone;
  bool quick = false;
  std::optional<uint64_t> seed;
  int reps = 30, device = 0;
  uint32_t time_limit = 600;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (parse_mode(arg, mode)) {
      // --check, --bench or --info
    } else if (arg == "--quick") {
      quick = true;
    } else if (arg == "--seed") {
      seed = cli::parse_u64(arg, args.value());
    } else if (arg == "--reps") {
      reps = cli::parse_int(arg, args.value(), 20, 10000);
    } else if (arg == "--device") {
      device = cli::parse_int(arg, args.value(), 0, 1024);
    } else if (arg == "--time-limit") {
      time_limit = cli::parse_u32(arg, args.value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  require_mode(mode, quick);

  setvbuf(stdout, nullptr, _IOLBF, 0);
  arm_time_limit(kProgram, time_limit);
  if (!lc::available()) {
    fprintf(stderr, "%s: this build of lgreco has no CUDA kernels (nvcc was not found at build time)\n", kProgram);
    return kExitNoDevice;
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0 || device >= count) {
    fprintf(stderr, "%s: no CUDA device %d (%s); this program needs a GPU\n", kProgram, device,
            e != cudaSuccess ? cudaGetErrorString(e) : strf("%d devices", count).c_str());
    return kExitNoDevice;
  }
  const DeviceFacts facts = use_device(device);
  const cudaDeviceProp& prop = facts.prop;
  DeviceBuffer workspace(lc::kWorkspaceBytes);
  lc::Handle handle;
  try {
    handle = lc::Handle::create(workspace.get(), workspace.size());
  } catch (const std::exception& x) {
    printf("# device %d: %s\nFAIL handle: %s\nRESULT: FAIL\n", device, prop.name, x.what());
    return kExitFailed;
  }
  printf("# device %d: %s, compute capability %d.%d, %d SMs; %s; cuBLAS %d; lgreco %s; %s\n", device, prop.name,
         prop.major, prop.minor, prop.multiProcessorCount, facts.versions().c_str(), handle.cublas_version(),
         version_string(), bench::utc_now().c_str());
  CudaStream s;
  int rc = 0;
  if (mode == Mode::kCheck)
    rc = run_check(quick, seed ? *seed : std::random_device{}() * uint64_t{0x100000001} ^ std::random_device{}(), handle, s);
  else if (mode == Mode::kBench)
    rc = run_bench(reps, handle, s);
  else
    printf("# --info: cuBLAS loaded and a handle created\n");
  s.sync();
  handle.reset();  // before the workspace goes
  return rc;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main(lgreco::kProgram, [&] { return lgreco::run(argc, argv); });
}
