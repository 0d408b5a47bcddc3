#include "plugin/collective/inproc_fabric.h"

#include <cstring>
#include <numeric>

namespace lgreco::collective {

InProcHub::InProcHub(int ranks, std::chrono::milliseconds timeout)
    : ranks_(ranks), timeout_(timeout), present_(ranks, false), posts_(ranks) {
  if (ranks < 1) throw std::invalid_argument("in-process fabric: needs at least one rank");
}

const char* InProcHub::op_name(Op op) {
  switch (op) {
    case Op::kAllToAll: return "all_to_all_v";
    case Op::kAllGather: return "all_gather_v";
    case Op::kSumFloat: return "all_reduce_sum(float)";
    case Op::kSumDouble: return "all_reduce_sum(double)";
  }
  return "?";
}

void InProcHub::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_.empty()) broken_ = why;
  cv_.notify_all();
}

void InProcHub::meet(int rank, const char* phase) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!broken_.empty()) throw FabricError("in-process fabric is broken: " + broken_);
  const uint64_t generation = generation_;
  present_[rank] = true;
  if (++arrived_ == ranks_) {
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), false);
    ++generation_;
    cv_.notify_all();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (generation_ == generation && broken_.empty()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation && broken_.empty()) {
      std::string missing;
      for (int r = 0; r < ranks_; ++r)
        if (!present_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      broken_ = "rank " + std::to_string(rank) + " waited " + std::to_string(timeout_.count()) +
                " ms in " + phase + " for rank(s) " + missing + " (dead or stalled?)";
      cv_.notify_all();
    }
  }
  if (generation_ == generation) throw FabricError("in-process fabric is broken: " + broken_);
}

InProcFabric::InProcFabric(std::shared_ptr<InProcHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {
  if (rank < 0 || rank >= hub_->ranks())
    throw std::invalid_argument("in-process fabric: rank " + std::to_string(rank) + " of " +
                                std::to_string(hub_->ranks()));
}

void InProcFabric::post_and_meet(InProcHub::Post post) {
  {
    std::lock_guard<std::mutex> lock(hub_->mutex_);
    hub_->posts_[rank_] = std::move(post);
  }
  hub_->meet(rank_, "the meeting that starts an operation");
}

// Every rank runs the same checks on the same posts, so all of them fail alike.
void InProcFabric::check_posts(InProcHub::Op op) {
  const int n = hub_->ranks();
  std::string problem;
  // Rank 0's operation is the reference, so that every rank names the same culprit.
  for (int p = 1; p < n && problem.empty(); ++p)
    if (hub_->posts_[p].op != hub_->posts_[0].op)
      problem = "rank " + std::to_string(p) + " called " + InProcHub::op_name(hub_->posts_[p].op) +
                " while rank 0 called " + InProcHub::op_name(hub_->posts_[0].op);
  for (int p = 0; p < n && problem.empty(); ++p) {
    const InProcHub::Post& post = hub_->posts_[p];
    if (post.op != op) {
      problem = "rank " + std::to_string(p) + " called " + InProcHub::op_name(post.op);
    } else if ((op == InProcHub::Op::kAllToAll || op == InProcHub::Op::kAllGather) &&
               post.send_bytes.size() != static_cast<size_t>(n)) {
      problem = "rank " + std::to_string(p) + " gave " + std::to_string(post.send_bytes.size()) + " byte counts for " +
                std::to_string(n) + " ranks";
    } else if (op == InProcHub::Op::kAllToAll && post.recv_bytes.size() != static_cast<size_t>(n)) {
      problem = "rank " + std::to_string(p) + " expects data from " + std::to_string(post.recv_bytes.size()) +
                " ranks of " + std::to_string(n);
    } else if (op == InProcHub::Op::kAllGather && post.send_bytes != hub_->posts_[0].send_bytes) {
      problem = "ranks 0 and " + std::to_string(p) + " disagree on the all_gather_v byte counts";
    } else if ((op == InProcHub::Op::kSumFloat || op == InProcHub::Op::kSumDouble) &&
               post.elements != hub_->posts_[0].elements) {
      problem = "ranks 0 and " + std::to_string(p) + " reduce " + std::to_string(hub_->posts_[0].elements) + " and " +
                std::to_string(post.elements) + " elements";
    }
  }
  // All-to-all: what each rank sends each other rank is what that rank expects.
  for (int p = 0; p < n && problem.empty() && op == InProcHub::Op::kAllToAll; ++p)
    for (int q = 0; q < n && problem.empty(); ++q) {
      const uint64_t sent = hub_->posts_[p].send_bytes[q], expected = hub_->posts_[q].recv_bytes[p];
      if (sent != expected)
        problem = "rank " + std::to_string(q) + " expects " + std::to_string(expected) + " bytes from rank " +
                  std::to_string(p) + ", which sends " + std::to_string(sent);
    }
  if (!problem.empty()) {
    hub_->abort(problem + " (mismatched configuration between ranks?)");
    throw FabricError("in-process fabric: " + problem + " (mismatched configuration between ranks?)");
  }
}

void InProcFabric::finish(std::chrono::steady_clock::time_point start) {
  hub_->meet(rank_, "the meeting that ends an operation");
  ++counters_.calls;
  counters_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void InProcFabric::all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                                std::span<const uint64_t> recv_bytes) {
  const auto start = std::chrono::steady_clock::now();
  const int n = hub_->ranks();
  if (send_bytes.size() != static_cast<size_t>(n) || recv_bytes.size() != static_cast<size_t>(n))
    throw FabricError("all_to_all_v: byte counts for " + std::to_string(send_bytes.size()) + "/" +
                      std::to_string(recv_bytes.size()) + " ranks, the fabric has " + std::to_string(n));
  post_and_meet({InProcHub::Op::kAllToAll, send, {send_bytes.begin(), send_bytes.end()},
                 {recv_bytes.begin(), recv_bytes.end()}, 0});
  check_posts(InProcHub::Op::kAllToAll);
  uint64_t at = 0;
  for (int p = 0; p < n; ++p) {
    const InProcHub::Post& post = hub_->posts_[p];
    const uint64_t size = post.send_bytes[rank_];
    const uint64_t offset = std::accumulate(post.send_bytes.begin(), post.send_bytes.begin() + rank_, uint64_t{0});
    if (size) memcpy(recv + at, static_cast<const uint8_t*>(post.send) + offset, size);
    at += size;
    if (p != rank_) counters_.bytes_received += size;
  }
  for (int q = 0; q < n; ++q)
    if (q != rank_) counters_.bytes_sent += send_bytes[q];
  finish(start);
}

void InProcFabric::all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) {
  const auto start = std::chrono::steady_clock::now();
  const int n = hub_->ranks();
  post_and_meet({InProcHub::Op::kAllGather, send, {bytes.begin(), bytes.end()}, {}, 0});
  check_posts(InProcHub::Op::kAllGather);
  uint64_t at = 0;
  for (int p = 0; p < n; ++p) {
    if (bytes[p]) memcpy(recv + at, hub_->posts_[p].send, bytes[p]);
    at += bytes[p];
    if (p != rank_) counters_.bytes_received += bytes[p];
  }
  counters_.bytes_sent += bytes[rank_] * (n - 1);
  finish(start);
}

template <typename T>
void InProcFabric::sum(std::span<T> data, InProcHub::Op op) {
  const auto start = std::chrono::steady_clock::now();
  const int n = hub_->ranks();
  std::vector<T> total(data.size(), T(0));  // before posting: nothing may throw between the meetings
  post_and_meet({op, data.data(), {}, {}, data.size()});
  check_posts(op);
  for (int p = 0; p < n; ++p) {  // rank order: the same bits everywhere
    const T* from = static_cast<const T*>(hub_->posts_[p].send);
    for (size_t i = 0; i < data.size(); ++i) total[i] += from[i];
  }
  counters_.bytes_sent += data.size_bytes() * (n - 1);
  counters_.bytes_received += data.size_bytes() * (n - 1);
  hub_->meet(rank_, "the meeting after a reduction's reads");  // peers have read our data
  std::copy(total.begin(), total.end(), data.begin());
  ++counters_.calls;
  counters_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void InProcFabric::all_reduce_sum(std::span<float> data) { sum(data, InProcHub::Op::kSumFloat); }
void InProcFabric::all_reduce_sum(std::span<double> data) { sum(data, InProcHub::Op::kSumDouble); }

}  // namespace lgreco::collective
