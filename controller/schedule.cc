#include "controller/schedule.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

#include "config/params.h"

namespace lgreco::controller {

Schedule::Schedule(const ScheduleSettings& s) : settings_(s) {
  const std::string violation = config::schedule_rule_violation(s.warmup, s.period, s.window, s.switch_lag);
  if (!violation.empty()) throw std::invalid_argument(violation);
}

bool Schedule::measures(uint64_t step) const {
  const ScheduleSettings& s = settings_;
  if (step < s.warmup) return step >= 1 && step + s.window >= s.warmup;  // the first window, clipped to 1..
  return (step - s.warmup) % s.period >= s.period - s.window;
}

bool Schedule::probes(uint64_t step) const {
  const ScheduleSettings& s = settings_;
  // The window that ends at or after this step, and its first step.
  const uint64_t k = step < s.warmup ? 0 : (step - (s.warmup - 1) + s.period - 1) / s.period;
  const uint64_t last = s.warmup - 1 + k * s.period;
  const uint64_t first = k == 0 ? std::max<uint64_t>(1, s.warmup > s.window ? s.warmup - s.window : 1)
                                : last - s.window + 1;
  return step + s.probe_lead >= first;
}

bool Schedule::leads_first_window(uint64_t step) const {
  return step >= 1 && step < settings_.warmup && probes(step) && !measures(step);
}

double Schedule::first_lead_middle() const {
  double sum = 0, n = 0;
  for (uint64_t step = 1; step < settings_.warmup; ++step)
    if (leads_first_window(step)) sum += static_cast<double>(step) + 1, n += 1;
  return n > 0 ? sum / n : 0.0;
}

template <typename Block>
void Schedule::for_each_probe_block(uint64_t step, Block&& block) const {
  const ScheduleSettings& s = settings_;
  // Window k ends at last_k = warmup - 1 + k period; the steps after last_{k-1} up to
  // last_k that probe are the last window + probe_lead of them (the first window clipped
  // to 1.., its lead to 0..).
  uint64_t next = 0;  // the first step not yet counted
  for (uint64_t k = 0; next <= step; ++k) {
    const uint64_t last = s.warmup - 1 + k * s.period;
    const uint64_t first_window = k == 0 ? std::max<uint64_t>(1, s.warmup > s.window ? s.warmup - s.window : 1)
                                         : last - s.window + 1;
    const uint64_t from = std::max(next, first_window > s.probe_lead ? first_window - s.probe_lead : 0);
    const uint64_t to = std::min(last, step);
    if (to >= from) block(from, to);
    next = last + 1;
  }
}

uint64_t Schedule::probe_steps_through(uint64_t step) const {
  uint64_t count = 0;
  for_each_probe_block(step, [&](uint64_t from, uint64_t to) { count += to - from + 1; });
  return count;
}

double Schedule::shadow_age(uint64_t window_last_step) const {
  return weighted_shadow_age(window_last_step, [](double a, double b) { return b - a + 1; });
}

double Schedule::weighted_shadow_age(uint64_t window_last_step,
                                     const std::function<double(double, double)>& run_weight) const {
  const ScheduleSettings& s = settings_;
  // The window's steps, clipped to 1.. as the first window is.
  const uint64_t first = window_last_step + 1 > s.window ? window_last_step + 1 - s.window : 1;
  if (window_last_step < first) return 0;
  const uint64_t steps = window_last_step - first + 1;
  double sum = 0;
  for_each_probe_block(window_last_step, [&](uint64_t from, uint64_t to) {
    sum += run_weight(static_cast<double>(from) + 1, static_cast<double>(to) + 1);
  });
  // Every window step probes, so the ages over the window rise by one per step: their
  // mean is the age at the last less half the window.
  return sum - (static_cast<double>(steps) - 1) / 2;
}

bool Schedule::window_ends(uint64_t step) const {
  return step + 1 >= settings_.warmup && (step + 1 - settings_.warmup) % settings_.period == 0;
}

}  // namespace lgreco::controller
