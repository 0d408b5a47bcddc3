#include "plugin/net/loader.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/auxv.h>

#include <exception>
#include <mutex>
#include <utility>

#include "config/log.h"
#include "plugin/net/got_rebind.h"
#include "plugin/shim/entry_point_names.h"

namespace lgreco::net {
namespace {

constexpr const char* kAllReduce = "ncclAllReduce";

// The counters of objects added to and removed from the process (dl_phdr_info's
// dlpi_adds/dlpi_subs): equal counters mean the same set of loaded objects.
using LoadCounts = std::pair<unsigned long long, unsigned long long>;

int read_counts(dl_phdr_info* info, size_t size, void* data) {
  if (size >= offsetof(dl_phdr_info, dlpi_subs) + sizeof(info->dlpi_subs))
    *static_cast<LoadCounts*>(data) = {info->dlpi_adds, info->dlpi_subs};
  return 1;  // the counters are the same in every entry
}

LoadCounts load_counts() {
  LoadCounts counts{0, 0};
  dl_iterate_phdr(read_counts, &counts);
  return counts;
}

// What survives between calls. Guarded by `mutex`; install_shim holds it throughout, so
// concurrent inits (one per communicator, possibly from several threads) scan one at a time.
struct Loader {
  std::mutex mutex;
  bool prepared = false;               // the library is pinned and its entry points known
  ShimState settled = ShimState::kFailed;  // kNotInLibrary / kAlreadyActive: decided for good
  bool is_settled = false;
  std::string library;                 // our file, as the dynamic loader names it
  const link_map* self = nullptr;
  std::vector<Rebinding> rebindings;   // kEntryPointNames -> our definitions
  size_t all_reduce_index = 0;
  LoadCounts last_counts{~0ull, ~0ull};
  int scans_with_same_counts = 0;
  size_t allreduce_call_sites = 0;
  bool ever_found_callers = false;
};

Loader& loader() {
  static Loader* l = new Loader;  // never destroyed: NCCL may call init during exit
  return *l;
}

// The object this code lives in. In liblgreco.so that is the library NCCL dlopened; in a
// program linking the core archive (the unit tests) it is the program.
const link_map* own_object() {
  Dl_info info{};
  void* extra = nullptr;
  if (!dladdr1(reinterpret_cast<const void*>(&install_shim), &info, &extra, RTLD_DL_LINKMAP) || !extra) return nullptr;
  return static_cast<const link_map*>(extra);
}

const link_map* object_of(const void* address) {
  Dl_info info{};
  void* extra = nullptr;
  if (!dladdr1(address, &info, &extra, RTLD_DL_LINKMAP)) return nullptr;
  return static_cast<const link_map*>(extra);
}

// Pins the library and finds the shim's entry points in it. Returns the state to report
// if there is nothing more to do (kNotInLibrary, kAlreadyActive, kFailed), else kInstalled.
ShimState prepare(Loader& l, std::string* detail) {
  l.self = own_object();
  if (!l.self) {
    *detail = "dladdr cannot name the object lgreco's loader is in";
    return ShimState::kFailed;
  }
  if (!l.self->l_name || l.self->l_name[0] == '\0') {
    l.settled = ShimState::kNotInLibrary;
    l.is_settled = true;
    *detail = "not running from liblgreco.so (the loader is linked into the program): no shim to install";
    return l.settled;
  }
  l.library = l.self->l_name;
  // Pin before anything points into us: NCCL dlcloses its net plugin after a failed
  // init, when devices() is 0, and after the last communicator. The handle is kept: a
  // pinned library is never unloaded anyway.
  void* pinned = dlopen(l.library.c_str(), RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  if (!pinned) {
    const char* why = dlerror();
    *detail = "cannot pin " + l.library + " in memory (" + (why ? why : "unknown dlopen error") +
              "): GOT slots must not point into a library NCCL may unload, so none are rebound";
    return ShimState::kFailed;
  }
  std::vector<Rebinding> rebindings;
  std::string missing;
  for (const std::string_view name : shim::kEntryPointNames) {
    const std::string n(name);
    void* fn = dlsym(pinned, n.c_str());
    // dlsym also searches the library's dependencies: only our own definition counts.
    if (!fn || object_of(fn) != l.self) {
      missing += (missing.empty() ? "" : ", ") + n;
      continue;
    }
    if (n == kAllReduce) l.all_reduce_index = rebindings.size();
    rebindings.push_back({n, fn});
  }
  if (rebindings.empty()) {
    l.settled = ShimState::kNotInLibrary;
    l.is_settled = true;
    *detail = "not running from liblgreco.so (" + l.library + " exports none of the shim's entry points)";
    return l.settled;
  }
  if (!missing.empty()) {
    *detail = l.library + " lacks the shim entry points " + missing +
              " (a mismatched build?): nothing rebound, so that no call bypasses half the shim";
    return ShimState::kFailed;
  }
  l.rebindings = std::move(rebindings);
  l.prepared = true;
  // Under LD_PRELOAD (or with the library otherwise first in the global scope) every
  // caller already binds to our definitions. The global scope is what the main
  // program's handle searches; RTLD_DEFAULT would not do: called from a library loaded
  // RTLD_LOCAL (NCCL's dlopen of its plugin), it also searches that library's own scope
  // and would find our definition where no caller can.
  void* global_scope = dlopen(nullptr, RTLD_LAZY);
  const void* global = global_scope ? dlsym(global_scope, kAllReduce) : nullptr;
  if (global_scope) dlclose(global_scope);
  if (global == l.rebindings[l.all_reduce_index].replacement) {
    l.settled = ShimState::kAlreadyActive;
    l.is_settled = true;
    *detail = "lgreco's shim already receives NCCL calls (LD_PRELOAD): nothing to rebind";
    LGRECO_INFO("NET", "%s", detail->c_str());
    return l.settled;
  }
  return ShimState::kInstalled;
}

ShimInstall scan(Loader& l, const LoadCounts& counts) {
  ShimInstall result;
  result.rescanned = true;
  const void* vdso = reinterpret_cast<const void*>(getauxval(AT_SYSINFO_EHDR));
  bool shared_nccl_loaded = false;
  const auto skip = [&](const LoadedObject& object) {
    if (object.contains(reinterpret_cast<const void*>(&install_shim))) return true;  // lgreco itself
    if (vdso && object.contains(vdso)) return true;
    if (!object.defines("pncclAllReduce")) return false;
    shared_nccl_loaded = true;  // a libnccl: its own calls stay its own
    return true;
  };
  RebindReport report = rebind_imports(l.rebindings, skip);
  // Count this scan as a confirmation only if nothing was loaded while it ran.
  l.scans_with_same_counts = counts == l.last_counts ? l.scans_with_same_counts + 1 : 1;
  l.last_counts = counts;

  for (const ObjectRebinds& object : report.objects) {
    if (object.rewritten == 0) continue;
    std::string names;
    for (const std::string& n : object.names) names += (names.empty() ? "" : ", ") + n;
    LGRECO_INFO("NET", "rebound %zu call sites in %s to lgreco's shim (%s)", object.rewritten,
                object.path.empty() ? "the main program" : object.path.c_str(), names.c_str());
  }
  for (const std::string& error : report.errors)
    LGRECO_WARN_ONCE("NET", error, "cannot rebind NCCL calls to lgreco's shim: %s; those calls go to NCCL "
                     "uncompressed", error.c_str());
  result.errors = std::move(report.errors);
  result.rewritten = report.rewritten();
  result.allreduce_call_sites = report.imports.empty() ? 0 : report.imports[l.all_reduce_index];
  l.allreduce_call_sites = result.allreduce_call_sites;
  if (result.allreduce_call_sites > 0) {
    l.ever_found_callers = true;
    result.state = ShimState::kInstalled;
    result.detail = std::to_string(result.allreduce_call_sites) + " call sites of ncclAllReduce bound to lgreco's shim (" +
                    std::to_string(result.rewritten) + " rebound now, " + std::to_string(report.objects_scanned) +
                    " objects scanned)";
  } else {
    result.state = ShimState::kNoCallers;
    result.detail = "no loaded object imports ncclAllReduce (" + std::to_string(report.objects_scanned) +
                    " objects scanned)";
    // Why, as far as this process shows: NCCL inside the program or a framework library
    // (no shared libnccl: its calls never pass a GOT slot), or a shared libnccl that is
    // called only through dlsym'd pointers.
    if (!l.ever_found_callers)
      LGRECO_WARN_ONCE("NET", "no-allreduce-importer",
                       "no loaded object imports ncclAllReduce (%s), so the net plugin cannot install lgreco's "
                       "compression; NCCL's calls run uncompressed (LD_PRELOAD=%s installs it where NCCL is a "
                       "shared library)",
                       shared_nccl_loaded ? "a shared libnccl is loaded, but its callers reach it through dlsym"
                                          : "no shared libnccl is loaded: NCCL is linked statically into the program "
                                            "or a framework library",
                       l.library.c_str());
  }
  return result;
}

}  // namespace

const char* shim_state_name(ShimState state) {
  switch (state) {
    case ShimState::kInstalled: return "installed";
    case ShimState::kAlreadyActive: return "already active";
    case ShimState::kNoCallers: return "no callers";
    case ShimState::kNotInLibrary: return "not in library";
    case ShimState::kFailed: return "failed";
  }
  return "?";
}

ShimInstall install_shim() noexcept {
  try {
    Loader& l = loader();
    std::lock_guard<std::mutex> lock(l.mutex);
    ShimInstall result;
    if (l.is_settled) {
      result.state = l.settled;
      result.detail = l.settled == ShimState::kAlreadyActive ? "lgreco's shim already receives NCCL calls (LD_PRELOAD)"
                                                              : "not running from liblgreco.so";
      return result;
    }
    if (!l.prepared) {
      result.state = prepare(l, &result.detail);
      if (result.state == ShimState::kFailed) LGRECO_WARN_ONCE("NET", result.detail, "%s", result.detail.c_str());
      if (result.state != ShimState::kInstalled) return result;
    }
    // An object that another thread was loading during a scan may have been relocated
    // over the slots that scan wrote: scan until two scans in a row saw the same objects.
    const LoadCounts counts = load_counts();
    if (counts == l.last_counts && l.scans_with_same_counts >= 2) {
      result.state = l.allreduce_call_sites > 0 ? ShimState::kInstalled : ShimState::kNoCallers;
      result.allreduce_call_sites = l.allreduce_call_sites;
      result.detail = "no object loaded or unloaded since the last scans";
      return result;
    }
    return scan(l, counts);
  } catch (const std::exception& e) {
    ShimInstall failed;
    failed.detail = std::string("lgreco's loader failed: ") + e.what();
    LGRECO_WARN_ONCE("NET", failed.detail, "%s", failed.detail.c_str());
    return failed;
  } catch (...) {
    return ShimInstall{};
  }
}

}  // namespace lgreco::net
