// The NCCL functions liblgreco.so exports. Under LD_PRELOAD they win symbol lookup over
// libnccl's (which are weak aliases of its pnccl* functions), so the framework's calls
// come here; each hands its call to the process's one Shim (shim.h), which compresses it
// or calls the real NCCL through the pnccl* table.
//
// The Shim is made at the first call (NCCL is loaded by then; it may not be when this
// library is) and is never destroyed: at process exit the CUDA runtime may already be
// gone, so an exit handler only logs each communicator's summary.
//
// Only this file and plugin/library.cc go into liblgreco.so without the core archive:
// the unit tests link the archive and must not interpose NCCL themselves.
#include <cstdlib>
#include <string>

#include "config/log.h"
#include "config/params.h"
#include "plugin/shim/device_runtime.h"
#include "plugin/shim/nccl_api.h"
#include "plugin/shim/nccl_locator.h"
#include "plugin/shim/shim.h"

namespace lgreco::shim {
namespace {

Shim* g_exit_shim = nullptr;
void log_at_exit() {
  if (g_exit_shim) g_exit_shim->log_summaries();
}

Shim* create_shim() noexcept try {
  std::string error;
  std::optional<ResolvedNccl> nccl = resolve_loaded_nccl(&error);
  if (!nccl) {
    LGRECO_WARN("SHIM", "lgreco's NCCL functions cannot reach the real NCCL: %s; NCCL calls fail with "
                "ncclSystemError (remove liblgreco.so from LD_PRELOAD)", error.c_str());
    return nullptr;
  }
  LGRECO_INFO("SHIM", "interposing NCCL %s at %s", nccl_version_name(nccl->version_code).c_str(), nccl->path.c_str());
  Shim::Options options{config::params(), nccl->version_code};
  auto* shim = new Shim(nccl->api, cuda_runtime(), std::move(options));
  g_exit_shim = shim;
  std::atexit(log_at_exit);
  return shim;
} catch (const std::exception& e) {
  LGRECO_WARN("SHIM", "cannot start lgreco's shim: %s; NCCL calls fail with ncclSystemError", e.what());
  return nullptr;
}

// Nothing may unwind into the caller's C code: an exception the shim did not handle
// itself (it handles every one it expects) ends the call with ncclInternalError.
template <typename Fn>
nccl::Result guarded(const char* call, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::exception& e) {
    LGRECO_WARN("SHIM", "%s: unexpected error in lgreco: %s", call, e.what());
  } catch (...) {
    LGRECO_WARN("SHIM", "%s: unexpected error in lgreco", call);
  }
  return nccl::kInternalError;
}

Shim* the_shim() {
  static Shim* shim = create_shim();  // thread-safe once; then one load
  return shim;
}

}  // namespace
}  // namespace lgreco::shim

using lgreco::nccl::Comm;
using lgreco::nccl::DataType;
using lgreco::nccl::RedOp;
using lgreco::nccl::Result;
using lgreco::nccl::Stream;
using lgreco::shim::guarded;
using lgreco::shim::Shim;
using lgreco::shim::the_shim;

#define LGRECO_EXPORT extern "C" __attribute__((visibility("default")))

// Forwards a call the shim does not change, after telling it that an operation other
// than an allreduce joined the current group.
#define LGRECO_FORWARD(member, ...)                                   \
  Shim* shim = the_shim();                                            \
  if (!shim) return lgreco::nccl::kSystemError;                       \
  if (!shim->api().member) return lgreco::nccl::kInvalidUsage;        \
  return guarded(#member, [&] {                                       \
    shim->note_other_operation();                                     \
    return shim->api().member(__VA_ARGS__);                           \
  })

LGRECO_EXPORT Result ncclAllReduce(const void* send, void* recv, size_t count, DataType dtype, RedOp op, Comm comm,
                                   Stream stream) {
  Shim* shim = the_shim();
  return shim ? guarded("ncclAllReduce", [&] { return shim->all_reduce(send, recv, count, dtype, op, comm, stream); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclGroupStart() {
  Shim* shim = the_shim();
  return shim ? guarded("ncclGroupStart", [&] { return shim->group_start(); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclGroupEnd() {
  Shim* shim = the_shim();
  return shim ? guarded("ncclGroupEnd", [&] { return shim->group_end(); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclGroupSimulateEnd(void* sim_info) {
  Shim* shim = the_shim();
  return shim ? guarded("ncclGroupSimulateEnd", [&] { return shim->group_simulate_end(sim_info); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclCommDestroy(Comm comm) {
  Shim* shim = the_shim();
  return shim ? guarded("ncclCommDestroy", [&] { return shim->comm_destroy(comm); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclCommAbort(Comm comm) {
  Shim* shim = the_shim();
  return shim ? guarded("ncclCommAbort", [&] { return shim->comm_abort(comm); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT Result ncclCommFinalize(Comm comm) {
  Shim* shim = the_shim();
  return shim ? guarded("ncclCommFinalize", [&] { return shim->comm_finalize(comm); }) : lgreco::nccl::kSystemError;
}

LGRECO_EXPORT const char* ncclGetLastError(Comm comm) {
  Shim* shim = the_shim();
  if (!shim) return "lgreco could not find the real NCCL (see its WARN)";
  try {
    return shim->last_error(comm);
  } catch (...) {
    return "lgreco: cannot read the last error";
  }
}

LGRECO_EXPORT Result ncclBroadcast(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                                   Stream stream) {
  LGRECO_FORWARD(broadcast, send, recv, count, dtype, root, comm, stream);
}
LGRECO_EXPORT Result ncclBcast(void* data, size_t count, DataType dtype, int root, Comm comm, Stream stream) {
  LGRECO_FORWARD(bcast, data, count, dtype, root, comm, stream);
}
LGRECO_EXPORT Result ncclReduce(const void* send, void* recv, size_t count, DataType dtype, RedOp op, int root,
                                Comm comm, Stream stream) {
  LGRECO_FORWARD(reduce, send, recv, count, dtype, op, root, comm, stream);
}
LGRECO_EXPORT Result ncclReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype, RedOp op,
                                       Comm comm, Stream stream) {
  LGRECO_FORWARD(reduce_scatter, send, recv, recv_count, dtype, op, comm, stream);
}
LGRECO_EXPORT Result ncclAllGather(const void* send, void* recv, size_t send_count, DataType dtype, Comm comm,
                                   Stream stream) {
  LGRECO_FORWARD(all_gather, send, recv, send_count, dtype, comm, stream);
}
LGRECO_EXPORT Result ncclSend(const void* data, size_t count, DataType dtype, int peer, Comm comm, Stream stream) {
  LGRECO_FORWARD(send, data, count, dtype, peer, comm, stream);
}
LGRECO_EXPORT Result ncclRecv(void* data, size_t count, DataType dtype, int peer, Comm comm, Stream stream) {
  LGRECO_FORWARD(recv, data, count, dtype, peer, comm, stream);
}
LGRECO_EXPORT Result ncclAlltoAll(const void* send, void* recv, size_t count, DataType dtype, Comm comm,
                                  Stream stream) {
  LGRECO_FORWARD(all_to_all, send, recv, count, dtype, comm, stream);
}
LGRECO_EXPORT Result ncclGather(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                                Stream stream) {
  LGRECO_FORWARD(gather, send, recv, count, dtype, root, comm, stream);
}
LGRECO_EXPORT Result ncclScatter(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                                 Stream stream) {
  LGRECO_FORWARD(scatter, send, recv, count, dtype, root, comm, stream);
}
