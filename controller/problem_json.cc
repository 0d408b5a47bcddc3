#include "controller/problem_json.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "config/json_strict.h"

namespace lgreco::controller {

namespace {

using nlohmann::json;

LinkCost parse_link(const json& j, const std::string& path) {
  LinkCost link;
  link.bandwidth = config::number_field(j, "bandwidth", path, std::nullopt, "bytes per second, a number > 0");
  link.latency = config::number_field(j, "latency", path, 0.0, "seconds, a number >= 0");
  link.throughput = config::number_field(j, "throughput", path, 0.0, "elements per second, a number >= 0");
  return link;
}

CostModel parse_cost_model(const json& j, const std::string& path) {
  config::expect_object(j, path);
  config::expect_keys(j, path, {"bandwidth", "latency", "throughput", "families"});
  CostModel model;
  model.link = parse_link(j, path);
  if (const json* families = config::find_field(j, "families", path, false)) {
    const std::string fpath = config::json_path(path, "families");
    config::expect_object(*families, fpath);
    for (const auto& item : families->items()) {
      const std::string p = config::json_path(fpath, item.key());
      config::expect_object(item.value(), p);
      config::expect_keys(item.value(), p, {"bandwidth", "latency", "throughput"});
      FamilyCost cost;
      for (auto [key, field] : {std::pair{"bandwidth", &cost.bandwidth}, std::pair{"latency", &cost.latency},
                                std::pair{"throughput", &cost.throughput}})
        if (item.value().contains(key)) *field = config::number_field(item.value(), key, p, std::nullopt, "a number");
      model.families.emplace(item.key(), cost);
    }
  }
  return model;
}

Candidate parse_candidate(const json& j, const std::string& path) {
  config::expect_object(j, path);
  config::expect_keys(j, path, {"codec", "bytes", "error"});
  Candidate c;
  c.codec = config::string_field(j, "codec", path, std::nullopt);
  c.bytes = config::unsigned_field(j, "bytes", path, std::nullopt);
  c.error = config::number_field(j, "error", path, std::nullopt, "a finite number >= 0");
  return c;
}

Layer parse_layer(const json& j, const std::string& path) {
  config::expect_object(j, path);
  config::expect_keys(j, path, {"name", "numel", "default", "candidates"});
  Layer layer;
  layer.name = config::string_field(j, "name", path, "");
  const std::string label = layer.name.empty() ? path : path + " (" + layer.name + ")";
  layer.numel = config::unsigned_field(j, "numel", label, 0);
  const json& candidates = config::array_field(j, "candidates", label);
  for (size_t c = 0; c < candidates.size(); ++c)
    layer.candidates.push_back(parse_candidate(candidates[c], label + ".candidates[" + std::to_string(c) + "]"));
  if (!j.contains("default") && layer.candidates.size() > 1)
    throw ProblemError(label + ".default: missing; required when a layer has more than one candidate");
  const uint64_t default_index = config::unsigned_field(j, "default", label, 0);
  if (default_index >= layer.candidates.size() && !layer.candidates.empty())
    throw ProblemError(label + ".default: " + std::to_string(default_index) + " is out of range (" +
                       std::to_string(layer.candidates.size()) + " candidates)");
  layer.default_index = static_cast<uint32_t>(default_index);
  return layer;
}

}  // namespace

Problem parse_problem_json(std::string_view text) try {
  const json root = config::parse_strict_json(text);
  config::expect_object(root, "");
  config::expect_keys(root, "", {"alpha", "objective", "cost_model", "layers"});
  Problem problem;
  problem.alpha = config::number_field(root, "alpha", "", 1.0, "a finite number >= 0");
  const std::string objective = config::string_field(root, "objective", "", "size");
  if (!parse_objective(objective, &problem.objective))
    throw ProblemError("objective: \"" + objective + "\"; expected \"size\" or \"time\"");
  if (const json* model = config::find_field(root, "cost_model", "", problem.objective == Objective::kTime))
    problem.cost_model = parse_cost_model(*model, "cost_model");
  const json& layers = config::array_field(root, "layers", "");
  for (size_t l = 0; l < layers.size(); ++l)
    problem.layers.push_back(parse_layer(layers[l], "layers[" + std::to_string(l) + "]"));
  validate(problem);
  return problem;
} catch (const config::JsonError& e) {
  throw ProblemError(e.what());
}

namespace {

// Output keeps a reading order (ordered_json), input does not need one.
using ordered = nlohmann::ordered_json;

// One line; bytes that are not UTF-8 in a layer name or codec become U+FFFD instead of
// an exception on the solver thread.
std::string dump(const ordered& value) { return value.dump(-1, ' ', false, ordered::error_handler_t::replace); }

ordered summary(const Problem& problem, const Solution& s) {
  ordered out = ordered::object();
  out["objective"] = objective_name(problem.objective);
  out["feasible"] = s.feasible;
  out["bytes"] = s.bytes;
  out["error"] = s.error;
  out["budget"] = s.budget;
  out["default_bytes"] = s.default_bytes;
  out["default_error"] = s.default_error;
  if (problem.objective == Objective::kTime) {
    out["time"] = s.cost;
    out["default_time"] = s.default_cost;
  }
  out["lower_bound"] = s.lower_bound;
  out["gap"] = s.feasible ? relative_gap(s) : 0.0;
  out["core_layers"] = s.core_layers;
  return out;
}

}  // namespace

std::string solution_json(const Problem& problem, const Solution& solution, double solve_ms) {
  ordered out = ordered::object();
  out["choices"] = solution.choices;
  const ordered totals = summary(problem, solution);
  for (const auto& item : totals.items()) out[item.key()] = item.value();
  out["solve_ms"] = solve_ms;
  return dump(out);
}

std::string decision_json(const DecisionContext& context, const Problem& problem, const Solution& solution,
                          double solve_ms) {
  ordered out = ordered::object();
  out["log_version"] = kDecisionLogVersion;
  out["epoch"] = context.epoch;
  out["stats_last_step"] = context.stats_last_step;
  out["effective_step"] = context.effective_step;
  out["samples"] = context.samples;
  out["alpha"] = context.alpha;
  out["alpha_eff"] = context.alpha_eff;
  out["loop_bias"] = context.loop_bias;
  if (context.metric) out["metric"] = context.metric;
  out["kept_defaults"] = context.kept_defaults;
  out["window"] = {{"realized", context.window_realized},
                   {"predicted", context.window_predicted},
                   {"budget", context.window_budget}};
  const ordered totals = summary(problem, solution);
  for (const auto& item : totals.items()) out[item.key()] = item.value();
  out["solve_ms"] = solve_ms;
  ordered layers = ordered::array();
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const Candidate& c = problem.layers[l].candidates[solution.choices[l]];
    const std::string& default_codec = problem.layers[l].candidates[problem.layers[l].default_index].codec;
    ordered layer = {{"name", problem.layers[l].name},
                     {"codec", c.codec},
                     {"default_codec", default_codec},
                     {"bytes", c.bytes},
                     {"error", c.error}};
    if (context.layer_realized) layer["window_realized"] = (*context.layer_realized)[l];
    if (!context.layer_drift.empty()) layer["drift"] = context.layer_drift[l];
    if (!context.layer_relative.empty()) layer["relative"] = context.layer_relative[l];
    if (!context.layer_window_relative.empty()) layer["window_relative"] = context.layer_window_relative[l];
    if (!context.layer_relative_bound.empty() && context.layer_relative_bound[l] > 0)
      layer["relative_bound"] = context.layer_relative_bound[l];
    layers.push_back(std::move(layer));
  }
  out["layers"] = std::move(layers);
  return dump(out);
}

}  // namespace lgreco::controller
