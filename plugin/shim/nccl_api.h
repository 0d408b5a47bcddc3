// The real NCCL, as a table of function pointers.
//
// The shim's own ncclAllReduce (and the calls it tracks) win symbol lookup under
// LD_PRELOAD, so the real ones are reached through libnccl's pncclXxx aliases
// (shared/DESIGN.md: in libnccl, ncclAllReduce is a weak alias of pncclAllReduce). The
// table is filled from the libnccl the process already loaded (nccl_locator.h); tests
// fill it with a test double (tests/unit/fake_nccl.h), which is why every call the shim
// makes to NCCL goes through it.
#pragma once

#include <optional>
#include <string>

#include "plugin/shim/nccl_abi.h"

namespace lgreco::shim {

struct NcclApi {
  using Comm = nccl::Comm;
  using Stream = nccl::Stream;
  using Result = nccl::Result;
  using DataType = nccl::DataType;
  using RedOp = nccl::RedOp;

  // Required: the shim cannot work without these.
  Result (*get_version)(int* version) = nullptr;
  const char* (*get_error_string)(Result result) = nullptr;
  Result (*all_reduce)(const void* send, void* recv, size_t count, DataType dtype, RedOp op, Comm comm,
                       Stream stream) = nullptr;
  Result (*all_gather)(const void* send, void* recv, size_t send_count, DataType dtype, Comm comm,
                       Stream stream) = nullptr;
  Result (*send)(const void* data, size_t count, DataType dtype, int peer, Comm comm, Stream stream) = nullptr;
  Result (*recv)(void* data, size_t count, DataType dtype, int peer, Comm comm, Stream stream) = nullptr;
  Result (*group_start)() = nullptr;
  Result (*group_end)() = nullptr;
  Result (*comm_count)(Comm comm, int* count) = nullptr;
  Result (*comm_user_rank)(Comm comm, int* rank) = nullptr;
  Result (*comm_cu_device)(Comm comm, int* device) = nullptr;
  Result (*comm_get_async_error)(Comm comm, Result* async_error) = nullptr;
  Result (*comm_destroy)(Comm comm) = nullptr;
  Result (*comm_abort)(Comm comm) = nullptr;

  // Optional (null when the loaded NCCL predates them; the shim then never needs them,
  // because the application, linked against the same NCCL, cannot call them either).
  Result (*comm_finalize)(Comm comm) = nullptr;                    // 2.14
  const char* (*get_last_error)(Comm comm) = nullptr;              // 2.13
  Result (*group_simulate_end)(void* sim_info) = nullptr;          // 2.22
  // Collectives the shim only forwards: seen inside a group, they make it a group that
  // is not a lone allreduce (shim.h).
  Result (*broadcast)(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                      Stream stream) = nullptr;
  Result (*bcast)(void* data, size_t count, DataType dtype, int root, Comm comm, Stream stream) = nullptr;
  Result (*reduce)(const void* send, void* recv, size_t count, DataType dtype, RedOp op, int root, Comm comm,
                   Stream stream) = nullptr;
  Result (*reduce_scatter)(const void* send, void* recv, size_t recv_count, DataType dtype, RedOp op, Comm comm,
                           Stream stream) = nullptr;
  Result (*all_to_all)(const void* send, void* recv, size_t count, DataType dtype, Comm comm,
                       Stream stream) = nullptr;                   // 2.28
  Result (*gather)(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                   Stream stream) = nullptr;                       // 2.28
  Result (*scatter)(const void* send, void* recv, size_t count, DataType dtype, int root, Comm comm,
                    Stream stream) = nullptr;                      // 2.28

  // Text for a result code, safe when get_error_string is null.
  const char* error_string(Result result) const;
};

// Versions the shim compresses on: calls on any other NCCL pass through, with one WARN.
// From 2.12 on every call and value the shim uses exists with today's meaning
// (ncclAvg 2.10, non-blocking communicators and ncclCommGetAsyncError's InProgress 2.12).
constexpr int kOldestSupportedNccl = nccl::version_code(2, 12, 0);
constexpr int kFirstUnsupportedNccl = nccl::version_code(3, 0, 0);

struct ResolvedNccl {
  NcclApi api;
  std::string path;  // the libnccl the table points into
  int version_code = 0;
};

// Fills the table from the libnccl this process already loaded. Returns nothing, with
// *error saying why, when no loaded object exports pnccl symbols or a required one is
// missing. Never loads a library itself (the framework decides which NCCL it uses).
std::optional<ResolvedNccl> resolve_loaded_nccl(std::string* error);

}  // namespace lgreco::shim
