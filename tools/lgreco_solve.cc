// lgreco-solve: the L-GreCo search on a problem file, as the controller runs it.
#include <cstdio>
#include <string>

#include "controller/problem_json.h"
#include "controller/solver.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-solve [--tolerance X] PROBLEM.json     (- reads standard input)

Chooses one candidate codec per layer to minimise total bytes (or predicted exchange
time) while the total error stays within alpha x the error of the layers' defaults,
and prints the answer as one JSON line:

  {"objective": "size", "feasible": true, "bytes": ..., "error": ..., "budget": ...,
   "default_bytes": ..., "default_error": ..., "lower_bound": ..., "gap": ...,
   "core_layers": ..., "choices": [candidate index per layer], "solve_ms": ...}

PROBLEM.json:

  {"alpha": 1.0, "objective": "size",
   "layers": [{"name": "conv1", "numel": 9408, "default": 2,
               "candidates": [{"codec": "quant:bits=2", "bytes": 2424, "error": 0.5}, ...]},
              ...]}

  alpha       error budget relative to the defaults (default 1)
  objective   "size" (bytes) or "time" (needs "cost_model", see docs/CONTROLLER.md)
  layers      name (optional, unique), numel (needed only for codec throughput),
              default (candidate index; optional with one candidate), candidates
              (codec spec, encoded bytes, error)

"feasible": false means no assignment meets the budget; the choices are then the
least-error assignment. lower_bound is proven: no feasible assignment costs less.

  --tolerance X   largest relative distance from the optimum (default 0.001)

Exit status: 0 answered, 1 invalid problem (the message names the field), 2 usage.
)";

int run(int argc, char** argv) {
  controller::SolverOptions options;
  std::string path;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--tolerance") {
      const std::string text = args.value();
      char* end = nullptr;
      options.tolerance = strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !(options.tolerance > 0) || options.tolerance >= 1)
        throw cli::UsageError("--tolerance expects a number in (0, 1), got '" + text + "'");
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw cli::UsageError("unknown option " + arg);
    } else if (path.empty()) {
      path = arg;
    } else {
      throw cli::UsageError("one problem file expected, got '" + path + "' and '" + arg + "'");
    }
  }
  if (path.empty()) throw cli::UsageError("missing PROBLEM.json");

  const std::string where = path == "-" ? "<stdin>" : path;
  const std::vector<uint8_t> bytes = path == "-" ? cli::read_all(stdin, where) : cli::read_file(path);
  const std::string text(bytes.begin(), bytes.end());
  controller::Problem problem;
  try {
    problem = controller::parse_problem_json(text);
  } catch (const controller::ProblemError& e) {
    throw std::runtime_error(where + ": " + e.what());
  }
  const double start = cli::seconds_now();
  const controller::Solution solution = controller::solve(problem, options);
  const double solve_ms = (cli::seconds_now() - start) * 1e3;
  printf("%s\n", controller::solution_json(problem, solution, solve_ms).c_str());
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-solve", [&] { return lgreco::run(argc, argv); });
}
