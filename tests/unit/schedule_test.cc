// When the controller measures, solves and switches, over simulated step sequences.
#include "controller/schedule.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "controller/stats.h"
#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using controller::Schedule;
using controller::ScheduleSettings;
using controller::ErrorStats;

BOOST_AUTO_TEST_SUITE(schedule)

// Settings that keep every rule, drawn over small ranges; a probe lead too if asked.
ScheduleSettings random_settings(std::mt19937_64& rng, bool lead) {
  ScheduleSettings set;
  set.warmup = 2 + rng() % 30;
  set.period = 1 + rng() % 25;
  set.window = 1 + rng() % set.period;
  set.switch_lag = 1 + rng() % (set.period + 1 - set.window);
  if (lead) set.probe_lead = rng() % 30;
  return set;
}

BOOST_AUTO_TEST_CASE(defaults_measure_the_last_ten_steps_of_each_period) {
  const Schedule s(ScheduleSettings{});
  std::vector<uint64_t> measured, ends;
  for (uint64_t step = 0; step < 320; ++step) {
    if (s.measures(step)) measured.push_back(step);
    if (s.window_ends(step)) ends.push_back(step);
  }
  std::vector<uint64_t> expected;
  for (uint64_t start : {90, 190, 290})
    for (uint64_t k = 0; k < 10; ++k) expected.push_back(start + k);
  BOOST_TEST(measured == expected);
  BOOST_TEST(ends == std::vector<uint64_t>({99, 199, 299}));
  BOOST_TEST(s.effective_step(99) == 103u);
}

BOOST_AUTO_TEST_CASE(random_settings_keep_every_rule) {
  std::mt19937_64 rng(test::run_seed());
  for (int i = 0; i < 300; ++i) {
    const ScheduleSettings set = random_settings(rng, false);
    const Schedule s(set);
    BOOST_TEST_CONTEXT("warmup " << set.warmup << " period " << set.period << " window " << set.window << " lag "
                                 << set.switch_lag) {
      BOOST_TEST(!s.measures(0));  // never DDP's first, pre-rebuild step
      uint64_t measured = 0;       // measured steps since the previous window ended
      std::vector<uint64_t> switches, ends;
      for (uint64_t step = 0; step < 400; ++step) {
        if (s.measures(step)) ++measured;
        if (s.window_ends(step)) {
          BOOST_TEST(s.measures(step));  // a window ends on a measured step
          const uint64_t expected = ends.empty() ? std::min(set.window, step) : set.window;
          BOOST_TEST(measured == expected);  // whole windows (the first clipped to start at 1)
          measured = 0;
          ends.push_back(step);
          switches.push_back(s.effective_step(step));
          BOOST_TEST(s.effective_step(step) >= 2u);
          BOOST_TEST(s.effective_step(step) >= set.warmup);
        }
      }
      // No switch inside a window: every step of a window runs one assignment.
      for (uint64_t end : ends) {
        bool inside = false;
        for (uint64_t sw : switches) inside = inside || (sw + set.window > end + 1 && sw <= end);
        BOOST_TEST(!inside, "a switch inside the window ending at " << end);
      }
      // Switches: warmup - 1 + lag, then every period.
      for (size_t k = 0; k < switches.size(); ++k)
        BOOST_TEST(switches[k] == set.warmup - 1 + set.switch_lag + k * set.period);
    }
  }
}

// The error probe runs in each window and the probe_lead steps before it; with a lead
// as long as the gap between windows, always.
BOOST_AUTO_TEST_CASE(the_probe_runs_in_each_window_and_its_lead) {
  std::mt19937_64 rng(test::run_seed());
  for (int i = 0; i < 200; ++i) {
    const ScheduleSettings set = random_settings(rng, true);
    const Schedule s(set);
    BOOST_TEST_CONTEXT("warmup " << set.warmup << " period " << set.period << " window " << set.window << " lead "
                                 << set.probe_lead) {
      for (uint64_t step = 0; step < 300; ++step) {
        bool want = false;  // a measured step within the lead ahead
        for (uint64_t ahead = 0; ahead <= set.probe_lead && !want; ++ahead) want = s.measures(step + ahead);
        // The first window is clipped to start at 1: step 0 probes if step 1 is within the lead.
        BOOST_TEST(s.probes(step) == want, "step " << step);
        if (s.measures(step)) BOOST_TEST(s.probes(step));
      }
    }
  }
  const Schedule defaults(ScheduleSettings{});
  std::vector<uint64_t> probed;
  for (uint64_t step = 0; step < 300; ++step)
    if (defaults.probes(step)) probed.push_back(step);
  BOOST_TEST(probed.size() == 60u);  // 80..99, 180..199, 280..299
  BOOST_TEST(probed.front() == 80u);
  BOOST_TEST(probed.back() == 299u);
}

// The shadows' age: the probe steps from 0 on, counted one by one with probes(); over a
// window, their mean. Step 0 counts where it probes: a layout fixed from step 0 (the demo)
// runs the probe there, and the demo's first TopK shadows, counted from 1, held a step
// more than their age said.
BOOST_AUTO_TEST_CASE(the_shadow_age_counts_the_probe_steps_since_step_0) {
  std::mt19937_64 rng(test::run_seed());
  for (int i = 0; i < 200; ++i) {
    const ScheduleSettings set = random_settings(rng, true);
    const Schedule s(set);
    BOOST_TEST_CONTEXT("warmup " << set.warmup << " period " << set.period << " window " << set.window << " lead "
                                 << set.probe_lead) {
      uint64_t count = s.probes(0) ? 1 : 0;
      std::vector<uint64_t> through(1, count);  // through[t]: probe steps in 0..t
      BOOST_TEST(s.probe_steps_through(0) == count);
      for (uint64_t step = 1; step < 300; ++step) {
        count += s.probes(step) ? 1 : 0;
        through.push_back(count);
        BOOST_TEST(s.probe_steps_through(step) == count, "step " << step);
      }
      // The first window's lead: the probe steps from 1 before it.
      double lead_sum = 0, lead_n = 0;
      for (uint64_t step = 0; step < 300; ++step) {
        const bool want = step >= 1 && step < set.warmup && s.probes(step) && !s.measures(step);
        BOOST_TEST(s.leads_first_window(step) == want, "step " << step);
        if (want) lead_sum += static_cast<double>(step) + 1, lead_n += 1;
      }
      BOOST_TEST(s.first_lead_middle() == (lead_n > 0 ? lead_sum / lead_n : 0.0));
      for (uint64_t end = 1; end < 300; ++end) {
        if (!s.window_ends(end)) continue;
        double sum = 0, n = 0;
        for (uint64_t t = end + 1 > set.window ? end + 1 - set.window : 1; t <= end; ++t)
          if (t >= 1) sum += static_cast<double>(through[t]), n += 1;
        BOOST_TEST(s.shadow_age(end) == sum / n, boost::test_tools::tolerance(1e-12));
      }
    }
  }
  const Schedule defaults(ScheduleSettings{});
  BOOST_TEST(defaults.first_lead_middle() == 85.5);  // steps 80..89, counted from 1
  BOOST_TEST(defaults.shadow_age(99) == 15.5);   // probes 80..99, window 90..99
  BOOST_TEST(defaults.shadow_age(199) == 35.5);  // and 180..199
  const Schedule demo(ScheduleSettings{5, 5, 2, 2, 10});
  BOOST_TEST(demo.probes(0));
  BOOST_TEST(demo.shadow_age(4) == 4.5);  // probes 0..4 (the lead reaches step 0), window 3..4
}

// The shadows' age with each probe step weighed: the sum of the weights of the probe
// steps through the window's last, as probes() finds them one by one, less the window's
// half-length as shadow_age; weight 1 is shadow_age. The runs of probe steps are asked
// for in order, each a run of consecutive probe steps.
BOOST_AUTO_TEST_CASE(a_weighted_shadow_age_sums_the_probe_steps_weights) {
  std::mt19937_64 rng(test::run_seed());
  std::uniform_real_distribution<double> uniform(0.125, 8.0);
  std::vector<double> table(400);
  for (double& w : table) w = uniform(rng);
  for (int i = 0; i < 200; ++i) {
    const ScheduleSettings set = random_settings(rng, true);
    const Schedule s(set);
    BOOST_TEST_CONTEXT("warmup " << set.warmup << " period " << set.period << " window " << set.window << " lead "
                                 << set.probe_lead) {
      for (uint64_t end = 1; end < 300; ++end) {
        if (!s.window_ends(end)) continue;
        const uint64_t first = end + 1 > set.window ? end + 1 - set.window : 1;
        double sum = 0;
        for (uint64_t step = 0; step <= end; ++step)
          if (s.probes(step)) sum += table[step + 1];
        double last = 0;
        bool runs_of_probe_steps = true;
        const double got = s.weighted_shadow_age(end, [&](double a, double b) {
          double run = 0;
          for (double t = a; t <= b; ++t) {
            runs_of_probe_steps = runs_of_probe_steps && t > last && s.probes(static_cast<uint64_t>(t) - 1);
            last = t;
            run += table[static_cast<size_t>(t)];
          }
          return run;
        });
        BOOST_TEST(got == sum - (static_cast<double>(end - first + 1) - 1) / 2, boost::test_tools::tolerance(1e-12));
        BOOST_TEST(runs_of_probe_steps);
        BOOST_TEST(s.weighted_shadow_age(end, [](double a, double b) { return b - a + 1; }) == s.shadow_age(end));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(invalid_settings_are_named) {
  auto message = [](ScheduleSettings set) {
    try {
      Schedule s(set);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ScheduleSettings set;
  set.warmup = 1;
  BOOST_TEST(message(set).find("warmup 1: must be at least 2") == 0);
  set = {};
  set.window = 0;
  BOOST_TEST(message(set).find("window 0: must be between 1 and the period (100)") == 0);
  set = {};
  set.window = 101;
  BOOST_TEST(message(set).find("window 101") == 0);
  set = {};
  set.switch_lag = 0;
  BOOST_TEST(message(set).find("switch lag 0") == 0);
  set = {};
  set.window = 50;
  set.switch_lag = 60;
  BOOST_TEST(message(set).find("window 50 + switch lag 60: must be at most period + 1 (101)") == 0);
  set = {};
  set.period = 0;
  BOOST_TEST(message(set).find("period 0") == 0);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(error_stats)

BOOST_AUTO_TEST_CASE(sums_and_means_match_a_float64_reference_for_both_metrics) {
  std::mt19937_64 rng(test::run_seed());
  std::uniform_real_distribution<double> unit(0.0, 10.0);
  const std::vector<uint32_t> shape = {7, 1, 3};
  for (auto metric : {controller::ErrorMetric::kSquaredL2, controller::ErrorMetric::kL2}) {
    controller::ErrorStats stats(shape, metric);
    std::vector<std::vector<double>> reference(3);
    std::vector<uint64_t> samples(3, 0);
    for (size_t l = 0; l < 3; ++l) reference[l].assign(shape[l], 0.0);
    for (int i = 0; i < 50; ++i) {
      const size_t l = rng() % 3;
      std::vector<double> e(shape[l]);
      for (auto& v : e) v = unit(rng);
      BOOST_TEST(stats.add(l, e));
      for (size_t c = 0; c < e.size(); ++c)
        reference[l][c] += metric == controller::ErrorMetric::kL2 ? std::sqrt(e[c]) : e[c];
      ++samples[l];
    }
    for (size_t l = 0; l < 3; ++l) {
      BOOST_TEST(stats.samples(l) == samples[l]);
      for (uint32_t c = 0; c < shape[l]; ++c)
        BOOST_TEST(stats.mean(l, c) == (samples[l] ? reference[l][c] / samples[l] : 0.0),
                   boost::test_tools::tolerance(1e-14));
    }
  }
}

// A candidate's estimate: simulated x measured / reference (window sums: the sample's
// own-state error scaled by the whole layer's content over the sample's), else measured,
// else simulated x the sample's scale; the real state now and the realized error scaled
// alike; shares that other ranks count add without counting.
BOOST_AUTO_TEST_CASE(estimates_combine_the_measurements) {
  ErrorStats s({3, 2}, controller::ErrorMetric::kSquaredL2);
  s.set_sample_scale(0, 16);
  s.set_sample_scale(1, 4);
  const std::vector<double> measured0 = {8, 4, 2}, simulated0 = {1, 0.25, 0}, reference0 = {0.5, 0.25, 0},
                            current0 = {0.6, 0.3, 0}, independent0 = {0.5, 0.2, 0};
  ErrorStats::Sample a;
  a.measured = measured0;
  a.simulated = simulated0;
  a.reference = reference0;
  a.current = current0;
  a.simulated_independent = independent0;
  a.realized = 0.2;
  a.magnitude = 10;
  BOOST_TEST(s.add(0, a));
  ErrorStats::Sample b;  // another rank's share of the same step: its whole layer's content
  b.measured = measured0;
  b.magnitude = 6;
  b.counted = false;
  BOOST_TEST(s.add(0, b));
  BOOST_TEST(s.samples(0) == 1u);
  BOOST_TEST(s.mean(0, 0) == 1 * 16.0 / 0.5);    // the sample's own state, scaled to the layer
  BOOST_TEST(s.mean(0, 1) == 0.25 * 8.0 / 0.25);
  BOOST_TEST(s.mean(0, 2) == 4.0);               // not simulated (low rank): measured
  BOOST_TEST(s.current_mean(0, 0) == 0.6 * 16.0 / 0.5);
  BOOST_TEST(s.current_mean(0, 2) == 4.0);
  BOOST_TEST(s.realized_mean(0, 1) == 0.2 * 8.0 / 0.25);  // like candidate 1's estimate...
  BOOST_TEST(s.realized_mean(0, 2) == 0.2 * 16);          // ...or scaled by the sample
  BOOST_TEST(s.magnitude_mean(0) == 16.0);
  BOOST_TEST(s.shadow_correlation(0, 0) == 2.0);  // simulated over its independent sum
  BOOST_TEST(s.shadow_correlation(0, 1) == 1.25);
  BOOST_TEST(s.shadow_correlation(0, 2) == 0.0);  // not simulated
  // Without a whole-layer measurement: the simulation scaled by the sample.
  const std::vector<double> none = {0, 0}, sim = {0.5, 0.25};
  ErrorStats::Sample c;
  c.measured = none;
  c.simulated = sim;
  BOOST_TEST(s.add(1, c));
  BOOST_TEST(s.mean(1, 0) == 2.0);
  BOOST_TEST(s.mean(1, 1) == 1.0);
  // A non-finite value anywhere skips the sample.
  ErrorStats::Sample bad = a;
  bad.realized = std::nan("");
  BOOST_TEST(!s.add(0, bad));
  BOOST_TEST(s.skipped(0) == 1u);
  bad = a;
  const std::vector<double> negative = {0.5, -1, 0};
  bad.simulated_independent = negative;
  BOOST_TEST(!s.add(0, bad));
  BOOST_TEST(s.skipped(0) == 2u);
  BOOST_TEST(s.samples(0) == 1u);
  BOOST_TEST(s.shadow_correlation(0, 0) == 2.0);  // the skipped samples added nothing
  bad = a;
  bad.simulated_independent = sim;  // two values for three candidates
  BOOST_CHECK_THROW(s.add(0, bad), std::invalid_argument);
  BOOST_CHECK_THROW(s.set_sample_scale(0, 0.5), std::invalid_argument);
}

// The first window's lead: magnitudes alone, shares that another rank counts adding
// without counting, non-finite ones refused; summed across ranks like the rest.
BOOST_AUTO_TEST_CASE(lead_magnitudes_are_summed_and_counted_apart) {
  ErrorStats s({2, 1}, controller::ErrorMetric::kSquaredL2);
  BOOST_TEST(s.lead_magnitude_mean(0) == 0.0);
  BOOST_TEST(s.add_lead(0, 12, true));
  BOOST_TEST(s.add_lead(0, 4, false));
  BOOST_TEST(s.add_lead(0, 8, true));
  BOOST_TEST(!s.add_lead(0, std::nan(""), true));
  BOOST_TEST(!s.add_lead(0, -1, true));
  BOOST_TEST(s.lead_magnitude_mean(0) == 12.0);  // (12 + 4 + 8) / 2 counted
  BOOST_TEST(s.lead_magnitude_mean(1) == 0.0);
  BOOST_TEST(s.samples(0) == 0u);  // not error samples
  BOOST_TEST(s.magnitude_mean(0) == 0.0);
  ErrorStats other = s;
  other.merge(s);
  BOOST_TEST(other.lead_magnitude_mean(0) == 12.0);
  s.clear();
  BOOST_TEST(s.lead_magnitude_mean(0) == 0.0);
  BOOST_CHECK_THROW(s.add_lead(2, 1, true), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(overflowed_samples_are_skipped_and_counted) {
  controller::ErrorStats stats({2}, controller::ErrorMetric::kSquaredL2);
  BOOST_TEST(stats.add(0, std::vector<double>{1.0, 2.0}));
  BOOST_TEST(!stats.add(0, std::vector<double>{std::numeric_limits<double>::infinity(), 2.0}));
  BOOST_TEST(!stats.add(0, std::vector<double>{1.0, std::nan("")}));
  BOOST_TEST(!stats.add(0, std::vector<double>{-1.0, 2.0}));
  BOOST_TEST(stats.samples(0) == 1u);
  BOOST_TEST(stats.skipped(0) == 3u);
  BOOST_TEST(stats.mean(0, 1) == 2.0);
  BOOST_CHECK_THROW(stats.add(1, std::vector<double>{1.0, 2.0}), std::invalid_argument);
  BOOST_CHECK_THROW(stats.add(0, std::vector<double>{1.0}), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(summing_reduction_buffers_across_ranks_equals_merging) {
  std::mt19937_64 rng(test::run_seed() ^ 3);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const std::vector<uint32_t> shape = {3, 2};
  std::vector<controller::ErrorStats> ranks(4, controller::ErrorStats(shape, controller::ErrorMetric::kSquaredL2));
  for (auto& r : ranks)
    for (int i = 0; i < 10; ++i) r.add(i % 2, std::vector<double>(shape[i % 2], unit(rng)));
  // What the engine's allreduce does: elementwise sums of the flat buffers.
  controller::ErrorStats allreduced(shape, controller::ErrorMetric::kSquaredL2);
  for (const auto& r : ranks)
    for (size_t i = 0; i < r.reduction_buffer().size(); ++i)
      allreduced.reduction_buffer()[i] += r.reduction_buffer()[i];
  controller::ErrorStats merged(shape, controller::ErrorMetric::kSquaredL2);
  for (const auto& r : ranks) merged.merge(r);
  BOOST_TEST(allreduced.samples(0) == 20u);
  for (size_t l = 0; l < 2; ++l)
    for (uint32_t c = 0; c < shape[l]; ++c) BOOST_TEST(allreduced.mean(l, c) == merged.mean(l, c));
  controller::ErrorStats other({3, 3}, controller::ErrorMetric::kSquaredL2);
  BOOST_CHECK_THROW(merged.merge(other), std::invalid_argument);
  merged.clear();
  BOOST_TEST(merged.samples(0) == 0u);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
