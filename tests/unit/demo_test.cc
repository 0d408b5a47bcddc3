// lgreco-demo as `make demo` runs it, shortened: the embedded ResNet-50 registration on
// 2 ranks, a small registration file on 4, and its command-line errors. Checks the last
// line's format and sanity (ratios above 1, a finite error ratio), one table line per
// epoch and the PNG.
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
  double vs_fp32 = 0, vs_uniform = 0, error_vs_budget = 0;
};

Summary check_last_line(const std::string& output) {
  const std::string line = last_line(output);
  static const std::regex format(
      R"(demo: ranks=(\d+) steps=(\d+) bytes_vs_fp32=(\d+\.\d+) bytes_vs_uniform=(\d+\.\d+) )"
      R"(error_vs_budget=(\d+\.\d+))");
  std::smatch m;
  BOOST_TEST_REQUIRE(std::regex_match(line, m, format), "last line: " << line);
  Summary s{std::stoi(m[1]), std::stoi(m[2]), std::stod(m[3]), std::stod(m[4]), std::stod(m[5])};
  BOOST_TEST(s.vs_fp32 > 1.0, line);
  BOOST_TEST(s.vs_uniform > 1.0, line);  // adaptive bit widths send fewer bytes than uniform 4 bits
  BOOST_TEST(s.vs_fp32 > s.vs_uniform, line);
  BOOST_TEST(std::isfinite(s.error_vs_budget), line);
  BOOST_TEST(s.error_vs_budget > 0.0, line);
  return s;
}

bool is_png(const std::string& path) {
  const std::vector<uint8_t> b = test::read_bytes(path);
  const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  return b.size() > 8 + 25 && std::equal(signature, signature + 8, b.begin());
}

}  // namespace

BOOST_AUTO_TEST_SUITE(demo_tool)

BOOST_AUTO_TEST_CASE(resnet50_embedded_short_run) {
  test::TempDir dir;
  const std::string png = dir.file("plots/bits.png");  // the directory is created
  const auto r = test::run_command(demo() + " --steps 7 --ranks 2 --seed 3 --png " + png);
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
  BOOST_TEST(test::contains(r.output, "# bits per layer: " + png), r.output);
  BOOST_TEST(is_png(png));
}

BOOST_AUTO_TEST_CASE(registration_file_on_four_ranks) {
  test::TempDir dir;
  const std::string reg = R"({"version": 1, "model": "tiny", "buckets": [
    {"count": 52300, "dtype": "float32", "layers": [
      {"name": "head.bias", "offset": 0, "numel": 100, "shape": [100]},
      {"name": "head.weight", "offset": 100, "numel": 51200, "shape": [100, 512]},
      {"name": "block2.norm.weight", "offset": 51300, "numel": 1000, "shape": [1000]}]},
    {"count": 86016, "dtype": "bfloat16", "layers": [
      {"name": "block2.conv.weight", "offset": 0, "numel": 36864, "shape": [64, 64, 3, 3]},
      {"name": "block1.conv.weight", "offset": 36864, "numel": 36864, "shape": [64, 64, 3, 3]},
      {"name": "block1.small.weight", "offset": 73728, "numel": 512, "shape": [8, 64]},
      {"name": "stem.weight", "offset": 74240, "numel": 11776, "shape": [64, 184]}]}]})";
  test::write_bytes(dir.file("tiny.json"), reg.data(), reg.size());
  const std::string png = dir.file("tiny.png");
  const auto r = test::run_command(demo() + " --steps 17 --registration " + dir.file("tiny.json") + " --png " + png);
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  const Summary s = check_last_line(r.output);
  BOOST_TEST(s.ranks == 4);
  BOOST_TEST(s.steps == 17);
  BOOST_TEST(test::contains(r.output, "model tiny"));
  BOOST_TEST(test::contains(r.output, "4 layers (136,704 values) adaptive"), r.output);
  // Groups in model order (the reverse of the registration's): stem, block1, block2, head.
  BOOST_TEST(test::contains(r.output, "  stem block1 block2   head"), r.output);
  for (const char* epoch : {"\n    0     0-5 ", "\n    1    6-10 ", "\n    2   11-15 ", "\n    3   16-16 "})
    BOOST_TEST(test::contains(r.output, epoch), r.output);
  BOOST_TEST(is_png(png));
}

BOOST_AUTO_TEST_CASE(command_line_errors) {
  test::TempDir dir;
  const auto help = test::run_command(demo() + " --help");
  BOOST_TEST(help.exit_code == 0);
  BOOST_TEST(test::contains(help.output, "usage: lgreco-demo"));
  for (const char* bad :
       {"--steps 6", "--steps x", "--ranks 0", "--ranks 1", "--ranks 17", "--algorithm ring", "--bogus", "--png"}) {
    const auto r = test::run_command(demo() + " " + bad);
    BOOST_TEST(r.exit_code == 2, bad << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "Try 'lgreco-demo --help'"), bad << ": " << r.output);
  }
  // An unwritable plot path fails before the run, not after it.
  const auto unwritable = test::run_command(demo() + " --png /proc/lgreco-none/bits.png");
  BOOST_TEST(unwritable.exit_code == 1, unwritable.output);
  BOOST_TEST(test::contains(unwritable.output, "cannot create the directory of '/proc/lgreco-none/bits.png'"),
             unwritable.output);
  BOOST_TEST(!test::contains(unwritable.output, "epoch"), unwritable.output);
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
