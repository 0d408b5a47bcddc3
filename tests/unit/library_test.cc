// liblgreco.so as a process loads it: the one VERSION line, the NCCL it finds among the
// loaded objects, the symbols it exports; and the NCCL locator in-process.
#include <dlfcn.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <filesystem>
#include <set>
#include <sstream>

#include "config/log.h"
#include "config/version.h"
#include "plugin/shim/nccl_locator.h"
#include "test_util.h"

using namespace lgreco;

namespace {

using test::contains;
using test::count_of;
using test::read_text;

std::string library_path() { return test::env_or("LGRECO_TEST_LIB", "build/lib/liblgreco.so"); }
std::string nccl_library() { return test::env_or("LGRECO_TEST_NCCL_LIB", "/usr/local/cuda/lib64/libnccl.so"); }


struct NcclPresent {
  boost::test_tools::assertion_result operator()(boost::unit_test::test_unit_id) const {
    boost::test_tools::assertion_result r(access(nccl_library().c_str(), R_OK) == 0);
    r.message() << "no NCCL library at " << nccl_library() << " (set NCCL_HOME)";
    return r;
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(shared_library)

BOOST_AUTO_TEST_CASE(loading_logs_one_version_line_and_nothing_by_default) {
  const auto quiet = test::run_command("LD_PRELOAD=" + library_path() + " /bin/true");
  BOOST_TEST(quiet.exit_code == 0);
  BOOST_TEST(quiet.output.empty(), quiet.output);
  const auto r = test::run_command("LGRECO_DEBUG=VERSION LD_PRELOAD=" + library_path() + " /bin/true");
  BOOST_TEST(r.exit_code == 0);
  BOOST_TEST(count_of(r.output, "[-] LGRECO VERSION INIT lgreco " + std::string(version_string())) == 1u, r.output);
  BOOST_TEST(contains(r.output, "NCCL not loaded yet"), r.output);
  const auto bad = test::run_command("LGRECO_DEBUG=LOUD LD_PRELOAD=" + library_path() + " /bin/true");
  BOOST_TEST(contains(bad.output, "LGRECO WARN CONFIG LGRECO_DEBUG=LOUD (environment): not a level; accepted: NONE,"),
             bad.output);
  BOOST_TEST(count_of(bad.output, "compression is off in this process") == 1u, bad.output);
}

BOOST_AUTO_TEST_CASE(loading_after_nccl_names_its_version, *boost::unit_test::precondition(NcclPresent())) {
  const auto r =
      test::run_command("LGRECO_DEBUG=INFO LD_PRELOAD='" + nccl_library() + " " + library_path() + "' /bin/true");
  BOOST_TEST(r.exit_code == 0);
  const int code = nccl_header_version_code();
  BOOST_TEST(contains(r.output, "NCCL " + shim::nccl_version_name(code) + " at "), r.output);
  BOOST_TEST(contains(r.output, "libnccl"), r.output);
}

BOOST_AUTO_TEST_CASE(exports_only_its_public_entry_points) {
  const auto r = test::run_command("nm -D --defined-only " + library_path());
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  std::set<std::string> names;
  std::istringstream lines(r.output);
  std::string address, type, name;
  while (lines >> address >> type >> name) names.insert(name);
  // lgreco_version, the NCCL calls the shim interposes (plugin/shim/entry_points.cc), and
  // the net-plugin tables NCCL looks up (plugin/net/exports.cc), and the comm hook's C ABI
  // (plugin/hook/lgreco_hook.h).
  const std::set<std::string> expected{"lgreco_version",   "ncclAllGather",     "ncclAllReduce",   "ncclAlltoAll",
                                       "ncclBcast",        "ncclBroadcast",     "ncclCommAbort",   "ncclCommDestroy",
                                       "ncclCommFinalize", "ncclGather",        "ncclGetLastError", "ncclGroupEnd",
                                       "ncclGroupSimulateEnd", "ncclGroupStart", "ncclRecv",        "ncclReduce",
                                       "ncclReduceScatter", "ncclScatter",      "ncclSend",
                                       "ncclNetPlugin_v8", "ncclNetPlugin_v9", "ncclNetPlugin_v10",
                                       "ncclNetPlugin_v11", "lgreco_hook_abi_version", "lgreco_hook_open",
                                       "lgreco_hook_allreduce_mean", "lgreco_hook_counters", "lgreco_hook_summary",
                                       "lgreco_hook_close"};
  BOOST_TEST((names == expected), r.output);
  // The NCCL plugin name is the same library.
  const auto plugin = std::filesystem::path(library_path()).parent_path() / "libnccl-net-lgreco.so";
  BOOST_TEST(std::filesystem::equivalent(plugin, library_path()));
  // No link-time dependency on NCCL, the CUDA runtime or libstdc++.
  const auto deps = test::run_command("ldd " + library_path());
  BOOST_TEST(!contains(deps.output, "libnccl"), deps.output);
  BOOST_TEST(!contains(deps.output, "libcudart"), deps.output);
  BOOST_TEST(!contains(deps.output, "libstdc++"), deps.output);
}

// A program linked against a libnccl calls NCCL through its PLT, as frameworks do; with
// LD_PRELOAD the shim sees every call, reaches that libnccl's pncclXxx for the real work
// and logs its summary. The stand-in libnccl has one rank, so every call passes through.
BOOST_AUTO_TEST_CASE(preloaded_the_shim_intercepts_a_programs_nccl_calls_and_forwards_them) {
  const std::string probe = test::env_or("LGRECO_TEST_INTERPOSE_PROBE", "build/bin/lgreco-interpose-probe");
  const auto plain = test::run_command(probe);
  BOOST_TEST_REQUIRE(plain.exit_code == 0, plain.output);
  const std::string counts =
      "fake nccl: allreduce=2 allgather=0 broadcast=1 send=0 recv=0 group_start=1 group_end=1 destroy=1";
  BOOST_TEST(contains(plain.output, counts), plain.output);
  BOOST_TEST(!contains(plain.output, "LGRECO"), plain.output);

  const auto r = test::run_command("LGRECO_DEBUG=INFO LD_PRELOAD=" + library_path() + " " + probe);
  BOOST_TEST(r.exit_code == 0, r.output);
  BOOST_TEST(contains(r.output, "probe: results ok, recv[12345]=12345"), r.output);
  BOOST_TEST(contains(r.output, counts), r.output);  // the real calls still happened, once each
  BOOST_TEST(contains(r.output, "LGRECO INFO SHIM interposing NCCL 2.28.9 at "), r.output);
  BOOST_TEST(contains(r.output, "lgreco shim: rank 0/1: 2 allreduce calls, 0 compressed, 2 passed through"), r.output);
  BOOST_TEST(contains(r.output, "a communicator of one rank: nothing to exchange (2)"), r.output);
  BOOST_TEST(!contains(r.output, "WARN"), r.output);

  const auto off = test::run_command("LGRECO_MODE=off LGRECO_DEBUG=INFO LD_PRELOAD=" + library_path() + " " + probe);
  BOOST_TEST(contains(off.output, counts), off.output);
  BOOST_TEST(contains(off.output, "every allreduce goes to NCCL untouched: LGRECO_MODE=off"), off.output);
}

BOOST_AUTO_TEST_CASE(locator_finds_an_rtld_local_nccl, *boost::unit_test::precondition(NcclPresent())) {
  BOOST_TEST(!shim::find_loaded_nccl().has_value());  // this test binary does not link NCCL
  // PyTorch loads NCCL through an RTLD_LOCAL extension; the locator must still see it.
  void* handle = dlopen(nccl_library().c_str(), RTLD_NOW | RTLD_LOCAL);
  BOOST_TEST_REQUIRE(handle != nullptr, dlerror());
  const auto nccl = shim::find_loaded_nccl();
  BOOST_TEST_REQUIRE(nccl.has_value());
  BOOST_TEST(nccl->version_code == nccl_header_version_code());
  BOOST_TEST(contains(nccl->path, "libnccl"), nccl->path);
  dlclose(handle);
}

BOOST_AUTO_TEST_CASE(nccl_version_names) {
  BOOST_TEST(shim::nccl_version_name(22809) == "2.28.9");
  BOOST_TEST(shim::nccl_version_name(21903) == "2.19.3");
  BOOST_TEST(shim::nccl_version_name(2708) == "2.7.8");
  BOOST_TEST(shim::nccl_version_name(0) == "unknown");
}

BOOST_AUTO_TEST_CASE(log_levels_parse_case_insensitively) {
  log::Level l;
  BOOST_TEST((log::parse_level("info", &l) && l == log::Level::kInfo));
  BOOST_TEST((log::parse_level("TRACE", &l) && l == log::Level::kTrace));
  BOOST_TEST((log::parse_level("None", &l) && l == log::Level::kNone));
  BOOST_TEST(!log::parse_level("verbose", &l));
}

BOOST_AUTO_TEST_SUITE_END()
