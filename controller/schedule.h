// When the controller measures, solves and switches, in steps of one communicator.
//
// Step 0 is the first step the engine sees (DDP's first iteration, before it rebuilds its
// buckets). Measurement windows end at the boundaries B_k = warmup + k * period
// (k = 0, 1, ...): window k is the `window` steps before B_k, and the assignment solved
// from it takes effect at step (B_k - 1) + switch_lag on every rank. Before the first
// switch every layer runs its default codec.
//
//   warmup=100 period=100 window=10 switch_lag=4:
//   measure 90..99 -> solve -> switch at 103; measure 190..199 -> switch at 203; ...
//
// The engine's error probe (plugin/collective/probe.h) runs during each window and the
// `probe_lead` steps before it (80..99, 180..199, ... with a lead of 10): its shadow
// residuals reach their own codec's steady state before the window measures them.
//
// Rules that the constructor enforces:
//   warmup >= 2        nothing layout-dependent before DDP's rebuilt buckets (step 1);
//                      the first window never includes step 0 (it is clipped to 1..)
//   1 <= window <= period, switch_lag >= 1
//   window + switch_lag <= period + 1
//                      an assignment is in effect before the next window measures, so
//                      every window measures under one assignment
#pragma once

#include <cstdint>
#include <functional>

namespace lgreco::controller {

struct ScheduleSettings {
  uint64_t warmup = 100;
  uint64_t period = 100;
  uint64_t window = 10;
  uint64_t switch_lag = 4;
  uint64_t probe_lead = 10;
};

class Schedule {
 public:
  // Throws std::invalid_argument naming the setting that breaks a rule above.
  explicit Schedule(const ScheduleSettings& settings);

  const ScheduleSettings& settings() const { return settings_; }
  // Whether candidate errors are measured at this step.
  bool measures(uint64_t step) const;
  // Whether the error probe runs at this step: a window's steps and the probe_lead before
  // (step 0 too, where the first window's lead reaches it).
  bool probes(uint64_t step) const;
  // Whether this step is in the first window's lead: a probe step before the first window
  // (from step 1). The engine measures the gradient's magnitude there, for the first
  // solve's drift.
  bool leads_first_window(uint64_t step) const;
  // The middle of those steps, counted from 1 as Controller's window middles are; 0 when
  // there are none (no lead, or a first window that starts at step 1).
  double first_lead_middle() const;
  // How many probe steps there are in 0..step. The error probe's shadow residuals run
  // from the first probe step on and persist, so this is their age, in steps of gradient
  // seen, after `step`: step 0 counts where it probes (an engine whose layout is fixed
  // from step 0, a registration file or the demo, runs the probe there; counted from 1,
  // the demo's first TopK shadows held a step more than their age said and read 1.4x
  // what a TopK started with them made). Under DDP step 0's buckets are not the rebuilt
  // ones and run no probe; with the default schedule the first probe step is 80.
  uint64_t probe_steps_through(uint64_t step) const;
  // The shadows' mean age over the steps of the window ending at window_last_step.
  double shadow_age(uint64_t window_last_step) const;
  // The same age with each probe step weighed (the controller's weight: the step's
  // gradient energy over the window's): run_weight(a, b) gives the summed weights of the
  // consecutive probe steps a..b (counted from 1); it is asked for each run in order.
  // Each step weighing 1 (run_weight = b - a + 1): shadow_age().
  double weighted_shadow_age(uint64_t window_last_step, const std::function<double(double, double)>& run_weight) const;
  // Whether this step is the last of a window: after it, aggregate and submit.
  bool window_ends(uint64_t step) const;
  // The first step that uses the assignment solved from a window ending at this step.
  uint64_t effective_step(uint64_t window_last_step) const { return window_last_step + settings_.switch_lag; }

 private:
  // Calls block(from, to) for each run of consecutive probe steps in 1..step, in order.
  template <typename Block>
  void for_each_probe_block(uint64_t step, Block&& block) const;
  ScheduleSettings settings_;
};

}  // namespace lgreco::controller
