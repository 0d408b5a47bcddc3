#include "controller/schedule.h"

#include <stdexcept>
#include <string>

namespace lgreco::controller {

namespace {
std::string n(uint64_t v) { return std::to_string(v); }
}  // namespace

Schedule::Schedule(const ScheduleSettings& s) : settings_(s) {
  if (s.warmup < 2)
    throw std::invalid_argument("warmup " + n(s.warmup) +
                                ": must be at least 2 (DDP rebuilds its buckets after its first step)");
  if (s.period < 1) throw std::invalid_argument("period 0: must be at least 1");
  if (s.window < 1 || s.window > s.period)
    throw std::invalid_argument("window " + n(s.window) + ": must be between 1 and the period (" + n(s.period) + ")");
  if (s.switch_lag < 1) throw std::invalid_argument("switch lag 0: must be at least 1");
  if (s.window + s.switch_lag > s.period + 1)
    throw std::invalid_argument("window " + n(s.window) + " + switch lag " + n(s.switch_lag) +
                                ": must be at most period + 1 (" + n(s.period + 1) +
                                "), so that each assignment is in effect before the next window measures");
}

bool Schedule::measures(uint64_t step) const {
  const ScheduleSettings& s = settings_;
  if (step < s.warmup) return step >= 1 && step + s.window >= s.warmup;  // the first window, clipped to 1..
  return (step - s.warmup) % s.period >= s.period - s.window;
}

bool Schedule::window_ends(uint64_t step) const {
  return step + 1 >= settings_.warmup && (step + 1 - settings_.warmup) % settings_.period == 0;
}

}  // namespace lgreco::controller
