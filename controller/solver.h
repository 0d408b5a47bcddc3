// The L-GreCo solver: a multiple-choice knapsack over layers (controller/problem.h).
//
// How it works (docs/CONTROLLER.md has the details):
//  1. Per layer, the candidates on the lower convex hull of (error, cost). Walking all hull
//     steps across layers in order of cost saved per unit of error spent solves the LP
//     relaxation exactly: its value is a lower bound on the optimum, its break-point slope
//     is the Lagrange multiplier lambda, and two greedy walks (one stopping before the
//     break step, one taking it and undoing cheaper steps) give feasible incumbents; so
//     do the defaults when alpha >= 1.
//  2. Unless the best incumbent is already proven within the tolerance: Lagrangian
//     reduction. A candidate whose reduced cost s + lambda*e - min_c(s + lambda*e) exceeds
//     (incumbent - lower bound) cannot be in any assignment cheaper than the incumbent;
//     layers left with one candidate are fixed.
//  3. The remaining "core" layers are split. The few with the widest cost ranges go into
//     a dynamic programme over a discretised cost axis (bins of width Delta, each
//     candidate's extra cost rounded up, errors exact: per bin the least error); the rest
//     stay relaxed (their LP optimum as a function of the error they are left) and are
//     filled greedily. The split is chosen to minimise the proven loss of both (rounding:
//     at most one bin per DP layer; greedy: at most one relaxed layer's range) within the
//     table's cap, and Delta no finer than the tolerance needs. Because errors are never
//     rounded, no budget is wasted, unlike the reference's DP over an error axis of
//     10,000 bins (7% of the budget unused at 1,000 layers, docs/PERF.md).
//  4. Every answer is re-checked on the undiscretised errors, repaired if floating-point
//     rounding made it infeasible, then improved greedily with any budget left.
//
// Deterministic: one thread, no unordered containers, total orders with index tie-breaks
// and a fixed summation order (layer order) for every total, so every rank that solves
// the same problem reaches the same answer bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "controller/problem.h"

namespace lgreco::controller {

struct SolverOptions {
  // The returned cost is within this fraction of the optimum (0.001: 0.1%), unless the
  // refinement's table would exceed max_table_cells; Solution::lower_bound says what was
  // proven either way.
  double tolerance = 1e-3;
  // Core layers x cost bins of the refinement's table (its memory is one byte per cell
  // plus 16 bytes per bin).
  uint64_t max_table_cells = uint64_t{1} << 22;
};

struct Solution {
  std::vector<uint32_t> choices;  // candidate index per layer
  // False when no assignment meets the budget (possible with alpha < 1): choices are then
  // the minimum-error assignment.
  bool feasible = true;
  double cost = 0;  // objective value: bytes (as a double) or seconds
  uint64_t bytes = 0;
  double error = 0;   // sum of the chosen errors, in layer order
  double budget = 0;  // alpha x default_error
  double default_cost = 0;
  uint64_t default_bytes = 0;
  double default_error = 0;
  // No feasible assignment costs less (up to floating-point rounding). Equal to cost when
  // the optimum was proven; 0 when infeasible.
  double lower_bound = 0;
  uint32_t core_layers = 0;  // layers the refinement left open (0: not needed)
  double bin_width = 0;      // the refinement's cost discretisation (0: not run)
};

// Throws ProblemError when the problem is invalid (validate()).
Solution solve(const Problem& problem, const SolverOptions& options = {});

// The objective cost of every candidate of every layer: its bytes, or its predicted
// seconds under the problem's cost model.
std::vector<std::vector<double>> candidate_costs(const Problem& problem);

// (cost - lower_bound) / lower_bound; 0 when both are 0.
double relative_gap(const Solution& solution);

}  // namespace lgreco::controller
