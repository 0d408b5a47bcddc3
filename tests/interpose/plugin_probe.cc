// A program that loads liblgreco.so the way NCCL loads a net plugin (dlopen RTLD_NOW |
// RTLD_LOCAL, then ncclNetPlugin_v11's init, once per communicator), after a library that
// calls NCCL through its PLT (caller.c, bound to the stand-in libnccl before lgreco is
// loaded). The caller is dlopened like a framework's extension: RTLD_LOCAL as PyTorch
// loads libnccl (then no ncclAllReduce is in the global scope), or RTLD_GLOBAL.
// It calls NCCL through that library, unloads the plugin as NCCL does after its last
// communicator, and calls again: both rounds must reach lgreco's shim, the second through
// the pinned library (RTLD_NODELETE). The stand-in libnccl's counts (fake_nccl_counts)
// show that the real calls still happened, the shim's exit summary (LGRECO_DEBUG=INFO)
// that it saw them. With `none` for the caller, nothing in the process imports NCCL.
//
// Usage: lgreco-plugin-probe CALLER_PATH|none lazy|now local|global PLUGIN_PATH
#include <dlfcn.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "plugin/net/net_abi.h"

namespace {

// NCCL's logger: the plugin's lines, as NCCL would print them (levels as ncclDebugLogLevel).
void probe_logger(int level, unsigned long flags, const char* file, int line, const char* format, ...) {
  (void)file, (void)line;
  static const char* const kLevels[] = {"NONE", "VERSION", "WARN", "INFO", "ABORT", "TRACE"};
  const char* name = level >= 0 && level < 6 ? kLevels[level] : "?";
  char message[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  printf("probe log %s (flags 0x%lx): %s\n", name, flags, message);
  fflush(stdout);
}

int usage(const char* self) {
  fprintf(stderr, "usage: %s CALLER_PATH|none lazy|now local|global PLUGIN_PATH\n", self);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return usage(argv[0]);
  const bool with_caller = strcmp(argv[1], "none") != 0;
  int mode = 0;
  if (!strcmp(argv[2], "lazy")) mode = RTLD_LAZY;
  else if (!strcmp(argv[2], "now")) mode = RTLD_NOW;
  else return usage(argv[0]);
  if (!strcmp(argv[3], "local")) mode |= RTLD_LOCAL;
  else if (!strcmp(argv[3], "global")) mode |= RTLD_GLOBAL;
  else return usage(argv[0]);

  int (*caller_run)() = nullptr;
  void (*fake_nccl_counts)() = nullptr;
  if (with_caller) {
    void* caller = dlopen(argv[1], mode);
    if (!caller) {
      fprintf(stderr, "probe: cannot load %s: %s\n", argv[1], dlerror());
      return 2;
    }
    caller_run = reinterpret_cast<int (*)()>(dlsym(caller, "caller_run"));
    fake_nccl_counts = reinterpret_cast<void (*)()>(dlsym(caller, "fake_nccl_counts"));  // its libnccl's
    if (!caller_run || !fake_nccl_counts) {
      fprintf(stderr, "probe: %s lacks caller_run or its libnccl fake_nccl_counts\n", argv[1]);
      return 2;
    }
  }

  void* plugin = dlopen(argv[4], RTLD_NOW | RTLD_LOCAL);
  if (!plugin) {
    fprintf(stderr, "probe: cannot load %s: %s\n", argv[4], dlerror());
    return 2;
  }
  auto* net = static_cast<lgreco::net::abi::Net_v11*>(dlsym(plugin, "ncclNetPlugin_v11"));
  if (!net || !net->init) {
    fprintf(stderr, "probe: %s has no ncclNetPlugin_v11\n", argv[4]);
    return 2;
  }
  int bad = 0;
  // Two communicators: NCCL calls init for each.
  void* ctx[2] = {nullptr, nullptr};
  int init[2] = {-1, -1};
  for (int comm = 0; comm < 2; ++comm) {
    lgreco::net::abi::CommConfig config{};
    config.trafficClass = -1;  // NCCL_NET_TRAFFIC_CLASS_UNDEF: NCCL_IB_TC not set
    init[comm] = static_cast<int>(net->init(&ctx[comm], 0x5eed + comm, &config, probe_logger, nullptr));
    printf("probe: init %d\n", init[comm]);
    fflush(stdout);
    bad |= init[comm];
    if (caller_run) bad |= caller_run();
  }
  for (int comm = 0; comm < 2; ++comm)
    if (init[comm] == 0 && net->finalize) net->finalize(ctx[comm]);
  // NCCL dlcloses its net plugin after the last communicator (and after a failed init).
  dlclose(plugin);
  printf("probe: plugin closed\n");
  fflush(stdout);
  if (caller_run) bad |= caller_run();
  if (fake_nccl_counts) fake_nccl_counts();
  return bad;
}
