#include "config/bucket_matcher.h"

#include <algorithm>
#include <string>

namespace lgreco::config {

namespace {

bool same_kind(const RegisteredBucket& bucket, const CallKey& call) {
  return bucket.count == call.count && bucket.dtype == call.dtype;
}

}  // namespace

RegisteredBucket auto_layout(uint64_t count, DType dtype, uint64_t segment_bytes) {
  const uint64_t group = kMinCompressedElements;
  const uint64_t segment = std::max<uint64_t>(group, segment_bytes / dtype_size(dtype) / group * group);
  RegisteredBucket bucket;
  bucket.count = count;
  bucket.dtype = dtype;
  for (uint64_t offset = 0; offset < count;) {
    uint64_t numel = std::min(segment, count - offset);
    if (count - offset - numel < group) numel = count - offset;  // a short tail joins this segment
    RegisteredLayer layer;
    layer.name = "segment" + std::to_string(bucket.layers.size());
    layer.offset = offset;
    layer.numel = numel;
    layer.has_shape = false;
    bucket.layers.push_back(std::move(layer));
    offset += numel;
  }
  return bucket;
}

BucketMatcher::BucketMatcher(std::shared_ptr<const Registration> registration, MatcherSettings settings)
    : registration_(std::move(registration)), settings_(settings) {
  if (registration_) {
    compressed_at_.assign(registration_->buckets.size(), CallKey{});
    candidate_ = registration_->buckets.size();  // the registered pattern has n calls
    for (const RegisteredBucket& b : registration_->buckets) registered_kinds_.insert({b.count, b.dtype});
  }
}

bool BucketMatcher::considered(const CallKey& call) const {
  if (registration_) return registered_kinds_.count({call.count, call.dtype}) > 0;
  return call.count * dtype_size(call.dtype) >= settings_.min_bytes;
}

// ---------------------------------------------------------------------------------------
// Learning

BucketMatcher::Recurrence BucketMatcher::note_call(const CallKey& call) {
  const uint64_t index = calls_++;
  Recurrence r;
  auto [it, fresh] = history_.try_emplace(call);
  History& h = it->second;
  r.previous_call = h.last_call;
  r.recurring = !fresh && index - h.last_call <= kHistory;
  h.last_call = index;
  if (!r.recurring) {
    h.recurring_calls = 0;
  } else {
    const uint64_t position = recurring_count_++;
    if (h.recurring_calls > 0) {
      h.previous_gap = h.gap;
      h.gap = position - h.last_recurring;
    }
    h.last_recurring = position;
    ++h.recurring_calls;
    recurring_.push_back(call);
    if (recurring_.size() > kHistory) recurring_.pop_front();
  }
  if (history_.size() > 4 * kHistory) {  // forget buffers not called for kHistory calls
    for (auto i = history_.begin(); i != history_.end();)
      i = index - i->second.last_call > kHistory ? history_.erase(i) : std::next(i);
  }
  return r;
}

// Whether a recurring call's buffer belongs to the candidate period: in auto mode, those
// that recur at least once per `candidate_` recurring calls. A rarer buffer (an evaluation
// every N steps, a buffer whose count changes) must not break the run of a shorter period.
bool BucketMatcher::counts_for_candidate(const CallKey& call) const {
  if (registration_) return true;
  const History& h = history_.at(call);
  return h.recurring_calls < 2 || h.gap <= candidate_;
}

void BucketMatcher::set_candidate(size_t period) {
  candidate_ = period;
  tried_ = false;
  run_ = 0;
  const size_t size = recurring_.size();
  for (size_t j = size; j-- > period;) {
    if (!counts_for_candidate(recurring_[j])) continue;
    if (recurring_[j] != recurring_[j - period]) break;
    ++run_;
  }
}

void BucketMatcher::learn(const CallKey& call) {
  // The run: recurring calls of this period's buffers that equal the recurring call
  // candidate_ positions before. Calls of rarer buffers neither extend nor break it.
  if (counts_for_candidate(call)) {
    const size_t size = recurring_.size();
    if (candidate_ > 0 && size > candidate_ && recurring_[size - 1 - candidate_] == call) {
      ++run_;
    } else {
      run_ = 0;
      tried_ = false;
    }
  }
  if (registration_) {
    if (pattern_.empty() && !tried_ && run_ >= candidate_) {
      tried_ = true;
      adopt_registered(period_calls(candidate_));
    }
    return;
  }
  // A buffer with two equal gaps in a row proposes its gap as the period. The current
  // candidate keeps its place while it repeats and has not been tried, so that neither a
  // run of workspace calls nor a rare periodic buffer can interrupt it.
  const History& h = history_.at(call);
  if (h.recurring_calls >= 3 && h.gap == h.previous_gap && h.gap != candidate_ && h.gap <= kMaxAutoPeriod &&
      !recently_tried(h.gap) && (candidate_ == 0 || tried_ || run_ < candidate_))
    set_candidate(h.gap);
  try_auto();
}

// A period is tried again only after the calls have had time to change (a buffer's first
// gaps, before it settles, can make a period look worse than it is).
bool BucketMatcher::recently_tried(size_t period) const {
  const auto it = tried_periods_.find(period);
  return it != tried_periods_.end() && calls_ - it->second < kHistory / 4;
}

// The calls of one period: those of the period's buffers among the last `period`
// recurring calls.
std::vector<CallKey> BucketMatcher::period_calls(size_t period) const {
  std::vector<CallKey> calls;
  for (auto k = recurring_.end() - static_cast<std::ptrdiff_t>(period); k != recurring_.end(); ++k)
    if (counts_for_candidate(*k)) calls.push_back(*k);
  return calls;
}

// Counts the buffers called once per step in a period.
size_t BucketMatcher::once_per_step(const std::vector<CallKey>& period) {
  std::map<CallKey, uint32_t> n;
  for (const CallKey& k : period) ++n[k];
  size_t once = 0;
  for (const auto& [key, count] : n) once += count == 1;
  return once;
}

// Whether period a (with a_once buffers called once per step) explains the calls better
// than period b: gradient buckets are called once per iteration, so the iteration is the
// period with the largest share of once-per-step calls (a run of workspace calls has
// fewer; a longer cycle, where each gradient bucket occurs many times, has far fewer).
// Ties: more once-per-step buffers, then the shorter period.
static bool better(size_t a_once, size_t a_period, size_t b_once, size_t b_period) {
  if (a_once * b_period != b_once * a_period) return a_once * b_period > b_once * a_period;
  if (a_once != b_once) return a_once > b_once;
  return a_period < b_period;
}

void BucketMatcher::try_auto() {
  if (tried_ || candidate_ == 0 || run_ < std::max(candidate_, kMinAutoRun)) return;
  tried_ = true;
  tried_periods_[candidate_] = calls_;
  // The buffers this period leaves out (rarer ones) must be a small part of the calls:
  // else it is a run inside a longer pattern (workspace calls between gradient buckets).
  size_t total = 0, included = 0;
  const size_t span = std::max(2 * candidate_, kMinAutoRun);
  for (auto k = recurring_.rbegin(); k != recurring_.rend() && included < span; ++k, ++total)
    included += counts_for_candidate(*k);
  if ((total - included) * kMaxLeftOut.den > total * kMaxLeftOut.num) return;
  std::vector<CallKey> period = period_calls(candidate_);
  const size_t once = once_per_step(period);
  if (once == 0) return;
  if (!pattern_.empty() && !better(once, period.size(), once_per_step(pattern_), pattern_.size())) return;
  adopt_auto(std::move(period));
}

bool BucketMatcher::adopt_registered(const std::vector<CallKey>& period) {
  const std::vector<RegisteredBucket>& buckets = registration_->buckets;
  const size_t n = buckets.size();
  if (std::set<CallKey>(period.begin(), period.end()).size() != n) return false;
  // Where bucket 0 is in the period: the first rotation under which every call has its
  // bucket's count and dtype (validate() guarantees that any other such rotation has
  // identical layouts, so the choice cannot change a layout).
  size_t first = n;
  for (size_t start = 0; start < n && first == n; ++start) {
    bool fits = true;
    for (size_t b = 0; b < n && fits; ++b) fits = same_kind(buckets[b], period[(start + b) % n]);
    if (fits) first = start;
  }
  if (first == n) return false;
  drop_pattern();
  for (size_t b = 0; b < n; ++b) {
    pattern_.push_back(period[(first + b) % n]);
    target_[pattern_.back()] = static_cast<uint32_t>(b);
    in_pattern_[pattern_.back()] = 1;
  }
  next_ = (n - first) % n;  // the call after the period's last one
  last_pattern_call_ = calls_;
  ++adoptions_;
  return true;
}

void BucketMatcher::adopt_auto(std::vector<CallKey> period) {
  drop_pattern();  // a better period replaces the old one; the periods tried stay tried
  pattern_ = std::move(period);
  for (const CallKey& k : pattern_) ++in_pattern_[k];
  uint32_t index = 0;
  for (const CallKey& k : pattern_)
    if (in_pattern_[k] == 1) target_[k] = index++;
  if (compressed_at_.size() < index) compressed_at_.resize(index);
  next_ = 0;  // the period ended with this call
  last_pattern_call_ = calls_;
  ++adoptions_;
}

std::vector<const RegisteredBucket*> BucketMatcher::auto_pattern_layouts() {
  std::vector<const RegisteredBucket*> out;
  if (registration_) return out;
  for (const CallKey& k : pattern_) {
    const auto target = target_.find(k);
    if (target == target_.end()) continue;  // called more than once per step
    if (out.size() <= target->second) out.resize(target->second + 1, nullptr);
    if (k.count * dtype_size(k.dtype) >= settings_.min_bytes) out[target->second] = auto_layout_for(k);
  }
  return out;
}

void BucketMatcher::drop_pattern() {
  pattern_.clear();
  target_.clear();
  in_pattern_.clear();
  next_ = 0;
  started_ = false;
}

void BucketMatcher::forget_pattern() {
  drop_pattern();
  tried_periods_.clear();  // the calls changed: every period may be worth trying again
  tried_ = false;
}

// ---------------------------------------------------------------------------------------
// Following

const RegisteredBucket* BucketMatcher::auto_layout_for(const CallKey& call) {
  const auto key = std::make_pair(call.count, call.dtype);
  auto it = auto_layouts_.find(key);
  if (it == auto_layouts_.end()) {
    if (auto_layouts_.size() >= settings_.max_auto_layouts) return nullptr;
    it = auto_layouts_
             .emplace(key, std::make_unique<RegisteredBucket>(auto_layout(call.count, call.dtype, settings_.segment_bytes)))
             .first;
  }
  return it->second.get();
}

Match BucketMatcher::outside(const Recurrence& r) {
  Match m;
  m.step = step_;
  if (!r.recurring) {
    m.reason = "not part of the repeating call pattern (a buffer called for the first time)";
    return m;
  }
  if (r.previous_call > last_pattern_call_) {
    // No call of the pattern since this buffer's previous call: the pattern's buffers are
    // gone (a new model, reallocated buckets).
    forget_pattern();
    m.reason = "the call pattern stopped (its buffers are no longer called); learning it again";
    return m;
  }
  m.reason = registration_ ? "not a registered bucket's buffer (another tensor with a registered count and dtype)"
                           : "not part of the repeating call pattern";
  return m;
}

Match BucketMatcher::follow(const CallKey& call, const Recurrence& r) {
  Match m;
  m.step = step_;
  if (call != pattern_[next_]) {
    if (in_pattern_.count(call)) {
      forget_pattern();
      m.reason = "the call pattern broke (a bucket moved, was skipped or came out of turn); learning it again";
      return m;
    }
    return outside(r);
  }
  last_pattern_call_ = calls_;
  const bool step_begins = next_ == 0;
  next_ = (next_ + 1) % pattern_.size();
  if (step_begins) {
    ++step_;
    started_ = true;
  }
  m.step = step_;
  if (!started_) {
    m.reason = "call pattern just learned; compression starts with its next step";
    return m;
  }
  const auto target = target_.find(call);
  if (target == target_.end()) {
    m.reason = "called more than once per step (a workspace, not a gradient bucket)";
    return m;
  }
  if (call.count * dtype_size(call.dtype) < settings_.min_bytes) {
    m.reason = "smaller than LGRECO_MIN_BYTES";
    return m;
  }
  const RegisteredBucket* layout = registration_ ? &registration_->buckets[target->second] : auto_layout_for(call);
  if (!layout) {
    m.reason = "too many distinct buffer sizes for auto mode";
    return m;
  }
  m.kind = registration_ ? Match::Kind::kRegistered : Match::Kind::kAuto;
  m.bucket = target->second;
  m.layout = layout;
  m.new_address = compressed_at_[m.bucket] != call;
  compressed_at_[m.bucket] = call;
  return m;
}

Match BucketMatcher::match(const CallKey& call) {
  Match m;
  m.step = step_;
  if (call.count == 0) {
    m.reason = "an empty call";
    return m;
  }
  if (!registration_ && !settings_.auto_mode) {
    m.reason = "no registration file and auto mode is off (LGRECO_AUTO=0)";
    return m;
  }
  if (!considered(call)) {
    m.reason = registration_ ? "matches no registered bucket (count and dtype)" : "smaller than LGRECO_MIN_BYTES";
    return m;
  }
  const Recurrence r = note_call(call);
  const bool had_pattern = !pattern_.empty();
  const uint64_t adopted_before = adoptions_;
  if (r.recurring) learn(call);
  if (adoptions_ != adopted_before) {  // this call completed a newly learned pattern
    m.reason = "call pattern just learned; compression starts with its next step";
    return m;
  }
  if (had_pattern && !pattern_.empty()) return follow(call, r);
  m.reason = registration_ ? "waiting for the registered buckets to repeat twice in a row (first steps, or they changed)"
                           : "waiting for a repeating pattern of buffers (first steps, or they changed)";
  return m;
}

}  // namespace lgreco::config
