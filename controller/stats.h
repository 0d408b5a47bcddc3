// Error statistics of the candidates over a measurement window.
//
// Each sample is one layer on one rank at one step: the squared L2 error of every
// candidate on the error-feedback-corrected gradient x = g + residual (what
// measure_candidates() in kernels/codec.h returns). A sample holding a non-finite value
// (an AMP overflow step) is skipped and counted, never summed.
//
// Several ranks: each rank accumulates its own samples; the engine then sums the
// accumulators elementwise across ranks (reduction_buffer(), an allreduce with SUM over
// doubles that gives every rank the same bits) and hands the sum to the controller. The
// controller divides by the number of samples behind each layer, so it solves on means
// per (step, rank), and because every rank holds the same sums every rank solves the
// same problem.
//
// The metric turns a sample into the number the solver adds across layers:
//   kSquaredL2 (default): ||x - C(x)||^2. Squared errors of independent layers add up to
//     the squared error of the whole gradient, so the budget bounds exactly the variance
//     the compression adds to the model's update.
//   kL2: ||x - C(x)||, the paper's and its reference code's choice.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace lgreco::controller {

enum class ErrorMetric { kSquaredL2, kL2 };
const char* metric_name(ErrorMetric metric);
bool parse_metric(std::string_view text, ErrorMetric* metric);

class ErrorStats {
 public:
  // candidates_per_layer[l]: how many candidates layer l measures.
  ErrorStats(std::vector<uint32_t> candidates_per_layer, ErrorMetric metric);

  size_t layers() const { return first_.size() - 1; }
  uint32_t candidates(size_t layer) const { return first_[layer + 1] - first_[layer]; }
  ErrorMetric metric() const { return metric_; }

  // One sample of `layer`: squared errors, one per candidate. Returns false (and counts it
  // as skipped) when a value is negative, NaN or infinite. Throws std::invalid_argument on
  // a wrong layer index or candidate count.
  bool add(size_t layer, std::span<const double> squared_errors);

  // Elementwise sum with another accumulator of the same shape (what the engine's
  // allreduce does across ranks). Throws std::invalid_argument on a shape mismatch.
  void merge(const ErrorStats& other);

  void clear();

  // Samples summed for a layer, and skipped ones.
  uint64_t samples(size_t layer) const;
  uint64_t skipped(size_t layer) const;
  // Mean metric value of a candidate over the layer's samples; 0 without samples.
  double mean(size_t layer, uint32_t candidate) const;

  // The accumulator's state as one flat array of doubles: per-candidate sums, then
  // per-layer sample counts, then skipped counts. Summing these elementwise across ranks
  // (counts stay exact below 2^53) is the whole aggregation.
  std::span<double> reduction_buffer() { return data_; }
  std::span<const double> reduction_buffer() const { return data_; }

 private:
  std::vector<uint32_t> first_;  // candidate sums of layer l start at first_[l]
  ErrorMetric metric_;
  std::vector<double> data_;
  size_t samples_offset_ = 0;
};

}  // namespace lgreco::controller
