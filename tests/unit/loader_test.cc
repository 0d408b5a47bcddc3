// The net plugin's loader (plugin/net/loader.h): GOT rebinding in-process, on a library
// that calls the stand-in libnccl through its PLT (tests/interpose/caller.c, built with
// lazy binding and with full RELRO); and, in the shared_library suite, liblgreco.so loaded
// as NCCL loads a net plugin (tests/interpose/plugin_probe.cc).
#include <dlfcn.h>

#include <boost/test/unit_test.hpp>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "plugin/net/got_rebind.h"
#include "plugin/net/loader.h"
#include "plugin/shim/entry_point_names.h"
#include "test_util.h"

using namespace lgreco;

namespace {

using test::contains;
using test::count_of;

std::string library_path() { return test::env_or("LGRECO_TEST_LIB", "build/lib/liblgreco.so"); }
// The Makefile's CALLER_LIB: a variant's name ("lazy", "now") completes it.
std::string caller_library(const std::string& variant) {
  return test::env_or("LGRECO_TEST_CALLER_LIB", "build/lib/test/liblgreco-caller") + "-" + variant + ".so";
}
std::string plugin_probe() { return test::env_or("LGRECO_TEST_PLUGIN_PROBE", "build/bin/lgreco-plugin-probe"); }

// ncclResult_t is an int-sized enum; the caller library is C.
using AllReduceFn = int (*)(const void*, void*, size_t, int, int, void*, void*);
using GroupFn = int (*)();

std::atomic<int> g_replacement_calls{0};
size_t g_replacement_count = 0;
void* g_replacement_comm = nullptr;
constexpr int kReplacementResult = 42;

int replacement_all_reduce(const void*, void*, size_t count, int, int, void* comm, void*) {
  ++g_replacement_calls;
  g_replacement_count = count;
  g_replacement_comm = comm;
  return kReplacementResult;
}
int replacement_group_end() { return kReplacementResult + 1; }
int replacement_never_imported() { return -1; }

// caller.c, dlopened: its functions, and the file it came from.
struct CallerLibrary {
  using CallAllReduce = int (*)(const void*, void*, size_t, void*);
  using GroupEndAddress = GroupFn (*)();

  explicit CallerLibrary(const std::string& variant, int mode) : path(caller_library(variant)) {
    handle = dlopen(path.c_str(), mode | RTLD_LOCAL);
    if (!handle) return;
    all_reduce = reinterpret_cast<CallAllReduce>(dlsym(handle, "caller_all_reduce"));
    group_end_address = reinterpret_cast<GroupEndAddress>(dlsym(handle, "caller_group_end_address"));
  }
  ~CallerLibrary() {
    if (handle) dlclose(handle);
  }
  CallerLibrary(const CallerLibrary&) = delete;
  CallerLibrary& operator=(const CallerLibrary&) = delete;

  bool ok() const { return handle && all_reduce && group_end_address; }
  bool is(const net::LoadedObject& object) const {
    return object.contains(reinterpret_cast<const void*>(all_reduce));
  }
  // The process's mappings of this file, as /proc/self/maps shows them (protections included).
  std::vector<std::string> mappings() const {
    std::ifstream maps("/proc/self/maps");
    std::vector<std::string> lines;
    const std::string name = std::filesystem::path(path).filename();
    for (std::string line; std::getline(maps, line);)
      if (contains(line, name)) lines.push_back(line);
    return lines;
  }

  std::string path;
  void* handle = nullptr;
  CallAllReduce all_reduce = nullptr;
  GroupEndAddress group_end_address = nullptr;
};

std::string joined(const std::vector<std::string>& lines) {
  std::string all;
  for (const std::string& line : lines) all += line + "\n";
  return all;
}

std::vector<net::Rebinding> test_rebindings() {
  return {{"ncclAllReduce", reinterpret_cast<const void*>(&replacement_all_reduce)},
          {"ncclGroupEnd", reinterpret_cast<const void*>(&replacement_group_end)},
          {"ncclNeverImported", reinterpret_cast<const void*>(&replacement_never_imported)}};
}

struct Variant {
  const char* name;
  int mode;
};
// Lazy binding, opened lazily: the PLT slots still point at the resolver stubs when they
// are rewritten. Full RELRO: every slot bound at load, the GOT page read-only.
constexpr Variant kVariants[] = {{"lazy", RTLD_LAZY}, {"now", RTLD_NOW}};

bool library_exports(const std::string& symbol) {
  const auto r = test::run_command("nm -D --defined-only " + library_path());
  return r.exit_code == 0 && contains(r.output, " " + symbol + "\n");
}

struct NetPluginExported {
  boost::test_tools::assertion_result operator()(boost::unit_test::test_unit_id) const {
    boost::test_tools::assertion_result r(library_exports("ncclNetPlugin_v11"));
    r.message() << library_path() << " does not export ncclNetPlugin_v11 (plugin/net/exports.cc not built)";
    return r;
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(got_rebind)

BOOST_AUTO_TEST_CASE(rewrites_plt_and_got_slots_so_calls_land_in_the_replacement) {
  for (const Variant& v : kVariants) {
    BOOST_TEST_CONTEXT("caller library built " << v.name) {
      CallerLibrary caller(v.name, v.mode);
      BOOST_TEST_REQUIRE(caller.ok(), caller.path << ": " << dlerror());
      std::vector<float> send{1, 2, 3, 4}, recv(4, 0.0f);
      if (v.mode == RTLD_NOW) {  // bound to the stand-in libnccl, which copies send to recv
        BOOST_TEST(caller.all_reduce(send.data(), recv.data(), 4, nullptr) == 0);
        BOOST_TEST(recv[3] == 4.0f);
      }
      const GroupFn original_group_end = caller.group_end_address();
      BOOST_TEST(reinterpret_cast<const void*>(original_group_end) !=
                 reinterpret_cast<const void*>(&replacement_group_end));
      const std::vector<std::string> maps_before = caller.mappings();
      BOOST_TEST_REQUIRE(!maps_before.empty());

      const auto only_caller = [&](const net::LoadedObject& object) { return !caller.is(object); };
      const net::RebindReport report = net::rebind_imports(test_rebindings(), only_caller);
      BOOST_TEST(report.errors.empty(), joined(report.errors));
      BOOST_TEST(report.objects_scanned == 1u);
      BOOST_TEST(report.objects_skipped >= 3u);  // this program, libc, the stand-in libnccl at least
      BOOST_TEST_REQUIRE(report.objects.size() == 1u);
      BOOST_TEST(report.objects[0].path == caller.path);
      // ncclAllReduce's JUMP_SLOT, ncclGroupEnd's GLOB_DAT (its address is taken, so its
      // calls go through that slot too); ncclGroupStart is not wanted.
      BOOST_TEST(report.objects[0].rewritten == 2u);
      BOOST_TEST(report.objects[0].already == 0u);
      BOOST_TEST(report.rewritten() == 2u);
      const std::set<std::string> names(report.objects[0].names.begin(), report.objects[0].names.end());
      BOOST_TEST(report.objects[0].names.size() == 2u);
      BOOST_TEST((names == std::set<std::string>{"ncclAllReduce", "ncclGroupEnd"}));
      BOOST_TEST((report.imports == std::vector<size_t>{1, 1, 0}));

      g_replacement_calls = 0;
      recv.assign(4, 0.0f);
      void* const comm = &recv;
      BOOST_TEST(caller.all_reduce(send.data(), recv.data(), 4, comm) == kReplacementResult);
      BOOST_TEST(caller.all_reduce(send.data(), recv.data(), 3, comm) == kReplacementResult);
      BOOST_TEST(g_replacement_calls.load() == 2);  // the lazy resolver did not put NCCL back
      BOOST_TEST(g_replacement_count == 3u);
      BOOST_TEST(g_replacement_comm == comm);
      BOOST_TEST(recv[3] == 0.0f);  // the stand-in libnccl was not called
      BOOST_TEST(reinterpret_cast<const void*>(caller.group_end_address()) ==
                 reinterpret_cast<const void*>(&replacement_group_end));
      BOOST_TEST(caller.group_end_address()() == kReplacementResult + 1);
      // Every page got its protection back (full RELRO: the GOT is read-only again).
      BOOST_TEST((caller.mappings() == maps_before));

      // A slot that already points at its replacement is left alone.
      const net::RebindReport again = net::rebind_imports(test_rebindings(), only_caller);
      BOOST_TEST(again.errors.empty(), joined(again.errors));
      BOOST_TEST_REQUIRE(again.objects.size() == 1u);
      BOOST_TEST(again.objects[0].rewritten == 0u);
      BOOST_TEST(again.objects[0].already == 2u);
      BOOST_TEST((again.imports == std::vector<size_t>{1, 1, 0}));

      // And back: the same mechanism restores NCCL's own functions.
      const net::RebindReport back = net::rebind_imports(
          {{"ncclGroupEnd", reinterpret_cast<const void*>(original_group_end)}}, only_caller);
      BOOST_TEST(back.rewritten() == 1u);
      BOOST_TEST(reinterpret_cast<const void*>(caller.group_end_address()) ==
                 reinterpret_cast<const void*>(original_group_end));
      BOOST_TEST((caller.mappings() == maps_before));
    }
  }
}

BOOST_AUTO_TEST_CASE(skipped_objects_are_left_alone) {
  CallerLibrary caller("now", RTLD_NOW);
  BOOST_TEST_REQUIRE(caller.ok(), caller.path << ": " << dlerror());
  const net::RebindReport report =
      net::rebind_imports(test_rebindings(), [](const net::LoadedObject&) { return true; });
  BOOST_TEST(report.errors.empty());
  BOOST_TEST(report.objects_scanned == 0u);
  BOOST_TEST(report.objects_skipped >= 4u);
  BOOST_TEST(report.objects.empty());
  BOOST_TEST((report.imports == std::vector<size_t>{0, 0, 0}));
  std::vector<float> send{5, 6}, recv(2, 0.0f);
  BOOST_TEST(caller.all_reduce(send.data(), recv.data(), 2, nullptr) == 0);
  BOOST_TEST(recv[1] == 6.0f);  // the stand-in libnccl did it
}

// The lazy caller has a DT_GNU_HASH table, the full-RELRO one only DT_HASH (Makefile).
BOOST_AUTO_TEST_CASE(an_object_defines_its_own_symbols_not_its_imports) {
  for (const Variant& v : kVariants) {
    BOOST_TEST_CONTEXT("caller library built " << v.name) {
      CallerLibrary caller(v.name, v.mode);
      BOOST_TEST_REQUIRE(caller.ok(), caller.path << ": " << dlerror());
      int callers_seen = 0, nccls_seen = 0, libcs_seen = 0;
      net::rebind_imports(test_rebindings(), [&](const net::LoadedObject& object) {
        if (caller.is(object)) {
          ++callers_seen;
          BOOST_TEST(object.defines("caller_run"));
          BOOST_TEST(object.defines("caller_all_reduce"));
          BOOST_TEST(object.defines("caller_group_end_address"));
          BOOST_TEST(!object.defines("ncclAllReduce"));  // imported, not defined
          BOOST_TEST(!object.defines("pncclAllReduce"));
          BOOST_TEST(!object.defines("caller_runs"));
        } else if (contains(object.path(), "libfakenccl.so")) {
          ++nccls_seen;
          BOOST_TEST(object.defines("pncclAllReduce"));
          BOOST_TEST(object.defines("ncclAllReduce"));  // a weak definition is a definition
          BOOST_TEST(object.defines("fake_nccl_counts"));
          BOOST_TEST(!object.defines("pncclAllReduceX"));
          BOOST_TEST(!object.defines(""));
        } else if (contains(object.path(), "libc.so")) {
          ++libcs_seen;
          BOOST_TEST(object.defines("malloc"));
          BOOST_TEST(!object.defines("pncclAllReduce"));
        }
        return true;
      });
      BOOST_TEST(callers_seen == 1);
      BOOST_TEST(nccls_seen == 1);
      BOOST_TEST(libcs_seen == 1);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_missing_replacement_is_an_error_and_nothing_is_rewritten) {
  CallerLibrary caller("now", RTLD_NOW);
  BOOST_TEST_REQUIRE(caller.ok(), caller.path << ": " << dlerror());
  const GroupFn before = caller.group_end_address();
  const net::RebindReport report = net::rebind_imports(
      {{"ncclGroupEnd", reinterpret_cast<const void*>(&replacement_group_end)}, {"ncclAllReduce", nullptr}},
      [&](const net::LoadedObject& object) { return !caller.is(object); });
  BOOST_TEST_REQUIRE(report.errors.size() == 1u);
  BOOST_TEST(contains(report.errors[0], "no replacement for ncclAllReduce"), report.errors[0]);
  BOOST_TEST(report.objects_scanned == 0u);
  BOOST_TEST(reinterpret_cast<const void*>(caller.group_end_address()) == reinterpret_cast<const void*>(before));
}

// The unit-test program links the core archive: it has no shim entry points of its own,
// so the loader must leave every loaded caller as it is.
BOOST_AUTO_TEST_CASE(install_shim_outside_liblgreco_does_nothing) {
  CallerLibrary caller("now", RTLD_NOW);
  BOOST_TEST_REQUIRE(caller.ok(), caller.path << ": " << dlerror());
  for (int call = 0; call < 2; ++call) {
    const net::ShimInstall r = net::install_shim();
    BOOST_TEST((r.state == net::ShimState::kNotInLibrary), net::shim_state_name(r.state) << ": " << r.detail);
    BOOST_TEST(contains(r.detail, "not running from liblgreco.so"), r.detail);
    BOOST_TEST(r.rewritten == 0u);
  }
  std::vector<float> send{7}, recv(1, 0.0f);
  BOOST_TEST(caller.all_reduce(send.data(), recv.data(), 1, nullptr) == 0);
  BOOST_TEST(recv[0] == 7.0f);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(shared_library)

// The loader rebinds exactly the functions the library exports as the shim: the names in
// plugin/shim/entry_point_names.h are the NCCL functions `nm -D` lists (plugin tables such
// as ncclNetPlugin_v11 are data, not functions).
BOOST_AUTO_TEST_CASE(the_loaders_names_are_the_exported_nccl_functions) {
  const auto r = test::run_command("nm -D --defined-only " + library_path());
  BOOST_TEST_REQUIRE(r.exit_code == 0, r.output);
  std::set<std::string> exported;
  std::istringstream lines(r.output);
  std::string address, type, name;
  while (lines >> address >> type >> name)
    if (name.rfind("nccl", 0) == 0 && (type == "T" || type == "W")) exported.insert(name);
  const std::set<std::string> tracked(shim::kEntryPointNames.begin(), shim::kEntryPointNames.end());
  BOOST_TEST(tracked.size() == shim::kEntryPointNames.size());  // no name twice
  BOOST_TEST((exported == tracked), r.output);
}

// NCCL_NET_PLUGIN=lgreco, simulated: a program has loaded a library bound to a libnccl
// (RTLD_LOCAL as PyTorch loads NCCL, or RTLD_GLOBAL), then loads liblgreco.so as NCCL
// loads a net plugin and inits two communicators. The first init rebinds that library
// to the shim: its calls reach the shim, the shim reaches NCCL's pncclXxx, and after NCCL
// unloads the plugin the calls still work (the library pinned itself).
BOOST_AUTO_TEST_CASE(as_a_net_plugin_it_rebinds_loaded_callers_to_the_shim,
                     *boost::unit_test::precondition(NetPluginExported())) {
  const std::string plugin =
      (std::filesystem::path(library_path()).parent_path() / "libnccl-net-lgreco.so").string();
  // Three rounds of caller_run (two inits, then after the plugin is closed), each an
  // allreduce in a group and one outside.
  const std::string counts =
      "fake nccl: allreduce=6 allgather=0 broadcast=0 send=0 recv=0 group_start=3 group_end=3 destroy=0";
  const std::string summary = "lgreco shim: rank 0/1: 6 allreduce calls, 0 compressed, 6 passed through";
  for (const Variant& v : kVariants) {
    for (const char* scope : {"local", "global"}) {
      BOOST_TEST_CONTEXT("caller library built " << v.name << ", loaded " << scope) {
        const auto r = test::run_command("LGRECO_DEBUG=INFO LGRECO_NET=off " + plugin_probe() + " " +
                                         caller_library(v.name) + " " + v.name + " " + scope + " " + plugin);
        BOOST_TEST(r.exit_code == 0, r.output);
        BOOST_TEST(count_of(r.output, "probe: init 0") == 2u, r.output);
        BOOST_TEST(count_of(r.output, "caller: results ok, recv[12345]=12345") == 3u, r.output);
        BOOST_TEST(contains(r.output, "probe: plugin closed"), r.output);
        BOOST_TEST(contains(r.output, counts), r.output);  // the real calls happened, once each
        // One object rebound, once: the caller library's ncclAllReduce and ncclGroupStart
        // JUMP_SLOTs and its ncclGroupEnd GLOB_DAT. (How a line is prefixed depends on
        // whether it went through NCCL's logger.)
        const std::string caller_file = std::filesystem::path(caller_library(v.name)).filename();
        BOOST_TEST(count_of(r.output, "NET rebound ") == 1u, r.output);
        BOOST_TEST(contains(r.output, "NET rebound 3 call sites in "), r.output);
        BOOST_TEST(contains(r.output, "/" + caller_file + " to lgreco's shim ("), r.output);
        BOOST_TEST(contains(r.output, "SHIM interposing NCCL 2.28.9 at "), r.output);
        BOOST_TEST(contains(r.output, summary), r.output);
        BOOST_TEST(!contains(r.output, "WARN"), r.output);
      }
    }
  }

  // Under LD_PRELOAD as well (the 'both' mode): the shim already has the calls, nothing
  // is rebound, and each call is still seen once.
  const auto both = test::run_command("LGRECO_DEBUG=INFO LGRECO_NET=off LD_PRELOAD=" + library_path() + " " +
                                      plugin_probe() + " " + caller_library("now") + " now local " + plugin);
  BOOST_TEST(both.exit_code == 0, both.output);
  BOOST_TEST(count_of(both.output, "already receives NCCL calls (LD_PRELOAD): nothing to rebind") == 1u,
             both.output);
  BOOST_TEST(!contains(both.output, "call sites in"), both.output);
  BOOST_TEST(contains(both.output, counts), both.output);
  BOOST_TEST(contains(both.output, summary), both.output);
  BOOST_TEST(!contains(both.output, "WARN"), both.output);
}

// Nothing in the process imports NCCL (NCCL linked statically into the framework, or
// reached through dlsym): one WARN over all inits says compression cannot be installed
// and names LD_PRELOAD; the plugin still initialises.
BOOST_AUTO_TEST_CASE(as_a_net_plugin_without_callers_it_warns_once,
                     *boost::unit_test::precondition(NetPluginExported())) {
  const std::string plugin =
      (std::filesystem::path(library_path()).parent_path() / "libnccl-net-lgreco.so").string();
  const auto r = test::run_command("LGRECO_DEBUG=WARN LGRECO_NET=off " + plugin_probe() + " none now local " + plugin);
  BOOST_TEST(r.exit_code == 0, r.output);
  BOOST_TEST(count_of(r.output, "probe: init 0") == 2u, r.output);
  // Once through NCCL's logger and once on lgreco's own sink (NCCL_DEBUG is not set, so
  // NCCL would not print it), over both inits.
  BOOST_TEST(count_of(r.output, "LGRECO NET no loaded object imports ncclAllReduce") == 1u, r.output);
  BOOST_TEST(count_of(r.output, "LGRECO WARN NET no loaded object imports ncclAllReduce") == 1u, r.output);
  BOOST_TEST(contains(r.output, "cannot install lgreco's compression"), r.output);
  BOOST_TEST(contains(r.output, "no shared libnccl is loaded"), r.output);  // the probe has none
  BOOST_TEST(contains(r.output, "LD_PRELOAD="), r.output);
}

BOOST_AUTO_TEST_SUITE_END()
