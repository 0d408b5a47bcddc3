#include "controller/schedule.h"

#include <algorithm>
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

bool Schedule::window_ends(uint64_t step) const {
  return step + 1 >= settings_.warmup && (step + 1 - settings_.warmup) % settings_.period == 0;
}

}  // namespace lgreco::controller
