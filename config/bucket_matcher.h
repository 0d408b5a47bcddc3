// Which registered bucket (or auto-mode buffer) an allreduce call is, and which step of
// its communicator it belongs to. One BucketMatcher per communicator; calls come from one
// thread at a time (NCCL's rule for a communicator). Pure logic: no CUDA, no NCCL.
//
// Steps. DDP calls its buckets in the same order every iteration, so a step begins each
// time the first bucket of the previous step is called again:
//   registered mode: a call that matches bucket 0's count and dtype begins a step when it
//     is the buffer that began the previous step, or when this step has already passed
//     every registered bucket of that count and dtype;
//   auto mode: a call begins a step when it is the buffer that began the current step,
//     or any buffer already called in the current step (the layout changed).
// Warm-up, periods and switch lags count these steps (controller/schedule.h).
//
// Matching. Registered: by count and dtype, and among buckets sharing both, by their
// order within the step. Auto: buffers of at least min_bytes, by (address, count,
// dtype), split into fixed segments that act as layers.
//
// Confirmation. A call is compressed only when the same buffer (address, count, dtype)
// was the same bucket in the previous step. So the first step never compresses, and
// neither does the step after a layout change: DDP's first iteration, before it rebuilds
// its buckets, can never be mistaken for the registered layout, and a buffer that does
// not recur every step (activations, metrics) is never compressed in auto mode.
//
// Ranks: every rank makes the same calls in the same order (NCCL requires it), and
// equality of addresses follows the same pattern on every rank as long as their
// allocations do (DDP's do); the engine's configuration agreement guards the rest.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "config/registration.h"

namespace lgreco::config {

struct MatcherSettings {
  bool auto_mode = true;          // used only without a registration
  uint64_t min_bytes = 256 * 1024;
  uint64_t segment_bytes = 1024 * 1024;
  // Auto mode: at most this many distinct recurring buffers get a layout; more pass
  // through (a bound on memory if addresses churn).
  uint32_t max_auto_buckets = 1024;
};

struct CallKey {
  uintptr_t address = 0;
  uint64_t count = 0;
  DType dtype = DType::kFloat32;
  friend auto operator<=>(const CallKey&, const CallKey&) = default;
};

struct Match {
  enum class Kind : uint8_t { kPassThrough, kRegistered, kAuto };
  Kind kind = Kind::kPassThrough;
  uint64_t step = 0;  // the communicator's step this call belongs to
  // kRegistered: index into Registration::buckets. kAuto: the buffer's auto-bucket id.
  uint32_t bucket = 0;
  // The layout: the registered bucket, or the auto bucket's segments. Null when passed through.
  const RegisteredBucket* layout = nullptr;
  // First compressed call of this bucket at this address: state kept per bucket (error
  // feedback residuals) belongs to another buffer and must start afresh.
  bool new_address = false;
  const char* reason = nullptr;  // kPassThrough: why (static text)
};

// Splits `count` elements into segments of segment_bytes (rounded down to whole groups of
// kMinCompressedElements, at least one group); a tail shorter than one group joins the
// segment before it. Segments have no shape.
RegisteredBucket auto_layout(uint64_t count, DType dtype, uint64_t segment_bytes, uint32_t id);

class BucketMatcher {
 public:
  // registration may be null: auto mode if settings.auto_mode, else nothing matches.
  BucketMatcher(std::shared_ptr<const Registration> registration, MatcherSettings settings);

  // For every eligible call (sum/avg of a float dtype; the shim filters the rest).
  Match match(const CallKey& call);

  uint64_t step() const { return step_; }
  bool started() const { return started_; }

 private:
  Match match_registered(const CallKey& call);
  Match match_auto(const CallKey& call);
  void begin_step(const CallKey& first);

  std::shared_ptr<const Registration> registration_;
  MatcherSettings settings_;
  uint64_t step_ = 0;
  bool started_ = false;  // a step has begun
  CallKey first_;         // the call that began the current step

  // Registered mode: what each bucket was in this step and the previous one.
  static constexpr CallKey kUnmatched{};
  size_t cursor_ = 0;  // the next bucket this step may match
  std::vector<CallKey> current_, previous_, compressed_at_;

  // Auto mode: the buffers called in this step and the previous one.
  std::set<CallKey> seen_, seen_before_;
  std::map<CallKey, uint32_t> auto_ids_;
  std::vector<std::unique_ptr<RegisteredBucket>> auto_layouts_;
};

}  // namespace lgreco::config
