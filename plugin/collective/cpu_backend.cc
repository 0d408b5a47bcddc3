#include "plugin/collective/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/lowrank.h"
#include "kernels/quant_math.h"
#include "kernels/sketch.h"

namespace lgreco::collective {

namespace {

class HostBuffer final : public Backend::Buffer {
 public:
  explicit HostBuffer(uint64_t bytes) : bytes_(bytes), data_(new uint8_t[bytes ? bytes : 1]()) {}
  void* data() override { return data_.get(); }
  uint64_t bytes() const override { return bytes_; }

 private:
  uint64_t bytes_;
  std::unique_ptr<uint8_t[]> data_;
};

class DoneEvent final : public Event {
 public:
  bool ready() override { return true; }
  void wait() override {}
};

const void* element_ptr(const ElementSpan& span, uint64_t element) {
  return static_cast<const uint8_t*>(span.data) + (element - span.first) * dtype_size(span.dtype);
}
void* element_ptr_mut(const ElementSpan& span, uint64_t element) {
  return static_cast<uint8_t*>(span.data) + (element - span.first) * dtype_size(span.dtype);
}
float* residual_of(float* residual_data, uint64_t residual_first, const Segment& s, const uint8_t* flags) {
  if (!residual_data || (flags && flags[s.layer])) return nullptr;
  return residual_data + (s.offset - residual_first);
}

}  // namespace

const Codec& CpuBackend::codec(const CodecSpec& spec, DType dtype) {
  auto key = std::make_pair(spec.str(), dtype);
  auto it = codecs_.find(key);
  if (it == codecs_.end()) it = codecs_.emplace(std::move(key), Codec::create(spec, dtype)).first;
  return *it->second;
}

std::unique_ptr<Backend::Buffer> CpuBackend::allocate(uint64_t bytes) { return std::make_unique<HostBuffer>(bytes); }
void CpuBackend::fill_zero(void* data, uint64_t bytes) {
  if (bytes) memset(data, 0, bytes);
}
void CpuBackend::copy(void* dst, const void* src, uint64_t bytes) {
  if (bytes && dst != src) memmove(dst, src, bytes);
}
void CpuBackend::upload(void* dst, const void* host_src, uint64_t bytes) { copy(dst, host_src, bytes); }
std::unique_ptr<Event> CpuBackend::read_back(void* host_dst, const void* src, uint64_t bytes) {
  copy(host_dst, src, bytes);
  return std::make_unique<DoneEvent>();
}

void CpuBackend::find_nonfinite(const Plan&, std::span<const Segment> segments, ElementSpan input, uint8_t* flags) {
  for (const Segment& s : segments) flags[s.layer] = 0;
  for (const Segment& s : segments) {
    const void* data = element_ptr(input, s.offset);
    for (uint64_t i = 0; i < s.count && !flags[s.layer]; ++i)
      if (!quant::is_finite_value(load_as_float(data, input.dtype, i))) flags[s.layer] = 1;
  }
}

void CpuBackend::encode(const Plan& plan, std::span<const Segment> segments, ElementSpan input, float* residual_data,
                        uint64_t residual_first, const uint8_t* flags, const NoiseBase& noise, uint8_t* out,
                        uint64_t byte_offset_base) {
  for (const Segment& s : segments) {
    const CodecSpec& spec = plan.codecs[s.codec];
    const void* data = element_ptr(input, s.offset);
    float* residual = residual_of(residual_data, residual_first, s, flags);
    uint8_t* dst = out + byte_offset_base + s.byte_offset;
    if (spec.family() == CodecFamily::kNone && input.dtype != plan.dtype) {
      // A reduced float32 sum sent uncompressed in the call's element type: rounding it
      // is the codec, and the residual keeps what rounding lost.
      for (uint64_t i = 0; i < s.count; ++i) {
        const float x = load_as_float(data, input.dtype, i);
        const float v = residual ? quant::canonical_nan(x + residual[i]) : x;
        store_from_float(dst, plan.dtype, i, v);
        // As the none codec: a sum that overflows the element type keeps its residual.
        const float sent = round_to_dtype(v, plan.dtype);
        if (residual && quant::is_finite_value(sent)) residual[i] = v - sent;
      }
      continue;
    }
    const NoiseKey key{noise.seed, noise.rank, noise.step, noise.layer_base + s.layer};
    codec(spec, input.dtype).encode(key, Slice{data, s.count, s.first_element}, residual, {dst, s.bytes});
  }
}

void CpuBackend::decode(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                        uint64_t byte_offset_base, ElementSpan out) {
  for (const Segment& s : segments)
    codec(plan.codecs[s.codec], plan.dtype)
        .decode({in + byte_offset_base + s.byte_offset, s.bytes}, s.count, out.dtype, element_ptr_mut(out, s.offset));
}

void CpuBackend::decode_accumulate(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                                   uint64_t byte_offset_base, ElementSpan acc) {
  for (const Segment& s : segments)
    codec(plan.codecs[s.codec], plan.dtype)
        .decode_accumulate({in + byte_offset_base + s.byte_offset, s.bytes}, s.count,
                           static_cast<float*>(element_ptr_mut(acc, s.offset)));
}

void CpuBackend::accumulate_exact(const Plan&, std::span<const Segment> segments, ElementSpan input,
                                  float* residual_data, uint64_t residual_first, const uint8_t* flags,
                                  ElementSpan acc) {
  for (const Segment& s : segments) {
    const void* data = element_ptr(input, s.offset);
    float* residual = residual_of(residual_data, residual_first, s, flags);
    float* sum = static_cast<float*>(element_ptr_mut(acc, s.offset));
    for (uint64_t i = 0; i < s.count; ++i) {
      const float x = load_as_float(data, input.dtype, i);
      sum[i] = quant::canonical_nan(sum[i] + (residual ? x + residual[i] : x));
    }
    if (residual) memset(residual, 0, s.count * sizeof(float));
  }
}

void CpuBackend::divide(float* acc, uint64_t n, float divisor) {
  for (uint64_t i = 0; i < n; ++i) acc[i] = quant::canonical_nan(acc[i] / divisor);
}

void CpuBackend::gather(std::span<const Run> runs, ElementSpan src, uint64_t src_end, float scale, bool accumulate,
                        float* dst) {
  for (const Run& r : runs)
    for (uint64_t i = 0; i < r.count; ++i) {
      const uint64_t e = r.from + i;
      const float v = e >= src.first && e < src_end ? scale * load_as_float(element_ptr(src, e), src.dtype, 0) : 0.0f;
      float& d = dst[r.to + i];
      d = accumulate ? quant::canonical_nan(d + v) : quant::canonical_nan(v);
    }
}

void CpuBackend::distance(std::span<const Segment> segments, ElementSpan a, const float* b, int power, double weight,
                          double* out, uint8_t* nonfinite) {
  if (power != 1 && power != 2) throw std::invalid_argument("cpu backend distance: power " + std::to_string(power));
  for (const Segment& s : segments) {
    const void* x = element_ptr(a, s.offset);
    const float* y = b ? b + (s.offset - a.first) : nullptr;
    double sum = 0;
    for (uint64_t i = 0; i < s.count; ++i) {
      const double v = load_as_float(x, a.dtype, i);
      const double d = y ? v - static_cast<double>(y[i]) : v;
      sum += power == 2 ? d * d : std::fabs(d);
    }
    if (std::isfinite(sum)) out[s.layer] += weight * sum;
    else nonfinite[s.layer] = 1;
  }
}

void CpuBackend::sketch(std::span<const SketchRun> runs, const float* src, float* dst) {
  for (const SketchRun& r : runs)  // before any output is written
    if (r.width == 0) throw std::invalid_argument("cpu backend sketch: a run of width 0");
  for (const SketchRun& r : runs) {
    for (uint64_t j = 0; j < r.width; ++j) {
      double sum = 0;
      for (uint64_t i = j; i < r.count; i += r.width)
        sum += sketch::sign(r.key, i) * static_cast<double>(src[r.from + i]);
      dst[r.to + j] = static_cast<float>(sum);
    }
  }
}

void CpuBackend::narrow(const float* acc, uint64_t n, ElementSpan out) {
  if (out.dtype == DType::kFloat32) {
    copy(out.data, acc, n * sizeof(float));
    return;
  }
  for (uint64_t i = 0; i < n; ++i) store_from_float(out.data, out.dtype, i, acc[i]);
}

void CpuBackend::measure(const Plan&, std::span<const Segment> segments, ElementSpan input, const float* residual,
                         uint64_t residual_first, const Measure& m) {
  const size_t c = m.candidates.size();
  std::vector<CodecSpec> specs;
  std::vector<size_t> columns;
  for (size_t k = 0; k < c; ++k)
    if (m.candidate_mask.empty() || m.candidate_mask[k]) specs.push_back(m.candidates[k]), columns.push_back(k);
  if (specs.empty()) return;
  for (const Segment& s : segments) {
    if (!m.measured[s.layer]) continue;
    const float* r = residual ? residual + (s.offset - residual_first) : nullptr;
    const CandidateReport report =
        measure_candidates(specs, input.dtype, Slice{element_ptr(input, s.offset), s.count, s.first_element}, r);
    if (report.nonfinite_buckets) m.nonfinite[s.layer] = 1;
    for (size_t k = 0; k < specs.size(); ++k)
      m.squared[s.layer * c + columns[k]] += m.weight * report.candidates[k].squared_error;
  }
}

namespace {

// M of a low-rank layer: input + residual in float32 (no residual where flagged).
std::vector<float> matrix_of(const Backend::LowRankLayer& l, ElementSpan input, const float* residual,
                             const uint8_t* flags) {
  const uint64_t n = l.rows * l.cols;
  std::vector<float> x(n);
  const void* data = element_ptr(input, l.offset);
  const float* r = residual && !(flags && flags[l.layer]) ? residual + l.offset : nullptr;
  for (uint64_t i = 0; i < n; ++i) {
    const float v = load_as_float(data, input.dtype, i);
    x[i] = r ? v + r[i] : v;
  }
  return x;
}

}  // namespace

void CpuBackend::lowrank_project(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                                 const uint8_t* flags, const float* q, float* p) {
  for (const LowRankLayer& l : layers) {
    const std::vector<float> x = matrix_of(l, input, residual, flags);
    lowrank::project(x.data(), {l.rows, l.cols}, q + l.q_offset, l.rank, p + l.p_offset);
  }
}

void CpuBackend::lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) {
  for (const LowRankLayer& l : layers) lowrank::orthonormalize(p + l.p_offset, l.rows, l.rank);
}

void CpuBackend::lowrank_back_project(std::span<const LowRankLayer> layers, ElementSpan input, float* residual,
                                      const uint8_t* flags, const float* p, float* q) {
  for (const LowRankLayer& l : layers) {
    const std::vector<float> x = matrix_of(l, input, residual, flags);
    const lowrank::Shape shape{l.rows, l.cols};
    lowrank::back_project(x.data(), shape, p + l.p_offset, l.rank, q + l.q_offset);
    if (!residual || (flags && flags[l.layer])) continue;
    // Error feedback: what this rank's own factors miss, M - P (M^T P)^T.
    std::vector<float> approx(x.size());
    lowrank::reconstruct(p + l.p_offset, q + l.q_offset, shape, l.rank, 1.0f, approx.data());
    float* r = residual + l.offset;
    for (size_t i = 0; i < x.size(); ++i) r[i] = x[i] - approx[i];
  }
}

void CpuBackend::lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                                     ElementSpan out) {
  for (const LowRankLayer& l : layers) {
    std::vector<float> values(l.rows * l.cols);
    lowrank::reconstruct(p + l.p_offset, q + l.q_offset, {l.rows, l.cols}, l.rank, scale, values.data());
    void* dst = element_ptr_mut(out, l.offset);
    for (size_t i = 0; i < values.size(); ++i) store_from_float(dst, out.dtype, i, quant::canonical_nan(values[i]));
  }
}

void CpuBackend::lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) {
  for (const LowRankLayer& l : layers)
    for (uint32_t c = 0; c < l.rank; ++c) {
      bool usable = false, finite = true;
      for (uint64_t j = 0; j < l.cols; ++j) {
        const float v = q_new[l.q_offset + j * l.rank + c];
        usable |= v != 0.0f;
        finite &= quant::is_finite_value(v);
      }
      const float* from = usable && finite ? q_new : q0;
      for (uint64_t j = 0; j < l.cols; ++j) q[l.q_offset + j * l.rank + c] = from[l.q_offset + j * l.rank + c];
    }
}

void CpuBackend::measure_lowrank(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                                 const NoiseBase& key, const Measure& m) {
  const size_t c = m.candidates.size();
  std::vector<uint32_t> ranks;
  std::vector<size_t> columns;
  uint32_t basis_rank = 0;
  for (size_t k = 0; k < c; ++k)
    if (m.candidates[k].family() == CodecFamily::kPowersgd && (m.candidate_mask.empty() || m.candidate_mask[k])) {
      ranks.push_back(m.candidates[k].powersgd_params().rank);
      columns.push_back(k);
      basis_rank = std::max(basis_rank, ranks.back());
    }
  if (ranks.empty()) return;
  std::vector<double> errors(ranks.size());
  for (const LowRankLayer& l : layers) {
    if (!m.measured[l.layer]) continue;
    const std::vector<float> x = matrix_of(l, input, residual, nullptr);
    std::vector<float> basis(l.cols * basis_rank);
    lowrank::initial_q(NoiseKey{key.seed, 0, key.step, key.layer_base + l.layer}, l.cols, basis_rank, basis.data());
    if (!lowrank::squared_errors(x.data(), {l.rows, l.cols}, basis.data(), basis_rank, ranks, errors))
      m.nonfinite[l.layer] = 1;
    for (size_t k = 0; k < ranks.size(); ++k) m.squared[l.layer * c + columns[k]] += m.weight * errors[k];
  }
}

uint64_t CpuBackend::mark() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}
double CpuBackend::seconds_between(uint64_t first_mark, uint64_t second_mark) {
  return second_mark >= first_mark ? (second_mark - first_mark) * 1e-9 : 0.0;
}

}  // namespace lgreco::collective
