// The command-line tools as a user runs them: lgreco-codec's commands and its errors,
// the independent Python decoder (written from docs/FORMAT.md alone) agreeing with it,
// lgreco-solve on problem files, and smoke runs of the benchmarks and the demo.
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "controller/problem_json.h"
#include "kernels/codec.h"
#include "kernels/lgc_file.h"
#include "test_util.h"

using namespace lgreco;
using lgreco::test::Dist;

namespace {

std::string codec_tool() { return test::bin_dir() + "/lgreco-codec"; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void write_f32(const std::string& path, const std::vector<float>& x) {
  test::write_bytes(path, x.data(), 4 * x.size());
}

std::vector<float> read_f32(const std::string& path) {
  const auto b = test::read_bytes(path);
  std::vector<float> x(b.size() / 4);
  if (!b.empty()) memcpy(x.data(), b.data(), b.size());
  return x;
}

struct PythonDecoder {
  std::string python = test::env_or("LGRECO_TEST_PYTHON", "/usr/bin/python3");
  std::string script = test::env_or("LGRECO_TEST_SOURCE_DIR", ".") + "/tests/format/lgc_decode.py";
  std::string command(const std::string& in, const std::string& out) const {
    return python + " " + script + " " + in + " " + out;
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(tools)

BOOST_AUTO_TEST_CASE(encode_and_decode_through_files_match_the_library) {
  std::mt19937_64 rng(test::run_seed());
  test::TempDir dir;
  const uint64_t n = 5000;
  const std::vector<float> x = test::draw(Dist::kMixedScales, n, rng, 1024);
  write_f32(dir.file("in.f32"), x);
  const auto enc =
      test::run_command(codec_tool() + " encode --codec quant:bits=3 --seed 99 --rank 2 --step 5 --layer 4 " +
                        dir.file("in.f32") + " " + dir.file("x.lgc"));
  BOOST_TEST_REQUIRE(enc.exit_code == 0, enc.output);
  const LgcFile f = parse_lgc(test::read_bytes(dir.file("x.lgc")), "x.lgc");
  BOOST_TEST(f.header.spec.str() == "quant:bits=3,bucket=1024,rounding=stochastic");
  BOOST_TEST(f.header.count == n);
  const NoiseKey key{99, 2, 5, 4};
  const auto codec = Codec::create(f.header.spec, DType::kFloat32);
  std::vector<uint8_t> want(codec->encoded_bytes(n));
  codec->encode(key, Slice{x.data(), n, 0}, nullptr, want);
  BOOST_TEST((f.payload == want));

  const auto dec = test::run_command(codec_tool() + " decode " + dir.file("x.lgc") + " " + dir.file("out.f32"));
  BOOST_TEST_REQUIRE(dec.exit_code == 0, dec.output);
  std::vector<float> y(n);
  codec->decode(want, n, DType::kFloat32, y.data());
  const std::vector<float> got = read_f32(dir.file("out.f32"));
  BOOST_TEST_REQUIRE(got.size() == n);
  BOOST_TEST(memcmp(got.data(), y.data(), 4 * n) == 0);

  const auto info = test::run_command(codec_tool() + " info " + dir.file("x.lgc"));
  BOOST_TEST(info.exit_code == 0);
  BOOST_TEST(contains(info.output, "count 5000"));
  BOOST_TEST(contains(info.output, "seed 99"));
}

BOOST_AUTO_TEST_CASE(independent_python_decoder_agrees_bit_for_bit) {
  std::mt19937_64 rng(test::run_seed());
  test::TempDir dir;
  const PythonDecoder py;
  int files = 0;
  for (const char* spec : {"none", "quant:bits=1,bucket=32", "quant:bits=2,bucket=96,rounding=nearest", "quant:bits=3",
                           "quant:bits=4", "quant:bits=5,bucket=64", "quant:bits=7", "quant:bits=8", "topk",
                           "topk:density=0.3", "topk:density=1"})
    for (uint64_t n : {0, 1, 33, 4097}) {
      std::vector<float> x = test::draw(Dist::kMixedScales, n, rng, 32);
      if (n > 100) x[70] = std::nanf("");  // a non-finite bucket
      write_f32(dir.file("in.f32"), x);
      const auto enc =
          test::run_command(codec_tool() + " encode --codec " + spec + " --seed " + std::to_string(rng() >> 1) + " " +
                            dir.file("in.f32") + " " + dir.file("x.lgc"));
      BOOST_TEST_REQUIRE(enc.exit_code == 0, enc.output);
      const auto ours = test::run_command(codec_tool() + " decode " + dir.file("x.lgc") + " " + dir.file("ours.f32"));
      const auto theirs = test::run_command(py.command(dir.file("x.lgc"), dir.file("theirs.f32")));
      BOOST_TEST_INFO_SCOPE(spec << " n=" << n);
      BOOST_TEST_REQUIRE(ours.exit_code == 0, ours.output);
      BOOST_TEST_REQUIRE(theirs.exit_code == 0, theirs.output);
      BOOST_TEST_REQUIRE((test::read_bytes(dir.file("ours.f32")) == test::read_bytes(dir.file("theirs.f32"))));
      ++files;
    }
  // PowerSGD, whose files carry the matrix view in their spec (rows=N from --shape).
  for (const auto& [rows, cols] : {std::pair<int, int>{1, 1}, {3, 11}, {17, 241}, {64, 64}})
    for (const char* spec : {"powersgd:rank=1", "powersgd:rank=3"}) {
      const uint64_t n = static_cast<uint64_t>(rows) * cols;
      write_f32(dir.file("in.f32"), test::draw(Dist::kNormal, n, rng));
      const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
      const auto enc = test::run_command(codec_tool() + " encode --codec " + spec + " --shape " + shape + " --seed " +
                                         std::to_string(rng() >> 1) + " " + dir.file("in.f32") + " " + dir.file("x.lgc"));
      BOOST_TEST_REQUIRE(enc.exit_code == 0, enc.output);
      const auto ours = test::run_command(codec_tool() + " decode " + dir.file("x.lgc") + " " + dir.file("ours.f32"));
      const auto theirs = test::run_command(py.command(dir.file("x.lgc"), dir.file("theirs.f32")));
      BOOST_TEST_INFO_SCOPE(spec << " " << shape);
      BOOST_TEST_REQUIRE(ours.exit_code == 0, ours.output);
      BOOST_TEST_REQUIRE(theirs.exit_code == 0, theirs.output);
      BOOST_TEST_REQUIRE((test::read_bytes(dir.file("ours.f32")) == test::read_bytes(dir.file("theirs.f32"))));
      ++files;
    }
  BOOST_TEST(files == 52);
  // It rejects damage too.
  auto bytes = test::read_bytes(dir.file("x.lgc"));
  bytes.back() ^= 1;
  test::write_bytes(dir.file("bad.lgc"), bytes.data(), bytes.size());
  const auto bad = test::run_command(py.command(dir.file("bad.lgc"), dir.file("o.f32")));
  BOOST_TEST(bad.exit_code == 1);
  BOOST_TEST(contains(bad.output, "error"));
}

BOOST_AUTO_TEST_CASE(stats_prints_one_line_per_candidate) {
  std::mt19937_64 rng(test::run_seed());
  test::TempDir dir;
  const uint64_t n = 9000;
  const std::vector<float> x = test::draw(Dist::kHeavyTailed, n, rng);
  write_f32(dir.file("in.f32"), x);
  const std::vector<std::string> specs = {"quant:bits=2", "quant:bits=4,rounding=nearest", "none", "topk:density=0.05",
                                          "powersgd:rank=2", "powersgd:rank=8"};
  std::string cmd = codec_tool() + " stats";
  for (const auto& s : specs) cmd += " --codec " + s;
  const auto r = test::run_command(cmd + " --seed 3 --layer 2 --shape 90x100 " + dir.file("in.f32"));
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  std::vector<CodecSpec> parsed;
  for (const auto& s : specs) {
    parsed.push_back(CodecSpec::parse(s));
    if (parsed.back().family() == CodecFamily::kPowersgd)
      parsed.back() = CodecSpec::powersgd(PowersgdParams{parsed.back().powersgd_params().rank, 90});
  }
  const CandidateReport want =
      measure_candidates(parsed, DType::kFloat32, Slice{x.data(), n, 0}, nullptr, NoiseKey{3, 0, 0, 2});
  std::istringstream lines(r.output);
  std::string line;
  size_t row = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string spec;
    uint64_t bytes = 0;
    double l2 = -1, rel = -1;
    fields >> spec >> bytes >> l2 >> rel;
    BOOST_TEST_REQUIRE(row < specs.size());
    BOOST_TEST(spec == parsed[row].str());
    BOOST_TEST(bytes == want.candidates[row].bytes);
    BOOST_TEST(l2 == std::sqrt(want.candidates[row].squared_error), boost::test_tools::tolerance(1e-6));
    ++row;
  }
  BOOST_TEST(row == specs.size());
}

BOOST_AUTO_TEST_CASE(bad_input_gives_a_clear_error_and_exit_status) {
  std::mt19937_64 rng(test::run_seed());
  test::TempDir dir;
  const std::vector<float> x = test::draw(Dist::kNormal, 3000, rng);
  write_f32(dir.file("in.f32"), x);
  BOOST_TEST_REQUIRE(
      test::run_command(codec_tool() + " encode --codec quant " + dir.file("in.f32") + " " + dir.file("x.lgc"))
          .exit_code == 0);
  const auto file = test::read_bytes(dir.file("x.lgc"));
  test::write_bytes(dir.file("short.lgc"), file.data(), file.size() / 2);
  auto flipped = file;
  flipped[file.size() - 10] ^= 4;
  test::write_bytes(dir.file("flipped.lgc"), flipped.data(), flipped.size());
  test::write_bytes(dir.file("odd.f32"), "12345", 5);

  struct Case {
    std::string args;
    int exit_code;
    std::string message;
  } cases[] = {
      {"", 2, "missing command"},
      {"frobnicate", 2, "unknown command 'frobnicate'"},
      {"encode --codec quant:bits=9 " + dir.file("in.f32") + " " + dir.file("o.lgc"), 2, "bits=9 is out of range"},
      {"encode --codec quant:bucket=1000 " + dir.file("in.f32") + " " + dir.file("o.lgc"), 2, "bucket=1000"},
      {"encode --codec quant " + dir.file("in.f32"), 2, "expected IN.f32 OUT.lgc"},
      {"encode " + dir.file("in.f32") + " " + dir.file("o.lgc"), 2, "exactly one --codec"},
      {"encode --codec quant --seed -1 " + dir.file("in.f32") + " " + dir.file("o.lgc"), 2, "--seed expects"},
      {"encode --codec quant --bogus " + dir.file("in.f32"), 2, "unknown option --bogus"},
      {"encode --codec quant " + dir.file("missing.f32") + " " + dir.file("o.lgc"), 1, "cannot open"},
      {"encode --codec quant " + dir.file("odd.f32") + " " + dir.file("o.lgc"), 1, "not a multiple of 4"},
      {"decode " + dir.file("short.lgc") + " " + dir.file("o.f32"), 1, "truncated payload"},
      {"decode " + dir.file("flipped.lgc") + " " + dir.file("o.f32"), 1, "payload checksum mismatch"},
      {"decode " + dir.file("in.f32") + " " + dir.file("o.f32"), 1, "not an .lgc file"},
      {"decode " + dir.file("x.lgc") + " /nonexistent-dir/o.f32", 1, "cannot create"},
      {"decode --codec quant " + dir.file("x.lgc") + " " + dir.file("o.f32"), 2, "takes the codec from the file"},
      {"stats " + dir.file("in.f32"), 2, "at least one --codec"},
      {"stats --codec topk:density=2 " + dir.file("in.f32"), 2, "density=2 is invalid"},
      {"stats --codec powersgd:rank=0 " + dir.file("in.f32"), 2, "rank=0 is out of range"},
      {"stats --codec powersgd " + dir.file("in.f32"), 2, "needs the matrix shape: --shape NxM"},
      {"stats --codec powersgd --shape 30x " + dir.file("in.f32"), 2, "--shape"},
      {"stats --codec powersgd --shape 0x30 " + dir.file("in.f32"), 2, "each side must be at least 1"},
      {"stats --codec powersgd:rows=20 --shape 30x100 " + dir.file("in.f32"), 2, "rows=20 disagrees with --shape"},
      {"stats --codec powersgd --shape 30x99 " + dir.file("in.f32"), 1, "3000 values, but --shape 30x99 makes 2970"},
      {"decode --shape 3x1000 " + dir.file("x.lgc") + " " + dir.file("o.f32"), 2, "unknown option --shape"},
      {"info " + dir.file("short.lgc"), 1, "truncated"},
  };
  for (const Case& c : cases) {
    const auto r = test::run_command(codec_tool() + " " + c.args);
    BOOST_TEST_INFO_SCOPE("lgreco-codec " << c.args << "\n" << r.output);
    BOOST_TEST(r.exit_code == c.exit_code);
    BOOST_TEST(contains(r.output, c.message));
    BOOST_TEST(contains(r.output, "lgreco-codec: "));
  }
  const auto help = test::run_command(codec_tool() + " --help");
  BOOST_TEST(help.exit_code == 0);
  BOOST_TEST(contains(help.output, "usage:"));
  BOOST_TEST(contains(help.output, "stats"));
}

BOOST_AUTO_TEST_CASE(benchmark_and_demo_run) {
  const auto bench = test::run_command(test::bin_dir() + "/lgreco-codec-bench --count 65536 --reps 1");
  BOOST_TEST(bench.exit_code == 0, bench.output);
  BOOST_TEST(contains(bench.output, "encode + error feedback"));
  BOOST_TEST(contains(bench.output, "decode-accumulate"));
  BOOST_TEST(test::run_command(test::bin_dir() + "/lgreco-codec-bench --bits 0").exit_code == 2);
  const auto demo = test::run_command(test::bin_dir() + "/lgreco-quant-demo --scale 0.02");
  BOOST_TEST(demo.exit_code == 0, demo.output);
  BOOST_TEST(contains(demo.output, "resnet50"));
  BOOST_TEST(contains(demo.output, "L-GreCo: one bit width per layer"));
  const auto solve_bench = test::run_command(test::bin_dir() + "/lgreco-solve-bench --reps 1");
  BOOST_TEST(solve_bench.exit_code == 0, solve_bench.output);
  BOOST_TEST(contains(solve_bench.output, "quant        1000"));
  BOOST_TEST(test::run_command(test::bin_dir() + "/lgreco-solve-bench --reps 0").exit_code == 2);
}

std::string solve_tool() { return test::bin_dir() + "/lgreco-solve"; }

BOOST_AUTO_TEST_CASE(solve_answers_a_problem_file_as_the_library_does) {
  std::mt19937_64 rng(test::run_seed());
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  nlohmann::json problem = {{"alpha", 0.5 + unit(rng)}, {"layers", nlohmann::json::array()}};
  for (int l = 0; l < 40; ++l) {
    nlohmann::json layer = {{"name", "layer" + std::to_string(l)}, {"default", 2}};
    for (int b = 2; b <= 8; ++b)
      layer["candidates"].push_back({{"codec", "quant:bits=" + std::to_string(b)},
                                     {"bytes", 1000 * b + rng() % 500},
                                     {"error", (1.0 + unit(rng)) / (1 << (2 * b))}});
    problem["layers"].push_back(layer);
  }
  test::TempDir dir;
  const std::string text = problem.dump(2);
  test::write_bytes(dir.file("p.json"), text.data(), text.size());
  const auto r = test::run_command(solve_tool() + " " + dir.file("p.json"));
  BOOST_REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const auto out = nlohmann::json::parse(r.output);
  const auto p = controller::parse_problem_json(text);
  const auto s = controller::solve(p);
  BOOST_TEST(out.at("choices").get<std::vector<uint32_t>>() == s.choices);
  BOOST_TEST(out.at("bytes").get<uint64_t>() == s.bytes);
  BOOST_TEST(out.at("feasible").get<bool>() == s.feasible);
  BOOST_TEST(out.at("default_bytes").get<uint64_t>() == s.default_bytes);
  BOOST_TEST(out.contains("solve_ms"));
  const auto piped = test::run_command(solve_tool() + " - < " + dir.file("p.json"));
  BOOST_TEST(piped.exit_code == 0);
  BOOST_TEST(nlohmann::json::parse(piped.output).at("choices") == out.at("choices"));
}

BOOST_AUTO_TEST_CASE(solve_answers_the_readme_example) {
  const auto r = test::run_command(solve_tool() + " " + test::env_or("LGRECO_TEST_SOURCE_DIR", ".") +
                                   "/controller/examples/small.json");
  BOOST_REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  const auto out = nlohmann::json::parse(r.output);
  BOOST_TEST(out.at("choices").get<std::vector<uint32_t>>() == std::vector<uint32_t>({2, 0, 0}));
  BOOST_TEST(out.at("bytes").get<uint64_t>() == 541480u);
  BOOST_TEST(out.at("default_bytes").get<uint64_t>() == 1048776u);
  BOOST_TEST(out.at("gap").get<double>() == 0.0);  // proven optimal
}

BOOST_AUTO_TEST_CASE(solve_rejects_malformed_problems_naming_the_field) {
  test::TempDir dir;
  struct Case {
    std::string text, expected;
  };
  const Case cases[] = {
      {"not json", "not valid JSON at line 1"},
      {R"({"layers": [{"name": "a", "candidates": [{"codec": "none", "bytes": 4, "error": NaN}]}]})",
       "NaN is not a JSON number"},
      {R"({"layers": [{"name": "a", "candidates": [{"codec": "none", "bytes": -4, "error": 1}]}]})",
       "layers[0] (a).candidates[0].bytes: -4; expected a non-negative integer"},
      {R"({"layers": [{"name": "a", "default": 1, "candidates": [{"codec": "none", "bytes": 4, "error": 1}]}]})",
       "layers[0] (a).default: 1 is out of range"},
      {R"({"layers": [{"name": "a", "candidates": [{"codec": "none", "error": 1}]}]})",
       "layers[0] (a).candidates[0].bytes: missing"},
      {R"({"alpha": 1})", "layers: missing"},
  };
  for (const Case& c : cases) {
    test::write_bytes(dir.file("bad.json"), c.text.data(), c.text.size());
    const auto r = test::run_command(solve_tool() + " " + dir.file("bad.json"));
    BOOST_TEST_CONTEXT(c.text) {
      BOOST_TEST(r.exit_code == 1);
      BOOST_TEST(contains(r.output, "lgreco-solve: error: " + dir.file("bad.json") + ": "), r.output);
      BOOST_TEST(contains(r.output, c.expected), r.output);
    }
  }
  BOOST_TEST(test::run_command(solve_tool()).exit_code == 2);
  BOOST_TEST(test::run_command(solve_tool() + " --frobnicate x.json").exit_code == 2);
  BOOST_TEST(test::run_command(solve_tool() + " --tolerance 2 x.json").exit_code == 2);
  BOOST_TEST(test::run_command(solve_tool() + " " + dir.file("missing.json")).exit_code == 1);
  const auto help = test::run_command(solve_tool() + " --help");
  BOOST_TEST(help.exit_code == 0);
  BOOST_TEST(contains(help.output, "PROBLEM.json"));
}

// The Makefile finds the CUDA runtime and NCCL under whichever folder a toolkit uses
// (issue 21, finding 7): fake toolkits with an nvcc stub and an empty libcudart_static.a
// in each layout; `make cuda-info` names the folder, and none gives an error naming
// CUDA_LIB_DIR.
BOOST_AUTO_TEST_CASE(the_makefile_finds_the_cuda_runtime_in_every_toolkit_layout) {
  namespace fs = std::filesystem;
  const std::string source = test::env_or("LGRECO_TEST_SOURCE_DIR", ".");
  const std::string multiarch = test::run_command("g++ -print-multiarch").output;
  std::vector<std::string> layouts = {"lib64", "lib", "targets/x86_64-linux/lib"};
  if (!multiarch.empty()) layouts.push_back("lib/" + multiarch.substr(0, multiarch.find('\n')));
  for (const std::string& layout : layouts) {
    BOOST_TEST_CONTEXT(layout) {
      test::TempDir dir;
      const std::string home = dir.file("cuda");
      fs::create_directories(home + "/bin");
      fs::create_directories(home + "/" + layout);
      test::write_bytes(home + "/bin/nvcc", "#!/bin/sh\n", 10);
      fs::permissions(home + "/bin/nvcc", fs::perms::owner_all);
      test::write_bytes(home + "/" + layout + "/libcudart_static.a", "", 0);
      test::write_bytes(home + "/" + layout + "/libnccl.so.2", "", 0);
      const auto r = test::run_command("make -s -C " + source + " cuda-info CUDA_HOME=" + home);
      BOOST_TEST(r.exit_code == 0, r.output);
      BOOST_TEST(contains(r.output, "libcudart_static.a from " + home + "/" + layout + ";"), r.output);
      BOOST_TEST(contains(r.output, "libnccl.so in " + home + "/" + layout), r.output);
    }
  }
  test::TempDir dir;
  const std::string home = dir.file("cuda");
  fs::create_directories(home + "/bin");
  test::write_bytes(home + "/bin/nvcc", "#!/bin/sh\n", 10);
  fs::permissions(home + "/bin/nvcc", fs::perms::owner_all);
  const auto r = test::run_command("make -s -C " + source + " cuda-info CUDA_HOME=" + home);
  BOOST_TEST(r.exit_code != 0);
  BOOST_TEST(contains(r.output, "libcudart_static.a is in none of " + home + "/lib64"), r.output);
  BOOST_TEST(contains(r.output, "set CUDA_LIB_DIR"), r.output);
}

BOOST_AUTO_TEST_SUITE_END()
