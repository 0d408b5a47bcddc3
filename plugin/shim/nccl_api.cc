#include "plugin/shim/nccl_api.h"

#include <dlfcn.h>

#include "plugin/shim/nccl_locator.h"

namespace lgreco::shim {

const char* NcclApi::error_string(Result result) const {
  if (get_error_string) return get_error_string(result);
  return "unknown NCCL result";
}

namespace {

template <typename Fn>
void bind(void* handle, const char* name, Fn*& slot) {
  slot = reinterpret_cast<Fn*>(dlsym(handle, name));
}

}  // namespace

std::optional<ResolvedNccl> resolve_loaded_nccl(std::string* error) {
  const std::optional<LoadedNccl> loaded = find_loaded_nccl();
  if (!loaded) {
    *error = "no loaded library exports pncclAllReduce (is NCCL linked statically into the framework?)";
    return std::nullopt;
  }
  // The reference stays: the framework keeps libnccl loaded for the life of the process,
  // and the table must never outlive it.
  void* handle = dlopen(loaded->path.c_str(), RTLD_LAZY | RTLD_NOLOAD | RTLD_LOCAL);
  if (!handle) {
    *error = "dlopen(" + loaded->path + ", RTLD_NOLOAD) failed: " + dlerror();
    return std::nullopt;
  }
  ResolvedNccl out;
  out.path = loaded->path;
  out.version_code = loaded->version_code;
  NcclApi& a = out.api;
  // ncclGetVersion and ncclGetErrorString have no interposed twin: their plain names
  // are libnccl's own (the p-prefixed ones exist too, taken when present).
  bind(handle, "pncclGetVersion", a.get_version);
  if (!a.get_version) bind(handle, "ncclGetVersion", a.get_version);
  bind(handle, "pncclGetErrorString", a.get_error_string);
  if (!a.get_error_string) bind(handle, "ncclGetErrorString", a.get_error_string);
  bind(handle, "pncclAllReduce", a.all_reduce);
  bind(handle, "pncclAllGather", a.all_gather);
  bind(handle, "pncclSend", a.send);
  bind(handle, "pncclRecv", a.recv);
  bind(handle, "pncclGroupStart", a.group_start);
  bind(handle, "pncclGroupEnd", a.group_end);
  bind(handle, "pncclCommCount", a.comm_count);
  bind(handle, "pncclCommUserRank", a.comm_user_rank);
  bind(handle, "pncclCommCuDevice", a.comm_cu_device);
  bind(handle, "pncclCommGetAsyncError", a.comm_get_async_error);
  bind(handle, "pncclCommDestroy", a.comm_destroy);
  bind(handle, "pncclCommAbort", a.comm_abort);
  bind(handle, "pncclCommFinalize", a.comm_finalize);
  bind(handle, "pncclGetLastError", a.get_last_error);
  bind(handle, "pncclGroupSimulateEnd", a.group_simulate_end);
  bind(handle, "pncclBroadcast", a.broadcast);
  bind(handle, "pncclBcast", a.bcast);
  bind(handle, "pncclReduce", a.reduce);
  bind(handle, "pncclReduceScatter", a.reduce_scatter);
  bind(handle, "pncclAlltoAll", a.all_to_all);
  bind(handle, "pncclGather", a.gather);
  bind(handle, "pncclScatter", a.scatter);

  const struct {
    const char* name;
    bool present;
  } required[] = {
      {"ncclGetVersion", a.get_version != nullptr},
      {"ncclGetErrorString", a.get_error_string != nullptr},
      {"pncclAllReduce", a.all_reduce != nullptr},
      {"pncclAllGather", a.all_gather != nullptr},
      {"pncclSend", a.send != nullptr},
      {"pncclRecv", a.recv != nullptr},
      {"pncclGroupStart", a.group_start != nullptr},
      {"pncclGroupEnd", a.group_end != nullptr},
      {"pncclCommCount", a.comm_count != nullptr},
      {"pncclCommUserRank", a.comm_user_rank != nullptr},
      {"pncclCommCuDevice", a.comm_cu_device != nullptr},
      {"pncclCommGetAsyncError", a.comm_get_async_error != nullptr},
      {"pncclCommDestroy", a.comm_destroy != nullptr},
      {"pncclCommAbort", a.comm_abort != nullptr},
  };
  for (const auto& r : required)
    if (!r.present) {
      *error = loaded->path + " does not export " + r.name;
      return std::nullopt;
    }
  return out;
}

}  // namespace lgreco::shim
