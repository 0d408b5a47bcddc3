// Installing lgreco's collective shim from inside the NCCL net plugin, without LD_PRELOAD.
//
// With NCCL_NET_PLUGIN=lgreco, NCCL dlopens liblgreco.so (as libnccl-net-lgreco.so) during
// communicator init. By then the framework (PyTorch's libtorch_cuda.so) is loaded and its
// imports of ncclAllReduce & co. are bound to libnccl, which may even be RTLD_LOCAL: symbol
// interposition is over, and lgreco's exported ncclAllReduce is never looked up. What can
// still be changed is where those imports point: each caller reaches an imported function
// through a slot of its GOT, filled by the dynamic loader. install_shim() writes the
// address of lgreco's definition into every such slot of every loaded object
// (plugin/net/got_rebind.h), so the next ncclAllReduce the framework makes enters the shim,
// which calls the real NCCL through its pncclAllReduce exactly as under LD_PRELOAD.
//
// Not skipped objects: everything loaded except lgreco itself, any libnccl (an object that
// defines pncclAllReduce: NCCL's own internal calls must stay NCCL's) and the vdso.
//
// What it cannot reach, and what stays untouched there (those calls go to NCCL directly,
// uncompressed, and correct):
//   - NCCL linked statically into the framework: there is no import to rebind. A WARN
//     says so when no loaded object imports ncclAllReduce; LD_PRELOAD cannot help either
//     in that case, it can for the next case.
//   - callers that got the function through dlsym(), or stored its address before the
//     rebinding (in a data table or a variable): those copies keep NCCL's address.
//   - objects loaded after the last NCCL init: NCCL calls the plugin's init once per
//     communicator and each call rescans, so they are caught by the next communicator.
//
// The library pins itself first (dlopen RTLD_NODELETE): NCCL dlcloses a net plugin after a
// failed init, when devices() is 0 and after its last communicator, and rebound slots must
// never point into unmapped memory. Under LD_PRELOAD the shim already receives every call;
// install_shim() then only says so.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace lgreco::net {

enum class ShimState {
  kInstalled,      // callers' imports of ncclAllReduce are bound to the shim
  kAlreadyActive,  // global lookup finds lgreco's own ncclAllReduce (LD_PRELOAD): nothing to do
  kNoCallers,      // no loaded object imports ncclAllReduce through its GOT: nothing to rebind
  kNotInLibrary,   // this code is not running from liblgreco.so (a program linking the core archive)
  kFailed,         // the library could not be pinned or its entry points found: nothing rebound
};
const char* shim_state_name(ShimState state);

struct ShimInstall {
  ShimState state = ShimState::kFailed;
  std::string detail;              // one line: what happened, or why not
  size_t rewritten = 0;            // GOT slots this call pointed at the shim
  size_t allreduce_call_sites = 0;  // slots bound to the shim's ncclAllReduce after the last scan
  bool rescanned = false;          // false: no object was loaded or unloaded since the last scans
  std::vector<std::string> errors;  // objects that could not be rebound (each also logged once)
};

// Pins the library and binds every loaded caller's imports of the shim's entry points
// (plugin/shim/entry_point_names.h) to lgreco's definitions. Safe to call from any thread
// at any time, as often as NCCL inits a communicator: calls are serialised, and a call
// after two scans that saw the same set of loaded objects only compares two counters.
// Never throws; logs under NET (INFO per object rebound, one WARN per distinct problem).
ShimInstall install_shim() noexcept;

}  // namespace lgreco::net
