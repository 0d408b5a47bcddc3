#include "controller/controller.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "config/log.h"
#include "controller/problem_json.h"
#include "kernels/codec_spec.h"

namespace lgreco::controller {

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

unsigned long long ull(uint64_t v) { return v; }

// Every layer at its default, with the totals of `solved` (the same problem's).
Solution defaults_of(const Problem& problem, const Solution& solved) {
  Solution s;
  for (const Layer& layer : problem.layers) s.choices.push_back(layer.default_index);
  s.cost = s.default_cost = solved.default_cost;
  s.bytes = s.default_bytes = solved.default_bytes;
  s.error = s.default_error = solved.default_error;
  s.budget = solved.budget;
  s.lower_bound = s.cost;  // nothing was searched: the gap is 0, not a proof
  return s;
}

// The layers as a problem: validates names, defaults, counts and the placeholder
// errors (finite, >= 0) once; the statistics replace the errors at every solve.
std::vector<Layer> validated(std::vector<Layer> layers, const ControllerSettings& settings) {
  Problem p;
  p.alpha = settings.alpha;
  p.objective = settings.objective;
  p.cost_model = settings.cost_model;
  p.layers = std::move(layers);
  validate(p);
  if (!(settings.solver.tolerance > 0) || settings.solver.max_table_cells == 0)
    throw std::invalid_argument("solver tolerance must be > 0 and its table cap > 0");
  return std::move(p.layers);
}

// 2^bits - 1 of a quantizer's spec (the layers' specs were validated when they were built).
double quant_levels(std::string_view spec) {
  return std::ldexp(1.0, CodecSpec::parse(spec).quant_params().bits) - 1;
}

// TopK and PowerSGD keep what they do not send in the residual, which piles up step after
// step; a quantizer's residual is one unit of its own width.
bool holds_values_back(std::string_view family) { return family == "topk" || family == "powersgd"; }

// The mean over n steps from step a of an error relaxing geometrically from `now` to
// `steady` at `rate` per step.
double relaxed_mean(double steady, double now, double rate, double a, double n) {
  if (!(rate < 1 - 1e-9)) return now;  // nothing relaxes
  return steady + (now - steady) * std::pow(rate, a) * (1 - std::pow(rate, n)) / (n * (1 - rate));
}

// TopK's error as a function of its residual's age k (steps of gradient it holds), fitted
// through its error on the gradient alone (k = 1) and its shadow's (k = A):
//   up to A, E(k) = fresh (1 - r^k) / (1 - r), a residual that keeps r of itself each step
//            (E(k + 1) = r E(k) + fresh), r fitted so that E(A) = steady;
//   beyond,  E(A) (k / A)^s, the power law of the curve's own slope at A: elements that
//            the codec seldom sends go on accumulating after the rest has settled, and
//            the shadow cannot tell for how long;
//   steady >= A fresh (unsent values that add up coherently): E(k) = fresh k^p through
//            both, p <= 2; without a shadow (or one a step old), linear, E(k) = fresh k.
struct TopkGrowth {
  double fresh, steady, age, rate = 1, slope = 1;
  bool geometric = false;
  TopkGrowth(double fresh_error, double steady_error, double shadow_age)
      : fresh(fresh_error), steady(steady_error), age(shadow_age) {
    if (!(age > 1.5 && steady > fresh)) {  // no growth measured: linear, the safe side
      age = 1, steady = fresh;
      return;
    }
    const double ratio = steady / fresh;
    if (ratio >= age * 0.999) {
      slope = std::min(2.0, std::log(ratio) / std::log(age));
      return;
    }
    double lo = 0, hi = 1;  // (1 - r^A) / (1 - r) rises with r from 1 to A
    for (int i = 0; i < 64; ++i) {
      const double r = (lo + hi) / 2;
      ((1 - std::pow(r, age)) / (1 - r) < ratio ? lo : hi) = r;
    }
    rate = std::max(lo, 1e-12), geometric = true;
    slope = age * -std::log(rate) * std::pow(rate, age) / (1 - std::pow(rate, age));
  }
  // Past the shadow's age the curve hardly rises: the codec has settled, and a state that
  // holds more than its shadow is not on the curve (the power law's inverse overflows).
  bool flat() const { return slope < 1e-3; }
  // Where the geometric part tends: fresh / (1 - rate) (infinite where it is not geometric).
  double ceiling() const { return geometric ? fresh / (1 - rate) : HUGE_VAL; }
  double at(double k) const {
    if (geometric && k <= age) return fresh * (1 - std::pow(rate, k)) / (1 - rate);
    return steady * std::pow(k / age, slope);
  }
  // The age at which it makes `error` (at least 1, at most e^40).
  double age_of(double error) const {
    if (error <= fresh) return 1;
    if (geometric && error <= steady) return std::max(1.0, std::log(1 - error * (1 - rate) / fresh) / std::log(rate));
    // Not flat(); bounded all the same (e^40 steps: beyond any run), so that at() is finite.
    return std::clamp(age * std::pow(error / steady, 1 / slope), 1.0, std::exp(40.0));
  }
};

}  // namespace

Controller::Controller(ControllerSettings settings, std::vector<Layer> layers, SolveFunction solve)
    : settings_(std::move(settings)),
      schedule_(settings_.schedule),
      layers_(validated(std::move(layers), settings_)),
      solve_(solve ? std::move(solve) : SolveFunction(&controller::solve)),
      alpha_eff_(settings_.alpha) {
  auto defaults = std::make_shared<Assignment>();
  for (const Layer& layer : layers_) defaults->choices.push_back(layer.default_index);
  in_effect_ = defaults->choices;
  last_magnitude_.assign(layers_.size(), 0.0);
  chosen_.resize(layers_.size());
  chosen_scale_.assign(layers_.size(), 1.0);
  chosen_defaults_.assign(layers_.size(), 0.0);
  pools_.resize(layers_.size());
  pool_factor_.resize(layers_.size());
  current_ = std::move(defaults);
  if (!settings_.decision_log_path.empty()) {
    decision_log_ = fopen(settings_.decision_log_path.c_str(), "a");
    if (!decision_log_)
      LGRECO_WARN("CTRL", "cannot open the decision log '%s': %s; decisions will not be logged",
                  settings_.decision_log_path.c_str(), strerror(errno));
  }
  thread_ = std::thread(&Controller::run, this);
  pthread_setname_np(thread_.native_handle(), "lgreco-ctrl");  // as top and gdb show it
}

Controller::~Controller() { stop(); }

void Controller::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    stopped_.store(true, std::memory_order_relaxed);
  }
  work_ready_.notify_all();
  result_ready_.notify_all();
  std::call_once(joined_, [this] {
    thread_.join();
    if (decision_log_) fclose(decision_log_);
    decision_log_ = nullptr;
  });
}

ErrorStats Controller::new_stats() const {
  std::vector<uint32_t> counts;
  for (const Layer& layer : layers_) counts.push_back(static_cast<uint32_t>(layer.candidates.size()));
  return ErrorStats(std::move(counts), settings_.metric);
}

Controller::Counters Controller::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

void Controller::submit(uint64_t window_last_step, ErrorStats aggregated, std::optional<CostModel> cost_model,
                        std::optional<ErrorStats> lead) {
  if (!schedule_.window_ends(window_last_step))
    throw std::invalid_argument("Controller::submit: step " + std::to_string(window_last_step) +
                                " does not end a measurement window");
  for (const ErrorStats* s : {&aggregated, lead ? &*lead : nullptr}) {
    if (!s) continue;
    if (s->layers() != layers_.size() || s->metric() != settings_.metric)
      throw std::invalid_argument("Controller::submit: statistics of another shape or metric");
    for (size_t l = 0; l < layers_.size(); ++l)
      if (s->candidates(l) != layers_[l].candidates.size())
        throw std::invalid_argument("Controller::submit: statistics of another shape (layer " + std::to_string(l) +
                                    ")");
  }
  const uint64_t epoch = ++submitted_;
  const uint64_t effective = schedule_.effective_step(window_last_step);
  switches_.emplace_back(epoch, effective);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(Job{epoch, window_last_step, effective, std::move(aggregated),
                        cost_model ? std::move(*cost_model) : settings_.cost_model, std::move(lead)});
  }
  work_ready_.notify_one();
}

std::shared_ptr<const Assignment> Controller::assignment_for_step(uint64_t step) {
  if (stopped_.load(std::memory_order_relaxed)) return current_;  // no switches after stop()
  while (!switches_.empty() && step >= switches_.front().second) {
    const uint64_t epoch = switches_.front().first;
    switches_.pop_front();
    std::unique_lock<std::mutex> lock(mutex_);
    if (results_.empty()) {
      if (stopping_) continue;  // no solver any more: keep the current assignment
      const auto start = std::chrono::steady_clock::now();
      result_ready_.wait(lock, [this] { return stopping_ || !results_.empty(); });
      const double waited = ms_since(start);
      ++counters_.waits;
      counters_.wait_ms += waited;
      if (!warned_wait_) {
        warned_wait_ = true;
        LGRECO_WARN("CTRL",
                    "step %llu waited %.2f ms for the solve of epoch %llu; raise the switch lag (now %llu steps) "
                    "to keep solving off the training path",
                    ull(step), waited, ull(epoch), ull(schedule_.settings().switch_lag));
      } else {
        LGRECO_INFO("CTRL", "step %llu waited %.2f ms for the solve of epoch %llu", ull(step), waited, ull(epoch));
      }
      if (results_.empty()) continue;
    }
    Result result = std::move(results_.front());
    results_.pop_front();
    lock.unlock();
    if (result.epoch != epoch) throw std::logic_error("controller results out of order");
    if (result.assignment) current_ = std::move(result.assignment);
  }
  return current_;
}

void Controller::run() {
  for (;;) {
    std::optional<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (stopping_) return;
      job.emplace(std::move(jobs_.front()));
      jobs_.pop_front();
    }
    std::shared_ptr<const Assignment> assignment = solve_job(*job);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Counted where the result is published, so that a reader who sees the count also
      // finds the result (assignment_for_step does not wait for it).
      if (assignment)
        ++counters_.solves;
      else
        ++counters_.failed_solves;
      results_.push_back(Result{job->epoch, std::move(assignment)});
    }
    result_ready_.notify_all();
  }
}

WindowReading Controller::read_window(const ErrorStats& stats) const {
  WindowReading r;
  double defaults = 0;
  // The layers the last solve predicted: its prediction, the defaults' error as it
  // forecast them, and the defaults' error as this window measured them.
  double forecast = 0, defaults_forecast = 0, defaults_now = 0;
  // The same prediction over the whole epoch, and for the layers without one.
  double epoch_forecast = 0, unforecast = 0;
  const std::vector<double> weight = weights_of(stats);
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (stats.samples(l) == 0 || weight[l] == 0) continue;
    const double w = weight[l];
    const double default_now = stats.mean(l, layers_[l].default_index);
    r.realized += w * realized_of(stats, l);
    defaults += w * default_now * pool_factor(l, layers_[l].default_index);
    // What the solve that chose the assignment in effect predicted for it (the defaults'
    // estimate in this window before the first solve).
    // Its error over the window's steps, which lie late in the epoch: a transient's rise
    // or fall is mostly done there (comparing with the epoch's mean would read a TopK
    // epoch's rise as the model's bias).
    if (!chosen_[l]) {
      unforecast += w * stats.mean(l, in_effect_[l]);
      continue;
    }
    const ScheduleSettings& s = settings_.schedule;
    forecast += mean_error(*chosen_[l], s.period - s.window - s.switch_lag + 1, s.window) * chosen_scale_[l];
    epoch_forecast += mean_error(*chosen_[l], 0, s.period) * chosen_scale_[l];
    defaults_forecast += chosen_defaults_[l] * chosen_scale_[l];
    defaults_now += w * default_now;
  }
  // The forecast re-anchored to this window: scaled by how the defaults' error, measured
  // here on the same gradients, differs from what the solve forecast for them. The windows
  // are an epoch apart, and real training's gradients change their scale and shape between
  // them by more than the drift's trend foresees (the quick char_lm run: the defaults' own
  // error read 0.38-2.34x the forecast); a bias measured against the raw forecast reads
  // that as the model's error and lowers alpha_eff for nothing. The ratio of the two
  // windows' defaults takes the gradients' change out; what is left is the model's.
  // The ratio is itself two measurements, each with its sampling noise: within
  // kAnchorBand of 1 it is taken as 1, beyond it shrunk toward 1 by the band, so that in
  // stationary training the anchor adds no noise to the reading (a 1-2% jitter there made
  // the loop hold a 3.5% overspend within its dead band: controller_test's wrong-model
  // run) and a real change still counts.
  double anchor = 1;
  if (defaults_forecast > 0 && defaults_now > 0) {
    const double ratio = defaults_now / defaults_forecast;
    anchor = ratio > kAnchorBand ? ratio / kAnchorBand : ratio < 1 / kAnchorBand ? ratio * kAnchorBand : 1.0;
  }
  r.predicted = unforecast + forecast * anchor;
  r.epoch_predicted = unforecast + epoch_forecast * anchor;
  r.budget = settings_.alpha * defaults;
  return r;
}

void Controller::update_loop(const WindowReading& r) {
  if (!settings_.budget_loop) return;
  const double alpha = settings_.alpha, before = alpha_eff_;
  double target = alpha / bias_;
  // The epoch's error as this window projects it: the window lies late in the epoch, where
  // a codec that accumulates (TopK) is above its mean over the epoch and one that relaxes
  // below it; the forecast's own shape carries the window to the epoch. The budget holds
  // for the epoch (the solve meets it with the epoch's mean): the demo's first TopK epoch
  // realized 0.99 of the uniform run's error, and its window 1.20 of the budget, which cut
  // alpha_eff to 0.84.
  const double shape = r.predicted > 0 && r.epoch_predicted > 0 ? r.epoch_predicted / r.predicted : 1.0;
  const double realized = r.realized * (std::isfinite(shape) ? shape : 1.0);
  if (r.predicted > 0 && r.realized > 0 && std::isfinite(r.realized / r.predicted)) {
    const double bias = r.realized / r.predicted;
    if (bias > bias_ * kDeadBand) {
      bias_ = std::min(bias, kMaxBias);
      target = alpha / bias_;
      // Below the alpha that overspent by as much as it overspent too: errors come in
      // steps (one more layer at a narrow codec), not a slope.
      if (r.budget > 0 && realized > r.budget) target = std::min(target, before * r.budget / realized);
    } else if (bias < bias_ / kDeadBand) {
      bias_ = std::max(1.0, std::sqrt(bias_ * bias));
      target = alpha / bias_;
    }
  }
  // Down at once; up by at most half the window's headroom (in ratio: sqrt(budget /
  // realized)), and at least 1% per window. A rise into error that the model does not
  // see (a narrow codec it under-predicts) is then bounded by what the window left
  // unused; one all the way back to alpha / B at once would overspend and swing.
  double rise = kRise;
  if (r.budget > 0 && realized > 0 && realized < r.budget) rise = std::max(rise, std::sqrt(r.budget / realized));
  alpha_eff_ = std::clamp(target < before ? target : std::min(target, before * rise), alpha / kMaxBias, alpha);
}

// The middle of the window ending at `last`, and of the epoch whose assignment it solves,
// as steps counted from 1.
double Controller::window_middle(uint64_t last) const {
  return static_cast<double>(last) + 1 - (static_cast<double>(settings_.schedule.window) - 1) / 2;
}
double Controller::epoch_middle(uint64_t last) const {
  const ScheduleSettings& s = settings_.schedule;
  return static_cast<double>(last) + 1 + static_cast<double>(s.switch_lag) + (static_cast<double>(s.period) - 1) / 2;
}

std::vector<double> Controller::drift_of(const ErrorStats& stats, uint64_t window_last) const {
  std::vector<double> drift(layers_.size(), 1.0);
  // Compared with the window before; the first window, with its lead's steps (the
  // engine measures the magnitude there), if it had any.
  const bool first = last_middle_ <= 0;
  const double before_middle = first ? schedule_.first_lead_middle() : last_middle_;
  const double now = window_middle(window_last);
  if (!(before_middle > 0) || !(before_middle < now)) return drift;
  const double epoch = epoch_middle(window_last);
  // The gradient's scale as a power of the step: its exponent from the last two windows,
  // carried on to the epoch's middle.
  const double h = std::log(epoch / now) / std::log(now / before_middle);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const double m = stats.magnitude_mean(l), before = first ? stats.lead_magnitude_mean(l) : last_magnitude_[l];
    const double energy_ratio = (m / before) * (m / before);
    if (m > 0 && before > 0 && std::isfinite(energy_ratio)) drift[l] = std::pow(std::clamp(energy_ratio, 0.125, 8.0), h);
  }
  return drift;
}

// The leads join the pools (record_pools, below) only where the probe runs at every step
// after the warmup: the shadows then see every gradient, and a lead step's are in the
// state a window step's would be. After a gap (the demo's `--period 20`: 8 steps unprobed
// of 20) they hold residuals of gradients that many steps old; with its 10-step leads pooled, seed 2's last two epochs reached 1.075
// and 1.081 of the uniform run's (its windows alone: 1.020).
bool Controller::pools_lead() const {
  const ScheduleSettings& s = settings_.schedule;
  return s.window < kPoolSteps && s.period <= s.window + s.probe_lead;
}

// A window of a few steps measures a quantizer's error with the noise of the gradients'
// tails: which buckets a few large values fall in sets their ranges, and so the error,
// from step to step. In the demo (window 2, period 5) the uniform run's error per step
// varied by 4% (log sd), single steps up to 1.2x, and its epochs realized 0.90-1.07 of
// the window's estimate; the adaptive epochs, solved to that budget, 0.86-1.10 of the
// uniform run's (the solve spends what the noise adds to the budget); with the budget
// pooled alone, the layers the solve spends it on (settled at 2 bits, half the adaptive
// run's error) still swung 0.86-1.11 of their window's estimate, and single epochs
// reached 1.07. The windows before measured the same candidates on other gradients of the
// same layer: each quantization candidate's error is pooled as error per unit of energy
// (the error follows the gradient's scale squared; the energy, (sum |g|)^2, is robust to
// the tails) over the newest points that measured kPoolSteps steps (this window's
// included), weighted by their steps, times this window's energy. Where windows are
// shorter than kPoolSteps (pools_lead), each window's lead (its probe steps before it,
// which the engine then measures the same way) is a point of its own: 2-step windows see
// 2 of the demo's 5 steps, and on its seed 7 a small layer whose error spiked on the last
// steps of two windows held three epochs' budgets 1.2x high. The first window's lead is
// not measured (its shadows are young there). Only points that ended within kPoolSpan
// steps of this window count: pooled over 60 steps (`--period 20`, before the leads
// were), the demo's seed 2 reached 1.075 of the uniform run's in a later epoch (unpooled:
// 1.020), as the error per energy moves over such spans too (an error-feedback residual,
// for one, holds gradients of past scales). So a window of kPoolSteps steps or more (a
// real schedule's 10), or whose lead and windows before lie further back than kPoolSpan,
// is its own pool, and slow changes of the gradients' shape are followed at once there.
// TopK and PowerSGD candidates are not pooled: their errors grow with the age of their
// state, which differs from window to window (transient_of).
void Controller::record_pools(const ErrorStats& stats, const ErrorStats* lead, uint64_t window_last) {
  const uint64_t window = std::max<uint64_t>(settings_.schedule.window, 1);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<Candidate>& candidates = layers_[l].candidates;
    pools_[l].resize(candidates.size());
    pool_factor_[l].assign(candidates.size(), 1.0);
    const double m = stats.magnitude_mean(l), energy = m * m;
    if (stats.samples(l) == 0 || !(energy > 0) || !std::isfinite(energy)) continue;
    const double lead_m = lead ? lead->magnitude_mean(l) : 0.0;
    const bool lead_measured = lead && lead->samples(l) > 0 && lead_m > 0 && std::isfinite(lead_m * lead_m);
    for (uint32_t c = 0; c < candidates.size(); ++c) {
      const double error = stats.mean(l, c);
      if (codec_family(candidates[c].codec) != "quant" || !(error > 0) || !std::isfinite(error)) continue;
      std::deque<PoolPoint>& points = pools_[l][c];
      // The lead's steps, then the window's.
      if (const double e = lead_measured ? lead->mean(l, c) : 0.0; e > 0 && std::isfinite(e))
        points.push_back({e, lead_m * lead_m, window_last - window, lead->samples(l)});
      points.push_back({error, energy, window_last, stats.samples(l)});
      // The newest points that measured kPoolSteps steps, within kPoolSpan.
      uint64_t steps = 0;
      for (const PoolPoint& p : points) steps += p.steps;
      while (points.size() > 1 &&
             (steps - points.front().steps >= kPoolSteps || window_last - points.front().last_step >= kPoolSpan))
        steps -= points.front().steps, points.pop_front();
      if (points.size() < 2) continue;  // its own pool: the factor is 1, exactly
      double errors = 0, energies = 0;
      for (const PoolPoint& p : points) {
        const auto n = static_cast<double>(p.steps);
        errors += n * p.error, energies += n * p.energy;
      }
      const double f = errors / energies * energy / error;
      if (std::isfinite(f) && f > 0) pool_factor_[l][c] = f;
    }
  }
}

Controller::Transient Controller::pooled_transient_of(const Job& job, size_t layer, uint32_t candidate) const {
  Transient x = transient_of(job, layer, candidate);
  const double f = pool_factor(layer, candidate);
  x.steady *= f, x.now *= f, x.fresh *= f;
  return x;
}

double Controller::pool_factor(size_t layer, uint32_t candidate) const {
  return layer < pool_factor_.size() && candidate < pool_factor_[layer].size() ? pool_factor_[layer][candidate] : 1.0;
}

// The shadows' age for one layer in the window ending at window_last, in steps of the
// layer's gradient energy there: each probe step counts by its energy over the window's,
// from the magnitudes measured in the windows so far (and the first window's lead):
// log-linear between their middles, the first one's before it, each weight within
// [1/8, 8]. Without this window's measurement, the steps as they are. Probe runs that end
// two periods or more before the window count as their length times their middle's
// weight (the energy changes little within one): a long run's solve costs one weight per
// window, not one per probe step.
double Controller::energy_age(size_t layer, uint64_t window_last) const {
  const std::vector<EnergyPoint>& history = energy_history_[layer];
  const double middle = window_middle(window_last);
  if (history.empty() || history.back().t != middle || !(history.back().energy > 0))
    return schedule_.shadow_age(window_last);
  const double now = history.back().energy;
  size_t next = 0;  // the first point after t; the weights are asked for in order of t
  const auto weight = [&](double t) {
    while (next < history.size() && history[next].t <= t) ++next;
    double energy;
    if (next == 0) {
      energy = history.front().energy;
    } else if (next == history.size()) {
      energy = history.back().energy;
    } else {
      const EnergyPoint &a = history[next - 1], &b = history[next];
      energy = a.energy * std::pow(b.energy / a.energy, (t - a.t) / (b.t - a.t));
    }
    return std::clamp(energy / now, 1.0 / 8, 8.0);
  };
  const double old = middle - 2 * static_cast<double>(settings_.schedule.period);
  return schedule_.weighted_shadow_age(window_last, [&](double first, double last) {
    if (last < old) return (last - first + 1) * weight((first + last) / 2);
    double sum = 0;
    for (double t = first; t <= last; ++t) sum += weight(t);
    return sum;
  });
}

// Each layer's gradient energy (its magnitude squared) in this window, and before the
// first, in its lead's steps, at their middles counted from 1.
void Controller::record_energies(const Job& job) {
  energy_history_.resize(layers_.size());
  const double lead = schedule_.first_lead_middle(), now = window_middle(job.window_last_step);
  for (size_t l = 0; l < layers_.size(); ++l) {
    std::vector<EnergyPoint>& history = energy_history_[l];
    const double m = job.stats.magnitude_mean(l), before = job.stats.lead_magnitude_mean(l);
    if (history.empty() && lead > 0 && lead < now && before > 0) history.push_back({lead, before * before});
    if (m > 0 && (history.empty() || history.back().t < now)) history.push_back({now, m * m});
  }
}

// A candidate's mean error over an epoch of T steps after a switch to it. Its error
// starts at what it makes on the state the previous codec left, `now` (the probe's
// measurement of the real state, scaled to the layer), and goes to its own steady state
// (`steady`, its estimate); how depends on how its error feedback remembers:
//  - max-min quantization relaxes geometrically at a rate r per step: the mean is
//    steady + (now - steady) (1 - r^T) / (T (1 - r)). A residual that widens the range
//    relaxes like the fixed-point iteration it is, by the share of the range it adds:
//    r = 1 - sqrt(min/max) of the two errors (errors grow with the square of the unit),
//    capped at 0.8. (Measured on the demo: layers moved from 4 to 2 bits, steady / now
//    about 2.8, relaxed at about 0.4 per step; the formula says 0.40.)
//    From the residual of a codec that holds values back (TopK's), a quantizer sends it
//    all at once: the rate is at most 1 / (2^bits - 1), what its own unit adds to the
//    next range. (With the sqrt rate, 3- and 4-bit layers leaving TopK realized 0.64 and
//    0.79 of their prediction in the demo; with this one 0.83-0.97, on a `now` that
//    the probe over-estimated then; now 0.98-1.00 with the state grown to the switch,
//    transient_of.)
//  - TopK accumulates: what it does not send stays in the residual, whose energy grows
//    with the steps of gradient it holds (TopkGrowth: the curve through `fresh` at age 1
//    and the shadow's `steady` at its age A). The real state is as old as its error says
//    on that curve, and goes on ageing until the switch where TopK is in effect; step a
//    after the switch makes E(k0 + a). From a state older than its own (a sparser
//    TopK's), the excess drains at the curve's own saturation rate. (The linear growth
//    held to the shadow as a floor, before, predicted the demo's TopK layers 1.2-1.3x
//    what they made, and the unit test's moves to denser TopK 5x; held to the shadow as
//    a ceiling, the first TopK epoch realized 1.5x its budget.)
//  - PowerSGD accumulates too (what its basis misses stays in the residual): the same
//    curve, through its error on the gradient alone and its shadow's (transient_of),
//    where the low-rank probe ran; without it, its one-step estimate as it is.
// For the codec in effect, settled, now = steady and nothing changes.
// The mean over the `count` steps from `first` after the switch (0: the switch step).
double Controller::mean_error(const Transient& x, uint64_t first, uint64_t count) {
  const double a = static_cast<double>(first), n = static_cast<double>(std::max<uint64_t>(count, 1));
  if (x.on_growth_curve()) {
    const TopkGrowth growth(x.fresh, x.steady, x.age);
    if (x.ageing == 0 && x.now > growth.ceiling())
      // From a state above what the codec's own residual ever reaches (a much sparser
      // codec's): the excess drains, toward that ceiling, at the rate of the codec's own
      // saturation or more slowly as the state says (`keeps`). Below the ceiling the state
      // is as old as its error says on the curve and goes on along it: a denser TopK on a
      // sparser one's state still piles up what it seldom sends (drained toward `steady`
      // instead, the demo's moves from 0.1% to 1% realized 1.15-1.35 of their prediction).
      return x.correlation * relaxed_mean(growth.ceiling(), x.now, std::max(growth.rate, x.keeps), a, n);
    // Settled, with a state above its own: it keeps what it holds.
    if (growth.flat() && x.now > growth.steady) return x.correlation * x.now / x.drift;
    // From the real state's age, as its error says, on along the growth curve.
    // Each step after the window's middle ages the state by its gradient's energy over the
    // window's (energy_steps). The codec in effect's state goes on from the window; a
    // state another codec left holds what it held (age_of(now) less the window's own
    // step) and from the switch on takes in each step's gradient at that step's energy,
    // the first one's too (counted as the window's, the demo's first TopK epoch realized
    // 0.87 of its prediction: its gradients' energy fell by a quarter from the window to
    // the switch).
    const double held = growth.age_of(x.now);
    const auto age_at = [&](double t) {  // t: steps after the switch, from its middle
      return x.ageing > 0 ? held + x.energy_steps(x.lag + t)
                          : held - 1 + x.energy_steps(x.lag + t + 0.5) - x.energy_steps(x.lag - 0.5);
    };
    // The mean over the steps (at most 256 of them, evenly spread: a smooth curve).
    const double points = std::min(n, 256.0);
    double sum = 0;
    for (double j = 0; j < points; ++j) sum += growth.at(age_at(a + (j + 0.5) * n / points - 0.5));
    // Over the drift the caller applies: what the state holds does not drift, and what it
    // takes in is counted above by its energy.
    return x.correlation * sum / points / x.drift;
  }
  if (!(x.steady > 0) || !(x.now > 0) || x.steady == x.now) return x.correlation * x.steady;
  double rate = std::min(0.8, 1 - std::sqrt(std::min(x.steady, x.now) / std::max(x.steady, x.now)));
  // From the residual of a codec that holds values back (TopK's, PowerSGD's), which can
  // be many times the gradient: a quantizer sends it all at once, and what its own error
  // adds to the next range shrinks by its level count each step.
  if (codec_family(x.codec) == "quant" && x.state_family != "quant" && x.now > x.steady)
    rate = std::min(rate, 1 / quant_levels(x.codec));
  return relaxed_mean(x.steady, x.now, rate, a, n);
}

bool Controller::Transient::on_growth_curve() const {
  // PowerSGD only where its shadows measured the curve (age): without the low-rank probe
  // its estimate is one step's, held as it is.
  const std::string_view family = codec_family(codec);
  return (family == "topk" || (family == "powersgd" && age > 0)) && now > 0 && fresh > 0;
}

double Controller::Transient::energy_steps(double steps) const {
  if (!(steps > 0)) return steps;
  if (energy_exponent == 0 || !(window_t > 0)) return steps;
  // The integral of ((window_t + u) / window_t)^q over [0, steps).
  const double q = energy_exponent, end = 1 + steps / window_t;
  return std::fabs(q + 1) < 1e-9 ? window_t * std::log(end) : window_t * (std::pow(end, q + 1) - 1) / (q + 1);
}

Controller::Transient Controller::transient_of(const Job& job, size_t layer, uint32_t candidate) const {
  const ErrorStats& stats = job.stats;
  const ScheduleSettings& s = settings_.schedule;
  Transient x;
  x.codec = layers_[layer].candidates[candidate].codec;
  x.steady = stats.mean(layer, candidate);
  x.now = stats.current_mean(layer, candidate);
  x.fresh = stats.measured_mean(layer, candidate);
  // The shadow's age in steps of today's gradient (energy_age): the
  // curve through it is in the units that `fresh` and the real state's error are in. In
  // steps, a shadow that summed the larger gradients of earlier steps looked older than
  // its count, and the curve too steep: the demo's TopK layers that stayed at their
  // density realized 0.74-0.89 of their prediction in the second and third epochs.
  if (stats.simulated_sum(layer, candidate) > 0) x.age = shadow_age_[layer];
  const uint32_t in_effect = in_effect_[layer];
  x.state_family = codec_family(layers_[layer].candidates[in_effect].codec);
  x.lag = static_cast<double>(s.switch_lag) + (static_cast<double>(s.window) - 1) / 2;
  if (in_effect == candidate) x.ageing = x.lag;
  // The drift as a power of the step (drift_of's model): (epoch / window)^q = drift.
  x.window_t = window_middle(job.window_last_step);
  if (layer < drift_.size() && drift_[layer] > 0 && std::isfinite(drift_[layer])) {
    x.drift = drift_[layer];
    const double epoch = epoch_middle(job.window_last_step);
    if (epoch > x.window_t) x.energy_exponent = std::log(x.drift) / std::log(epoch / x.window_t);
  }
  // `current` and `measured` weigh the ranks' errors as independent; TopK's are not (the
  // ranks drop values of the same large coordinates, and their residuals pile up alike:
  // measured on the demo, the output's error 1.4-2.3x the independent sum). The shadows'
  // error, `steady`, is the output's. So the growth curve is drawn in independent units
  // (the shadows' error weighed so too) and the output's correlation, the shadows' ratio
  // of the two, scales the whole curve: the real state's place on the curve is where its
  // independent error says. (With the correlation on `now` alone, placed on a curve
  // whose top held it but whose start did not, TopK's layers realized 1.05-1.33 of their
  // prediction after the first epoch and 0.52-0.90 in it.) Without shadows, the realized
  // error over `current` of the layers at TopK (none: 1).
  if (codec_family(x.codec) == "topk") {
    if (const double c = stats.shadow_correlation(layer, candidate); c > 0) {
      x.correlation = c;
      x.steady /= c;
    } else {
      x.correlation = topk_correlation(stats, layer);
    }
  }
  // PowerSGD accumulates as TopK does (what the rank-r basis misses stays in the
  // residual), and its shadows (lowrank_probe.h) give the same two measurements: the
  // curve, in independent units, and the ranks' correlation. The probe does not measure a
  // low-rank candidate on the real state; the state's error is read from what the codec in
  // effect realized, where that codec also holds values back (a low-rank or TopK
  // residual), and a quantizer's residual is taken as none (it is one unit of its width):
  // the candidate starts fresh.
  if (codec_family(x.codec) == "powersgd" && stats.simulated_sum(layer, candidate) > 0) {
    if (const double c = stats.shadow_correlation(layer, candidate); c > 0) {
      x.correlation = c;
      x.steady /= c;
    }
    const double held = realized_of(stats, layer) / x.correlation;
    x.now = x.state_family == "quant" || !(held > 0) ? x.fresh : held;
  }
  // The state the switch hands over is older than the one measured: where the codec in
  // effect holds values back too (a TopK or low-rank residual), it goes on piling up
  // under that codec from the window to the switch (its `ageing`). Measured on the state
  // at the window, moves between TopK densities in the demo realized 1.15-1.45 of their
  // prediction (0.1% -> 0.25%: the state at age 3 of a curve still near linear, 2.5 steps
  // before the switch).
  // What the candidate keeps of such a state per step: its error on the state over the
  // codec in effect's (both one step on the same state and gradient, the one that holds
  // back more keeping nearly all). Its own curve's rate, fitted from the shadow's growth
  // from nothing, is faster: a heavy-tailed gradient gives up much of its energy in its
  // top values, an old residual (a sum of many steps, nearly normal) little. (In
  // controller_test's forced TopK runs, the Gaussian layer moved from 0.2% to 10% realized
  // 1.04-1.05 of its prediction drained at the fitted rate, 0.98-1.00 with this.)
  if (in_effect != candidate && holds_values_back(codec_family(x.codec)) && holds_values_back(x.state_family)) {
    // (TopK's own measurements only: `current` is not measured for a low-rank codec.)
    const double state = stats.current_mean(layer, in_effect);
    if (codec_family(x.codec) == "topk" && x.state_family == "topk" && state > 0 && x.now > 0)
      x.keeps = std::min(1.0, x.now / state);
    x.now *= state_growth_to_switch(job, layer);
  }
  // A quantizer on such a state: the state's part of its error grows with it to the
  // switch too. The error follows the square of the range, and the state's range the
  // square root of its energy, so the growth is taken in range units over what the
  // quantizer makes on the gradient alone. (Measured at the window, the demo's layers
  // leaving TopK for 3 bits realized 1.08 of their prediction; with the state's growth
  // as energy, 0.96-0.97 for 3 and 4 bits; in range units 0.98-1.00.)
  if (in_effect != candidate && codec_family(x.codec) == "quant" && holds_values_back(x.state_family) &&
      x.now > x.fresh && x.fresh > 0) {
    const double range =
        std::sqrt(x.fresh) + (std::sqrt(x.now) - std::sqrt(x.fresh)) * std::sqrt(state_growth_to_switch(job, layer));
    x.now = range * range;
  }
  return x;
}

// What the real state's error grows by from the window to the switch, under the codec in
// effect, where that codec holds values back: on its own growth curve, from the age its
// error says, on by its `ageing` (1 for a codec without a measured curve).
double Controller::state_growth_to_switch(const Job& job, size_t layer) const {
  const Transient e = transient_of(job, layer, in_effect_[layer]);
  if (!e.on_growth_curve()) return 1;
  const TopkGrowth growth(e.fresh, e.steady, e.age);
  const double k = growth.age_of(e.now), before = growth.at(k), after = growth.at(k + e.energy_steps(e.ageing));
  return before > 0 && after > before && std::isfinite(after / before) ? after / before : 1;
}

double Controller::realized_of(const ErrorStats& stats, size_t layer) const {
  const uint32_t in_effect = in_effect_[layer];
  const std::vector<Candidate>& candidates = layers_[layer].candidates;
  if (codec_family(candidates[in_effect].codec) != "powersgd") return stats.realized_mean(layer, in_effect);
  // The realized error is measured on the probe's sample of codec buckets; a low-rank
  // candidate's reference is the whole layer (lowrank_probe.h). So the sample's content
  // ratio comes from a candidate measured on that sample: the default, or another that is
  // not low rank; else the sample's share of the layer.
  const auto on_sample = [&](uint32_t c) { return codec_family(candidates[c].codec) != "powersgd"; };
  uint32_t scale = layers_[layer].default_index;
  for (uint32_t c = 0; !on_sample(scale) && c < candidates.size(); ++c) scale = c;
  return on_sample(scale) ? stats.realized_mean(layer, scale) : stats.realized_mean_sampled(layer);
}

double Controller::topk_correlation(const ErrorStats& stats, size_t layer) const {
  const auto ratio = [&](size_t l) -> std::pair<double, double> {
    const uint32_t c = in_effect_[l];
    if (stats.samples(l) == 0 || codec_family(layers_[l].candidates[c].codec) != "topk") return {0, 0};
    const double realized = stats.realized_mean(l, c), current = stats.current_mean(l, c);
    return realized > 0 && current > 0 ? std::pair{realized, current} : std::pair{0.0, 0.0};
  };
  if (auto [realized, current] = ratio(layer); current > 0) return realized / current;
  if (!pooled_topk_correlation_) {
    double realized = 0, current = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto [r, c] = ratio(l);
      realized += r, current += c;
    }
    pooled_topk_correlation_ = current > 0 ? realized / current : 1.0;
  }
  return *pooled_topk_correlation_;
}

std::vector<double> Controller::weights_of(const ErrorStats& stats) const {
  std::vector<double> weight(layers_.size(), 1.0);
  if (settings_.metric != ErrorMetric::kNormalized) return weight;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const double m = stats.magnitude_mean(l), n = static_cast<double>(layers_[l].numel);
    const double w = (n / m) * (n / m);
    weight[l] = m > 0 && std::isfinite(w) ? w : 0.0;
  }
  return weight;
}

double Controller::relative_of(const ErrorStats& stats, size_t layer, double error) const {
  const double m = stats.magnitude_mean(layer), n = static_cast<double>(layers_[layer].numel);
  const double r = error * n / (m * m);
  return m > 0 && std::isfinite(r) ? r : 0.0;
}

std::vector<double> Controller::epoch_scales(std::span<const double> drift, std::span<const double> weight) const {
  std::vector<double> scale(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l)
    scale[l] = settings_.metric == ErrorMetric::kNormalized ? weight[l] : drift[l] * weight[l];
  return scale;
}

Controller::Built Controller::problem_from(const Job& job, std::span<const double> scale) const {
  const ErrorStats& stats = job.stats;
  double steady_defaults = 0, epoch_defaults = 0;
  Built built;
  Problem& p = built.problem;
  p.alpha = alpha_eff_;
  p.objective = settings_.objective;
  p.cost_model = job.cost_model;
  p.layers = layers_;
  built.index.resize(p.layers.size());
  built.measured.assign(p.layers.size(), 0);
  built.relative_bound.assign(p.layers.size(), 0.0);
  built.budget.assign(p.layers.size(), 0.0);
  for (size_t l = 0; l < p.layers.size(); ++l) {
    Layer& layer = p.layers[l];
    if (stats.samples(l) == 0 || scale[l] == 0) {
      // Nothing measured (every sample overflowed, or the layer was not reached; for the
      // normalized metric, no magnitude): it keeps its default and adds nothing to the
      // budget.
      Candidate keep = layer.candidates[layer.default_index];
      keep.error = 0;
      built.index[l].assign(1, layer.default_index);
      layer.candidates.assign(1, keep);
      layer.default_index = 0;
      continue;
    }
    built.measured[l] = 1;
    for (uint32_t c = 0; c < layer.candidates.size(); ++c) {
      const Transient x = pooled_transient_of(job, l, c);
      built.index[l].push_back(c);
      layer.candidates[c].error = mean_error(x, 0, settings_.schedule.period) * scale[l];
      if (c == layer.default_index) {
        built.budget[l] = x.steady;
        steady_defaults += built.budget[l] * scale[l], epoch_defaults += layer.candidates[c].error;
      }
    }
  }
  // The budget is the default's error as a uniform run has it, in its own steady state
  // (pooled over the last windows: record_pools): alpha is rescaled so that alpha x
  // the defaults' epoch errors (with their transients, where a layer is not at its default
  // now) is alpha_eff x their steady errors.
  if (epoch_defaults > 0 && steady_defaults > 0) p.alpha = alpha_eff_ * steady_defaults / epoch_defaults;
  if (settings_.metric == ErrorMetric::kNormalized && settings_.relative_cap > 0) cap_relative_errors(built);
  return built;
}

// The normalized metric's cap: a weighted error is numel x the layer's relative error, so
// the defaults' mean relative error per value is their weighted errors over their values.
// A candidate above alpha_eff x max(cap x that mean, the layer's own default's) leaves the
// problem; the default always stays.
void Controller::cap_relative_errors(Built& built) const {
  Problem& p = built.problem;
  double defaults = 0, values = 0;
  for (size_t l = 0; l < p.layers.size(); ++l) {
    if (!built.measured[l]) continue;
    defaults += p.layers[l].candidates[p.layers[l].default_index].error;
    values += static_cast<double>(layers_[l].numel);
  }
  if (!(defaults > 0) || !(values > 0)) return;
  const double mean = defaults / values;
  for (size_t l = 0; l < p.layers.size(); ++l) {
    if (!built.measured[l]) continue;
    Layer& layer = p.layers[l];
    const double n = static_cast<double>(layers_[l].numel);
    const double own = layer.candidates[layer.default_index].error / n;
    const double bound = alpha_eff_ * std::max(settings_.relative_cap * mean, own);
    built.relative_bound[l] = bound;
    std::vector<Candidate> kept;
    std::vector<uint32_t> index;
    uint32_t default_index = 0;
    for (uint32_t c = 0; c < layer.candidates.size(); ++c) {
      if (c != layer.default_index && layer.candidates[c].error / n > bound) continue;
      if (c == layer.default_index) default_index = static_cast<uint32_t>(kept.size());
      kept.push_back(layer.candidates[c]);
      index.push_back(built.index[l][c]);
    }
    layer.candidates = std::move(kept);
    layer.default_index = default_index;
    built.index[l] = std::move(index);
  }
}

std::shared_ptr<const Assignment> Controller::solve_job(const Job& job) {
  try {
    // The loop first: its state moves whether or not this solve succeeds.
    pooled_topk_correlation_.reset();  // of this window
    record_pools(job.stats, job.lead && pools_lead() ? &*job.lead : nullptr, job.window_last_step);
    const WindowReading reading = read_window(job.stats);
    update_loop(reading);
    const std::vector<double> drift = drift_of(job.stats, job.window_last_step);
    record_energies(job);
    drift_ = drift;
    shadow_age_.resize(layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) shadow_age_[l] = energy_age(l, job.window_last_step);
    const std::vector<double> scale = epoch_scales(drift, weights_of(job.stats));
    for (size_t l = 0; l < layers_.size(); ++l) last_magnitude_[l] = job.stats.magnitude_mean(l);
    last_middle_ = window_middle(job.window_last_step);
    return solve_and_log(job, reading, drift, scale);
  } catch (const std::exception& e) {
    return failed(job, e.what());
  } catch (...) {
    return failed(job, "an unknown exception");
  }
}

std::shared_ptr<const Assignment> Controller::failed(const Job& job, const char* what) {
  // Deterministic inputs fail identically on every rank, so all keep their assignment.
  // One WARN per controller; later failures at INFO.
  if (!warned_failure_) {
    warned_failure_ = true;
    LGRECO_WARN("CTRL", "solving epoch %llu failed: %s; keeping the current assignment", ull(job.epoch), what);
  } else {
    LGRECO_INFO("CTRL", "solving epoch %llu failed: %s; keeping the current assignment", ull(job.epoch), what);
  }
  return nullptr;  // counted in failed_solves when published (run)
}

std::shared_ptr<const Assignment> Controller::solve_and_log(const Job& job, const WindowReading& reading,
                                                            std::span<const double> drift,
                                                            std::span<const double> scale) {
  const Built built = problem_from(job, scale);
  const Problem& problem = built.problem;
  const auto start = std::chrono::steady_clock::now();
  Solution solution = solve_(problem, settings_.solver);
  const double solve_ms = ms_since(start);
  if (solution.choices.size() != layers_.size()) throw std::logic_error("the solver answered for other layers");
  // At alpha >= 1 the defaults meet the budget by definition: it is their own error. When
  // the loop's alpha_eff < 1 asks for less error than theirs, the search may only get
  // there by spending more bytes than they do (or not at all); then the defaults are the
  // better answer to the budget the user set, and the window after measures them exactly.
  const double solved_cost = solution.cost;
  const bool kept_defaults = settings_.alpha >= 1 && solution.cost > solution.default_cost;
  if (kept_defaults) solution = defaults_of(problem, solution);

  auto assignment = std::make_shared<Assignment>();
  assignment->epoch = job.epoch;
  assignment->effective_step = job.effective_step;
  assignment->choices.resize(layers_.size());
  uint64_t min_samples = UINT64_MAX;
  for (size_t l = 0; l < layers_.size(); ++l) {
    min_samples = std::min(min_samples, job.stats.samples(l));
    if (solution.choices[l] >= built.index[l].size()) throw std::logic_error("the solver chose no offered candidate");
    assignment->choices[l] = built.index[l][solution.choices[l]];  // the layer's own index
  }
  if (layers_.empty()) min_samples = 0;
  assignment->alpha_eff = alpha_eff_;
  assignment->bias = bias_;
  assignment->kept_defaults = kept_defaults;
  assignment->window = reading;
  assignment->drift.assign(drift.begin(), drift.end());
  // Per layer, what the solve knew of its choice: the prediction the epoch is judged
  // against (in squared error, the metric's weight taken off), and for the next window's
  // reading its transient and drift.
  assignment->predicted.assign(layers_.size(), 0.0);
  assignment->budget.assign(layers_.size(), 0.0);
  assignment->relative.assign(layers_.size(), 0.0);
  assignment->relative_bound = built.relative_bound;
  std::vector<std::optional<Transient>> chosen(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!built.measured[l]) continue;
    const uint32_t c = assignment->choices[l];
    // The epoch's error as the window measured it, and with the drift's forecast.
    const double in_window = problem.layers[l].candidates[solution.choices[l]].error / scale[l];
    assignment->predicted[l] = in_window * drift[l];
    assignment->budget[l] = built.budget[l] * drift[l];
    assignment->relative[l] = relative_of(job.stats, l, in_window);
    // The default is always offered, whatever the cap (cap_relative_errors): a layer at its
    // default has the relative error uniform compression has, and no bound.
    if (solution.choices[l] == problem.layers[l].default_index) assignment->relative_bound[l] = 0;
    chosen[l] = pooled_transient_of(job, l, c);
  }

  if (decision_log_) {
    std::vector<double> realized, window_relative;
    for (size_t l = 0; l < layers_.size(); ++l) {
      realized.push_back(realized_of(job.stats, l));
      window_relative.push_back(relative_of(job.stats, l, realized.back()));
    }
    DecisionContext context;
    context.epoch = job.epoch;
    context.stats_last_step = job.window_last_step;
    context.effective_step = job.effective_step;
    context.samples = min_samples;
    context.alpha = settings_.alpha;
    context.alpha_eff = alpha_eff_;
    context.loop_bias = bias_;
    context.window_realized = reading.realized;
    context.window_predicted = reading.predicted;
    context.window_budget = reading.budget;
    context.metric = metric_name(settings_.metric);
    context.layer_realized = &realized;
    context.layer_drift = drift;
    context.layer_relative = assignment->relative;
    context.layer_window_relative = window_relative;
    context.layer_relative_bound = assignment->relative_bound;
    context.kept_defaults = kept_defaults;
    const std::string line = decision_json(context, problem, solution, solve_ms);
    fprintf(decision_log_, "%s\n", line.c_str());
    fflush(decision_log_);
  }
  LGRECO_INFO("CTRL",
              "epoch %llu (window ending at step %llu, switch at step %llu): %llu of %llu default bytes, error "
              "%.6g of budget %.6g%s at alpha_eff %.4g (the window realized %.4g of its budget), solved in %.2f ms",
              ull(job.epoch), ull(job.window_last_step), ull(job.effective_step), ull(solution.bytes),
              ull(solution.default_bytes), solution.error, solution.budget,
              solution.feasible ? "" : " (infeasible: least-error assignment)", problem.alpha,
              reading.budget > 0 ? reading.realized / reading.budget : 0.0, solve_ms);
  if (kept_defaults)
    LGRECO_INFO("CTRL",
                "epoch %llu keeps the defaults: the solve at alpha_eff %.4g would send %.6g, more than their %.6g",
                ull(job.epoch), problem.alpha, solved_cost, solution.default_cost);
  in_effect_ = assignment->choices;
  chosen_ = std::move(chosen);
  chosen_scale_.assign(scale.begin(), scale.end());
  for (size_t l = 0; l < layers_.size(); ++l)
    chosen_defaults_[l] = built.measured[l] ? job.stats.mean(l, layers_[l].default_index) : 0.0;
  assignment->solution = std::move(solution);
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.last_solve_ms = solve_ms;  // solves is counted when the result is published (run)
  return assignment;
}

}  // namespace lgreco::controller
