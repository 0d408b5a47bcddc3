// The collective shim: what lgreco's ncclAllReduce (and the calls it tracks) do before
// and instead of NCCL's. Pure dispatch logic over two injected interfaces, the real NCCL
// (nccl_api.h) and the GPU runtime (device_runtime.h), so that the unit tests run all of
// it against a test double of NCCL with host memory (tests/unit/fake_nccl.h);
// entry_points.cc holds the exported C functions around one process-wide Shim.
//
// An allreduce takes the compressed path only when every rule below lets it; anything
// else is passed to the real NCCL untouched:
//   - NCCL is a version the shim supports, and LGRECO_MODE is not off (process-wide);
//   - the op is sum or avg, the type float32, float16 or bfloat16, and the call holds at
//     least LGRECO_MIN_BYTES;
//   - it is not inside a user's ncclGroupStart/End, except as the only operation of its
//     group (older PyTorch wraps each collective in a group): then it runs at the
//     outermost ncclGroupEnd. Inside a group NCCL only queues work, so a kernel the shim
//     launched there would run before NCCL's own;
//   - its stream is not being captured into a CUDA graph (the compressed path compares
//     configurations and reads statistics back on the host, which capture forbids; a
//     capture query that fails fails the call);
//   - its communicator reports no error (a communicator in error fails the call with
//     NCCL's code, enqueuing nothing; one with a non-blocking operation in progress is
//     settled first, bounded by LGRECO_TIMEOUT: what one rank alone sees never makes it
//     pass through while its peers compress);
//   - the communicator's ranks agreed on their configuration (below), and the bucket
//     matcher (config/bucket_matcher.h) recognises the call as a registered bucket (or,
//     without a registration, an auto-mode gradient buffer); the engine
//     (plugin/collective/engine.h) then compresses it or, on a problem every rank sees
//     alike, passes it through on every rank.
//
// Agreement. Every filter above must give the same answer on every rank, or one rank
// would run the compressed exchange while another calls NCCL's allreduce: mismatched
// collectives. They do when every rank has the same parameters and registration. So at a
// communicator's first allreduce that could ever be compressed (sum or avg of a float
// type, at least kAgreementFloorBytes: what NCCL already requires to be the same on every
// rank), outside a group and outside capture, its ranks all-gather a digest of their
// configuration (lgreco version, parameters, registration) and whether they can compress
// (valid parameters, a usable device). Any difference makes every rank pass that
// communicator's calls through for good, with one WARN naming the ranks. The exchange
// waits for the peers as long as NCCL would (the framework's watchdog bounds it), with a
// WARN every LGRECO_TIMEOUT. Only what cannot differ between the ranks of one job skips
// it: an unsupported NCCL, and LGRECO_MODE=off (which must then be set on every rank).
//
// Failures. Whatever goes wrong on one rank before the exchange (its CUDA backend cannot
// be made: a pool, stream or event refused; no memory for the exchange's buffers within
// LGRECO_MAX_MEMORY) takes part in it as "cannot compress", through plain device memory of
// the runtime's (DeviceRuntime::exchange_memory) where the backend has none: every rank
// then passes through together. A rank that cannot even take part (no usable device at
// all) and a failure after data was queued to peers (a dead peer, a broken connection)
// make this communicator's calls return ncclInternalError, with the reason in
// ncclGetLastError: quietly passing through there would pair this rank's allreduce with
// its peers' exchange.
//
// Communicators: the shim keeps state per communicator, made at its first allreduce from
// ncclCommUserRank, ncclCommCount and ncclCommCuDevice, so communicators from
// ncclCommInitRank, InitAll, Split, Shrink or InitRankScalable all work alike and their
// creation needs no interception; ncclCommDestroy, Abort and Finalize end it (a handle
// NCCL reuses later starts afresh). A call in flight on another thread keeps the state
// alive until it returns; an abort makes it stop at its next NCCL call or wait.
//
// Threads: NCCL lets one thread at a time call on a communicator, different
// communicators from different threads; the shim follows (state per communicator, a
// mutex only around the table of communicators and the counters). Group state is per
// thread, as NCCL's. One thread driving several ranks must group their allreduces
// together (they then pass through): a lone allreduce of one of them would wait in the
// configuration exchange for ranks the same thread has not called yet.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/bucket_matcher.h"
#include "config/params.h"
#include "config/registration.h"
#include "plugin/shim/device_runtime.h"
#include "plugin/shim/nccl_api.h"

namespace lgreco::shim {

// What one communicator did, for the summary line and the tests.
struct CommCounters {
  uint64_t calls = 0;           // allreduce calls
  uint64_t compressed = 0;      // calls that took the compressed path
  uint64_t passed_through = 0;  // calls given to NCCL's allreduce
  uint64_t errors = 0;          // calls that failed on the compressed path
  uint64_t gradient_bytes = 0;  // count x element size of the compressed calls
  uint64_t bytes_sent = 0;      // what this rank sent to peers for them
  // The host's waits for the device inside the engine, and those that found it behind
  // (collective::EngineCounters): one at the first compressed call, none after it.
  uint64_t host_waits = 0, host_stalls = 0;
  std::map<std::string, uint64_t, std::less<>> pass_reasons;  // why calls passed through, counted

  CommCounters& operator+=(const CommCounters& other);
};

class Shim {
 public:
  struct Options {
    config::Params params;  // the LGRECO_* parameters
    int nccl_version = 0;   // ncclGetVersion() of the NCCL behind `api`
  };
  // `api` is the real NCCL; `runtime` creates each communicator's backend.
  Shim(const NcclApi& api, std::unique_ptr<DeviceRuntime> runtime, Options options);
  ~Shim();
  Shim(const Shim&) = delete;
  Shim& operator=(const Shim&) = delete;

  nccl::Result all_reduce(const void* send, void* recv, size_t count, nccl::DataType dtype, nccl::RedOp op,
                          nccl::Comm comm, nccl::Stream stream);
  nccl::Result group_start();
  nccl::Result group_end();
  nccl::Result group_simulate_end(void* sim_info);
  // Before forwarding any other collective or point-to-point call: inside a group, the
  // group is no longer a lone allreduce (a deferred one is forwarded first, keeping the
  // user's order).
  void note_other_operation();
  // The communicator's lgreco state goes (its summary is logged), then NCCL's call runs;
  // abort runs NCCL's first (it stops kernels that may be waiting on a dead peer).
  nccl::Result comm_destroy(nccl::Comm comm);
  nccl::Result comm_abort(nccl::Comm comm);
  nccl::Result comm_finalize(nccl::Comm comm);
  // lgreco's last error (of this communicator; of any, for a null one) while NCCL's has
  // not changed since lgreco's was recorded, else NCCL's.
  const char* last_error(nccl::Comm comm);

  const NcclApi& api() const { return api_; }
  // Why the shim passes everything through (unsupported NCCL, LGRECO_MODE=off, invalid
  // parameters), or "" when it may compress.
  const std::string& disabled_reason() const { return disabled_; }
  // Counters of a live communicator (nothing if the shim has not seen it), and of every
  // communicator it has seen, live or gone.
  std::optional<CommCounters> counters(nccl::Comm comm) const;
  CommCounters total_counters() const;
  // The summary line of every live communicator, at INFO (at process exit).
  void log_summaries() const;

 private:
  struct CommState;
  struct Call {
    const void* send;
    void* recv;
    size_t count;
    nccl::DataType dtype;
    nccl::RedOp op;
    nccl::Comm comm;
    nccl::Stream stream;
  };
  struct GroupState;
  using StatePtr = std::shared_ptr<CommState>;

  nccl::Result dispatch(const Call& call);  // outside any group
  nccl::Result dispatch_on(CommState& s, const Call& call);
  nccl::Result forward(const Call& call);
  nccl::Result pass(CommState* state, const Call& call, const char* reason);
  nccl::Result fail(CommState& s, const std::string& message);  // the communicator is broken
  // Why the call can never be compressed by its op, type and size (and, once the ranks
  // agreed, its buffers), or "". Before the agreement the size floor is the constant
  // kAgreementFloorBytes, after it LGRECO_MIN_BYTES (shim.h: what may decide when).
  const char* static_reason(const Call& call, bool agreed) const;
  StatePtr state_of(nccl::Comm comm);                 // creates on first use
  StatePtr detach_state(nccl::Comm comm);             // out of the table, marked abandoned
  void agree(CommState& s, const Call& call);         // the configuration agreement
  bool ensure_engine(CommState& s, const config::Match& match);
  void retire(CommState& s, const char* why);  // logs the summary
  void record_error(CommState* s, const std::string& message);
  GroupState& group();

  NcclApi api_;
  std::unique_ptr<DeviceRuntime> runtime_;
  Options options_;
  std::string disabled_;
  std::string local_problem_;  // why this rank cannot compress (reported in the agreement)
  std::shared_ptr<const config::Registration> registration_;
  std::string config_text_;  // what ranks compare

  mutable std::mutex mutex_;  // comms_, retired_, the last error
  std::unordered_map<nccl::Comm, StatePtr> comms_;
  CommCounters retired_;
  // The newest error lgreco returned, and NCCL's last error when it was recorded: NCCL's
  // is newer once it differs.
  std::string last_error_, nccl_error_then_;
  // Bumped whenever a communicator's state goes, so that per-thread caches of the last
  // state used notice (the fast path takes no lock).
  std::atomic<uint64_t> generation_{1};
  const uint64_t id_;  // tells this Shim's per-thread state from another's (tests)
};

// Calls smaller than this never trigger the configuration agreement (a barrier's one-element
// allreduce, a few metrics): whether a call reaches it must not depend on any setting, so
// this is a constant, not LGRECO_MIN_BYTES.
constexpr uint64_t kAgreementFloorBytes = 4096;

// One summary line (the format tests/gpu and docs/USAGE.md rely on).
std::string summary_line(int rank, int size, const CommCounters& c);

}  // namespace lgreco::shim
