// JSON in and out of the controller: the problem lgreco-solve reads, the answer it
// prints, and the controller's decision-log lines. docs/CONTROLLER.md specifies the
// fields; parsing is strict (unknown keys are errors) so that a typo is never ignored.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "controller/problem.h"
#include "controller/solver.h"

namespace lgreco::controller {

// Parses a problem document and validates it. Throws ProblemError naming the field
// ("layers[2] (fc1).candidates[0].bytes: -5; expected a non-negative integer"), or the
// line and column when the text is not JSON.
Problem parse_problem_json(std::string_view text);

// The solution object lgreco-solve prints (one line).
std::string solution_json(const Problem& problem, const Solution& solution, double solve_ms);

// What one decision-log line records besides the solution.
struct DecisionContext {
  uint64_t epoch = 0;            // 1 for the first solved assignment
  uint64_t stats_last_step = 0;  // last step of the measurement window
  uint64_t effective_step = 0;   // first step that uses the assignment
  uint64_t samples = 0;          // steps per layer behind the errors
  // The closed loop on the realized error (controller.h): the alpha the solve used and the
  // window's measurements of the assignment in effect during it.
  double alpha = 1, alpha_eff = 1, loop_bias = 1;
  double window_realized = 0, window_predicted = 0, window_budget = 0;
  const char* metric = nullptr;                         // the error metric's name, or null
  const std::vector<double>* layer_realized = nullptr;  // per layer, or null
  std::span<const double> layer_drift;                  // per layer, or empty
  // Per layer, or empty: the choice's predicted and the window's realized error relative
  // to the gradient's energy per coordinate (controller.h, Assignment::relative), and the
  // bound the solve held the first to (0: none).
  std::span<const double> layer_relative, layer_window_relative, layer_relative_bound;
  bool kept_defaults = false;  // Assignment::kept_defaults
};

// The decision log's format version, its first field ("log_version"). Readers (`lgreco
// plot`) refuse other versions by name; a change that renames or redefines a field bumps
// it, a new field does not.
inline constexpr int kDecisionLogVersion = 1;

// One line (no newline): the format version, the context, the solution summary and, per
// layer, the chosen codec with its bytes and error.
std::string decision_json(const DecisionContext& context, const Problem& problem, const Solution& solution,
                          double solve_ms);

}  // namespace lgreco::controller
