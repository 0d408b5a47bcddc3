#include "controller/problem_json.h"

#include <cmath>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

namespace lgreco::controller {

namespace {

using nlohmann::json;

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

// The value of a number as the message shows it.
std::string shown(const json& value) { return value.dump(); }

void check_object(const json& value, const std::string& path) {
  if (!value.is_object())
    throw ProblemError((path.empty() ? "the document" : path) + ": expected an object, got " + value.type_name());
}

void check_keys(const json& object, const std::string& path, std::initializer_list<std::string_view> allowed) {
  for (const auto& item : object.items()) {
    bool known = false;
    for (std::string_view k : allowed) known = known || item.key() == k;
    if (!known) {
      std::string list;
      for (std::string_view k : allowed) list += (list.empty() ? "" : ", ") + std::string(k);
      throw ProblemError(join(path, item.key()) + ": unknown key (expected one of: " + list + ")");
    }
  }
}

const json* find(const json& object, std::string_view key, const std::string& path, bool required) {
  const auto it = object.find(key);
  if (it == object.end()) {
    if (required) throw ProblemError(join(path, key) + ": missing");
    return nullptr;
  }
  return &*it;
}

double number_at(const json& object, std::string_view key, const std::string& path, std::optional<double> fallback,
                 const char* expected) {
  const json* v = find(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (!v->is_number()) throw ProblemError(join(path, key) + ": " + shown(*v) + "; expected " + expected);
  return v->get<double>();
}

uint64_t unsigned_at(const json& object, std::string_view key, const std::string& path,
                     std::optional<uint64_t> fallback) {
  const json* v = find(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (v->is_number_unsigned()) return v->get<uint64_t>();
  // 1234.0 is a whole number too (numpy floats print that way).
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d >= 0 && d <= 9007199254740992.0 && std::floor(d) == d) return static_cast<uint64_t>(d);
  }
  throw ProblemError(join(path, key) + ": " + shown(*v) + "; expected a non-negative integer");
}

std::string string_at(const json& object, std::string_view key, const std::string& path,
                      std::optional<std::string> fallback) {
  const json* v = find(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (!v->is_string()) throw ProblemError(join(path, key) + ": " + shown(*v) + "; expected a string");
  return v->get<std::string>();
}

const json& array_at(const json& object, std::string_view key, const std::string& path) {
  const json* v = find(object, key, path, true);
  if (!v->is_array()) throw ProblemError(join(path, key) + ": expected an array, got " + v->type_name());
  return *v;
}

LinkCost parse_link(const json& j, const std::string& path) {
  LinkCost link;
  link.bandwidth = number_at(j, "bandwidth", path, std::nullopt, "bytes per second, a number > 0");
  link.latency = number_at(j, "latency", path, 0.0, "seconds, a number >= 0");
  link.throughput = number_at(j, "throughput", path, 0.0, "elements per second, a number >= 0");
  return link;
}

CostModel parse_cost_model(const json& j, const std::string& path) {
  check_object(j, path);
  check_keys(j, path, {"bandwidth", "latency", "throughput", "families"});
  CostModel model;
  model.link = parse_link(j, path);
  if (const json* families = find(j, "families", path, false)) {
    const std::string fpath = join(path, "families");
    check_object(*families, fpath);
    for (const auto& item : families->items()) {
      const std::string p = join(fpath, item.key());
      check_object(item.value(), p);
      check_keys(item.value(), p, {"bandwidth", "latency", "throughput"});
      FamilyCost cost;
      for (auto [key, field] : {std::pair{"bandwidth", &cost.bandwidth}, std::pair{"latency", &cost.latency},
                                std::pair{"throughput", &cost.throughput}})
        if (item.value().contains(key)) *field = number_at(item.value(), key, p, std::nullopt, "a number");
      model.families.emplace(item.key(), cost);
    }
  }
  return model;
}

Candidate parse_candidate(const json& j, const std::string& path) {
  check_object(j, path);
  check_keys(j, path, {"codec", "bytes", "error"});
  Candidate c;
  c.codec = string_at(j, "codec", path, std::nullopt);
  c.bytes = unsigned_at(j, "bytes", path, std::nullopt);
  c.error = number_at(j, "error", path, std::nullopt, "a finite number >= 0");
  return c;
}

Layer parse_layer(const json& j, const std::string& path) {
  check_object(j, path);
  check_keys(j, path, {"name", "numel", "default", "candidates"});
  Layer layer;
  layer.name = string_at(j, "name", path, "");
  const std::string label = layer.name.empty() ? path : path + " (" + layer.name + ")";
  layer.numel = unsigned_at(j, "numel", label, 0);
  const json& candidates = array_at(j, "candidates", label);
  for (size_t c = 0; c < candidates.size(); ++c)
    layer.candidates.push_back(parse_candidate(candidates[c], label + ".candidates[" + std::to_string(c) + "]"));
  if (!j.contains("default") && layer.candidates.size() > 1)
    throw ProblemError(label + ".default: missing; required when a layer has more than one candidate");
  const uint64_t default_index = unsigned_at(j, "default", label, 0);
  if (default_index >= layer.candidates.size() && !layer.candidates.empty())
    throw ProblemError(label + ".default: " + std::to_string(default_index) + " is out of range (" +
                       std::to_string(layer.candidates.size()) + " candidates)");
  layer.default_index = static_cast<uint32_t>(default_index);
  return layer;
}

// "line 3, column 17" for a byte offset, as an editor counts.
std::string position_text(std::string_view text, size_t byte) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

// The last "key": before offset `byte`, to name the field of a syntax error.
std::string key_before(std::string_view text, size_t byte) {
  const std::string_view before = text.substr(0, std::min(byte, text.size()));
  const size_t colon = before.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return "";
  const size_t close = before.find_last_not_of(" \t\r\n", colon - 1);
  if (close == std::string_view::npos || before[close] != '"' || close == 0) return "";
  const size_t open = before.rfind('"', close - 1);
  if (open == std::string_view::npos) return "";
  return std::string(text.substr(open + 1, close - open - 1));
}

json parse_strict(std::string_view text) {
  // Duplicate keys would silently keep the last value.
  std::vector<std::set<std::string>> open_objects;
  const json::parser_callback_t reject_duplicates = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == json::parse_event_t::object_end) open_objects.pop_back();
    if (event == json::parse_event_t::key && !open_objects.back().insert(parsed.get<std::string>()).second)
      throw ProblemError("duplicate key \"" + parsed.get<std::string>() + "\"");
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), reject_duplicates);
  } catch (const json::parse_error& e) {
    const size_t byte = e.byte > 0 ? e.byte - 1 : 0;
    std::string message = "not valid JSON at " + position_text(text, byte);
    const std::string key = key_before(text, byte);
    if (!key.empty()) message += " (the value of \"" + key + "\")";
    // The failing byte may sit inside the token: look a few bytes around it.
    const std::string_view near = text.substr(std::min(byte >= 9 ? byte - 9 : 0, text.size()), 20);
    for (std::string_view token : {"NaN", "Infinity", "nan", "inf"})
      if (near.find(token) != std::string_view::npos)
        throw ProblemError(message + ": " + std::string(token) +
                           " is not a JSON number (Python's json.dumps writes it for a non-finite float); "
                           "every value must be finite");
    // nlohmann's text after its "[json.exception...] parse error at ...:" prefix.
    const std::string what = e.what();
    const size_t detail = what.find(": ");
    throw ProblemError(message + ": " + (detail == std::string::npos ? what : what.substr(detail + 2)));
  } catch (const json::exception& e) {  // e.g. a number beyond double's range
    const std::string what = e.what();
    const size_t detail = what.find("] ");
    throw ProblemError("not valid JSON: " + (detail == std::string::npos ? what : what.substr(detail + 2)));
  }
}

}  // namespace

Problem parse_problem_json(std::string_view text) {
  const json root = parse_strict(text);
  check_object(root, "");
  check_keys(root, "", {"alpha", "objective", "cost_model", "layers"});
  Problem problem;
  problem.alpha = number_at(root, "alpha", "", 1.0, "a finite number >= 0");
  const std::string objective = string_at(root, "objective", "", "size");
  if (!parse_objective(objective, &problem.objective))
    throw ProblemError("objective: \"" + objective + "\"; expected \"size\" or \"time\"");
  if (const json* model = find(root, "cost_model", "", problem.objective == Objective::kTime))
    problem.cost_model = parse_cost_model(*model, "cost_model");
  const json& layers = array_at(root, "layers", "");
  for (size_t l = 0; l < layers.size(); ++l)
    problem.layers.push_back(parse_layer(layers[l], "layers[" + std::to_string(l) + "]"));
  validate(problem);
  return problem;
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
  out["epoch"] = context.epoch;
  out["stats_last_step"] = context.stats_last_step;
  out["effective_step"] = context.effective_step;
  out["samples"] = context.samples;
  const ordered totals = summary(problem, solution);
  for (const auto& item : totals.items()) out[item.key()] = item.value();
  out["solve_ms"] = solve_ms;
  ordered layers = ordered::array();
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const Candidate& c = problem.layers[l].candidates[solution.choices[l]];
    layers.push_back({{"name", problem.layers[l].name}, {"codec", c.codec}, {"bytes", c.bytes}, {"error", c.error}});
  }
  out["layers"] = std::move(layers);
  return dump(out);
}

}  // namespace lgreco::controller
