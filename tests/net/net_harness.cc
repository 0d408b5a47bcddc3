// lgreco-net-harness: drives a NCCL net plugin library the way NCCL's proxy does, with
// host memory only, so that the plugin's ABI tables can be checked without a GPU or NCCL.
//
// Two processes, a receiver and a sender, play the two proxies of one NCCL connection
// (src/transport/net.cc at v2.28.9-1):
//   receiver: dlopen(lib, RTLD_NOW|RTLD_LOCAL), dlsym("ncclNetPlugin_vN"), init, devices,
//             getProperties (checked), listen -> the 128-byte handle goes to a file
//             (written to FILE.tmp, then renamed, so the sender never reads half of it);
//             accept() again and again until it returns a comm; closeListen.
//   sender:   the same up to getProperties; waits for the handle file; connect() again
//             and again (same handle buffer, as NCCL) until it returns a comm.
//   both:     regMr of host buffers, then the cases named by --cases, in the same order
//             on both sides over the one connection; deregMr, closeSend/closeRecv,
//             finalize (v11).
//
// Data: every message is a counter-based hash stream of (seed, case, message index), so
// each side regenerates it alone. Receive buffers are poisoned first; after a receive,
// every byte of the message is compared, the bytes after it (up to the posted capacity
// and a guard) must still be poison, and the sizes test() reports must be the message
// sizes, with the entries of the sizes array past n left alone.
//
// Every plugin call is timed: NCCL's proxy thread serves every connection of a process,
// so one call that blocks (connect/accept/test) stalls them all; a call longer than
// --max-call-ms fails the case that made it. Every wait has a deadline (--case-timeout-s),
// and the whole process ends itself with exit code 124 after --timeout-s.
//
// Output: one line per case, then one summary line:
//   net-harness: role=recv api=v11 case=sizes result=PASS messages=52 bytes=... ms=... detail="..."
//   net-harness: role=recv api=v11 result=PASS cases=4 failed=0
// Exit codes: 0 every case passed; 1 a case failed; 2 usage; 3 setup failed (dlopen,
// init, devices, properties, listen, connect); 4 accept() returned an error (the fault
// tests tell this apart from a hang); 124 the process timed out.
//
// Fault roles: case `killed-sender` (the sender raises SIGKILL on itself while a 512 MiB
// message is in flight; the receiver must get an error from test()) and case
// `expect-error` (receiver only: one receive of --expect-capacity bytes with tag
// --expect-tag; whatever connects must make test() fail: the suite's raw client sends a
// message header with a size that does not fit).
//
// Needs nothing of lgreco but plugin/net/net_abi.h (the ABI structs).
#include <dlfcn.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plugin/net/net_abi.h"

namespace {

namespace abi = lgreco::net::abi;
using Clock = std::chrono::steady_clock;
using Result = abi::Result;
constexpr Result kOk = lgreco::nccl::kSuccess;

constexpr int kExitFailed = 1, kExitUsage = 2, kExitSetup = 3, kExitAcceptError = 4, kExitTimeout = 124;
// NCCL_NET_OPTIONAL_RECV_COMPLETION: NCCL 2.28 presets *request to this before a single
// LL/LL128 irecv (v11 only; its adapters for older versions reset it to NULL).
void* const kOptionalRecvCompletion = reinterpret_cast<void*>(0x1);
constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 64;         // poisoned bytes after each receive's capacity
constexpr int kSizesCanary = -12345;  // entries of test()'s sizes array past n

// ------------------------------------------------------------------------------------
// Options

struct Options {
  std::string role;  // recv | send
  std::string lib;
  std::string handle_file;
  std::string api = "v11";
  std::vector<std::string> cases;
  uint64_t comm_id = 0;
  uint64_t seed = 0;
  int dev = 0;
  double timeout_s = 150;
  double case_timeout_s = 60;
  double connect_timeout_s = 30;
  double max_call_ms = 3000;
  uint64_t expect_capacity = 4096;
  int expect_tag = 7;
  // Buffers per grouped receive in the grouped and interleaved cases; 0: the plugin's
  // maxRecvs. More than maxRecvs drives a capability the plugin has and does not
  // advertise (NCCL would never post such a receive).
  int group_buffers = 0;
  int verbose = 0;
};
Options g_opt;
const char* g_role = "?";

// ------------------------------------------------------------------------------------
// The logger NCCL would pass: NCCL-style lines, counting WARNs.

std::atomic<int> g_warns{0};
std::string g_host;

extern "C" void harness_logger(int level, unsigned long /*flags*/, const char* file, int line, const char* fmt,
                               ...) {
  if (level == abi::kLogWarn) ++g_warns;
  const bool show = level == abi::kLogWarn || level == abi::kLogAbort || level == abi::kLogVersion ||
                    (level == abi::kLogInfo && g_opt.verbose >= 1) || (level == abi::kLogTrace && g_opt.verbose >= 2);
  if (!show) return;
  char message[2048];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof message, fmt ? fmt : "(null format)", args);
  va_end(args);
  const char* name = level == abi::kLogWarn    ? "WARN"
                     : level == abi::kLogInfo  ? "INFO"
                     : level == abi::kLogTrace ? "TRACE"
                     : level == abi::kLogAbort ? "ABORT"
                                               : "VERSION";
  const long tid = syscall(SYS_gettid);
  if (level == abi::kLogWarn)
    fprintf(stderr, "%s:%d:%ld [harness-%s] %s:%d NCCL %s %s\n", g_host.c_str(), getpid(), tid, g_role,
            file ? file : "?", line, name, message);
  else
    fprintf(stderr, "%s:%d:%ld [harness-%s] NCCL %s %s\n", g_host.c_str(), getpid(), tid, g_role, name, message);
}

// ------------------------------------------------------------------------------------
// Failures and deadlines

// Thrown by a case on the first thing that went wrong; the message is the case's detail.
struct CaseFailure {
  std::string what;
};
[[noreturn]] void fail(const std::string& what) { throw CaseFailure{what}; }

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

const char* result_name(Result r) {
  switch (static_cast<int>(r)) {
    case 0: return "ncclSuccess";
    case 1: return "ncclUnhandledCudaError";
    case 2: return "ncclSystemError";
    case 3: return "ncclInternalError";
    case 4: return "ncclInvalidArgument";
    case 5: return "ncclInvalidUsage";
    case 6: return "ncclRemoteError";
    case 7: return "ncclInProgress";
  }
  return "(unknown result)";
}
std::string result_text(Result r) { return format("%d (%s)", static_cast<int>(r), result_name(r)); }

struct Deadline {
  Clock::time_point at;
  explicit Deadline(double seconds)
      : at(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds))) {}
  bool passed() const { return Clock::now() >= at; }
};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A short pause between polls that found nothing to do (as NCCL's proxy would yield).
void idle() { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

// ------------------------------------------------------------------------------------
// Timing of plugin calls: the slowest call of the current case.

struct CallTimes {
  double worst_ms = 0;
  std::string worst_call;
  void reset() { worst_ms = 0, worst_call.clear(); }
};
CallTimes g_calls;

template <typename F>
Result timed(const char* call, F&& f) {
  const auto t0 = Clock::now();
  const Result r = f();
  const double ms = ms_since(t0);
  if (ms > g_calls.worst_ms) g_calls.worst_ms = ms, g_calls.worst_call = call;
  return r;
}

// ------------------------------------------------------------------------------------
// The plugin through one of its versioned tables, with v11's types.

struct Props {
  std::string name, pci_path;
  uint64_t guid = 0;
  int ptr_support = 0, reg_is_global = 0, force_flush = 0, speed = 0, port = 0, max_comms = 0, max_recvs = 0;
  float latency = 0;
  int device_type = 0, device_version = 0;
  int vdevs = -1;  // -1: not in this version
  int vdev0 = -1;
  size_t max_p2p_bytes = 0, max_coll_bytes = 0;  // 0: not in this version
  int max_multi_request_size = -1;
};

class Plugin {
 public:
  Plugin(void* table, int version) : version_(version) {
    switch (version) {
      case 11: v11_ = static_cast<const abi::Net_v11*>(table); break;
      case 10: v10_ = static_cast<const abi::Net_v10*>(table); break;
      case 9: v9_ = static_cast<const abi::Net_v9*>(table); break;
      default: v8_ = static_cast<const abi::Net_v8*>(table); break;
    }
  }
  int version() const { return version_; }
  const char* name() const {
    return v11_ ? v11_->name : v10_ ? v10_->name : v9_ ? v9_->name : v8_->name;
  }
  // The table's function pointers that NCCL calls unconditionally.
  std::string missing_functions() const {
    std::string missing;
    auto need = [&](const void* f, const char* n) {
      if (!f) missing += std::string(missing.empty() ? "" : ", ") + n;
    };
#define LGRECO_NEED(T)                                                                                         \
  need(reinterpret_cast<const void*>(T->init), "init");                                                        \
  need(reinterpret_cast<const void*>(T->devices), "devices");                                                  \
  need(reinterpret_cast<const void*>(T->getProperties), "getProperties");                                      \
  need(reinterpret_cast<const void*>(T->listen), "listen");                                                    \
  need(reinterpret_cast<const void*>(T->connect), "connect");                                                  \
  need(reinterpret_cast<const void*>(T->accept), "accept");                                                    \
  need(reinterpret_cast<const void*>(T->regMr), "regMr");                                                      \
  need(reinterpret_cast<const void*>(T->deregMr), "deregMr");                                                  \
  need(reinterpret_cast<const void*>(T->isend), "isend");                                                      \
  need(reinterpret_cast<const void*>(T->irecv), "irecv");                                                      \
  need(reinterpret_cast<const void*>(T->test), "test");                                                        \
  need(reinterpret_cast<const void*>(T->closeSend), "closeSend");                                              \
  need(reinterpret_cast<const void*>(T->closeRecv), "closeRecv");                                              \
  need(reinterpret_cast<const void*>(T->closeListen), "closeListen");
    if (v11_) {
      LGRECO_NEED(v11_)
      need(reinterpret_cast<const void*>(v11_->finalize), "finalize");
    } else if (v10_) {
      LGRECO_NEED(v10_)
    } else if (v9_) {
      LGRECO_NEED(v9_)
    } else {
      LGRECO_NEED(v8_)
    }
#undef LGRECO_NEED
    return missing;
  }

  Result init(uint64_t comm_id) {
    if (v11_) {
      abi::CommConfig config{abi::kTrafficClassUndef};
      return timed("init", [&] { return v11_->init(&ctx_, comm_id, &config, harness_logger, nullptr); });
    }
    if (v10_) return timed("init", [&] { return v10_->init(harness_logger, nullptr); });
    if (v9_) return timed("init", [&] { return v9_->init(harness_logger); });
    return timed("init", [&] { return v8_->init(harness_logger); });
  }
  Result finalize() {
    if (!v11_) return kOk;
    return timed("finalize", [&] { return v11_->finalize(ctx_); });
  }
  Result devices(int* n) {
    return timed("devices", [&] {
      return v11_ ? v11_->devices(n) : v10_ ? v10_->devices(n) : v9_ ? v9_->devices(n) : v8_->devices(n);
    });
  }
  Result properties(int dev, Props* out) {
    auto str = [](const char* s) { return s ? std::string(s) : std::string("(null)"); };
    auto common = [&](const auto& p) {
      out->name = str(p.name), out->pci_path = str(p.pciPath), out->guid = p.guid;
      out->ptr_support = p.ptrSupport, out->reg_is_global = p.regIsGlobal, out->speed = p.speed;
      out->port = p.port, out->latency = p.latency, out->max_comms = p.maxComms, out->max_recvs = p.maxRecvs;
      out->device_type = p.netDeviceType, out->device_version = p.netDeviceVersion;
    };
    auto newer = [&](const auto& p) {
      out->force_flush = p.forceFlush, out->vdevs = p.vProps.ndevs, out->vdev0 = p.vProps.devs[0];
      out->max_p2p_bytes = p.maxP2pBytes, out->max_coll_bytes = p.maxCollBytes;
    };
    if (v11_) {
      abi::Properties_v11 p;
      std::memset(&p, 0xEE, sizeof p);  // fields the plugin forgets show up as garbage
      const Result r = timed("getProperties", [&] { return v11_->getProperties(dev, &p); });
      if (r == kOk) common(p), newer(p), out->max_multi_request_size = p.maxMultiRequestSize;
      return r;
    }
    if (v10_ || v9_) {
      abi::Properties_v9 p;
      std::memset(&p, 0xEE, sizeof p);
      const Result r = timed("getProperties",
                             [&] { return v10_ ? v10_->getProperties(dev, &p) : v9_->getProperties(dev, &p); });
      if (r == kOk) common(p), newer(p);
      return r;
    }
    abi::Properties_v8 p;
    std::memset(&p, 0xEE, sizeof p);
    const Result r = timed("getProperties", [&] { return v8_->getProperties(dev, &p); });
    if (r == kOk) common(p);
    return r;
  }
  Result listen(int dev, void* handle, void** listen_comm) {
    return timed("listen", [&] {
      return v11_   ? v11_->listen(ctx_, dev, handle, listen_comm)
             : v10_ ? v10_->listen(dev, handle, listen_comm)
             : v9_  ? v9_->listen(dev, handle, listen_comm)
                    : v8_->listen(dev, handle, listen_comm);
    });
  }
  Result connect(int dev, void* handle, void** send_comm, abi::DeviceHandle** dev_handle) {
    abi::CommConfig config{abi::kTrafficClassUndef};
    return timed("connect", [&] {
      return v11_   ? v11_->connect(ctx_, dev, handle, send_comm, dev_handle)
             : v10_ ? v10_->connect(dev, &config, handle, send_comm, dev_handle)
             : v9_  ? v9_->connect(dev, handle, send_comm, dev_handle)
                    : v8_->connect(dev, handle, send_comm, dev_handle);
    });
  }
  Result accept(void* listen_comm, void** recv_comm, abi::DeviceHandle** dev_handle) {
    return timed("accept", [&] {
      return v11_   ? v11_->accept(listen_comm, recv_comm, dev_handle)
             : v10_ ? v10_->accept(listen_comm, recv_comm, dev_handle)
             : v9_  ? v9_->accept(listen_comm, recv_comm, dev_handle)
                    : v8_->accept(listen_comm, recv_comm, dev_handle);
    });
  }
  Result reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
    return timed("regMr", [&] {
      return v11_   ? v11_->regMr(comm, data, size, type, mhandle)
             : v10_ ? v10_->regMr(comm, data, size, type, mhandle)
             : v9_  ? v9_->regMr(comm, data, size, type, mhandle)
                    : v8_->regMr(comm, data, size, type, mhandle);
    });
  }
  Result dereg_mr(void* comm, void* mhandle) {
    return timed("deregMr", [&] {
      return v11_   ? v11_->deregMr(comm, mhandle)
             : v10_ ? v10_->deregMr(comm, mhandle)
             : v9_  ? v9_->deregMr(comm, mhandle)
                    : v8_->deregMr(comm, mhandle);
    });
  }
  Result isend(void* comm, void* data, size_t size, int tag, void* mhandle, void** request) {
    static int phandle_dummy;  // NCCL passes a profiler handle slot; never read by a plain plugin
    return timed("isend", [&] {
      if (v11_) return v11_->isend(comm, data, size, tag, mhandle, &phandle_dummy, request);
      if (v10_) return v10_->isend(comm, data, size, tag, mhandle, &phandle_dummy, request);
      if (v9_) return v9_->isend(comm, data, size, tag, mhandle, request);
      if (size > INT32_MAX) fail(format("a %zu-byte message does not fit v8's int size", size));
      return v8_->isend(comm, data, static_cast<int>(size), tag, mhandle, request);
    });
  }
  Result irecv(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request) {
    void* phandles[abi::kMaxRequests];
    static int phandle_dummy;
    for (int i = 0; i < n && i < abi::kMaxRequests; ++i) phandles[i] = &phandle_dummy;
    return timed("irecv", [&] {
      if (v11_) return v11_->irecv(comm, n, data, sizes, tags, mhandles, phandles, request);
      if (v10_) return v10_->irecv(comm, n, data, sizes, tags, mhandles, phandles, request);
      if (v9_) return v9_->irecv(comm, n, data, sizes, tags, mhandles, request);
      int int_sizes[abi::kMaxRequests];
      for (int i = 0; i < n; ++i) {
        if (sizes[i] > INT32_MAX) fail(format("a %zu-byte receive does not fit v8's int size", sizes[i]));
        int_sizes[i] = static_cast<int>(sizes[i]);
      }
      return v8_->irecv(comm, n, data, int_sizes, tags, mhandles, request);
    });
  }
  Result test(void* request, int* done, int* sizes) {
    return timed("test", [&] {
      return v11_   ? v11_->test(request, done, sizes)
             : v10_ ? v10_->test(request, done, sizes)
             : v9_  ? v9_->test(request, done, sizes)
                    : v8_->test(request, done, sizes);
    });
  }
  Result close_send(void* c) {
    return timed("closeSend", [&] {
      return v11_ ? v11_->closeSend(c) : v10_ ? v10_->closeSend(c) : v9_ ? v9_->closeSend(c) : v8_->closeSend(c);
    });
  }
  Result close_recv(void* c) {
    return timed("closeRecv", [&] {
      return v11_ ? v11_->closeRecv(c) : v10_ ? v10_->closeRecv(c) : v9_ ? v9_->closeRecv(c) : v8_->closeRecv(c);
    });
  }
  Result close_listen(void* c) {
    return timed("closeListen", [&] {
      return v11_   ? v11_->closeListen(c)
             : v10_ ? v10_->closeListen(c)
             : v9_  ? v9_->closeListen(c)
                    : v8_->closeListen(c);
    });
  }

 private:
  int version_;
  const abi::Net_v11* v11_ = nullptr;
  const abi::Net_v10* v10_ = nullptr;
  const abi::Net_v9* v9_ = nullptr;
  const abi::Net_v8* v8_ = nullptr;
  void* ctx_ = nullptr;
};

// ------------------------------------------------------------------------------------
// Data: a stream both sides can regenerate.

uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t message_key(int case_no, uint64_t index) {
  return mix64(g_opt.seed ^ mix64((static_cast<uint64_t>(case_no) << 48) ^ index));
}
void fill(uint8_t* p, size_t n, uint64_t key) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = mix64(key + i);
    std::memcpy(p + i, &w, 8);
  }
  if (i < n) {
    const uint64_t w = mix64(key + i);
    std::memcpy(p + i, &w, n - i);
  }
}
// The offset of the first byte of p[0, n) that differs from the stream, or n.
size_t first_mismatch(const uint8_t* p, size_t n, uint64_t key) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = mix64(key + i);
    if (std::memcmp(p + i, &w, 8) != 0) break;
  }
  if (i >= n) return n;
  uint8_t expected[8];
  const uint64_t w = mix64(key + i);
  std::memcpy(expected, &w, 8);
  for (size_t j = 0; j < 8 && i + j < n; ++j)
    if (p[i + j] != expected[j]) return i + j;
  return n;
}
uint8_t expected_byte(uint64_t key, size_t at) {
  const uint64_t w = mix64(key + (at & ~size_t{7}));
  return static_cast<uint8_t>(w >> (8 * (at & 7)));
}
// The first byte of p[0, n) that is not poison, or n.
size_t first_unpoisoned(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != kPoison) return i;
  return n;
}

// Page-aligned host memory (NCCL's host buffers are cudaHostAlloc'd, page aligned).
struct HostBuffer {
  uint8_t* data = nullptr;
  size_t size = 0;
  explicit HostBuffer(size_t n) : size(n) {
    if (posix_memalign(reinterpret_cast<void**>(&data), 4096, std::max<size_t>(n, 1)) != 0)
      fail(format("cannot allocate %zu bytes of host memory", n));
  }
  ~HostBuffer() { free(data); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
};

// ------------------------------------------------------------------------------------
// One side of the connection, and the helpers every case uses.

struct Side {
  Plugin* plugin = nullptr;
  Props props;
  void* comm = nullptr;  // send or receive comm
  bool recv = false;
  Deadline deadline{0};
  uint64_t messages = 0, bytes = 0;
  std::string notes;  // facts worth a line (how many requests the plugin took at once, ...)
};

// A registered region, deregistered when the case ends.
struct Registration {
  Side& side;
  void* mhandle = nullptr;
  Registration(Side& s, HostBuffer& buffer) : side(s) {
    const Result r = s.plugin->reg_mr(s.comm, buffer.data, buffer.size, abi::kPtrHost, &mhandle);
    if (r != kOk)
      fail(format("regMr(NCCL_PTR_HOST, %zu bytes) returned %s", buffer.size, result_text(r).c_str()));
  }
  ~Registration() {
    const Result r = side.plugin->dereg_mr(side.comm, mhandle);
    if (r != kOk)
      fprintf(stderr, "net-harness: deregMr returned %s (reported by the case summary as a note)\n",
              result_text(r).c_str()),
          side.notes += " deregMr-failed";
  }
};

// Posts one send, retrying while the plugin is busy (request NULL), as NCCL does.
void* post_send(Side& s, void* data, size_t size, int tag, void* mhandle, const std::string& what) {
  for (;;) {
    void* request = nullptr;
    const Result r = s.plugin->isend(s.comm, data, size, tag, mhandle, &request);
    if (r != kOk) fail(format("isend of %s returned %s", what.c_str(), result_text(r).c_str()));
    if (request) return request;
    if (s.deadline.passed()) fail("isend of " + what + " kept returning a NULL request (busy) until the deadline");
    idle();
  }
}

// Posts one receive of n buffers, retrying while busy. `preset` is what *request holds
// before the call (NCCL: NULL, or NCCL_NET_OPTIONAL_RECV_COMPLETION).
void* post_recv(Side& s, int n, void** data, size_t* sizes, int* tags, void** mhandles, const std::string& what,
                void* preset = nullptr) {
  for (;;) {
    void* request = preset;
    const Result r = s.plugin->irecv(s.comm, n, data, sizes, tags, mhandles, &request);
    if (r != kOk) fail(format("irecv of %s returned %s", what.c_str(), result_text(r).c_str()));
    if (request == kOptionalRecvCompletion)
      fail("irecv of " + what +
           " returned with *request still NCCL_NET_OPTIONAL_RECV_COMPLETION (0x1): NCCL takes any non-NULL value as "
           "a posted request and would call test(0x1); the plugin must set *request (NULL when busy)");
    if (request) return request;
    if (s.deadline.passed()) fail("irecv of " + what + " kept returning a NULL request (busy) until the deadline");
    idle();
  }
}

// One test() call. *sizes gets n entries; entries past n must keep their canary.
bool test_once(Side& s, void* request, int n, int* sizes, const std::string& what) {
  int done = -1;
  int buf[abi::kMaxRequests + 4];
  for (int& v : buf) v = kSizesCanary;
  const Result r = s.plugin->test(request, &done, buf);
  if (r != kOk) fail(format("test() of %s returned %s", what.c_str(), result_text(r).c_str()));
  if (done != 0 && done != 1) fail(format("test() of %s set *done to %d (expected 0 or 1)", what.c_str(), done));
  for (int i = n; i < n + 4; ++i)
    if (buf[i] != kSizesCanary)
      fail(format("test() of %s wrote sizes[%d] = %d, past the %d entries of the request", what.c_str(), i, buf[i],
                  n));
  if (done) std::copy(buf, buf + n, sizes);
  return done == 1;
}

void wait_done(Side& s, void* request, int n, int* sizes, const std::string& what) {
  while (!test_once(s, request, n, sizes, what)) {
    if (s.deadline.passed()) fail("test() of " + what + " never reported done before the deadline (--case-timeout-s)");
    idle();
  }
}

// Checks a received buffer: the message bytes, its size, and poison after it.
void check_received(const uint8_t* buf, size_t capacity, size_t size, int reported, uint64_t key,
                    const std::string& what) {
  if (reported != static_cast<int>(size))
    fail(format("test() reported %d bytes for %s; %zu were sent", reported, what.c_str(), size));
  const size_t bad = first_mismatch(buf, size, key);
  if (bad != size)
    fail(format("%s: byte %zu of %zu is 0x%02x, expected 0x%02x (poison is 0x%02x)", what.c_str(), bad, size,
                buf[bad], expected_byte(key, bad), kPoison));
  const size_t tail = capacity - size + kGuard;
  const size_t written = first_unpoisoned(buf + size, tail);
  if (written != tail)
    fail(format("%s: byte %zu after the %zu-byte message (capacity %zu) was overwritten (0x%02x)", what.c_str(),
                written, size, capacity, buf[size + written]));
}

// ------------------------------------------------------------------------------------
// Cases. Each is run with the same number on both sides; the data of message i of case c
// is message_key(c, i).

enum CaseNo : int { kSizes = 1, kInflight, kGrouped, kInterleaved, kLarge, kSmall, kKilled, kExpectError };

// Messages one at a time: 0 bytes, powers of 2 up to 64 MiB, odd sizes, from unaligned
// offsets into buffers larger than the message (and some exactly the message's size).
std::vector<size_t> sizes_list(bool small) {
  std::vector<size_t> sizes{0};
  const int max_log = small ? 16 : 26;
  for (int b = 0; b <= max_log; ++b) sizes.push_back(size_t{1} << b);
  const size_t odd[] = {3, 5, 7, 13, 127, 1000, 4095, 4097, 65535, 65537, 131071, 1000003, 8388607, 33554433,
                        67108863};
  for (size_t v : odd)
    if (v <= (size_t{1} << max_log)) sizes.push_back(v);
  std::mt19937_64 rng(mix64(g_opt.seed ^ 0x51235ull));
  for (int i = 0; i < 4; ++i) sizes.push_back(rng() % (small ? 65536 : (1u << 20)));
  return sizes;
}

void case_sizes(Side& s, int case_no, bool small) {
  const std::vector<size_t> sizes = sizes_list(small);
  const size_t max_size = *std::max_element(sizes.begin(), sizes.end());
  constexpr size_t kSlack = 4096;
  HostBuffer buffer(max_size + 16 + kSlack + kGuard);
  Registration reg(s, buffer);
  std::mt19937_64 rng(mix64(g_opt.seed ^ 0x5175ull));
  // Receives posted with NCCL_NET_OPTIONAL_RECV_COMPLETION may complete before their data
  // lands; they are checked at the end of the case, after later messages completed.
  struct Deferred {
    size_t index, offset, capacity, size;
    int reported;
  };
  std::vector<Deferred> deferred;
  std::vector<std::unique_ptr<HostBuffer>> deferred_buffers;
  std::vector<std::unique_ptr<Registration>> deferred_regs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t size = sizes[i];
    const size_t offset = i % 11;  // unaligned starts, as NCCL's offsets into its buffers can be
    const size_t capacity = size + (i % 3 == 0 ? 0 : rng() % kSlack);
    const int tag = static_cast<int>(i % 4);
    const uint64_t key = message_key(case_no, i);
    const std::string what = format("message %zu (%zu bytes, tag %d)", i, size, tag);
    if (!s.recv) {
      fill(buffer.data + offset, size, key);
      void* request = post_send(s, buffer.data + offset, size, tag, reg.mhandle, what);
      int reported = kSizesCanary;
      wait_done(s, request, 1, &reported, what);
      if (reported != static_cast<int>(size))
        fail(format("test() of the send of %s reported %d bytes", what.c_str(), reported));
    } else {
      const bool optional = s.plugin->version() == 11 && i % 4 == 1;
      // The optional-completion receives get their own buffer, so that it stays untouched
      // until it is checked.
      uint8_t* base = buffer.data;
      void* mhandle = reg.mhandle;
      if (optional) {
        deferred_buffers.push_back(std::make_unique<HostBuffer>(offset + capacity + kGuard));
        deferred_regs.push_back(std::make_unique<Registration>(s, *deferred_buffers.back()));
        base = deferred_buffers.back()->data;
        mhandle = deferred_regs.back()->mhandle;
      }
      std::memset(base, kPoison, offset + capacity + kGuard);
      void* data = base + offset;
      size_t cap = capacity;
      int tags[1] = {tag};
      void* request = post_recv(s, 1, &data, &cap, tags, &mhandle, what, optional ? kOptionalRecvCompletion : nullptr);
      int reported = kSizesCanary;
      wait_done(s, request, 1, &reported, what);
      if (optional)
        deferred.push_back(Deferred{i, offset, capacity, size, reported});
      else
        check_received(base + offset, capacity, size, reported, key, what);
    }
    ++s.messages, s.bytes += size;
  }
  for (size_t d = 0; d < deferred.size(); ++d) {
    const Deferred& m = deferred[d];
    check_received(deferred_buffers[d]->data + m.offset, m.capacity, m.size, m.reported, message_key(case_no, m.index),
                   format("message %zu (%zu bytes, posted with NCCL_NET_OPTIONAL_RECV_COMPLETION)", m.index, m.size));
  }
  deferred_regs.clear();
}

// Many requests at once: post until the plugin says busy (request NULL), test the ones in
// flight newest first (NCCL tests sub by sub, not in posting order), post again.
void case_inflight(Side& s, int case_no) {
  constexpr int kMessages = 96;
  constexpr size_t kMax = 256 * 1024;
  std::mt19937_64 rng(mix64(g_opt.seed ^ 0x1f1177ull));
  std::vector<size_t> size(kMessages), capacity(kMessages);
  std::vector<int> tag(kMessages);
  for (int i = 0; i < kMessages; ++i) {
    size[i] = i % 10 == 0 ? 0 : rng() % kMax;
    capacity[i] = size[i] + rng() % 512;
    tag[i] = static_cast<int>(rng() % 1000);
  }
  const size_t stride = kMax + 512 + kGuard;
  HostBuffer buffer(stride * kMessages);
  Registration reg(s, buffer);
  std::vector<void*> request(kMessages, nullptr);
  int next = 0, completed = 0, in_flight = 0, max_in_flight = 0, busy_answers = 0;
  while (completed < kMessages) {
    // Post until busy.
    while (next < kMessages) {
      uint8_t* at = buffer.data + stride * next;
      const std::string what = format("message %d (%zu bytes, tag %d)", next, size[next], tag[next]);
      void* r = nullptr;
      Result rc;
      if (!s.recv) {
        fill(at, size[next], message_key(case_no, next));
        rc = s.plugin->isend(s.comm, at, size[next], tag[next], reg.mhandle, &r);
      } else {
        std::memset(at, kPoison, capacity[next] + kGuard);
        void* data = at;
        size_t cap = capacity[next];
        int t = tag[next];
        void* mh = reg.mhandle;
        rc = s.plugin->irecv(s.comm, 1, &data, &cap, &t, &mh, &r);
      }
      if (rc != kOk)
        fail(format("%s of %s returned %s", s.recv ? "irecv" : "isend", what.c_str(), result_text(rc).c_str()));
      if (!r) {
        ++busy_answers;
        break;
      }
      request[next++] = r;
      max_in_flight = std::max(max_in_flight, ++in_flight);
    }
    // Test everything in flight, newest first.
    bool progress = false;
    for (int i = next - 1; i >= 0; --i) {
      if (!request[i]) continue;
      const std::string what = format("message %d (%zu bytes, tag %d)", i, size[i], tag[i]);
      int reported = kSizesCanary;
      if (!test_once(s, request[i], 1, &reported, what)) continue;
      request[i] = nullptr, --in_flight, ++completed, progress = true;
      if (s.recv)
        check_received(buffer.data + stride * i, capacity[i], size[i], reported, message_key(case_no, i), what);
      else if (reported != static_cast<int>(size[i]))
        fail(format("test() of the send of %s reported %d bytes", what.c_str(), reported));
      ++s.messages, s.bytes += size[i];
    }
    if (!progress) {
      if (s.deadline.passed())
        fail(format("%d of %d messages completed before the deadline (%d in flight)", completed, kMessages,
                    in_flight));
      idle();
    }
  }
  s.notes += format(" max_in_flight=%d busy_answers=%d", max_in_flight, busy_answers);
  // NCCL keeps up to NCCL_STEPS (8) requests of one sub in flight on a comm, and up to
  // NCCL_NET_MAX_REQUESTS (32) in all: a plugin taking fewer than 8 stalls NCCL's pipeline.
  if (max_in_flight < 8)
    fail(format("the plugin took at most %d requests at once (NCCL keeps up to 8 per connection, 32 in all)",
                max_in_flight));
}

int group_buffers(const Side& s) {
  return std::clamp(g_opt.group_buffers > 0 ? g_opt.group_buffers : s.props.max_recvs, 1, 8);
}

// Grouped receives: irecv with n = min(maxRecvs or --group-buffers, 8) buffers and distinct tags, buffers
// larger than the messages; the sender sends the n messages in a shuffled tag order.
void case_grouped(Side& s, int case_no) {
  const int n = group_buffers(s);
  constexpr int kRounds = 12;
  constexpr size_t kMax = 64 * 1024;
  std::mt19937_64 rng(mix64(g_opt.seed ^ 0x6209ull));
  const size_t stride = kMax + 1024 + kGuard;
  HostBuffer buffer(stride * n);
  Registration reg(s, buffer);
  for (int round = 0; round < kRounds; ++round) {
    std::vector<int> tags(n), order(n);
    std::vector<size_t> size(n), capacity(n);
    const int base_tag = static_cast<int>(rng() % 100000);
    for (int i = 0; i < n; ++i) {
      tags[i] = base_tag + 3 * i;  // distinct
      size[i] = (round + i) % 7 == 0 ? 0 : rng() % kMax;
      capacity[i] = size[i] + rng() % 1024;
      order[i] = i;
    }
    std::shuffle(order.begin(), order.end(), rng);
    auto key = [&](int i) { return message_key(case_no, static_cast<uint64_t>(round) * 64 + i); };
    if (!s.recv) {
      std::vector<void*> requests;
      for (int k = 0; k < n; ++k) {
        const int i = order[k];
        fill(buffer.data + stride * i, size[i], key(i));
        requests.push_back(post_send(s, buffer.data + stride * i, size[i], tags[i], reg.mhandle,
                                     format("round %d buffer %d (%zu bytes, tag %d)", round, i, size[i], tags[i])));
      }
      for (int k = 0; k < n; ++k) {
        int reported = kSizesCanary;
        wait_done(s, requests[k], 1, &reported, format("round %d send %d", round, k));
        if (reported != static_cast<int>(size[order[k]]))
          fail(format("test() of round %d send %d reported %d bytes, sent %zu", round, k, reported, size[order[k]]));
      }
    } else {
      std::vector<void*> data(n), mhandles(n, reg.mhandle);
      for (int i = 0; i < n; ++i) {
        data[i] = buffer.data + stride * i;
        std::memset(data[i], kPoison, capacity[i] + kGuard);
      }
      const std::string what = format("round %d (a grouped irecv of %d buffers)", round, n);
      void* request = post_recv(s, n, data.data(), capacity.data(), tags.data(), mhandles.data(), what);
      std::vector<int> reported(n, kSizesCanary);
      wait_done(s, request, n, reported.data(), what);
      for (int i = 0; i < n; ++i)
        check_received(buffer.data + stride * i, capacity[i], size[i], reported[i], key(i),
                       format("round %d buffer %d (tag %d)", round, i, tags[i]));
    }
    for (int i = 0; i < n; ++i) ++s.messages, s.bytes += size[i];
  }
  s.notes += format(" n=%d", n);
}

// Grouped receives as NCCL's PXN posts them: several groups in flight on one comm (one per
// step), while on the sending side each tag (sub) posts its steps on its own. Here every
// tag sends all its steps before the next tag starts whenever the plugin takes them, so
// that step k+1 of tag A reaches the receiver before step k of tag B: the message must go
// to the oldest group with an unfilled buffer of its tag. A plugin may instead hold the
// send back (request NULL) until the older group is complete: the sender then moves on to
// the next tag, as NCCL's proxy would.
void case_interleaved(Side& s, int case_no) {
  const int n = group_buffers(s);
  if (n < 2) {
    s.notes += " skipped: one buffer per receive (maxRecvs=1 and no --group-buffers)";
    return;
  }
  constexpr int kGroups = 4;
  constexpr size_t kMax = 32 * 1024;
  std::mt19937_64 rng(mix64(g_opt.seed ^ 0x17e41eaull));
  std::vector<int> tags(n);
  std::vector<size_t> size(kGroups * n), capacity(kGroups * n);
  for (int i = 0; i < n; ++i) tags[i] = 100 + 7 * i;
  for (int m = 0; m < kGroups * n; ++m) size[m] = rng() % kMax, capacity[m] = size[m] + rng() % 256;
  const size_t stride = kMax + 256 + kGuard;
  HostBuffer buffer(stride * kGroups * n);
  Registration reg(s, buffer);
  auto at = [&](int group, int i) { return buffer.data + stride * (group * n + i); };
  auto key = [&](int group, int i) { return message_key(case_no, static_cast<uint64_t>(group * n + i)); };
  if (!s.recv) {
    std::vector<int> posted(n, 0), completed(n, 0);
    std::vector<std::vector<void*>> requests(n, std::vector<void*>(kGroups, nullptr));
    int total_done = 0;
    // Sends the plugin took for step g while another tag had not yet posted step g - 1
    // (the reordering under test), and sends it held back (request NULL).
    int posted_ahead = 0, held_back = 0;
    while (total_done < kGroups * n) {
      bool progress = false;
      for (int i = 0; i < n; ++i) {  // tag i's "sub": post its next step if the plugin takes it
        while (posted[i] < kGroups) {
          const int g = posted[i];
          fill(at(g, i), size[g * n + i], key(g, i));
          void* r = nullptr;
          const Result rc = s.plugin->isend(s.comm, at(g, i), size[g * n + i], tags[i], reg.mhandle, &r);
          if (rc != kOk)
            fail(format("isend of step %d of tag %d returned %s", g, tags[i], result_text(rc).c_str()));
          if (!r) {
            ++held_back;
            break;
          }
          for (int j = 0; j < n; ++j)
            if (posted[j] < g) {
              ++posted_ahead;
              break;
            }
          requests[i][g] = r, ++posted[i], progress = true;
        }
      }
      for (int i = 0; i < n; ++i) {
        while (completed[i] < posted[i]) {
          const int g = completed[i];
          int reported = kSizesCanary;
          if (!test_once(s, requests[i][g], 1, &reported, format("send of step %d of tag %d", g, tags[i]))) break;
          if (reported != static_cast<int>(size[g * n + i]))
            fail(format("test() of step %d of tag %d reported %d bytes", g, tags[i], reported));
          ++completed[i], ++total_done, progress = true;
          ++s.messages, s.bytes += size[g * n + i];
        }
      }
      if (!progress) {
        if (s.deadline.passed())
          fail(format("%d of %d sends completed before the deadline", total_done, kGroups * n));
        idle();
      }
    }
    s.notes += format(" posted_ahead=%d held_back=%d", posted_ahead, held_back);
  } else {
    std::vector<void*> requests(kGroups, nullptr);
    for (int g = 0; g < kGroups; ++g) {
      std::vector<void*> data(n), mhandles(n, reg.mhandle);
      std::vector<size_t> cap(n);
      std::vector<int> t(tags);
      for (int i = 0; i < n; ++i) {
        data[i] = at(g, i), cap[i] = capacity[g * n + i];
        std::memset(data[i], kPoison, cap[i] + kGuard);
      }
      requests[g] = post_recv(s, n, data.data(), cap.data(), t.data(), mhandles.data(),
                              format("group %d (an irecv of %d buffers)", g, n));
    }
    for (int g = 0; g < kGroups; ++g) {
      std::vector<int> reported(n, kSizesCanary);
      wait_done(s, requests[g], n, reported.data(), format("group %d of %d posted at once", g, kGroups));
      for (int i = 0; i < n; ++i) {
        check_received(at(g, i), capacity[g * n + i], size[g * n + i], reported[i], key(g, i),
                       format("group %d buffer %d (tag %d, step %d of that tag)", g, i, tags[i], g));
        ++s.messages, s.bytes += size[g * n + i];
      }
    }
  }
  s.notes += format(" groups=%d n=%d", kGroups, n);
}

// One 1 GiB message.
void case_large(Side& s, int case_no) {
  const size_t size = size_t{1} << 30;
  if (s.props.max_p2p_bytes != 0 && s.props.max_p2p_bytes < size)
    fail(format("maxP2pBytes is %zu: NCCL would never post this 1 GiB message in one isend", s.props.max_p2p_bytes));
  const size_t capacity = size + 4096;
  HostBuffer buffer(capacity + kGuard);
  Registration reg(s, buffer);
  const uint64_t key = message_key(case_no, 0);
  const auto t0 = Clock::now();
  double transfer_ms = 0;
  if (!s.recv) {
    fill(buffer.data, size, key);
    const auto t1 = Clock::now();
    void* request = post_send(s, buffer.data, size, 0, reg.mhandle, "the 1 GiB message");
    int reported = kSizesCanary;
    wait_done(s, request, 1, &reported, "the 1 GiB message");
    transfer_ms = ms_since(t1);
    if (reported != static_cast<int>(size)) fail(format("test() of the 1 GiB send reported %d bytes", reported));
  } else {
    std::memset(buffer.data, kPoison, capacity + kGuard);
    void* data = buffer.data;
    size_t cap = capacity;
    int tag = 0;
    void* mh = reg.mhandle;
    const auto t1 = Clock::now();
    void* request = post_recv(s, 1, &data, &cap, &tag, &mh, "the 1 GiB message");
    int reported = kSizesCanary;
    wait_done(s, request, 1, &reported, "the 1 GiB message");
    transfer_ms = ms_since(t1);
    check_received(buffer.data, capacity, size, reported, key, "the 1 GiB message");
  }
  (void)t0;
  ++s.messages, s.bytes += size;
  s.notes += format(" transfer_ms=%.0f MB/s=%.0f", transfer_ms, size / 1e3 / std::max(transfer_ms, 1e-3));
}

// Polls test() on a receive that must fail until it returns an error, which goes into
// the notes with its time; fails when the receive completes (`why` an error was due) or
// at the deadline.
void wait_error(Side& s, void* request, const char* what, const char* why) {
  const auto t0 = Clock::now();
  for (;;) {
    int done = 0;
    int sizes[abi::kMaxRequests] = {};
    const Result r = s.plugin->test(request, &done, sizes);
    if (r != kOk) {
      s.notes += format(" test_error=%s after_ms=%.0f", result_text(r).c_str(), ms_since(t0));
      return;
    }
    if (done)
      fail(format("test() reported %s done (%d bytes) although %s; an error was expected", what, sizes[0], why));
    if (s.deadline.passed())
      fail(format("test() returned no error for %s within %.0f ms although %s", what, ms_since(t0), why));
    idle();
  }
}

// The sender dies (SIGKILL) with a 512 MiB message in flight; the receiver's test() must
// return an error, not hang and not report the message complete.
void case_killed(Side& s, int case_no) {
  const size_t size = size_t{512} << 20;
  HostBuffer buffer(size + kGuard);
  Registration reg(s, buffer);
  const uint64_t key = message_key(case_no, 0);
  if (!s.recv) {
    fill(buffer.data, size, key);
    void* request = post_send(s, buffer.data, size, 0, reg.mhandle, "the 512 MiB message");
    const auto t0 = Clock::now();
    // Make sure bytes are moving (the receiver is connected and reading), then die.
    while (ms_since(t0) < 30) {
      int reported = kSizesCanary;
      if (test_once(s, request, 1, &reported, "the 512 MiB message"))
        fail("the 512 MiB message was sent completely within 30 ms: cannot kill the sender mid-transfer");
    }
    printf("net-harness: role=send case=killed-sender: raising SIGKILL with the message in flight\n");
    fflush(stdout);
    raise(SIGKILL);
    fail("still alive after SIGKILL");
  }
  std::memset(buffer.data, kPoison, size + kGuard);
  void* data = buffer.data;
  size_t cap = size;
  int tag = 0;
  void* mh = reg.mhandle;
  void* request = post_recv(s, 1, &data, &cap, &tag, &mh, "the 512 MiB message");
  // What NCCL needs: an error it can report (it aborts the communicator).
  wait_error(s, request, "the 512 MiB message", "its sender was killed mid-transfer");
}

// Receiver only: whatever connected must make this receive fail (the suite's raw client
// sends a header whose size does not fit).
void case_expect_error(Side& s, int /*case_no*/) {
  if (!s.recv) fail("expect-error is a receiver case");
  const size_t capacity = g_opt.expect_capacity;
  HostBuffer buffer(capacity + kGuard);
  Registration reg(s, buffer);
  std::memset(buffer.data, kPoison, capacity + kGuard);
  void* data = buffer.data;
  size_t cap = capacity;
  int tag = g_opt.expect_tag;
  void* mh = reg.mhandle;
  void* request = post_recv(s, 1, &data, &cap, &tag, &mh, "the receive that must fail");
  wait_error(s, request, "the receive", "its sender's header does not fit");
  const size_t past = first_unpoisoned(buffer.data + capacity, kGuard);
  if (past != kGuard) fail(format("the failed receive wrote byte %zu past its %zu-byte buffer", past, capacity));
}

struct CaseDef {
  const char* name;
  int number;
  std::function<void(Side&, int)> run;
};
const std::vector<CaseDef>& all_cases() {
  static const std::vector<CaseDef> cases{
      {"sizes", kSizes, [](Side& s, int c) { case_sizes(s, c, false); }},
      {"small", kSmall, [](Side& s, int c) { case_sizes(s, c, true); }},
      {"inflight", kInflight, case_inflight},
      {"grouped", kGrouped, case_grouped},
      {"interleaved", kInterleaved, case_interleaved},
      {"large", kLarge, case_large},
      {"killed-sender", kKilled, case_killed},
      {"expect-error", kExpectError, case_expect_error},
  };
  return cases;
}

// ------------------------------------------------------------------------------------
// Setup: properties, the handle, connect/accept.

std::string check_properties(const Props& p, int dev, int version) {
  std::vector<std::string> bad;
  if (p.name.empty() || p.name == "(null)") bad.push_back("name is empty or NULL");
  if (p.speed <= 0) bad.push_back(format("speed is %d Mbps (must be > 0)", p.speed));
  if (!(p.ptr_support & abi::kPtrHost)) bad.push_back(format("ptrSupport 0x%x lacks NCCL_PTR_HOST", p.ptr_support));
  if (p.max_comms < 1) bad.push_back(format("maxComms is %d", p.max_comms));
  if (p.max_recvs < 1 || p.max_recvs > 64) bad.push_back(format("maxRecvs is %d (1..64)", p.max_recvs));
  if (!std::isfinite(p.latency) || p.latency < 0) bad.push_back(format("latency is %g", p.latency));
  if (p.device_type != abi::kDeviceHost) bad.push_back(format("netDeviceType is %d (host = 0)", p.device_type));
  if (version >= 9) {
    if (p.vdevs != 1 || p.vdev0 != dev)
      bad.push_back(format("vProps is {ndevs=%d, devs[0]=%d}; a physical device is {1, %d}", p.vdevs, p.vdev0, dev));
    if (p.max_p2p_bytes == 0 || p.max_p2p_bytes > abi::kMaxNetSizeBytes)
      bad.push_back(format("maxP2pBytes is %zu (1..NCCL_MAX_NET_SIZE_BYTES)", p.max_p2p_bytes));
    if (p.max_coll_bytes == 0 || p.max_coll_bytes > abi::kMaxNetSizeBytes)
      bad.push_back(format("maxCollBytes is %zu (1..NCCL_MAX_NET_SIZE_BYTES)", p.max_coll_bytes));
    if (p.force_flush != 0 && p.force_flush != 1) bad.push_back(format("forceFlush is %d", p.force_flush));
  }
  if (version >= 11 && (p.max_multi_request_size < 1 || p.max_multi_request_size > 64))
    bad.push_back(format("maxMultiRequestSize is %d", p.max_multi_request_size));
  std::string out;
  for (const auto& b : bad) out += (out.empty() ? "" : "; ") + b;
  return out;
}

std::string describe(const Props& p) {
  std::string s = format("name=%s pciPath=%s speed=%d ptrSupport=0x%x maxComms=%d maxRecvs=%d latency=%g",
                         p.name.c_str(), p.pci_path.c_str(), p.speed, p.ptr_support, p.max_comms, p.max_recvs,
                         p.latency);
  if (p.max_p2p_bytes) s += format(" maxP2pBytes=%zu", p.max_p2p_bytes);
  if (p.max_multi_request_size >= 0) s += format(" maxMultiRequestSize=%d", p.max_multi_request_size);
  return s;
}

bool write_handle(const std::string& path, const char (&handle)[abi::kHandleMaxBytes]) {
  const std::string tmp = path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "wb");
  if (!f) return false;
  const bool ok = fwrite(handle, 1, sizeof handle, f) == sizeof handle;
  if (fclose(f) != 0 || !ok) return false;
  return rename(tmp.c_str(), path.c_str()) == 0;
}

bool read_handle(const std::string& path, char (&handle)[abi::kHandleMaxBytes]) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) return false;
  const bool ok = fread(handle, 1, sizeof handle, f) == sizeof handle;
  fclose(f);
  return ok;
}

void print_case(const char* name, bool pass, const Side& s, double ms, const std::string& detail) {
  printf("net-harness: role=%s api=v%d case=%s result=%s messages=%" PRIu64 " bytes=%" PRIu64
         " ms=%.0f warns=%d slowest_call=%s:%.1fms%s detail=\"%s\"\n",
         g_role, s.plugin->version(), name, pass ? "PASS" : "FAIL", s.messages, s.bytes, ms, g_warns.load(),
         g_calls.worst_call.empty() ? "-" : g_calls.worst_call.c_str(), g_calls.worst_ms, s.notes.c_str(),
         detail.c_str());
  fflush(stdout);
}

[[noreturn]] void setup_failed(const std::string& what) {
  printf("net-harness: role=%s api=%s result=SETUP-FAILED detail=\"%s\"\n", g_role, g_opt.api.c_str(), what.c_str());
  fflush(stdout);
  _exit(kExitSetup);
}

extern "C" void on_alarm(int) {
  static const char msg[] = "net-harness: result=TIMEOUT detail=\"the whole run exceeded --timeout-s\"\n";
  ssize_t ignored = write(STDOUT_FILENO, msg, sizeof msg - 1);
  (void)ignored;
  _exit(kExitTimeout);
}

int usage(const char* why) {
  fprintf(stderr,
          "net-harness: %s\n"
          "usage: lgreco-net-harness --role recv|send --lib PATH --handle-file PATH --comm-id N --seed N\n"
          "         [--api v11|v10|v9|v8] [--cases sizes,small,inflight,grouped,interleaved,large,killed-sender,"
          "expect-error]\n"
          "         [--dev N] [--timeout-s S] [--case-timeout-s S] [--connect-timeout-s S] [--max-call-ms MS]\n"
          "         [--expect-capacity BYTES] [--expect-tag T] [--group-buffers N] [--verbose]\n",
          why);
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--role") g_opt.role = value();
      else if (a == "--lib") g_opt.lib = value();
      else if (a == "--handle-file") g_opt.handle_file = value();
      else if (a == "--api") g_opt.api = value();
      else if (a == "--comm-id") g_opt.comm_id = std::stoull(value(), nullptr, 0);
      else if (a == "--seed") g_opt.seed = std::stoull(value(), nullptr, 0);
      else if (a == "--dev") g_opt.dev = std::stoi(value());
      else if (a == "--timeout-s") g_opt.timeout_s = std::stod(value());
      else if (a == "--case-timeout-s") g_opt.case_timeout_s = std::stod(value());
      else if (a == "--connect-timeout-s") g_opt.connect_timeout_s = std::stod(value());
      else if (a == "--max-call-ms") g_opt.max_call_ms = std::stod(value());
      else if (a == "--expect-capacity") g_opt.expect_capacity = std::stoull(value(), nullptr, 0);
      else if (a == "--expect-tag") g_opt.expect_tag = std::stoi(value());
      else if (a == "--group-buffers") g_opt.group_buffers = std::stoi(value());
      else if (a == "--verbose") ++g_opt.verbose;
      else if (a == "--cases") {
        std::stringstream list(value());
        for (std::string c; std::getline(list, c, ',');)
          if (!c.empty()) g_opt.cases.push_back(c);
      } else
        return usage(("unknown argument " + a).c_str());
    } catch (const std::exception& e) {
      return usage((a + ": " + e.what()).c_str());
    }
  }
  if (g_opt.role != "recv" && g_opt.role != "send") return usage("--role must be recv or send");
  if (g_opt.lib.empty() || g_opt.handle_file.empty()) return usage("--lib and --handle-file are required");
  if (g_opt.cases.empty()) g_opt.cases = {"sizes", "inflight", "grouped", "interleaved"};
  for (const auto& c : g_opt.cases)
    if (std::none_of(all_cases().begin(), all_cases().end(), [&](const CaseDef& d) { return c == d.name; }))
      return usage(("unknown case " + c).c_str());
  int version = 0;
  if (g_opt.api == "v11") version = 11;
  else if (g_opt.api == "v10") version = 10;
  else if (g_opt.api == "v9") version = 9;
  else if (g_opt.api == "v8") version = 8;
  else return usage("--api must be v11, v10, v9 or v8");
  g_role = g_opt.role == "recv" ? "recv" : "send";
  const bool receiver = g_opt.role == "recv";

  // The last resort against a hang anywhere, plugin calls included.
  signal(SIGALRM, on_alarm);
  alarm(static_cast<unsigned>(std::ceil(g_opt.timeout_s)));
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  g_host = host;

  // As NCCL: dlopen by path, RTLD_NOW | RTLD_LOCAL, then the versioned symbol.
  void* lib = dlopen(g_opt.lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) setup_failed(std::string("dlopen: ") + dlerror());
  const std::string symbol = "ncclNetPlugin_" + g_opt.api;
  void* table = dlsym(lib, symbol.c_str());
  if (!table) setup_failed("dlsym(" + symbol + ") found nothing in " + g_opt.lib);
  Plugin plugin(table, version);
  if (std::string missing = plugin.missing_functions(); !missing.empty())
    setup_failed(symbol + " has NULL entries NCCL calls: " + missing);
  if (!plugin.name() || std::string(plugin.name()).empty()) setup_failed(symbol + ".name is empty");

  Result r = plugin.init(g_opt.comm_id);
  if (r != kOk) setup_failed("init returned " + result_text(r));
  int ndev = -1;
  r = plugin.devices(&ndev);
  if (r != kOk) setup_failed("devices returned " + result_text(r));
  if (ndev <= 0) setup_failed(format("devices() reported %d devices (NCCL falls back to its own transport)", ndev));
  if (g_opt.dev >= ndev) setup_failed(format("--dev %d, but the plugin has %d devices", g_opt.dev, ndev));
  Side side;
  side.plugin = &plugin;
  side.recv = receiver;
  for (int d = 0; d < ndev; ++d) {
    Props p;
    r = plugin.properties(d, &p);
    if (r != kOk) setup_failed(format("getProperties(%d) returned %s", d, result_text(r).c_str()));
    if (std::string bad = check_properties(p, d, version); !bad.empty())
      setup_failed(format("getProperties(%d): %s [%s]", d, bad.c_str(), describe(p).c_str()));
    if (d == g_opt.dev) side.props = p;
  }
  printf("net-harness: role=%s api=v%d plugin=%s devices=%d dev=%d %s\n", g_role, version, plugin.name(), ndev,
         g_opt.dev, describe(side.props).c_str());
  fflush(stdout);

  // Connection setup: both sides call connect/accept again and again (non-blocking).
  const Deadline connect_deadline(g_opt.connect_timeout_s);
  const auto t_connect = Clock::now();
  int setup_calls = 0;
  g_calls.reset();
  char handle[abi::kHandleMaxBytes];
  abi::DeviceHandle* dev_handle = nullptr;
  if (receiver) {
    std::memset(handle, 0, sizeof handle);
    void* listen_comm = nullptr;
    r = plugin.listen(g_opt.dev, handle, &listen_comm);
    if (r != kOk || !listen_comm)
      setup_failed("listen returned " + result_text(r) + (listen_comm ? "" : " and no listen comm"));
    if (!write_handle(g_opt.handle_file, handle)) setup_failed("cannot write " + g_opt.handle_file);
    while (!side.comm) {
      r = plugin.accept(listen_comm, &side.comm, &dev_handle);
      ++setup_calls;
      if (r != kOk) {
        printf("net-harness: role=recv api=v%d case=accept result=ACCEPT-ERROR detail=\"accept() returned %s after "
               "%d calls, %.0f ms\"\n",
               version, result_text(r).c_str(), setup_calls, ms_since(t_connect));
        fflush(stdout);
        plugin.close_listen(listen_comm);
        _exit(kExitAcceptError);
      }
      if (!side.comm) {
        if (connect_deadline.passed())
          setup_failed(format("accept() returned no comm within %.0f s (%d calls)", g_opt.connect_timeout_s,
                              setup_calls));
        idle();
      }
    }
    // NCCL closes the listen comm once its connection is accepted.
    r = plugin.close_listen(listen_comm);
    if (r != kOk) setup_failed("closeListen returned " + result_text(r));
  } else {
    while (!read_handle(g_opt.handle_file, handle)) {
      if (connect_deadline.passed()) setup_failed("no handle in " + g_opt.handle_file + " before the deadline");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    while (!side.comm) {
      r = plugin.connect(g_opt.dev, handle, &side.comm, &dev_handle);
      ++setup_calls;
      if (r != kOk)
        setup_failed(format("connect() returned %s after %d calls", result_text(r).c_str(), setup_calls));
      if (!side.comm) {
        if (connect_deadline.passed())
          setup_failed(format("connect() returned no comm within %.0f s (%d calls)", g_opt.connect_timeout_s,
                              setup_calls));
        idle();
      }
    }
  }
  if (dev_handle && dev_handle->netDeviceType != abi::kDeviceHost)
    setup_failed(format("%s returned a device handle of type %d for a host-only device", receiver ? "accept" : "connect",
                        dev_handle->netDeviceType));
  printf("net-harness: role=%s api=v%d connected after %d %s calls, %.0f ms (slowest call %s %.1f ms)\n", g_role,
         version, setup_calls, receiver ? "accept" : "connect", ms_since(t_connect), g_calls.worst_call.c_str(),
         g_calls.worst_ms);
  if (g_calls.worst_ms > g_opt.max_call_ms)
    setup_failed(format("one %s call took %.0f ms: connect/accept must not block NCCL's proxy thread",
                        g_calls.worst_call.c_str(), g_calls.worst_ms));
  fflush(stdout);

  // The cases, in order; after a failure the connection's state is unknown, so the rest
  // are skipped.
  int failed = 0, ran = 0;
  for (const auto& name : g_opt.cases) {
    const CaseDef& def = *std::find_if(all_cases().begin(), all_cases().end(),
                                       [&](const CaseDef& d) { return name == d.name; });
    if (failed) {
      printf("net-harness: role=%s api=v%d case=%s result=SKIPPED detail=\"an earlier case failed\"\n", g_role,
             version, def.name);
      continue;
    }
    side.messages = side.bytes = 0;
    side.notes.clear();
    side.deadline = Deadline(g_opt.case_timeout_s);
    g_calls.reset();
    const auto t0 = Clock::now();
    std::string detail;
    bool pass = true;
    try {
      def.run(side, def.number);
      if (g_calls.worst_ms > g_opt.max_call_ms)
        pass = false, detail = format("one %s call took %.0f ms (more than --max-call-ms %.0f): a call that blocks "
                                      "stalls NCCL's proxy thread",
                                      g_calls.worst_call.c_str(), g_calls.worst_ms, g_opt.max_call_ms);
    } catch (const CaseFailure& f) {
      pass = false, detail = f.what;
    }
    ++ran;
    if (!pass) ++failed;
    print_case(def.name, pass, side, ms_since(t0), detail);
  }

  // Teardown as NCCL's: free the comm, then finalize the context.
  r = receiver ? plugin.close_recv(side.comm) : plugin.close_send(side.comm);
  if (r != kOk) {
    printf("net-harness: role=%s %s returned %s\n", g_role, receiver ? "closeRecv" : "closeSend",
           result_text(r).c_str());
    ++failed;
  }
  r = plugin.finalize();
  if (r != kOk) {
    printf("net-harness: role=%s finalize returned %s\n", g_role, result_text(r).c_str());
    ++failed;
  }
  printf("net-harness: role=%s api=v%d result=%s cases=%d failed=%d warns=%d\n", g_role, version,
         failed ? "FAIL" : "PASS", ran, failed, g_warns.load());
  fflush(stdout);
  return failed ? kExitFailed : 0;
}
