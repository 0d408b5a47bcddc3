// The engine's Fabric over the real NCCL of the communicator it serves: the compressed
// bytes travel through NCCL itself, on the user's stream, by whichever transport NCCL
// chose (NVLink, InfiniBand, sockets, lgreco's net plugin).
//
//   all_to_all_v   one group of pncclSend/pncclRecv of ncclUint8, one pair per peer with
//                  bytes to move (this rank's own block too: NCCL copies it locally)
//   all_gather_v   pncclAllGather when every rank contributes the same bytes; otherwise
//                  a group of sends and receives straight into place, so that unequal
//                  contributions need neither padding nor staging copies
//   all_reduce_sum pncclAllReduce, float32/float64, in place
//
// Every operation only enqueues on the stream of set_stream() and returns: no host
// synchronisation, no allocation. Byte counts come from the engine's plans, computed on
// the host alike on every rank (fabric.h), so sends and receives always match.
//
// Where this fabric differs from fabric.h's contract, and why that is safe:
//  - all_reduce_sum gives every rank the same bits (NCCL reduces each element once and
//    then distributes it, in ring, tree and NVLS alike) but does not promise rank order.
//    The engine only sums statistics this way, and compares the assignments ranks derive
//    from them before switching, so a difference could only make ranks pass through.
//  - Waits: nothing here waits for data, so a dead peer is noticed where NCCL notices it
//    (its own timeouts, the framework's watchdog), not within LGRECO_TIMEOUT; and the
//    engine's host waits for read-backs (configuration agreement, window ends) last as
//    long as the stream takes. A non-blocking communicator's group may answer
//    ncclInProgress; the fabric then polls ncclCommGetAsyncError until the group is
//    enqueued, at most the timeout.
//  - abort() breaks this fabric only. It never aborts the user's communicator: the
//    framework owns it and aborts or destroys it itself after the error return (a second
//    abort would free it twice). Peers then fail through NCCL's and the framework's own
//    timeouts and error handling.
//  - Errors NCCL reports asynchronously (a peer's connection lost) are checked before
//    each operation through ncclCommGetAsyncError, and become FabricError.
#pragma once

#include <atomic>
#include <chrono>
#include <string>

#include "plugin/collective/fabric.h"
#include "plugin/shim/nccl_api.h"

namespace lgreco::shim {

class NcclFabric final : public collective::Fabric {
 public:
  // `api` must outlive the fabric. rank and size are the communicator's
  // (ncclCommUserRank, ncclCommCount).
  NcclFabric(const NcclApi& api, nccl::Comm comm, int rank, int size, std::chrono::milliseconds timeout);

  // The stream of the next operations (each call's own stream).
  void set_stream(nccl::Stream stream) { stream_ = stream; }
  // A flag another thread sets when the communicator is being aborted or destroyed: the
  // fabric then makes no further NCCL call on it and throws FabricError (it never
  // outlives the flag's owner).
  void set_abandoned_flag(const std::atomic<bool>* flag) { abandoned_ = flag; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  void all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                    std::span<const uint64_t> recv_bytes) override;
  void all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) override;
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  collective::FabricCounters counters() const override { return counters_; }
  void abort(const std::string& why) override;

 private:
  class Group;  // one ncclGroupStart/End, ended (and checked) once
  void begin(const char* operation);  // checks the fabric and the communicator
  // A failed result throws FabricError; ncclInProgress passes (inside a group) ...
  void check(nccl::Result result, const char* operation, const std::string& call);
  // ... or, for a call that ends an operation, is waited out.
  void finish(nccl::Result result, const char* operation, const std::string& call);
  void settle(const char* operation);  // waits out ncclInProgress, bounded
  [[noreturn]] void fail(const std::string& message);

  const NcclApi& api_;
  nccl::Comm comm_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  nccl::Stream stream_ = nullptr;
  const std::atomic<bool>* abandoned_ = nullptr;
  bool broken_ = false;
  std::string broken_reason_;
  collective::FabricCounters counters_;
};

}  // namespace lgreco::shim
