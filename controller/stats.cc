#include "controller/stats.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace lgreco::controller {

const char* metric_name(ErrorMetric metric) {
  switch (metric) {
    case ErrorMetric::kSquaredL2: return "squared";
    case ErrorMetric::kL2: return "l2";
  }
  return "?";
}

bool parse_metric(std::string_view text, ErrorMetric* metric) {
  if (text == "squared") {
    *metric = ErrorMetric::kSquaredL2;
    return true;
  }
  if (text == "l2") {
    *metric = ErrorMetric::kL2;
    return true;
  }
  return false;
}

ErrorStats::ErrorStats(std::vector<uint32_t> candidates_per_layer, ErrorMetric metric) : metric_(metric) {
  first_.push_back(0);
  for (uint32_t n : candidates_per_layer) first_.push_back(first_.back() + n);
  samples_offset_ = first_.back();
  data_.assign(samples_offset_ + 2 * layers(), 0.0);
}

bool ErrorStats::add(size_t layer, std::span<const double> squared_errors) {
  if (layer >= layers())
    throw std::invalid_argument("ErrorStats::add: layer " + std::to_string(layer) + " of " + std::to_string(layers()));
  if (squared_errors.size() != candidates(layer))
    throw std::invalid_argument("ErrorStats::add: layer " + std::to_string(layer) + " measures " +
                                std::to_string(candidates(layer)) + " candidates, got " +
                                std::to_string(squared_errors.size()));
  const bool usable =
      std::all_of(squared_errors.begin(), squared_errors.end(), [](double e) { return std::isfinite(e) && e >= 0; });
  if (!usable) {
    data_[samples_offset_ + layers() + layer] += 1;
    return false;
  }
  double* sums = &data_[first_[layer]];
  for (size_t c = 0; c < squared_errors.size(); ++c)
    sums[c] += metric_ == ErrorMetric::kL2 ? std::sqrt(squared_errors[c]) : squared_errors[c];
  data_[samples_offset_ + layer] += 1;
  return true;
}

void ErrorStats::merge(const ErrorStats& other) {
  if (other.first_ != first_ || other.metric_ != metric_)
    throw std::invalid_argument("ErrorStats::merge: accumulators of different shapes or metrics");
  for (size_t i = 0; i < data_.size(); ++i) data_[i] += other.data_[i];
}

void ErrorStats::clear() { std::fill(data_.begin(), data_.end(), 0.0); }

uint64_t ErrorStats::samples(size_t layer) const { return static_cast<uint64_t>(data_[samples_offset_ + layer]); }

uint64_t ErrorStats::skipped(size_t layer) const {
  return static_cast<uint64_t>(data_[samples_offset_ + layers() + layer]);
}

double ErrorStats::mean(size_t layer, uint32_t candidate) const {
  const double n = data_[samples_offset_ + layer];
  return n > 0 ? data_[first_[layer] + candidate] / n : 0.0;
}

}  // namespace lgreco::controller
