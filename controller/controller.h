// The L-GreCo controller of one communicator: it turns aggregated error statistics into
// per-layer codec assignments on a background thread, off the training path.
//
// The engine's loop, per step s of the communicator (controller/schedule.h says when):
//
//   auto a = controller.assignment_for_step(s);    // the codecs to use at step s
//   ... encode and exchange with a->choices ...
//   if (controller.schedule().measures(s))      stats.add(layer, squared errors) ...
//   if (controller.schedule().window_ends(s)) { allreduce(stats.reduction_buffer(), SUM);
//                                               controller.submit(s, stats); stats.clear(); }
//
// The closed loop (docs/CONTROLLER.md, "The closed loop"): each window also carries the
// realized error of the assignment in effect during it. Before each solve the thread
// compares it with what the solve that chose that assignment predicted for it, re-anchored
// to this window by the defaults' error measured here over their error as that solve
// forecast it (the gradients change between the two windows; read_window): their
// ratio b is the model's bias, as measured. It keeps an estimate B of it, in [1, 4],
// and aims at alpha_eff = alpha / B, so that the realized error (B x the prediction) fits
// alpha x the default's:
//   b > 1.02 B:    B = b                 (under-predicted: corrected at once; and if the
//                                         epoch overspent, alpha_eff also at most the
//                                         alpha that overspent over the overspend)
//   b < B / 1.02:  B = sqrt(B b)         (over-predicted: given back halfway)
//   otherwise:     unchanged             (the dead band)
// The epoch's overspend is the window's realized error carried to the epoch by the
// forecast's own shape (its mean over the epoch over its mean over the window) over the
// budget: the window lies late in the epoch, where a TopK transient is above its mean.
// alpha_eff follows its aim down at once and up by at most max(1%, half the epoch's
// headroom) per window. The bias
// depends on the assignment (a model may err on the narrow codecs only): given back at
// once, alpha_eff would climb until they return, overspend again and swing; rising
// slowly, it comes back to such a cliff tens of windows later, by a step.
// Realized and re-anchored predicted error come from the same window and the same
// assignment, so a window whose gradients are unusual (a heavy tail's outlier) moves both
// alike; comparing the realized error with the budget instead would read the budget's own
// swings as the model's error, and a solution that leaves budget unused as a model that
// errs low. The state moves whether or not the solve then succeeds; every rank computes
// the same.
//
// Drift: gradients change scale as training goes on, layer by layer, and an assignment
// runs after the window it was solved from. Every codec's error scales with the square of
// the gradient's scale, so each layer's errors are extrapolated by the trend of its
// gradient's magnitude m = sum |g| (robust where a sum of squares of heavy-tailed values
// would swing with its largest few), taken as a power of the step t (counted from 1),
// the usual shape of gradient-norm and loss curves: with windows centred at t0 and t1 and
// the epoch the assignment runs centred at t2, every error of a layer is multiplied by
// ((m1 / m0)^2)^h, h = log(t2 / t1) / log(t1 / t0), the squared ratio kept in [1/8, 8].
// The first window has none before it: its lead's steps (the probe's, before it), where
// the engine measures the magnitude alone (ErrorStats::add_lead), stand in.
// A power law slows down as t grows, so it extrapolates less than a constant rate would:
// the safe side too when a job resumes from a checkpoint and the steps restart.
//
// Transients: a layer that switches codec starts from the residual the previous codec
// left; its error relaxes from what the new codec makes on that state (measured on the
// whole layer now) to its own steady state (the probe's estimate). Each candidate's
// error is its mean over the epoch (mean_error in controller.cc). With 100-step periods
// the transient is a few percent of the epoch; with the demo's 5-step ones, a third.
//
// submit() only enqueues; the thread solves and keeps the result until step
// s + switch_lag, when assignment_for_step() hands it out, on every rank at the same step
// (every rank submits the same sums, and the solver is deterministic). If the solve has
// not finished by then, assignment_for_step() waits for it and logs that it did: a
// switch at different steps on different ranks would encode with different codecs.
//
// Threads: the training-path calls (assignment_for_step, submit) come from one thread at
// a time; they take a mutex only at a submit and at a switch step. stop() (and the
// destructor) stop and join the solver thread; no thread outlives the Controller.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <span>
#include <thread>
#include <vector>

#include "controller/problem.h"
#include "controller/schedule.h"
#include "controller/solver.h"
#include "controller/stats.h"

namespace lgreco::controller {

struct ControllerSettings {
  double alpha = 1.0;
  Objective objective = Objective::kSize;
  CostModel cost_model;  // for Objective::kTime
  ErrorMetric metric = ErrorMetric::kSquaredL2;
  ScheduleSettings schedule;
  SolverOptions solver;
  // One JSON line per solved assignment is appended here; empty: no log. The caller
  // expands any per-rank pattern.
  std::string decision_log_path;
  // The closed loop on the realized error (above); off: every solve uses alpha.
  bool budget_loop = true;
  // Under ErrorMetric::kNormalized, no layer's relative error (below) above alpha_eff x
  // max(relative_cap x the defaults' mean relative error, its own default's): a candidate
  // beyond it is not offered to the solver (docs/CONTROLLER.md, "What the optimizer
  // sees"). 0: no cap.
  double relative_cap = 4;
};

// The loop's reading of one window (all in the statistics' metric, summed over layers).
struct WindowReading {
  double realized = 0;   // the assignment in effect, as it ran
  double predicted = 0;  // the same assignment, as the statistics predict it
  // The same prediction over the whole epoch (what the budget bounds): its ratio to
  // `predicted` carries the window's reading to the epoch (update_loop).
  double epoch_predicted = 0;
  double budget = 0;     // alpha x the defaults' predicted error
};

// The codecs in effect from effective_step on.
struct Assignment {
  uint64_t epoch = 0;  // 0: every layer at its default
  uint64_t effective_step = 0;
  std::vector<uint32_t> choices;  // candidate index per layer
  Solution solution;              // the solver's summary (empty for epoch 0)
  double alpha_eff = 0;           // the alpha the solve used (0 for epoch 0)
  double bias = 1;                // the loop's estimate of the model's bias it used
  // Every layer at its default because the solve at alpha_eff < 1 would have cost more
  // than they do (alpha >= 1 only; controller.cc, solve_and_log).
  bool kept_defaults = false;
  WindowReading window;           // of the window it was solved from
  std::vector<double> drift;      // per layer: the factor its errors were extrapolated by
  // Per layer: the default's error per step the budget allowed over the epoch (its
  // estimate pooled over the last windows, record_pools; times the drift); 0 where the
  // layer was not measured. What the uniform run's error is to be judged against.
  std::vector<double> budget;
  // Per layer: the mean error per step the solve predicted for its choice over the epoch
  // (the estimate carried through the switch's transient, times the drift); 0 where the
  // layer was not measured. What the realized error of the epoch is to be judged against.
  std::vector<double> predicted;
  // Per layer: the same as an error relative to the gradient's energy per coordinate,
  // without the drift's forecast (a relative error does not drift): the choice's error in
  // the window x numel / magnitude^2 (magnitude: the window's sum |g| in the output's
  // units), and the bound the solve held it to (0: no bound, as for a layer at its default,
  // whose error is uniform compression's; not measured: both 0).
  std::vector<double> relative, relative_bound;
};

class Controller {
 public:
  using SolveFunction = std::function<Solution(const Problem&, const SolverOptions&)>;

  // layers: every layer with its candidates (codec spec and bytes; each error must be a
  // finite placeholder >= 0, such as 0: the statistics replace it) and default. Throws std::invalid_argument
  // (ProblemError) on invalid settings or layers. `solve` replaces the solver (tests).
  Controller(ControllerSettings settings, std::vector<Layer> layers, SolveFunction solve = {});
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  const Schedule& schedule() const { return schedule_; }
  const std::vector<Layer>& layers() const { return layers_; }
  // An empty accumulator shaped for these layers and the configured metric.
  ErrorStats new_stats() const;

  // The assignment in effect at `step` (steps never go backwards). Waits only when a
  // switch is due at this step and its solve has not finished.
  std::shared_ptr<const Assignment> assignment_for_step(uint64_t step);

  // Hands over the statistics of the window that ended at window_last_step, already
  // summed across ranks, and (for the time objective) the cost model measured over that
  // window, the same on every rank; without one the settings' model is used. Never waits
  // for a solve.
  // `lead`: the same statistics of the window's lead steps (its probe steps before it, from
  // the last window on), where pools_lead(): the quantizers' pools take them in.
  void submit(uint64_t window_last_step, ErrorStats aggregated, std::optional<CostModel> cost_model = std::nullopt,
              std::optional<ErrorStats> lead = std::nullopt);
  // Whether the quantization candidates' pools take in the lead steps' statistics
  // (record_pools): windows of fewer than kPoolSteps steps, in a schedule whose probe runs
  // at every step after the warmup (its leads fill the periods).
  bool pools_lead() const;

  // Stops the solver thread (an unfinished solve completes first; queued ones are
  // dropped) and joins it. Later calls of assignment_for_step() return the current
  // assignment and switch no more. Idempotent.
  void stop();

  struct Counters {
    uint64_t solves = 0;  // finished
    uint64_t failed_solves = 0;
    uint64_t waits = 0;  // switch steps that had to wait
    double wait_ms = 0;  // total waited
    double last_solve_ms = 0;
  };
  Counters counters() const;

 private:
  struct Job {
    uint64_t epoch, window_last_step, effective_step;
    ErrorStats stats;
    CostModel cost_model;
    std::optional<ErrorStats> lead;  // submit()'s
  };
  struct Result {
    uint64_t epoch;
    std::shared_ptr<const Assignment> assignment;  // null: the solve failed, keep the current one
  };

  void run();
  // The problem of a window: per layer the candidates offered to the solver (index: the
  // layer's candidate index of each; a layer not measured offers its default alone) and
  // the relative-error bound applied (0: none).
  struct Built {
    Problem problem;
    std::vector<std::vector<uint32_t>> index;
    std::vector<uint8_t> measured;
    std::vector<double> relative_bound;
    std::vector<double> budget;  // per layer, the default's steady error the budget rests on (0: not measured)
  };
  void cap_relative_errors(Built& built) const;
  // The factor from a layer's squared error in the window to the metric's error over the
  // epoch: drift x weight under the absolute metrics (the error follows the gradient's
  // scale); the weight alone under kNormalized, where the gradient's scale moves the error
  // and the weight (1 / magnitude^2) alike and the drift cancels.
  std::vector<double> epoch_scales(std::span<const double> drift, std::span<const double> weight) const;
  Built problem_from(const Job& job, std::span<const double> scale) const;
  // The metric's weight of one unit of each layer's squared error: 1 for the absolute
  // metrics; numel^2 / magnitude^2 for kNormalized, 0 where the window measured no
  // magnitude (the layer then keeps its default and adds nothing to the budget).
  std::vector<double> weights_of(const ErrorStats& stats) const;
  // error x numel / magnitude^2 of the window (0 where no magnitude was measured).
  double relative_of(const ErrorStats& stats, size_t layer, double error) const;
  std::vector<double> drift_of(const ErrorStats& stats, uint64_t window_last) const;
  // The quantization candidates' errors pooled over the last windows (controller.cc,
  // record_pools): this window's over its energy, with its lead's (`lead`: null where not
  // pools_lead()) and the windows' and leads' before it that ended within kPoolSpan steps,
  // kPoolSteps steps of them; per layer and candidate, the factor from the window's own
  // estimate to the pool (1: not pooled).
  void record_pools(const ErrorStats& stats, const ErrorStats* lead, uint64_t window_last);
  double pool_factor(size_t layer, uint32_t candidate) const;
  struct EnergyPoint {
    double t, energy;  // a window's (or the first lead's) middle, counted from 1; magnitude^2
  };
  void record_energies(const Job& job);
  double energy_age(size_t layer, uint64_t window_last) const;
  // A candidate's error after a switch to it (controller.cc, mean_error): its estimate in
  // its own state, on the state now, and on the gradient alone, per step; the age of the
  // state its estimate was measured in (its shadow's, in steps; 0: not simulated); and
  // for the codec in effect, the steps its real state goes on ageing from the window's
  // middle to the switch (0 for the others, whose state is another codec's).
  struct Transient {
    std::string codec;
    double steady = 0, now = 0, fresh = 0;
    double age = 0, ageing = 0;
    // TopK: the output's error over the independent ranks' sum (the shadows' ratio, else
    // topk_correlation); it scales the whole curve, not the state's place on it.
    double correlation = 1;
    // The gradient's energy over the window's as a power of the step, (t / window_t)^q
    // (t counted from 1; q from the layer's drift), and that drift, by which the caller
    // scales the epoch's error. An accumulating codec's state holds past gradients, which
    // do not drift: its steps count by energy_steps and its error is the drift's over.
    double window_t = 0, energy_exponent = 0, drift = 1;
    // The steps from the window's middle to the switch (the codec in effect's `ageing`).
    double lag = 0;
    // On a state that another codec which holds values back left: the share of it the
    // candidate keeps per step (transient_of; 0: not measured).
    double keeps = 0;
    // The steps [0, s) after the window's middle in steps of its gradient's energy.
    double energy_steps(double s) const;
    // Whether its error follows TopkGrowth (TopK; PowerSGD where shadows measured it).
    bool on_growth_curve() const;
    std::string state_family;  // of the codec in effect, whose residual the state holds
  };
  Transient transient_of(const Job& job, size_t layer, uint32_t candidate) const;
  // transient_of with a quantizer's errors pooled over the last windows (record_pools).
  Transient pooled_transient_of(const Job& job, size_t layer, uint32_t candidate) const;
  static double mean_error(const Transient& x, uint64_t first, uint64_t count);
  // The output's TopK error over the independent ranks' sum, on the layer's real state
  // (controller.cc, transient_of): where the shadows' own ratio is not measured.
  double topk_correlation(const ErrorStats& stats, size_t layer) const;
  // The realized error per step of the layer's codec in effect, scaled from the probe's
  // sample to the whole layer.
  double realized_of(const ErrorStats& stats, size_t layer) const;
  double state_growth_to_switch(const Job& job, size_t layer) const;
  mutable std::optional<double> pooled_topk_correlation_;  // per window; solver thread only
  double window_middle(uint64_t last) const;
  double epoch_middle(uint64_t last) const;
  std::shared_ptr<const Assignment> solve_job(const Job& job);  // never throws
  std::shared_ptr<const Assignment> solve_and_log(const Job& job, const WindowReading& reading,
                                                  std::span<const double> drift, std::span<const double> scale);
  std::shared_ptr<const Assignment> failed(const Job& job, const char* what);
  // The closed loop's step for a window: reads it and updates alpha_eff_.
  WindowReading read_window(const ErrorStats& stats) const;
  void update_loop(const WindowReading& reading);

  const ControllerSettings settings_;
  const Schedule schedule_;
  const std::vector<Layer> layers_;
  const SolveFunction solve_;
  FILE* decision_log_ = nullptr;  // written by the solver thread only
  bool warned_failure_ = false;   // one WARN for a failed solve, later ones INFO; solver thread only
  // The closed loop's state (solver thread only): alpha_eff, and the choices in effect
  // during the window being solved (the last successful solve's, or the defaults); each
  // layer's gradient magnitude in the window before (0: unknown).
  static constexpr double kDeadBand = 1.02, kMaxBias = 4, kRise = 1.01, kAnchorBand = 1.03;
  double alpha_eff_, bias_ = 1;
  std::vector<uint32_t> in_effect_;
  std::vector<double> last_magnitude_;
  // Per layer: what the last successful solve knew of its choice (none: the layer was not
  // measured, or no solve yet), the epoch scale it applied (epoch_scales), and the
  // defaults' error in its window (for read_window's anchor; 0: not measured).
  std::vector<std::optional<Transient>> chosen_;
  std::vector<double> chosen_scale_, chosen_defaults_;
  double last_middle_ = 0;  // of the window before (0: none yet)
  // Per layer, the gradient energies measured so far (record_energies), one point per
  // window; and the shadows' age in the window being solved, in steps of its gradient's
  // energy there (energy_age), set by solve_job before the problem is built.
  std::vector<std::vector<EnergyPoint>> energy_history_;
  std::vector<double> shadow_age_;
  std::vector<double> drift_;  // per layer, the epoch's (drift_of), set with shadow_age_
  // Per layer and candidate, the error and the gradient's energy of the last windows
  // (record_pools), and the factor from the window being solved to their pool.
  struct PoolPoint {
    double error, energy;  // per step
    uint64_t last_step;    // the window's or the lead's last
    uint64_t steps;        // measured
  };
  static constexpr uint64_t kPoolSteps = 8, kPoolSpan = 16;
  std::vector<std::vector<std::deque<PoolPoint>>> pools_;
  std::vector<std::vector<double>> pool_factor_;

  // Training-path state (one thread).
  std::shared_ptr<const Assignment> current_;
  std::deque<std::pair<uint64_t, uint64_t>> switches_;  // (epoch, effective step), in order
  uint64_t submitted_ = 0;
  bool warned_wait_ = false;
  std::atomic<bool> stopped_{false};  // set by stop(); read by assignment_for_step()

  // Shared with the solver thread.
  mutable std::mutex mutex_;
  std::condition_variable work_ready_, result_ready_;
  std::deque<Job> jobs_;
  std::deque<Result> results_;
  bool stopping_ = false;
  Counters counters_;
  std::once_flag joined_;
  std::thread thread_;
};

}  // namespace lgreco::controller
