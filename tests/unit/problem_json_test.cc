// The problem file lgreco-solve reads, the answer it prints and the decision-log line.
#include "controller/problem_json.h"

#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>
#include <string>

namespace lgreco {
namespace {

using controller::ProblemError;
using nlohmann::json;

const char kProblem[] = R"({
  "alpha": 0.9, "objective": "time",
  "cost_model": {"bandwidth": 1.25e9, "latency": 2e-5,
                 "families": {"quant": {"throughput": 2e10}, "none": {"latency": 0, "bandwidth": 2.5e9}}},
  "layers": [
    {"name": "conv1", "numel": 9408, "default": 1,
     "candidates": [{"codec": "quant:bits=2", "bytes": 2424, "error": 0.5},
                    {"codec": "quant:bits=4", "bytes": 4776.0, "error": 0.125}]},
    {"name": "bn1.weight", "candidates": [{"codec": "none", "bytes": 256, "error": 0}]}
  ]})";

std::string error_of(const std::string& text) {
  try {
    controller::parse_problem_json(text);
  } catch (const ProblemError& e) {
    return e.what();
  }
  return "no error";
}

BOOST_AUTO_TEST_SUITE(problem_json)

BOOST_AUTO_TEST_CASE(parses_every_field) {
  const controller::Problem p = controller::parse_problem_json(kProblem);
  BOOST_TEST(p.alpha == 0.9);
  BOOST_TEST(std::string(objective_name(p.objective)) == "time");
  BOOST_TEST(p.cost_model.link.bandwidth == 1.25e9);
  BOOST_TEST(p.cost_model.link.latency == 2e-5);
  BOOST_TEST(p.cost_model.link.throughput == 0.0);
  BOOST_TEST(p.cost_model.for_family("quant").throughput == 2e10);
  BOOST_TEST(p.cost_model.for_family("quant").latency == 2e-5);
  BOOST_TEST(p.cost_model.for_family("none").latency == 0.0);
  BOOST_TEST(p.cost_model.for_family("none").bandwidth == 2.5e9);
  BOOST_REQUIRE_EQUAL(p.layers.size(), 2u);
  BOOST_TEST(p.layers[0].name == "conv1");
  BOOST_TEST(p.layers[0].numel == 9408u);
  BOOST_TEST(p.layers[0].default_index == 1u);
  BOOST_TEST(p.layers[0].candidates[1].codec == "quant:bits=4");
  BOOST_TEST(p.layers[0].candidates[1].bytes == 4776u);  // a whole float is accepted
  BOOST_TEST(p.layers[0].candidates[1].error == 0.125);
  BOOST_TEST(p.layers[1].default_index == 0u);  // optional with one candidate
  // Defaults of the optional top-level fields.
  const controller::Problem q = controller::parse_problem_json(R"({"layers": []})");
  BOOST_TEST(q.alpha == 1.0);
  BOOST_TEST(std::string(objective_name(q.objective)) == "size");
}

BOOST_AUTO_TEST_CASE(malformed_input_names_the_field) {
  struct Case {
    std::string text, expected;
  };
  const std::string layer =
      R"({"name": "fc", "default": 0, "candidates": [{"codec": "quant", "bytes": 8, "error": 1}]})";
  auto with_candidate = [](const std::string& candidate) {
    return R"({"layers": [{"name": "fc", "default": 0, "candidates": [)" + candidate + "]}]}";
  };
  const Case cases[] = {
      {"nope", "not valid JSON at line 1, column"},
      {"{\"layers\": [\n {\"name\": \"x\", \"candidates\": [{\"codec\": \"none\", \"bytes\": 1, \"error\": NaN}]}]}",
       "not valid JSON at line 2, column 70 (the value of \"error\"): NaN is not a JSON number"},
      {"[]", "the document: expected an object, got array"},
      {"{}", "layers: missing"},
      {R"({"layers": {}})", "layers: expected an array, got object"},
      {R"({"layers": [], "alpah": 1})", "alpah: unknown key (expected one of: alpha, objective, cost_model, layers)"},
      {R"({"layers": [], "alpha": "1"})", "alpha: \"1\"; expected a finite number >= 0"},
      {R"({"layers": [], "alpha": -1})", "alpha: -1; expected a finite number >= 0"},
      {R"({"layers": [], "objective": "speed"})", "objective: \"speed\"; expected \"size\" or \"time\""},
      {R"({"layers": [], "objective": "time"})", "cost_model: missing"},
      {R"({"layers": [], "objective": "time", "cost_model": {"bandwidth": 0}})",
       "cost_model.bandwidth: 0; expected a finite number of bytes per second > 0"},
      {R"({"layers": [], "objective": "time", "cost_model": {"bandwidth": 1, "families": {"quant": {"latency": -1}}}})",
       "cost_model.families.quant.latency: -1; expected a finite number of seconds >= 0"},
      {R"({"layers": [], "cost_model": {"bandwidth": 1, "lat": 0}})", "cost_model.lat: unknown key"},
      {with_candidate(R"({"codec": "quant", "bytes": -5, "error": 1})"),
       "layers[0] (fc).candidates[0].bytes: -5; expected a non-negative integer"},
      {with_candidate(R"({"codec": "quant", "bytes": 12.5, "error": 1})"),
       "layers[0] (fc).candidates[0].bytes: 12.5; expected a non-negative integer"},
      {with_candidate(R"({"codec": "quant", "error": 1})"), "layers[0] (fc).candidates[0].bytes: missing"},
      {with_candidate(R"({"codec": "quant", "bytes": 8, "error": null})"),
       "layers[0] (fc).candidates[0].error: null; expected a finite number >= 0"},
      {with_candidate(R"({"codec": "quant", "bytes": 8, "error": -0.5})"),
       "layers[0] (fc).candidates[0].error: -0.5; expected a finite number >= 0"},
      {with_candidate(R"({"codec": "quant", "bytes": 8, "error": 1e400})"),
       "not valid JSON: number overflow parsing '1e400'"},
      {with_candidate(R"({"codec": 4, "bytes": 8, "error": 1})"),
       "layers[0] (fc).candidates[0].codec: 4; expected a string"},
      {with_candidate(R"({"codec": "q", "bytes": 8, "error": 1, "bytes": 9})"), "duplicate key \"bytes\""},
      {with_candidate(R"({"codec": "q", "bytes": 8, "eror": 1})"), "layers[0] (fc).candidates[0].eror: unknown key"},
      {R"({"layers": [{"name": "fc", "default": 3, "candidates": [{"codec": "q", "bytes": 8, "error": 1}]}]})",
       "layers[0] (fc).default: 3 is out of range (1 candidates)"},
      {R"({"layers": [{"name": "fc", "candidates": [{"codec": "q", "bytes": 8, "error": 1}, {"codec": "r", "bytes": 4, "error": 2}]}]})",
       "layers[0] (fc).default: missing; required when a layer has more than one candidate"},
      {R"({"layers": [{"name": "fc", "candidates": []}]})", "layers[0] (fc).candidates: empty"},
      {R"({"layers": [)" + layer + "," + layer + "]}", "layers[1] (fc).name: duplicate layer name 'fc'"},
      {R"({"layers": [7]})", "layers[0]: expected an object, got number"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.text) {
      const std::string message = error_of(c.text);
      BOOST_TEST(message.find(c.expected) == 0, "message: " << message);
    }
  }
}

BOOST_AUTO_TEST_CASE(solution_and_decision_lines_are_json_with_every_field) {
  const controller::Problem p = controller::parse_problem_json(kProblem);
  const controller::Solution s = controller::solve(p);
  const json out = json::parse(controller::solution_json(p, s, 1.5));
  BOOST_TEST(out.at("choices").get<std::vector<uint32_t>>() == s.choices);
  BOOST_TEST(out.at("feasible").get<bool>() == s.feasible);
  BOOST_TEST(out.at("bytes").get<uint64_t>() == s.bytes);
  BOOST_TEST(out.at("error").get<double>() == s.error);  // doubles round-trip exactly
  BOOST_TEST(out.at("budget").get<double>() == s.budget);
  BOOST_TEST(out.at("default_bytes").get<uint64_t>() == s.default_bytes);
  BOOST_TEST(out.at("time").get<double>() == s.cost);
  BOOST_TEST(out.at("lower_bound").get<double>() == s.lower_bound);
  BOOST_TEST(out.at("solve_ms").get<double>() == 1.5);
  BOOST_TEST(out.at("objective").get<std::string>() == "time");

  controller::DecisionContext context;
  context.epoch = 3;
  context.stats_last_step = 299;
  context.effective_step = 302;
  context.samples = 40;
  context.alpha = 1.0;
  context.alpha_eff = 0.8125;
  context.window_realized = 3.5;
  context.window_predicted = 3.0;
  context.window_budget = 3.25;
  const std::vector<double> realized = {1.5, 0.0}, drift = {0.75, 1.0};
  context.layer_realized = &realized;
  context.layer_drift = drift;
  const std::string line = controller::decision_json(context, p, s, 0.25);
  BOOST_TEST(line.find('\n') == std::string::npos);
  const json d = json::parse(line);
  // The format version comes first, so that a reader can refuse a line before the rest.
  BOOST_TEST(line.starts_with("{\"log_version\":" + std::to_string(controller::kDecisionLogVersion) + ","), line);
  BOOST_TEST(d.at("log_version").get<int>() == controller::kDecisionLogVersion);
  BOOST_TEST(d.at("epoch").get<uint64_t>() == 3u);
  BOOST_TEST(d.at("stats_last_step").get<uint64_t>() == 299u);
  BOOST_TEST(d.at("effective_step").get<uint64_t>() == 302u);
  BOOST_TEST(d.at("samples").get<uint64_t>() == 40u);
  BOOST_TEST(d.at("budget").get<double>() == s.budget);
  BOOST_REQUIRE_EQUAL(d.at("layers").size(), 2u);
  BOOST_TEST(d.at("layers")[0].at("name").get<std::string>() == "conv1");
  BOOST_TEST(d.at("layers")[0].at("codec").get<std::string>() == p.layers[0].candidates[s.choices[0]].codec);
  BOOST_TEST(d.at("layers")[1].at("bytes").get<uint64_t>() == 256u);
  for (size_t l = 0; l < 2; ++l)
    BOOST_TEST(d.at("layers")[l].at("default_codec").get<std::string>() ==
               p.layers[l].candidates[p.layers[l].default_index].codec);
  // The closed loop and the drift (controller.h).
  BOOST_TEST(d.at("alpha").get<double>() == 1.0);
  BOOST_TEST(d.at("alpha_eff").get<double>() == 0.8125);
  BOOST_TEST(d.at("window").at("realized").get<double>() == 3.5);
  BOOST_TEST(d.at("window").at("predicted").get<double>() == 3.0);
  BOOST_TEST(d.at("window").at("budget").get<double>() == 3.25);
  BOOST_TEST(d.at("layers")[0].at("window_realized").get<double>() == 1.5);
  BOOST_TEST(d.at("layers")[0].at("drift").get<double>() == 0.75);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
