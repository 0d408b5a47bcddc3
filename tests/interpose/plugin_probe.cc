// A program that loads liblgreco.so the way NCCL loads a net plugin (dlopen RTLD_NOW |
// RTLD_LOCAL, then ncclNetPlugin_v11's init), after a library that calls NCCL through its
// PLT (caller.c, linked in, so bound to the stand-in libnccl before lgreco is loaded).
// It calls NCCL through that library, unloads the plugin as NCCL does after its last
// communicator, and calls again: both rounds must reach lgreco's shim, the second through
// the pinned library (RTLD_NODELETE). The stand-in libnccl's counts (fake_nccl_counts)
// show that the real calls still happened, the shim's exit summary (LGRECO_DEBUG=INFO)
// that it saw them. Usage: lgreco-plugin-probe-{lazy,now} PLUGIN_PATH
#include <dlfcn.h>

#include <cstdarg>
#include <cstdio>

#include "plugin/net/net_abi.h"

extern "C" {
int caller_run(void);
void fake_nccl_counts(void);
}

namespace {

// NCCL's logger: the plugin's lines, as NCCL would print them.
void probe_logger(int level, unsigned long flags, const char* file, int line, const char* format, ...) {
  (void)file, (void)line;
  char message[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  static const char* const kLevels[] = {"NONE", "VERSION", "WARN", "INFO", "ABORT", "TRACE"};
  const char* name = level >= 0 && level < 6 ? kLevels[level] : "?";
  printf("probe log %s (flags 0x%lx): %s\n", name, flags, message);
  fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PLUGIN_PATH\n", argv[0]);
    return 2;
  }
  void* plugin = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!plugin) {
    fprintf(stderr, "probe: cannot load %s: %s\n", argv[1], dlerror());
    return 2;
  }
  auto* net = static_cast<lgreco::net::abi::Net_v11*>(dlsym(plugin, "ncclNetPlugin_v11"));
  if (!net || !net->init) {
    fprintf(stderr, "probe: %s has no ncclNetPlugin_v11\n", argv[1]);
    return 2;
  }
  void* ctx = nullptr;
  lgreco::net::abi::CommConfig config{};
  config.trafficClass = -1;  // NCCL_NET_TRAFFIC_CLASS_UNDEF: NCCL_IB_TC not set
  const int init = static_cast<int>(net->init(&ctx, 0x5eed, &config, probe_logger, nullptr));
  int devices = -1;
  if (init == 0 && net->devices) net->devices(&devices);
  printf("probe: init %d, devices %d\n", init, devices);
  fflush(stdout);
  int bad = caller_run();
  if (init == 0 && net->finalize) net->finalize(ctx);
  // NCCL dlcloses its net plugin after the last communicator (and after a failed init).
  dlclose(plugin);
  printf("probe: plugin closed\n");
  fflush(stdout);
  bad |= caller_run();
  fake_nccl_counts();
  return bad;
}
