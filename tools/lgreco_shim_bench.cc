// lgreco-shim-bench: the host cost the collective shim adds to an allreduce it passes to
// NCCL untouched (plugin/shim/shim.h), per call. Every allreduce of a job goes through
// the shim, most of them small or otherwise not compressed, so this is a tax on every
// collective; the target is at most 1 microsecond.
//
// "NCCL" here is a stub whose allreduce returns at once, so the time is the shim's own:
// the per-thread group state, the communicator lookup, the checks and the counters. The
// stub's own call (an indirect call returning a constant) is timed alone as the floor.
#include <cstdio>
#include <cstring>
#include <string>

#include "config/params.h"
#include "config/version.h"
#include "plugin/shim/host_runtime.h"
#include "plugin/shim/nccl_api.h"
#include "plugin/shim/shim.h"
#include "tools/bench_util.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-shim-bench [--calls N]

Times lgreco's ncclAllReduce on calls it passes through to NCCL (median of 5 runs of N
calls each, default 1000000): a reduction it never compresses, a call under
LGRECO_MIN_BYTES, an eligible buffer outside the call pattern (the bucket matcher runs),
calls inside a group that holds other operations, and the shim disabled (LGRECO_MODE=off).
NCCL is a stub that returns at once; its own cost is the first row.
)";

// A communicator of 2 ranks whose peer always agrees: the all-gather copies this rank's
// record into every slot. Nothing else does anything.
nccl::Result ok0() { return nccl::kSuccess; }
nccl::Result stub_all_reduce(const void*, void*, size_t, nccl::DataType, nccl::RedOp, nccl::Comm, nccl::Stream) {
  return nccl::kSuccess;
}
nccl::Result stub_all_gather(const void* send, void* recv, size_t bytes, nccl::DataType, nccl::Comm, nccl::Stream) {
  for (int r = 0; r < 2; ++r) memcpy(static_cast<uint8_t*>(recv) + r * bytes, send, bytes);
  return nccl::kSuccess;
}
nccl::Result stub_send(const void*, size_t, nccl::DataType, int, nccl::Comm, nccl::Stream) { return nccl::kSuccess; }
nccl::Result stub_recv(void*, size_t, nccl::DataType, int, nccl::Comm, nccl::Stream) { return nccl::kSuccess; }
nccl::Result stub_count(nccl::Comm, int* n) { return *n = 2, nccl::kSuccess; }
nccl::Result stub_zero(nccl::Comm, int* n) { return *n = 0, nccl::kSuccess; }
nccl::Result stub_async(nccl::Comm, nccl::Result* r) { return *r = nccl::kSuccess, nccl::kSuccess; }
nccl::Result stub_comm(nccl::Comm) { return nccl::kSuccess; }
nccl::Result stub_version(int* v) { return *v = 22809, nccl::kSuccess; }
const char* stub_error(nccl::Result) { return "stub"; }

shim::NcclApi stub_api() {
  shim::NcclApi a;
  a.get_version = stub_version;
  a.get_error_string = stub_error;
  a.all_reduce = stub_all_reduce;
  a.all_gather = stub_all_gather;
  a.send = stub_send;
  a.recv = stub_recv;
  a.group_start = ok0;
  a.group_end = ok0;
  a.comm_count = stub_count;
  a.comm_user_rank = stub_zero;
  a.comm_cu_device = stub_zero;
  a.comm_get_async_error = stub_async;
  a.comm_destroy = stub_comm;
  a.comm_abort = stub_comm;
  return a;
}

config::Params params(bool off) {
  config::ParamSources sources;
  sources.read_file = [](const std::string&, bool* missing, std::string*) -> std::optional<std::string> {
    *missing = true;
    return std::nullopt;
  };
  sources.environment = {{"LGRECO_MODE", off ? "off" : "uniform"}, {"LGRECO_DEBUG", "WARN"}};
  return config::load_params(sources);
}

void row(const char* name, uint64_t calls, const std::function<void(uint64_t)>& call) {
  for (uint64_t i = 0; i < 20000; ++i) call(i);  // warm: the agreement, the matcher's history
  uint64_t next = 20000;
  const double seconds = bench::median_seconds(5, [&] {
    for (const uint64_t end = next + calls; next < end; ++next) call(next);
  });
  printf("%-58s %9.1f\n", name, seconds / calls * 1e9);
}

int run(int argc, char** argv) {
  uint64_t calls = 1000000;
  for (cli::Args args(argc, argv, 1); args.next();) {
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (args.arg() == "--calls") {
      calls = cli::parse_u64("--calls", args.value());
    } else {
      throw cli::UsageError("unknown argument " + args.arg());
    }
  }
  const shim::NcclApi api = stub_api();
  shim::Shim shim(api, std::make_unique<shim::HostRuntime>(), shim::Shim::Options{params(false), 22809});
  shim::Shim off(api, std::make_unique<shim::HostRuntime>(), shim::Shim::Options{params(true), 22809});
  auto* comm = reinterpret_cast<nccl::Comm>(uintptr_t{0x5000});
  auto* stream = reinterpret_cast<nccl::Stream>(uintptr_t{0x6000});
  static float data[1 << 16];
  const size_t big = 1 << 20;  // 4 MiB of float32: above LGRECO_MIN_BYTES (addresses only)

  printf("# lgreco-shim-bench, lgreco %s, %s\n", version_string(), bench::utc_now().c_str());
  printf("# cpu: %s; one thread; median of 5 runs of %llu calls; target <= 1000 ns\n", bench::cpu_model().c_str(),
         static_cast<unsigned long long>(calls));
  printf("%-58s %9s\n", "call passed through", "ns/call");
  row("the stub NCCL alone (floor)", calls, [&](uint64_t) {
    api.all_reduce(data, data, 16, nccl::kFloat32, nccl::kSum, comm, stream);
  });
  row("max of float32 (never compressed)", calls, [&](uint64_t) {
    shim.all_reduce(data, data, big, nccl::kFloat32, nccl::kMax, comm, stream);
  });
  row("sum of 16 float32 (under LGRECO_MIN_BYTES)", calls, [&](uint64_t) {
    shim.all_reduce(data, data, 16, nccl::kFloat32, nccl::kSum, comm, stream);
  });
  row("sum of 4 MiB at fresh addresses (not in the call pattern)", calls, [&](uint64_t i) {
    shim.all_reduce(data, reinterpret_cast<void*>(uintptr_t{0x100000000} + (i % (1 << 24)) * 0x1000), big,
                    nccl::kFloat32, nccl::kSum, comm, stream);
  });
  row("group of broadcast + allreduce (forwarded in the group)", calls / 4, [&](uint64_t) {
    shim.group_start();
    shim.note_other_operation();
    shim.all_reduce(data, data, big, nccl::kFloat32, nccl::kSum, comm, stream);
    shim.group_end();
  });
  row("LGRECO_MODE=off", calls, [&](uint64_t) {
    off.all_reduce(data, data, big, nccl::kFloat32, nccl::kSum, comm, stream);
  });
  const shim::CommCounters c = shim.total_counters();
  printf("# %llu calls seen, %llu compressed (must be 0: every row passes through)\n",
         static_cast<unsigned long long>(c.calls), static_cast<unsigned long long>(c.compressed));
  return c.compressed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-shim-bench", [&] { return lgreco::run(argc, argv); });
}
