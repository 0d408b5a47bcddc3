#include "plugin/shim/nccl_fabric.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace lgreco::shim {

using collective::FabricError;

// One ncclGroupStart/End. end() is called once on the success path and checked; on an
// exception the destructor still closes the group, so that NCCL's per-thread group depth
// goes back to where the framework left it.
class NcclFabric::Group {
 public:
  Group(NcclFabric& fabric, const char* operation) : fabric_(fabric), operation_(operation) {
    fabric_.check(fabric_.api_.group_start(), operation_, "ncclGroupStart");
    open_ = true;
  }
  ~Group() {
    if (open_) fabric_.api_.group_end();
  }
  void end() {
    open_ = false;
    const nccl::Result r = fabric_.api_.group_end();
    fabric_.finish(r, operation_, "ncclGroupEnd");
  }

 private:
  NcclFabric& fabric_;
  const char* operation_;
  bool open_ = false;
};

NcclFabric::NcclFabric(const NcclApi& api, nccl::Comm comm, int rank, int size, std::chrono::milliseconds timeout)
    : api_(api), comm_(comm), rank_(rank), size_(size), timeout_(timeout) {}

void NcclFabric::fail(const std::string& message) {
  if (!broken_) {
    broken_ = true;
    broken_reason_ = message;
  }
  throw FabricError(message);
}

void NcclFabric::abort(const std::string& why) {
  if (broken_) return;
  broken_ = true;
  broken_reason_ = "aborted: " + why;
}

void NcclFabric::check(nccl::Result result, const char* operation, const std::string& call) {
  if (result == nccl::kSuccess || result == nccl::kInProgress) return;
  std::string message = std::string("NCCL fabric ") + operation + ": " + call + " failed on rank " +
                        std::to_string(rank_) + ": " + api_.error_string(result);
  if (api_.get_last_error) {
    const char* last = api_.get_last_error(comm_);
    if (last && *last) message += " (" + std::string(last) + ")";
  }
  fail(message);
}

void NcclFabric::finish(nccl::Result result, const char* operation, const std::string& call) {
  if (result == nccl::kInProgress) return settle(operation);
  check(result, operation, call);
}

void NcclFabric::begin(const char* operation) {
  if (broken_) throw FabricError(std::string("NCCL fabric ") + operation + ": broken by an earlier error: " +
                                 broken_reason_);
  if (abandoned_ && abandoned_->load(std::memory_order_acquire))
    fail(std::string("NCCL fabric ") + operation + ": the communicator is being aborted or destroyed");
  nccl::Result async = nccl::kSuccess;
  check(api_.comm_get_async_error(comm_, &async), operation, "ncclCommGetAsyncError");
  if (async == nccl::kInProgress) settle(operation);
  else if (async != nccl::kSuccess)
    fail(std::string("NCCL fabric ") + operation + ": the communicator reports an asynchronous error on rank " +
         std::to_string(rank_) + ": " + api_.error_string(async) + " (a peer failed or the network broke)");
  ++counters_.calls;
}

// A non-blocking communicator enqueues a group in the background: its result is known
// when ncclCommGetAsyncError stops answering ncclInProgress.
void NcclFabric::settle(const char* operation) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (unsigned spins = 0;; ++spins) {
    if (abandoned_ && abandoned_->load(std::memory_order_acquire))
      fail(std::string("NCCL fabric ") + operation + ": the communicator is being aborted or destroyed");
    nccl::Result async = nccl::kSuccess;
    check(api_.comm_get_async_error(comm_, &async), operation, "ncclCommGetAsyncError");
    if (async == nccl::kSuccess) return;
    if (async != nccl::kInProgress)
      fail(std::string("NCCL fabric ") + operation + ": the communicator's operation failed on rank " +
           std::to_string(rank_) + ": " + api_.error_string(async));
    if (std::chrono::steady_clock::now() > deadline)
      fail(std::string("NCCL fabric ") + operation + ": the non-blocking communicator stayed in progress for " +
           std::to_string(timeout_.count()) + " ms on rank " + std::to_string(rank_) + " (LGRECO_TIMEOUT)");
    if (spins < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclFabric::all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                              std::span<const uint64_t> recv_bytes) {
  static constexpr const char* kOp = "all_to_all_v";
  begin(kOp);
  if (send_bytes.size() != static_cast<size_t>(size_) || recv_bytes.size() != static_cast<size_t>(size_))
    fail("NCCL fabric all_to_all_v: byte counts for " + std::to_string(send_bytes.size()) + "/" +
         std::to_string(recv_bytes.size()) + " ranks on a communicator of " + std::to_string(size_));
  Group group(*this, kOp);
  uint64_t send_at = 0, recv_at = 0;
  for (int q = 0; q < size_; ++q) {
    // This rank's own block goes through NCCL too (a local copy on the stream), which
    // keeps the fabric free of any copy kernel of its own.
    if (send_bytes[q] > 0) {
      check(api_.send(send + send_at, send_bytes[q], nccl::kUint8, q, comm_, stream_), kOp,
            "ncclSend to rank " + std::to_string(q));
      if (q != rank_) counters_.bytes_sent += send_bytes[q];
    }
    if (recv_bytes[q] > 0) {
      check(api_.recv(recv + recv_at, recv_bytes[q], nccl::kUint8, q, comm_, stream_), kOp,
            "ncclRecv from rank " + std::to_string(q));
      if (q != rank_) counters_.bytes_received += recv_bytes[q];
    }
    send_at += send_bytes[q];
    recv_at += recv_bytes[q];
  }
  group.end();
}

void NcclFabric::all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) {
  static constexpr const char* kOp = "all_gather_v";
  begin(kOp);
  if (bytes.size() != static_cast<size_t>(size_))
    fail("NCCL fabric all_gather_v: byte counts for " + std::to_string(bytes.size()) + " ranks on a communicator of " +
         std::to_string(size_));
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  const uint64_t mine = bytes[rank_];
  counters_.bytes_sent += mine * (size_ - 1);
  counters_.bytes_received += total - mine;
  if (total == 0) return;
  if (std::all_of(bytes.begin(), bytes.end(), [&](uint64_t b) { return b == bytes[0]; })) {
    finish(api_.all_gather(send, recv, mine, nccl::kUint8, comm_, stream_), kOp, "ncclAllGather");
    return;
  }
  Group group(*this, kOp);
  uint64_t at = 0;
  for (int q = 0; q < size_; ++q) {
    const bool in_place = q == rank_ && recv + at == send;
    if (mine > 0 && !(q == rank_ && in_place))
      check(api_.send(send, mine, nccl::kUint8, q, comm_, stream_), kOp, "ncclSend to rank " + std::to_string(q));
    if (bytes[q] > 0 && !in_place)
      check(api_.recv(recv + at, bytes[q], nccl::kUint8, q, comm_, stream_), kOp,
            "ncclRecv from rank " + std::to_string(q));
    at += bytes[q];
  }
  group.end();
}

void NcclFabric::all_reduce_sum(std::span<float> data) {
  begin("all_reduce_sum(float)");
  if (data.empty()) return;
  finish(api_.all_reduce(data.data(), data.data(), data.size(), nccl::kFloat32, nccl::kSum, comm_, stream_),
        "all_reduce_sum(float)", "ncclAllReduce");
}

void NcclFabric::all_reduce_sum(std::span<double> data) {
  begin("all_reduce_sum(double)");
  if (data.empty()) return;
  finish(api_.all_reduce(data.data(), data.data(), data.size(), nccl::kFloat64, nccl::kSum, comm_, stream_),
        "all_reduce_sum(double)", "ncclAllReduce");
}

}  // namespace lgreco::shim
