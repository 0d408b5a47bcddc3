// Fabric: how the engine moves bytes between the ranks of one communicator.
//
// The engine's algorithms (plugin/collective/engine.h) are written once over this
// interface; the in-process fabric (ranks as threads), the socket fabric (ranks as
// processes, over plugin/transport) and, in the shim, the NCCL fabric implement it.
//
// Rules every implementation keeps:
//  - Calls are collective: every rank makes the same sequence of calls, and the byte
//    counts agree (what rank p sends to rank q is what q expects from p). Every count is
//    computed on the host from fixed-rate codec sizes before any data exists, so no
//    fabric ever exchanges sizes at run time (impossible under CUDA graph capture).
//  - Operations take effect in the order they are issued, on the queue the fabric was
//    built for. The NCCL fabric only enqueues on the user's CUDA stream and returns; the
//    CPU fabrics here complete each operation before returning. The engine therefore
//    never reads what an operation produced on the host except through its backend's
//    explicit read-back, and works unchanged either way.
//  - Reductions give every rank the same bits: elements are summed in rank order
//    (0, 1, ..., size-1), whatever the fabric's internal schedule.
//  - Waits are bounded (except the NCCL fabric's, which only enqueues and leaves the
//    waiting to NCCL and the framework: plugin/shim/nccl_fabric.h). A peer that does not
//    answer within the fabric's timeout, a closed connection or a size the peer
//    disagrees with throws FabricError naming the operation, the peer and the likely
//    cause. After an error the fabric is broken:
//    every later call throws at once (peers then fail too, instead of hanging).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace lgreco::collective {

class FabricError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What an exchange cost, for the controller's time objective and the benchmarks.
struct FabricCounters {
  uint64_t calls = 0;       // operations issued
  uint64_t bytes_sent = 0;  // payload bytes this rank put on the wire (peers only, not self)
  uint64_t bytes_received = 0;
  double busy_seconds = 0;  // wall time spent inside operations
};

class Fabric {
 public:
  virtual ~Fabric() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "inproc", "socket", "nccl": for logs and benchmark headers.
  virtual std::string name() const = 0;

  // All-to-all with per-peer byte counts. `send` holds the bytes for rank 0, then rank 1,
  // ..., send_bytes[q] of them for rank q (including this rank: copied locally). `recv`
  // receives recv_bytes[p] bytes from each rank p, in rank order. Both spans have size()
  // entries; recv_bytes[p] on this rank equals send_bytes[this rank] on rank p.
  virtual void all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                            std::span<const uint64_t> recv_bytes) = 0;

  // All-gather with per-rank byte counts: rank p contributes bytes[p] bytes (its `send`);
  // `recv` receives every rank's contribution in rank order (sum of bytes). `bytes` is
  // the same on every rank.
  virtual void all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) = 0;

  // In-place sums across ranks, summed in rank order: the same bits on every rank.
  virtual void all_reduce_sum(std::span<float> data) = 0;
  virtual void all_reduce_sum(std::span<double> data) = 0;

  virtual FabricCounters counters() const = 0;

  // Breaks the fabric on purpose: this rank failed in the middle of a collective and will
  // not come to the next operation. Peers waiting for it fail at once (a closed
  // connection, a broken hub; the NCCL fabric cannot: nccl_fabric.h) instead of waiting out the timeout,
  // and every later call here throws. Never throws; idempotent.
  //
  // Threads: the engine calls it from the thread that makes the fabric's calls, and
  // every implementation must allow that. The in-process and socket fabrics also allow
  // it from any other thread, even while an operation runs there (a watchdog): that
  // operation then ends with FabricError at once. An implementation that cannot must
  // say so in its header.
  virtual void abort(const std::string& why) = 0;
};

}  // namespace lgreco::collective
