// Error statistics of the candidates over a measurement window.
//
// Each sample is one layer at one step. It holds, per candidate, the squared L2 error
// that the candidate makes, in up to five measurements (the engine's: docs/ENGINE.md,
// "Statistics and the controller"):
//   measured   on the whole layer's gradient alone, as measure_candidates() in
//              kernels/codec.h measures (low-rank candidates: on the real state);
//   simulated  on the error probe's sample of the layer, the candidate under its OWN
//              error feedback (plugin/collective/probe.h);
//   reference  on the same sample, measured as `measured` is;
//   current    on the same sample, on its real state (the residuals the codecs in effect
//              left), as measure_candidates() measures: where a switch would start;
//   simulated_independent  `simulated` with the ranks' errors weighed as independent,
//              as `current` and `reference` weigh them (their ratio: how the ranks'
//              errors correlate in the candidate's own state);
// and the realized error of the step on the sample. A candidate's estimate is
// simulated x measured / reference (window sums): its own-state error on the sample,
// scaled by the ratio of the whole layer's content to the sample's. Without a simulation
// (low-rank candidates; callers that only measure) it is `measured`; without a
// measurement of the whole layer, simulated x the layer's sample_scale (numel / sampled
// values). A sample holding a non-finite value (an AMP overflow step) is skipped and
// counted, never summed.
//
// Several ranks: each rank accumulates its own samples, or shares of a sample that
// another rank counts (the engine's ranks each measure their part of a layer; the probe
// runs on one rank per layer); the engine then sums the accumulators elementwise across
// ranks (reduction_buffer(), an allreduce with SUM over doubles that gives every rank the
// same bits) and hands the sum to the controller. The controller divides by the number of
// samples behind each layer, so it solves on means per step, and because every rank
// holds the same sums every rank solves the same problem.
//
// The metric turns a sample into the number the solver adds across layers:
//   kSquaredL2 (default): ||x - C(x)||^2. Squared errors of independent layers add up to
//     the squared error of the whole gradient, so the budget bounds exactly the variance
//     the compression adds to the model's update.
//   kL2: ||x - C(x)||, the paper's and its reference code's choice.
//   kNormalized (the library's default, config/params.cc): ||x - C(x)||^2 summed as
//     kSquaredL2 is; the controller then weighs each layer by n^2 / m^2 (n its elements,
//     m its magnitude sum |g|), which turns a layer's squared error into n times its error
//     relative to its gradient's energy per coordinate: what the error adds to an update
//     that Adam-family optimizers normalise per coordinate (docs/CONTROLLER.md, "What the
//     optimizer sees").
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace lgreco::controller {

enum class ErrorMetric { kSquaredL2, kL2, kNormalized };
const char* metric_name(ErrorMetric metric);
bool parse_metric(std::string_view text, ErrorMetric* metric);

class ErrorStats {
 public:
  // candidates_per_layer[l]: how many candidates layer l measures.
  ErrorStats(std::vector<uint32_t> candidates_per_layer, ErrorMetric metric);

  size_t layers() const { return first_.size() - 1; }
  uint32_t candidates(size_t layer) const { return first_[layer + 1] - first_[layer]; }
  ErrorMetric metric() const { return metric_; }

  // One sample of `layer`, or a share of one. `measured` has one value per candidate;
  // `simulated` and `reference` one per candidate or none (not measured so). With
  // counted = false the values add to a sample another rank counts. Returns false (and
  // counts it as skipped) when a value is negative, NaN or infinite. Throws
  // std::invalid_argument on a wrong layer index or candidate count.
  struct Sample {
    std::span<const double> measured, simulated, reference, current;
    // `simulated` with the ranks' errors weighed as independent (as `current` is).
    std::span<const double> simulated_independent;
    double realized = 0;
    double magnitude = 0;  // the gradient's sum of |g| (a share: this rank's), for drift
    bool counted = true;
  };
  bool add(size_t layer, const Sample& sample);
  // A sample with `measured` alone.
  bool add(size_t layer, std::span<const double> squared_errors) {
    Sample s;
    s.measured = squared_errors;
    return add(layer, s);
  }

  // The gradient's sum of |g| at a step of the first window's lead (the probe steps
  // before it; controller/schedule.h), for the first solve's drift, which has no window
  // before it. A share, counted or not, as in add(). Returns false (and adds nothing)
  // for a negative or non-finite value.
  bool add_lead(size_t layer, double magnitude, bool counted);

  // numel / sampled values of a layer's probe sample (1 by default): not part of the
  // reduction; every rank sets the same.
  void set_sample_scale(size_t layer, double scale);

  // Elementwise sum with another accumulator of the same shape (what the engine's
  // allreduce does across ranks). Throws std::invalid_argument on a shape mismatch.
  void merge(const ErrorStats& other);

  void clear();

  // Samples summed for a layer, and skipped ones.
  uint64_t samples(size_t layer) const;
  uint64_t skipped(size_t layer) const;
  // The estimate of a candidate's metric per step (above); 0 without samples.
  double mean(size_t layer, uint32_t candidate) const;
  // The realized error per step of the layer, scaled to the whole layer as the estimate of
  // `in_effect`, the candidate in effect, is: realized x measured / reference; 0 without
  // samples.
  double realized_mean(size_t layer, uint32_t in_effect) const;
  // The same scaled by the sample's share of the layer alone (numel / sampled values):
  // where no candidate of the sample's kind measured its content.
  double realized_mean_sampled(size_t layer) const;
  // The candidate's error on the real state now, per step, scaled alike: `current` x
  // measured / reference (its estimate when not simulated).
  double current_mean(size_t layer, uint32_t candidate) const;
  // `measured` per step: the candidate on the whole layer's gradient alone (low rank: its
  // real state).
  double measured_mean(size_t layer, uint32_t candidate) const;
  // How the ranks' errors add up in the candidate's own state: simulated over
  // simulated_independent (1: independent, as quantization's stochastic rounding; up to
  // P where every rank makes the same error: TopK's hold back the same coordinates). 0
  // where not measured.
  double shadow_correlation(size_t layer, uint32_t candidate) const;
  // The window sums of one measurement of a candidate (for tests and diagnostics).
  double measured_sum(size_t layer, uint32_t candidate) const { return data_[first_[layer] + candidate]; }
  double simulated_sum(size_t layer, uint32_t candidate) const { return data_[simulated_ + first_[layer] + candidate]; }
  double reference_sum(size_t layer, uint32_t candidate) const { return data_[reference_ + first_[layer] + candidate]; }
  double current_sum(size_t layer, uint32_t candidate) const { return data_[current_ + first_[layer] + candidate]; }
  double simulated_independent_sum(size_t layer, uint32_t candidate) const {
    return data_[independent_ + first_[layer] + candidate];
  }
  double realized_sum(size_t layer) const { return data_[realized_ + layer]; }

  // The gradient's sum of |g| per step (summed over ranks); 0 without samples.
  double magnitude_mean(size_t layer) const;
  // The same over the lead's steps (add_lead); 0 without any.
  double lead_magnitude_mean(size_t layer) const;

  // The accumulator's state as one flat array of doubles: the measured, simulated,
  // reference, current and simulated_independent sums per candidate; per layer the realized, magnitude and lead
  // magnitude sums, the lead's counts, the sample counts and the skipped counts. Summing
  // these elementwise across ranks (counts stay exact below 2^53) is the whole aggregation.
  std::span<double> reduction_buffer() { return data_; }
  std::span<const double> reduction_buffer() const { return data_; }

 private:
  std::vector<uint32_t> first_;  // candidate sums of layer l start at first_[l]
  ErrorMetric metric_;
  std::vector<double> data_;
  size_t simulated_ = 0, reference_ = 0, current_ = 0, independent_ = 0, realized_ = 0, magnitude_ = 0, lead_ = 0,
         samples_offset_ = 0;
  // The scale from the sample to the whole layer of candidate c's measurements.
  double content_ratio(size_t layer, uint32_t candidate) const;
  std::vector<double> scale_;  // per layer
};

}  // namespace lgreco::controller
