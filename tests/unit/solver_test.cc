// The L-GreCo solver against exhaustive search, an independently computed Lagrangian
// bound, and itself (determinism).
#include "controller/solver.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <random>
#include <thread>

#include "tests/unit/test_util.h"
#include "tools/solver_instances.h"

namespace lgreco {
namespace {

using controller::Candidate;
using controller::Layer;
using controller::Objective;
using controller::Problem;
using controller::ProblemError;
using controller::Solution;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Bytes of quant:bits=4 with 1024-value buckets.
uint64_t quant_bytes(uint64_t n) { return tools::quant_encoded_bytes(n, 4); }

// kLumpy: two big layers among small ones, so that the refinement splits them (big
// layers in its DP, small ones relaxed and filled greedily).
enum class Flavor { kSmallBytes, kLargeBytes, kTies, kTime, kLumpy };

// Random instances with every shape the solver must handle: single-candidate layers,
// duplicate and dominated candidates, zero errors, alpha below and above 1.
Problem random_problem(std::mt19937_64& rng, Flavor flavor, int max_layers, int max_candidates) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Problem p;
  p.alpha = 0.3 + 1.5 * unit(rng);
  if (flavor == Flavor::kTime) {
    p.objective = Objective::kTime;
    p.cost_model.link = {1e9 * (0.5 + unit(rng)), 1e-5 * unit(rng), 0};
    p.cost_model.families["quant"].throughput = 5e8 * (0.5 + unit(rng));
    p.cost_model.families["none"].latency = 2e-6;
  }
  const int layers = 1 + static_cast<int>(rng() % max_layers);
  for (int l = 0; l < layers; ++l) {
    Layer layer;
    layer.name = "l" + std::to_string(l);
    layer.numel = 1 + rng() % 100000;
    const int count = 1 + static_cast<int>(rng() % max_candidates);
    for (int c = 0; c < count; ++c) {
      Candidate cand;
      cand.codec = (c == 0 && flavor == Flavor::kTime) ? "none" : "quant:bits=" + std::to_string(2 + c);
      cand.bytes = flavor == Flavor::kSmallBytes ? rng() % 40 : 1000 + rng() % 10000000;
      if (flavor == Flavor::kLumpy) cand.bytes = l < 2 ? 1000000 + rng() % 10000000 : 1 + rng() % 3000;
      cand.error = rng() % 6 == 0 ? static_cast<double>(rng() % 3) : 10 * unit(rng);
      if (flavor == Flavor::kTies && c > 0 && rng() % 2) {
        cand = layer.candidates[rng() % c];  // an exact duplicate, or one equal coordinate
        if (rng() % 2) cand.bytes += rng() % 3;
      }
      layer.candidates.push_back(cand);
    }
    layer.default_index = static_cast<uint32_t>(rng() % count);
    p.layers.push_back(std::move(layer));
  }
  return p;
}

struct Exhaustive {
  double best_cost = kInf;  // least cost among assignments within the budget
  double least_error = kInf;
};

Exhaustive exhaustive(const Problem& p, double budget) {
  const auto costs = controller::candidate_costs(p);
  std::vector<uint32_t> c(p.layers.size(), 0);
  Exhaustive r;
  for (;;) {
    double e = 0, s = 0;
    for (size_t l = 0; l < p.layers.size(); ++l) {
      e += p.layers[l].candidates[c[l]].error;
      s += costs[l][c[l]];
    }
    r.least_error = std::min(r.least_error, e);
    if (e <= budget) r.best_cost = std::min(r.best_cost, s);
    size_t l = 0;
    while (l < p.layers.size() && ++c[l] == p.layers[l].candidates.size()) c[l++] = 0;
    if (l == p.layers.size()) break;
  }
  return r;
}

// The Lagrangian dual L(lambda) = sum_l min_c (s + lambda e) - lambda budget is a lower
// bound for every lambda >= 0; its maximum is the LP relaxation's value. Found here by
// bisection on the sign of its slope, independently of the solver's hull walk.
double lagrangian_bound(const Problem& p, double budget) {
  const auto costs = controller::candidate_costs(p);
  auto evaluate = [&](double lambda, double* slope) {
    double value = 0, error = 0;
    for (size_t l = 0; l < p.layers.size(); ++l) {
      double best = kInf, best_error = 0;
      for (size_t c = 0; c < costs[l].size(); ++c) {
        const double v = costs[l][c] + lambda * p.layers[l].candidates[c].error;
        if (v < best || (v == best && p.layers[l].candidates[c].error < best_error)) {
          best = v;
          best_error = p.layers[l].candidates[c].error;
        }
      }
      value += best;
      error += best_error;
    }
    if (slope) *slope = error - budget;
    return value - lambda * budget;
  };
  double lo = -60, hi = 60;  // log10 lambda
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    double slope;
    evaluate(std::pow(10.0, mid), &slope);
    (slope > 0 ? lo : hi) = mid;
  }
  return std::max({evaluate(0, nullptr), evaluate(std::pow(10.0, lo), nullptr), evaluate(std::pow(10.0, hi), nullptr)});
}

void check_against_exhaustive(const Problem& p, const controller::SolverOptions& options) {
  const Solution s = controller::solve(p, options);
  const Exhaustive best = exhaustive(p, s.budget);
  BOOST_REQUIRE_EQUAL(s.choices.size(), p.layers.size());
  for (size_t l = 0; l < p.layers.size(); ++l) BOOST_REQUIRE_LT(s.choices[l], p.layers[l].candidates.size());
  const bool feasible = best.best_cost < kInf;
  BOOST_REQUIRE_EQUAL(s.feasible, feasible);
  if (!feasible) {
    BOOST_TEST(s.error == best.least_error);  // the least-error assignment
    return;
  }
  BOOST_TEST(s.error <= s.budget);
  BOOST_TEST(s.cost <= best.best_cost * (1 + options.tolerance) + 1e-12);
  BOOST_TEST(s.lower_bound <= best.best_cost * (1 + 1e-12) + 1e-12);  // the bound is a bound
  BOOST_TEST(s.lower_bound <= s.cost);
}

BOOST_AUTO_TEST_SUITE(solver)

BOOST_AUTO_TEST_CASE(matches_exhaustive_search_on_small_random_instances) {
  const uint64_t seed = test::run_seed();
  BOOST_TEST_CONTEXT("LGRECO_TEST_SEED=" << seed) {
    std::mt19937_64 rng(seed);
    for (Flavor flavor : {Flavor::kSmallBytes, Flavor::kLargeBytes, Flavor::kTies, Flavor::kTime, Flavor::kLumpy}) {
      for (int i = 0; i < 1500; ++i) {
        const Problem p = random_problem(rng, flavor, 7, 6);
        BOOST_TEST_CONTEXT("flavor " << static_cast<int>(flavor) << " instance " << i)
        check_against_exhaustive(p, {});
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(whole_bytes_are_solved_exactly_when_bins_are_one_byte) {
  // Byte counts below tolerance x cost / layers make the bin one byte: no rounding at all.
  std::mt19937_64 rng(test::run_seed() ^ 0x51);
  for (int i = 0; i < 2000; ++i) {
    const Problem p = random_problem(rng, Flavor::kSmallBytes, 6, 5);
    const Solution s = controller::solve(p);
    const Exhaustive best = exhaustive(p, s.budget);
    if (best.best_cost < kInf) BOOST_TEST(s.cost == best.best_cost);
  }
}

BOOST_AUTO_TEST_CASE(alpha_one_never_costs_more_than_the_defaults) {
  // The defaults meet an alpha = 1 budget with no slack at all: an assignment exactly on
  // the boundary, which a sum in another order can miss by one ulp.
  std::mt19937_64 rng(test::run_seed() ^ 0x1d);
  for (int i = 0; i < 3000; ++i) {
    tools::QuantInstanceShape shape;
    shape.layers = 1 + static_cast<uint32_t>(rng() % 8);
    const Problem p = tools::quant_instance(shape, rng());
    const Solution s = controller::solve(p);
    BOOST_TEST(s.feasible);
    BOOST_TEST(s.bytes <= s.default_bytes);
    BOOST_TEST(s.lower_bound <= s.default_cost);
    BOOST_TEST(s.error <= s.budget);
  }
}

BOOST_AUTO_TEST_CASE(a_coarse_table_still_returns_a_feasible_answer_with_a_valid_bound) {
  // A tiny refinement table forces wide bins (or no refinement): the answer must stay
  // feasible and its lower bound valid; only its distance from the optimum may grow.
  std::mt19937_64 rng(test::run_seed() ^ 0x77);
  controller::SolverOptions options;
  options.max_table_cells = 64;
  options.tolerance = 1e-6;
  for (int i = 0; i < 500; ++i) {
    const Problem p = random_problem(rng, Flavor::kLargeBytes, 7, 5);
    const Solution s = controller::solve(p, options);
    const Exhaustive best = exhaustive(p, s.budget);
    if (best.best_cost == kInf) continue;
    BOOST_TEST(s.error <= s.budget);
    BOOST_TEST(s.lower_bound <= best.best_cost * (1 + 1e-12));
    BOOST_TEST(s.cost >= best.best_cost);
  }
}

BOOST_AUTO_TEST_CASE(large_instances_are_within_half_a_percent_of_the_lagrangian_bound) {
  const uint64_t seed = test::run_seed();
  BOOST_TEST_CONTEXT("LGRECO_TEST_SEED=" << seed) {
    std::mt19937_64 rng(seed);
    for (double alpha : {0.7, 1.0, 1.4}) {
      tools::QuantInstanceShape shape;
      shape.layers = 1000;
      Problem p = tools::quant_instance(shape, rng());
      p.alpha = alpha;
      const Solution s = controller::solve(p);
      const double bound = lagrangian_bound(p, s.budget);
      BOOST_TEST_CONTEXT("quant, alpha " << alpha) {
        BOOST_TEST(s.feasible);
        BOOST_TEST(s.error <= s.budget);
        BOOST_TEST(s.cost <= bound * 1.005);
        BOOST_TEST(s.lower_bound >= bound * (1 - 1e-9));  // at least as strong as the LP
        BOOST_TEST(s.lower_bound <= s.cost);
        BOOST_TEST(s.bytes < s.default_bytes);  // alpha near 1 always saves on these
      }
    }
    // Lumpy: 1% of the layers 300x larger. The LP bound is loose here (a real integrality
    // gap of a few percent), so the answer is held to the solver's own proven bound, which
    // must be at least the LP's.
    for (double alpha : {0.8, 1.0}) {
      tools::QuantInstanceShape shape;
      shape.layers = 1000;
      shape.uncompressed_fraction = 0;
      Problem p = tools::quant_instance(shape, rng());
      for (auto& layer : p.layers)
        if (rng() % 100 == 0)
          for (auto& c : layer.candidates) {
            c.bytes *= 300;
            c.error *= 300;
          }
      p.alpha = alpha;
      const Solution s = controller::solve(p);
      BOOST_TEST_CONTEXT("lumpy, alpha " << alpha) {
        BOOST_TEST(s.error <= s.budget);
        BOOST_TEST(s.cost <= s.lower_bound * 1.005);
        BOOST_TEST(s.lower_bound >= lagrangian_bound(p, s.budget) * (1 - 1e-9));
      }
    }
    Problem p;  // 1000 layers drawn like the small random instances
    for (int l = 0; l < 1000; ++l) {
      Problem one = random_problem(rng, Flavor::kLargeBytes, 1, 7);
      one.layers[0].name = "l" + std::to_string(l);
      p.layers.push_back(one.layers[0]);
    }
    const Solution s = controller::solve(p);
    const double bound = lagrangian_bound(p, s.budget);
    BOOST_TEST(s.cost <= bound * 1.005);
    BOOST_TEST(s.error <= s.budget);
  }
}

BOOST_AUTO_TEST_CASE(infeasible_budget_returns_the_least_error_assignment) {
  Problem p;
  p.alpha = 0.5;
  for (int l = 0; l < 3; ++l) {
    Layer layer;
    layer.name = "l" + std::to_string(l);
    layer.candidates = {{"quant:bits=2", 100, 4.0}, {"quant:bits=8", 400, 1.0}, {"quant:bits=7", 500, 1.0}};
    layer.default_index = 1;  // the least error is the default: alpha 0.5 cannot be met
    p.layers.push_back(layer);
  }
  const Solution s = controller::solve(p);
  BOOST_TEST(!s.feasible);
  BOOST_TEST(s.choices == std::vector<uint32_t>({1, 1, 1}));  // equal error: the cheaper one
  BOOST_TEST(s.error == 3.0);
  BOOST_TEST(s.budget == 1.5);
}

BOOST_AUTO_TEST_CASE(alpha_zero_allows_only_zero_error) {
  Problem p;
  p.alpha = 0;
  Layer a{"a", 0, 0, {{"quant:bits=4", 10, 0.5}, {"none", 40, 0.0}}};
  Layer b{"b", 0, 0, {{"none", 8, 0.0}}};
  p.layers = {a, b};
  const Solution s = controller::solve(p);
  BOOST_TEST(s.feasible);
  BOOST_TEST(s.choices == std::vector<uint32_t>({1, 0}));
  BOOST_TEST(s.bytes == 48u);
}

BOOST_AUTO_TEST_CASE(empty_and_single_candidate_problems) {
  Problem empty;
  const Solution e = controller::solve(empty);
  BOOST_TEST(e.feasible);
  BOOST_TEST(e.choices.empty());
  BOOST_TEST(e.bytes == 0u);

  Problem fixed;
  for (int l = 0; l < 4; ++l) fixed.layers.push_back(Layer{"f" + std::to_string(l), 0, 0, {{"none", 100u + l, 1.0}}});
  const Solution f = controller::solve(fixed);
  BOOST_TEST(f.feasible);
  BOOST_TEST(f.choices == std::vector<uint32_t>(4, 0));
  BOOST_TEST(f.bytes == 406u);
  BOOST_TEST(f.lower_bound == f.cost);
}

BOOST_AUTO_TEST_CASE(time_objective_drops_compression_where_it_does_not_pay) {
  // A small layer: quantizing it saves 3.5 KB (2.8 us at 1.25 GB/s) but its extra
  // message (5 us latency) costs more. The big one saves 28 ms for 1 ms of codec time.
  Problem p;
  p.cost_model.link = {1.25e9, 5e-6, 0};
  p.cost_model.families["quant"].throughput = 1e10;
  p.cost_model.families["none"].latency = 0;  // rides in the bucket's own message
  Layer small{"small", 1000, 1, {{"none", 4000, 0.0}, {"quant:bits=4", quant_bytes(1000), 1.0}}};
  Layer big{"big", 10000000, 1, {{"none", 40000000, 0.0}, {"quant:bits=4", quant_bytes(10000000), 1.0}}};
  p.layers = {small, big};

  p.objective = Objective::kSize;
  const Solution by_size = controller::solve(p);
  BOOST_TEST(by_size.choices == std::vector<uint32_t>({1, 1}));

  p.objective = Objective::kTime;
  const Solution by_time = controller::solve(p);
  BOOST_TEST(by_time.choices == std::vector<uint32_t>({0, 1}));                       // same error budget, less time
  const double expected = (0 + 4000 / 1.25e9) +                                       // small: none
                          (5e-6 + quant_bytes(10000000) / 1.25e9 + 10000000 / 1e10);  // big: quant
  BOOST_TEST(std::abs(by_time.cost - expected) <= 1e-15 * expected);
  BOOST_TEST(by_time.cost < by_time.default_cost);
}

BOOST_AUTO_TEST_CASE(same_input_same_output_across_runs_and_threads) {
  tools::QuantInstanceShape shape;
  shape.layers = 1500;
  Problem p = tools::quant_instance(shape, test::run_seed());
  p.alpha = 0.9;
  const Solution first = controller::solve(p);
  auto same = [&](const Solution& s) {
    return s.choices == first.choices && std::memcmp(&s.cost, &first.cost, sizeof(double)) == 0 &&
           std::memcmp(&s.error, &first.error, sizeof(double)) == 0 &&
           std::memcmp(&s.lower_bound, &first.lower_bound, sizeof(double)) == 0;
  };
  for (int i = 0; i < 5; ++i) BOOST_TEST(same(controller::solve(p)));
  std::vector<std::future<Solution>> runs;
  for (int t = 0; t < 4; ++t) runs.push_back(std::async(std::launch::async, [&] { return controller::solve(p); }));
  for (auto& r : runs) BOOST_TEST(same(r.get()));
}

BOOST_AUTO_TEST_CASE(golden_answer_is_the_same_on_every_machine) {
  // A fixed instance built with integer arithmetic and + - x / only (no libm, no
  // library distributions, whose results may differ between platforms): a change in the
  // answer means that ranks on different machines or builds could choose differently.
  auto instance = [](int layers, uint64_t state) {
    auto next = [&state] {  // splitmix64
      uint64_t z = (state += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      return z ^ (z >> 31);
    };
    Problem p;
    p.alpha = 0.95;
    for (int l = 0; l < layers; ++l) {
      Layer layer{"l" + std::to_string(l), 1024 + next() % 2000000, 2, {}};
      const double scale = static_cast<double>(1 + next() % 1000) / 1024.0;
      for (uint32_t bits = 2; bits <= 8; ++bits) {
        const double levels = static_cast<double>((1u << bits) - 1);
        const double jitter = static_cast<double>(950 + next() % 101) / 1000.0;
        layer.candidates.push_back({"quant:bits=" + std::to_string(bits), tools::quant_encoded_bytes(layer.numel, bits),
                                    static_cast<double>(layer.numel) * scale / (levels * levels) * jitter});
      }
      p.layers.push_back(std::move(layer));
    }
    return p;
  };
  struct Golden {
    int layers;
    uint64_t hash, bytes;
    bool refined;  // the instance exercises the DP refinement
  };
  for (const Golden& g :
       {Golden{400, 0x62df170147b6837dull, 198019984, false}, Golden{12, 0x5c067ae03ffd6798ull, 5409316, true}}) {
    const Solution s = controller::solve(instance(g.layers, 20261130));
    uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a over the choices
    for (uint32_t c : s.choices) hash = (hash ^ c) * 0x100000001b3ull;
    BOOST_TEST_CONTEXT(g.layers << " layers") {
      BOOST_TEST(hash == g.hash, "choices hash 0x" << std::hex << hash);
      BOOST_TEST(s.bytes == g.bytes);
      BOOST_TEST((s.bin_width > 0) == g.refined);
    }
  }
}

// Regressions found by review fuzzing.
BOOST_AUTO_TEST_CASE(an_exact_fit_of_the_cheapest_assignment_is_found_and_bounded) {
  // The all-cheapest assignment has exactly the defaults' errors: the relaxation's prefix
  // sums say it fits; a running subtraction once said otherwise.
  Problem p;
  p.layers = {Layer{"a", 0, 0, {{"q", 0, 0.41628672446192305}, {"q", 3, 0.0}}},
              Layer{"b", 0, 0, {{"q", 4, 0.0}, {"q", 1, 0.0}}},
              Layer{"c", 0, 1, {{"q", 2, 0.0}, {"q", 0, 0.14511564436130203}}}};
  const Solution s = controller::solve(p);
  BOOST_TEST(s.choices == std::vector<uint32_t>({0, 1, 1}));
  BOOST_TEST(s.cost == 1.0);
  BOOST_TEST(s.lower_bound == 1.0);
}

BOOST_AUTO_TEST_CASE(scaling_the_errors_by_a_power_of_two_changes_nothing) {
  // Tiny errors against large costs once overflowed the cost-per-error ratios.
  std::mt19937_64 rng(test::run_seed() ^ 0x5ca1e);
  for (int i = 0; i < 300; ++i) {
    const Problem p = random_problem(rng, i % 2 ? Flavor::kLargeBytes : Flavor::kTime, 7, 5);
    const Solution reference = controller::solve(p);
    for (int shift : {-900, -600, 600, 900}) {  // every error stays a normal number
      Problem q = p;
      for (auto& layer : q.layers)
        for (auto& c : layer.candidates) c.error = std::ldexp(c.error, shift);
      const Solution s = controller::solve(q);
      BOOST_TEST_CONTEXT("instance " << i << ", errors x 2^" << shift) {
        BOOST_TEST(s.choices == reference.choices);
        BOOST_TEST(s.cost == reference.cost);
        BOOST_TEST(s.lower_bound == reference.lower_bound);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(irrelevant_large_errors_do_not_spoil_the_bound) {
  // Six identical layers whose usable errors are ~1e-301, next to one candidate of error
  // 0.75 that never fits, with costs up to 1e18 (time objective, 1 GB/s).
  Problem p;
  p.alpha = 0.29999999999999999;
  p.objective = Objective::kTime;
  p.cost_model.link = {1e-3, 0, 0};
  for (int l = 0; l < 6; ++l)
    p.layers.push_back(Layer{"l" + std::to_string(l),
                             1,
                             5,
                             {{"quant:bits=0", 1125899906842285, 4.6757820706098911e-303},
                              {"none", 1125899906841798, 3.1872883655945733e-301},
                              {"quant:bits=2", 642409, 0.74954159473710547},
                              {"quant:bits=3", 533675, 4.0537615394164191e-301},
                              {"quant:bits=4", 567391, 5.4757866927586563e-301},
                              {"none", 1125899906842257, 9.0725096583934933e-301}}});
  const Solution s = controller::solve(p);
  const Exhaustive best = exhaustive(p, s.budget);
  BOOST_TEST(s.feasible);
  BOOST_TEST(s.error <= s.budget);
  BOOST_TEST(s.cost <= best.best_cost * 1.001);
  BOOST_TEST(s.lower_bound <= best.best_cost);
}

BOOST_AUTO_TEST_CASE(totals_that_would_overflow_are_rejected) {
  Problem p;
  p.layers = {Layer{"a", 0, 0, {{"q", 100, 1e308}, {"q", 50, 1.7e308}}},
              Layer{"b", 0, 0, {{"q", 100, 1e308}, {"q", 50, 1.7e308}}}};
  BOOST_CHECK_THROW(controller::solve(p), ProblemError);
  Problem t;
  t.objective = Objective::kTime;
  t.cost_model.link = {8e-303, 0, 0};
  t.layers = {Layer{"a", 0, 0, {{"q", 1000, 1.0}}}};
  BOOST_CHECK_THROW(controller::solve(t), ProblemError);
  Problem tiny;  // cost ranges of 1e-323 s: nothing to discretise, and no undefined cast
  tiny.objective = Objective::kTime;
  tiny.cost_model.link = {1e9, 0, 0};
  tiny.cost_model.families["a"].latency = 1e-323;
  tiny.cost_model.families["b"].latency = 2e-323;
  for (int l = 0; l < 6; ++l)
    tiny.layers.push_back(Layer{"l" + std::to_string(l), 0, 0, {{"a", 0, 5.0}, {"b", 0, 1.0}, {"none", 0, 9.0}}});
  const Solution s = controller::solve(tiny);
  BOOST_TEST(s.error <= s.budget);
  BOOST_TEST(s.lower_bound <= s.cost);
}

BOOST_AUTO_TEST_CASE(invalid_problems_name_the_field) {
  auto message = [](const Problem& p) {
    try {
      controller::solve(p);
    } catch (const ProblemError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto base = [] {
    Problem p;
    p.layers.push_back(Layer{"conv1", 100, 1, {{"quant:bits=2", 10, 1.0}, {"quant:bits=4", 20, 0.5}}});
    return p;
  };
  Problem p = base();
  p.layers[0].candidates[1].error = std::nan("");
  BOOST_TEST(message(p) == "layers[0] (conv1).candidates[1].error: NaN; expected a finite number >= 0");
  p = base();
  p.layers[0].candidates[0].error = -1;
  BOOST_TEST(message(p).find("candidates[0].error: -1") != std::string::npos);
  p = base();
  p.layers[0].default_index = 2;
  BOOST_TEST(message(p) == "layers[0] (conv1).default: 2 is out of range (2 candidates)");
  p = base();
  p.alpha = -0.5;
  BOOST_TEST(message(p) == "alpha: -0.5; expected a finite number >= 0");
  p = base();
  p.layers.push_back(p.layers[0]);
  BOOST_TEST(message(p) == "layers[1] (conv1).name: duplicate layer name 'conv1'");
  p = base();
  p.layers[0].candidates.clear();
  BOOST_TEST(message(p).find("candidates: empty") != std::string::npos);
  p = base();
  p.layers[0].candidates.resize(256, p.layers[0].candidates[0]);
  BOOST_TEST(message(p).find("at most 255") != std::string::npos);
  p = base();
  p.objective = Objective::kTime;  // no bandwidth
  BOOST_TEST(message(p).find("cost_model.bandwidth: 0") != std::string::npos);
  p.cost_model.link.bandwidth = 1e9;
  p.cost_model.families["quant"].throughput = 1e9;
  p.layers[0].numel = 0;
  BOOST_TEST(message(p).find("numel: missing") != std::string::npos);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
