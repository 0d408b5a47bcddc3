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
};

// The codecs in effect from effective_step on.
struct Assignment {
  uint64_t epoch = 0;  // 0: every layer at its default
  uint64_t effective_step = 0;
  std::vector<uint32_t> choices;  // candidate index per layer
  Solution solution;              // the solver's summary (empty for epoch 0)
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
  void submit(uint64_t window_last_step, ErrorStats aggregated, std::optional<CostModel> cost_model = std::nullopt);

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
  };
  struct Result {
    uint64_t epoch;
    std::shared_ptr<const Assignment> assignment;  // null: the solve failed, keep the current one
  };

  void run();
  Problem problem_from(const Job& job) const;
  std::shared_ptr<const Assignment> solve_job(const Job& job);  // never throws
  std::shared_ptr<const Assignment> solve_and_log(const Job& job);
  std::shared_ptr<const Assignment> failed(const Job& job, const char* what);

  const ControllerSettings settings_;
  const Schedule schedule_;
  const std::vector<Layer> layers_;
  const SolveFunction solve_;
  FILE* decision_log_ = nullptr;  // written by the solver thread only

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
