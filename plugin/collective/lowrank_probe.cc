#include "plugin/collective/lowrank_probe.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/lowrank.h"
#include "kernels/sketch.h"

namespace lgreco::collective {

LowRankProbe::LowRankProbe(const BucketLayout& layout, uint32_t layer_base, std::span<const uint8_t> measured,
                           const std::vector<std::vector<uint32_t>>& columns, std::span<const CodecSpec> candidates,
                           std::span<const int> designated, int ranks, int rank, uint64_t seed)
    : ranks_(ranks), rank_(rank), seed_(seed), layer_base_(layer_base) {
  const size_t n = layout.layers.size();
  if (measured.size() != n || columns.size() != n || designated.size() != n)
    throw std::invalid_argument("LowRankProbe: per-layer inputs of another size than the bucket's layers");
  covered_.assign(n, 0);
  for (uint32_t k = 0; k < candidates.size(); ++k)
    if (candidates[k].family() == CodecFamily::kPowersgd) shadows_of_.push_back(Shadow{k, {}, {}, {}, {}});
  const uint64_t table_columns = candidates.size();
  for (uint32_t l = 0; l < n; ++l) {
    const LayerLayout& layer = layout.layers[l];
    if (!measured[l] || layer.rows == 0 || layer.numel % layer.rows != 0) continue;
    const uint64_t at = values_;  // the layer's first value in the probe's copy
    for (Shadow& s : shadows_of_) {
      if (std::find(columns[l].begin(), columns[l].end(), s.column) == columns[l].end()) continue;
      Backend::LowRankLayer m;
      m.layer = l;
      m.offset = at;
      m.rows = layer.rows;
      m.cols = layer.numel / layer.rows;
      m.rank = candidates[s.column].powersgd_params().rank;
      m.p_offset = p_floats_;
      m.q_offset = q_floats_;
      p_floats_ += m.rows * m.rank;
      q_floats_ += m.cols * m.rank;
      s.layers.push_back(m);
      all_layers_.push_back(m);
      const uint64_t width = std::min(kLowRankSketchWidth, layer.numel);
      s.sketches.push_back(Backend::SketchRun{at, layer.numel, sketch_floats_, width, 0});
      Segment own;
      own.layer = static_cast<uint32_t>(l * table_columns + s.column);  // the statistics slot
      own.offset = at;
      own.count = layer.numel;
      s.shadow_segments.push_back(own);
      if (designated[l] == rank_) {
        Segment sum = own;
        sum.offset = sketch_floats_;
        sum.count = width;
        s.sketch_segments.push_back(sum);
      }
      sketch_floats_ += width;
      covered_[l] = 1;
    }
    if (!covered_[l]) continue;
    runs_.push_back(Backend::Run{layer.offset, at, layer.numel});
    values_ += layer.numel;
  }
  std::erase_if(shadows_of_, [](const Shadow& s) { return s.layers.empty(); });
}

void LowRankProbe::prepare(Backend& backend) {
  if (empty() || shadows_) return;
  auto shadows = backend.allocate(4 * shadows_of_.size() * values_);
  auto g = backend.allocate(4 * values_);
  auto p = backend.allocate(4 * p_floats_);
  auto sketch_q = backend.allocate(4 * (sketch_floats_ + q_floats_));
  auto q = backend.allocate(4 * q_floats_);
  auto q0 = backend.allocate(4 * q_floats_);
  auto q0_host = backend.allocate_host(4 * q_floats_);
  backend.prepare_lowrank(all_layers_, {}, 0, DType::kFloat32, true);
  backend.prepare_probe(Plan{});  // the distances' partial sums
  // Every candidate's factor starts where the exchange's does: the layer's seeded Q0. The
  // pinned staging stays with the probe (the copy may still read it after this returns).
  auto* host = static_cast<float*>(q0_host->data());
  for (const Backend::LowRankLayer& m : all_layers_)
    lowrank::initial_q(NoiseKey{seed_, 0, 0, layer_base_ + m.layer}, m.cols, m.rank, host + m.q_offset);
  backend.upload(q0->data(), host, 4 * q_floats_);
  backend.copy(q->data(), q0->data(), 4 * q_floats_);
  shadows_ = std::move(shadows), g_ = std::move(g), p_ = std::move(p), sketch_q_ = std::move(sketch_q);
  q_ = std::move(q), q0_ = std::move(q0), q0_host_ = std::move(q0_host);
}

void LowRankProbe::step(Backend& backend, Fabric& fabric, const Call& call, const ProbeOutput* out) {
  if (empty()) return;
  if (!shadows_) throw std::logic_error("LowRankProbe::step before prepare()");
  auto* g = static_cast<float*>(g_->data());
  auto* p = static_cast<float*>(p_->data());
  auto* sketches = static_cast<float*>(sketch_q_->data());
  float* q_new = sketches + sketch_floats_;
  auto* q = static_cast<float*>(q_->data());
  const ElementSpan copy{g, DType::kFloat32, 0};
  const auto shadow = [&](size_t k) { return static_cast<float*>(shadows_->data()) + k * values_; };

  backend.gather(runs_, call.input, call.count, 1.0f, false, g);
  for (size_t k = 0; k < shadows_of_.size(); ++k) {
    // Without error feedback nothing carries over: the shadow holds this step's error alone.
    if (!call.error_feedback) backend.fill_zero(shadow(k), 4 * values_);
    backend.lowrank_project(shadows_of_[k].layers, copy, shadow(k), nullptr, q, p);
  }
  fabric.all_reduce_sum(std::span<float>(p, p_floats_));
  backend.lowrank_orthonormalize(all_layers_, p);
  for (size_t k = 0; k < shadows_of_.size(); ++k) {
    Shadow& s = shadows_of_[k];
    backend.lowrank_back_project(s.layers, copy, shadow(k), nullptr, p, q_new);
    // Signs keyed by step, layer and candidate: independent across the window's steps, the
    // same on every rank.
    for (size_t i = 0; i < s.sketches.size(); ++i)
      s.sketches[i].key = sketch::mix64(
          seed_ ^
          sketch::mix64(call.step ^ sketch::mix64((uint64_t{layer_base_ + s.layers[i].layer} << 20) ^ s.column)));
    backend.sketch(s.sketches, shadow(k), sketches);
  }
  fabric.all_reduce_sum(std::span<float>(sketches, sketch_floats_ + q_floats_));
  backend.lowrank_keep(all_layers_, q_new, static_cast<float*>(q0_->data()), q);
  if (!out) return;

  const double w2 = call.average ? 1.0 / (static_cast<double>(ranks_) * ranks_) : 1.0;
  for (size_t k = 0; k < shadows_of_.size(); ++k) {
    const Shadow& s = shadows_of_[k];
    if (!s.sketch_segments.empty())
      backend.distance(s.sketch_segments, ElementSpan{sketches, DType::kFloat32, 0}, nullptr, 2, w2, out->simulated,
                       out->simulated_nonfinite);
    if (out->simulated_independent)
      backend.distance(s.shadow_segments, ElementSpan{shadow(k), DType::kFloat32, 0}, nullptr, 2, w2,
                       out->simulated_independent, out->simulated_nonfinite);
  }
}

}  // namespace lgreco::collective
