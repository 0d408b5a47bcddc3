#include "tests/unit/fake_nccl.h"

#include <cstring>
#include <stdexcept>

#include "kernels/dtype.h"

namespace lgreco::test {

namespace {
FakeNccl* g_fake = nullptr;

size_t element_bytes(nccl::DataType t) {
  switch (t) {
    case nccl::kInt8:
    case nccl::kUint8: return 1;
    case nccl::kFloat16:
    case nccl::kBfloat16: return 2;
    case nccl::kInt32:
    case nccl::kUint32:
    case nccl::kFloat32: return 4;
    default: return 8;
  }
}

// Element i as a double / stored from a double, for the reductions.
double load(const uint8_t* p, nccl::DataType t, size_t i) {
  switch (t) {
    case nccl::kFloat16: return load_as_float(p, DType::kFloat16, i);
    case nccl::kBfloat16: return load_as_float(p, DType::kBFloat16, i);
    case nccl::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case nccl::kFloat64: return reinterpret_cast<const double*>(p)[i];
    case nccl::kInt32: return reinterpret_cast<const int32_t*>(p)[i];
    case nccl::kInt64: return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    case nccl::kUint8: return p[i];
    default: return static_cast<double>(reinterpret_cast<const int8_t*>(p)[i]);
  }
}
void store(uint8_t* p, nccl::DataType t, size_t i, double v) {
  switch (t) {
    case nccl::kFloat16: store_from_float(p, DType::kFloat16, i, static_cast<float>(v)); break;
    case nccl::kBfloat16: store_from_float(p, DType::kBFloat16, i, static_cast<float>(v)); break;
    case nccl::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
    case nccl::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
    case nccl::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case nccl::kInt64: reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case nccl::kUint8: p[i] = static_cast<uint8_t>(v); break;
    default: reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
  }
}

}  // namespace

struct FakeNccl::Op {
  enum class Kind : uint8_t { kAllReduce, kAllGather, kBroadcast, kSend, kRecv } kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  nccl::DataType dtype = nccl::kUint8;
  nccl::RedOp op = nccl::kSum;
  int peer = 0;  // send/recv: the peer; broadcast: the root
  const char* name() const {
    switch (kind) {
      case Kind::kAllReduce: return "allreduce";
      case Kind::kAllGather: return "allgather";
      case Kind::kBroadcast: return "broadcast";
      case Kind::kSend: return "send";
      case Kind::kRecv: return "recv";
    }
    return "?";
  }
};

struct FakeNccl::Rank {
  int rank = 0;
  Counts counts;
  std::vector<std::string> issued;
  nccl::Result async_result = nccl::kSuccess;
  int async_queries = 0;
  uint64_t fail_sends_from = 0, sends = 0;
  uint64_t fail_group_enqueue = 0, group_enqueues = 0;
  uint64_t next_round = 0;
};

struct FakeNccl::Round {
  Op::Kind kind;
  size_t count;
  nccl::DataType dtype;
  nccl::RedOp op;
  int root;
  std::vector<std::vector<uint8_t>> contributions;
  int arrived = 0, departed = 0;
};

// Per thread, as NCCL's own group state.
struct GroupQueue {
  int depth = 0;
  std::vector<std::pair<nccl::Comm, FakeNccl*>> owners;
};

FakeNccl::FakeNccl(int ranks, std::chrono::milliseconds timeout) : ranks_(ranks), timeout_(timeout) {
  if (g_fake) throw std::logic_error("FakeNccl: one at a time");
  for (int r = 0; r < ranks; ++r) {
    rank_state_.push_back(std::make_unique<Rank>());
    rank_state_.back()->rank = r;
  }
  g_fake = this;
}

FakeNccl::~FakeNccl() { g_fake = nullptr; }

nccl::Comm FakeNccl::comm(int rank) const { return reinterpret_cast<nccl::Comm>(rank_state_.at(rank).get()); }

FakeNccl::Rank& FakeNccl::rank_of(nccl::Comm comm) {
  for (auto& r : rank_state_)
    if (reinterpret_cast<nccl::Comm>(r.get()) == comm) return *r;
  throw std::logic_error("FakeNccl: unknown communicator");
}

void FakeNccl::set_async(int rank, nccl::Result result, int queries) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_state_.at(rank)->async_result = result;
  rank_state_.at(rank)->async_queries = queries;
}

void FakeNccl::fail_group_enqueue(int rank, uint64_t nth) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_state_.at(rank)->fail_group_enqueue = nth;
}

void FakeNccl::fail_sends_from(int rank, uint64_t nth) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_state_.at(rank)->fail_sends_from = nth;
}

FakeNccl::Counts FakeNccl::counts(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rank_state_.at(rank)->counts;
}

std::vector<std::string> FakeNccl::issued(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rank_state_.at(rank)->issued;
}

std::string FakeNccl::violation() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return violation_;
}

void FakeNccl::violate(const std::string& what) {  // mutex_ held
  if (violation_.empty()) violation_ = what;
  changed_.notify_all();
}

// ---------------------------------------------------------------------------------------
// Running operations

nccl::Result FakeNccl::collective(Rank& r, const Op& op) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t seq = r.next_round++;
  auto& slot = rounds_[seq];
  if (!slot) {
    slot = std::make_unique<Round>(Round{op.kind, op.count, op.dtype, op.op, op.peer, {}, 0, 0});
    slot->contributions.resize(ranks_);
  }
  Round& round = *slot;
  if (round.kind != op.kind || round.count != op.count || round.dtype != op.dtype || round.op != op.op ||
      round.root != op.peer) {
    violate("collective #" + std::to_string(seq) + ": rank " + std::to_string(r.rank) + " issued " + op.name() +
            " of " + std::to_string(op.count) + " elements, another rank a different collective");
    return nccl::kInvalidUsage;
  }
  const size_t bytes = op.count * element_bytes(op.dtype);
  const auto* src = static_cast<const uint8_t*>(op.send);
  if (op.kind != Op::Kind::kBroadcast || r.rank == op.peer) round.contributions[r.rank].assign(src, src + bytes);
  ++round.arrived;
  changed_.notify_all();
  if (!changed_.wait_for(lock, timeout_, [&] { return round.arrived == ranks_ || !violation_.empty(); }) ||
      round.arrived != ranks_) {
    violate("collective #" + std::to_string(seq) + " (" + op.name() + "): rank " + std::to_string(r.rank) +
            " waited for peers in vain");
    return nccl::kRemoteError;
  }
  auto* dst = static_cast<uint8_t*>(op.recv);
  switch (op.kind) {
    case Op::Kind::kAllReduce:
      for (size_t i = 0; i < op.count; ++i) {
        double v = load(round.contributions[0].data(), op.dtype, i);
        for (int q = 1; q < ranks_; ++q) {
          const double x = load(round.contributions[q].data(), op.dtype, i);
          v = op.op == nccl::kMax ? std::max(v, x) : op.op == nccl::kMin ? std::min(v, x) : v + x;
        }
        if (op.op == nccl::kAvg) v /= ranks_;
        store(dst, op.dtype, i, v);
      }
      break;
    case Op::Kind::kAllGather:
      for (int q = 0; q < ranks_; ++q) memcpy(dst + q * bytes, round.contributions[q].data(), bytes);
      break;
    case Op::Kind::kBroadcast: memcpy(dst, round.contributions[op.peer].data(), bytes); break;
    default: break;
  }
  if (++round.departed == ranks_) rounds_.erase(seq);
  return nccl::kSuccess;
}

nccl::Result FakeNccl::do_send(Rank& r, const Op& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++r.sends;
  if (r.fail_sends_from && r.sends >= r.fail_sends_from) return nccl::kRemoteError;
  const auto* src = static_cast<const uint8_t*>(op.send);
  channels_[{r.rank, op.peer}].emplace_back(src, src + op.count * element_bytes(op.dtype));
  changed_.notify_all();
  return nccl::kSuccess;
}

nccl::Result FakeNccl::do_recv(Rank& r, const Op& op) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto& channel = channels_[{op.peer, r.rank}];
  if (!changed_.wait_for(lock, timeout_, [&] { return !channel.empty() || !violation_.empty(); }) ||
      channel.empty()) {
    violate("rank " + std::to_string(r.rank) + " waited in vain for a message from rank " + std::to_string(op.peer));
    return nccl::kRemoteError;
  }
  std::vector<uint8_t> message = std::move(channel.front());
  channel.pop_front();
  const size_t bytes = op.count * element_bytes(op.dtype);
  if (message.size() != bytes) {
    violate("rank " + std::to_string(r.rank) + " expected " + std::to_string(bytes) + " bytes from rank " +
            std::to_string(op.peer) + ", which sent " + std::to_string(message.size()));
    return nccl::kInvalidUsage;
  }
  memcpy(op.recv, message.data(), bytes);
  return nccl::kSuccess;
}

nccl::Result FakeNccl::run(Rank& r, const Op& op) {
  switch (op.kind) {
    case Op::Kind::kSend: return do_send(r, op);
    case Op::Kind::kRecv: return do_recv(r, op);
    default: return collective(r, op);
  }
}

namespace {
thread_local int t_depth = 0;
thread_local nccl::Result t_group_error = nccl::kSuccess;  // NCCL's ncclGroupError
thread_local nccl::Comm t_group_error_comm = nullptr;      // whose enqueue failed
}  // namespace

// Queued operations of this thread's open group (opaque to the header).
struct FakeCalls {
  struct Queued {
    nccl::Comm comm;
    FakeNccl::Op op;
  };
  static std::vector<Queued>& queue() {
    thread_local std::vector<Queued> q;
    return q;
  }
};

nccl::Result FakeNccl::enqueue(nccl::Comm comm, Op op) {
  Rank& r = rank_of(comm);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    r.issued.push_back(op.name());
    switch (op.kind) {
      case Op::Kind::kAllReduce: ++r.counts.all_reduce; break;
      case Op::Kind::kAllGather: ++r.counts.all_gather; break;
      case Op::Kind::kBroadcast: ++r.counts.broadcast; break;
      case Op::Kind::kSend: ++r.counts.send; break;
      case Op::Kind::kRecv: ++r.counts.recv; break;
    }
  }
  if (t_depth > 0) {
    if (op.kind == Op::Kind::kSend || op.kind == Op::Kind::kRecv) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (r.fail_group_enqueue && ++r.group_enqueues == r.fail_group_enqueue) {
        t_group_error = nccl::kSystemError;
        t_group_error_comm = comm;
        return nccl::kSystemError;
      }
    }
    FakeCalls::queue().push_back({comm, op});
    return nccl::kSuccess;
  }
  return run(r, op);
}

// ---------------------------------------------------------------------------------------
// The API

namespace {

FakeNccl& fake() {
  if (!g_fake) throw std::logic_error("FakeNccl: none exists");
  return *g_fake;
}

}  // namespace

shim::NcclApi FakeNccl::api() {
  shim::NcclApi a;
  a.get_version = [](int* v) {
    *v = fake().version.load();
    return nccl::kSuccess;
  };
  a.get_error_string = [](nccl::Result r) -> const char* {
    static const char* const names[] = {"no error",        "unhandled cuda error", "unhandled system error",
                                        "internal error",  "invalid argument",     "invalid usage",
                                        "remote process exited or there was a network error", "operation in progress"};
    return r >= 0 && r < 8 ? names[r] : "unknown result code";
  };
  a.all_reduce = [](const void* s, void* r, size_t n, nccl::DataType t, nccl::RedOp op, nccl::Comm c, nccl::Stream) {
    return fake().enqueue(c, Op{Op::Kind::kAllReduce, s, r, n, t, op, 0});
  };
  a.all_gather = [](const void* s, void* r, size_t n, nccl::DataType t, nccl::Comm c, nccl::Stream) {
    return fake().enqueue(c, Op{Op::Kind::kAllGather, s, r, n, t, nccl::kSum, 0});
  };
  a.broadcast = [](const void* s, void* r, size_t n, nccl::DataType t, int root, nccl::Comm c, nccl::Stream) {
    return fake().enqueue(c, Op{Op::Kind::kBroadcast, s, r, n, t, nccl::kSum, root});
  };
  a.send = [](const void* d, size_t n, nccl::DataType t, int peer, nccl::Comm c, nccl::Stream) {
    return fake().enqueue(c, Op{Op::Kind::kSend, d, nullptr, n, t, nccl::kSum, peer});
  };
  a.recv = [](void* d, size_t n, nccl::DataType t, int peer, nccl::Comm c, nccl::Stream) {
    return fake().enqueue(c, Op{Op::Kind::kRecv, nullptr, d, n, t, nccl::kSum, peer});
  };
  a.group_start = []() {
    ++t_depth;
    return nccl::kSuccess;
  };
  a.group_end = []() {
    if (t_depth == 0) return nccl::kInvalidUsage;
    if (--t_depth > 0) return nccl::kSuccess;
    FakeNccl& f = fake();
    std::vector<FakeCalls::Queued> queued = std::move(FakeCalls::queue());
    FakeCalls::queue().clear();
    if (t_group_error != nccl::kSuccess) {
      // NCCL's groupCleanup: nothing of the group runs; the error is the group's result.
      const nccl::Result error = t_group_error;
      t_group_error = nccl::kSuccess;
      std::lock_guard<std::mutex> lock(f.mutex_);
      f.rank_of(t_group_error_comm).counts.dropped_groups++;
      return error;
    }
    nccl::Result result = nccl::kSuccess;
    std::vector<nccl::Comm> comms;
    for (const auto& q : queued)
      if (q.op.kind == Op::Kind::kSend && result == nccl::kSuccess) result = f.run(f.rank_of(q.comm), q.op);
    for (const auto& q : queued)
      if (q.op.kind != Op::Kind::kSend && result == nccl::kSuccess) result = f.run(f.rank_of(q.comm), q.op);
    for (const auto& q : queued) comms.push_back(q.comm);
    if (!comms.empty()) {
      std::lock_guard<std::mutex> lock(f.mutex_);
      f.rank_of(comms.front()).counts.group_end++;
    }
    if (result == nccl::kSuccess && f.non_blocking && !comms.empty()) {
      // The group runs "in the background": the next queries say so.
      std::lock_guard<std::mutex> lock(f.mutex_);
      Rank& r = f.rank_of(comms.front());
      r.async_result = nccl::kInProgress;
      r.async_queries = 3;
      return nccl::kInProgress;
    }
    return result;
  };
  a.comm_count = [](nccl::Comm c, int* n) {
    fake().rank_of(c);
    *n = fake().ranks();
    return nccl::kSuccess;
  };
  a.comm_user_rank = [](nccl::Comm c, int* r) {
    *r = fake().rank_of(c).rank;
    return nccl::kSuccess;
  };
  a.comm_cu_device = [](nccl::Comm c, int* d) {
    fake().rank_of(c);
    *d = 0;
    return nccl::kSuccess;
  };
  a.comm_get_async_error = [](nccl::Comm c, nccl::Result* out) {
    FakeNccl& f = fake();
    std::lock_guard<std::mutex> lock(f.mutex_);
    Rank& r = f.rank_of(c);
    *out = nccl::kSuccess;
    if (r.async_queries > 0) {
      --r.async_queries;
      *out = r.async_result;
    }
    return nccl::kSuccess;
  };
  auto lifecycle = [](nccl::Comm c, uint64_t Counts::*counter) {
    FakeNccl& f = fake();
    std::lock_guard<std::mutex> lock(f.mutex_);
    ++(f.rank_of(c).counts.*counter);
    return nccl::kSuccess;
  };
  static decltype(lifecycle) s_lifecycle = lifecycle;
  a.comm_destroy = [](nccl::Comm c) { return s_lifecycle(c, &Counts::destroy); };
  a.comm_abort = [](nccl::Comm c) { return s_lifecycle(c, &Counts::abort); };
  a.comm_finalize = [](nccl::Comm c) { return s_lifecycle(c, &Counts::finalize); };
  a.get_last_error = [](nccl::Comm) -> const char* { return "fake NCCL's last error"; };
  return a;
}

}  // namespace lgreco::test
