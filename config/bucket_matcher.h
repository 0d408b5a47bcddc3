// Which registered bucket (or auto-mode buffer) an allreduce call is, and which step of
// its communicator it belongs to. One BucketMatcher per communicator; calls come from one
// thread at a time (NCCL's rule for a communicator). Pure logic: no CUDA, no NCCL.
//
// A data-parallel job repeats the same allreduce calls every iteration: DDP calls its
// buckets in the same order, at the same addresses. The matcher learns that repeating
// pattern from the calls themselves and compresses only calls that follow it:
//
//   considered calls   registered mode: calls whose (count, dtype) is a registered
//                      bucket's; auto mode: calls of at least min_bytes
//   recurring calls    considered calls whose buffer (address, count, dtype) was already
//                      called among the last kHistory considered calls. A buffer's first
//                      call never is one, so buffers at fresh addresses (activations,
//                      temporaries) never take part in a pattern.
//   pattern            registered mode: n distinct recurring buffers that came twice in a
//                      row in the same order, with the counts and dtypes of the n
//                      registered buckets (so each buffer's bucket follows). Auto mode: a
//                      period that repeated for at least kMinAutoRun calls among the
//                      buffers that recur at least once per period (rarer ones, such as an
//                      evaluation every N steps, are left out if they are at most 30% of
//                      the calls); of several, the one whose share of once-per-step calls
//                      is largest (gradient buckets are called once per iteration, a
//                      workspace several times).
//   steps              a step begins each time the pattern's first call comes again, so
//                      steps count iterations; warm-up, periods and switch lags count them
//
// Until a pattern is known, nothing is compressed: DDP's first iteration (its buckets
// before the rebuild) can never be mistaken for the registered layout. Compression starts
// with the first step after the pattern was learned. Then the pattern's buffers are
// compressed (auto mode: those called once per step). The pattern is dropped, and
// everything passes through until a new one is learned, when a pattern buffer comes out
// of turn (a rebuilt or reallocated bucket) or when a buffer outside the pattern recurs
// with no pattern call since its previous call (the pattern's buffers are gone: a new
// model). Registered mode: another recurring buffer with a registered count and dtype
// keeps the registered pattern from ever being learned (lgreco will not guess which buffer
// is which bucket); one-off buffers do not.
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
#include <unordered_map>
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
  // Considered calls remembered: a buffer recurs if called again within this many.
  static constexpr size_t kHistory = 8192;
  // Auto mode: the longest pattern, and the repeated calls needed before one is used.
  static constexpr size_t kMaxAutoPeriod = 1024;
  static constexpr size_t kMinAutoRun = 32;
  // At most this share of recurring calls may be left out of an auto-mode period.
  static constexpr struct { size_t num, den; } kMaxLeftOut{3, 10};

  // registration may be null: auto mode if settings.auto_mode, else nothing matches.
  BucketMatcher(std::shared_ptr<const Registration> registration, MatcherSettings settings);

  // For every eligible call (sum/avg of a float dtype; the shim filters the rest).
  Match match(const CallKey& call);

  uint64_t step() const { return step_; }
  bool has_pattern() const { return !pattern_.empty(); }
  // Counts the patterns learned so far: a caller that keeps state per pattern (the shim's
  // engine in auto mode) starts afresh when it changes.
  uint64_t pattern_generation() const { return adoptions_; }
  // Auto mode: the layout of each auto index (Match::bucket) of the current pattern, or
  // null for an index whose calls pass through (below min_bytes, too many layouts).
  // Empty without a pattern or with a registration.
  std::vector<const RegisteredBucket*> auto_pattern_layouts();

 private:
  struct CallKeyHash {
    size_t operator()(const CallKey& k) const {
      return std::hash<uint64_t>()(k.address * 0x9E3779B97F4A7C15ull ^ k.count * 0xC2B2AE3D27D4EB4Full ^
                                   static_cast<uint64_t>(k.dtype));
    }
  };
  // What is known about a buffer's recent calls.
  struct History {
    uint64_t last_call = 0;       // index among considered calls
    uint64_t last_recurring = 0;  // index among recurring calls (valid if recurring_calls > 0)
    uint64_t recurring_calls = 0;
    uint64_t gap = 0, previous_gap = 0;  // between its last three recurring calls
  };

  struct Recurrence {
    bool recurring = false;
    uint64_t previous_call = 0;  // the buffer's previous call (index among considered calls)
  };

  bool considered(const CallKey& call) const;
  Recurrence note_call(const CallKey& call);  // updates the histories
  bool counts_for_candidate(const CallKey& call) const;
  void set_candidate(size_t period);
  void learn(const CallKey& call);  // for a recurring call
  void try_auto();
  static size_t once_per_step(const std::vector<CallKey>& period);
  void forget_pattern();
  bool recently_tried(size_t period) const;
  bool adopt_registered(const std::vector<CallKey>& period);
  void adopt_auto(std::vector<CallKey> period);
  void drop_pattern();
  Match follow(const CallKey& call, const Recurrence& r);
  Match outside(const Recurrence& r);  // a call that is not the pattern's
  const RegisteredBucket* auto_layout_for(const CallKey& call);
  std::vector<CallKey> period_calls(size_t period) const;

  std::shared_ptr<const Registration> registration_;
  std::set<std::pair<uint64_t, DType>> registered_kinds_;  // (count, dtype) of some bucket
  MatcherSettings settings_;
  uint64_t step_ = 0;

  std::unordered_map<CallKey, History, CallKeyHash> history_;
  uint64_t calls_ = 0;              // considered calls so far
  std::deque<CallKey> recurring_;   // the last recurring calls (at most kHistory)
  uint64_t recurring_count_ = 0;    // recurring calls so far

  // Learning: the candidate period (in recurring calls), how many recurring calls of its
  // buffers (auto mode: those that recur at least once per candidate_ calls) in a row
  // equal the one candidate_ before, and whether this run was tried; auto mode tries a
  // period again only kHistory / 4 calls after it last did.
  size_t candidate_ = 0;
  size_t run_ = 0;
  bool tried_ = false;
  std::map<size_t, uint64_t> tried_periods_;  // period -> when it was tried (considered calls)
  uint64_t adoptions_ = 0;  // patterns learned so far

  // The pattern: the calls of one step, in order, and the next one expected.
  std::vector<CallKey> pattern_;
  size_t next_ = 0;
  bool started_ = false;  // a step of the pattern has begun since it was learned
  uint64_t last_pattern_call_ = 0;  // index among considered calls
  std::unordered_map<CallKey, uint32_t, CallKeyHash> target_;  // buffer -> bucket / auto index
  std::unordered_map<CallKey, uint32_t, CallKeyHash> in_pattern_;  // buffer -> calls per step

  std::vector<CallKey> compressed_at_;  // per bucket / auto index: the last buffer compressed
  std::map<std::pair<uint64_t, DType>, std::unique_ptr<RegisteredBucket>> auto_layouts_;
};

}  // namespace lgreco::config
