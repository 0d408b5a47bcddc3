// A test double of NCCL's pncclXxx API for the shim's tests: the ranks of one job are
// threads of this process, "device" memory is host memory and every operation completes
// before it returns (the way the CPU backend does), so the shim, the engine and the NCCL
// fabric run unchanged on a machine without a GPU.
//
// It behaves as NCCL does where the shim relies on it: operations inside
// ncclGroupStart/End are queued per thread and run at the outermost group end (sends
// first, so grouped exchanges never deadlock); collectives of one communicator are
// matched across ranks in issue order; a send is matched with the receive of the same
// pair in order, and byte counts must agree. Where NCCL would hang or corrupt data
// (mismatched collectives, sizes that differ) it records a violation, returns an error,
// and never waits longer than its timeout.
//
// The API is plain function pointers, so the double is a process-wide singleton: one
// FakeNccl exists at a time (tests run sequentially).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/shim/nccl_api.h"

namespace lgreco::test {

class FakeNccl {
 public:
  explicit FakeNccl(int ranks, std::chrono::milliseconds timeout = std::chrono::seconds(20));
  ~FakeNccl();
  FakeNccl(const FakeNccl&) = delete;
  FakeNccl& operator=(const FakeNccl&) = delete;

  int ranks() const { return ranks_; }
  nccl::Comm comm(int rank) const;
  static shim::NcclApi api();  // every entry filled

  // Knobs.
  std::atomic<int> version{22809};
  // The next `queries` ncclCommGetAsyncError calls of `rank` answer `result`.
  void set_async(int rank, nccl::Result result, int queries);
  // ncclGroupEnd answers ncclInProgress on `rank` (a non-blocking communicator), and the
  // next few ncclCommGetAsyncError queries stay in progress.
  std::atomic<bool> non_blocking{false};
  // The rank's sends fail (ncclRemoteError) from its n-th send on (counting from 1).
  void fail_sends_from(int rank, uint64_t nth);
  // The rank's n-th ncclSend/ncclRecv enqueued inside a group (counting from 1) fails to
  // enqueue (ncclSystemError), as NCCL 2.28.9 does when it cannot record the task: its
  // ncclGroupErrCheck keeps the error for the thread's group, and ncclGroupEnd then
  // launches nothing of that group (groupCleanup drops every queued task) and returns it.
  void fail_group_enqueue(int rank, uint64_t nth);

  // What happened.
  struct Counts {
    uint64_t all_reduce = 0, all_gather = 0, send = 0, recv = 0, broadcast = 0;
    uint64_t group_end = 0, destroy = 0, abort = 0, finalize = 0;
    uint64_t dropped_groups = 0;  // groups a failed enqueue cancelled (fail_group_enqueue)
  };
  Counts counts(int rank) const;
  // Operations the rank issued, in order ("allreduce", "broadcast", "send", ...).
  std::vector<std::string> issued(int rank) const;
  std::string violation() const;  // the first protocol violation, "" if none

 private:
  struct Rank;
  struct Round;
  struct Op;
  friend struct FakeCalls;

  Rank& rank_of(nccl::Comm comm);
  void violate(const std::string& what);
  nccl::Result run(Rank& r, const Op& op);
  nccl::Result enqueue(nccl::Comm comm, Op op);
  nccl::Result collective(Rank& r, const Op& op);
  nccl::Result do_send(Rank& r, const Op& op);
  nccl::Result do_recv(Rank& r, const Op& op);

  const int ranks_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Rank>> rank_state_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<uint64_t, std::unique_ptr<Round>> rounds_;               // by sequence number
  std::map<std::pair<int, int>, std::deque<std::vector<uint8_t>>> channels_;  // (from, to)
  std::string violation_;
};

}  // namespace lgreco::test
