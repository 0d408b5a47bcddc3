// The controller's thread, schedule and hand-over, over simulated training steps on
// several ranks. Also built alone under ThreadSanitizer (make test-tsan), so it uses
// nothing but controller/ and config/.
#include "controller/controller.h"

#include <dirent.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <chrono>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/test_util.h"
#include "tools/solver_instances.h"

namespace lgreco {
namespace {

using controller::Assignment;
using controller::Controller;
using controller::ControllerSettings;
using controller::ErrorStats;
using controller::Layer;
using controller::Problem;
using namespace std::chrono_literals;

// Layers with candidates quant bits 2..8 (default 4) and a last one that stays as is.
std::vector<Layer> make_layers(size_t count) {
  std::vector<Layer> layers;
  for (size_t l = 0; l < count; ++l) {
    Layer layer{"layer" + std::to_string(l), 1000 + 997 * l * l, 2, {}};
    for (uint32_t b = 2; b <= 8; ++b)
      layer.candidates.push_back({"quant:bits=" + std::to_string(b), tools::quant_encoded_bytes(layer.numel, b), 0});
    layers.push_back(std::move(layer));
  }
  layers.push_back(Layer{"bias", 64, 0, {{"none", 256, 0}}});
  return layers;
}

// One rank's sample of every layer: the stochastic-rounding error model with a per-layer
// scale and per-sample noise.
void add_samples(ErrorStats& stats, const std::vector<Layer>& layers, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.5, 1.5);
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<double> e;
    const double scale = static_cast<double>(layers[l].numel) * (1 + l % 3) * unit(rng);
    for (size_t c = 0; c < layers[l].candidates.size(); ++c) {
      const double levels = static_cast<double>((4u << c) - 1);
      e.push_back(layers[l].candidates.size() == 1 ? 0.0 : scale / (levels * levels));
    }
    stats.add(l, e);
  }
}

ControllerSettings small_schedule(uint64_t warmup, uint64_t period, uint64_t window, uint64_t lag) {
  ControllerSettings s;
  s.schedule = {warmup, period, window, lag};
  return s;
}

// The problem the controller must have solved: the layers with the aggregated means.
Problem expected_problem(const ControllerSettings& settings, std::vector<Layer> layers, const ErrorStats& stats) {
  Problem p;
  p.alpha = settings.alpha;
  for (size_t l = 0; l < layers.size(); ++l)
    for (uint32_t c = 0; c < layers[l].candidates.size(); ++c) layers[l].candidates[c].error = stats.mean(l, c);
  p.layers = std::move(layers);
  return p;
}

size_t thread_count() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}


BOOST_AUTO_TEST_SUITE(controller_thread)

BOOST_AUTO_TEST_CASE(every_rank_switches_at_the_same_step_to_the_same_choices) {
  const auto layers = make_layers(12);
  const ControllerSettings settings = small_schedule(5, 6, 2, 2);
  constexpr int kRanks = 3;
  std::vector<std::unique_ptr<Controller>> ranks;
  std::vector<ErrorStats> local;
  std::vector<std::mt19937_64> rngs;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(std::make_unique<Controller>(settings, layers));
    local.push_back(ranks.back()->new_stats());
    rngs.emplace_back(test::run_seed() + r);
  }
  std::vector<uint32_t> defaults;
  for (const Layer& l : layers) defaults.push_back(l.default_index);

  std::vector<uint64_t> switch_steps;
  struct Expected {
    uint64_t at;                     // effective step
    std::vector<uint32_t> choices;
    std::vector<double> predicted;   // per layer: the chosen candidate's mean error
  };
  std::vector<Expected> expected;
  uint64_t epoch = 0;
  for (uint64_t step = 0; step < 45; ++step) {
    std::vector<std::shared_ptr<const Assignment>> a;
    for (auto& c : ranks) a.push_back(c->assignment_for_step(step));
    for (int r = 1; r < kRanks; ++r) {
      BOOST_TEST(a[r]->epoch == a[0]->epoch);
      BOOST_TEST(a[r]->choices == a[0]->choices);
    }
    if (a[0]->epoch != epoch) {
      epoch = a[0]->epoch;
      switch_steps.push_back(step);
      BOOST_TEST(a[0]->effective_step == step);
    }
    // The assignment in effect is the one solved from the last window whose switch came.
    const Expected* want = nullptr;
    for (const Expected& e : expected)
      if (e.at <= step) want = &e;
    BOOST_TEST(a[0]->choices == (want ? want->choices : defaults), "step " << step);
    // What the solve predicted for each choice: on these settled samples (the state now
    // is the steady one, no drift) exactly the statistics' mean, for the epoch to be
    // judged against; 0 for the layer that only passes through.
    if (want) {
      BOOST_TEST_REQUIRE(a[0]->predicted.size() == layers.size());
      for (size_t l = 0; l < layers.size(); ++l)
        BOOST_TEST(a[0]->predicted[l] == want->predicted[l], boost::test_tools::tolerance(1e-12));
    }

    const auto& schedule = ranks[0]->schedule();
    if (schedule.measures(step))
      for (int r = 0; r < kRanks; ++r) add_samples(local[r], layers, rngs[r]);
    if (schedule.window_ends(step)) {
      ErrorStats sum = ranks[0]->new_stats();  // the engine's allreduce
      for (int r = 0; r < kRanks; ++r) sum.merge(local[r]);
      for (auto& c : ranks) c->submit(step, sum);
      for (auto& l : local) l.clear();
      Expected e{schedule.effective_step(step), controller::solve(expected_problem(settings, layers, sum)).choices, {}};
      for (size_t l = 0; l < layers.size(); ++l) e.predicted.push_back(sum.mean(l, e.choices[l]));
      expected.push_back(std::move(e));
    }
  }
  BOOST_TEST(switch_steps == std::vector<uint64_t>({6, 12, 18, 24, 30, 36, 42}));
  for (auto& c : ranks) BOOST_TEST(c->counters().solves == 7u);
}

// The closed loop against a deliberately wrong error model, the kind the controller had
// before the error probe: the narrow codecs (2 and 3 bits) realize `bias` times the error
// the statistics predict. The first adaptive epoch overspends; the loop sees it in the
// next window and lowers alpha_eff until the realized error fits the budget, within two
// epochs, then stays there without swinging back over it. Two controllers fed the same
// sums (two ranks) make the same decisions. With the loop off the overspend stays.
struct LoopRun {
  std::vector<double> ratio;      // per adaptive epoch: realized error over the budget
  std::vector<double> alpha_eff;  // per adaptive epoch
  std::vector<double> bytes;      // per adaptive epoch: over the defaults'
};
LoopRun run_wrong_model(bool loop, double bias, uint64_t seed) {
  const auto layers = make_layers(30);
  ControllerSettings settings = small_schedule(2, 4, 2, 1);
  settings.budget_loop = loop;
  Controller a(settings, layers), b(settings, layers);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> jitter(0.97, 1.03);  // measurement noise
  // The model: quantization's error ~ scale / levels^2, per layer and candidate, with
  // per-element scales over four decades (so that the search moves bits between layers).
  std::vector<std::vector<double>> model(layers.size());
  for (size_t l = 0; l < layers.size(); ++l)
    for (size_t c = 0; c < layers[l].candidates.size(); ++c) {
      const double levels = static_cast<double>((4u << c) - 1);
      const double scale = static_cast<double>(layers[l].numel) * std::pow(10.0, static_cast<double>(l % 5) - 2);
      model[l].push_back(layers[l].candidates.size() == 1 ? 0.0 : scale / (levels * levels));
    }
  const auto truth = [&](size_t l, uint32_t c) { return model[l][c] * (c < 2 ? bias : 1.0); };
  double budget = 0;
  for (size_t l = 0; l < layers.size(); ++l) budget += truth(l, layers[l].default_index);
  LoopRun out;
  ErrorStats stats = a.new_stats();
  uint64_t epoch = 0;
  double realized = 0;
  uint64_t steps = 0;
  for (uint64_t step = 0; step < 60; ++step) {
    const auto in_a = a.assignment_for_step(step), in_b = b.assignment_for_step(step);
    BOOST_TEST(in_a->choices == in_b->choices);
    BOOST_TEST(in_a->alpha_eff == in_b->alpha_eff);
    if (in_a->epoch != epoch) {  // a switch: the epoch before is done
      if (epoch > 0) out.ratio.push_back(realized / steps / budget);
      epoch = in_a->epoch;
      out.alpha_eff.push_back(in_a->alpha_eff);
      out.bytes.push_back(static_cast<double>(in_a->solution.bytes) /
                          static_cast<double>(in_a->solution.default_bytes));
      realized = 0, steps = 0;
    }
    double step_error = 0;
    for (size_t l = 0; l < layers.size(); ++l) step_error += truth(l, in_a->choices[l]);
    if (epoch > 0) realized += step_error, ++steps;
    if (a.schedule().measures(step))
      for (size_t l = 0; l < layers.size(); ++l) {
        std::vector<double> measured;
        for (double e : model[l]) measured.push_back(e * jitter(rng));
        ErrorStats::Sample sample;
        sample.measured = measured;
        sample.realized = truth(l, in_a->choices[l]) * jitter(rng);
        stats.add(l, sample);
      }
    if (a.schedule().window_ends(step)) {
      a.submit(step, stats);
      b.submit(step, stats);
      stats.clear();
    }
  }
  return out;
}

BOOST_AUTO_TEST_CASE(the_closed_loop_corrects_a_wrong_error_model_within_two_epochs) {
  const uint64_t seed = test::run_seed();
  for (double bias : {1.6, 2.4}) {
    BOOST_TEST_CONTEXT("seed " << seed << ", the narrow codecs realize " << bias << "x their predicted error") {
      const LoopRun off = run_wrong_model(false, bias, seed);
      const LoopRun on = run_wrong_model(true, bias, seed);
      BOOST_TEST_REQUIRE(on.ratio.size() >= 8u);
      std::string trace, off_trace;
      for (size_t k = 0; k < on.ratio.size(); ++k)
        trace += " " + std::to_string(on.ratio[k]) + "@" + std::to_string(on.alpha_eff[k]);
      for (double r : off.ratio) off_trace += " " + std::to_string(r);
      BOOST_TEST_CONTEXT("realized / budget @ alpha_eff per epoch:" << trace << "; loop off:" << off_trace) {
        for (double r : off.ratio) BOOST_TEST(r > 1.1);  // without the loop the model's error stays
        BOOST_TEST(on.ratio[0] > 1.1);                   // the first adaptive epoch, before any correction
        // Recovered within two epochs: to within the noise below (+-3%, and the cliff's
        // 1.033), not 1.03: seed 18199682993546702887 went 1.36, 1.034, 1.035, 0.97 under
        // one alpha_eff (CI's random seed, 2026-12-06; none of 2,100 other seeds did).
        BOOST_TEST(std::min(on.ratio[1], on.ratio[2]) <= 1.04);
        // And it stays so: from the third epoch on, no overspend beyond 10%, at most one
        // beyond 4% in any six epochs (the ceiling's slow re-probe of a cliff where one
        // more layer's narrow codec adds a step of error), on average within the budget,
        // and the budget not wasted. Not 3%: the measurements carry +-3% noise, so at
        // one alpha_eff the solution near such a cliff realizes 1.003 or 1.033 of the
        // budget by which layer the noise favours, and the loop rightly leaves a bias
        // within its dead band alone (seeds 103 and 108 of 1-120 had two such epochs
        // within six, at 1.032-1.036). A re-probe itself reached 1.048-1.054 once in
        // seeds 15, 57 and 89.
        double sum = 0;
        for (size_t k = 2; k < on.ratio.size(); ++k) {
          BOOST_TEST(on.ratio[k] <= 1.10);
          BOOST_TEST(on.ratio[k] >= 0.70);
          sum += on.ratio[k];
          size_t over = 0;
          for (size_t j = k; j < std::min(k + 6, on.ratio.size()); ++j) over += on.ratio[j] > 1.04;
          BOOST_TEST(over <= 1u, "epochs " << k << " to " << k + 5);
        }
        BOOST_TEST(sum / static_cast<double>(on.ratio.size() - 2) <= 1.02);  // the dead band
        for (double alpha : on.alpha_eff) BOOST_TEST((alpha >= 0.25 && alpha <= 1.0));
        // Lowered or not, alpha_eff never makes an epoch dearer than the defaults.
        for (double bytes : on.bytes) BOOST_TEST(bytes <= 1.0);
      }
    }
  }
}

// TopK's error feedback keeps what it does not send, so its error grows with its
// residual's age, sublinearly (the residual's largest values go out). Here real TopK runs
// with error feedback feed the controller as the engine's probe would: every candidate's
// shadow residual stepped on the probe steps only (10 of every 20), the real state's
// error per candidate, the gradient alone's, and the realized error. A forced sequence
// of densities moves each layer down, up and keeps it; per density, the epochs' realized
// mean error must be within 15% of what the solve predicted for them
// (Assignment::predicted). (The linear growth held to the shadow as a floor predicted up
// to 5x for moves to a denser TopK here.)
namespace topk_run {
// x = g + r; the k largest |x| are sent; returns the squared error, r = what was not.
double step(std::vector<float>& r, const std::vector<float>& g, size_t k, bool keep) {
  std::vector<float> x(g.size());
  for (size_t i = 0; i < g.size(); ++i) x[i] = g[i] + r[i];
  std::vector<float> mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) mag[i] = std::fabs(x[i]);
  std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(x.size() - k), mag.end());
  const float threshold = mag[x.size() - k];
  double e = 0;
  size_t sent = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::fabs(x[i]) >= threshold && sent < k) {
      ++sent;
      x[i] = 0;
    }
    e += static_cast<double>(x[i]) * x[i];
  }
  if (keep) r = std::move(x);
  return e;
}
}  // namespace topk_run

// A layer-epoch of a forced TopK run: the densities (indices) it moved from and to, and
// its realized error over the prediction.
struct TopkEpoch {
  std::string layer;
  uint64_t epoch;
  uint32_t from, to;
  double ratio;
};

// Two layers of 8192 values (gaussian, and log-normal scales per element: a heavy tail)
// under TopK with error feedback at densities 0.2%, 1% and 10% (the default 10%), each
// step's gradient fresh noise; the controller's solves are replaced by the `forced`
// choices, one per epoch (the last repeated). Every candidate's error is measured as the
// engine does: on the gradient alone, on the real state, and in shadows of its own.
std::vector<TopkEpoch> run_forced_topk(ControllerSettings settings, const std::vector<std::vector<uint32_t>>& forced) {
  constexpr size_t kNumel = 8192;
  const std::vector<double> densities{0.002, 0.01, 0.1};
  std::vector<Layer> layers;
  for (const char* name : {"gaussian", "heavy"}) {
    Layer layer{name, kNumel, 2, {}};
    for (double d : densities)
      layer.candidates.push_back({"topk:density=" + std::to_string(d), static_cast<uint64_t>(8 * d * kNumel), 0});
    layers.push_back(std::move(layer));
  }
  size_t solves = 0;  // the solver thread's alone
  settings.budget_loop = false;
  Controller controller(settings, layers, [&](const Problem&, const controller::SolverOptions&) {
    controller::Solution s;
    s.choices = forced[std::min(solves++, forced.size() - 1)];
    return s;
  });
  std::mt19937_64 rng(test::run_seed());
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> scale(2, std::vector<float>(kNumel));  // per element
  for (size_t i = 0; i < kNumel; ++i) {
    scale[0][i] = 1;
    scale[1][i] = std::exp(1.5f * normal(rng));  // log-normal: a heavy tail
  }
  const size_t C = densities.size();
  std::vector<std::vector<float>> real(2, std::vector<float>(kNumel, 0.0f));
  std::vector<std::vector<std::vector<float>>> shadow(2, std::vector<std::vector<float>>(C, real[0]));
  ErrorStats stats = controller.new_stats();
  std::shared_ptr<const Assignment> in_effect;
  std::vector<uint32_t> before{2, 2};  // the choices of the epoch before the one in effect
  std::vector<double> realized(2, 0);
  uint64_t steps = 0;
  std::vector<TopkEpoch> epochs;
  const auto judge = [&] {
    if (!in_effect || steps == 0) return;
    for (size_t l = 0; l < 2; ++l) {
      if (in_effect->epoch > 0)
        epochs.push_back({layers[l].name, in_effect->epoch, before[l], in_effect->choices[l],
                          realized[l] / static_cast<double>(steps) / in_effect->predicted[l]});
      before[l] = in_effect->choices[l];
    }
  };
  const auto& schedule = controller.schedule();
  const uint64_t last = schedule.settings().warmup + schedule.settings().period * forced.size();
  for (uint64_t step = 1; step < last; ++step) {
    auto a = controller.assignment_for_step(step);
    if (a != in_effect) {
      judge();
      in_effect = a, realized.assign(2, 0), steps = 0;
    }
    for (size_t l = 0; l < 2; ++l) {
      std::vector<float> g(kNumel);
      double magnitude = 0;
      for (size_t i = 0; i < kNumel; ++i) g[i] = scale[l][i] * normal(rng), magnitude += std::fabs(g[i]);
      std::vector<double> measured(C), simulated(C), current(C);
      const std::vector<float> zero(kNumel, 0.0f);
      for (size_t c = 0; c < C; ++c) {
        const size_t k = static_cast<size_t>(densities[c] * kNumel);
        if (schedule.probes(step)) simulated[c] = topk_run::step(shadow[l][c], g, k, true);
        std::vector<float> scratch = zero;
        measured[c] = topk_run::step(scratch, g, k, false);
        scratch = real[l];
        current[c] = topk_run::step(scratch, g, k, false);
      }
      const double made = topk_run::step(real[l], g, static_cast<size_t>(densities[a->choices[l]] * kNumel), true);
      realized[l] += made;
      if (schedule.measures(step)) {
        ErrorStats::Sample sample;
        sample.measured = measured, sample.simulated = simulated, sample.reference = measured;
        sample.current = current, sample.realized = made, sample.magnitude = magnitude;
        stats.add(l, sample);
      }
    }
    ++steps;
    if (schedule.window_ends(step)) {
      controller.submit(step, stats);
      stats.clear();
    }
  }
  judge();
  return epochs;
}

std::string trace_of(const std::vector<TopkEpoch>& epochs) {
  const char* density[] = {"0.2%", "1%", "10%"};
  std::string trace;
  for (const TopkEpoch& e : epochs)
    trace += " " + e.layer + "@" + density[e.from] + "->" + density[e.to] + ":" + std::to_string(e.ratio);
  return trace;
}

// The geometric mean of the ratios of the epochs `select` takes (1 where none).
template <typename Select>
double geometric_mean(const std::vector<TopkEpoch>& epochs, Select select) {
  double sum = 0;
  size_t n = 0;
  for (const TopkEpoch& e : epochs)
    if (select(e)) sum += std::log(e.ratio), ++n;
  return n ? std::exp(sum / static_cast<double>(n)) : 1.0;
}

BOOST_AUTO_TEST_CASE(topk_predictions_follow_the_residuals_growth) {
  ControllerSettings settings = small_schedule(20, 20, 4, 2);
  settings.schedule.probe_lead = 6;
  const std::vector<std::vector<uint32_t>> forced{{1, 0}, {0, 0}, {0, 1}, {0, 2}, {2, 0}, {0, 0}, {1, 1}, {1, 0}};
  const std::vector<TopkEpoch> epochs = run_forced_topk(settings, forced);
  const std::string trace = trace_of(epochs);
  BOOST_TEST_MESSAGE("TopK realized / predicted per epoch:" << trace);
  BOOST_TEST(epochs.size() >= 2 * (forced.size() - 1));
  // Per density over its layer-epochs (the demo's criterion), the geometric mean within
  // 15%; a single epoch of the heavy-tailed layer within [0.7, 1.35].
  BOOST_TEST_CONTEXT("realized / predicted per epoch:" << trace) {
    for (const TopkEpoch& e : epochs)
      BOOST_TEST((e.ratio >= 0.7 && e.ratio <= 1.35), "epoch " << e.epoch << " layer " << e.layer << ": " << e.ratio);
    for (uint32_t c = 0; c < 3; ++c) {
      const double mean = geometric_mean(epochs, [&](const TopkEpoch& e) { return e.to == c; });
      BOOST_TEST((mean >= 0.85 && mean <= 1.15), "density index " << c << ": " << mean);
    }
  }
}

// The demo's schedule (5-step epochs from 2-step windows, switch lag 2): a TopK state is
// young at every switch, and from the window to the switch it goes on piling up under the
// density in effect for 2.5 steps, a large share of its age. Moves between densities must
// be predicted from the state the switch hands over (Controller::state_growth_to_switch).
// Measured at the window, they realized 1.15-1.45 of their prediction in the demo; here
// (seeds 1-10) the moves' geometric mean was 1.078-1.096 and single moves reached
// 1.32-1.42; from the state at the switch 0.999-1.012, single moves at most 1.14-1.20.
BOOST_AUTO_TEST_CASE(topk_moves_are_predicted_from_the_state_at_the_switch) {
  ControllerSettings settings = small_schedule(5, 5, 2, 2);
  settings.schedule.probe_lead = 10;
  const std::vector<std::vector<uint32_t>> forced{{0, 0}, {1, 1}, {0, 1}, {1, 0}, {1, 1}, {0, 0},
                                                  {0, 1}, {1, 1}, {1, 0}, {0, 0}, {1, 1}, {0, 1}};
  const std::vector<TopkEpoch> epochs = run_forced_topk(settings, forced);
  const std::string trace = trace_of(epochs);
  BOOST_TEST_MESSAGE("TopK realized / predicted per epoch:" << trace);
  BOOST_TEST_CONTEXT("realized / predicted per epoch:" << trace) {
    const auto between_sparse = [](const TopkEpoch& e) { return e.from != 2 && e.epoch > 1; };
    const double moves =
        geometric_mean(epochs, [&](const TopkEpoch& e) { return between_sparse(e) && e.from != e.to; });
    const double stays =
        geometric_mean(epochs, [&](const TopkEpoch& e) { return between_sparse(e) && e.from == e.to; });
    BOOST_TEST((moves >= 0.94 && moves <= 1.05), "moves between 0.2% and 1%: " << moves);
    for (const TopkEpoch& e : epochs)
      if (between_sparse(e) && e.from != e.to)
        BOOST_TEST(e.ratio <= 1.28, "epoch " << e.epoch << " layer " << e.layer << ": " << e.ratio);
    BOOST_TEST((stays >= 0.85 && stays <= 1.15), "stays at 0.2% or 1%: " << stays);
  }
}

// The loop's window lies late in the epoch. A TopK layer's error rises through the epoch,
// so the window reads above the epoch's mean, and above the budget that the epoch's mean
// meets. The loop must judge the epoch's overspend by the window carried to the epoch
// (the forecast's own shape), not the window's raw reading: the demo's first TopK epoch
// realized 0.99 of the uniform run's error, its window 1.20 of the budget, and alpha_eff
// went to 0.84. Here: one layer moved from 4 bits to TopK, whose error grows linearly (its
// shadow 4.5x its fresh error at age 4.5), forecast at 6 over the epoch and 7 over the
// window's steps; another at 8 bits; the budget 6.5; the window realizes 1.04x its
// forecast. alpha_eff must be 1 / 1.04 (the bias), not 6.5 / 7.3 (the code before: 0.890).
BOOST_AUTO_TEST_CASE(the_loop_judges_the_epoch_not_the_late_window) {
  const uint64_t numel = 1 << 16;
  Layer rising{"rising", numel, 0, {}}, settled{"settled", numel, 0, {}};
  rising.candidates = {{"quant:bits=4", tools::quant_encoded_bytes(numel, 4), 0},
                       {"topk:density=0.001", static_cast<uint64_t>(8 * 0.001 * numel), 0}};
  settled.candidates = {{"quant:bits=4", tools::quant_encoded_bytes(numel, 4), 0},
                        {"quant:bits=8", tools::quant_encoded_bytes(numel, 8), 0}};
  const std::vector<Layer> layers{rising, settled};
  ControllerSettings settings = small_schedule(5, 5, 2, 2);  // the demo's
  settings.schedule.probe_lead = 10;
  Controller controller(settings, layers, [](const Problem&, const controller::SolverOptions&) {
    controller::Solution s;
    s.choices = {1, 1};  // TopK, 8 bits
    return s;
  });
  const double a4 = 0.5, b4 = 6.0, b8 = b4 / 289;  // 4 and 8 bits: (2^bits - 1)^-2
  const double bias = 1.04;
  const auto add = [&](ErrorStats& stats, size_t layer, std::vector<double> errors, std::vector<double> shadow,
                       std::vector<double> current, double realized) {
    ErrorStats::Sample sample;
    sample.measured = errors, sample.reference = errors, sample.simulated = shadow, sample.current = current;
    sample.realized = realized, sample.magnitude = 100;
    BOOST_TEST_REQUIRE(stats.add(layer, sample));
  };
  ErrorStats stats = controller.new_stats();
  for (uint64_t step = 3; step <= 4; ++step) {  // the first window; the shadows from step 0
    const double age = static_cast<double>(step + 1);
    add(stats, 0, {a4, 2.0}, {a4, 2.0 * age}, {a4, 2.0}, a4);
    add(stats, 1, {b4, b8}, {b4, b8}, {b4, b8}, b4);
  }
  controller.submit(4, stats);
  const auto first = controller.assignment_for_step(6);
  BOOST_TEST_REQUIRE(first->epoch == 1u);
  BOOST_TEST(first->predicted[0] == 6.0, boost::test_tools::tolerance(1e-6));  // 2 (t + 1), t = 0..4
  BOOST_TEST(first->alpha_eff == 1.0);
  stats.clear();
  for (uint64_t step = 8; step <= 9; ++step) {  // TopK's steps 3 and 4 after the switch: 6, 8
    const double age = static_cast<double>(step + 1), held = static_cast<double>(step - 5);
    add(stats, 0, {a4, 2.0}, {a4, 2.0 * age}, {a4, 2.0 * held}, bias * 2.0 * held);
    add(stats, 1, {b4, b8}, {b4, b8}, {b4, b8}, bias * b8);
  }
  controller.submit(9, stats);
  const auto second = controller.assignment_for_step(11);
  BOOST_TEST_REQUIRE(second->epoch == 2u);
  BOOST_TEST(second->alpha_eff == 1 / bias, boost::test_tools::tolerance(1e-3));
}

// The first solve has no window before it: its drift compares the window's magnitude
// with its lead's (Schedule::first_lead_middle), as a power of the step carried to the
// epoch's middle; without lead magnitudes none.
BOOST_AUTO_TEST_CASE(the_first_solve_takes_its_drift_from_the_windows_lead) {
  const auto layers = make_layers(3);
  ControllerSettings settings = small_schedule(20, 10, 4, 2);
  settings.schedule.probe_lead = 6;  // lead 10..15, window 16..19, epoch 21..30
  for (bool lead : {true, false}) {
    Controller controller(settings, layers);
    ErrorStats stats = controller.new_stats();
    std::mt19937_64 rng(test::run_seed());
    const std::vector<double> before = {100, 50, 10, 1}, now = {80, 55, 10, 1};  // per layer
    for (uint64_t step = 10; step < 20; ++step) {
      if (controller.schedule().leads_first_window(step) && lead)
        for (size_t l = 0; l < layers.size(); ++l) stats.add_lead(l, before[l], true);
      if (!controller.schedule().measures(step)) continue;
      for (size_t l = 0; l < layers.size(); ++l) {
        std::vector<double> e(layers[l].candidates.size(), 1.0);
        ErrorStats::Sample sample;
        sample.measured = e;
        sample.magnitude = now[l];
        stats.add(l, sample);
      }
    }
    controller.submit(19, stats);
    const auto a = controller.assignment_for_step(21);
    BOOST_TEST_REQUIRE(a->epoch == 1u);
    BOOST_TEST_REQUIRE(a->drift.size() == layers.size());
    const double t0 = 13.5, t1 = 18.5, t2 = 20 + 2 + 4.5;  // counted from 1
    const double h = std::log(t2 / t1) / std::log(t1 / t0);
    for (size_t l = 0; l < layers.size(); ++l) {
      const double want = lead ? std::pow((now[l] / before[l]) * (now[l] / before[l]), h) : 1.0;
      BOOST_TEST(a->drift[l] == want, boost::test_tools::tolerance(1e-12));
    }
  }
}

// A quantizer's errors, the default's (the budget) and the other candidates', rest on
// their error per unit of gradient energy pooled over windows of 8 steps at least, those
// that ended within the last 16 (controller.cc, record_pools): a short window of
// heavy-tailed gradients reads them with much noise (the demo, window 2: its epochs'
// uniform error realized 0.90-1.07 of the window's own estimate), and the solve spends
// what the noise adds. Each window here reads the errors per energy times a noise factor
// of up to 1.5 while the energy grows; every solve's budget and prediction must be the
// pooled ones, times the drift (and the solve's budget alpha x their sum), and a window of
// 8 steps its own.
// A layer's candidates' errors, where candidate c has 4 << c levels and errs `error` at
// c = 2 (15 levels), scaled by the squared step size; a single-candidate layer errs 0.
std::vector<double> quantizer_errors(const Layer& layer, double error) {
  std::vector<double> e;
  for (uint32_t c = 0; c < layer.candidates.size(); ++c) {
    const double levels = static_cast<double>((4u << c) - 1);
    e.push_back(layer.candidates.size() == 1 ? 0.0 : error * (15 / levels) * (15 / levels));
  }
  return e;
}

// A sample of those errors and the gradient's magnitude.
ErrorStats::Sample quantizer_sample(std::span<const double> errors, double magnitude) {
  ErrorStats::Sample sample;
  sample.measured = errors;
  sample.magnitude = magnitude;
  return sample;
}

BOOST_AUTO_TEST_CASE(quantizers_errors_are_pooled_over_short_windows) {
  const auto layers = make_layers(3);
  const std::vector<double> noise = {1.5, 0.6, 1.3, 0.8, 1.1, 0.7, 1.4, 0.9};
  for (const uint64_t window : {2, 8}) {
    const ControllerSettings settings = small_schedule(5 + window, 5 + window, window, 2);
    Controller controller(settings, layers);
    std::mt19937_64 rng(test::run_seed());
    std::uniform_real_distribution<double> jitter(0.9, 1.1);
    std::vector<double> base;  // per layer: the default's error per unit of energy
    for (size_t l = 0; l < layers.size(); ++l) base.push_back(jitter(rng) * static_cast<double>(1 + l));
    // Per layer, the windows so far: the default's error and the energy.
    struct Window {
      double error, energy;
    };
    std::vector<std::vector<Window>> history(layers.size());
    // The pool's factor for layer l in window k: its last `pooled` windows that ended
    // within 16 steps of it (every candidate's errors are the default's times one factor
    // per width, so one pool says it for all).
    const size_t pooled = static_cast<size_t>((8 + window - 1) / window);
    const uint64_t period = settings.schedule.period;
    const auto factor = [&](size_t l, size_t k) {
      double error = 0, energy = 0;
      for (size_t j = k, n = 0; n < pooled && (k - j) * period < 16; --j, ++n) {
        error += history[l][j].error, energy += history[l][j].energy;
        if (j == 0) break;
      }
      return error / energy * history[l][k].energy / history[l][k].error;
    };
    ErrorStats stats = controller.new_stats();
    size_t windows = 0, pooled_checks = 0;
    uint64_t epochs_checked = 0;
    for (uint64_t step = 0; windows < noise.size(); ++step) {
      const auto a = controller.assignment_for_step(step);
      if (a->epoch > epochs_checked) {
        // Solved from window a->epoch - 1 (counted from 0).
        epochs_checked = a->epoch;
        const size_t k = static_cast<size_t>(a->epoch) - 1;
        BOOST_TEST_REQUIRE(a->budget.size() == layers.size());
        double sum = 0;
        for (size_t l = 0; l + 1 < layers.size(); ++l) {
          const uint32_t c = a->choices[l];
          const double own = history[l][k].error * a->drift[l], f = factor(l, k);
          BOOST_TEST(a->budget[l] == own * f, boost::test_tools::tolerance(1e-9));
          // The chosen candidate's error is the default's times its width's factor (settled,
          // no transient), pooled alike.
          const double levels = static_cast<double>((4u << c) - 1);
          BOOST_TEST(a->predicted[l] == own * (15 / levels) * (15 / levels) * f, boost::test_tools::tolerance(1e-9));
          // (The noise sets a pool apart from the window's own estimate.)
          if (std::abs(f - 1) > 0.05) ++pooled_checks;
          if (window >= 8) BOOST_TEST(f == 1.0, boost::test_tools::tolerance(1e-12));
          sum += a->budget[l];
        }
        BOOST_TEST(a->solution.budget == a->alpha_eff * sum, boost::test_tools::tolerance(1e-9));
      }
      if (!controller.schedule().measures(step)) continue;
      const size_t k = windows;
      for (size_t l = 0; l < layers.size(); ++l) {
        const double magnitude = 100.0 * (1 + l) * (1 + 0.2 * static_cast<double>(k));
        const std::vector<double> e = quantizer_errors(layers[l], noise[k] * base[l] * magnitude * magnitude);
        stats.add(l, quantizer_sample(e, magnitude));
        if (history[l].size() == k) history[l].push_back({e.size() > 1 ? e[2] : 0.0, magnitude * magnitude});
      }
      if (controller.schedule().window_ends(step)) {
        controller.submit(step, stats);
        stats.clear();
        ++windows;
      }
    }
    BOOST_TEST(epochs_checked + 1 >= noise.size());
    if (window < 8) BOOST_TEST(pooled_checks >= 6u);
  }
}

// A window of 2 steps every 5 sees 2 of them; its lead's steps (the probe's from the last
// window on) join the quantizers' pools (Controller::pools_lead, record_pools): each
// solve's budget must be the window's default error times the drift times the pool of the
// newest leads and windows that measured 8 steps within 16, each weighed by its steps; the
// first window's lead (before `warmup`, young shadows) is never submitted.
BOOST_AUTO_TEST_CASE(the_leads_steps_join_the_quantizers_pools) {
  const auto layers = make_layers(3);
  const ControllerSettings settings = small_schedule(5, 5, 2, 2);
  Controller controller(settings, layers);
  BOOST_TEST(controller.pools_lead());
  BOOST_TEST(!Controller(small_schedule(20, 20, 8, 2), layers).pools_lead());  // a long window: its own pool
  BOOST_TEST(!Controller(small_schedule(20, 20, 2, 2), layers).pools_lead());  // 8 steps unprobed per period
  BOOST_TEST(Controller(small_schedule(20, 12, 2, 2), layers).pools_lead());   // the lead of 10 fills it
  std::mt19937_64 rng(test::run_seed());
  std::uniform_real_distribution<double> noise(0.6, 1.5), jitter(0.9, 1.1);
  std::vector<double> base;
  for (size_t l = 0; l < layers.size(); ++l) base.push_back(jitter(rng) * static_cast<double>(1 + l));
  struct Point {
    double error, energy;
    uint64_t steps, last;
  };
  std::vector<std::vector<Point>> points(layers.size());        // as submitted, leads before windows
  std::vector<std::vector<Point>> windows_only(layers.size());  // the windows alone
  std::vector<std::vector<double>> expected(layers.size());     // per window: the pool's factor
  std::vector<double> window_error(layers.size());
  ErrorStats stats = controller.new_stats(), lead = controller.new_stats();
  uint64_t epochs_checked = 0;
  size_t lead_mattered = 0, windows = 0;
  for (uint64_t step = 0; windows < 8; ++step) {
    const auto a = controller.assignment_for_step(step);
    if (a->epoch > epochs_checked) {
      epochs_checked = a->epoch;
      const size_t k = static_cast<size_t>(a->epoch) - 1;
      for (size_t l = 0; l + 1 < layers.size(); ++l)
        BOOST_TEST(a->budget[l] == window_error[l] * a->drift[l] * expected[l][k], boost::test_tools::tolerance(1e-9));
    }
    const bool measures = controller.schedule().measures(step);
    if (!measures && step < settings.schedule.warmup) continue;  // the first window's lead: not pooled
    ErrorStats& into = measures ? stats : lead;
    for (size_t l = 0; l < layers.size(); ++l) {
      const double magnitude = 100.0 * (1 + l) * (1 + 0.05 * static_cast<double>(step));
      const std::vector<double> e = quantizer_errors(layers[l], noise(rng) * base[l] * magnitude * magnitude);
      into.add(l, quantizer_sample(e, magnitude));
    }
    if (!controller.schedule().window_ends(step)) continue;
    for (size_t l = 0; l + 1 < layers.size(); ++l) {
      const auto point = [](const ErrorStats& s, size_t layer, uint64_t last) {
        const double m = s.magnitude_mean(layer);
        return Point{s.mean(layer, 2), m * m, s.samples(layer), last};
      };
      // The pool's factor: the newest points that measured 8 steps, within 16 steps.
      const auto factor = [step](std::vector<Point>& p) {
        uint64_t steps = 0;
        for (const Point& x : p) steps += x.steps;
        while (p.size() > 1 && (steps - p.front().steps >= 8 || step - p.front().last >= 16))
          steps -= p.front().steps, p.erase(p.begin());
        if (p.size() < 2) return 1.0;
        double errors = 0, energies = 0;
        for (const Point& x : p)
          errors += static_cast<double>(x.steps) * x.error, energies += static_cast<double>(x.steps) * x.energy;
        return errors / energies * p.back().energy / p.back().error;
      };
      if (lead.samples(l) > 0) points[l].push_back(point(lead, l, step - 2));
      points[l].push_back(point(stats, l, step));
      windows_only[l].push_back(point(stats, l, step));
      window_error[l] = stats.mean(l, 2);
      const double f = factor(points[l]);
      expected[l].push_back(f);
      if (std::abs(f / factor(windows_only[l]) - 1) > 0.02) ++lead_mattered;  // without the leads it would differ
    }
    controller.submit(step, stats, std::nullopt, lead);
    stats.clear();
    lead.clear();
    ++windows;
  }
  BOOST_TEST(epochs_checked + 1 >= windows);
  BOOST_TEST(lead_mattered >= 6u);
}

// A TopK layer whose shadow has settled (its error barely above the gradient alone's)
// while its real state holds far more: the growth curve is flat past the shadow's age and
// cannot reach the state's error. The prediction must stay finite (it overflowed to inf,
// and the solve failed), and be the state's error: a settled TopK keeps what it holds.
BOOST_AUTO_TEST_CASE(a_settled_topk_layer_is_predicted_at_its_real_state) {
  Layer layer{"w", 8192, 0, {}};
  for (double d : {0.01, 0.001})
    layer.candidates.push_back({"topk:density=" + std::to_string(d), static_cast<uint64_t>(8 * d * 8192), 0});
  ControllerSettings settings = small_schedule(20, 10, 4, 2);
  settings.schedule.probe_lead = 6;
  settings.budget_loop = false;
  Controller controller(settings, {layer});
  ErrorStats stats = controller.new_stats();
  const std::vector<double> fresh = {1.0, 2.0}, shadow = {1.0001, 2.0002}, current = {50.0, 60.0};
  for (uint64_t step = 16; step < 20; ++step) {
    ErrorStats::Sample sample;
    sample.measured = fresh, sample.reference = fresh, sample.simulated = shadow, sample.current = current;
    sample.realized = 50.0, sample.magnitude = 100;
    stats.add(0, sample);
  }
  controller.submit(19, stats);
  const auto a = controller.assignment_for_step(21);
  BOOST_TEST(controller.counters().failed_solves == 0u);
  BOOST_TEST_REQUIRE(a->epoch == 1u);
  BOOST_TEST_REQUIRE(a->predicted.size() == 1u);
  BOOST_TEST(std::isfinite(a->predicted[0]));
  if (a->choices[0] == 0) BOOST_TEST(a->predicted[0] == 50.0, boost::test_tools::tolerance(0.01));
}

// A solver that blocks until released, to stand for a slow solve.
struct GatedSolver {
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  Controller::SolveFunction function() {
    auto open = opened;
    return [open](const Problem& p, const controller::SolverOptions& o) {
      open.wait();
      return controller::solve(p, o);
    };
  }
};

BOOST_AUTO_TEST_CASE(training_path_waits_only_when_the_switch_step_arrives_first) {
  const auto layers = make_layers(4);
  GatedSolver solver;
  Controller c(small_schedule(2, 10, 1, 3), layers, solver.function());
  std::mt19937_64 rng(test::run_seed());
  ErrorStats stats = c.new_stats();
  BOOST_TEST(c.schedule().measures(1));
  add_samples(stats, layers, rng);
  BOOST_TEST(c.schedule().window_ends(1));
  c.submit(1, stats);  // effective at step 4; the solve is held at the gate

  // Steps before the switch return at once with the defaults, solve or no solve.
  for (uint64_t step : {2, 3}) {
    auto before = std::async(std::launch::async, [&c, step] { return c.assignment_for_step(step); });
    BOOST_REQUIRE(before.wait_for(10s) == std::future_status::ready);
    BOOST_TEST(before.get()->epoch == 0u);
  }
  auto at_switch = std::async(std::launch::async, [&c] { return c.assignment_for_step(4); });
  BOOST_TEST((at_switch.wait_for(100ms) == std::future_status::timeout));  // waiting for the solve
  solver.gate.set_value();
  BOOST_REQUIRE(at_switch.wait_for(10s) == std::future_status::ready);
  const auto a = at_switch.get();
  BOOST_TEST(a->epoch == 1u);
  BOOST_TEST(a->effective_step == 4u);
  const auto counters = c.counters();
  BOOST_TEST(counters.waits == 1u);
  BOOST_TEST(counters.wait_ms >= 50.0);
}

BOOST_AUTO_TEST_CASE(no_wait_when_the_solve_finishes_first) {
  const auto layers = make_layers(4);
  Controller c(small_schedule(2, 10, 1, 3), layers);
  std::mt19937_64 rng(test::run_seed());
  ErrorStats stats = c.new_stats();
  add_samples(stats, layers, rng);
  c.submit(1, stats);
  BOOST_REQUIRE(test::eventually([&] { return c.counters().solves == 1; }, std::chrono::seconds(10)));
  BOOST_TEST(c.assignment_for_step(3)->epoch == 0u);
  BOOST_TEST(c.assignment_for_step(4)->epoch == 1u);
  BOOST_TEST(c.counters().waits == 0u);
}

BOOST_AUTO_TEST_CASE(a_failed_solve_keeps_the_current_assignment) {
  const auto layers = make_layers(3);
  int calls = 0;
  Controller c(small_schedule(2, 4, 1, 1), layers, [&calls](const Problem& p, const controller::SolverOptions& o) {
    if (++calls == 1) throw std::runtime_error("injected failure");
    return controller::solve(p, o);
  });
  std::mt19937_64 rng(test::run_seed());
  ErrorStats stats = c.new_stats();
  add_samples(stats, layers, rng);
  c.submit(1, stats);
  BOOST_TEST(c.assignment_for_step(2)->epoch == 0u);  // waits for the (failing) solve
  BOOST_TEST(c.counters().failed_solves == 1u);
  c.submit(5, stats);
  BOOST_TEST(c.assignment_for_step(6)->epoch == 2u);
}

BOOST_AUTO_TEST_CASE(a_layer_without_samples_keeps_its_default) {
  auto layers = make_layers(3);
  Controller c(small_schedule(2, 4, 1, 1), layers);
  std::mt19937_64 rng(test::run_seed());
  ErrorStats all = c.new_stats();
  add_samples(all, layers, rng);
  ErrorStats partial = c.new_stats();  // layer 1 every sample overflowed
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<double> e(layers[l].candidates.size());
    for (uint32_t k = 0; k < e.size(); ++k) e[k] = l == 1 ? std::nan("") : all.mean(l, k);
    partial.add(l, e);
  }
  c.submit(1, partial);
  const auto a = c.assignment_for_step(2);
  BOOST_TEST(a->epoch == 1u);
  BOOST_TEST(a->choices[1] == layers[1].default_index);
  BOOST_TEST(a->predicted[1] == 0.0);  // nothing measured, nothing predicted
  BOOST_TEST(a->predicted[0] > 0.0);
}

// At alpha >= 1 the defaults meet the budget by definition (it is their own error), so no
// epoch sends more than they would: a solve that answers with a dearer assignment (as the
// closed loop's alpha_eff < 1 can make it, or a solver as here) gives way to them, and the
// decision log says so. Under alpha < 1 the user asked for less error than theirs: the
// dearer answer stands.
BOOST_AUTO_TEST_CASE(no_epoch_sends_more_than_the_defaults_at_alpha_one) {
  const auto layers = make_layers(4);
  // Every layer at its last candidate (8 bits): less error than the defaults, more bytes.
  const auto widest = [](const Problem& p, const controller::SolverOptions& o) {
    controller::Solution s = controller::solve(p, o);
    s.bytes = 0, s.error = 0;
    for (size_t l = 0; l < p.layers.size(); ++l) {
      s.choices[l] = static_cast<uint32_t>(p.layers[l].candidates.size() - 1);
      s.bytes += p.layers[l].candidates[s.choices[l]].bytes;
      s.error += p.layers[l].candidates[s.choices[l]].error;
    }
    s.cost = static_cast<double>(s.bytes);
    return s;
  };
  for (double alpha : {1.0, 0.5}) {
    BOOST_TEST_CONTEXT("alpha " << alpha) {
      test::TempDir dir;
      ControllerSettings settings = small_schedule(2, 4, 1, 1);
      settings.alpha = alpha;
      settings.decision_log_path = dir.file("decisions.jsonl");
      std::shared_ptr<const Assignment> a;
      {
        Controller c(settings, layers, widest);
        std::mt19937_64 rng(test::run_seed());
        ErrorStats stats = c.new_stats();
        add_samples(stats, layers, rng);
        c.submit(1, stats);
        a = c.assignment_for_step(2);
      }
      BOOST_TEST_REQUIRE(a->epoch == 1u);
      const bool keep = alpha >= 1;
      BOOST_TEST(a->kept_defaults == keep);
      for (size_t l = 0; l + 1 < layers.size(); ++l)
        BOOST_TEST(a->choices[l] == (keep ? layers[l].default_index : layers[l].candidates.size() - 1));
      BOOST_TEST((a->solution.bytes == a->solution.default_bytes) == keep);
      BOOST_TEST((a->solution.bytes > a->solution.default_bytes) == !keep);
      std::ifstream in(settings.decision_log_path);
      std::string line;
      BOOST_TEST_REQUIRE(static_cast<bool>(std::getline(in, line)));
      const auto d = nlohmann::json::parse(line);
      BOOST_TEST(d.at("kept_defaults").get<bool>() == keep);
      BOOST_TEST(d.at("bytes").get<uint64_t>() == a->solution.bytes);
      BOOST_TEST(d.at("layers")[0].at("codec").get<std::string>() == (keep ? "quant:bits=4" : "quant:bits=8"));
    }
  }
}

BOOST_AUTO_TEST_CASE(decision_log_has_one_json_line_per_epoch) {
  const auto layers = make_layers(5);
  test::TempDir dir;
  ControllerSettings settings = small_schedule(3, 5, 2, 2);
  settings.decision_log_path = dir.file("decisions.jsonl");
  {
    Controller c(settings, layers);
    std::mt19937_64 rng(test::run_seed());
    ErrorStats stats = c.new_stats();
    for (uint64_t step = 0; step < 15; ++step) {  // through the third switch, at 14
      c.assignment_for_step(step);
      if (c.schedule().measures(step)) add_samples(stats, layers, rng);
      if (c.schedule().window_ends(step)) {
        c.submit(step, stats);
        stats.clear();
      }
    }
  }  // destroyed: joined, log closed
  std::ifstream in(settings.decision_log_path);
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  BOOST_REQUIRE_EQUAL(lines.size(), 3u);  // windows ending at 2, 7, 12
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& d = lines[i];
    BOOST_TEST(d.at("epoch").get<uint64_t>() == i + 1);
    BOOST_TEST(d.at("stats_last_step").get<uint64_t>() == 2 + 5 * i);
    BOOST_TEST(d.at("effective_step").get<uint64_t>() == 4 + 5 * i);
    BOOST_TEST(d.at("samples").get<uint64_t>() == 2u);
    BOOST_TEST(d.at("feasible").get<bool>());
    BOOST_TEST(d.at("error").get<double>() <= d.at("budget").get<double>());
    BOOST_TEST(d.at("bytes").get<uint64_t>() <= d.at("default_bytes").get<uint64_t>());
    BOOST_TEST(d.at("solve_ms").get<double>() >= 0.0);
    BOOST_REQUIRE_EQUAL(d.at("layers").size(), layers.size());
    BOOST_TEST(d.at("layers")[5].at("codec").get<std::string>() == "none");
  }
}

BOOST_AUTO_TEST_CASE(nothing_on_the_solver_thread_can_end_the_process) {
  // A layer name that is not UTF-8 once made the decision log's JSON throw on the solver
  // thread, which ended the process.
  auto layers = make_layers(2);
  layers[0].name = "conv\xff";
  test::TempDir dir;
  ControllerSettings settings = small_schedule(2, 4, 1, 1);
  settings.decision_log_path = dir.file("log.jsonl");
  {
    Controller c(settings, layers);
    std::mt19937_64 rng(test::run_seed());
    ErrorStats stats = c.new_stats();
    add_samples(stats, layers, rng);
    c.submit(1, stats);
    BOOST_TEST(c.assignment_for_step(2)->epoch == 1u);
  }
  std::ifstream in(settings.decision_log_path);
  std::string line;
  BOOST_REQUIRE(std::getline(in, line));
  BOOST_TEST(nlohmann::json::parse(line).at("layers")[0].at("name").get<std::string>() == "conv\xef\xbf\xbd");
  // A replacement solver throwing something that is not a std::exception.
  Controller c(small_schedule(2, 4, 1, 1), make_layers(2),
               [](const Problem&, const controller::SolverOptions&) -> controller::Solution { throw 42; });
  c.submit(1, c.new_stats());
  BOOST_TEST(c.assignment_for_step(2)->epoch == 0u);
  BOOST_TEST(c.counters().failed_solves == 1u);
}

BOOST_AUTO_TEST_CASE(stop_joins_the_thread_and_later_calls_do_not_hang) {
  const size_t before = thread_count();
  const auto layers = make_layers(2);
  {
    Controller c(small_schedule(2, 4, 1, 1), layers);
    BOOST_TEST(thread_count() == before + 1);
    c.stop();
    c.stop();  // idempotent
    BOOST_TEST(thread_count() == before);
    ErrorStats stats = c.new_stats();
    c.submit(1, stats);
    auto after = std::async(std::launch::async, [&c] { return c.assignment_for_step(2); });
    BOOST_REQUIRE(after.wait_for(10s) == std::future_status::ready);
    BOOST_TEST(after.get()->epoch == 0u);
  }
  {
    Controller c(small_schedule(2, 4, 1, 1), layers);
    ErrorStats stats = c.new_stats();
    c.submit(1, stats);  // destroyed with a job queued or running
  }
  BOOST_TEST(thread_count() == before);
}

BOOST_AUTO_TEST_CASE(invalid_use_is_reported) {
  const auto layers = make_layers(2);
  BOOST_CHECK_THROW(Controller(small_schedule(1, 4, 1, 1), layers), std::invalid_argument);
  auto bad = layers;
  bad[0].default_index = 9;
  BOOST_CHECK_THROW(Controller(small_schedule(2, 4, 1, 1), bad), controller::ProblemError);
  Controller c(small_schedule(2, 4, 1, 1), layers);
  BOOST_CHECK_THROW(c.submit(2, c.new_stats()), std::invalid_argument);  // not a window end
  BOOST_CHECK_THROW(c.submit(1, ErrorStats({7}, controller::ErrorMetric::kSquaredL2)), std::invalid_argument);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
