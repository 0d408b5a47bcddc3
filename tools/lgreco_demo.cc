// lgreco-demo (`make demo`): the compressed-allreduce engine and the L-GreCo controller
// at work on ResNet-50's gradient buckets.
//
// Ranks are threads of this process, each with its own in-process fabric, CPU backend and
// Engine in adaptive mode, exactly as the library runs them; every step each rank calls
// allreduce once per bucket of the registration (embedded: config/examples/resnet50.json)
// in registration order. The gradients are synthetic but shaped like real ones: per-layer
// scales spread over four orders of magnitude, heavy tails of layer-specific weight,
// per-row scales, a shared mean with per-rank noise (data-parallel gradients are
// correlated), and scales that drift over training at a different pace per layer group.
//
// Beside it each rank runs a second engine, uniform 4 bits, on the same gradients: the
// reference every error is compared with (a real run, not an extrapolation).
//
// Per epoch (one assignment of the controller) it prints the mean bits chosen per layer
// group, the bytes against float32 and against uniform 4 bits, the alpha the solve used
// (the closed loop's alpha_eff), the controller's predicted error against its budget, the
// compression error (the output minus the exact sum of what the ranks encoded, gradients
// plus residuals, docs/CONTROLLER.md) and the output's error against the exact gradient
// sum, each over the uniform run's on the same steps, and the solve time. It writes rank
// 0's decision log (build/demo/decisions.jsonl; `make demo` draws it with `lgreco plot`),
// and ends with one line for scripts:
//
//   demo: ranks=4 steps=40 bytes_vs_fp32=... bytes_vs_uniform=... error_vs_budget=...
//         output_error_vs_uniform=... alpha_eff=...
//
// error_vs_budget is the compression error of the adaptive epochs over the uniform run's
// on the same steps (the budget at alpha = 1); output_error_vs_uniform the same for the
// error against the exact gradient sum; alpha_eff the mean alpha the solves used. The
// lines before it give the realized over the predicted error by codec (the prediction is
// right, not only the total) and the worst adaptive epoch after the first, with the layer
// whose uniform error missed its forecast there by the most.
//
// Candidates: quantization at 2..8 bits (default), or with --families quant,topk also
// TopK at densities 0.1%..5%, the default codec staying 4 bits. Then a layer's bits per
// value is TopK's 64 k / n, a `topk` column counts the adaptive layers on TopK per epoch,
// a comment line says which groups and densities chose it, and the last line ends with
// " families=quant,topk". The gradients are the same
// under both settings.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "config/registration.h"
#include "config/version.h"
#include "lgreco_demo_registration.h"  // generated from config/examples/resnet50.json (Makefile)
#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/engine.h"
#include "plugin/collective/inproc_fabric.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

using collective::BucketLayout;
using collective::Engine;
using collective::EngineOptions;

// Uniform 4 bits until step 6 (the first window measures steps 3-4, after error feedback
// has settled), then a switch every 5 steps, each solved from steps 2-3 before it during
// a lag of 2 steps: several epochs in a run of a few dozen steps. --warmup, --period and
// --window change the first three (a real run's schedule is 100/100/10).
constexpr controller::ScheduleSettings kSchedule{.warmup = 5, .period = 5, .window = 2, .switch_lag = 2};
constexpr uint64_t kDefaultSteps = 40;
constexpr int kMaxRanks = 16;
constexpr int kDefaultBits = 4, kMinBits = 2, kMaxBits = 8;
// TopK densities of --families quant,topk, in parts per billion: 0.1%, 0.25%, 0.5%, 1%,
// 2%, 5%, the set LGRECO_CANDIDATES=auto gives around topk:density=0.01 (density x 0.1,
// 0.25, 0.5, 1, 2, 5; config/params.cc). A TopK layer costs 64 k / n bits per value
// (u32 index and f32 value per kept element), 0.064 to 3.2 here: from 30x below 2 bits
// to about 3 bits. Denser ones would cost more than 4 bits with far more error than
// 4-bit quantization on any gradient that is not sparse.
constexpr uint32_t kTopkPpb[] = {1'000'000, 2'500'000, 5'000'000, 10'000'000, 20'000'000, 50'000'000};
// Index of a layer's codec in the candidate list, or this for a codec outside it.
constexpr uint8_t kNoChoice = 255;

const char kUsage[] = R"(usage: lgreco-demo [--steps N] [--ranks P] [--seed S] [--registration FILE]
                   [--algorithm auto|sra|allgather] [--families quant|quant,topk]
                   [--warmup N] [--period N] [--window N] [--loop on|off] [--decision-log PATH]

Runs lgreco's compressed allreduce (the engine with error feedback and the L-GreCo
controller choosing 2..8 bits per layer, default 4, and TopK densities too with
--families quant,topk) on P ranks as threads of this process, over the gradient buckets
of ResNet-50 (embedded registration) or of FILE, with synthetic gradients whose
per-layer scale, tails and drift over training differ as real ones do. Beside it, on the
same gradients, a second engine runs uniform 4 bits: the reference every error is
compared with.
Per epoch of the controller it prints the mean bits per layer group, the bytes against
float32 and uniform 4 bits, the alpha the solve used, the errors against uniform 4 bits'
and the solve time; it writes the controller's decision log (rank 0's), which
`lgreco plot PATH` draws (`make demo` does).
The last line reads
  demo: ranks=P steps=N bytes_vs_fp32=R bytes_vs_uniform=R error_vs_budget=R
        output_error_vs_uniform=R alpha_eff=R
(on one line; bytes: float32's or uniform 4 bits' over lgreco's; error_vs_budget:
lgreco's compression error, output minus the exact sum of what was encoded, over the
uniform run's, which is the budget at alpha = 1; output_error_vs_uniform: the error of the
output against the exact sum of the gradients, the same way; alpha_eff: the mean alpha
the solves used; all over the adaptive epochs), followed by " families=quant,topk" when
TopK is among the candidates.

  --steps N            steps (default 40; at least the first switch + 1, step 7 by default)
  --ranks P            ranks, 2..16 (default 4); each holds its gradients and the engine's buffers
  --seed S             seed of the gradients and the rounding noise (default 1)
  --registration FILE  a registration file (docs/REGISTRATION.md) instead of ResNet-50
  --algorithm A        the engine's algorithm (default auto: sra for 4 ranks and large buckets)
  --families F         the codec families the controller chooses among (default quant):
                         quant       quantization, 2..8 bits
                         quant,topk  also TopK at densities 0.1%, 0.25%, 0.5%, 1%, 2%, 5%
                                     (LGRECO_CANDIDATES=auto around topk:density=0.01),
                                     64 k / n = 0.064..3.2 bits per value; a mixed call
                                     all-gathers its TopK layers (docs/ENGINE.md). The
                                     default codec stays quant:bits=4: the budget and the
                                     uniform 4 bits comparison mean the same.
  --warmup N           the controller's schedule (docs/CONTROLLER.md; defaults 5, 5, 2,
  --period N             with a switch lag of 2; a real run's are 100, 100, 10, 4): the
  --window N             first window ends at step warmup - 1, one every period after it
  --loop on|off        the closed loop on the realized error (default on); off: every solve
                       uses alpha = 1 (docs/CONTROLLER.md)
  --decision-log PATH  where rank 0's decision log goes (default build/demo/decisions.jsonl;
                       emptied first: it holds this run only): one JSON line per solve,
                       LGRECO_DECISION_LOG's format (docs/CONTROLLER.md)
)";

struct Options {
  uint64_t steps = kDefaultSteps;
  int ranks = 4;
  uint64_t seed = 1;
  std::string registration;
  collective::Algorithm algorithm = collective::Algorithm::kAuto;
  bool topk = false;  // --families quant,topk
  controller::ScheduleSettings schedule = kSchedule;
  bool loop = true;
  std::string decision_log = "build/demo/decisions.jsonl";  // rank 0's
  uint64_t first_switch() const { return schedule.warmup - 1 + schedule.switch_lag; }
};

// "quant" or "quant,topk" (either order). TopK alone is not offered: the default codec,
// whose error is the budget, is 4-bit quantization.
bool parse_families(const std::string& text, bool* topk) {
  if (text == "quant") {
    *topk = false;
    return true;
  }
  if (text == "quant,topk" || text == "topk,quant") {
    *topk = true;
    return true;
  }
  return false;
}

Options parse_options(int argc, char** argv, bool* help) {
  Options o;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    if (args.is_help()) {
      *help = true;
      return o;
    } else if (arg == "--steps") {
      o.steps = cli::parse_u64(arg, args.value());
    } else if (arg == "--ranks") {
      const std::string v = args.value();
      const uint64_t r = cli::parse_u64(arg, v);
      // One rank exchanges nothing, so the engine would pass every call through.
      if (r < 2 || r > kMaxRanks) throw cli::UsageError("--ranks must be 2.." + std::to_string(kMaxRanks) + ": " + v);
      o.ranks = static_cast<int>(r);
    } else if (arg == "--seed") {
      o.seed = cli::parse_u64(arg, args.value());
    } else if (arg == "--png") {
      // The picture is drawn from the decision log since the hand-written PNG was retired.
      throw cli::UsageError(
          "--png is gone: the demo writes its decision log (--decision-log PATH) and "
          "'lgreco plot PATH' draws it");
    } else if (arg == "--registration") {
      o.registration = args.value();
    } else if (arg == "--algorithm") {
      const std::string v = args.value();
      if (!collective::parse_algorithm(v, &o.algorithm))
        throw cli::UsageError("--algorithm must be auto, sra or allgather: " + v);
    } else if (arg == "--families") {
      const std::string v = args.value();
      if (!parse_families(v, &o.topk))
        throw cli::UsageError(
            "--families must be quant or quant,topk" +
            std::string(v == "topk" ? " (not topk alone: the budget is 4-bit quantization's error)" : "") + ": '" + v +
            "'");
    } else if (arg == "--warmup") {
      o.schedule.warmup = cli::parse_u64(arg, args.value());
    } else if (arg == "--period") {
      o.schedule.period = cli::parse_u64(arg, args.value());
    } else if (arg == "--window") {
      o.schedule.window = cli::parse_u64(arg, args.value());
    } else if (arg == "--decision-log") {
      o.decision_log = args.value();
      if (o.decision_log.empty()) throw cli::UsageError("--decision-log needs a path");
    } else if (arg == "--loop") {
      const std::string v = args.value();
      if (v != "on" && v != "off") throw cli::UsageError("--loop must be on or off: '" + v + "'");
      o.loop = v == "on";
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  const controller::ScheduleSettings& s = o.schedule;
  if (const std::string bad = config::schedule_rule_violation(s.warmup, s.period, s.window, s.switch_lag); !bad.empty())
    throw cli::UsageError("--warmup " + std::to_string(s.warmup) + " --period " + std::to_string(s.period) +
                          " --window " + std::to_string(s.window) + " (switch lag " + std::to_string(s.switch_lag) +
                          "): " + bad);
  if (o.steps <= o.first_switch() || o.steps > 100000)
    throw cli::UsageError("--steps must be " + std::to_string(o.first_switch() + 1) +
                          "..100000 (the first assignment takes effect at step " + std::to_string(o.first_switch()) +
                          "): " + std::to_string(o.steps));
  return o;
}

// ---------------------------------------------------------------------------------------
// Random numbers: splitmix64 to derive streams, xoshiro256** for bulk draws.

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t mix(uint64_t a, uint64_t b) { return mix(mix(a) ^ b); }
uint64_t hash_text(std::string_view s) { return collective::digest(s); }

class Xoshiro {
 public:
  explicit Xoshiro(uint64_t seed) {
    for (uint64_t& w : s_) w = seed = mix(seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t, s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return (next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {                                        // Box-Muller, one value per call
    const double u = 1.0 - uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * std::numbers::pi * v);
  }
  // Gamma(shape >= 1, 1): Marsaglia and Tsang.
  double gamma(double shape) {
    const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
    for (;;) {
      double x, v;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = 1.0 - uniform();
      if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v;
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// One standard normal from a hash (for per-layer constants).
double normal_of(uint64_t h) { return Xoshiro(h).normal(); }
double uniform_of(uint64_t h) { return Xoshiro(h).uniform(); }

// ---------------------------------------------------------------------------------------
// The model's layers, as the demo reports them.

struct LayerInfo {
  std::string name;
  uint32_t bucket = 0;
  uint64_t offset = 0, numel = 0;
  uint64_t row = 0;               // elements per row (shape[0] rows), numel for 1-D tensors
  DType dtype = DType::kFloat32;  // its bucket's
  bool adaptive = false;
  uint32_t model_position = 0;  // 0 = the input side (registrations list buckets output first)
  int group = 0;
};

struct Model {
  std::string name, source;
  std::vector<LayerInfo> layers;     // registration order, all buckets
  std::vector<std::string> groups;   // in model order; only groups with adaptive layers
  std::vector<uint32_t> plot_order;  // adaptive layers in model order (indices into layers)
  uint64_t values = 0, adaptive_values = 0;
};

// The group of a layer: its name's first component ("layer3.1.conv2.weight" -> "layer3").
std::string group_of(const std::string& name) { return name.substr(0, name.find('.')); }

Model describe(const config::Registration& reg, const std::vector<BucketLayout>& layouts) {
  Model m;
  m.name = reg.model.empty() ? "(unnamed)" : reg.model;
  m.source = reg.source;
  for (size_t b = 0; b < reg.buckets.size(); ++b)
    for (size_t l = 0; l < reg.buckets[b].layers.size(); ++l) {
      const config::RegisteredLayer& r = reg.buckets[b].layers[l];
      LayerInfo info;
      info.name = r.name;
      info.bucket = static_cast<uint32_t>(b);
      info.offset = r.offset;
      info.numel = r.numel;
      info.dtype = reg.buckets[b].dtype;
      info.row = std::max<uint64_t>(r.shape.size() >= 2 && r.shape[0] > 0 ? r.numel / r.shape[0] : r.numel, 1);
      info.adaptive = layouts[b].layers[l].adaptive();
      m.values += r.numel;
      if (info.adaptive) m.adaptive_values += r.numel;
      m.layers.push_back(std::move(info));
    }
  // DDP registers buckets from the output back to the input: model order is the reverse.
  const uint32_t n = static_cast<uint32_t>(m.layers.size());
  for (uint32_t i = 0; i < n; ++i) m.layers[i].model_position = n - 1 - i;
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::reverse(order.begin(), order.end());
  // Groups of adaptive layers, in model order; past 8, the rest share one column.
  constexpr size_t kMaxGroups = 8;
  std::map<std::string, int> index;
  for (uint32_t i : order) {
    LayerInfo& l = m.layers[i];
    if (!l.adaptive) continue;
    m.plot_order.push_back(i);
    const std::string g = group_of(l.name);
    auto it = index.find(g);
    if (it == index.end()) {
      if (m.groups.size() < kMaxGroups) {
        it = index.emplace(g, static_cast<int>(m.groups.size())).first;
        m.groups.push_back(g);
      } else {
        if (m.groups.size() == kMaxGroups) m.groups.push_back("rest");
        it = index.emplace(g, static_cast<int>(kMaxGroups)).first;
      }
    }
    l.group = it->second;
  }
  for (uint32_t i : order)  // kept layers share their group's index (the gradient model uses it)
    if (!m.layers[i].adaptive) {
      auto it = index.find(group_of(m.layers[i].name));
      m.layers[i].group = it == index.end() ? -1 : it->second;
    }
  return m;
}

// ---------------------------------------------------------------------------------------
// Synthetic gradients.
//
// Rank r's gradient of layer l at step t, element i in row j:
//   g = s_l(t) * row_j * (sqrt(rho_l) * T_l[a + i] + sqrt(1 - rho_l) * T_l[b_r + i])
// T_l is a table of unit-variance values of the layer's tail family (normal, or Student-t
// with 10, 6, 4, 3 or 2.5 degrees of freedom), read from a per-(step, layer) offset a
// shared by all ranks (the mean of the data-parallel gradients) and a per-rank offset b_r
// (the noise of each rank's batch); rho_l is the share of the mean. The scale is
// s_l(t) = s_l * (1 + t / 12)^(-gamma_l): log10 s_l falls with depth (the output layers
// get a decade back: they see the loss directly), spread by a normal of 0.5 decades;
// gamma_l is its group's drift (-0.3..1.2: some groups fade as training converges, some
// grow) plus per-layer jitter. Rows have log-normal scales (sigma 0.5).

class Gradients {
 public:
  static constexpr int kTails = 6;
  static constexpr double kDof[kTails] = {0, 10, 6, 4, 3, 2.5};  // 0: normal
  static constexpr uint64_t kTable = 262139;                     // prime: no alignment with buckets
  static constexpr double kDriftSteps = 12;

  Gradients(const Model& model, uint64_t seed) : seed_(seed) {
    for (int k = 0; k < kTails; ++k) {
      Xoshiro rng(mix(seed, 0x7461696c + k));
      std::vector<float>& t = tables_[k];
      t.resize(kTable);
      const double nu = kDof[k];
      for (float& v : t) {
        const double z = rng.normal();
        v = static_cast<float>(nu == 0 ? z : z / std::sqrt(2.0 * rng.gamma(nu / 2) / nu) * std::sqrt((nu - 2) / nu));
      }
    }
    const double n = static_cast<double>(std::max<size_t>(model.layers.size(), 2) - 1);
    const int last_group = static_cast<int>(model.groups.size()) - 1;
    for (const LayerInfo& info : model.layers) {
      Layer& l = layers_.emplace_back();
      const uint64_t h = mix(seed, hash_text(info.name));
      const uint64_t hg = mix(seed, hash_text(group_of(info.name)));
      const double depth = info.model_position / n;
      const double log10_scale = -1.5 - 2.0 * depth + (info.group == last_group ? 1.0 : 0.0) + 0.5 * normal_of(h);
      l.scale = std::pow(10.0, log10_scale);
      l.drift = -0.3 + 1.5 * uniform_of(hg) + 0.15 * normal_of(mix(h, 1));
      l.tail = static_cast<int>(mix(h, 2) % kTails);
      const double rho = 0.1 + 0.5 * uniform_of(mix(h, 3));
      l.shared = std::sqrt(rho);
      l.noise = std::sqrt(1 - rho);
      l.offset = info.offset;
      l.numel = info.numel;
      l.row = info.row;
      Xoshiro rng(mix(h, 4));
      l.rows.resize((info.numel + info.row - 1) / info.row);
      for (float& r : l.rows) r = static_cast<float>(std::exp(0.5 * rng.normal()));
      l.index = static_cast<uint32_t>(layers_.size() - 1);
      by_bucket_.resize(std::max<size_t>(by_bucket_.size(), info.bucket + 1));
      by_bucket_[info.bucket].push_back(l.index);
    }
  }

  // Rank r's gradient of one bucket at one step, as float32, into out[0, count).
  void fill(int rank, uint64_t step, uint32_t bucket, float* out) const {
    for (uint32_t index : by_bucket_[bucket]) {
      const Layer& l = layers_[index];
      const float* t = tables_[l.tail].data();
      const double s = l.scale * std::pow(1.0 + static_cast<double>(step) / kDriftSteps, -l.drift);
      uint64_t a = mix(mix(seed_, step), index) % kTable;
      uint64_t b = mix(mix(mix(seed_, step), index), 1000 + static_cast<uint64_t>(rank)) % kTable;
      float* o = out + l.offset;
      for (uint64_t first = 0, row = 0; first < l.numel; first += l.row, ++row) {
        const float ca = static_cast<float>(s * l.rows[row] * l.shared);
        const float cb = static_cast<float>(s * l.rows[row] * l.noise);
        uint64_t left = std::min(l.row, l.numel - first);
        float* p = o + first;
        while (left > 0) {
          const uint64_t n = std::min({left, kTable - a, kTable - b});
          const float* ta = t + a;
          const float* tb = t + b;
          for (uint64_t i = 0; i < n; ++i) p[i] = ca * ta[i] + cb * tb[i];
          p += n, left -= n, a += n, b += n;
          if (a == kTable) a = 0;
          if (b == kTable) b = 0;
        }
      }
    }
  }

 private:
  struct Layer {
    uint32_t index = 0;
    uint64_t offset = 0, numel = 0, row = 1;
    double scale = 1, drift = 0;
    int tail = 0;
    float shared = 1, noise = 0;
    std::vector<float> rows;
  };
  uint64_t seed_;
  std::vector<float> tables_[kTails];
  std::vector<Layer> layers_;
  std::vector<std::vector<uint32_t>> by_bucket_;
};

// ---------------------------------------------------------------------------------------
// One run: ranks as threads, each with two engines on the same gradients: lgreco's
// (adaptive) and a uniform one at the default codec, the reference its errors are
// compared with.

enum RunKind { kAdaptiveRun = 0, kUniformRun = 1, kRuns = 2 };

// The errors of one step, per layer, summed over the ranks' shares of the check.
struct StepErrors {
  // Compression error (docs/CONTROLLER.md): ||out - exact(what was encoded)||^2, where
  // what was encoded is every rank's gradient plus its residual, plus the owner residual
  // of the element's owner under sra. Output error: ||out - sum of the gradients||^2.
  std::vector<double> compression[kRuns], output[kRuns];
  std::vector<double> norm;  // ||sum of the gradients||^2
};

// What rank 0 saw at one step.
struct StepRecord {
  uint64_t epoch = 0;
  std::vector<uint8_t> choice;  // per layer (registration order): index into the candidates, or kNoChoice
  collective::EngineCounters counters;
  std::shared_ptr<const controller::Assignment> assignment;  // in effect
  double solve_ms = 0;
  std::vector<collective::Algorithm> algorithms;  // per bucket
  // The statistics the assignment in effect was solved from (empty in epoch 0).
  std::optional<controller::ErrorStats> stats;
  uint64_t probe_sampled = 0;  // values the error probe samples
  StepErrors errors;
};

struct Timers {
  double generate = 0, allreduce = 0, check = 0;
};

class Run {
 public:
  Run(const Options& options, std::vector<BucketLayout> layouts, EngineOptions engine_options, const Model& model,
      const Gradients& gradients)
      : o_(options),
        layouts_(std::move(layouts)),
        model_(model),
        gradients_(gradients),
        sync_(options.ranks),
        inputs_(options.ranks),
        shares_(options.ranks),
        timers_(options.ranks) {
    engine_options_[kAdaptiveRun] = engine_options;
    engine_options_[kUniformRun] = engine_options;
    engine_options_[kUniformRun].mode = config::Mode::kUniform;
    engine_options_[kUniformRun].parameters_text += " uniform";
    for (int run = 0; run < kRuns; ++run) {
      hubs_[run] = std::make_shared<collective::InProcHub>(options.ranks, std::chrono::minutes(5));
      outputs_[run].resize(options.ranks);
      residuals_[run].resize(options.ranks);
      owner_residuals_[run].resize(options.ranks);
    }
    for (int r = 0; r < o_.ranks; ++r) {
      for (const BucketLayout& b : layouts_) inputs_[r].emplace_back(b.count * dtype_size(b.dtype));
      for (int run = 0; run < kRuns; ++run) {
        for (const BucketLayout& b : layouts_) outputs_[run][r].emplace_back(b.count * dtype_size(b.dtype));
        residuals_[run][r].resize(layouts_.size());
        owner_residuals_[run][r].resize(layouts_.size());
      }
    }
  }

  // Runs every step; calls `on_step` on rank 0's thread after each. Returns "" or why it
  // failed.
  std::string run(const std::function<void(uint64_t step, const StepRecord&)>& on_step) {
    std::vector<std::thread> threads;
    for (int r = 0; r < o_.ranks; ++r) threads.emplace_back([this, r, &on_step] { rank_main(r, on_step); });
    for (std::thread& t : threads) t.join();
    return failure_;
  }
  const std::vector<Timers>& timers() const { return timers_; }

 private:
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = why;
    failed_ = true;
  }

  void abort_all(const std::string& why) {
    for (auto& hub : hubs_) hub->abort(why);
  }

  void rank_main(int r, const std::function<void(uint64_t, const StepRecord&)>& on_step) {
    try {
      std::unique_ptr<collective::InProcFabric> fabrics[kRuns];
      collective::CpuBackend backends[kRuns];
      std::unique_ptr<Engine> engines[kRuns];
      for (int run = 0; run < kRuns; ++run) {
        fabrics[run] = std::make_unique<collective::InProcFabric>(hubs_[run], r);
        EngineOptions options = engine_options_[run];
        if (run == kAdaptiveRun && r == 0) options.controller.decision_log_path = o_.decision_log;
        engines[run] = std::make_unique<Engine>(options, layouts_, *fabrics[run], backends[run]);
      }
      std::vector<float> staging;  // for buckets that are not float32
      Timers& timer = timers_[r];
      for (uint64_t step = 0; step < o_.steps; ++step) {
        double t0 = cli::seconds_now();
        for (uint32_t b = 0; b < layouts_.size(); ++b) generate(r, step, b, staging);
        double t1 = cli::seconds_now();
        timer.generate += t1 - t0;
        for (int run = 0; run < kRuns && !failed_; ++run)
          for (uint32_t b = 0; b < layouts_.size() && !failed_; ++b) {
            // What this call will encode besides the gradient: the residuals as they stand.
            residuals_[run][r][b] = engines[run]->residual_snapshot(b);
            owner_residuals_[run][r][b] = engines[run]->owner_residual_snapshot(b);
            const collective::EngineCall call{.bucket = b,
                                              .step = step,
                                              .send = inputs_[r][b].data(),
                                              .recv = outputs_[run][r][b].data(),
                                              .count = layouts_[b].count,
                                              .dtype = layouts_[b].dtype,
                                              .op = collective::ReduceOp::kSum};
            const collective::CallOutcome out = engines[run]->allreduce(call);
            if (out.kind != collective::CallOutcome::Kind::kDone) {
              fail("rank " + std::to_string(r) + ", step " + std::to_string(step) + ", bucket " + std::to_string(b) +
                   (run == kUniformRun ? " (the uniform reference run)" : "") +
                   (out.kind == collective::CallOutcome::Kind::kPassThrough ? ": the engine passed the call through: "
                                                                            : ": ") +
                   out.message);
              abort_all("rank " + std::to_string(r) + " failed");
              break;
            }
          }
        t0 = cli::seconds_now();
        timer.allreduce += t0 - t1;
        StepRecord record;
        if (r == 0) record = snapshot(*engines[kAdaptiveRun]);
        sync_.arrive_and_wait();  // every output and input of this step is ready
        if (failed_) break;
        check(r);
        timer.check += cli::seconds_now() - t0;
        sync_.arrive_and_wait();  // every rank's share of the check is done
        if (failed_) break;
        if (r == 0) {
          StepErrors& e = record.errors;
          const size_t n = model_.layers.size();
          for (int run = 0; run < kRuns; ++run) e.compression[run].assign(n, 0.0), e.output[run].assign(n, 0.0);
          e.norm.assign(n, 0.0);
          for (int q = 0; q < o_.ranks; ++q)
            for (size_t l = 0; l < n; ++l) {
              for (int run = 0; run < kRuns; ++run) {
                e.compression[run][l] += shares_[q].compression[run][l];
                e.output[run][l] += shares_[q].output[run][l];
              }
              e.norm[l] += shares_[q].norm[l];
            }
          on_step(step, record);
        }
      }
    } catch (const std::exception& e) {
      fail("rank " + std::to_string(r) + ": " + e.what());
      abort_all("rank " + std::to_string(r) + " failed");
      sync_.arrive_and_drop();  // the others do not wait for this rank at the barriers
    }
  }

  void generate(int r, uint64_t step, uint32_t b, std::vector<float>& staging) {
    const BucketLayout& layout = layouts_[b];
    if (layout.dtype == DType::kFloat32) {
      gradients_.fill(r, step, b, reinterpret_cast<float*>(inputs_[r][b].data()));
      return;
    }
    staging.resize(layout.count);
    gradients_.fill(r, step, b, staging.data());
    for (uint64_t i = 0; i < layout.count; ++i) store_from_float(inputs_[r][b].data(), layout.dtype, i, staging[i]);
  }

  StepRecord snapshot(const Engine& engine) const {
    StepRecord s;
    s.epoch = engine.epoch();
    s.counters = engine.counters();
    s.assignment = engine.assignment();
    if (const controller::Controller* c = engine.controller()) s.solve_ms = c->counters().last_solve_ms;
    if (s.epoch > 0) s.stats = engine.last_window_stats();
    s.probe_sampled = engine.probe_sampled();
    for (uint32_t b = 0; b < layouts_.size(); ++b) s.algorithms.push_back(engine.algorithm(b));
    const std::vector<CodecSpec>& candidates = engine_options_[kAdaptiveRun].candidates;
    for (uint32_t b = 0; b < layouts_.size(); ++b)
      for (const CodecSpec& c : engine.layer_codecs(b)) {
        const size_t at = std::find(candidates.begin(), candidates.end(), c) - candidates.begin();
        s.choice.push_back(at < candidates.size() ? static_cast<uint8_t>(at) : kNoChoice);
      }
    return s;
  }

  // The owner residual rank q held for element i of bucket b before the call (0 where q
  // does not own i, or without sra).
  static float owner_part(const std::pair<uint64_t, std::vector<float>>& owned, uint64_t i) {
    return i >= owned.first && i - owned.first < owned.second.size() ? owned.second[i - owned.first] : 0.0f;
  }

  // This rank's share of the error check: a 1/P slice of every bucket, against float64
  // sums of all ranks' inputs (and, for the compression error, their residuals).
  // Outputs are bit-identical on every rank (a test of the engine checks that), so each
  // rank reads its own.
  void check(int r) {
    StepErrors& share = shares_[r];
    const size_t layers = model_.layers.size();
    for (int run = 0; run < kRuns; ++run)
      share.compression[run].assign(layers, 0.0), share.output[run].assign(layers, 0.0);
    share.norm.assign(layers, 0.0);
    const int p = o_.ranks;
    for (size_t l = 0; l < layers; ++l) {
      const LayerInfo& info = model_.layers[l];
      const uint32_t b = info.bucket;
      const BucketLayout& layout = layouts_[b];
      const uint64_t begin = layout.count * r / p, end = layout.count * (r + 1) / p;
      const uint64_t lo = std::max(begin, info.offset), hi = std::min(end, info.offset + info.numel);
      if (lo >= hi) continue;
      double compression[kRuns] = {}, output[kRuns] = {}, norm = 0;
      for (uint64_t i = lo; i < hi; ++i) {
        double x = 0;
        for (int q = 0; q < p; ++q) x += load_as_float(inputs_[q][b].data(), layout.dtype, i);
        norm += x * x;
        for (int run = 0; run < kRuns; ++run) {
          double encoded = x;
          for (int q = 0; q < p; ++q) {
            const std::vector<float>& residual = residuals_[run][q][b];
            if (!residual.empty()) encoded += residual[i];
            encoded += owner_part(owner_residuals_[run][q][b], i);
          }
          const double out = load_as_float(outputs_[run][r][b].data(), layout.dtype, i);
          compression[run] += (out - encoded) * (out - encoded);
          output[run] += (out - x) * (out - x);
        }
      }
      for (int run = 0; run < kRuns; ++run)
        share.compression[run][l] = compression[run], share.output[run][l] = output[run];
      share.norm[l] = norm;
    }
  }

  const Options& o_;
  const std::vector<BucketLayout> layouts_;
  EngineOptions engine_options_[kRuns];
  const Model& model_;
  const Gradients& gradients_;
  std::shared_ptr<collective::InProcHub> hubs_[kRuns];
  std::barrier<> sync_;
  std::vector<std::vector<std::vector<uint8_t>>> inputs_;          // [rank][bucket], read by every rank's check
  std::vector<std::vector<std::vector<uint8_t>>> outputs_[kRuns];  // [run][rank][bucket]
  std::vector<std::vector<std::vector<float>>> residuals_[kRuns];  // [run][rank][bucket], before the call
  std::vector<std::vector<std::pair<uint64_t, std::vector<float>>>> owner_residuals_[kRuns];
  std::vector<StepErrors> shares_;  // [rank]: each rank's share of a step
  std::vector<Timers> timers_;
  std::mutex mutex_;
  std::atomic<bool> failed_{false};
  std::string failure_;
};

// ---------------------------------------------------------------------------------------
// Reporting

using cli::thousands;

// The candidates adaptive layers choose among: quantization at 2..8 bits (index bits - 2),
// then, with TopK, the densities of kTopkPpb in increasing order.
std::vector<CodecSpec> make_candidates(bool topk) {
  std::vector<CodecSpec> out;
  for (int b = kMinBits; b <= kMaxBits; ++b) out.push_back(CodecSpec::parse("quant:bits=" + std::to_string(b)));
  if (topk)
    for (uint32_t ppb : kTopkPpb) out.push_back(CodecSpec::topk(TopkParams{ppb}));
  return out;
}

// A density as a percentage: "0.1%", "0.25%", "1%".
std::string percent(uint32_t ppb) {
  char text[32];
  snprintf(text, sizeof text, "%g%%", static_cast<double>(ppb) / 1e7);
  return text;
}

// "quant bits 2..8" and, with TopK, " and topk densities 0.1%, ..., 5%".
std::string candidates_text(bool topk) {
  std::string s = "quant bits " + std::to_string(kMinBits) + ".." + std::to_string(kMaxBits);
  if (topk) {
    s += " and topk densities ";
    for (size_t i = 0; i < std::size(kTopkPpb); ++i) s += (i ? ", " : "") + percent(kTopkPpb[i]);
  }
  return s;
}

// Bits per value a layer's choice costs, as the table shows it: quantization's code width
// (its per-bucket minimum and unit, 0.06 bits more at buckets of 1024, left out, as the
// demo always showed it), everything else its whole encoding: TopK's 64 k / n.
double bits_per_value(const CodecSpec& c, const LayerInfo& l) {
  if (c.family() == CodecFamily::kQuant) return c.quant_params().bits;
  return 8.0 * static_cast<double>(collective::encoded_bytes(c, l.dtype, l.numel)) / static_cast<double>(l.numel);
}

// What the demo adds up over an epoch, or over all adaptive epochs.
struct Totals {
  uint64_t epoch = 0, first_step = 0, steps = 0;
  std::vector<uint8_t> choice;                               // per layer, at the first step: index into the candidates
  std::shared_ptr<const controller::Assignment> assignment;  // of the epoch
  std::optional<controller::ErrorStats> stats;               // it was solved from
  double solve_ms = 0;
  uint64_t encoded = 0, uncompressed = 0, uniform = 0;  // bytes of one encoding per call
  uint64_t wire = 0, probe = 0;                         // bytes rank 0 sent, and of those the probe's
  // Squared errors summed over layers and steps (StepErrors).
  double compression[kRuns] = {}, output[kRuns] = {}, norm = 0;
  double alpha_eff = 0;                   // summed over steps
  std::vector<double> layer_compression;  // per layer, the adaptive run's, summed over steps
  std::vector<double> layer_uniform;      // per layer, the uniform run's, summed over steps
  std::vector<double> layer_norm;         // per layer, ||sum of the gradients||^2 summed over steps
};

// Realized over predicted compression error of the layers at one codec.
struct CodecCheck {
  double realized = 0, predicted = 0;
  uint64_t layer_epochs = 0;
};

// The table, one line per epoch, printed on rank 0's thread as the steps come in.
class Report {
 public:
  Report(const Model& model, const std::vector<CodecSpec>& candidates, bool topk, uint64_t uniform_bytes)
      : model_(model), candidates_(candidates), topk_(topk), uniform_bytes_(uniform_bytes) {
    by_codec_.resize(candidates.size());
    from_topk_.resize(candidates.size());
  }

  void print_header() {
    std::string header = "epoch   steps ";
    for (const std::string& g : model_.groups) {
      const std::string shown = g.substr(0, 12);
      widths_.push_back(std::max<int>(6, static_cast<int>(shown.size())));
      char cell[32];
      snprintf(cell, sizeof cell, " %*s", widths_.back(), shown.c_str());
      header += cell;
    }
    printf("%s    all%s  vs_fp32  vs_u4  alpha_eff  pred/bud  cmp/u4  out/u4   rel_err  solve_ms\n", header.c_str(),
           topk_ ? " topk" : "");
    fflush(stdout);
  }

  void add(uint64_t step, const StepRecord& s) {
    if (step == 0) algorithms_ = s.algorithms;
    probe_sampled_ = s.probe_sampled;
    if (current_.steps == 0 || s.epoch != current_.epoch) {
      if (current_.steps > 0) finish_epoch(current_);
      current_ = Totals{};
      current_.epoch = s.epoch;
      current_.first_step = step;
      current_.choice = s.choice;
      current_.assignment = s.assignment;
      current_.stats = s.stats;
      current_.solve_ms = s.solve_ms;
      current_.layer_compression.assign(model_.layers.size(), 0.0);
    }
    const uint64_t encoded = s.counters.encoded_bytes - last_.encoded_bytes;
    const uint64_t uncompressed = s.counters.uncompressed_bytes - last_.uncompressed_bytes;
    const uint64_t wire = s.counters.wire_bytes_sent - last_.wire_bytes_sent;
    const uint64_t probe = s.counters.probe_bytes_sent - last_.probe_bytes_sent;
    last_ = s.counters;
    const StepErrors& e = s.errors;
    const size_t n = model_.layers.size();
    const bool adaptive = s.epoch > 0;
    const double alpha_eff = adaptive && s.assignment ? s.assignment->alpha_eff : 1.0;
    for (Totals* t : {&current_, adaptive ? &adaptive_ : nullptr}) {
      if (!t) continue;
      ++t->steps;
      t->encoded += encoded;
      t->uncompressed += uncompressed;
      t->uniform += uniform_bytes_;
      t->wire += wire;
      t->probe += probe;
      t->alpha_eff += alpha_eff;
      for (size_t l = 0; l < n; ++l) {
        for (int run = 0; run < kRuns; ++run)
          t->compression[run] += e.compression[run][l], t->output[run] += e.output[run][l];
        t->norm += e.norm[l];
      }
    }
    current_.layer_uniform.resize(n);
    current_.layer_norm.resize(n);
    for (size_t l = 0; l < n; ++l) {
      current_.layer_compression[l] += e.compression[kAdaptiveRun][l];
      current_.layer_uniform[l] += e.compression[kUniformRun][l];
      current_.layer_norm[l] += e.norm[l];
    }
  }

  void finish() {
    if (current_.steps > 0) finish_epoch(current_);
  }

  const Totals& adaptive() const { return adaptive_; }
  uint64_t probe_sampled() const { return probe_sampled_; }
  // The largest compression error over uniform's of an adaptive epoch after the first.
  double worst_later_epoch() const { return worst_later_; }
  // In that epoch, the uniform run's own compression error over what the statistics the
  // epoch was solved from predicted for it (the default codec on every adaptive layer):
  // how far the reference itself strayed from its forecast, the noise no solve can see.
  double worst_later_uniform_vs_forecast() const { return worst_later_uniform_; }
  // In that epoch, the adaptive layer whose uniform error missed its forecast by the most
  // (its name, its share of the forecast and its realized over forecast error); empty
  // where there was no forecast.
  const std::string& worst_later_miss() const { return worst_later_miss_; }

  // The reference's own noise, in hindsight. Each layer's uniform error per unit of the
  // exact sum's energy over all the adaptive epochs after the first is its steady rate;
  // times an epoch's energy it is that epoch's steady budget, the best a forecast that
  // assumes the gradients' shape stays put can know. Per epoch: the uniform run's error
  // over that budget (the noise no forecast sees), and the adaptive run's (the solve's
  // own miss); the product of the second and the inverse of the first is the epoch's
  // ratio. Empty before two such epochs.
  struct Hindsight {
    std::vector<double> uniform_vs_steady, adaptive_vs_steady;
  };
  Hindsight hindsight() const {
    Hindsight h;
    if (later_.size() < 2) return h;
    const size_t n = model_.layers.size();
    std::vector<double> rate(n, 0.0);
    for (size_t l = 0; l < n; ++l) {
      double error = 0, norm = 0;
      for (const Totals& e : later_) error += e.layer_uniform[l], norm += e.layer_norm[l];
      rate[l] = norm > 0 ? error / norm : 0.0;
    }
    for (const Totals& e : later_) {
      double steady = 0;
      for (size_t l = 0; l < n; ++l) steady += rate[l] * e.layer_norm[l];
      if (!(steady > 0)) return Hindsight{};
      h.uniform_vs_steady.push_back(e.compression[kUniformRun] / steady);
      h.adaptive_vs_steady.push_back(e.compression[kAdaptiveRun] / steady);
    }
    return h;
  }

  // Realized over predicted compression error by codec, over the adaptive epochs after
  // the first (their assignments were solved from windows under adaptive assignments);
  // with `from_topk`, of the layer-epochs that left TopK for a quantizer only.
  std::string codec_check(bool from_topk = false) const {
    std::string s;
    for (size_t c = 0; c < candidates_.size(); ++c) {
      const CodecCheck& k = (from_topk ? from_topk_ : by_codec_)[c];
      if (k.layer_epochs == 0) continue;
      char cell[96];
      snprintf(cell, sizeof cell, "%s%s %.3f (%llu)", s.empty() ? "" : ", ", codec_label(candidates_[c]).c_str(),
               k.predicted > 0 ? k.realized / k.predicted : 0.0, static_cast<unsigned long long>(k.layer_epochs));
      s += cell;
    }
    return s.empty() ? (from_topk ? "(none)" : "(no adaptive epoch after the first)") : s;
  }

  // With TopK among the candidates: which adaptive layers chose it, over the adaptive
  // epochs, by group and by density. One line.
  std::string topk_summary() const {
    std::string s = "topk in the adaptive epochs: " + std::to_string(topk_layer_epochs_) + " of " +
                    std::to_string(layer_epochs_) + " layer-epochs";
    if (topk_layer_epochs_ == 0) return s + " (quantization everywhere)";
    s += "; by group:";
    for (size_t g = 0; g < model_.groups.size(); ++g)
      if (topk_by_group_.count(g)) s += " " + model_.groups[g] + " " + std::to_string(topk_by_group_.at(g)) + ",";
    s.back() = ';';
    s += " by density:";
    for (const auto& [ppb, n] : topk_by_density_) s += " " + percent(ppb) + " " + std::to_string(n) + ",";
    s.pop_back();
    return s;
  }
  const std::vector<collective::Algorithm>& algorithms() const { return algorithms_; }

 private:
  // The candidate that is the default codec, quant:bits=4 (the uniform run's); size() if
  // the candidates lack it.
  size_t index_of_default() const {
    for (size_t c = 0; c < candidates_.size(); ++c)
      if (candidates_[c].family() == CodecFamily::kQuant && candidates_[c].quant_params().bits == kDefaultBits)
        return c;
    return candidates_.size();
  }

  static std::string codec_label(const CodecSpec& c) {
    if (c.family() == CodecFamily::kQuant) return std::to_string(c.quant_params().bits) + " bits";
    if (c.family() == CodecFamily::kTopk) return "topk " + percent(c.topk_params().density_ppb);
    return c.str();
  }

  void finish_epoch(const Totals& e) {
    print(e);
    check_epoch(e);
    previous_choice_ = e.choice;
  }

  void check_epoch(const Totals& e) {
    const double ratio = e.compression[kUniformRun] > 0 ? e.compression[kAdaptiveRun] / e.compression[kUniformRun] : 0;
    if (e.epoch > 1) later_.push_back(e);
    if (e.epoch > 1) {
      // Predicted: what the solve predicted per step for each layer's codec over the epoch
      // (its estimate through the switch's transient, times the drift; controller layers
      // are the adaptive ones, in registration order). The uniform run's forecast: the
      // default's error the budget rested on (settled, pooled over the last windows),
      // times the drift.
      double uniform_realized = 0, uniform_predicted = 0;
      // The layer whose uniform error strayed furthest from its forecast (in error, not
      // ratio): which layer's noise the epoch's reference carried.
      size_t miss_layer = model_.layers.size();
      double miss_realized = 0, miss_predicted = 0;
      if (e.stats && e.assignment && e.assignment->predicted.size() == e.assignment->drift.size()) {
        const size_t default_choice = index_of_default();
        size_t k = 0;
        for (size_t l = 0; l < model_.layers.size(); ++l) {
          if (!model_.layers[l].adaptive) continue;
          const uint8_t choice = e.choice[l];
          if (choice < candidates_.size() && e.stats->samples(k) > 0) {
            // The same apart for the layers that leave TopK for a quantizer: they start
            // from a residual of many steps of unsent gradient (the transient is theirs).
            const bool from_topk = l < previous_choice_.size() && previous_choice_[l] < candidates_.size() &&
                                   candidates_[previous_choice_[l]].family() == CodecFamily::kTopk &&
                                   candidates_[choice].family() == CodecFamily::kQuant;
            const auto count = [&](CodecCheck& c) {
              c.realized += e.layer_compression[l];
              if (k < e.assignment->predicted.size())
                c.predicted += e.assignment->predicted[k] * static_cast<double>(e.steps);
              ++c.layer_epochs;
            };
            count(by_codec_[choice]);
            if (from_topk) count(from_topk_[choice]);
            if (default_choice < candidates_.size()) {
              uniform_realized += e.layer_uniform[l];
              const double budget = k < e.assignment->budget.size() ? e.assignment->budget[k] : 0.0;
              const double forecast = budget * static_cast<double>(e.steps);
              uniform_predicted += forecast;
              if (forecast > 0 && std::abs(e.layer_uniform[l] - forecast) > std::abs(miss_realized - miss_predicted))
                miss_layer = l, miss_realized = e.layer_uniform[l], miss_predicted = forecast;
            }
          }
          ++k;
        }
      }
      if (ratio > worst_later_) {
        worst_later_ = ratio;
        worst_later_uniform_ = uniform_predicted > 0 ? uniform_realized / uniform_predicted : 0;
        worst_later_miss_.clear();
        if (miss_layer < model_.layers.size() && uniform_predicted > 0) {
          char text[256];
          snprintf(text, sizeof text, "%s (%.0f%% of that forecast) realized %.4f of its own",
                   model_.layers[miss_layer].name.c_str(), 100.0 * miss_predicted / uniform_predicted,
                   miss_realized / miss_predicted);
          worst_later_miss_ = text;
        }
      }
    }
  }

  void print(const Totals& e) {
    char steps[48];
    snprintf(steps, sizeof steps, "%llu-%llu", static_cast<unsigned long long>(e.first_step),
             static_cast<unsigned long long>(e.first_step + e.steps - 1));
    printf("%5llu %7s ", static_cast<unsigned long long>(e.epoch), steps);
    std::vector<double> bits(model_.groups.size(), 0), values(model_.groups.size(), 0);
    double all_bits = 0, all_values = 0;
    int on_topk = 0;
    for (uint32_t i : model_.plot_order) {
      const LayerInfo& l = model_.layers[i];
      const uint8_t choice = e.choice[i];
      const CodecSpec* c = choice < candidates_.size() ? &candidates_[choice] : nullptr;
      bits[l.group] += (c ? bits_per_value(*c, l) : 0.0) * static_cast<double>(l.numel);
      values[l.group] += static_cast<double>(l.numel);
      if (c && c->family() == CodecFamily::kTopk) {
        ++on_topk;
        if (e.epoch > 0) {
          ++topk_layer_epochs_;
          ++topk_by_group_[static_cast<size_t>(l.group)];
          ++topk_by_density_[c->topk_params().density_ppb];
        }
      }
      if (e.epoch > 0) ++layer_epochs_;
    }
    for (size_t g = 0; g < model_.groups.size(); ++g) {
      printf(" %*.2f", widths_[g], bits[g] / values[g]);
      all_bits += bits[g], all_values += values[g];
    }
    printf(" %6.2f", all_bits / all_values);
    if (topk_) printf(" %4d", on_topk);
    printf(" %8.2f %6.3f", ratio(e.uncompressed, e.encoded), ratio(e.uniform, e.encoded));
    const controller::Assignment* a = e.assignment.get();
    if (e.epoch > 0 && a && a->solution.budget > 0)
      printf(" %10.4f %9.4f", a->alpha_eff, a->solution.error / a->solution.budget);
    else
      printf(" %10s %9s", "-", "-");
    printf(" %7.4f %7.4f", e.compression[kAdaptiveRun] / e.compression[kUniformRun],
           e.output[kAdaptiveRun] / e.output[kUniformRun]);
    printf(" %9.3e", std::sqrt(e.output[kAdaptiveRun] / e.norm));
    if (e.epoch > 0)
      printf(" %9.2f\n", e.solve_ms);
    else
      printf(" %9s\n", "-");
    fflush(stdout);
  }
  static double ratio(uint64_t a, uint64_t b) { return static_cast<double>(a) / static_cast<double>(b); }

  const Model& model_;
  const std::vector<CodecSpec>& candidates_;
  const bool topk_;
  const uint64_t uniform_bytes_;
  std::vector<int> widths_;
  Totals current_, adaptive_;
  collective::EngineCounters last_;
  // Adaptive layers x adaptive epochs, and those on TopK: in all, by group, by density.
  uint64_t layer_epochs_ = 0, topk_layer_epochs_ = 0;
  std::map<size_t, uint64_t> topk_by_group_;
  std::map<uint32_t, uint64_t> topk_by_density_;
  std::vector<CodecCheck> by_codec_, from_topk_;
  std::vector<uint8_t> previous_choice_;  // the last finished epoch's
  double worst_later_ = 0, worst_later_uniform_ = 0;
  std::string worst_later_miss_;
  std::vector<Totals> later_;  // the adaptive epochs after the first, for hindsight()
  uint64_t probe_sampled_ = 0;
  std::vector<collective::Algorithm> algorithms_;
};

// Creates the decision log's directory and empties the file, before the run rather than
// after it: the controller appends, and the log is to hold this run only.
void prepare_decision_log(const std::string& path) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) throw std::runtime_error("cannot create the directory of '" + path + "': " + ec.message());
  }
  FILE* f = fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write the decision log '" + path + "': " + strerror(errno));
  fclose(f);
}

int run(int argc, char** argv) {
  bool help = false;
  const Options o = parse_options(argc, argv, &help);
  if (help) {
    fputs(kUsage, stdout);
    return 0;
  }
  const double start = cli::seconds_now();
  const config::Registration reg =
      o.registration.empty() ? config::parse_registration(demo_data::kRegistration, demo_data::kRegistrationSource)
                             : config::load_registration(o.registration);

  EngineOptions options;
  options.mode = config::Mode::kAdaptive;
  options.codec = CodecSpec::parse("quant:bits=" + std::to_string(kDefaultBits));
  options.candidates = make_candidates(o.topk);
  options.error_feedback = true;
  options.algorithm = o.algorithm;
  options.seed = mix(o.seed, 0x726f756e64);  // the rounding noise
  options.controller.schedule = o.schedule;
  options.controller.budget_loop = o.loop;

  options.parameters_text = "lgreco-demo";
  std::vector<BucketLayout> layouts;
  for (size_t b = 0; b < reg.buckets.size(); ++b) {
    layouts.push_back(collective::layout_from_registration(reg.buckets[b], options));
    collective::validate(layouts.back(), b);
  }
  const Model model = describe(reg, layouts);
  if (model.plot_order.empty())
    throw std::runtime_error(reg.source + ": no layer is compressed adaptively (each is 1-D, under " +
                             std::to_string(config::kMinCompressedElements) + " elements, never or pinned)");
  uint64_t uniform_bytes = 0;  // one encoding of every bucket at the defaults
  for (const BucketLayout& b : layouts)
    for (const collective::LayerLayout& l : b.layers)
      uniform_bytes += collective::encoded_bytes(l.candidates[l.default_index], b.dtype, l.numel);
  prepare_decision_log(o.decision_log);
  const Gradients gradients(model, o.seed);

  using ull = unsigned long long;
  printf("# lgreco-demo, lgreco %s\n", version_string());
  printf(
      "# model %s (%s): %zu layers in %zu buckets, %s values; %zu layers (%s values) adaptive, the rest float32 "
      "(1-D, under %llu elements or registered never)\n",
      model.name.c_str(), reg.source.c_str(), model.layers.size(), reg.buckets.size(), thousands(model.values).c_str(),
      model.plot_order.size(), thousands(model.adaptive_values).c_str(),
      static_cast<ull>(config::kMinCompressedElements));
  printf(
      "# %d ranks as threads (in-process fabric, CPU backend), algorithm %s, error feedback; default %s, "
      "candidates %s\n",
      o.ranks, collective::algorithm_name(o.algorithm), options.codec.str().c_str(), candidates_text(o.topk).c_str());
  printf(
      "# controller: warmup %llu, period %llu, window %llu, switch lag %llu; alpha 1, squared error, closed loop %s; "
      "switches at steps %llu, %llu, ...; error probe from %llu steps before each window\n",
      static_cast<ull>(o.schedule.warmup), static_cast<ull>(o.schedule.period), static_cast<ull>(o.schedule.window),
      static_cast<ull>(o.schedule.switch_lag), o.loop ? "on" : "off", static_cast<ull>(o.first_switch()),
      static_cast<ull>(o.first_switch() + o.schedule.period), static_cast<ull>(o.schedule.probe_lead));
  printf(
      "# gradients: synthetic, seed %llu: per-layer scales over 4 decades (falling with depth), normal or Student-t "
      "tails (nu 10..2.5), per-row scales, a mean shared by the ranks plus per-rank noise, scales drifting per "
      "group over steps\n",
      static_cast<ull>(o.seed));
  printf(
      "#\n# per epoch of the controller: mean bits per value chosen for each group's adaptive layers; bytes of\n"
      "# float32 and of uniform 4 bits over lgreco's (one encoding per call); alpha_eff: the alpha the solve\n"
      "# used (the closed loop's); pred/bud: the solve's predicted error over its budget; cmp/u4: the measured\n"
      "# compression error (||out - exact sum of what was encoded||^2, residuals included) over the uniform\n"
      "# run's on the same steps; out/u4: the same for the error against the exact sum of the gradients;\n"
      "# rel_err: ||out - exact sum of the gradients|| / ||exact sum||\n");
  if (o.topk)
    printf(
        "# a layer on topk counts 64 k / n bits per value (u32 index, f32 value per kept element; quant: its\n"
        "# code width, as above); topk: how many adaptive layers use topk in the epoch\n");
  Report report(model, options.candidates, o.topk, uniform_bytes);
  report.print_header();

  Run runner(o, layouts, options, model, gradients);
  const std::string failure = runner.run([&](uint64_t step, const StepRecord& s) { report.add(step, s); });
  if (!failure.empty()) throw std::runtime_error(failure);
  report.finish();
  const Totals& adaptive = report.adaptive();
  if (adaptive.steps == 0 || adaptive.encoded == 0 || !(adaptive.compression[kUniformRun] > 0))
    throw std::runtime_error("the controller never switched to an adaptive assignment in " + std::to_string(o.steps) +
                             " steps (a failed solve? LGRECO_DEBUG=INFO says more)");

  const double seconds = cli::seconds_now() - start;
  Timers mean;
  for (const Timers& t : runner.timers()) {
    mean.generate += t.generate / o.ranks;
    mean.allreduce += t.allreduce / o.ranks;
    mean.check += t.check / o.ranks;
  }
  std::map<std::string, int> algorithms;
  for (collective::Algorithm a : report.algorithms()) ++algorithms[collective::algorithm_name(a)];
  std::string used;
  for (const auto& [name, count] : algorithms)
    used += (used.empty() ? "" : ", ") + name + " for " + std::to_string(count) + " of " +
            std::to_string(layouts.size()) + " buckets";
  printf("#\n# decision log (rank 0's, one line per solve): %s; draw it with: lgreco plot %s\n", o.decision_log.c_str(),
         o.decision_log.c_str());
  if (o.topk) printf("# %s\n", report.topk_summary().c_str());
  printf(
      "# adaptive epochs, %llu steps: %s bytes per step against %s in float32 and %s at uniform 4 bits; "
      "relative error %.3e against uniform 4 bits' %.3e; engine: %s\n",
      static_cast<ull>(adaptive.steps), thousands(adaptive.encoded / adaptive.steps).c_str(),
      thousands(adaptive.uncompressed / adaptive.steps).c_str(), thousands(uniform_bytes).c_str(),
      std::sqrt(adaptive.output[kAdaptiveRun] / adaptive.norm), std::sqrt(adaptive.output[kUniformRun] / adaptive.norm),
      used.c_str());
  printf(
      "# error probe: %s of the %s adaptive values sampled (%.2f%%); %s bytes per step of rank 0's %s on the wire "
      "in the adaptive epochs (its exchanges run in the windows and the %llu steps before each)\n",
      thousands(report.probe_sampled()).c_str(), thousands(model.adaptive_values).c_str(),
      100.0 * static_cast<double>(report.probe_sampled()) / static_cast<double>(model.adaptive_values),
      thousands(adaptive.probe / adaptive.steps).c_str(), thousands(adaptive.wire / adaptive.steps).c_str(),
      static_cast<ull>(o.schedule.probe_lead));
  printf("# realized over predicted compression error by codec, adaptive epochs after the first (layer-epochs): %s\n",
         report.codec_check().c_str());
  if (o.topk) printf("# of those, layers that left TopK for a quantizer: %s\n", report.codec_check(true).c_str());
  printf(
      "# worst adaptive epoch after the first: compression error %.4f of the uniform run's; in it, the uniform "
      "run's own error %.4f of what the solve's statistics forecast for it%s%s\n",
      report.worst_later_epoch(), report.worst_later_uniform_vs_forecast(),
      report.worst_later_miss().empty() ? "" : "; its largest miss: ", report.worst_later_miss().c_str());
  if (const Report::Hindsight h = report.hindsight(); !h.uniform_vs_steady.empty()) {
    const auto list = [](const std::vector<double>& v) {
      std::string s;
      for (double x : v) {
        char cell[32];
        snprintf(cell, sizeof cell, "%s%.3f", s.empty() ? "" : " ", x);
        s += cell;
      }
      return s;
    };
    printf(
        "# in hindsight, adaptive epochs after the first: the uniform run's error over its steady budget (each "
        "layer's uniform error per unit of the exact sum's energy over these epochs, times the epoch's energy): %s; "
        "the adaptive run's: %s; so a solve that spent each steady budget exactly would read up to %.4f of the "
        "uniform run's in one epoch\n",
        list(h.uniform_vs_steady).c_str(), list(h.adaptive_vs_steady).c_str(),
        1.0 / *std::min_element(h.uniform_vs_steady.begin(), h.uniform_vs_steady.end()));
  }
  printf("# %.1f s; per rank: gradients %.1f s, allreduce %.1f s, error check %.1f s\n", seconds, mean.generate,
         mean.allreduce, mean.check);
  printf(
      "demo: ranks=%d steps=%llu bytes_vs_fp32=%.3f bytes_vs_uniform=%.3f error_vs_budget=%.4f "
      "output_error_vs_uniform=%.4f alpha_eff=%.4f%s\n",
      o.ranks, static_cast<ull>(o.steps),
      static_cast<double>(adaptive.uncompressed) / static_cast<double>(adaptive.encoded),
      static_cast<double>(adaptive.uniform) / static_cast<double>(adaptive.encoded),
      adaptive.compression[kAdaptiveRun] / adaptive.compression[kUniformRun],
      adaptive.output[kAdaptiveRun] / adaptive.output[kUniformRun],
      adaptive.alpha_eff / static_cast<double>(adaptive.steps), o.topk ? " families=quant,topk" : "");
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-demo", [&] { return lgreco::run(argc, argv); });
}
