#include "controller/solver.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace lgreco::controller {

std::vector<std::vector<double>> candidate_costs(const Problem& problem) {
  std::vector<std::vector<double>> costs(problem.layers.size());
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const Layer& layer = problem.layers[l];
    for (const Candidate& c : layer.candidates)
      costs[l].push_back(problem.objective == Objective::kSize
                             ? static_cast<double>(c.bytes)
                             : problem.cost_model.seconds(codec_family(c.codec), c.bytes, layer.numel));
  }
  return costs;
}

double relative_gap(const Solution& solution) {
  if (solution.lower_bound <= 0) return solution.cost > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  return (solution.cost - solution.lower_bound) / solution.lower_bound;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The problem as flat arrays: candidates of layer l are first[l] .. first[l+1]-1.
struct Flat {
  std::vector<uint32_t> first;
  std::vector<double> cost;
  std::vector<double> error;
  bool integral_costs = false;  // byte counts: rounding to whole bins can be exact

  size_t layers() const { return first.size() - 1; }
  uint32_t count(size_t l) const { return first[l + 1] - first[l]; }
  double cost_of(size_t l, uint32_t c) const { return cost[first[l] + c]; }
  double error_of(size_t l, uint32_t c) const { return error[first[l] + c]; }
};

using Choices = std::vector<uint32_t>;

Flat flatten(const Problem& problem) {
  Flat f;
  f.integral_costs = problem.objective == Objective::kSize;
  f.first.push_back(0);
  const auto costs = candidate_costs(problem);
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    for (size_t c = 0; c < costs[l].size(); ++c) {
      f.cost.push_back(costs[l][c]);
      f.error.push_back(problem.layers[l].candidates[c].error);
    }
    f.first.push_back(static_cast<uint32_t>(f.cost.size()));
  }
  return f;
}

// The one definition of an assignment's totals: summed in layer order, so that every
// feasibility decision is made on the same number.
double total_error(const Flat& f, const Choices& choices) {
  double sum = 0;
  for (size_t l = 0; l < f.layers(); ++l) sum += f.error_of(l, choices[l]);
  return sum;
}

double total_cost(const Flat& f, const Choices& choices) {
  double sum = 0;
  for (size_t l = 0; l < f.layers(); ++l) sum += f.cost_of(l, choices[l]);
  return sum;
}

// Per layer, the candidate of least error (ties: least cost, then lowest index).
Choices min_error_choices(const Flat& f) {
  Choices choices(f.layers());
  for (size_t l = 0; l < f.layers(); ++l) {
    uint32_t best = 0;
    for (uint32_t c = 1; c < f.count(l); ++c) {
      const double e = f.error_of(l, c), eb = f.error_of(l, best);
      if (e < eb || (e == eb && f.cost_of(l, c) < f.cost_of(l, best))) best = c;
    }
    choices[l] = best;
  }
  return choices;
}

// Moves layers to lower-error candidates until the exact total fits the budget, each
// time taking the move that costs least per unit of error removed. Needed only when
// floating-point rounding made an assignment infeasible by a few ulps; terminates because
// the minimum-error assignment fits (the caller checked).
void repair(const Flat& f, Choices& choices, double budget) {
  while (total_error(f, choices) > budget) {
    double best_ratio = kInf;
    size_t best_layer = 0;
    uint32_t best_candidate = UINT32_MAX;
    for (size_t l = 0; l < f.layers(); ++l) {
      const double e0 = f.error_of(l, choices[l]), s0 = f.cost_of(l, choices[l]);
      for (uint32_t c = 0; c < f.count(l); ++c) {
        const double reduction = e0 - f.error_of(l, c);
        if (reduction <= 0) continue;
        const double ratio = (f.cost_of(l, c) - s0) / reduction;
        if (best_candidate == UINT32_MAX || ratio < best_ratio) {
          best_ratio = ratio;
          best_layer = l;
          best_candidate = c;
        }
      }
    }
    if (best_candidate == UINT32_MAX) return;  // every layer at its least error
    choices[best_layer] = best_candidate;
  }
}

// Spends budget left over (from rounding, or from the greedy's stop) on cheaper
// candidates, largest saving first.
void improve(const Flat& f, Choices& choices, double budget) {
  struct Move {
    double saving, extra_error;
    uint32_t layer, candidate;
  };
  std::vector<Move> moves;
  std::vector<uint8_t> moved(f.layers());
  for (int pass = 0; pass < 4; ++pass) {
    double error = total_error(f, choices);
    const double slack = budget - error;
    if (!(slack > 0)) break;
    moves.clear();
    for (size_t l = 0; l < f.layers(); ++l) {
      const double e0 = f.error_of(l, choices[l]), s0 = f.cost_of(l, choices[l]);
      for (uint32_t c = 0; c < f.count(l); ++c) {
        const double saving = s0 - f.cost_of(l, c), extra = f.error_of(l, c) - e0;
        if (saving > 0 && extra <= slack) moves.push_back({saving, extra, static_cast<uint32_t>(l), c});
      }
    }
    if (moves.empty()) break;
    std::sort(moves.begin(), moves.end(), [](const Move& a, const Move& b) {
      if (a.saving != b.saving) return a.saving > b.saving;
      if (a.extra_error != b.extra_error) return a.extra_error < b.extra_error;
      if (a.layer != b.layer) return a.layer < b.layer;
      return a.candidate < b.candidate;
    });
    std::fill(moved.begin(), moved.end(), 0);
    bool changed = false;
    for (const Move& m : moves) {
      if (moved[m.layer] || error + m.extra_error > budget) continue;
      error += m.extra_error;
      choices[m.layer] = m.candidate;
      moved[m.layer] = 1;
      changed = true;
    }
    if (!changed) break;
  }
  repair(f, choices, budget);  // the running sum above is not the layer-order sum
}

// --- Step 1: LP relaxation over the per-layer lower convex hulls -------------------------

struct HullStep {
  double efficiency;  // cost saved per unit of error added
  double saving, extra_error;
  uint32_t layer, step;  // step i goes from hull point i to i + 1
};

struct Relaxation {
  Choices incumbent;          // feasible integer assignment
  double lower_bound = 0;     // LP value
  double lambda = 0;          // multiplier at the break (0: nothing had to stop)
  bool proven_optimal = false;
};

// Candidates of layer l on the lower convex hull of (error, cost), by increasing error.
void layer_hull(const Flat& f, size_t l, std::vector<uint32_t>& order, std::vector<uint32_t>& hull) {
  order.resize(f.count(l));
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const double ea = f.error_of(l, a), eb = f.error_of(l, b);
    if (ea != eb) return ea < eb;
    const double sa = f.cost_of(l, a), sb = f.cost_of(l, b);
    if (sa != sb) return sa < sb;
    return a < b;
  });
  hull.clear();
  for (uint32_t c : order) {
    const double e = f.error_of(l, c), s = f.cost_of(l, c);
    if (!hull.empty() && s >= f.cost_of(l, hull.back())) continue;  // dominated
    // Drop the last point while it lies on or above the chord from the one before to c.
    while (hull.size() >= 2) {
      const uint32_t a = hull[hull.size() - 2], b = hull.back();
      const double ea = f.error_of(l, a), sa = f.cost_of(l, a);
      const double eb = f.error_of(l, b), sb = f.cost_of(l, b);
      if ((sb - sa) * (e - ea) >= (s - sa) * (eb - ea)) {
        hull.pop_back();
      } else {
        break;
      }
    }
    hull.push_back(c);
  }
}

Relaxation relax(const Flat& f, double budget) {
  const size_t layers = f.layers();
  std::vector<uint32_t> hull_first{0}, hull_points, order, hull;
  std::vector<HullStep> steps;
  for (size_t l = 0; l < layers; ++l) {
    layer_hull(f, l, order, hull);
    double previous = kInf;
    for (size_t i = 0; i + 1 < hull.size(); ++i) {
      const double saving = f.cost_of(l, hull[i]) - f.cost_of(l, hull[i + 1]);
      const double extra = f.error_of(l, hull[i + 1]) - f.error_of(l, hull[i]);
      // Convexity makes efficiencies decrease along the hull; clamp so that rounding can
      // never order a step before its predecessor.
      const double efficiency = std::min(previous, saving / extra);
      previous = efficiency;
      steps.push_back({efficiency, saving, extra, static_cast<uint32_t>(l), static_cast<uint32_t>(i)});
    }
    hull_points.insert(hull_points.end(), hull.begin(), hull.end());
    hull_first.push_back(static_cast<uint32_t>(hull_points.size()));
  }
  std::sort(steps.begin(), steps.end(), [](const HullStep& a, const HullStep& b) {
    if (a.efficiency != b.efficiency) return a.efficiency > b.efficiency;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.step < b.step;
  });

  std::vector<uint32_t> position(layers, 0);
  std::vector<uint8_t> blocked(layers, 0);
  Choices start(layers);
  for (size_t l = 0; l < layers; ++l) start[l] = hull_points[hull_first[l]];
  double cost = total_cost(f, start);
  double slack = budget - total_error(f, start);
  Relaxation r;
  bool broken = false;
  for (const HullStep& s : steps) {
    if (blocked[s.layer] || position[s.layer] != s.step) continue;
    if (s.extra_error <= slack) {
      ++position[s.layer];
      slack -= s.extra_error;
      cost -= s.saving;
      continue;
    }
    if (!broken) {
      broken = true;
      r.lambda = s.efficiency;
      r.lower_bound = cost - s.saving * (std::max(slack, 0.0) / s.extra_error);
    }
    blocked[s.layer] = 1;  // past the break: keep walking other layers greedily
  }
  r.incumbent.resize(layers);
  for (size_t l = 0; l < layers; ++l) r.incumbent[l] = hull_points[hull_first[l] + position[l]];
  if (!broken) {  // every layer reached its cheapest candidate: optimal
    r.proven_optimal = true;
    r.lower_bound = total_cost(f, r.incumbent);
  }
  return r;
}

// --- Steps 2 and 3: Lagrangian reduction, then a DP over the core ------------------------

struct Refinement {
  Choices choices;
  double lower_bound = 0;  // valid when ran
  uint32_t core_layers = 0;
  double bin_width = 0;
  bool ran = false;
};

Refinement refine(const Flat& f, const Relaxation& r, double incumbent_cost, double budget,
                  const SolverOptions& options) {
  const size_t layers = f.layers();
  Refinement out;
  const double gap = incumbent_cost - r.lower_bound;
  if (!std::isfinite(r.lambda)) return out;
  // Keep a candidate only if its reduced cost fits in the gap (with room for rounding).
  const double keep_limit = gap + 1e-9 * std::max(std::abs(incumbent_cost), 1e-300);

  std::vector<uint32_t> kept_first{0}, kept;  // per layer, its Pareto-efficient survivors
  std::vector<uint32_t> candidates, order;
  for (size_t l = 0; l < layers; ++l) {
    double floor_value = kInf;
    for (uint32_t c = 0; c < f.count(l); ++c)
      floor_value = std::min(floor_value, f.cost_of(l, c) + r.lambda * f.error_of(l, c));
    candidates.clear();
    for (uint32_t c = 0; c < f.count(l); ++c) {
      const double reduced = f.cost_of(l, c) + r.lambda * f.error_of(l, c) - floor_value;
      if (reduced <= keep_limit || c == r.incumbent[l]) candidates.push_back(c);
    }
    std::sort(candidates.begin(), candidates.end(), [&](uint32_t a, uint32_t b) {
      const double ea = f.error_of(l, a), eb = f.error_of(l, b);
      if (ea != eb) return ea < eb;
      const double sa = f.cost_of(l, a), sb = f.cost_of(l, b);
      if (sa != sb) return sa < sb;
      return a < b;
    });
    for (uint32_t c : candidates)  // drop dominated: more error for no less cost
      if (kept.size() == kept_first.back() || f.cost_of(l, c) < f.cost_of(l, kept.back())) kept.push_back(c);
    kept_first.push_back(static_cast<uint32_t>(kept.size()));
  }

  std::vector<uint32_t> core;
  double fixed_cost = 0, fixed_error = 0, base_cost = 0;
  out.choices.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    const uint32_t n = kept_first[l + 1] - kept_first[l];
    if (n == 1) {
      out.choices[l] = kept[kept_first[l]];
      fixed_cost += f.cost_of(l, out.choices[l]);
      fixed_error += f.error_of(l, out.choices[l]);
    } else {
      core.push_back(static_cast<uint32_t>(l));
      base_cost += f.cost_of(l, kept[kept_first[l + 1] - 1]);  // the cheapest survivor
    }
  }
  const double n_core = static_cast<double>(core.size());
  out.core_layers = static_cast<uint32_t>(core.size());
  if (core.empty()) {
    out.ran = true;
    out.lower_bound = fixed_cost;
    return out;
  }

  // Bin width: n_core bins of rounding may cost at most tolerance x the optimum (>= the
  // lower bound); widen if the table would exceed its cap.
  const double extra_limit = std::max(incumbent_cost - fixed_cost - base_cost, 0.0);
  // Two rows of 8-byte errors per bin besides the table: cap the bins too.
  const double max_bins = std::min(static_cast<double>(options.max_table_cells) / n_core, double{1 << 20});
  double width = options.tolerance * std::max(r.lower_bound, 0.0) / n_core;
  if (f.integral_costs) width = std::max(1.0, std::floor(width));
  auto bins_for = [&](double w) { return std::floor(extra_limit / w) + n_core + 1; };
  if (!(width > 0) || bins_for(width) > max_bins) {
    const double resolution = max_bins - n_core - 1;
    if (resolution < n_core) return out;  // too coarse to help: keep the incumbent
    width = std::max(width, extra_limit / resolution);
    if (f.integral_costs) width = std::ceil(width);
    if (!(width > 0) || bins_for(width) > max_bins) return out;
  }
  const size_t bins = static_cast<size_t>(bins_for(width));
  out.bin_width = width;

  // A candidate's extra cost over its layer's cheapest survivor, in bins, rounded up
  // (capped at `bins`, which no table index reaches).
  auto bins_of = [&](size_t l, uint32_t c) {
    const double base = f.cost_of(l, kept[kept_first[l + 1] - 1]);
    return static_cast<size_t>(std::min(std::ceil((f.cost_of(l, c) - base) / width), static_cast<double>(bins)));
  };

  // least_error[b]: least error of the core layers so far with rounded extra cost b.
  std::vector<double> least_error(bins, kInf), next(bins);
  std::vector<uint8_t> table(core.size() * bins);
  std::vector<size_t> weight;
  least_error[0] = 0;
  size_t reach = 0;  // highest bin reachable so far
  for (size_t k = 0; k < core.size(); ++k) {
    const size_t l = core[k];
    const uint32_t begin = kept_first[l], end = kept_first[l + 1];
    weight.clear();
    for (uint32_t i = begin; i < end; ++i) weight.push_back(bins_of(l, kept[i]));
    const size_t top = std::min(bins - 1, reach + *std::max_element(weight.begin(), weight.end()));
    std::fill(next.begin(), next.begin() + top + 1, kInf);
    uint8_t* row = &table[k * bins];
    for (uint32_t i = 0; i < end - begin; ++i) {
      const size_t w = weight[i];
      const double e = f.error_of(l, kept[begin + i]);
      for (size_t b = w; b <= top && b - w <= reach; ++b) {
        const double v = least_error[b - w] + e;
        if (v < next[b]) {
          next[b] = v;
          row[b] = static_cast<uint8_t>(i);
        }
      }
    }
    reach = top;
    std::swap(least_error, next);
  }
  // Summed in another order than total_error(): allow for rounding, so that no truly
  // feasible assignment is excluded (the bound below relies on it); the caller re-checks
  // and repairs the answer on the exact sum.
  const double core_budget = (budget - fixed_error) + 1e-12 * std::max(budget, 0.0);
  size_t best = bins;
  for (size_t b = 0; b <= reach; ++b)
    if (least_error[b] <= core_budget) {
      best = b;
      break;
    }
  if (best == bins) return out;  // rounding in the budget split: keep the incumbent
  // Every feasible assignment over the survivors has rounded cost >= best bins, and
  // rounding up added less than one bin (integral costs: at most width - 1) per core layer.
  const double per_layer_rounding = f.integral_costs ? width - 1 : width;
  out.lower_bound = fixed_cost + base_cost + static_cast<double>(best) * width - n_core * per_layer_rounding;
  for (size_t k = core.size(); k-- > 0;) {
    const size_t l = core[k];
    out.choices[l] = kept[kept_first[l] + table[k * bins + best]];
    best -= bins_of(l, out.choices[l]);
  }
  out.ran = true;
  return out;
}

}  // namespace

Solution solve(const Problem& problem, const SolverOptions& options) {
  validate(problem);
  const Flat f = flatten(problem);
  const size_t layers = f.layers();

  Solution s;
  Choices defaults(layers);
  for (size_t l = 0; l < layers; ++l) defaults[l] = problem.layers[l].default_index;
  s.default_error = total_error(f, defaults);
  s.default_cost = total_cost(f, defaults);
  s.budget = problem.alpha * s.default_error;

  Choices choices = min_error_choices(f);
  if (total_error(f, choices) > s.budget) {
    s.feasible = false;
  } else {
    const Relaxation r = relax(f, s.budget);
    choices = r.incumbent;
    repair(f, choices, s.budget);
    double cost = total_cost(f, choices);
    // With alpha >= 1 the defaults fit the budget by definition: never answer worse.
    if (total_error(f, defaults) <= s.budget && s.default_cost < cost) {
      choices = defaults;
      cost = s.default_cost;
    }
    s.lower_bound = std::min(r.lower_bound, cost);
    // Refine only when the incumbent is not yet proven within tolerance: the DP's own
    // guarantee (tolerance x optimum) could not improve on it otherwise.
    if (!r.proven_optimal && cost - s.lower_bound > options.tolerance * s.lower_bound) {
      Refinement refined = refine(f, r, cost, s.budget, options);
      if (refined.ran) {
        s.core_layers = refined.core_layers;
        s.bin_width = refined.bin_width;
        repair(f, refined.choices, s.budget);
        const double refined_cost = total_cost(f, refined.choices);
        if (refined_cost < cost ||
            (refined_cost == cost && total_error(f, refined.choices) < total_error(f, choices))) {
          choices = std::move(refined.choices);
          cost = refined_cost;
        }
        // Assignments outside the survivors cost at least the incumbent.
        s.lower_bound = std::max(s.lower_bound, std::min(refined.lower_bound, cost));
      }
    }
    improve(f, choices, s.budget);
  }

  s.choices = choices;
  s.error = total_error(f, choices);
  s.cost = total_cost(f, choices);
  s.lower_bound = std::min(s.lower_bound, s.cost);
  for (size_t l = 0; l < layers; ++l) {
    s.bytes += problem.layers[l].candidates[choices[l]].bytes;
    s.default_bytes += problem.layers[l].candidates[defaults[l]].bytes;
  }
  if (!s.feasible) s.lower_bound = 0;
  return s;
}

}  // namespace lgreco::controller
