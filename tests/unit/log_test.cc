// Logging: the line format with rank, the debug file pattern, subsystem masks, one WARN
// per cause, and NCCL's logger.
#include "config/log.h"

#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstdarg>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

using test::contains;
using test::count_of;
using test::LogToFile;
using test::read_text;



struct NcclLine {
  int level;
  unsigned long flags;
  std::string text;
};
std::vector<NcclLine> g_nccl_lines;
void fake_nccl_logger(int level, unsigned long flags, const char*, int, const char* format, ...) {
  char text[2048];
  va_list args;
  va_start(args, format);
  vsnprintf(text, sizeof text, format, args);
  va_end(args);
  g_nccl_lines.push_back({level, flags, text});
}


}  // namespace

BOOST_AUTO_TEST_SUITE(logging)

BOOST_AUTO_TEST_CASE(lines_carry_host_pid_tid_rank_and_lgreco) {
  LogToFile log;
  LGRECO_WARN("SHIM", "first %d", 1);
  log::set_rank(5);
  LGRECO_INFO("CTRL", "second %s", "line");
  LGRECO_TRACE("CTRL", "not at INFO");
  const std::string text = log.text();
  char host[64] = {};
  gethostname(host, sizeof host - 1);
  const std::string prefix = std::string(host) + ":" + std::to_string(getpid()) + ":[0-9]+ ";
  BOOST_TEST(std::regex_search(text, std::regex("(^|\n)" + prefix + "\\[-\\] LGRECO WARN SHIM first 1\n")), text);
  BOOST_TEST(std::regex_search(text, std::regex(prefix + "\\[5\\] LGRECO INFO CTRL second line\n")), text);
  BOOST_TEST(!contains(text, "not at INFO"));
}

BOOST_AUTO_TEST_CASE(debug_file_pattern_names_host_and_pid) {
  test::TempDir dir;
  log::reset_for_testing();
  log::configure(log::Level::kWarn, dir.file("lgreco.%h.%p.log"), ~0u);
  LGRECO_WARN("CONFIG", "to the file");
  char host[64] = {};
  gethostname(host, sizeof host - 1);
  const std::string path = dir.file("lgreco." + std::string(host) + "." + std::to_string(getpid()) + ".log");
  log::reset_for_testing();  // closes the file
  BOOST_TEST(contains(read_text(path), "LGRECO WARN CONFIG to the file"), path);
  // A file that cannot be opened: stderr, and a WARN saying so (checked through a child).
  const auto r = test::run_command("LGRECO_DEBUG=VERSION LGRECO_DEBUG_FILE=/nonexistent/dir/x.log LD_PRELOAD=" +
                                   test::env_or("LGRECO_TEST_LIB", "build/lib/liblgreco.so") + " /bin/true");
  BOOST_TEST(contains(r.output, "LGRECO_DEBUG_FILE: cannot open /nonexistent/dir/x.log"), r.output);
  BOOST_TEST(contains(r.output, "LGRECO VERSION INIT"), r.output);
}

BOOST_AUTO_TEST_CASE(a_debug_file_from_the_environment_gets_every_line) {
  test::TempDir dir;
  const auto r = test::run_command("LGRECO_DEBUG=VERSION LGRECO_DEBUG_FILE=" + dir.file("l.%p") + " LD_PRELOAD=" +
                                   test::env_or("LGRECO_TEST_LIB", "build/lib/liblgreco.so") + " /bin/true");
  BOOST_TEST(r.output.empty(), r.output);
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) {
    ++files;
    BOOST_TEST(contains(read_text(entry.path()), "LGRECO VERSION INIT lgreco"));
  }
  BOOST_TEST(files == 1u);
}

BOOST_AUTO_TEST_CASE(one_warning_per_distinct_cause) {
  LogToFile log;
  for (int call = 0; call < 1000; ++call) {
    LGRECO_WARN_ONCE("SHIM", "dtype:int8", "calls of dtype %s pass through uncompressed", "int8");
    LGRECO_WARN_ONCE("SHIM", call % 2 ? "op:max" : "op:min", "op %s passes through", call % 2 ? "max" : "min");
  }
  LGRECO_WARN_ONCE("ENGINE", "dtype:int8", "same cause, another subsystem");
  const std::string text = log.text();
  BOOST_TEST(count_of(text, "calls of dtype int8 pass through uncompressed") == 1u, text);
  BOOST_TEST(count_of(text, "op max passes through") == 1u, text);
  BOOST_TEST(count_of(text, "op min passes through") == 1u, text);
  BOOST_TEST(count_of(text, "same cause, another subsystem") == 1u, text);
  BOOST_TEST(count_of(text, "\n") == 4u, text);
}

BOOST_AUTO_TEST_CASE(warnings_about_causes_are_bounded) {
  LogToFile log;
  for (int cause = 0; cause < 5000; ++cause) LGRECO_WARN_ONCE("SHIM", std::to_string(cause), "cause %d", cause);
  const std::string text = log.text();
  BOOST_TEST(count_of(text, "\n") == 4097u);  // 4096 causes and the line saying the rest are not logged
  BOOST_TEST(contains(text, "further new ones are not logged"));
}

BOOST_AUTO_TEST_CASE(subsystem_masks_filter_info_but_never_warnings) {
  uint32_t mask = 0;
  std::string error;
  BOOST_TEST(log::parse_subsystems("ctrl, SHIM", &mask, &error));
  LogToFile log(log::Level::kInfo, mask);
  LGRECO_INFO("CTRL", "ctrl info");
  LGRECO_INFO("CODEC", "codec info");
  LGRECO_WARN("CODEC", "codec warn");
  const std::string text = log.text();
  BOOST_TEST(contains(text, "ctrl info"));
  BOOST_TEST(!contains(text, "codec info"));
  BOOST_TEST(contains(text, "codec warn"));
  uint32_t all_but = 0;
  BOOST_TEST(log::parse_subsystems("^CODEC", &all_but, &error));
  BOOST_TEST(all_but == (((1u << log::subsystem_names().size()) - 1) & ~(1u << 3)));
  BOOST_TEST(!log::parse_subsystems("CTRL,FOO", &mask, &error));
  BOOST_TEST(error == "\"FOO\" is not a subsystem");
}

BOOST_AUTO_TEST_CASE(nccl_logger_receives_lines_and_warnings_are_never_lost) {
  // lgreco's sink is stderr, as without LGRECO_DEBUG_FILE; it is captured in a file.
  test::TempDir dir;
  const std::string stderr_path = dir.file("stderr.txt");
  log::reset_for_testing();
  log::configure(log::Level::kInfo, "", ~0u);
  fflush(stderr);
  const int saved_stderr = dup(STDERR_FILENO);
  BOOST_TEST_REQUIRE(freopen(stderr_path.c_str(), "w", stderr) != nullptr);
  g_nccl_lines.clear();
  log::set_nccl_logger(fake_nccl_logger);
  unsetenv("NCCL_DEBUG");
  LGRECO_INFO("NET", "info via nccl");
  LGRECO_WARN("SHIM", "warn via nccl");
  setenv("NCCL_DEBUG", "warn", 1);
  LGRECO_WARN("SHIM", "second warn");
  log::set_nccl_logger(nullptr);
  fflush(stderr);
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  unsetenv("NCCL_DEBUG");
  log::reset_for_testing();
  BOOST_TEST_REQUIRE(g_nccl_lines.size() == 3u);
  BOOST_TEST(g_nccl_lines[0].level == 3);          // NCCL_LOG_INFO
  BOOST_TEST(g_nccl_lines[0].flags == 0x10u);      // NCCL_NET
  BOOST_TEST(g_nccl_lines[0].text == "LGRECO NET info via nccl");
  BOOST_TEST(g_nccl_lines[1].level == 2);          // NCCL_LOG_WARN
  BOOST_TEST(g_nccl_lines[1].flags == ~0ul);        // NCCL_ALL: NCCL_DEBUG_SUBSYS never hides a WARN
  const std::string text = read_text(stderr_path);
  BOOST_TEST(!contains(text, "info via nccl"), text);  // NCCL shows it (or was told not to)
  BOOST_TEST(contains(text, "warn via nccl"), text);   // NCCL_DEBUG unset: NCCL would print nothing
  BOOST_TEST(!contains(text, "second warn"), text);    // NCCL_DEBUG=WARN prints it
}

BOOST_AUTO_TEST_CASE(a_debug_file_gets_every_line_beside_nccls_logger) {
  LogToFile log;
  g_nccl_lines.clear();
  log::set_nccl_logger(fake_nccl_logger);
  setenv("NCCL_DEBUG", "info", 1);
  LGRECO_INFO("SHIM", "info to both");
  LGRECO_WARN("NET", "warn to both");
  log::set_nccl_logger(nullptr);
  BOOST_TEST(g_nccl_lines.size() == 2u);
  BOOST_TEST(g_nccl_lines[0].flags == 0x2u);  // NCCL_COLL
  const std::string text = log.text();
  BOOST_TEST(contains(text, "LGRECO INFO SHIM info to both"), text);
  BOOST_TEST(contains(text, "LGRECO WARN NET warn to both"), text);
}

BOOST_AUTO_TEST_CASE(an_invalid_configuration_warns_once_at_load) {
  const std::string lib = test::env_or("LGRECO_TEST_LIB", "build/lib/liblgreco.so");
  const auto r = test::run_command("LGRECO_ALPHA=-2 LGRECO_MODE=fast LD_PRELOAD=" + lib + " /bin/true");
  BOOST_TEST(count_of(r.output, "LGRECO WARN CONFIG LGRECO_MODE=fast (environment): not one of the accepted") == 1u,
             r.output);
  BOOST_TEST(count_of(r.output, "LGRECO_ALPHA=-2 (environment): out of range") == 1u, r.output);
  BOOST_TEST(count_of(r.output, "invalid configuration (2 errors above): compression is off in this process") == 1u,
             r.output);
  const auto typo = test::run_command("LGRECO_ALHPA=2 LD_PRELOAD=" + lib + " /bin/true");
  BOOST_TEST(contains(typo.output, "LGRECO_ALHPA is not an lgreco parameter (did you mean LGRECO_ALPHA?)"),
             typo.output);
  BOOST_TEST(!contains(typo.output, "compression is off"), typo.output);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco
