#include "config/bucket_matcher.h"

#include <algorithm>
#include <string>

namespace lgreco::config {

namespace {

// Auto mode: the longest pattern looked for after a buffer outside the pattern started
// recurring; if none is found within twice that many calls, the buffer is ignored (a rare
// periodic call, such as an evaluation every N steps, must not stretch a step to N).
constexpr size_t kMaxAutoPeriod = 1024;
constexpr size_t kMaxIgnored = 256;

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
  if (registration_) compressed_at_.assign(registration_->buckets.size(), CallKey{});
}

bool BucketMatcher::considered(const CallKey& call) const {
  if (registration_) {
    for (const RegisteredBucket& b : registration_->buckets)
      if (same_kind(b, call)) return true;
    return false;
  }
  return call.count * dtype_size(call.dtype) >= settings_.min_bytes && !ignored_.count(call);
}

void BucketMatcher::remember(const CallKey& call) {
  history_.push_back(call);
  ++history_count_[call];
  if (history_.size() > kHistory) {
    const auto it = history_count_.find(history_.front());
    if (--it->second == 0) history_count_.erase(it);
    history_.pop_front();
  }
  ++calls_;
}

bool BucketMatcher::learn(const CallKey& call) {
  if (history_count_[call] < 2) return false;  // only a recurring buffer can close a period
  // The recurring calls: one-off buffers left out.
  std::vector<const CallKey*> recurring;
  recurring.reserve(history_.size());
  for (const CallKey& k : history_)
    if (history_count_[k] >= 2) recurring.push_back(&k);
  const size_t size = recurring.size();
  size_t period = 0;
  if (registration_) {
    period = registration_->buckets.size();
  } else {
    for (size_t back = 1; back < size; ++back)  // where this buffer occurred before
      if (*recurring[size - 1 - back] == call) {
        period = back;
        break;
      }
    if (period < std::max<size_t>(min_period_, 1) || period > kMaxAutoPeriod) return false;
  }
  if (period == 0 || 2 * period > size) return false;
  for (size_t j = 0; j < period; ++j)
    if (*recurring[size - 2 * period + j] != *recurring[size - period + j]) return false;
  std::vector<CallKey> calls;
  for (size_t j = size - period; j < size; ++j) calls.push_back(*recurring[j]);
  if (registration_) return adopt_registered(std::move(calls));
  // After a buffer outside the old pattern began to recur, the longer pattern must keep
  // at least as many buffers called once per step: a rare periodic call would otherwise
  // stretch the step to its period, where the gradient buckets occur many times.
  if (pending_outside_ && once_per_step(calls) < required_once_) return false;
  adopt_auto(std::move(calls));
  return true;
}

size_t BucketMatcher::once_per_step(const std::vector<CallKey>& period) {
  std::map<CallKey, uint32_t> occurrences;
  for (const CallKey& k : period) ++occurrences[k];
  size_t once = 0;
  for (const auto& [key, n] : occurrences) once += n == 1;
  return once;
}

bool BucketMatcher::adopt_registered(std::vector<CallKey> period) {
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
  pattern_.clear();
  for (size_t b = 0; b < n; ++b) {
    pattern_.push_back(period[(first + b) % n]);
    target_[pattern_.back()] = static_cast<uint32_t>(b);
  }
  next_ = (n - first) % n;  // the call after the period's last one
  started_ = false;
  return true;
}

void BucketMatcher::adopt_auto(std::vector<CallKey> period) {
  pattern_ = std::move(period);
  std::map<CallKey, uint32_t> occurrences;
  for (const CallKey& k : pattern_) ++occurrences[k];
  uint32_t index = 0;
  for (const CallKey& k : pattern_)
    if (occurrences[k] == 1) target_[k] = index++;
  if (compressed_at_.size() < index) compressed_at_.resize(index);
  next_ = 0;
  started_ = false;
  min_period_ = 0;
  pending_outside_ = false;
}

void BucketMatcher::drop_pattern() {
  pattern_.clear();
  target_.clear();
  outside_seen_.clear();
  next_ = 0;
  started_ = false;
}

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

Match BucketMatcher::follow(const CallKey& call) {
  Match m;
  if (call != pattern_[next_]) {
    m.step = step_;
    if (target_.count(call) || std::find(pattern_.begin(), pattern_.end(), call) != pattern_.end()) {
      drop_pattern();
      min_period_ = 0;
      m.reason = "the call pattern broke (a bucket moved, was skipped or came out of turn); learning it again";
      return m;
    }
    if (registration_) {
      m.reason = "not a registered bucket's buffer (another tensor with a registered count and dtype)";
      return m;
    }
    if (history_count_[call] >= 2 && outside_seen_.count(call)) {
      // A buffer outside the pattern recurs: look for a longer pattern that includes it.
      min_period_ = pattern_.size() + 1;
      required_once_ = once_per_step(pattern_);
      pending_outside_ = true;
      pending_key_ = call;
      pending_deadline_ = calls_ + 2 * kMaxAutoPeriod;
      drop_pattern();
      m.reason = "a buffer outside the call pattern recurs; learning a longer pattern";
      return m;
    }
    if (outside_seen_.size() >= kHistory) outside_seen_.clear();
    outside_seen_[call] = calls_;
    m.reason = "not part of the repeating call pattern";
    return m;
  }
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
  const RegisteredBucket* layout =
      registration_ ? &registration_->buckets[target->second] : auto_layout_for(call);
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
    m.reason = registration_ ? "matches no registered bucket (count and dtype)"
               : ignored_.count(call) ? "a buffer that recurs irregularly"
                                      : "smaller than LGRECO_MIN_BYTES";
    return m;
  }
  remember(call);
  if (!pattern_.empty()) return follow(call);
  if (pending_outside_ && calls_ > pending_deadline_) {
    // No longer pattern includes that buffer: ignore it and find the old one again.
    if (ignored_.size() >= kMaxIgnored) ignored_.clear();
    ignored_.insert(pending_key_);
    pending_outside_ = false;
    min_period_ = 0;
  }
  learn(call);
  m.reason = registration_ ? "waiting for the registered buckets to repeat twice (first steps, or they changed)"
                           : "waiting for a repeating pattern of buffers (first steps, or they changed)";
  return m;
}

}  // namespace lgreco::config
