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
    case ErrorMetric::kNormalized: return "normalized";
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
  if (text == "normalized") {
    *metric = ErrorMetric::kNormalized;
    return true;
  }
  return false;
}

ErrorStats::ErrorStats(std::vector<uint32_t> candidates_per_layer, ErrorMetric metric) : metric_(metric) {
  first_.push_back(0);
  for (uint32_t n : candidates_per_layer) first_.push_back(first_.back() + n);
  simulated_ = first_.back();
  reference_ = 2 * first_.back();
  current_ = 3 * first_.back();
  independent_ = 4 * first_.back();
  realized_ = 5 * first_.back();
  magnitude_ = realized_ + layers();
  lead_ = magnitude_ + layers();  // lead magnitude sums, then the lead's counts
  samples_offset_ = lead_ + 2 * layers();
  data_.assign(samples_offset_ + 2 * layers(), 0.0);
  scale_.assign(layers(), 1.0);
}

void ErrorStats::set_sample_scale(size_t layer, double scale) {
  if (layer >= layers() || !(scale >= 1) || !std::isfinite(scale))
    throw std::invalid_argument("ErrorStats::set_sample_scale: layer " + std::to_string(layer) + ", scale " +
                                std::to_string(scale));
  scale_[layer] = scale;
}

bool ErrorStats::add(size_t layer, const Sample& s) {
  if (layer >= layers())
    throw std::invalid_argument("ErrorStats::add: layer " + std::to_string(layer) + " of " + std::to_string(layers()));
  const uint32_t n = candidates(layer);
  const auto fits = [n](std::span<const double> v) { return v.empty() || v.size() == n; };
  if (s.measured.size() != n || !fits(s.simulated) || !fits(s.reference) || !fits(s.current) ||
      !fits(s.simulated_independent))
    throw std::invalid_argument("ErrorStats::add: layer " + std::to_string(layer) + " measures " + std::to_string(n) +
                                " candidates, got " + std::to_string(s.measured.size()) + ", " +
                                std::to_string(s.simulated.size()) + ", " + std::to_string(s.reference.size()) +
                                ", " + std::to_string(s.current.size()) + ", " +
                                std::to_string(s.simulated_independent.size()));
  const auto finite = [](double e) { return std::isfinite(e) && e >= 0; };
  const auto all_finite = [&](std::span<const double> v) { return std::all_of(v.begin(), v.end(), finite); };
  if (!all_finite(s.measured) || !all_finite(s.simulated) || !all_finite(s.reference) || !all_finite(s.current) ||
      !all_finite(s.simulated_independent) || !finite(s.realized) || !finite(s.magnitude)) {
    data_[samples_offset_ + layers() + layer] += 1;
    return false;
  }
  // kNormalized sums squared errors too: its weights come from the window's magnitudes,
  // which only the whole window knows (Controller, metric_weight).
  const auto metric = [this](double e) { return metric_ == ErrorMetric::kL2 ? std::sqrt(e) : e; };
  for (uint32_t c = 0; c < n; ++c) {
    data_[first_[layer] + c] += metric(s.measured[c]);
    if (!s.simulated.empty()) data_[simulated_ + first_[layer] + c] += metric(s.simulated[c]);
    if (!s.reference.empty()) data_[reference_ + first_[layer] + c] += metric(s.reference[c]);
    if (!s.current.empty()) data_[current_ + first_[layer] + c] += metric(s.current[c]);
    if (!s.simulated_independent.empty())
      data_[independent_ + first_[layer] + c] += metric(s.simulated_independent[c]);
  }
  data_[realized_ + layer] += metric(s.realized);
  data_[magnitude_ + layer] += s.magnitude;
  if (s.counted) data_[samples_offset_ + layer] += 1;
  return true;
}

bool ErrorStats::add_lead(size_t layer, double magnitude, bool counted) {
  if (layer >= layers())
    throw std::invalid_argument("ErrorStats::add_lead: layer " + std::to_string(layer) + " of " +
                                std::to_string(layers()));
  if (!std::isfinite(magnitude) || magnitude < 0) return false;
  data_[lead_ + layer] += magnitude;
  if (counted) data_[lead_ + layers() + layer] += 1;
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

double ErrorStats::content_ratio(size_t layer, uint32_t candidate) const {
  const double measured = measured_sum(layer, candidate), reference = reference_sum(layer, candidate);
  return measured > 0 && reference > 0 ? measured / reference : scale_[layer];
}

double ErrorStats::mean(size_t layer, uint32_t candidate) const {
  const double n = data_[samples_offset_ + layer];
  if (!(n > 0)) return 0.0;
  const double simulated = simulated_sum(layer, candidate);
  if (simulated > 0) return simulated / n * content_ratio(layer, candidate);
  return measured_sum(layer, candidate) / n;
}

double ErrorStats::current_mean(size_t layer, uint32_t candidate) const {
  const double n = data_[samples_offset_ + layer];
  if (!(n > 0)) return 0.0;
  const double current = current_sum(layer, candidate);
  if (current > 0 && simulated_sum(layer, candidate) > 0) return current / n * content_ratio(layer, candidate);
  return mean(layer, candidate);
}

double ErrorStats::shadow_correlation(size_t layer, uint32_t candidate) const {
  const double together = simulated_sum(layer, candidate), apart = simulated_independent_sum(layer, candidate);
  return together > 0 && apart > 0 ? together / apart : 0.0;
}

double ErrorStats::measured_mean(size_t layer, uint32_t candidate) const {
  const double n = data_[samples_offset_ + layer];
  return n > 0 ? measured_sum(layer, candidate) / n : 0.0;
}

double ErrorStats::magnitude_mean(size_t layer) const {
  const double n = data_[samples_offset_ + layer];
  return n > 0 ? data_[magnitude_ + layer] / n : 0.0;
}

double ErrorStats::lead_magnitude_mean(size_t layer) const {
  const double n = data_[lead_ + layers() + layer];
  return n > 0 ? data_[lead_ + layer] / n : 0.0;
}

double ErrorStats::realized_mean(size_t layer, uint32_t in_effect) const {
  const double n = data_[samples_offset_ + layer];
  if (!(n > 0)) return 0.0;
  return realized_sum(layer) / n * content_ratio(layer, in_effect);
}

double ErrorStats::realized_mean_sampled(size_t layer) const {
  const double n = data_[samples_offset_ + layer];
  return n > 0 ? realized_sum(layer) / n * scale_[layer] : 0.0;
}

}  // namespace lgreco::controller
