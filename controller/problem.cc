#include "controller/problem.h"

#include <algorithm>
#include <cmath>
#include <set>

namespace lgreco::controller {

const char* objective_name(Objective objective) {
  switch (objective) {
    case Objective::kSize: return "size";
    case Objective::kTime: return "time";
  }
  return "?";
}

bool parse_objective(std::string_view text, Objective* objective) {
  if (text == "size") {
    *objective = Objective::kSize;
    return true;
  }
  if (text == "time") {
    *objective = Objective::kTime;
    return true;
  }
  return false;
}

std::string_view codec_family(std::string_view codec_spec) { return codec_spec.substr(0, codec_spec.find(':')); }

LinkCost CostModel::for_family(std::string_view family) const {
  LinkCost cost = link;
  const auto it = families.find(family);
  if (it != families.end()) {
    cost.bandwidth = it->second.bandwidth.value_or(cost.bandwidth);
    cost.latency = it->second.latency.value_or(cost.latency);
    cost.throughput = it->second.throughput.value_or(cost.throughput);
  }
  return cost;
}

double CostModel::seconds(std::string_view family, uint64_t bytes, uint64_t numel) const {
  const LinkCost cost = for_family(family);
  double t = cost.latency + static_cast<double>(bytes) / cost.bandwidth;
  if (cost.throughput > 0) t += static_cast<double>(numel) / cost.throughput;
  return t;
}

std::string layer_label(const Problem& problem, size_t layer) {
  std::string label = "layers[" + std::to_string(layer) + "]";
  if (layer < problem.layers.size() && !problem.layers[layer].name.empty())
    label += " (" + problem.layers[layer].name + ")";
  return label;
}

namespace {

std::string number_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void require(bool ok, const std::string& field, double value, const char* expected) {
  if (!ok) throw ProblemError(field + ": " + number_text(value) + "; expected " + expected);
}

void validate_link(const LinkCost& cost, const std::string& prefix) {
  require(std::isfinite(cost.bandwidth) && cost.bandwidth > 0, prefix + "bandwidth", cost.bandwidth,
          "a finite number of bytes per second > 0");
  require(std::isfinite(cost.latency) && cost.latency >= 0, prefix + "latency", cost.latency,
          "a finite number of seconds >= 0");
  require(std::isfinite(cost.throughput) && cost.throughput >= 0, prefix + "throughput", cost.throughput,
          "a finite number of elements per second >= 0 (0: not modelled)");
}

void validate_cost_model(const CostModel& model) {
  validate_link(model.link, "cost_model.");
  // Each family's effective numbers, so that an override is checked by the same rules.
  for (const auto& entry : model.families)
    validate_link(model.for_family(entry.first), "cost_model.families." + entry.first + ".");
}

}  // namespace

void validate(const Problem& problem) {
  require(std::isfinite(problem.alpha) && problem.alpha >= 0, "alpha", problem.alpha, "a finite number >= 0");
  if (problem.objective == Objective::kTime) validate_cost_model(problem.cost_model);
  std::set<std::string_view> names;
  double largest_errors = 0;  // the largest total error any assignment can have
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const Layer& layer = problem.layers[l];
    const std::string label = layer_label(problem, l);
    if (!layer.name.empty() && !names.insert(layer.name).second)
      throw ProblemError(label + ".name: duplicate layer name '" + layer.name + "'");
    if (layer.candidates.empty()) throw ProblemError(label + ".candidates: empty; a layer needs at least one");
    if (layer.candidates.size() > kMaxCandidatesPerLayer)
      throw ProblemError(label + ".candidates: " + std::to_string(layer.candidates.size()) + " candidates; at most " +
                         std::to_string(kMaxCandidatesPerLayer));
    if (layer.default_index >= layer.candidates.size())
      throw ProblemError(label + ".default: " + std::to_string(layer.default_index) + " is out of range (" +
                         std::to_string(layer.candidates.size()) + " candidates)");
    for (size_t c = 0; c < layer.candidates.size(); ++c) {
      const Candidate& candidate = layer.candidates[c];
      const std::string field = label + ".candidates[" + std::to_string(c) + "]";
      require(std::isfinite(candidate.error) && candidate.error >= 0, field + ".error", candidate.error,
              "a finite number >= 0");
      // Byte totals are summed in doubles: keep every sum exact.
      if (candidate.bytes > (uint64_t{1} << 50))
        throw ProblemError(field + ".bytes: " + std::to_string(candidate.bytes) + "; expected at most 2^50");
      if (problem.objective == Objective::kTime && layer.numel == 0 &&
          problem.cost_model.for_family(codec_family(candidate.codec)).throughput > 0)
        throw ProblemError(label + ".numel: missing; the time objective models codec throughput for '" +
                           candidate.codec + "' and needs the layer's element count");
      if (problem.objective == Objective::kTime) {
        const double t = problem.cost_model.seconds(codec_family(candidate.codec), candidate.bytes, layer.numel);
        if (!std::isfinite(t) || t > 1e100)
          throw ProblemError(field + ": predicted time " + number_text(t) +
                             " s is out of range; check cost_model's bandwidth and throughput");
      }
    }
    double largest = 0;
    for (const Candidate& c : layer.candidates) largest = std::max(largest, c.error);
    largest_errors += largest;
  }
  // Totals are summed in doubles; they must stay finite, with room for alpha.
  if (!(largest_errors <= 1e300))
    throw ProblemError("layers: the errors are too large (their total exceeds 1e300); scale them down");
  if (!(problem.alpha * largest_errors <= 1e300))
    throw ProblemError("alpha: " + number_text(problem.alpha) +
                       " times the total error overflows; expected a smaller alpha");
}

}  // namespace lgreco::controller
