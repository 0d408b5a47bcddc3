// lgreco-demo as `make demo` runs it, shortened: the embedded ResNet-50 registration on
// 2 ranks, a small registration file on 4 (quantization alone, and with TopK among the
// candidates), and its command-line errors. Checks the last line's format and sanity
// (ratios above 1, a finite error ratio), one table line per epoch and the decision log
// (one versioned JSON line per solve; tests/python/plot_test.py draws it).
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "test_util.h"

using namespace lgreco;

namespace {

std::string demo() { return test::bin_dir() + "/lgreco-demo"; }

std::string last_line(const std::string& output) {
  std::string s = output;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  const size_t at = s.rfind('\n');
  return at == std::string::npos ? s : s.substr(at + 1);
}

struct Summary {
  int ranks = 0;
  int steps = 0;
  double vs_fp32 = 0, vs_uniform = 0, error_vs_budget = 0, output_error_vs_uniform = 0, alpha_eff = 0;
  std::string families = "quant";  // " families=..." at the end of the line, when not quant alone
};

Summary check_last_line(const std::string& output) {
  const std::string line = last_line(output);
  static const std::regex format(
      R"(demo: ranks=(\d+) steps=(\d+) bytes_vs_fp32=(\d+\.\d+) bytes_vs_uniform=(\d+\.\d+) )"
      R"(error_vs_budget=(\d+\.\d+) output_error_vs_uniform=(\d+\.\d+) alpha_eff=(\d+\.\d+))"
      R"((?: families=(quant,topk))?)");
  std::smatch m;
  BOOST_TEST_REQUIRE(std::regex_match(line, m, format), "last line: " << line);
  Summary s{std::stoi(m[1]), std::stoi(m[2]), std::stod(m[3]), std::stod(m[4]),
            std::stod(m[5]), std::stod(m[6]), std::stod(m[7])};
  if (m[8].matched) s.families = m[8];
  BOOST_TEST(s.vs_fp32 > 1.0, line);
  BOOST_TEST(s.vs_uniform > 1.0, line);  // adaptive choices send fewer bytes than uniform 4 bits
  BOOST_TEST(s.vs_fp32 > s.vs_uniform, line);
  for (double e : {s.error_vs_budget, s.output_error_vs_uniform}) {
    BOOST_TEST(std::isfinite(e), line);
    BOOST_TEST(e > 0.0, line);
  }
  BOOST_TEST((s.alpha_eff >= 0.25 && s.alpha_eff <= 1.0), line);  // the closed loop's range
  // Epoch 0 runs the default on both engines, with the same noise: the same outputs, so
  // its errors are the uniform run's exactly.
  static const std::regex epoch0(R"(\n    0 +0-\d+ [^\n]* - +- +1\.0000 +1\.0000 )");
  BOOST_TEST(std::regex_search(output, epoch0), output);
  return s;
}

// The decision log rank 0's controller wrote: one line per solve, epochs 1, 2, ... in
// order, each in the current log format, naming every adaptive layer. The demo empties
// the file first, so a rerun does not append a second run.
void check_decision_log(const std::string& path, const std::string& output, int solves, size_t adaptive_layers) {
  BOOST_TEST(test::contains(output, "# decision log (rank 0's, one line per solve): " + path +
                                        "; draw it with: lgreco plot " + path),
             output);
  const std::string text = test::read_text(path);
  BOOST_TEST_REQUIRE(!text.empty(), path);
  BOOST_TEST(text.back() == '\n');
  std::vector<std::string> lines;
  for (size_t at = 0, end; at < text.size(); at = end + 1) {
    end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(at, end - at));
  }
  BOOST_TEST_REQUIRE(lines.size() == static_cast<size_t>(solves), text);
  for (int e = 0; e < solves; ++e) {
    const std::string& line = lines[e];
    BOOST_TEST(line.rfind("{\"log_version\":1,\"epoch\":" + std::to_string(e + 1) + ",", 0) == 0, line);
    size_t named = 0;
    for (size_t at = line.find("\"default_codec\":"); at != std::string::npos;
         at = line.find("\"default_codec\":", at + 1))
      ++named;
    BOOST_TEST(named == adaptive_layers, line);
  }
}

// Two buckets, four adaptive layers in four groups (one bucket bfloat16), three kept
// float32; tests/python/plot_test.py draws the demo's log of it.
std::string tiny_registration() {
  return test::env_or("LGRECO_TEST_SOURCE_DIR", ".") + "/tests/data/tiny_registration.json";
}

}  // namespace

BOOST_AUTO_TEST_SUITE(demo_tool)

BOOST_AUTO_TEST_CASE(resnet50_embedded_short_run) {
  test::TempDir dir;
  const std::string log = dir.file("logs/decisions.jsonl");  // the directory is created
  const auto r = test::run_command(demo() + " --steps 7 --ranks 2 --seed 3 --decision-log " + log);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  const Summary s = check_last_line(r.output);
  BOOST_TEST(s.ranks == 2);
  BOOST_TEST(s.steps == 7);
  BOOST_TEST(test::contains(r.output, "model resnet50 (config/examples/resnet50.json): 161 layers in 5 buckets"));
  BOOST_TEST(test::contains(r.output, "54 layers (25,502,912 values) adaptive"));
  // The ResNet-50 groups as table columns, an epoch 0 (uniform) and an epoch 1 line.
  BOOST_TEST(test::contains(r.output, "conv1 layer1 layer2 layer3 layer4     fc"), r.output);
  BOOST_TEST(test::contains(r.output, "\n    0     0-5 "), r.output);
  BOOST_TEST(test::contains(r.output, "\n    1     6-6 "), r.output);
  check_decision_log(log, r.output, 1, 54);
}

BOOST_AUTO_TEST_CASE(registration_file_on_four_ranks) {
  test::TempDir dir;
  const std::string reg = tiny_registration();
  const std::string log = dir.file("tiny.jsonl");
  test::write_bytes(log, "stale\n", 6);  // replaced, not appended to
  const auto r = test::run_command(demo() + " --steps 17 --registration " + reg + " --decision-log " + log);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  const Summary s = check_last_line(r.output);
  BOOST_TEST(s.ranks == 4);
  BOOST_TEST(s.steps == 17);
  BOOST_TEST(s.families == "quant");
  BOOST_TEST(test::contains(r.output, "candidates quant bits 2..8\n"), r.output);
  BOOST_TEST(!test::contains(r.output, "topk"), r.output);
  BOOST_TEST(test::contains(r.output, "model tiny"));
  BOOST_TEST(test::contains(r.output, "4 layers (136,704 values) adaptive"), r.output);
  // Groups in model order (the reverse of the registration's): stem, block1, block2, head.
  BOOST_TEST(test::contains(r.output, "  stem block1 block2   head"), r.output);
  for (const char* epoch : {"\n    0     0-5 ", "\n    1    6-10 ", "\n    2   11-15 ", "\n    3   16-16 "})
    BOOST_TEST(test::contains(r.output, epoch), r.output);
  // The worst later epoch names the adaptive layer whose uniform error missed its forecast
  // by the most, with its share of the forecast and its own realized over forecast.
  static const std::regex worst(
      R"(\n# worst adaptive epoch after the first: compression error (\d+\.\d+) of the uniform run's; in it, the )"
      R"(uniform run's own error (\d+\.\d+) of what the solve's statistics forecast for it; its largest miss: )"
      R"((\S+) \((\d+)% of that forecast\) realized (\d+\.\d+) of its own\n)");
  std::smatch m;
  BOOST_TEST_REQUIRE(std::regex_search(r.output, m, worst), r.output);
  BOOST_TEST(
      (m[3] == "head.weight" || m[3] == "block2.conv.weight" || m[3] == "block1.conv.weight" || m[3] == "stem.weight"),
      m[0]);
  BOOST_TEST((std::stoi(m[4]) > 0 && std::stoi(m[4]) <= 100), m[0]);
  BOOST_TEST(std::stod(m[5]) > 0.0, m[0]);
  const double worst_epoch = std::stod(m[1]);
  // In hindsight, per later epoch (2 and 3): the uniform run's and the adaptive run's error
  // over the epoch's steady budget; their ratio is the epoch's, the worst of them the one
  // above.
  static const std::regex hindsight(
      R"(
# in hindsight, adaptive epochs after the first: the uniform run's error over its steady budget \(.*\): )"
      R"((\d+\.\d+) (\d+\.\d+); the adaptive run's: (\d+\.\d+) (\d+\.\d+); so a solve that spent each steady )"
      R"(budget exactly would read up to (\d+\.\d+) of the uniform run's in one epoch
)");
  BOOST_TEST_REQUIRE(std::regex_search(r.output, m, hindsight), r.output);
  const double uniform[] = {std::stod(m[1]), std::stod(m[2])}, adaptive[] = {std::stod(m[3]), std::stod(m[4])};
  BOOST_TEST((uniform[0] > 0 && uniform[1] > 0 && adaptive[0] > 0 && adaptive[1] > 0), m[0]);
  BOOST_TEST(std::max(adaptive[0] / uniform[0], adaptive[1] / uniform[1]) == worst_epoch,
             boost::test_tools::tolerance(0.01));
  BOOST_TEST(std::stod(m[5]) == 1.0 / std::min(uniform[0], uniform[1]), boost::test_tools::tolerance(0.01));
  check_decision_log(log, r.output, 3, 4);
}

// --families quant,topk on the small registration: TopK densities join the candidates,
// the default stays 4 bits, and some layer takes TopK in some adaptive epoch: counted
// per epoch in the `topk` column and summed, by group and density, in a comment line.
BOOST_AUTO_TEST_CASE(topk_among_the_candidates) {
  test::TempDir dir;
  const std::string reg = tiny_registration();
  const std::string log = dir.file("codecs.jsonl");
  const auto r =
      test::run_command(demo() + " --steps 17 --families quant,topk --registration " + reg + " --decision-log " + log);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  const Summary s = check_last_line(r.output);
  BOOST_TEST(s.ranks == 4);
  BOOST_TEST(s.steps == 17);
  BOOST_TEST(s.families == "quant,topk");
  BOOST_TEST(test::contains(r.output,
                            "default quant:bits=4,bucket=1024,rounding=stochastic, candidates quant bits 2..8 and topk "
                            "densities 0.1%, 0.25%, 0.5%, 1%, 2%, 5%\n"),
             r.output);
  BOOST_TEST(test::contains(r.output, "  stem block1 block2   head    all topk  vs_fp32"), r.output);
  // The check by codec, and apart for the layers that left TopK for a quantizer.
  static const std::regex from_topk(
      R"(\n# of those, layers that left TopK for a quantizer: (\(none\)|\d bits \d+\.\d{3} \(\d+\)(, \d bits \d+\.\d{3} \(\d+\))*)\n)");
  BOOST_TEST(std::regex_search(r.output, from_topk), r.output);
  // The table: epoch, steps, the mean bits of the 4 groups and of all, then the count of
  // adaptive layers on TopK.
  static const std::regex row(R"(\n +(\d+) +\d+-\d+ +(?:\d+\.\d\d +){5}(\d+) )");
  std::vector<int> on_topk;  // per epoch
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), row), end; it != end; ++it) {
    BOOST_TEST(std::stoi((*it)[1]) == static_cast<int>(on_topk.size()), it->str());
    on_topk.push_back(std::stoi((*it)[2]));
  }
  BOOST_TEST_REQUIRE(on_topk.size() == 4u, r.output);  // epochs 0-3
  BOOST_TEST(on_topk[0] == 0);                         // uniform 4 bits
  int adaptive_on_topk = 0;
  for (size_t e = 1; e < on_topk.size(); ++e) {
    BOOST_TEST(on_topk[e] <= 4);
    adaptive_on_topk += on_topk[e];
  }
  BOOST_TEST(adaptive_on_topk > 0, r.output);
  std::smatch m;
  static const std::regex summary(R"(# topk in the adaptive epochs: (\d+) of 12 layer-epochs; by group: )");
  BOOST_TEST_REQUIRE(std::regex_search(r.output, m, summary), r.output);
  BOOST_TEST(std::stoi(m[1]) == adaptive_on_topk, r.output);
  check_decision_log(log, r.output, 3, 4);
  // The log names the TopK choices the table counted.
  BOOST_TEST(test::contains(test::read_text(log), "\"codec\":\"topk:"));
}

BOOST_AUTO_TEST_CASE(command_line_errors) {
  test::TempDir dir;
  const auto help = test::run_command(demo() + " --help");
  BOOST_TEST(help.exit_code == 0);
  BOOST_TEST(test::contains(help.output, "usage: lgreco-demo"));
  BOOST_TEST(test::contains(help.output, "--families F"));
  for (const char* bad : {"--steps 6", "--steps x", "--ranks 0", "--ranks 1", "--ranks 17", "--algorithm ring",
                          "--bogus", "--png x.png", "--decision-log", "--families"}) {
    const auto r = test::run_command(demo() + " " + bad);
    BOOST_TEST(r.exit_code == 2, bad << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "Try 'lgreco-demo --help'"), bad << ": " << r.output);
  }
  // A family list other than quant or quant,topk, named in the message.
  for (const char* value : {"foo", "topk", "", "quant,", "quant,topk,powersgd"}) {
    const auto r = test::run_command(demo() + " --families '" + value + "'");
    BOOST_TEST(r.exit_code == 2, value << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "--families must be quant or quant,topk"), value << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "'" + std::string(value) + "'"), value << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "Try 'lgreco-demo --help'"), value << ": " << r.output);
  }
  // The retired --png says where the picture comes from now.
  const auto png = test::run_command(demo() + " --png bits.png");
  BOOST_TEST(test::contains(png.output, "--png is gone"), png.output);
  BOOST_TEST(test::contains(png.output, "lgreco plot"), png.output);
  // An unwritable decision log fails before the run, not after it.
  const auto unwritable = test::run_command(demo() + " --decision-log /proc/lgreco-none/d.jsonl");
  BOOST_TEST(unwritable.exit_code == 1, unwritable.output);
  BOOST_TEST(test::contains(unwritable.output, "cannot create the directory of '/proc/lgreco-none/d.jsonl'"),
             unwritable.output);
  BOOST_TEST(!test::contains(unwritable.output, "epoch"), unwritable.output);
  const auto directory = test::run_command(demo() + " --decision-log /tmp");  // exists, a directory
  BOOST_TEST(directory.exit_code == 1, directory.output);
  BOOST_TEST(test::contains(directory.output, "cannot write the decision log '/tmp'"), directory.output);
  const auto missing = test::run_command(demo() + " --registration " + dir.file("none.json"));
  BOOST_TEST(missing.exit_code == 1, missing.output);
  BOOST_TEST(test::contains(missing.output, "none.json: cannot open"), missing.output);
  const std::string only_small = R"({"version": 1, "buckets": [{"count": 10, "dtype": "float32", "layers": [
      {"name": "b", "offset": 0, "numel": 10, "shape": [10]}]}]})";
  test::write_bytes(dir.file("small.json"), only_small.data(), only_small.size());
  const auto small = test::run_command(demo() + " --registration " + dir.file("small.json"));
  BOOST_TEST(small.exit_code == 1, small.output);
  BOOST_TEST(test::contains(small.output, "no layer is compressed adaptively"), small.output);
}

BOOST_AUTO_TEST_SUITE_END()
