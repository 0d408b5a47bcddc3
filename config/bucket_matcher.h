// Which registered bucket (or auto-mode buffer) an allreduce call is, and which step of
// its communicator it belongs to. One BucketMatcher per communicator; calls come from one
// thread at a time (NCCL's rule for a communicator). Pure logic: no CUDA, no NCCL.
//
// A data-parallel job repeats the same allreduce calls every iteration: DDP calls its
// buckets, in the same order, at the same addresses. The matcher learns that repeating
// pattern from the calls themselves and compresses only calls that follow it:
//
//   considered calls   registered mode: calls whose (count, dtype) is a registered
//                      bucket's; auto mode: calls of at least min_bytes
//   recurring calls    considered calls whose buffer (address, count, dtype) occurred
//                      before among the last kHistory considered calls; one-off buffers
//                      (activations at fresh addresses, a temporary) are ignored
//   pattern            the sequence of recurring calls that repeated exactly twice in a
//                      row: registered mode, n distinct buffers whose counts and dtypes
//                      are the n registered buckets' in order (the bucket of each buffer
//                      follows); auto mode, the shortest repeating sequence
//   steps              a step begins each time the pattern's first call comes again, so
//                      steps count iterations; warm-up, periods and switch lags count them
//
// Until a pattern has been seen twice, nothing is compressed: DDP's first iteration (its
// buckets before the rebuild) can never be mistaken for the registered layout. While the
// calls follow the pattern, its buffers are compressed (auto mode: those called once per
// step; a buffer called several times per step is a workspace, not a gradient). A call of
// a pattern buffer out of its turn (a rebuilt or reallocated bucket, a changed model)
// drops the pattern: everything passes through until a new one has been seen twice.
// Registered mode: other buffers with a registered count and dtype that recur every step
// make the pattern longer than the registration, so nothing is compressed (safe, and the
// engine's WARN says why). Auto mode: a buffer outside the pattern that starts recurring
// makes the matcher look for a longer pattern that includes it.
//
// Ranks: every rank makes the same calls in the same order (NCCL requires it), and
// equality of addresses follows the same pattern on every rank as long as their
// allocations do (DDP's do); the engine's configuration agreement guards the rest.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "config/registration.h"

namespace lgreco::config {

struct MatcherSettings {
  bool auto_mode = true;  // used only without a registration
  uint64_t min_bytes = 256 * 1024;
  uint64_t segment_bytes = 1024 * 1024;
  // Auto mode: at most this many distinct (count, dtype) layouts; more pass through.
  uint32_t max_auto_layouts = 1024;
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
  // kRegistered: index into Registration::buckets. kAuto: the buffer's index among the
  // compressed buffers of the current pattern.
  uint32_t bucket = 0;
  // The layout: the registered bucket, or the auto layout for this count and dtype. Lives
  // as long as the matcher. Null when passed through.
  const RegisteredBucket* layout = nullptr;
  // First compressed call of this bucket (or auto index) at this address: state kept per
  // bucket (error-feedback residuals) belongs to another buffer and must start afresh.
  bool new_address = false;
  const char* reason = nullptr;  // kPassThrough: why (static text)
};

// Splits `count` elements into segments of segment_bytes (rounded down to whole groups of
// kMinCompressedElements, at least one group); a tail shorter than one group joins the
// segment before it. Segments have no shape.
RegisteredBucket auto_layout(uint64_t count, DType dtype, uint64_t segment_bytes);

class BucketMatcher {
 public:
  // Considered calls remembered to find the pattern; it must repeat within half of them.
  static constexpr size_t kHistory = 8192;

  // registration may be null: auto mode if settings.auto_mode, else nothing matches.
  BucketMatcher(std::shared_ptr<const Registration> registration, MatcherSettings settings);

  // For every eligible call (sum/avg of a float dtype; the shim filters the rest).
  Match match(const CallKey& call);

  uint64_t step() const { return step_; }
  bool has_pattern() const { return !pattern_.empty(); }

 private:
  bool considered(const CallKey& call) const;
  void remember(const CallKey& call);
  bool learn(const CallKey& call);
  bool adopt_registered(std::vector<CallKey> period);
  void adopt_auto(std::vector<CallKey> period);
  void drop_pattern();
  static size_t once_per_step(const std::vector<CallKey>& period);
  Match follow(const CallKey& call);
  const RegisteredBucket* auto_layout_for(const CallKey& call);

  std::shared_ptr<const Registration> registration_;
  MatcherSettings settings_;
  uint64_t step_ = 0;

  // Recent considered calls and how often each buffer occurs among them.
  std::deque<CallKey> history_;
  std::map<CallKey, uint32_t> history_count_;

  // The learned pattern: the calls of one step, in order, and the next one expected.
  std::vector<CallKey> pattern_;
  size_t next_ = 0;
  std::map<CallKey, uint32_t> target_;  // buffer -> bucket (registered) or auto index
  bool started_ = false;  // a step of the pattern has begun since it was learned

  // Auto mode: buffers outside the pattern seen since it was learned; when one of them
  // recurs, a longer pattern that includes it (at least min_period_ long) is looked for
  // until pending_deadline_; failing that, the buffer is ignored from then on.
  std::map<CallKey, size_t> outside_seen_;
  size_t min_period_ = 0;
  size_t required_once_ = 0;  // buffers called once per step in the dropped pattern
  bool pending_outside_ = false;
  CallKey pending_key_;
  uint64_t pending_deadline_ = 0;
  std::set<CallKey> ignored_;

  std::vector<CallKey> compressed_at_;  // per bucket / auto index: the last buffer compressed
  std::map<std::pair<uint64_t, DType>, std::unique_ptr<RegisteredBucket>> auto_layouts_;
  uint64_t calls_ = 0;  // considered calls so far (history positions)
};

}  // namespace lgreco::config
