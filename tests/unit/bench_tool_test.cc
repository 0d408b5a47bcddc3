// lgreco-bench as a user runs it: the table, its check, the CPU fabrics, the adaptive
// mode, the NCCL fabric's failures without a GPU, and its command-line errors.
#include <boost/test/unit_test.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

std::string bench() { return test::bin_dir() + "/lgreco-bench"; }

// The data rows of a table (lines that do not start with '#').
std::vector<std::vector<std::string>> rows_of(const std::string& output) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line.find("LGRECO") != std::string::npos) continue;
    std::istringstream fields(line);
    std::vector<std::string> row;
    for (std::string f; fields >> f;) row.push_back(f);
    rows.push_back(row);
  }
  return rows;
}

void expect_clean_table(const test::CommandResult& r, size_t rows, const std::string& codec, double max_rel_err = 0.3) {
  BOOST_TEST(r.exit_code == 0, r.output);
  BOOST_TEST(test::contains(r.output, "# Out of bounds values : 0 OK"), r.output);
  const auto table = rows_of(r.output);
  BOOST_TEST_REQUIRE(table.size() == rows, r.output);
  for (const auto& row : table) {
    BOOST_TEST_REQUIRE(row.size() == 11u, r.output);
    BOOST_TEST(test::contains(row[3], codec));
    BOOST_TEST(std::stod(row[4]) > 0.0);       // time
    BOOST_TEST(std::stod(row[7]) > 0.0);       // wire bytes
    BOOST_TEST(std::stod(row[9]) < max_rel_err);  // rel_err
    BOOST_TEST(row[10] == "0");                 // #wrong
  }
}

BOOST_AUTO_TEST_SUITE(bench_tool)

BOOST_AUTO_TEST_CASE(inproc_sweeps_check_clean) {
  expect_clean_table(test::run_command(bench() + " -b 64K -e 256K -f 2 -n 2 -w 1 --ranks 3 -d half -o avg"), 3,
                     "quant:bits=4");
  expect_clean_table(test::run_command(bench() + " -b 100K -n 2 -w 1 --ranks 5 --codec quant:bits=2,bucket=256 "
                                                 "--algorithm sra -d bfloat16"),
                     1, "quant:bits=2", 1.2);  // 2 bits, quantized twice
  const auto none = test::run_command(bench() + " -b 128K -n 2 -w 1 --ranks 4 --codec none");
  expect_clean_table(none, 1, "none");
  BOOST_TEST(std::stod(rows_of(none.output)[0][9]) < 1e-6);  // uncompressed: float32 rounding only
}

BOOST_AUTO_TEST_CASE(socket_processes_check_clean) {
  expect_clean_table(test::run_command(bench() + " --fabric socket --ranks 3 -b 256K -n 2 -w 1 --timeout 30"), 1,
                     "quant:bits=4");
}

BOOST_AUTO_TEST_CASE(adaptive_mode_switches_and_checks_clean) {
  const auto r = test::run_command("LGRECO_DEBUG=NONE " + bench() + " --codec lgreco -b 1M -n 2 -w 5 --ranks 4");
  expect_clean_table(r, 1, "lgreco(");
  BOOST_TEST(test::contains(r.output, ",e1)"), r.output);  // the first assignment was in effect
}

// --fabric nccl needs CUDA, a GPU and a libnccl that loads. Without one of them it ends
// with a message that says which, never a crash or a hang: a usage error in a build
// without CUDA, exit 1 otherwise. With all of them (a GPU machine), one rank runs clean.
BOOST_AUTO_TEST_CASE(nccl_fabric_fails_cleanly_without_what_it_needs) {
  const std::string common = bench() + " --fabric nccl --ranks 1 -b 256K -n 2 -w 1 --timeout 30";
  // A libnccl that does not load: the same answer with or without a GPU.
  auto r = test::run_command(common + " --nccl-lib /nonexistent/libnccl.so.2");
  BOOST_TEST((r.exit_code == 1 || r.exit_code == 2), r.output);
  BOOST_TEST(test::contains(r.output, "--fabric nccl"), r.output);
  if (r.exit_code == 1) BOOST_TEST(test::contains(r.output, "cannot load NCCL from '/nonexistent/libnccl.so.2'"), r.output);
  // The default library, and whatever GPU there is (none in CI).
  r = test::run_command("LGRECO_DEBUG=NONE " + common);
  if (r.exit_code == 0) {
    BOOST_TEST(test::contains(r.output, "# Out of bounds values : 0 OK"), r.output);
    const auto table = rows_of(r.output);
    BOOST_TEST_REQUIRE(table.size() == 1u, r.output);
    BOOST_TEST_REQUIRE(table[0].size() == 13u, r.output);  // + nccl_us, vs_nccl
    BOOST_TEST(table[0][10] == "0");
    BOOST_TEST(std::stod(table[0][12]) > 0.0);
  } else {
    BOOST_TEST((r.exit_code == 1 || r.exit_code == 2), r.output);
    BOOST_TEST(test::contains(r.output, "--fabric nccl"), r.output);
  }
}

BOOST_AUTO_TEST_CASE(mistakes_are_usage_errors) {
  for (const char* args : {"-b 1M -e 64K", "--codec quant:bits=9", "--fabric carrier-pigeon", "--ranks 0",
                           "--schedule 1,1,1,1", "--registration x.json", "-d double", "--frobnicate",
                           "--device 0", "--nccl-lib libnccl.so.2", "--fabric nccl --device x",
                           "--fabric inproc --rank 0 --world-size 2"}) {
    const auto r = test::run_command(bench() + " " + args);
    BOOST_TEST(r.exit_code == 2, args << ": " << r.output);
    BOOST_TEST(test::contains(r.output, "Try 'lgreco-bench --help'"), r.output);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
