#include "config/bucket_matcher.h"

#include <algorithm>
#include <string>

namespace lgreco::config {

namespace {
// Auto mode remembers the buffers of a step to find the next one; a job that never
// repeats a buffer must not grow that memory without bound.
constexpr size_t kMaxBuffersPerStep = 4096;
}  // namespace

RegisteredBucket auto_layout(uint64_t count, DType dtype, uint64_t segment_bytes, uint32_t id) {
  const uint64_t group = kMinCompressedElements;
  const uint64_t segment = std::max<uint64_t>(group, segment_bytes / dtype_size(dtype) / group * group);
  RegisteredBucket bucket;
  bucket.count = count;
  bucket.dtype = dtype;
  for (uint64_t offset = 0; offset < count;) {
    uint64_t numel = std::min(segment, count - offset);
    if (count - offset - numel < group) numel = count - offset;  // a short tail joins this segment
    RegisteredLayer layer;
    layer.name = "auto" + std::to_string(id) + ".segment" + std::to_string(bucket.layers.size());
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
    const size_t n = registration_->buckets.size();
    current_.assign(n, kUnmatched);
    previous_.assign(n, kUnmatched);
    compressed_at_.assign(n, kUnmatched);
  }
}

void BucketMatcher::begin_step(const CallKey& first) {
  if (started_) ++step_;
  started_ = true;
  first_ = first;
  cursor_ = 0;
  previous_.swap(current_);
  std::fill(current_.begin(), current_.end(), kUnmatched);
  seen_before_.swap(seen_);
  seen_.clear();
}

Match BucketMatcher::match(const CallKey& call) {
  if (registration_) return match_registered(call);
  if (settings_.auto_mode) return match_auto(call);
  Match m;
  m.step = step_;
  m.reason = "no registration file and auto mode is off (LGRECO_AUTO=0)";
  return m;
}

Match BucketMatcher::match_registered(const CallKey& call) {
  const std::vector<RegisteredBucket>& buckets = registration_->buckets;
  const auto same_kind = [&](size_t b) { return buckets[b].count == call.count && buckets[b].dtype == call.dtype; };
  const auto next_from = [&](size_t from) {
    size_t b = from;
    while (b < buckets.size() && !same_kind(b)) ++b;
    return b;
  };
  Match m;
  if (next_from(0) == buckets.size()) {
    m.step = step_;
    m.reason = "matches no registered bucket (count and dtype)";
    return m;
  }
  if (same_kind(0) && (!started_ || call == first_ || next_from(cursor_) == buckets.size())) begin_step(call);
  m.step = step_;
  const size_t b = started_ ? next_from(cursor_) : buckets.size();
  if (b == buckets.size()) {
    m.reason = started_ ? "out of the registered order within this step" : "before the first registered bucket";
    return m;
  }
  cursor_ = b + 1;
  current_[b] = call;
  if (previous_[b] != call) {
    m.reason = "not yet confirmed: this buffer was not this bucket in the previous step (first step, or the "
               "buckets were rebuilt)";
    return m;
  }
  if (call.count * dtype_size(call.dtype) < settings_.min_bytes) {
    m.reason = "smaller than LGRECO_MIN_BYTES";
    return m;
  }
  m.kind = Match::Kind::kRegistered;
  m.bucket = static_cast<uint32_t>(b);
  m.layout = &buckets[b];
  m.new_address = compressed_at_[b] != call;
  compressed_at_[b] = call;
  return m;
}

Match BucketMatcher::match_auto(const CallKey& call) {
  Match m;
  if (call.count * dtype_size(call.dtype) < settings_.min_bytes) {
    m.step = step_;
    m.reason = "smaller than LGRECO_MIN_BYTES";
    return m;
  }
  if (!started_ || call == first_ || seen_.count(call)) begin_step(call);
  m.step = step_;
  if (seen_.size() >= kMaxBuffersPerStep && !seen_.count(call)) {
    m.reason = "too many distinct buffers in one step for auto mode";
    return m;
  }
  seen_.insert(call);
  if (!seen_before_.count(call)) {
    m.reason = "not yet confirmed: this buffer was not called in the previous step";
    return m;
  }
  auto it = auto_ids_.find(call);
  if (it == auto_ids_.end()) {
    if (auto_ids_.size() >= settings_.max_auto_buckets) {
      m.reason = "too many distinct recurring buffers for auto mode";
      return m;
    }
    const uint32_t id = static_cast<uint32_t>(auto_layouts_.size());
    auto_layouts_.push_back(
        std::make_unique<RegisteredBucket>(auto_layout(call.count, call.dtype, settings_.segment_bytes, id)));
    it = auto_ids_.emplace(call, id).first;
    m.new_address = true;
  }
  m.kind = Match::Kind::kAuto;
  m.bucket = it->second;
  m.layout = auto_layouts_[it->second].get();
  return m;
}

}  // namespace lgreco::config
