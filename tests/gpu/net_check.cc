// lgreco-gpu-net-check: NCCL's own allreduce over the network transport NCCL is told to
// use (NCCL_NET: lgreco's net plugin, or NCCL's internal Socket), checked and timed like
// nccl-tests' all_reduce_perf, with R ranks as processes sharing one GPU.
//
// The program loads the libnccl given by --nccl-lib (default libnccl.so.2, as
// lgreco-bench --fabric nccl) and resolves the few entry points it calls itself; it
// never includes nccl.h (plugin/shim/nccl_abi.h has the types) and links no lgreco code,
// so that what is measured is NCCL with whatever net plugin NCCL loads.
//
// Process model (as tests/gpu/run.sh shim and docs/BENCH.md run lgreco-bench): the
// parent never touches CUDA; a probe process checks the device, then one process per
// rank is forked, each with its own NCCL_HOSTID (NCCL refuses two ranks on one GPU
// otherwise) and, unless the environment says otherwise, NCCL_P2P_DISABLE=1
// NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo, so that the ranks talk over the network
// transport. Rank 0's ncclUniqueId reaches the others through pipes; each rank reports
// its rows, and the stage it is in, to the parent through another pipe. The parent is
// the watchdog: a rank that fails or a run past --timeout ends every rank.
//
// Per size (float32, sum, out of place): each rank fills its input from a counter-based
// random stream keyed by (seed, size, rank), poisons its output with NaN, runs one
// allreduce, and checks every element against the float64 sum of all ranks' inputs,
// regenerated on the host; then the input must be unchanged. Bound: NCCL adds R float32
// values in some order (ring or tree); any order of R - 1 float32 additions is within
// gamma_(R-1) * sum |x_r| of the exact sum (Higham, recursive summation), gamma_k =
// k u / (1 - k u), u = 2^-24, so |out - sum| <= R * 2^-24 * sum |x_r| holds for every
// correct result (and with inputs in multiples of 2^-23 in [-1, 1), two ranks' sum is
// exact in float32: any difference at R = 2 is a wrong value). Then warm-up calls, and
// timed calls with a CUDA event between each two: per rank the median, and the row's time
// is the slowest rank's median. algbw = size / time, busbw = algbw * 2 (R - 1) / R.
//
// Exit status: 0 every size correct, 1 wrong values or a rank failed, 2 usage error or no
// usable CUDA device (the reason is printed), 3 the watchdog's --timeout ran out.
// Built only with CUDA (Makefile), run by tests/gpu/run.sh net.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "plugin/shim/nccl_abi.h"
#include "tests/gpu/check_util.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

using gpu_check::strf;

constexpr char kProgram[] = "lgreco-gpu-net-check";
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;  // also: no usable CUDA device
constexpr int kExitTimeout = 3;

constexpr const char* kUsage = R"(usage: lgreco-gpu-net-check [options]

NCCL's allreduce (float32, sum, out of place) over the network transport NCCL_NET names,
R ranks as processes on one GPU; each size checked against the float64 sum of every
rank's input, then timed. One row per size, as nccl-tests prints them:
  size count type redop time(us) algbw busbw #wrong max_err/bound
time is the slowest rank's median over the timed calls (CUDA events), algbw = size /
time, busbw = algbw * 2 (R-1) / R; #wrong counts elements outside the bound
R * 2^-24 * sum|x| over all ranks, plus input elements the call changed.

  --ranks N               processes, all on --device (2 to 8; default 2)
  -b, --minbytes SIZE     smallest size (K, M, G suffixes; multiple of 4; default 1M)
  -e, --maxbytes SIZE     largest size (default 256M)
  -f, --stepfactor N      multiply the size by N between rows (default 4)
  -n, --iters N           timed calls per size (default 10)
  -w, --warmup_iters N    untimed calls before them (default 3)
  --nccl-lib PATH         the libnccl to dlopen (default libnccl.so.2)
  --net NAME              set NCCL_NET for the ranks (default: NCCL_NET from the
                          environment, else Socket)
  --device N              the CUDA device of every rank (default 0)
  --seed N                input seed (default 1)
  --timeout S             the watchdog: every rank is ended and the run fails after S
                          seconds (default 300)
  -h, --help              this text

Each rank gets NCCL_HOSTID=<NCCL_HOSTID or lgreco-net-check-PID>-<rank>, and, unless set
in the environment, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo (NCCL
runs several ranks on one GPU only that way). A net plugin: NCCL_NET_PLUGIN=PATH and
--net NAME. Exit status: 0 all correct, 1 wrong values or a rank failed, 2 usage error
or no usable CUDA device, 3 the watchdog fired.
)";

struct Options {
  int ranks = 2;
  uint64_t min_bytes = 1 << 20, max_bytes = 256 << 20, factor = 4;
  int iters = 10, warmup = 3;
  std::string nccl_lib = "libnccl.so.2";
  std::string net;  // empty: the environment's NCCL_NET, else Socket
  int device = 0;
  uint64_t seed = 1;
  int timeout_s = 300;
};

uint64_t parse_size(const std::string& option, const std::string& text) {
  return cli::parse_size(option, text, uint64_t{1} << 36);
}

using cli::parse_int;

Options parse(int argc, char** argv) {
  Options o;
  cli::Args args(argc, argv, 1);
  while (args.next()) {
    const std::string a = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      exit(0);
    } else if (a == "--ranks") {
      o.ranks = parse_int(a, args.value(), 2, 8);
    } else if (a == "-b" || a == "--minbytes") {
      o.min_bytes = parse_size(a, args.value());
    } else if (a == "-e" || a == "--maxbytes") {
      o.max_bytes = parse_size(a, args.value());
    } else if (a == "-f" || a == "--stepfactor") {
      o.factor = static_cast<uint64_t>(parse_int(a, args.value(), 2, 1 << 20));
    } else if (a == "-n" || a == "--iters") {
      o.iters = parse_int(a, args.value(), 1, 100000);
    } else if (a == "-w" || a == "--warmup_iters") {
      o.warmup = parse_int(a, args.value(), 0, 100000);
    } else if (a == "--nccl-lib") {
      o.nccl_lib = args.value();
      if (o.nccl_lib.empty()) throw cli::UsageError("--nccl-lib needs a path");
    } else if (a == "--net") {
      o.net = args.value();
      if (o.net.empty()) throw cli::UsageError("--net needs a name (lgreco, Socket, IB)");
    } else if (a == "--device") {
      o.device = parse_int(a, args.value(), 0, 1023);
    } else if (a == "--seed") {
      o.seed = cli::parse_u64(a, args.value());
    } else if (a == "--timeout") {
      o.timeout_s = parse_int(a, args.value(), 1, 86400);
    } else {
      throw cli::UsageError("unknown option " + a);
    }
  }
  if (o.min_bytes < 4 || o.min_bytes % 4 != 0)
    throw cli::UsageError("-b (minbytes) must be a positive multiple of 4 (float32 elements), got " +
                          std::to_string(o.min_bytes));
  if (o.max_bytes < o.min_bytes) throw cli::UsageError("-e (maxbytes) is smaller than -b (minbytes)");
  return o;
}

std::vector<uint64_t> sizes_of(const Options& o) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = o.min_bytes; s <= o.max_bytes; s *= o.factor) {
    sizes.push_back(s);
    if (s > o.max_bytes / o.factor) break;
  }
  return sizes;
}

// ---------------------------------------------------------------------------------------
// NCCL, loaded by hand

// Declared from nccl.h's signatures with nccl_abi.h's types.
struct Nccl {
  std::string path;  // the file the dynamic loader opened
  int version = 0;
  nccl::Result (*get_version)(int*) = nullptr;
  nccl::Result (*get_unique_id)(nccl::UniqueId*) = nullptr;
  nccl::Result (*comm_init_rank)(nccl::Comm*, int, nccl::UniqueId, int) = nullptr;
  nccl::Result (*all_reduce)(const void*, void*, size_t, nccl::DataType, nccl::RedOp, nccl::Comm,
                             nccl::Stream) = nullptr;
  nccl::Result (*comm_destroy)(nccl::Comm) = nullptr;
  const char* (*get_error_string)(nccl::Result) = nullptr;
  // Optional (NCCL 2.13 and later): better messages and an abort on errors.
  nccl::Result (*comm_get_async_error)(nccl::Comm, nccl::Result*) = nullptr;
  nccl::Result (*comm_abort)(nccl::Comm) = nullptr;
  const char* (*get_last_error)(nccl::Comm) = nullptr;
};

template <typename Fn>
void resolve(void* lib, const Options& o, const char* name, Fn* out, bool required = true) {
  void* f = dlsym(lib, name);
  if (!f && required) throw std::runtime_error("--nccl-lib " + o.nccl_lib + " does not export " + name);
  *out = reinterpret_cast<Fn>(f);
}

// Loads the library in the parent, before any fork: loading NCCL creates no CUDA context
// and starts no thread (ncclGetVersion only returns a constant), so the children inherit
// a library that has done nothing yet.
Nccl load_nccl(const Options& o) {
  void* lib = dlopen(o.nccl_lib.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!lib)
    throw std::runtime_error("cannot load NCCL from '" + o.nccl_lib + "' (--nccl-lib PATH): " + dlerror());
  Nccl api;
  resolve(lib, o, "ncclGetVersion", &api.get_version);
  resolve(lib, o, "ncclGetUniqueId", &api.get_unique_id);
  resolve(lib, o, "ncclCommInitRank", &api.comm_init_rank);
  resolve(lib, o, "ncclAllReduce", &api.all_reduce);
  resolve(lib, o, "ncclCommDestroy", &api.comm_destroy);
  resolve(lib, o, "ncclGetErrorString", &api.get_error_string);
  resolve(lib, o, "ncclCommGetAsyncError", &api.comm_get_async_error, false);
  resolve(lib, o, "ncclCommAbort", &api.comm_abort, false);
  resolve(lib, o, "ncclGetLastError", &api.get_last_error, false);
  struct link_map* map = nullptr;
  api.path = o.nccl_lib;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name) {
    char* real = realpath(map->l_name, nullptr);
    api.path = real ? real : map->l_name;
    free(real);
  }
  const nccl::Result r = api.get_version(&api.version);
  if (r != nccl::kSuccess) throw std::runtime_error(strf("ncclGetVersion failed: %d", static_cast<int>(r)));
  return api;
}

std::string version_name(int code) {
  // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9, major * 1000 + ... before.
  if (code >= 20900) return strf("%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
  return strf("%d.%d.%d", code / 1000, code / 100 % 10, code % 100);
}

// ---------------------------------------------------------------------------------------
// Inputs and the check

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;

// The key of one rank's stream at one size: a fresh stream per (seed, size, rank).
uint64_t stream_key(uint64_t seed, uint64_t bytes, int rank) {
  return mix(mix(seed + kGamma) ^ mix(bytes * 0xd1b54a32d192ed03ull + static_cast<uint64_t>(rank) + 1));
}

// Element i of a stream (splitmix64: state key + i * gamma): uniform in [-1, 1), a
// multiple of 2^-23, exact in float32.
float value(uint64_t key, uint64_t i) {
  return static_cast<float>(mix(key + (i + 1) * kGamma) >> 40) * 0x1p-23f - 1.0f;
}

// Runs fn(begin, end) over [0, n) in `threads` contiguous parts.
template <typename Fn>
void parallel_for(uint64_t n, int threads, Fn&& fn) {
  if (threads <= 1 || n < (1u << 16)) {
    fn(uint64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  const uint64_t step = (n + threads - 1) / threads;
  for (uint64_t b = 0; b < n; b += step) pool.emplace_back([&fn, b, e = std::min(n, b + step)] { fn(b, e); });
  for (auto& t : pool) t.join();
}

struct CheckResult {
  uint64_t wrong = 0;           // outputs outside the bound, plus changed inputs
  uint64_t input_changed = 0;
  double max_ratio = 0;         // the largest |out - sum| / bound (0 where bound and error are 0)
  uint64_t first_wrong = UINT64_MAX;
  double first_got = 0, first_want = 0;
  uint64_t digest = 0;          // of the output's bytes, to compare ranks
};

CheckResult check_output(const std::vector<float>& out, uint64_t count, uint64_t seed, uint64_t bytes, int ranks,
                         int threads) {
  std::vector<uint64_t> keys;
  for (int r = 0; r < ranks; ++r) keys.push_back(stream_key(seed, bytes, r));
  std::vector<CheckResult> parts(static_cast<size_t>(std::max(threads, 1)) + 1);
  std::atomic<size_t> next_part{0};
  parallel_for(count, threads, [&](uint64_t begin, uint64_t end) {
    CheckResult& c = parts[next_part++];
    uint64_t h = 0;
    for (uint64_t i = begin; i < end; ++i) {
      double want = 0, magnitude = 0;
      for (uint64_t key : keys) {
        const double x = value(key, i);
        want += x;
        magnitude += std::fabs(x);
      }
      const double got = out[i];
      const double bound = ranks * std::ldexp(magnitude, -24);
      const double d = std::fabs(got - want);
      if (!(d <= bound)) {
        if (c.wrong++ == 0) {
          c.first_wrong = i;
          c.first_got = got;
          c.first_want = want;
        }
      } else if (bound > 0) {
        c.max_ratio = std::max(c.max_ratio, d / bound);
      }
      uint32_t bits;
      memcpy(&bits, &out[i], sizeof bits);
      h ^= mix((i + 1) * kGamma ^ bits);  // order-free: the parts combine by xor
    }
    c.digest = h;
  });
  CheckResult total;
  for (const CheckResult& c : parts) {
    total.wrong += c.wrong;
    total.max_ratio = std::max(total.max_ratio, c.max_ratio);
    total.digest ^= c.digest;
    if (c.first_wrong < total.first_wrong) {
      total.first_wrong = c.first_wrong;
      total.first_got = c.first_got;
      total.first_want = c.first_want;
    }
  }
  return total;
}

// ---------------------------------------------------------------------------------------
// One rank (a child process)

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("write to the parent's pipe: ") + strerror(errno));
    p += n;
    left -= static_cast<size_t>(n);
  }
}

// Reads exactly n bytes from fd before `deadline` (cli::seconds_now()).
void read_exactly(int fd, void* buffer, size_t n, double deadline, const char* what) {
  auto* p = static_cast<char*>(buffer);
  while (n > 0) {
    const double left = deadline - cli::seconds_now();
    if (left <= 0) throw std::runtime_error(strf("timed out waiting for %s", what));
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
    if (ready < 0 && errno != EINTR) throw std::runtime_error(strf("poll: %s", strerror(errno)));
    if (ready <= 0) continue;
    const ssize_t got = read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw std::runtime_error(strf("reading %s: %s", what, strerror(errno)));
    if (got == 0) throw std::runtime_error(strf("rank 0 ended before sending %s", what));
    p += got;
    n -= static_cast<size_t>(got);
  }
}

class Rank {
 public:
  Rank(const Options& o, const Nccl& api, int rank, int report_fd, double deadline)
      : o_(o), api_(api), rank_(rank), report_fd_(report_fd), deadline_(deadline) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    threads_ = static_cast<int>(std::clamp<unsigned>(cores / static_cast<unsigned>(o.ranks), 1, 8));
  }

  void run(int id_read_fd, const std::vector<int>& id_write_fds) {
    stage("cudaSetDevice");
    LGRECO_CUDA_CHECK(cudaSetDevice(o_.device));
    cudaStream_t stream = nullptr;
    LGRECO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_ = stream;

    nccl::UniqueId id{};
    if (rank_ == 0) {
      stage("ncclGetUniqueId");
      check(api_.get_unique_id(&id), "ncclGetUniqueId", nullptr);
      for (int fd : id_write_fds) write_all(fd, std::string(id.internal, sizeof id.internal));
    } else {
      stage("waiting for rank 0's ncclUniqueId");
      read_exactly(id_read_fd, &id, sizeof id, deadline_, "the ncclUniqueId");
    }
    stage("ncclCommInitRank");
    nccl::Comm comm = nullptr;
    check(api_.comm_init_rank(&comm, o_.ranks, id, rank_), "ncclCommInitRank", nullptr);

    // Device memory, events and the communicator are released on success only: after an
    // error NCCL's kernels may still be waiting for a peer, and cudaFree or
    // ncclCommDestroy would wait with them. The process ends instead (the parent ends
    // its peers), and the driver releases everything.
    const uint64_t max_count = sizes_of(o_).back() / 4;
    void* in = nullptr;
    void* out = nullptr;
    LGRECO_CUDA_CHECK(cudaMalloc(&in, max_count * 4));
    LGRECO_CUDA_CHECK(cudaMalloc(&out, max_count * 4));
    std::vector<float> host_in(max_count), host_out(max_count);
    std::vector<cudaEvent_t> events(static_cast<size_t>(o_.iters) + 1);
    for (auto& e : events) LGRECO_CUDA_CHECK(cudaEventCreate(&e));

    for (const uint64_t bytes : sizes_of(o_)) {
      const uint64_t count = bytes / 4;
      const std::string at = strf("%llu B", static_cast<unsigned long long>(bytes));
      const uint64_t key = stream_key(o_.seed, bytes, rank_);
      parallel_for(count, threads_, [&](uint64_t b, uint64_t e) {
        for (uint64_t i = b; i < e; ++i) host_in[i] = value(key, i);
      });
      LGRECO_CUDA_CHECK(cudaMemcpyAsync(in, host_in.data(), bytes, cudaMemcpyHostToDevice, stream));
      LGRECO_CUDA_CHECK(cudaMemsetAsync(out, 0xff, bytes, stream));  // NaN everywhere
      stage("checked allreduce, " + at);
      all_reduce(in, out, count, comm, "ncclAllReduce (checked call), " + at);
      wait(comm, "the checked allreduce, " + at);
      LGRECO_CUDA_CHECK(cudaMemcpyAsync(host_out.data(), out, bytes, cudaMemcpyDeviceToHost, stream));
      wait(comm, "copying the output back, " + at);
      stage("checking " + at);
      CheckResult c = check_output(host_out, count, o_.seed, bytes, o_.ranks, threads_);
      // Out of place: the input must come back unchanged.
      LGRECO_CUDA_CHECK(cudaMemcpyAsync(host_out.data(), in, bytes, cudaMemcpyDeviceToHost, stream));
      wait(comm, "copying the input back, " + at);
      if (memcmp(host_out.data(), host_in.data(), bytes) != 0)
        for (uint64_t i = 0; i < count; ++i) c.input_changed += memcmp(&host_out[i], &host_in[i], 4) != 0;
      c.wrong += c.input_changed;
      if (c.first_wrong != UINT64_MAX)
        fprintf(stderr, "%s: rank %d: %s: %llu of %llu outputs outside the bound; the first, element %llu: got %.9g, "
                "want %.17g\n", kProgram, rank_, at.c_str(), static_cast<unsigned long long>(c.wrong - c.input_changed),
                static_cast<unsigned long long>(count), static_cast<unsigned long long>(c.first_wrong), c.first_got,
                c.first_want);
      if (c.input_changed)
        fprintf(stderr, "%s: rank %d: %s: the out-of-place call changed %llu input elements\n", kProgram, rank_,
                at.c_str(), static_cast<unsigned long long>(c.input_changed));

      stage("timing " + at);
      for (int w = 0; w < o_.warmup; ++w) all_reduce(in, out, count, comm, "ncclAllReduce (warm-up), " + at);
      LGRECO_CUDA_CHECK(cudaEventRecord(events[0], stream));
      for (int k = 0; k < o_.iters; ++k) {
        all_reduce(in, out, count, comm, "ncclAllReduce (timed), " + at);
        LGRECO_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(k) + 1], stream));
      }
      wait(comm, "the timed allreduces, " + at);
      std::vector<double> us;
      for (int k = 0; k < o_.iters; ++k) {
        float ms = 0;
        LGRECO_CUDA_CHECK(cudaEventElapsedTime(&ms, events[static_cast<size_t>(k)], events[static_cast<size_t>(k) + 1]));
        us.push_back(ms * 1000.0);
      }
      std::sort(us.begin(), us.end());
      const double median = us.size() % 2 ? us[us.size() / 2] : (us[us.size() / 2 - 1] + us[us.size() / 2]) / 2;
      write_all(report_fd_, strf("ROW %llu %.3f %llu %.6g %016llx\n", static_cast<unsigned long long>(bytes), median,
                                 static_cast<unsigned long long>(c.wrong), c.max_ratio,
                                 static_cast<unsigned long long>(c.digest)));
    }
    stage("ncclCommDestroy");
    check(api_.comm_destroy(comm), "ncclCommDestroy", nullptr);
    for (auto e : events) LGRECO_CUDA_CHECK(cudaEventDestroy(e));
    LGRECO_CUDA_CHECK(cudaFree(in));
    LGRECO_CUDA_CHECK(cudaFree(out));
    LGRECO_CUDA_CHECK(cudaStreamDestroy(stream));
    write_all(report_fd_, "DONE\n");
  }

 private:
  void stage(const std::string& what) { write_all(report_fd_, "STAGE " + what + "\n"); }

  void check(nccl::Result r, const std::string& call, nccl::Comm comm) {
    if (r == nccl::kSuccess) return;
    std::string detail;
    if (api_.get_last_error) {
      const char* last = api_.get_last_error(comm);
      if (last && *last) detail = std::string(" (NCCL's last error: ") + last + ")";
    }
    throw std::runtime_error(strf("%s failed: %d, %s%s", call.c_str(), static_cast<int>(r), api_.get_error_string(r),
                                  detail.c_str()));
  }

  void all_reduce(const void* in, void* out, uint64_t count, nccl::Comm comm, const std::string& call) {
    check(api_.all_reduce(in, out, count, nccl::kFloat32, nccl::kSum, comm, reinterpret_cast<nccl::Stream>(stream_)),
          call, comm);
  }

  // Waits for the stream while watching the communicator's asynchronous errors and the
  // deadline (a few seconds before the parent's watchdog, so this rank can say where it was).
  void wait(nccl::Comm comm, const std::string& what) {
    double last_async = 0;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) gpu_check::cuda_failed(q, ("cudaStreamQuery, waiting for " + what).c_str(), __FILE__, __LINE__);
      const double now = cli::seconds_now();
      if (api_.comm_get_async_error && now - last_async > 0.05) {
        last_async = now;
        nccl::Result async = nccl::kSuccess;
        check(api_.comm_get_async_error(comm, &async), "ncclCommGetAsyncError", comm);
        if (async != nccl::kSuccess && async != nccl::kInProgress)
          check(async, "the communicator, waiting for " + what + ",", comm);
      }
      if (now > deadline_) throw std::runtime_error("timed out waiting for " + what);
      usleep(200);
    }
  }

  const Options& o_;
  const Nccl& api_;
  const int rank_;
  const int report_fd_;
  const double deadline_;
  int threads_ = 1;
  cudaStream_t stream_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// The parent

// Sets `name` unless the environment has it; returns its value.
std::string default_env(const char* name, const char* value) {
  setenv(name, value, 0);
  return getenv(name);
}

std::string env_or(const char* name, const char* otherwise) {
  const char* v = getenv(name);
  return v && *v ? v : otherwise;
}

// No usable CUDA device: exit 2, after the probe's message.
struct NoDevice {};

// One probe process: is there a usable device? Exit 0 with its name on the pipe, or 2
// with the reason on stderr. Keeps CUDA out of the parent, which forks the ranks next.
std::string probe_device(const Options& o, double deadline) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error(strf("pipe: %s", strerror(errno)));
  fflush(stdout);
  fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(strf("fork: %s", strerror(errno)));
  if (pid == 0) {
    close(fds[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      fprintf(stderr, "%s: no usable CUDA device (cudaGetDeviceCount: %s)\n", kProgram,
              e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
      _exit(kExitUsage);
    }
    if (o.device >= devices) {
      fprintf(stderr, "%s: --device %d: this process sees %d CUDA device(s)\n", kProgram, o.device, devices);
      _exit(kExitUsage);
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, o.device) != cudaSuccess) _exit(kExitUsage);
    const std::string text = strf("%s, sm_%d%d, %.0f GiB", prop.name, prop.major, prop.minor,
                                  static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
    if (write(fds[1], text.data(), text.size()) < 0) _exit(kExitFailed);
    _exit(0);
  }
  close(fds[1]);
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (cli::seconds_now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      close(fds[0]);
      throw std::runtime_error("the device probe (cudaGetDeviceCount) did not finish before --timeout");
    }
    usleep(10000);
  }
  char name[512] = {};
  const ssize_t n = read(fds[0], name, sizeof name - 1);
  close(fds[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : kExitFailed;
    if (code == kExitUsage) throw NoDevice();  // the probe said why
    throw std::runtime_error(strf("the device probe failed (wait status %d)", status));
  }
  return std::string(name, n > 0 ? static_cast<size_t>(n) : 0);
}

struct RankState {
  pid_t pid = -1;
  int report_fd = -1;
  std::string buffer;     // bytes read, not yet a whole line
  std::string stage = "starting";
  bool exited = false, done = false, eof = false;
  int status = 0;
  std::map<uint64_t, std::vector<std::string>> rows;  // bytes -> fields of its ROW line
};

int run(const Options& o) {
  const double start = cli::seconds_now();
  const double deadline = start + o.timeout_s;
  const Nccl api = load_nccl(o);

  // The environment every rank inherits; NCCL_HOSTID is set per rank after the fork.
  if (!o.net.empty()) setenv("NCCL_NET", o.net.c_str(), 1);
  const std::string net = default_env("NCCL_NET", "Socket");
  const std::string p2p = default_env("NCCL_P2P_DISABLE", "1");
  const std::string shm = default_env("NCCL_SHM_DISABLE", "1");
  const std::string ifname = default_env("NCCL_SOCKET_IFNAME", "lo");
  const std::string hostid = env_or("NCCL_HOSTID", strf("lgreco-net-check-%d", static_cast<int>(getpid())).c_str());

  const std::string device_name = probe_device(o, deadline);
  const std::vector<uint64_t> sizes = sizes_of(o);
  printf("# %s: NCCL allreduce (sum, float32, out of place), %d ranks as processes on device %d (%s) (%s)\n", kProgram,
         o.ranks, o.device, device_name.c_str(), bench::utc_now().c_str());
  printf("# nccl %s at %s\n", version_name(api.version).c_str(), api.path.c_str());
  printf("# NCCL_NET=%s NCCL_NET_PLUGIN=%s NCCL_P2P_DISABLE=%s NCCL_SHM_DISABLE=%s NCCL_SOCKET_IFNAME=%s "
         "NCCL_HOSTID=%s-<rank>\n", net.c_str(), env_or("NCCL_NET_PLUGIN", "(unset)").c_str(), p2p.c_str(), shm.c_str(),
         ifname.c_str(), hostid.c_str());
  printf("# LGRECO_NET=%s LGRECO_SOCKET_IFNAME=%s\n", env_or("LGRECO_NET", "(unset)").c_str(),
         env_or("LGRECO_SOCKET_IFNAME", "(unset)").c_str());
  printf("# per size: 1 checked call, %d warm-up, %d timed (CUDA events; time = the slowest rank's median); seed %llu;"
         " bound R * 2^-24 * sum|x|\n", o.warmup, o.iters, static_cast<unsigned long long>(o.seed));
  printf("#%12s %12s %8s %6s %11s %9s %9s %8s %13s\n", "size", "count", "type", "redop", "time(us)", "algbw", "busbw",
         "#wrong", "max_err/bound");
  fflush(stdout);
  fflush(stderr);

  // Pipes: rank 0 -> rank r (the unique id), rank r -> parent (stages and rows).
  std::vector<int> id_pipe_read(o.ranks, -1), id_pipe_write(o.ranks, -1);
  std::vector<RankState> ranks(o.ranks);
  std::vector<int> report_write(o.ranks, -1);
  for (int r = 0; r < o.ranks; ++r) {
    int fds[2];
    if (r > 0) {
      if (pipe(fds) != 0) throw std::runtime_error(strf("pipe: %s", strerror(errno)));
      id_pipe_read[r] = fds[0];
      id_pipe_write[r] = fds[1];
    }
    if (pipe(fds) != 0) throw std::runtime_error(strf("pipe: %s", strerror(errno)));
    ranks[r].report_fd = fds[0];
    report_write[r] = fds[1];
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  }
  const pid_t parent = getpid();
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      for (int k = 0; k < r; ++k) kill(ranks[k].pid, SIGKILL);
      throw std::runtime_error(strf("fork: %s", strerror(errno)));
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // the watchdog may be killed itself
      if (getppid() != parent) _exit(kExitFailed);
      // Only this rank's ends stay open: rank 0 holds the id pipes' write ends, rank r
      // its read end; each rank its report pipe's write end.
      for (int k = 0; k < o.ranks; ++k) {
        close(ranks[k].report_fd);
        if (k != r) close(report_write[k]);
        if (id_pipe_read[k] >= 0 && k != r) close(id_pipe_read[k]);
        if (id_pipe_write[k] >= 0 && r != 0) close(id_pipe_write[k]);
      }
      setenv("NCCL_HOSTID", strf("%s-%d", hostid.c_str(), r).c_str(), 1);
      int code = 0;
      try {
        std::vector<int> writes;
        if (r == 0)
          for (int k = 1; k < o.ranks; ++k) writes.push_back(id_pipe_write[k]);
        Rank(o, api, r, report_write[r], deadline - 5).run(id_pipe_read[r], writes);
      } catch (const std::exception& e) {
        fprintf(stderr, "%s: rank %d: error: %s\n", kProgram, r, e.what());
        code = kExitFailed;
      }
      fflush(stdout);
      fflush(stderr);
      _exit(code);
    }
    ranks[r].pid = pid;
  }
  for (int r = 0; r < o.ranks; ++r) {
    close(report_write[r]);
    if (id_pipe_read[r] >= 0) close(id_pipe_read[r]);
    if (id_pipe_write[r] >= 0) close(id_pipe_write[r]);
  }

  // Watch: read reports, print each row once every rank has sent it, end everything when
  // a rank fails or the deadline passes.
  size_t printed = 0;
  uint64_t total_wrong = 0;
  std::vector<uint64_t> differing;  // sizes where the ranks' outputs are not bit-identical
  std::string failure;
  bool timed_out = false;
  auto kill_all = [&] {
    for (auto& s : ranks)
      if (!s.exited) kill(s.pid, SIGKILL);
  };
  auto drain = [&](RankState& s) {
    char chunk[4096];
    for (;;) {
      const ssize_t n = read(s.report_fd, chunk, sizeof chunk);
      if (n == 0) s.eof = true;  // the rank has closed its end: poll would report it for ever
      if (n <= 0) break;
      s.buffer.append(chunk, static_cast<size_t>(n));
    }
    size_t nl;
    while ((nl = s.buffer.find('\n')) != std::string::npos) {
      const std::string line = s.buffer.substr(0, nl);
      s.buffer.erase(0, nl + 1);
      if (line.rfind("STAGE ", 0) == 0) {
        s.stage = line.substr(6);
      } else if (line == "DONE") {
        s.done = true;
        s.stage = "done";
      } else if (line.rfind("ROW ", 0) == 0) {
        std::vector<std::string> fields;
        size_t at = 4;
        while (at < line.size()) {
          const size_t sp = line.find(' ', at);
          fields.push_back(line.substr(at, sp == std::string::npos ? std::string::npos : sp - at));
          if (sp == std::string::npos) break;
          at = sp + 1;
        }
        if (fields.size() == 5) s.rows[std::stoull(fields[0])] = fields;
      }
    }
  };
  auto print_ready_rows = [&] {
    while (printed < sizes.size()) {
      const uint64_t bytes = sizes[printed];
      for (const auto& s : ranks)
        if (!s.rows.count(bytes)) return;
      double seconds = 0, ratio = 0;
      uint64_t wrong = 0;
      bool same = true;
      for (const auto& s : ranks) {
        const auto& f = s.rows.at(bytes);
        seconds = std::max(seconds, std::stod(f[1]) * 1e-6);
        wrong += std::stoull(f[2]);
        ratio = std::max(ratio, std::stod(f[3]));
        same = same && f[4] == ranks[0].rows.at(bytes)[4];
      }
      if (!same) differing.push_back(bytes);
      total_wrong += wrong;
      const double algbw = static_cast<double>(bytes) / seconds / 1e9;
      const double busbw = algbw * 2.0 * (o.ranks - 1) / o.ranks;
      printf(" %12llu %12llu %8s %6s %11.1f %9.3f %9.3f %8llu %13.3g\n", static_cast<unsigned long long>(bytes),
             static_cast<unsigned long long>(bytes / 4), "float", "sum", seconds * 1e6, algbw, busbw,
             static_cast<unsigned long long>(wrong), ratio);
      fflush(stdout);
      ++printed;
    }
  };

  size_t running = ranks.size();
  while (running > 0) {
    std::vector<pollfd> fds;
    for (const auto& s : ranks) fds.push_back(pollfd{s.eof ? -1 : s.report_fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (auto& s : ranks) drain(s);
    print_ready_rows();
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (int r = 0; r < o.ranks; ++r) {
        RankState& s = ranks[r];
        if (s.pid != pid) continue;
        s.exited = true;
        s.status = status;
        --running;
        drain(s);
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && s.done;
        if (!ok && failure.empty() && !timed_out) {
          failure = WIFSIGNALED(status) ? strf("rank %d was killed by signal %d (%s) during: %s", r, WTERMSIG(status),
                                               strsignal(WTERMSIG(status)), s.stage.c_str())
                                        : strf("rank %d exited with status %d during: %s", r,
                                               WIFEXITED(status) ? WEXITSTATUS(status) : -1, s.stage.c_str());
          // Its peers may wait inside NCCL for ever: end them.
          kill_all();
        }
      }
    }
    if (running > 0 && !timed_out && cli::seconds_now() > deadline) {
      timed_out = true;
      std::string where;
      for (int r = 0; r < o.ranks; ++r)
        if (!ranks[r].exited) where += strf("%srank %d: %s", where.empty() ? "" : "; ", r, ranks[r].stage.c_str());
      fprintf(stderr, "%s: watchdog: still running after --timeout %d s, ending every rank (%s)\n", kProgram,
              o.timeout_s, where.c_str());
      kill_all();
    }
  }
  for (auto& s : ranks) {
    drain(s);
    close(s.report_fd);
  }
  print_ready_rows();

  printf("# Out of bounds values : %llu %s\n", static_cast<unsigned long long>(total_wrong),
         total_wrong == 0 && printed == sizes.size() ? "OK" : "FAILED");
  if (printed > 0) {
    if (differing.empty()) {
      printf("# ranks' outputs bit-identical at every size\n");
    } else {
      std::string list;
      for (uint64_t b : differing) list += strf(" %llu", static_cast<unsigned long long>(b));
      printf("# ranks' outputs differ at sizes:%s\n", list.c_str());
    }
  }
  printf("# %zu of %zu sizes done in %.1f s\n", printed, sizes.size(), cli::seconds_now() - start);
  fflush(stdout);
  if (timed_out) {
    fprintf(stderr, "%s: error: the watchdog ended the run after %d s (%zu of %zu sizes done)\n", kProgram, o.timeout_s,
            printed, sizes.size());
    return kExitTimeout;
  }
  if (!failure.empty()) {
    fprintf(stderr, "%s: error: %s\n", kProgram, failure.c_str());
    return kExitFailed;
  }
  if (printed != sizes.size()) {
    fprintf(stderr, "%s: error: only %zu of %zu sizes were reported\n", kProgram, printed, sizes.size());
    return kExitFailed;
  }
  return total_wrong == 0 ? 0 : kExitFailed;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main(lgreco::kProgram, [&] {
    const lgreco::Options o = lgreco::parse(argc, argv);
    try {
      return lgreco::run(o);
    } catch (const lgreco::NoDevice&) {
      return lgreco::kExitUsage;
    }
  });
}
