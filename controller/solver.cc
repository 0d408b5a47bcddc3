#include "controller/solver.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "kernels/cpu_dispatch.h"

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
  int error_shift = 0;          // errors here are the problem's times 2^error_shift

  size_t layers() const { return first.size() - 1; }
  uint32_t count(size_t l) const { return first[l + 1] - first[l]; }
  double cost_of(size_t l, uint32_t c) const { return cost[first[l] + c]; }
  double error_of(size_t l, uint32_t c) const { return error[first[l] + c]; }
};

using Choices = std::vector<uint32_t>;

// Errors are multiplied by 2^error_shift so that the budget is near 1 (the errors that
// matter are at most the budget), without letting the largest error overflow and, where
// possible, keeping every positive error a normal number. Scaling by a power of two
// commutes exactly with addition and comparison of normal numbers, so feasibility
// decisions are the same as on the problem's errors; what it buys is that ratios of cost
// to error (hull-step efficiencies, the Lagrange multiplier) stay finite.
int error_shift(const Problem& problem, double budget) {
  double largest = 0, smallest = std::numeric_limits<double>::infinity();
  for (const Layer& layer : problem.layers)
    for (const Candidate& c : layer.candidates)
      if (c.error > 0) {
        largest = std::max(largest, c.error);
        smallest = std::min(smallest, c.error);
      }
  if (!(largest > 0)) return 0;
  int exponent_reference, exponent_largest, exponent_smallest;  // x = m 2^e, m in [0.5, 1)
  std::frexp(budget > 0 ? budget : largest, &exponent_reference);
  std::frexp(largest, &exponent_largest);
  std::frexp(smallest, &exponent_smallest);
  return std::min(std::max(-exponent_reference, -1021 - exponent_smallest), 960 - exponent_largest);
}

Flat flatten(const Problem& problem, double budget) {
  Flat f;
  f.integral_costs = problem.objective == Objective::kSize;
  f.error_shift = error_shift(problem, budget);
  f.first.push_back(0);
  const auto costs = candidate_costs(problem);
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    for (size_t c = 0; c < costs[l].size(); ++c) {
      f.cost.push_back(costs[l][c]);
      f.error.push_back(std::ldexp(problem.layers[l].candidates[c].error, f.error_shift));
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
  const Choices before = choices;
  const double before_cost = total_cost(f, choices);
  struct Move {
    double saving, extra_error;
    uint32_t layer, candidate;
  };
  std::vector<Move> moves;
  std::vector<uint8_t> moved(f.layers());
  for (int pass = 0; pass < 4; ++pass) {
    double error = total_error(f, choices);
    if (!(error < budget)) break;
    moves.clear();
    for (size_t l = 0; l < f.layers(); ++l) {
      const double e0 = f.error_of(l, choices[l]), s0 = f.cost_of(l, choices[l]);
      for (uint32_t c = 0; c < f.count(l); ++c) {
        const double saving = s0 - f.cost_of(l, c), extra = f.error_of(l, c) - e0;
        if (saving > 0 && error + extra <= budget) moves.push_back({saving, extra, static_cast<uint32_t>(l), c});
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
  if (total_cost(f, choices) > before_cost) choices = before;
}

// --- Hulls and the greedy walk -----------------------------------------------------------

struct HullStep {
  double efficiency;  // cost saved per unit of error added
  double saving, extra_error;
  uint32_t layer, step;  // layer: index within the walk; step i goes from hull point i to i + 1
};

// Sorts candidates of layer l by error, then cost, then index.
void sort_by_error(const Flat& f, size_t l, std::vector<uint32_t>& candidates) {
  std::sort(candidates.begin(), candidates.end(), [&](uint32_t a, uint32_t b) {
    const double ea = f.error_of(l, a), eb = f.error_of(l, b);
    if (ea != eb) return ea < eb;
    const double sa = f.cost_of(l, a), sb = f.cost_of(l, b);
    if (sa != sb) return sa < sb;
    return a < b;
  });
}

// Of candidates sorted by error, keeps those on the lower convex hull of (error, cost).
void lower_hull(const Flat& f, size_t l, std::vector<uint32_t>& candidates) {
  size_t n = 0;  // candidates[0, n) is the hull so far
  for (uint32_t c : candidates) {
    const double e = f.error_of(l, c), s = f.cost_of(l, c);
    if (n > 0 && s >= f.cost_of(l, candidates[n - 1])) continue;  // dominated
    // Drop the last point while it lies on or above the chord from the one before to c.
    while (n >= 2) {
      const uint32_t a = candidates[n - 2], b = candidates[n - 1];
      const double ea = f.error_of(l, a), sa = f.cost_of(l, a);
      const double eb = f.error_of(l, b), sb = f.cost_of(l, b);
      if ((sb - sa) * (e - ea) < (s - sa) * (eb - ea)) break;
      --n;
    }
    candidates[n++] = c;
  }
  candidates.resize(n);
}

// A set of layers relaxed to the lower convex hulls of their candidates. All hull steps,
// in order of cost saved per error added, trace the LP relaxation's optimum as a function
// of the error allowed (convex, piecewise linear); taking them greedily gives integer
// assignments within one step of it.
class HullWalk {
 public:
  // layers: global layer indices; candidates_of(l, list) fills the candidates layer l may use.
  template <typename CandidatesOf>
  HullWalk(const Flat& f, std::vector<uint32_t> layers, CandidatesOf candidates_of) : layers_(std::move(layers)) {
    std::vector<uint32_t> list;
    hull_first_.push_back(0);
    for (uint32_t j = 0; j < layers_.size(); ++j) {
      const size_t l = layers_[j];
      candidates_of(l, list);
      sort_by_error(f, l, list);
      lower_hull(f, l, list);
      double previous = kInf;
      for (size_t i = 0; i + 1 < list.size(); ++i) {
        const double saving = f.cost_of(l, list[i]) - f.cost_of(l, list[i + 1]);
        const double extra = f.error_of(l, list[i + 1]) - f.error_of(l, list[i]);
        // Convexity makes efficiencies decrease along a hull; clamp so that rounding can
        // never order a step before its predecessor.
        const double efficiency = std::min(previous, saving / extra);
        previous = efficiency;
        steps_.push_back({efficiency, saving, extra, j, static_cast<uint32_t>(i)});
      }
      start_cost_ += f.cost_of(l, list[0]);
      start_error_ += f.error_of(l, list[0]);
      hull_.insert(hull_.end(), list.begin(), list.end());
      hull_first_.push_back(static_cast<uint32_t>(hull_.size()));
    }
    std::sort(steps_.begin(), steps_.end(), [](const HullStep& a, const HullStep& b) {
      if (a.efficiency != b.efficiency) return a.efficiency > b.efficiency;
      if (a.layer != b.layer) return a.layer < b.layer;
      return a.step < b.step;
    });
    cum_extra_.assign(1, 0.0);
    cum_saving_.assign(1, 0.0);
    for (const HullStep& s : steps_) {
      cum_extra_.push_back(cum_extra_.back() + s.extra_error);
      cum_saving_.push_back(cum_saving_.back() + s.saving);
    }
  }

  double least_error() const { return start_error_; }
  size_t step_count() const { return steps_.size(); }
  const HullStep& step(size_t i) const { return steps_[i]; }

  // The first step that does not fit in `room` (step_count() when all fit).
  size_t break_at(double room) const {
    const double r = room - start_error_;
    return static_cast<size_t>(std::upper_bound(cum_extra_.begin() + 1, cum_extra_.end(), r) - cum_extra_.begin()) - 1;
  }

  // The LP optimum of these layers within `room` error; +inf below least_error(). If the
  // break falls among steps whose cost-to-error ratio overflowed, their order is not known
  // exactly, and the bound falls back to every layer at its cheapest (valid, if weak).
  double lp_cost(double room) const {
    const double r = room - start_error_;
    if (r < 0) return kInf;
    const size_t i = break_at(room);
    if (i < steps_.size() && !std::isfinite(steps_[i].efficiency)) return start_cost_ - cum_saving_.back();
    double cost = start_cost_ - cum_saving_[i];
    if (i < steps_.size()) cost -= steps_[i].saving * ((r - cum_extra_[i]) / steps_[i].extra_error);
    return cost;
  }

  // Every layer at the cheapest end of its hull.
  void cheapest(Choices& out) const {
    for (size_t j = 0; j < layers_.size(); ++j) out[layers_[j]] = hull_[hull_first_[j + 1] - 1];
  }

  // Steps in order, each taken if it still fits; a layer stops at its first step that
  // does not. Writes the chosen candidates of these layers into `out`.
  void greedy(double room, Choices& out) const {
    std::vector<uint32_t> position(layers_.size(), 0);
    fill(position, room - start_error_, 0, UINT32_MAX);
    write(position, out);
  }

  // Takes the break step, undoes the least efficient steps taken before it until the
  // room fits again, then continues greedily. Better than greedy() when the break falls on
  // a big layer that many small ones can pay for. False when nothing fits.
  bool greedy_through_break(double room, Choices& out) const {
    const size_t at = break_at(room);
    if (at == steps_.size()) return false;
    std::vector<uint32_t> position(layers_.size(), 0);
    for (size_t i = 0; i <= at; ++i) ++position[steps_[i].layer];
    double left = room - start_error_ - cum_extra_[at + 1];
    for (size_t i = at; i-- > 0 && left < 0;) {
      if (steps_[i].layer == steps_[at].layer) continue;
      --position[steps_[i].layer];
      left += steps_[i].extra_error;
    }
    if (left < 0) return false;
    fill(position, left, at + 1, steps_[at].layer);
    write(position, out);
    return true;
  }

 private:
  void fill(std::vector<uint32_t>& position, double left, size_t from, uint32_t blocked_layer) const {
    std::vector<uint8_t> blocked(layers_.size(), 0);
    if (blocked_layer != UINT32_MAX) blocked[blocked_layer] = 1;
    for (size_t i = from; i < steps_.size(); ++i) {
      const HullStep& s = steps_[i];
      if (blocked[s.layer] || position[s.layer] != s.step) continue;
      if (s.extra_error <= left) {
        ++position[s.layer];
        left -= s.extra_error;
      } else {
        blocked[s.layer] = 1;
      }
    }
  }
  void write(const std::vector<uint32_t>& position, Choices& out) const {
    for (size_t j = 0; j < layers_.size(); ++j) out[layers_[j]] = hull_[hull_first_[j] + position[j]];
  }

  std::vector<uint32_t> layers_;
  std::vector<uint32_t> hull_first_, hull_;  // hull points of walk layer j
  std::vector<HullStep> steps_;
  std::vector<double> cum_extra_, cum_saving_;  // over the first i steps
  double start_cost_ = 0, start_error_ = 0;     // every layer at its least-error hull point
};

// --- Step 1: the LP relaxation of the whole problem --------------------------------------

struct Relaxation {
  std::vector<Choices> incumbents;  // integer assignments within the budget (up to rounding)
  double lower_bound = 0;           // the LP optimum
  double lambda = 0;                // its multiplier: the efficiency of the break step
  bool proven_optimal = false;      // every layer reached its cheapest candidate
};

Relaxation relax(const Flat& f, double budget) {
  std::vector<uint32_t> all(f.layers());
  std::iota(all.begin(), all.end(), 0u);
  const HullWalk walk(f, all, [&f](size_t l, std::vector<uint32_t>& list) {
    list.resize(f.count(l));
    std::iota(list.begin(), list.end(), 0u);
  });
  Relaxation r;
  r.incumbents.emplace_back(f.layers());
  const size_t at = walk.break_at(budget);
  if (at == walk.step_count()) {
    // Every step fits: every layer at its cheapest candidate, which no assignment beats.
    walk.cheapest(r.incumbents[0]);
    r.proven_optimal = true;
    r.lower_bound = total_cost(f, r.incumbents[0]);
    return r;
  }
  walk.greedy(budget, r.incumbents[0]);
  r.lambda = walk.step(at).efficiency;
  r.lower_bound = walk.lp_cost(budget);
  Choices through(f.layers());
  if (walk.greedy_through_break(budget, through)) r.incumbents.push_back(std::move(through));
  return r;
}

// --- Steps 2 and 3: Lagrangian reduction, then a DP over the big core layers -------------

// The DP's inner loop: bins w..last take candidate `tag` (weight w, error e) where it
// lowers their error. Branch-free so that it vectorizes; the AVX2 clone gives the same
// bits (one add and one compare per bin), so dispatch cannot make ranks disagree.
LGRECO_MULTIVERSION void relax_bins(const double* from, double* to, uint8_t* row, size_t w, size_t last, double e,
                                    uint8_t tag) {
  for (size_t b = w; b <= last; ++b) {
    const double v = from[b - w] + e;
    const bool better = v < to[b];
    to[b] = better ? v : to[b];
    row[b] = better ? tag : row[b];
  }
}

struct Refinement {
  std::vector<Choices> candidates;  // assignments to evaluate (up to rounding within budget)
  double lower_bound = 0;           // valid for assignments using only the survivors
  uint32_t core_layers = 0;
  double bin_width = 0;
  bool ran = false;
};

Refinement refine(const Flat& f, const Relaxation& r, const Choices& incumbent, double incumbent_cost, double budget,
                  const SolverOptions& options) {
  const size_t layers = f.layers();
  Refinement out;
  if (!std::isfinite(r.lambda)) return out;

  // Reduction: a candidate whose reduced cost exceeds the gap cannot be in an assignment
  // cheaper than the incumbent (with room for rounding).
  const double keep_limit = (incumbent_cost - r.lower_bound) + 1e-9 * std::max(std::abs(incumbent_cost), 1e-300);
  std::vector<uint32_t> kept_first{0}, kept;  // per layer, its Pareto-efficient survivors
  std::vector<uint32_t> list;
  for (size_t l = 0; l < layers; ++l) {
    double floor_value = kInf;
    for (uint32_t c = 0; c < f.count(l); ++c)
      floor_value = std::min(floor_value, f.cost_of(l, c) + r.lambda * f.error_of(l, c));
    list.clear();
    for (uint32_t c = 0; c < f.count(l); ++c)
      if (f.cost_of(l, c) + r.lambda * f.error_of(l, c) - floor_value <= keep_limit || c == incumbent[l])
        list.push_back(c);
    sort_by_error(f, l, list);
    for (uint32_t c : list)  // drop dominated: more error for no less cost
      if (kept.size() == kept_first.back() || f.cost_of(l, c) < f.cost_of(l, kept.back())) kept.push_back(c);
    kept_first.push_back(static_cast<uint32_t>(kept.size()));
  }
  auto cheapest = [&](size_t l) { return kept[kept_first[l + 1] - 1]; };
  auto range = [&](size_t l) { return f.cost_of(l, kept[kept_first[l]]) - f.cost_of(l, cheapest(l)); };

  Choices fixed(layers);
  std::vector<uint32_t> core;
  double fixed_cost = 0, fixed_error = 0;
  for (size_t l = 0; l < layers; ++l) {
    if (kept_first[l + 1] - kept_first[l] == 1) {
      fixed[l] = kept[kept_first[l]];
      fixed_cost += f.cost_of(l, fixed[l]);
      fixed_error += f.error_of(l, fixed[l]);
    } else {
      core.push_back(static_cast<uint32_t>(l));
    }
  }
  out.core_layers = static_cast<uint32_t>(core.size());

  // Split the core: the k layers of widest cost range go to the DP ("big"), the rest
  // stay relaxed ("small") and are filled greedily, which costs at most one small
  // layer's range over their LP optimum. The DP's rounding costs at most k bins (k times
  // width - 1 for whole bytes). Choose k for the least sum of the two, given the cap.
  std::vector<uint32_t> by_range = core;
  std::stable_sort(by_range.begin(), by_range.end(), [&](uint32_t a, uint32_t b) { return range(a) > range(b); });
  const double cap = static_cast<double>(options.max_table_cells);
  const double min_width = f.integral_costs ? 1.0 : 0.0;
  size_t big = 0;
  double width = 0, best_bound = by_range.empty() ? 0 : range(by_range[0]), big_range = 0;
  for (size_t k = 1; k <= by_range.size(); ++k) {
    big_range += range(by_range[k - 1]);
    const double bins_per_layer = std::min(cap / static_cast<double>(k), double{1 << 20}) - static_cast<double>(k) - 1;
    if (bins_per_layer < static_cast<double>(k)) break;  // the table cannot hold k layers usefully
    double w = std::max(min_width, big_range / bins_per_layer);
    if (f.integral_costs) w = std::ceil(w);
    if (!(w > 0) || !std::isfinite(w)) break;              // ranges too small to discretise
    const double rounding = f.integral_costs ? w - 1 : w;  // whole bytes in 1-byte bins round exactly
    const double bound = (k < by_range.size() ? range(by_range[k]) : 0.0) + static_cast<double>(k) * rounding;
    if (bound < best_bound) {
      best_bound = bound;
      big = k;
      width = w;
    }
  }
  // No finer than the tolerance needs, (tolerance x bound - small loss) over k layers,
  // unless the finest table is small anyway (then small problems come out exact).
  if (big > 0 && static_cast<double>(big) * (big_range / width + static_cast<double>(big) + 1) > 65536) {
    const double small_loss = big < by_range.size() ? range(by_range[big]) : 0.0;
    const double target = (options.tolerance * std::max(r.lower_bound, 0.0) - small_loss) / static_cast<double>(big);
    if (target > width) width = f.integral_costs ? std::max(1.0, std::floor(target)) : target;
  }
  std::vector<uint32_t> big_layers(by_range.begin(), by_range.begin() + big);
  std::vector<uint32_t> small_layers(by_range.begin() + big, by_range.end());
  std::sort(big_layers.begin(), big_layers.end());
  std::sort(small_layers.begin(), small_layers.end());
  const HullWalk small(f, small_layers, [&](size_t l, std::vector<uint32_t>& c) {
    c.assign(kept.begin() + kept_first[l], kept.begin() + kept_first[l + 1]);
  });

  // DP over the big layers: least_error[b] is their least error with rounded extra cost b
  // (over each layer's cheapest survivor). Bins beyond the incumbent's cost are useless.
  double big_base = 0;
  for (uint32_t l : big_layers) big_base += f.cost_of(l, cheapest(l));
  const double per_layer_rounding = f.integral_costs ? width - 1 : width;
  size_t bins = 1;
  if (big > 0) {
    double useful = std::min(big_range, std::max(incumbent_cost - fixed_cost - big_base, 0.0));
    bins = static_cast<size_t>(std::min(std::floor(useful / width) + static_cast<double>(big) + 1, cap / big));
    out.bin_width = width;
  }
  auto bins_of = [&](size_t l, uint32_t c) {
    return static_cast<size_t>(
        std::min(std::ceil((f.cost_of(l, c) - f.cost_of(l, cheapest(l))) / width), static_cast<double>(bins)));
  };
  std::vector<double> least_error(bins, kInf), next(bins);
  std::vector<uint8_t> table(big * bins);
  least_error[0] = 0;
  size_t reach = 0;  // highest bin reachable so far
  for (size_t k = 0; k < big; ++k) {
    const size_t l = big_layers[k];
    const uint32_t begin = kept_first[l], end = kept_first[l + 1];
    size_t top = reach;
    for (uint32_t i = begin; i < end; ++i) top = std::max(top, std::min(bins - 1, reach + bins_of(l, kept[i])));
    std::fill(next.begin(), next.begin() + top + 1, kInf);
    uint8_t* row = &table[k * bins];
    for (uint32_t i = begin; i < end; ++i) {
      const size_t w = bins_of(l, kept[i]);
      if (w <= top)
        relax_bins(least_error.data(), next.data(), row, w, std::min(top, reach + w), f.error_of(l, kept[i]),
                   static_cast<uint8_t>(i - begin));
    }
    reach = top;
    std::swap(least_error, next);
  }

  // Combine: each bin's big-layer error leaves the rest of the budget to the small layers.
  // Summed in another order than total_error(): allow for rounding, so that no truly
  // feasible assignment is excluded (the bound relies on it); the caller re-checks.
  const double core_budget = (budget - fixed_error) + 1e-12 * std::max(budget, 0.0);
  struct Option {
    double estimate;
    size_t bin;
  };
  std::vector<Option> options_by_bin;
  double bound = kInf;
  for (size_t b = 0; b <= reach; ++b) {
    if (!(least_error[b] < kInf)) continue;
    const double small_cost = small.lp_cost(core_budget - least_error[b]);
    if (!(small_cost < kInf)) continue;
    const double rounded = static_cast<double>(b) * width;
    // The big layers cost at least rounded - (rounding per layer), and at least nothing.
    bound =
        std::min(bound, big_base + std::max(0.0, rounded - static_cast<double>(big) * per_layer_rounding) + small_cost);
    options_by_bin.push_back({big_base + rounded + small_cost, b});
  }
  if (options_by_bin.empty()) return out;  // rounding in the budget split: keep the incumbent
  out.lower_bound = fixed_cost + bound;
  // Assignments for the most promising bins: big layers from the table, small ones greedy.
  const size_t tries = std::min<size_t>(4, options_by_bin.size());
  std::partial_sort(options_by_bin.begin(), options_by_bin.begin() + tries, options_by_bin.end(),
                    [](const Option& a, const Option& b) {
                      return a.estimate != b.estimate ? a.estimate < b.estimate : a.bin < b.bin;
                    });
  for (size_t t = 0; t < tries; ++t) {
    Choices choices = fixed;
    size_t b = options_by_bin[t].bin;
    const double room = core_budget - least_error[b];
    for (size_t k = big; k-- > 0;) {
      const size_t l = big_layers[k];
      choices[l] = kept[kept_first[l] + table[k * bins + b]];
      b -= bins_of(l, choices[l]);
    }
    small.greedy(room, choices);
    out.candidates.push_back(choices);
    if (small.greedy_through_break(room, choices)) out.candidates.push_back(std::move(choices));
  }
  out.ran = true;
  return out;
}

}  // namespace

Solution solve(const Problem& problem, const SolverOptions& options) {
  validate(problem);
  if (!(options.tolerance > 0 && options.tolerance < 1))
    throw std::invalid_argument("solver tolerance " + std::to_string(options.tolerance) + ": must be in (0, 1)");
  if (options.max_table_cells > (uint64_t{1} << 36))
    throw std::invalid_argument("solver table cap " + std::to_string(options.max_table_cells) + " cells: at most 2^36");
  const size_t layers = problem.layers.size();
  // Totals in the problem's units: the answer's feasibility is decided on these.
  auto unscaled_error = [&](const Choices& choices) {
    double sum = 0;
    for (size_t l = 0; l < layers; ++l) sum += problem.layers[l].candidates[choices[l]].error;
    return sum;
  };
  Solution s;
  Choices defaults(layers);
  for (size_t l = 0; l < layers; ++l) defaults[l] = problem.layers[l].default_index;
  s.default_error = unscaled_error(defaults);
  s.budget = problem.alpha * s.default_error;
  const Flat f = flatten(problem, s.budget);
  s.default_cost = total_cost(f, defaults);
  const double budget = std::ldexp(s.budget, f.error_shift);  // in the solver's units

  Choices choices = min_error_choices(f);
  if (unscaled_error(choices) > s.budget) {
    s.feasible = false;
  } else if (total_error(f, choices) <= budget) {  // (false only if the scaling was inexact)
    const Relaxation r = relax(f, budget);
    // The cheapest of the relaxation's incumbents and (with alpha >= 1 they fit the budget
    // by definition: never answer worse) the defaults.
    std::vector<Choices> incumbents = r.incumbents;
    incumbents.push_back(defaults);
    double cost = std::numeric_limits<double>::infinity();
    for (Choices& candidate : incumbents) {
      repair(f, candidate, budget);
      const double c = total_cost(f, candidate);
      if (total_error(f, candidate) <= budget && c < cost) {
        choices = candidate;
        cost = c;
      }
    }
    s.lower_bound = std::min(r.lower_bound, cost);
    // Refine only when the incumbent is not yet proven within tolerance: the DP's own
    // guarantee (tolerance x optimum) could not improve on it otherwise.
    if (!r.proven_optimal && cost - s.lower_bound > options.tolerance * s.lower_bound) {
      const Refinement refined = refine(f, r, choices, cost, budget, options);
      if (refined.ran) {
        s.core_layers = refined.core_layers;
        s.bin_width = refined.bin_width;
        for (Choices candidate : refined.candidates) {
          repair(f, candidate, budget);
          const double c = total_cost(f, candidate);
          if (c < cost || (c == cost && total_error(f, candidate) < total_error(f, choices))) {
            choices = std::move(candidate);
            cost = c;
          }
        }
        // Assignments outside the survivors cost at least the incumbent.
        s.lower_bound = std::max(s.lower_bound, std::min(refined.lower_bound, cost));
      }
    }
    improve(f, choices, budget);
    // The scaling is exact unless errors span nearly the whole double range; then make
    // sure on the problem's own numbers.
    if (unscaled_error(choices) > s.budget) choices = min_error_choices(f);
  }

  s.choices = choices;
  s.error = unscaled_error(choices);
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
