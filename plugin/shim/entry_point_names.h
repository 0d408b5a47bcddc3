// The NCCL functions liblgreco.so exports as the collective shim (plugin/shim/entry_points.cc),
// by name. The net plugin's loader (plugin/net/loader.h) rebinds callers' imports of exactly
// these names to lgreco's definitions; a name missing here would leave that call going to
// NCCL directly (e.g. a ncclCommDestroy the shim never sees would leak its communicator
// state), a name here that the library does not export makes the loader fail loudly.
// tests/unit/loader_test.cc checks that this list and `nm -D liblgreco.so` agree.
#pragma once

#include <array>
#include <string_view>

namespace lgreco::shim {

inline constexpr std::array<std::string_view, 18> kEntryPointNames{
    "ncclAllReduce",  "ncclGroupStart", "ncclGroupEnd",      "ncclGroupSimulateEnd", "ncclCommDestroy",
    "ncclCommAbort",  "ncclCommFinalize", "ncclGetLastError", "ncclBroadcast",       "ncclBcast",
    "ncclReduce",     "ncclReduceScatter", "ncclAllGather",   "ncclSend",            "ncclRecv",
    "ncclAlltoAll",   "ncclGather",     "ncclScatter",
};

}  // namespace lgreco::shim
