#include "controller/controller.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "config/log.h"
#include "controller/problem_json.h"

namespace lgreco::controller {

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

unsigned long long ull(uint64_t v) { return v; }

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

}  // namespace

Controller::Controller(ControllerSettings settings, std::vector<Layer> layers, SolveFunction solve)
    : settings_(std::move(settings)),
      schedule_(settings_.schedule),
      layers_(validated(std::move(layers), settings_)),
      solve_(solve ? std::move(solve) : SolveFunction(&controller::solve)) {
  auto defaults = std::make_shared<Assignment>();
  for (const Layer& layer : layers_) defaults->choices.push_back(layer.default_index);
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

void Controller::submit(uint64_t window_last_step, ErrorStats aggregated, std::optional<CostModel> cost_model) {
  if (!schedule_.window_ends(window_last_step))
    throw std::invalid_argument("Controller::submit: step " + std::to_string(window_last_step) +
                                " does not end a measurement window");
  if (aggregated.layers() != layers_.size() || aggregated.metric() != settings_.metric)
    throw std::invalid_argument("Controller::submit: statistics of another shape or metric");
  for (size_t l = 0; l < layers_.size(); ++l)
    if (aggregated.candidates(l) != layers_[l].candidates.size())
      throw std::invalid_argument("Controller::submit: statistics of another shape (layer " + std::to_string(l) + ")");
  const uint64_t epoch = ++submitted_;
  const uint64_t effective = schedule_.effective_step(window_last_step);
  switches_.emplace_back(epoch, effective);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(Job{epoch, window_last_step, effective, std::move(aggregated),
                        cost_model ? std::move(*cost_model) : settings_.cost_model});
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
      results_.push_back(Result{job->epoch, std::move(assignment)});
    }
    result_ready_.notify_all();
  }
}

Problem Controller::problem_from(const Job& job) const {
  const ErrorStats& stats = job.stats;
  Problem p;
  p.alpha = settings_.alpha;
  p.objective = settings_.objective;
  p.cost_model = job.cost_model;
  p.layers = layers_;
  for (size_t l = 0; l < p.layers.size(); ++l) {
    Layer& layer = p.layers[l];
    if (stats.samples(l) == 0) {
      // Nothing measured (every sample overflowed, or the layer was not reached): it
      // keeps its default and adds nothing to the budget.
      Candidate keep = layer.candidates[layer.default_index];
      keep.error = 0;
      layer.candidates.assign(1, keep);
      layer.default_index = 0;
      continue;
    }
    for (uint32_t c = 0; c < layer.candidates.size(); ++c) layer.candidates[c].error = stats.mean(l, c);
  }
  return p;
}

std::shared_ptr<const Assignment> Controller::solve_job(const Job& job) {
  try {
    return solve_and_log(job);
  } catch (const std::exception& e) {
    return failed(job, e.what());
  } catch (...) {
    return failed(job, "an unknown exception");
  }
}

std::shared_ptr<const Assignment> Controller::failed(const Job& job, const char* what) {
  // Deterministic inputs fail identically on every rank, so all keep their assignment.
  // One WARN per controller; later failures at INFO.
  bool first;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    first = counters_.failed_solves++ == 0;
  }
  if (first)
    LGRECO_WARN("CTRL", "solving epoch %llu failed: %s; keeping the current assignment", ull(job.epoch), what);
  else
    LGRECO_INFO("CTRL", "solving epoch %llu failed: %s; keeping the current assignment", ull(job.epoch), what);
  return nullptr;
}

std::shared_ptr<const Assignment> Controller::solve_and_log(const Job& job) {
  const Problem problem = problem_from(job);
  const auto start = std::chrono::steady_clock::now();
  Solution solution = solve_(problem, settings_.solver);
  const double solve_ms = ms_since(start);
  if (solution.choices.size() != layers_.size()) throw std::logic_error("the solver answered for other layers");

  auto assignment = std::make_shared<Assignment>();
  assignment->epoch = job.epoch;
  assignment->effective_step = job.effective_step;
  assignment->choices = solution.choices;
  uint64_t min_samples = UINT64_MAX;
  for (size_t l = 0; l < layers_.size(); ++l) {
    min_samples = std::min(min_samples, job.stats.samples(l));
    if (problem.layers[l].candidates.size() != layers_[l].candidates.size())
      assignment->choices[l] = layers_[l].default_index;  // the one-candidate stand-in
  }
  if (layers_.empty()) min_samples = 0;

  if (decision_log_) {
    const DecisionContext context{job.epoch, job.window_last_step, job.effective_step, min_samples};
    const std::string line = decision_json(context, problem, solution, solve_ms);
    fprintf(decision_log_, "%s\n", line.c_str());
    fflush(decision_log_);
  }
  LGRECO_INFO("CTRL",
              "epoch %llu (window ending at step %llu, switch at step %llu): %llu of %llu default bytes, error "
              "%.6g of budget %.6g%s, solved in %.2f ms",
              ull(job.epoch), ull(job.window_last_step), ull(job.effective_step), ull(solution.bytes),
              ull(solution.default_bytes), solution.error, solution.budget,
              solution.feasible ? "" : " (infeasible: least-error assignment)", solve_ms);
  assignment->solution = std::move(solution);
  std::lock_guard<std::mutex> lock(mutex_);
  ++counters_.solves;
  counters_.last_solve_ms = solve_ms;
  return assignment;
}

}  // namespace lgreco::controller
