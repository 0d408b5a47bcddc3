#include "plugin/shim/nccl_locator.h"

#include <dlfcn.h>
#include <link.h>

#include <vector>

namespace lgreco::shim {
namespace {

using GetVersionFn = int (*)(int*);  // ncclResult_t ncclGetVersion(int*)

int collect_path(struct dl_phdr_info* info, size_t, void* data) {
  if (info->dlpi_name && info->dlpi_name[0] != '\0')
    static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
  return 0;
}

}  // namespace

std::optional<LoadedNccl> find_loaded_nccl() {
  std::vector<std::string> paths;
  // First the libnccl the application's own ncclAllReduce would bind to where it is in
  // the global scope (the next definition after this library's): with two NCCLs loaded
  // (a framework's and another package's), that is the one the caller meant. Then every
  // loaded object, for a libnccl loaded RTLD_LOCAL (PyTorch).
  Dl_info next{};
  if (void* p = dlsym(RTLD_NEXT, "pncclAllReduce"); p && dladdr(p, &next) && next.dli_fname)
    paths.emplace_back(next.dli_fname);
  dl_iterate_phdr(collect_path, &paths);
  for (const std::string& path : paths) {
    void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD | RTLD_LOCAL);
    if (!handle) continue;
    void* all_reduce = dlsym(handle, "pncclAllReduce");
    auto get_version = reinterpret_cast<GetVersionFn>(dlsym(handle, "ncclGetVersion"));
    Dl_info where{};
    // dlsym searches the object's dependencies too; dladdr names the object that defines it.
    if (all_reduce && get_version && dladdr(all_reduce, &where) && where.dli_fname) {
      LoadedNccl nccl;
      nccl.path = where.dli_fname;
      int code = 0;
      if (get_version(&code) == 0) nccl.version_code = code;
      dlclose(handle);
      return nccl;
    }
    dlclose(handle);
  }
  return std::nullopt;
}

std::string nccl_version_name(int code) {
  if (code <= 0) return "unknown";
  if (code < 10000)  // before 2.9: major * 1000 + minor * 100 + patch
    return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 100) + "." + std::to_string(code % 100);
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

}  // namespace lgreco::shim
