// The in-process fabric: ranks are threads of one process sharing an InProcHub. Used by
// the unit tests, lgreco-bench --fabric inproc and the demo.
//
// Each operation is two meetings of all ranks at the hub: every rank posts what it sends
// and waits for the others (meeting 1), copies what it receives straight from the
// senders' buffers, and waits until everyone has copied (meeting 2) before its buffers
// may change. Every rank checks every rank's posted operation and byte counts, so a
// mismatch is reported identically on all of them. A rank that does not come to a
// meeting within the timeout breaks the hub: every waiting and later call throws.
// Every check happens before any rank copies: a rank that throws between the meetings
// frees its buffers while the others might still read them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/collective/fabric.h"

namespace lgreco::collective {

class InProcHub {
 public:
  InProcHub(int ranks, std::chrono::milliseconds timeout);
  int ranks() const { return ranks_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Breaks the hub (as a dead rank would): waiting and later operations throw.
  void abort(const std::string& why);

 private:
  friend class InProcFabric;
  enum class Op : uint8_t { kAllToAll, kAllGather, kSumFloat, kSumDouble };
  struct Post {
    Op op;
    const void* send = nullptr;
    std::vector<uint64_t> send_bytes;  // all-to-all: per destination; all-gather: per rank
    std::vector<uint64_t> recv_bytes;  // all-to-all: per source
    uint64_t elements = 0;             // reductions
  };
  static const char* op_name(Op op);

  // Waits until all ranks have arrived at this meeting; throws FabricError on timeout or
  // abort. `phase` names the meeting in messages.
  void meet(int rank, const char* phase);

  const int ranks_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<bool> present_;  // who has arrived at the current meeting
  std::string broken_;         // why the hub is broken; empty while it works
  std::vector<Post> posts_;
};

class InProcFabric final : public Fabric {
 public:
  InProcFabric(std::shared_ptr<InProcHub> hub, int rank);

  int rank() const override { return rank_; }
  int size() const override { return hub_->ranks(); }
  std::string name() const override { return "inproc"; }

  void all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                    std::span<const uint64_t> recv_bytes) override;
  void all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) override;
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  FabricCounters counters() const override { return counters_; }
  void abort(const std::string& why) override { hub_->abort("rank " + std::to_string(rank_) + " aborted: " + why); }

 private:
  // Posts, meets, checks every rank's post against the op; returns after meeting 1.
  void post_and_meet(InProcHub::Post post);
  void check_posts(InProcHub::Op op);
  template <typename T>
  void sum(std::span<T> data, InProcHub::Op op);
  void finish(std::chrono::steady_clock::time_point start);

  std::shared_ptr<InProcHub> hub_;
  int rank_;
  FabricCounters counters_;
};

}  // namespace lgreco::collective
