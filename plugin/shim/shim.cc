#include "plugin/shim/shim.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "config/bucket_matcher.h"
#include "config/log.h"
#include "config/text_file.h"
#include "config/version.h"
#include "plugin/collective/engine.h"
#include "plugin/shim/nccl_fabric.h"

namespace lgreco::shim {

using collective::CallOutcome;
using collective::Engine;
using collective::EngineCall;
using collective::EngineOptions;

namespace {

std::atomic<uint64_t> g_next_shim_id{1};

bool compressible_dtype(nccl::DataType t, DType* out) {
  switch (t) {
    case nccl::kFloat32: *out = DType::kFloat32; return true;
    case nccl::kFloat16: *out = DType::kFloat16; return true;
    case nccl::kBfloat16: *out = DType::kBFloat16; return true;
    default: return false;
  }
}

// What ranks exchange to agree on a communicator (plain data, the same layout everywhere).
struct AgreementRecord {
  uint64_t config_digest;
  uint32_t ok;  // 1: this rank can compress
  uint32_t rank;
};
static_assert(sizeof(AgreementRecord) == 16);

// Reasons a call passes through (static text; counted per communicator).
constexpr const char kInGroup[] = "inside a group with other operations";
constexpr const char kCapturing[] = "its stream is being captured into a CUDA graph";
constexpr const char kOneRank[] = "a communicator of one rank: nothing to exchange";
constexpr const char kOp[] = "a reduction other than sum or avg";
constexpr const char kType[] = "an element type other than float32, float16 or bfloat16";
constexpr const char kSmall[] = "smaller than LGRECO_MIN_BYTES";
constexpr const char kTiny[] = "smaller than 4 KiB (before the configuration exchange)";
constexpr const char kNoBuffer[] = "a null buffer";

}  // namespace

struct Shim::CommState {
  nccl::Comm comm = nullptr;
  int rank = 0, size = 1, device = 0;
  enum class Agreement : uint8_t {
    kPending,      // not yet exchanged
    kAgreed,       // the ranks agree: calls may be compressed
    kPassThrough,  // every rank passes this communicator's calls through
    kBroken,       // this rank failed where peers may be waiting: calls return errors
  } agreement = Agreement::kPending;
  std::string pass_reason;  // kPassThrough: why; kBroken: the error
  // Set by abort/destroy from any thread; a call in flight stops at its next NCCL call.
  std::atomic<bool> abandoned{false};
  std::unique_ptr<config::BucketMatcher> matcher;
  std::unique_ptr<StreamBackend> backend;
  std::unique_ptr<NcclFabric> fabric;
  std::unique_ptr<Engine> engine;
  uint64_t engine_generation = 0;  // the matcher's pattern the engine was built for
  std::vector<int> engine_bucket;  // matcher bucket -> engine bucket, -1: passes through
  bool memory_reported = false;
  mutable std::mutex counters_mutex;  // counters: written by the calling thread, read by any
  CommCounters counters;

  void count(uint64_t CommCounters::*field, uint64_t n = 1) {
    std::lock_guard<std::mutex> lock(counters_mutex);
    counters.*field += n;
  }
  CommCounters snapshot() const {
    std::lock_guard<std::mutex> lock(counters_mutex);
    return counters;
  }
};

struct Shim::GroupState {
  uint64_t owner = 0;
  int depth = 0;
  bool mixed = false;  // holds an operation other than one deferred allreduce
  std::optional<Call> deferred;
};

CommCounters& CommCounters::operator+=(const CommCounters& other) {
  calls += other.calls;
  compressed += other.compressed;
  passed_through += other.passed_through;
  errors += other.errors;
  gradient_bytes += other.gradient_bytes;
  bytes_sent += other.bytes_sent;
  host_waits += other.host_waits;
  host_stalls += other.host_stalls;
  for (const auto& [reason, n] : other.pass_reasons) pass_reasons[reason] += n;
  return *this;
}

std::string summary_line(int rank, int size, const CommCounters& c) {
  const uint64_t ring = size > 1 ? c.gradient_bytes / size * 2 * (size - 1) +
                                       c.gradient_bytes % size * 2 * (size - 1) / size
                                 : 0;
  char line[640];
  snprintf(line, sizeof line,
           "lgreco shim: rank %d/%d: %llu allreduce calls, %llu compressed, %llu passed through; compressed calls: "
           "%llu gradient bytes, %llu bytes sent by this rank (plain ring allreduce: %llu); host waits for the "
           "device: %llu, %llu of them stalled",
           rank, size, static_cast<unsigned long long>(c.calls), static_cast<unsigned long long>(c.compressed),
           static_cast<unsigned long long>(c.passed_through), static_cast<unsigned long long>(c.gradient_bytes),
           static_cast<unsigned long long>(c.bytes_sent), static_cast<unsigned long long>(ring),
           static_cast<unsigned long long>(c.host_waits), static_cast<unsigned long long>(c.host_stalls));
  return line;
}

Shim::Shim(const NcclApi& api, std::unique_ptr<DeviceRuntime> runtime, Options options)
    : api_(api), runtime_(std::move(runtime)), options_(std::move(options)), id_(g_next_shim_id++) {
  const config::Params& p = options_.params;
  const int v = options_.nccl_version;
  // Only what every rank of a job shares may skip the configuration exchange: the NCCL
  // they all load, and an explicit LGRECO_MODE=off. Invalid parameters take part in it
  // (as "cannot compress"), so that every rank passes through together.
  if (v < kOldestSupportedNccl || v >= kFirstUnsupportedNccl)
    disabled_ = "NCCL " + std::to_string(v) + " is not a version lgreco supports (2.12 to 2.x)";
  else if (p.valid() && p.mode == config::Mode::kOff)
    disabled_ = "LGRECO_MODE=off";
  if (!disabled_.empty()) {
    if (p.valid() && p.mode == config::Mode::kOff)
      LGRECO_INFO("SHIM", "every allreduce goes to NCCL untouched: %s", disabled_.c_str());
    else
      LGRECO_WARN("SHIM", "every allreduce goes to NCCL untouched: %s", disabled_.c_str());
    return;
  }
  if (!p.valid()) local_problem_ = "invalid LGRECO_* parameters: " + p.errors.front();
  // What every rank must share: the engine's settings, the registration's bytes and
  // lgreco's version (paths, logging and timeouts may differ).
  config_text_ = std::string("lgreco ") + version_string() + "; " +
                 EngineOptions::from_params(p, 0).parameters_text + "; max_memory=" + std::to_string(p.max_memory);
  if (!p.registration.empty()) {
    // Read once: its bytes go into the digest the ranks compare, then they are parsed
    // (load_registration only for a file that cannot be read, for its message).
    const config::TextFile file = config::read_text_file(p.registration, config::Registration::kMaxFileBytes);
    config_text_ += "; registration digest " + std::to_string(collective::digest(file.text));
    try {
      registration_ = std::make_shared<const config::Registration>(
          file.status == config::TextFile::Status::kOk ? config::parse_registration(file.text, p.registration)
                                                       : config::load_registration(p.registration));
    } catch (const std::exception& e) {
      if (local_problem_.empty()) local_problem_ = std::string("the registration: ") + e.what();
      LGRECO_WARN("SHIM", "cannot use the registration: %s; every rank will pass allreduce calls through",
                  e.what());
    }
  }
}

Shim::~Shim() = default;

Shim::GroupState& Shim::group() {
  thread_local GroupState g;
  if (g.owner != id_) {
    g = GroupState{};
    g.owner = id_;
  }
  return g;
}

// ---------------------------------------------------------------------------------------
// Communicators

Shim::StatePtr Shim::state_of(nccl::Comm comm) {
  // The last communicator this thread used, without a lock: valid while no state went
  // since (generation_), and a weak reference, so it never keeps a gone state alive.
  struct Cache {
    uint64_t shim = 0, generation = 0;
    nccl::Comm comm = nullptr;
    std::weak_ptr<CommState> state;
  };
  thread_local Cache cache;
  const uint64_t generation = generation_.load(std::memory_order_acquire);
  if (cache.shim == id_ && cache.comm == comm && cache.generation == generation)
    if (StatePtr s = cache.state.lock()) return s;
  if (!comm) return nullptr;

  std::lock_guard<std::mutex> lock(mutex_);
  auto it = comms_.find(comm);
  if (it == comms_.end()) {
    auto s = std::make_shared<CommState>();
    s->comm = comm;
    if (api_.comm_user_rank(comm, &s->rank) != nccl::kSuccess || api_.comm_count(comm, &s->size) != nccl::kSuccess ||
        api_.comm_cu_device(comm, &s->device) != nccl::kSuccess)
      return nullptr;  // NCCL rejects the communicator; its own call will say why
    const config::Params& p = options_.params;
    s->matcher = std::make_unique<config::BucketMatcher>(
        registration_, config::MatcherSettings{p.auto_mode, p.min_bytes, p.segment_bytes});
    if (comms_.empty()) log::set_rank(s->rank);
    LGRECO_INFO("SHIM", "communicator %p: rank %d of %d on CUDA device %d", static_cast<void*>(comm), s->rank,
                s->size, s->device);
    it = comms_.emplace(comm, std::move(s)).first;
  }
  cache.shim = id_;
  cache.generation = generation_.load(std::memory_order_acquire);
  cache.comm = comm;
  cache.state = it->second;
  return it->second;
}

Shim::StatePtr Shim::detach_state(nccl::Comm comm) {
  StatePtr s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = comms_.find(comm);
    if (it == comms_.end()) return nullptr;
    s = std::move(it->second);
    comms_.erase(it);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  s->abandoned.store(true, std::memory_order_release);
  retire(*s, "destroyed");
  return s;  // freed when the last reference goes: here, or a call in flight elsewhere
}

void Shim::retire(CommState& s, const char* why) {
  const CommCounters c = s.snapshot();
  LGRECO_INFO("SHIM", "%s (communicator %p %s)", summary_line(s.rank, s.size, c).c_str(),
              static_cast<void*>(s.comm), why);
  if (!c.pass_reasons.empty() && log::enabled(log::Level::kInfo)) {
    std::string reasons;
    for (const auto& [reason, n] : c.pass_reasons)
      reasons += (reasons.empty() ? "" : "; ") + reason + " (" + std::to_string(n) + ")";
    LGRECO_INFO("SHIM", "lgreco shim: rank %d/%d passed calls through because: %s", s.rank, s.size, reasons.c_str());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  retired_ += c;
}

nccl::Result Shim::comm_destroy(nccl::Comm comm) {
  // lgreco's buffers go while the communicator still exists (unless a call in flight on
  // another thread still holds them: then when it returns).
  detach_state(comm).reset();
  return api_.comm_destroy(comm);
}

nccl::Result Shim::comm_finalize(nccl::Comm comm) {
  detach_state(comm).reset();
  return api_.comm_finalize ? api_.comm_finalize(comm) : nccl::kInvalidUsage;
}

nccl::Result Shim::comm_abort(nccl::Comm comm) {
  // Out of the table first, so that a communicator NCCL creates with the same handle
  // starts afresh; then NCCL's abort, which stops kernels that may wait on a dead peer
  // (freeing lgreco's device memory before it could wait for them).
  StatePtr s = detach_state(comm);
  const nccl::Result r = api_.comm_abort(comm);
  s.reset();
  return r;
}

void Shim::record_error(CommState* s, const std::string& message) {
  if (s) s->count(&CommCounters::errors);
  const char* nccl_now = api_.get_last_error ? api_.get_last_error(s ? s->comm : nullptr) : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  last_error_ = message;
  nccl_error_then_ = nccl_now ? nccl_now : "";
}

const char* Shim::last_error(nccl::Comm comm) {
  // A copy per thread: the text stays valid until this thread asks again, whatever other
  // threads do meanwhile.
  thread_local std::string text;
  const char* nccl_now = api_.get_last_error ? api_.get_last_error(comm) : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!last_error_.empty() && nccl_error_then_ == (nccl_now ? nccl_now : "")) text = last_error_;
  else text = nccl_now ? nccl_now : "";
  return text.c_str();
}

std::optional<CommCounters> Shim::counters(nccl::Comm comm) const {
  StatePtr s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = comms_.find(comm);
    if (it == comms_.end()) return std::nullopt;
    s = it->second;
  }
  return s->snapshot();
}

CommCounters Shim::total_counters() const {
  std::vector<StatePtr> live;
  CommCounters t;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    t = retired_;
    for (const auto& [comm, s] : comms_) live.push_back(s);
  }
  for (const StatePtr& s : live) t += s->snapshot();
  return t;
}

void Shim::log_summaries() const {
  if (!log::enabled(log::Level::kInfo)) return;
  std::vector<StatePtr> live;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [comm, s] : comms_) live.push_back(s);
  }
  for (const StatePtr& s : live)
    LGRECO_INFO("SHIM", "%s (communicator %p at exit)", summary_line(s->rank, s->size, s->snapshot()).c_str(),
                static_cast<void*>(s->comm));
}

// ---------------------------------------------------------------------------------------
// Groups

nccl::Result Shim::group_start() {
  GroupState& g = group();
  const nccl::Result r = api_.group_start();
  if (r == nccl::kSuccess) ++g.depth;
  return r;
}

void Shim::note_other_operation() {
  GroupState& g = group();
  if (g.depth == 0 || g.mixed) return;
  g.mixed = true;
  if (g.deferred) {
    const Call deferred = *g.deferred;
    g.deferred.reset();
    // In the group, before the new operation: the user's order.
    if (StatePtr s = state_of(deferred.comm)) {
      s->count(&CommCounters::calls);
      pass(s.get(), deferred, kInGroup);
    } else {
      forward(deferred);
    }
  }
}

nccl::Result Shim::group_end() {
  GroupState& g = group();
  const nccl::Result r = api_.group_end();
  if (g.depth == 0) return r;  // unbalanced: NCCL says so
  if (--g.depth > 0) return r;
  std::optional<Call> deferred = std::move(g.deferred);
  g.deferred.reset();
  g.mixed = false;
  if (!deferred) return r;
  // The user's group held this allreduce alone: its ncclGroupEnd closed an empty group,
  // and the call runs now, as it would have at the end of the group.
  if (r != nccl::kSuccess && r != nccl::kInProgress) return r;
  return dispatch(*deferred);
}

nccl::Result Shim::group_simulate_end(void* sim_info) {
  if (!api_.group_simulate_end) return nccl::kInvalidUsage;
  note_other_operation();  // a deferred allreduce joins the simulated group
  GroupState& g = group();
  const nccl::Result r = api_.group_simulate_end(sim_info);
  if (g.depth > 0 && --g.depth == 0) g.mixed = false;
  return r;
}

// ---------------------------------------------------------------------------------------
// Allreduce

nccl::Result Shim::forward(const Call& c) {
  return api_.all_reduce(c.send, c.recv, c.count, c.dtype, c.op, c.comm, c.stream);
}

nccl::Result Shim::pass(CommState* s, const Call& call, const char* reason) {
  if (s) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(s->counters_mutex);
      ++s->counters.passed_through;
      auto& reasons = s->counters.pass_reasons;
      auto it = reasons.find(std::string_view(reason));
      if (it == reasons.end()) {
        first = true;
        it = reasons.emplace(reason, 0).first;
      }
      ++it->second;
    }
    if (first)
      LGRECO_INFO("SHIM", "rank %d/%d: an allreduce of %zu elements passes through: %s (logged once per reason)",
                  s->rank, s->size, call.count, reason);
  }
  return forward(call);
}

nccl::Result Shim::fail(CommState& s, const std::string& message) {
  if (s.agreement != CommState::Agreement::kBroken) {
    s.agreement = CommState::Agreement::kBroken;
    s.pass_reason = message;
    LGRECO_WARN("SHIM", "rank %d/%d: %s; this communicator's allreduce calls return ncclInternalError from now on",
                s.rank, s.size, message.c_str());
  }
  record_error(&s, "lgreco: " + message);
  return nccl::kInternalError;
}

const char* Shim::static_reason(const Call& c, bool agreed) const {
  if (c.op != nccl::kSum && c.op != nccl::kAvg) return kOp;
  DType dtype = DType::kFloat32;
  if (!compressible_dtype(c.dtype, &dtype)) return kType;
  const uint64_t bytes = c.count * dtype_size(dtype);
  if (!agreed) return bytes < kAgreementFloorBytes ? kTiny : "";
  if (bytes < options_.params.min_bytes) return kSmall;
  if (!c.send || !c.recv) return kNoBuffer;
  return "";
}

nccl::Result Shim::all_reduce(const void* send, void* recv, size_t count, nccl::DataType dtype, nccl::RedOp op,
                              nccl::Comm comm, nccl::Stream stream) {
  const Call call{send, recv, count, dtype, op, comm, stream};
  if (!disabled_.empty()) return forward(call);
  GroupState& g = group();
  if (g.depth > 0) {
    // The first operation of a group waits for the group's end; whether it may be
    // compressed is decided there, where every rank decides alike (shim.h).
    if (!g.mixed && !g.deferred) {
      g.deferred = call;
      return nccl::kSuccess;
    }
    note_other_operation();
    StatePtr s = state_of(comm);
    if (s) s->count(&CommCounters::calls);
    return pass(s.get(), call, kInGroup);
  }
  return dispatch(call);
}

nccl::Result Shim::dispatch(const Call& call) {
  // Held for the whole call: an abort or destroy on another thread cannot free the
  // state under it.
  const StatePtr s = state_of(call.comm);
  if (!s) return forward(call);
  try {
    return dispatch_on(*s, call);
  } catch (const std::exception& e) {
    // Nothing in dispatch_on throws by design; if something does, this call may have
    // queued work to peers, so it cannot quietly pass through.
    return fail(*s, std::string("unexpected error: ") + e.what());
  }
}

nccl::Result Shim::dispatch_on(CommState& s, const Call& call) {
  s.count(&CommCounters::calls);
  using Agreement = CommState::Agreement;
  if (s.agreement == Agreement::kBroken) {
    record_error(&s, "lgreco: an earlier failure on this communicator: " + s.pass_reason);
    return nccl::kInternalError;
  }
  // Before the agreement only what NCCL already requires to be the same on every rank
  // (the op, the type, the count) and what the application does alike (groups, capture)
  // may decide; after it, every setting is shared and the cheap checks come first.
  const char* reason = static_reason(call, s.agreement != Agreement::kPending);
  if (*reason) return pass(&s, call, reason);
  if (s.agreement == Agreement::kPassThrough) return pass(&s, call, s.pass_reason.c_str());
  if (s.size <= 1) return pass(&s, call, kOneRank);

  // What follows is known to this rank alone, so it may not pass the call through: its
  // peers would run lgreco's exchange against its NCCL allreduce (shim.h, "Agreement").
  // Capture is the application's doing, alike on every rank; a capture query that fails
  // (the legacy stream while another thread captures in global mode) fails NCCL's own
  // enqueue too, so the call fails here, with the reason.
  std::string capture_error;
  if (runtime_->capturing(call.stream, &capture_error)) {
    if (capture_error.empty()) return pass(&s, call, kCapturing);
    return fail(s, "cannot tell whether the call's stream is being captured into a CUDA graph (" + capture_error +
                       "), which lgreco must know before it enqueues anything");
  }
  // A communicator in error fails the call as NCCL's allreduce would, with NCCL's code and
  // nothing enqueued. One with a non-blocking operation in progress (the group a lone
  // allreduce closed, a split) goes on: the fabric settles it, bounded by LGRECO_TIMEOUT,
  // before its first operation (NcclFabric::settle).
  nccl::Result async = nccl::kSuccess;
  const nccl::Result queried = api_.comm_get_async_error(call.comm, &async);
  if (queried != nccl::kSuccess) async = queried;
  if (async != nccl::kSuccess && async != nccl::kInProgress) {
    record_error(&s, std::string("lgreco: the communicator reports an error (") + api_.error_string(async) +
                         "): the allreduce was not started");
    return async;
  }

  if (s.agreement == Agreement::kPending) {
    agree(s, call);
    if (s.agreement == Agreement::kBroken) {
      record_error(&s, "lgreco: " + s.pass_reason);
      return nccl::kInternalError;
    }
    if (s.agreement == Agreement::kPassThrough) return pass(&s, call, s.pass_reason.c_str());
    if (*(reason = static_reason(call, true))) return pass(&s, call, reason);
  }

  DType dtype = DType::kFloat32;
  compressible_dtype(call.dtype, &dtype);
  const config::Match m = s.matcher->match({reinterpret_cast<uintptr_t>(call.recv), call.count, dtype});
  if (m.kind == config::Match::Kind::kPassThrough) return pass(&s, call, m.reason);
  // The call's stream before the engine exists: a new engine allocates its buffers
  // stream-ordered, and they must not be queued on the previous call's stream.
  s.backend->set_stream(call.stream);
  s.fabric->set_stream(call.stream);
  if (!ensure_engine(s, m)) return fail(s, s.pass_reason);
  const int bucket = m.bucket < s.engine_bucket.size() ? s.engine_bucket[m.bucket] : -1;
  if (bucket < 0) return pass(&s, call, "no layout for this buffer");
  EngineCall ec;
  ec.bucket = static_cast<uint32_t>(bucket);
  ec.step = m.step;
  ec.send = call.send;
  ec.recv = call.recv;
  ec.count = call.count;
  ec.dtype = dtype;
  ec.op = call.op == nccl::kAvg ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum;
  ec.new_address = m.new_address;
  const uint64_t sent_before = s.engine->counters().wire_bytes_sent;
  const CallOutcome outcome = s.engine->allreduce(ec);
  {
    std::lock_guard<std::mutex> lock(s.counters_mutex);
    s.counters.host_waits = s.engine->counters().host_waits;
    s.counters.host_stalls = s.engine->counters().host_stalls;
  }
  switch (outcome.kind) {
    case CallOutcome::Kind::kDone: {
      std::lock_guard<std::mutex> lock(s.counters_mutex);
      ++s.counters.compressed;
      s.counters.gradient_bytes += call.count * dtype_size(dtype);
      s.counters.bytes_sent += s.engine->counters().wire_bytes_sent - sent_before;
    }
      if (!s.memory_reported) {
        s.memory_reported = true;
        LGRECO_INFO("SHIM", "rank %d/%d: compressing; lgreco holds %.1f MiB of device memory (error-feedback "
                    "residuals, staging, statistics) and %.1f KiB of pinned host memory on this communicator "
                    "(LGRECO_MAX_MEMORY=%llu, 0: no cap)",
                    s.rank, s.size, s.backend->device_bytes() / 1048576.0, s.backend->host_bytes() / 1024.0,
                    static_cast<unsigned long long>(options_.params.max_memory));
      }
      return nccl::kSuccess;
    case CallOutcome::Kind::kPassThrough:
      return pass(&s, call, "the engine passes this communicator through (its WARN says why)");
    case CallOutcome::Kind::kError:
      record_error(&s, outcome.message);
      return nccl::kInternalError;
  }
  return nccl::kInternalError;
}

// All ranks of the communicator exchange a digest of their configuration and whether
// they can compress; any difference makes every rank pass through (shim.h). Everything
// that can fail locally is done before anything is queued: a rank that then cannot take
// part is broken (its calls return errors), never quietly passing through while its
// peers wait in the exchange.
void Shim::agree(CommState& s, const Call& call) {
  using Agreement = CommState::Agreement;
  auto broken = [&](std::string why) {
    s.agreement = Agreement::kBroken;
    s.pass_reason = std::move(why);
    LGRECO_WARN("SHIM", "rank %d/%d: %s; this communicator's allreduce calls return ncclInternalError", s.rank,
                s.size, s.pass_reason.c_str());
  };
  // Every local problem from here on (no backend, no memory for the buffers) joins the
  // exchange as "cannot compress", so that every rank passes through together; only a rank
  // that cannot even get the exchange's few bytes of device memory is broken.
  std::string problem = local_problem_;
  try {
    s.backend = runtime_->create_backend(s.device, options_.params.max_memory);
    if (problem.empty()) problem = s.backend->unusable_reason();
  } catch (const std::exception& e) {
    s.backend.reset();
    if (problem.empty()) problem = std::string("cannot set up lgreco's CUDA backend: ") + e.what();
  }
  std::unique_ptr<ExchangeMemory> memory;
  std::unique_ptr<collective::Backend::Buffer> device_buffer, host_buffer;
  auto open_buffers = [&](std::unique_ptr<ExchangeMemory> m) {
    memory = std::move(m);
    // The call's stream before anything is enqueued: not the legacy default stream, which
    // waits for every blocking stream and breaks a global-mode capture elsewhere.
    memory->set_stream(call.stream);
    device_buffer = memory->allocate(sizeof(AgreementRecord) * (s.size + 1));
    // Pinned, so that the copy back is queued and the wait below is ours (a copy to
    // pageable memory would block inside CUDA).
    host_buffer = memory->allocate_host(sizeof(AgreementRecord) * s.size);
  };
  if (s.backend) {
    try {
      open_buffers(std::make_unique<BackendExchangeMemory>(*s.backend));
    } catch (const std::exception& e) {
      if (problem.empty()) problem = std::string("cannot allocate the configuration exchange's buffers: ") + e.what();
      device_buffer.reset(), host_buffer.reset(), memory.reset();
      s.backend.reset();
    }
  }
  if (!memory) {
    try {
      open_buffers(runtime_->exchange_memory(s.device));
    } catch (const std::exception& e) {
      return broken("cannot take part in lgreco's configuration exchange (CUDA device " + std::to_string(s.device) +
                    "): " + problem + "; " + e.what());
    }
    // The WARN after the exchange says why every rank passes through.
    LGRECO_INFO("SHIM", "rank %d/%d: %s; this rank takes part in the configuration exchange as unable to compress",
                s.rank, s.size, problem.c_str());
  }
  const std::chrono::milliseconds timeout(options_.params.timeout_seconds * 1000);
  s.fabric = std::make_unique<NcclFabric>(api_, s.comm, s.rank, s.size, timeout);
  s.fabric->set_abandoned_flag(&s.abandoned);
  s.fabric->set_stream(call.stream);

  const AgreementRecord mine{collective::digest(config_text_), problem.empty() ? 1u : 0u,
                             static_cast<uint32_t>(s.rank)};
  std::vector<AgreementRecord> all(s.size);
  try {
    auto* device = static_cast<uint8_t*>(device_buffer->data());
    memory->upload(device, &mine, sizeof mine);
    const std::vector<uint64_t> bytes(s.size, sizeof(AgreementRecord));
    s.fabric->all_gather_v(device, bytes, device + sizeof(AgreementRecord));
    auto ready = memory->read_back(host_buffer->data(), device + sizeof(AgreementRecord), host_buffer->bytes());
    // As long as NCCL would wait for a missing peer (the framework's watchdog bounds
    // that), saying so every LGRECO_TIMEOUT; an abort from another thread ends it.
    auto next_warning = std::chrono::steady_clock::now() + timeout;
    for (int warnings = 0; !ready->ready();) {
      if (s.abandoned.load(std::memory_order_acquire))
        throw collective::FabricError("the communicator was aborted or destroyed during the exchange");
      if (std::chrono::steady_clock::now() > next_warning) {
        LGRECO_WARN("SHIM", "rank %d/%d: still waiting after %d s for the other ranks to join lgreco's "
                    "configuration exchange (is LD_PRELOAD, or LGRECO_MODE=off, set on only some ranks?)",
                    s.rank, s.size, static_cast<int>((++warnings) * timeout.count() / 1000));
        next_warning += timeout;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    memcpy(all.data(), host_buffer->data(), host_buffer->bytes());
  } catch (const std::exception& e) {
    return broken(std::string("configuration exchange failed: ") + e.what());
  }
  auto give_up = [&](std::string reason) {
    s.agreement = Agreement::kPassThrough;
    s.pass_reason = std::move(reason);
    LGRECO_WARN("SHIM", "rank %d/%d: every allreduce of communicator %p passes through: %s", s.rank, s.size,
                static_cast<void*>(s.comm), s.pass_reason.c_str());
  };
  std::string differ, unable;
  for (int r = 0; r < s.size; ++r) {
    if (all[r].config_digest != all[0].config_digest) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    if (!all[r].ok) unable += (unable.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!differ.empty())
    return give_up("the LGRECO_* parameters, registration or lgreco version of rank(s) " + differ +
                   " differ from rank 0's");
  if (!unable.empty())
    return give_up("rank(s) " + unable + " cannot compress" + (problem.empty() ? "" : " (here: " + problem + ")"));
  s.agreement = Agreement::kAgreed;
  LGRECO_INFO("SHIM", "rank %d/%d: the ranks of communicator %p agree on lgreco's configuration", s.rank, s.size,
              static_cast<void*>(s.comm));
}

// The engine of the matcher's current pattern: one for the registration's buckets, or
// (auto mode) one per learned pattern. A layout the engine rejects still gets an engine,
// marked invalid (collective::make_engine_or_pass_through). Returns false (s.pass_reason
// says why) when not even that engine can be made: the communicator is then broken.
bool Shim::ensure_engine(CommState& s, const config::Match& match) {
  const bool registered = match.kind == config::Match::Kind::kRegistered;
  if (s.engine && (registered || s.engine_generation == s.matcher->pattern_generation())) return true;
  EngineOptions options = EngineOptions::from_params(options_.params, s.rank);
  std::vector<collective::BucketLayout> buckets;
  s.engine_bucket.clear();
  if (registered) {
    for (const config::RegisteredBucket& b : registration_->buckets) {
      s.engine_bucket.push_back(static_cast<int>(buckets.size()));
      buckets.push_back(collective::layout_from_registration(b, options));
    }
  } else {
    for (const config::RegisteredBucket* layout : s.matcher->auto_pattern_layouts()) {
      s.engine_bucket.push_back(layout ? static_cast<int>(buckets.size()) : -1);
      if (layout) buckets.push_back(collective::layout_from_registration(*layout, options));
    }
  }
  if (s.engine) {
    s.engine.reset();  // a new pattern: its buffers and residuals start afresh
    LGRECO_INFO("SHIM", "rank %d/%d: a new call pattern of %zu buffers; the engine starts again", s.rank, s.size,
                buckets.size());
  }
  s.engine_generation = s.matcher->pattern_generation();
  s.memory_reported = false;
  try {
    s.engine = collective::make_engine_or_pass_through(options, std::move(buckets), *s.fabric, *s.backend);
  } catch (const std::bad_alloc&) {
    s.pass_reason = "cannot allocate the engine's agreement buffer (LGRECO_MAX_MEMORY?)";
    return false;
  } catch (const std::exception& e) {
    s.pass_reason = std::string("cannot make the engine: ") + e.what();
    return false;
  }
  return true;
}

}  // namespace lgreco::shim
