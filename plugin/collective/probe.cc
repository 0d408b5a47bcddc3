#include "plugin/collective/probe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace lgreco::collective {

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
double unit_interval(uint64_t h) { return static_cast<double>(mix64(h) >> 11) * 0x1.0p-53; }

// The granules of a layer to sample: every one of a small layer (and then its partial
// last one too: the sample is the layer), else one drawn in each of m equal strata, so
// that the sample covers the layer evenly without aliasing with a periodic structure.
std::vector<Backend::Run> sample_runs(const LayerLayout& layer, uint64_t granule, const ProbeSettings& s,
                                      uint64_t key) {
  const uint64_t whole = layer.numel / granule;
  const auto wanted = static_cast<uint64_t>(std::ceil(s.fraction * static_cast<double>(whole)));
  const uint64_t m = std::max<uint64_t>(wanted, s.min_granules);
  if (whole == 0 || m >= whole) return {Backend::Run{layer.offset, 0, layer.numel}};
  std::vector<Backend::Run> runs;
  uint64_t to = 0;
  for (uint64_t i = 0; i < m; ++i) {
    const uint64_t lo = i * whole / m, hi = (i + 1) * whole / m;  // hi > lo, since whole > m
    const auto drawn = static_cast<uint64_t>(unit_interval(key ^ mix64(i)) * static_cast<double>(hi - lo));
    const uint64_t from = layer.offset + (lo + std::min(drawn, hi - lo - 1)) * granule;
    if (!runs.empty() && runs.back().from + runs.back().count == from) runs.back().count += granule;
    else runs.push_back(Backend::Run{from, to, granule});
    to += granule;
  }
  return runs;
}

// TopK on a sample keeps the share of it that the codec keeps of the whole layer
// (k = ceil(density n) rounds up, which on a small sample would overstate the share): the
// density whose ceil(density x sampled) is round(k(layer) x sampled / numel), at least 1.
CodecSpec sampled_codec(const CodecSpec& c, uint64_t numel, uint64_t sampled) {
  if (c.family() != CodecFamily::kTopk || sampled == numel) return c;
  TopkParams p = c.topk_params();
  const double share = static_cast<double>(p.k(numel)) * static_cast<double>(sampled) / static_cast<double>(numel);
  const uint64_t k = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(share)));
  p.density_ppb = static_cast<uint32_t>(std::clamp<uint64_t>(k * TopkParams::kPartsPerUnit / sampled, 1,
                                                             TopkParams::kPartsPerUnit));
  return CodecSpec::topk(p);
}

// A layout of float32 layers of these sizes and codecs, back to back from element 0.
BucketLayout virtual_layout(std::span<const uint64_t> sizes, std::span<const CodecSpec> codecs) {
  BucketLayout b;
  b.dtype = DType::kFloat32;
  for (size_t i = 0; i < sizes.size(); ++i) {
    b.layers.push_back(LayerLayout{"v" + std::to_string(i), b.count, sizes[i], {codecs[i]}, 0, 0});
    b.count += sizes[i];
  }
  return b;
}

ElementSpan floats(const float* data) { return ElementSpan{const_cast<float*>(data), DType::kFloat32, 0}; }

}  // namespace

bool BucketProbe::simulates(const CodecSpec& c) {
  return c.family() == CodecFamily::kQuant || c.family() == CodecFamily::kTopk;
}

BucketProbe::BucketProbe(const BucketLayout& layout, uint32_t bucket, std::span<const uint8_t> measured,
                         const std::vector<std::vector<uint32_t>>& columns, std::span<const CodecSpec> candidates,
                         int ranks, int rank, const ProbeSettings& settings)
    : ranks_(ranks), rank_(rank), columns_(candidates.size()) {
  const size_t n = layout.layers.size();
  if (measured.size() != n || columns.size() != n || ranks < 1 || rank < 0 || rank >= ranks ||
      !(settings.fraction > 0 && settings.fraction <= 1))
    throw std::invalid_argument("BucketProbe: inconsistent layout, columns, ranks or fraction");
  seed_ = mix64(settings.seed ^ mix64(0x70726f6265ull + bucket));
  layers_.resize(n);
  // The samples, and who simulates each layer: the costliest first, each to the rank with
  // the least work so far (the lowest on ties), so that every rank derives the same.
  std::vector<uint64_t> cost(n, 0);
  std::vector<uint32_t> order;
  for (size_t l = 0; l < n; ++l) {
    if (!measured[l]) continue;
    const LayerLayout& layer = layout.layers[l];
    if (columns[l].size() != layer.candidates.size())
      throw std::invalid_argument("BucketProbe: layer " + layer.name + " has columns for other candidates");
    const uint64_t granule = layer_granule(layer, layer.candidates[layer.default_index]);
    layers_[l].runs = sample_runs(layer, granule, settings, seed_ ^ mix64(l + 1));
    for (const Backend::Run& r : layers_[l].runs) layers_[l].sampled += r.count;
    sampled_total_ += layers_[l].sampled;
    uint64_t work = 1;
    for (const CodecSpec& c : layer.candidates) work += simulates(c) ? static_cast<uint64_t>(ranks) : 1;
    cost[l] = layers_[l].sampled * work;
    order.push_back(static_cast<uint32_t>(l));
  }
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return cost[a] > cost[b]; });
  std::vector<uint64_t> load(ranks, 0);
  for (uint32_t l : order) {
    const int q = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    layers_[l].rank = q;
    load[q] += cost[l];
  }

  // Each rank's part of the exchange: its layers in bucket order.
  part_at_.assign(ranks, 0);
  part_elements_.assign(ranks, 0);
  uint64_t base = 0;
  for (int q = 0; q < ranks; ++q) {
    part_at_[q] = base;
    for (size_t l = 0; l < n; ++l) {
      if (layers_[l].rank != q) continue;
      layers_[l].at = part_elements_[q];
      part_elements_[q] += layers_[l].sampled;
    }
    base += part_elements_[q];
  }
  mine_ = part_elements_[rank];
  // The exchange's runs into the send buffer: g alone (lead steps), or g, r, r2 as three
  // blocks of each part (window steps).
  for (Transfer* t : {&lead_, &window_}) {
    const uint64_t k = t == &lead_ ? 1 : 3;
    for (int q = 0; q < ranks; ++q) {
      t->send_bytes.push_back(k * part_elements_[q] * sizeof(float));
      t->recv_bytes.push_back(k * mine_ * sizeof(float));
    }
  }
  for (size_t l = 0; l < n; ++l) {
    if (layers_[l].rank < 0) continue;
    const int q = layers_[l].rank;
    for (const Backend::Run& r : layers_[l].runs) {
      const uint64_t at = layers_[l].at + r.to;
      lead_.g.push_back(Backend::Run{r.from, part_at_[q] + at, r.count});
      window_.g.push_back(Backend::Run{r.from, 3 * part_at_[q] + at, r.count});
      window_.r.push_back(Backend::Run{r.from, 3 * part_at_[q] + part_elements_[q] + at, r.count});
      window_.r2.push_back(Backend::Run{r.from, 3 * part_at_[q] + 2 * part_elements_[q] + at, r.count});
    }
  }
  for (const CodecSpec& c : candidates) {
    simulated_.push_back(simulates(c) ? 1 : 0);
    reducible_.push_back(simulates(c) && exchange_of(c) == Exchange::kReduce ? 1 : 0);
    gathered_.push_back(simulates(c) && exchange_of(c) == Exchange::kGather ? 1 : 0);
  }

  // This rank's layers: their plan over its sample layout, and the simulation's virtual
  // layers (one per simulated candidate of each).
  std::vector<uint64_t> sizes, vsizes, vslots;
  std::vector<CodecSpec> nones, vcodecs;
  std::vector<uint32_t> mine;
  mine_layers_.assign(n, 0);
  for (size_t l = 0; l < n; ++l) {
    if (layers_[l].rank != rank) continue;
    mine.push_back(static_cast<uint32_t>(l));
    mine_layers_[l] = 1;
    sizes.push_back(layers_[l].sampled);
    nones.push_back(CodecSpec::none());
    for (const Backend::Run& r : layers_[l].runs)
      out_runs_.push_back(Backend::Run{r.from, layers_[l].at + r.to, r.count});
  }
  sample_plan_ = make_plan(virtual_layout(sizes, nones), nones, 1);
  for (Segment& s : sample_plan_.segments) s.layer = mine[s.layer];
  for (int pass = 0; pass < 2; ++pass)  // reducible candidates first, then gathered ones
    for (size_t i = 0; i < mine.size(); ++i) {
      const LayerLayout& layer = layout.layers[mine[i]];
      for (size_t c = 0; c < layer.candidates.size(); ++c) {
        const CodecSpec& spec = layer.candidates[c];
        if (!simulates(spec) || (exchange_of(spec) == Exchange::kReduce) != (pass == 0)) continue;
        replicate_.push_back(Backend::Run{layers_[mine[i]].at, virtual_, sizes[i]});
        vsizes.push_back(sizes[i]);
        vcodecs.push_back(sampled_codec(spec, layer.numel, sizes[i]));
        vslots.push_back(mine[i] * columns_ + columns[mine[i]][c]);
        virtual_ += sizes[i];
        if (pass == 0) ++reducible_segments_;
      }
    }
  sim_plan_ = make_plan(virtual_layout(vsizes, vcodecs), vcodecs, 1);
  if (sim_plan_.segments.size() != vsizes.size()) throw std::logic_error("BucketProbe: a virtual layer is not one segment");
  for (Segment& s : sim_plan_.segments) s.layer = static_cast<uint32_t>(vslots[s.layer]);
  assigned_.reduced.assign(n, 0);
  assigned_.unreduced.assign(n, 0);
}

BucketProbe::Assignment BucketProbe::for_assignment(std::span<const CodecSpec> codecs, bool reduce_scatter) const {
  Assignment a;
  a.reduce_scatter = reduce_scatter;
  a.reduced.assign(layers_.size(), 0);
  a.unreduced.assign(layers_.size(), 0);
  std::vector<uint32_t> mine;
  std::vector<uint64_t> sizes;
  std::vector<CodecSpec> current;
  std::vector<uint8_t> included;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!mine_layers_[l]) continue;
    const bool reduced = reduce_scatter && exchange_of(codecs[l]) == Exchange::kReduce;
    (reduced ? a.reduced : a.unreduced)[l] = 1;
    mine.push_back(static_cast<uint32_t>(l));
    sizes.push_back(layers_[l].sampled);
    current.push_back(reduced ? codecs[l] : CodecSpec::none());
    included.push_back(reduced ? 1 : 0);
  }
  a.current_plan = make_plan(virtual_layout(sizes, current), current, 1, included);
  for (Segment& s : a.current_plan.segments) s.layer = mine[s.layer];
  if (reduce_scatter)
    for (const Segment& s : std::span<const Segment>(sim_plan_.segments).first(reducible_segments_))
      if (a.unreduced[s.layer / columns_]) a.unreduced_reducible.push_back(s);
  return a;
}

BucketProbe::Scratch BucketProbe::scratch_bytes(const Assignment& assignment) const {
  Scratch s;
  const uint64_t all = std::accumulate(part_elements_.begin(), part_elements_.end(), uint64_t{0});
  s.send = 3 * all * sizeof(float);
  s.recv = 3 * static_cast<uint64_t>(ranks_) * mine_ * sizeof(float);
  s.inputs = s.sum = s.error = virtual_ * sizeof(float);
  s.payload = std::max(sim_plan_.total_bytes, assignment.current_plan.total_bytes);
  s.flags = layers_.size() * columns_;
  s.sample = mine_ * sizeof(float);
  return s;
}

void BucketProbe::prepare(Backend& backend, std::span<const CodecSpec> candidates, const Assignment& assignment) {
  if (mine_ == 0) return;
  backend.prepare_measure(sample_plan_, candidates);
  if (!assignment.current_plan.segments.empty()) backend.prepare_encode(assignment.current_plan);
  if (virtual_ == 0) return;
  // Without error feedback nothing carries over, but the codecs still need somewhere to
  // write what they lose: that is the error (step()).
  if (!shadows_) {
    shadows_ = backend.allocate(static_cast<uint64_t>(ranks_) * virtual_ * sizeof(float));
    owner_shadow_ = backend.allocate(virtual_ * sizeof(float));
  }
  backend.prepare_probe(sim_plan_);
}

void BucketProbe::step(Backend& backend, Fabric& fabric, const Call& call, const Buffers& buf,
                       const ProbeOutput* out) {
  const int n = ranks_;
  const float w = call.average ? 1.0f / static_cast<float>(n) : 1.0f;
  // Every rank sends each designated rank g of its samples; in a window's steps r and r2
  // too (the reference and realized errors need them), as three blocks of its part.
  const Transfer& x = out ? window_ : lead_;
  backend.gather(x.g, call.input, call.count, 1.0f, false, buf.send);
  if (out) {
    const ElementSpan none{nullptr, DType::kFloat32, 0};  // outside [0, 0): zeros
    if (call.residual) backend.gather(x.r, floats(call.residual), call.count, 1.0f, false, buf.send);
    else backend.gather(x.r, none, 0, 1.0f, false, buf.send);
    if (call.owner_residual)
      backend.gather(x.r2, ElementSpan{const_cast<float*>(call.owner_residual), DType::kFloat32, call.owner_first},
                     call.owner_end, 1.0f, false, buf.send);
    else backend.gather(x.r2, none, 0, 1.0f, false, buf.send);
  }
  fabric.all_to_all_v(reinterpret_cast<const uint8_t*>(buf.send), x.send_bytes, reinterpret_cast<uint8_t*>(buf.recv),
                      x.recv_bytes);
  if (mine_ == 0) return;
  const uint64_t k = out ? 3 : 1;
  const auto g_of = [&](int p) { return buf.recv + static_cast<uint64_t>(p) * k * mine_; };
  if (out) measure_reference(backend, call, buf, *out);
  if (virtual_ == 0) return;

  // The simulation: every rank's encoding with its shadow, the owner's (this rank's) exact
  // contribution under sra, the sum, and under sra the owner's re-encoding.
  const std::span<const Segment> all = sim_plan_.segments;
  const std::span<const Segment> reducible = all.first(reducible_segments_);
  const std::span<const Segment> gathered = all.subspan(reducible_segments_);
  const uint64_t vbytes = virtual_ * sizeof(float);
  auto* shadows = static_cast<float*>(shadows_->data());
  auto* owner = static_cast<float*>(owner_shadow_->data());
  const bool feedback = call.residual != nullptr;
  backend.fill_zero(buf.sum, vbytes);
  const ElementSpan sum = floats(buf.sum);
  for (int p = 0; p < n; ++p) {
    float* shadow = shadows + static_cast<uint64_t>(p) * virtual_;
    if (!feedback) backend.fill_zero(shadow, vbytes);
    backend.gather(replicate_, floats(g_of(p)), mine_, 1.0f, false, buf.inputs);
    const ElementSpan input = floats(buf.inputs);
    backend.find_nonfinite(sim_plan_, all, input, buf.flags);
    const NoiseBase noise{seed_, static_cast<uint32_t>(p), call.step, 0};
    const bool owns = assigned_.reduce_scatter && p == rank_;
    if (owns) backend.accumulate_exact(sim_plan_, reducible, input, shadow, 0, buf.flags, sum);
    const std::span<const Segment> sent = owns ? gathered : all;
    backend.encode(sim_plan_, sent, input, shadow, 0, buf.flags, noise, buf.payload, 0);
    backend.decode_accumulate(sim_plan_, sent, buf.payload, 0, sum);
  }
  if (call.average) backend.divide(buf.sum, virtual_, static_cast<float>(n));
  if (assigned_.reduce_scatter) {
    if (!feedback) backend.fill_zero(owner, vbytes);
    const NoiseBase noise{seed_, NoiseBase::kReencodeRankBit | static_cast<uint32_t>(rank_), call.step, 0};
    backend.encode(sim_plan_, reducible, sum, owner, 0, nullptr, noise, buf.payload, 0);
  }
  if (!out) return;
  // Output - (what was encoded) = -(w sum_p r_p + r_owner) of the new shadows (the owner
  // shadow of gathered candidates stays 0: only reducible ones are re-encoded); and the
  // same errors as if the ranks' were independent, each shadow's apart (TopK's are not
  // independent: the ranks hold back the same large coordinates).
  backend.fill_zero(buf.error, vbytes);
  const Backend::Run whole{0, 0, virtual_};
  const auto add_error = [&](const float* shadow, float weight) {
    backend.gather({&whole, 1}, floats(shadow), virtual_, weight, true, buf.error);
    if (out->simulated_independent)
      backend.distance(all, floats(shadow), nullptr, 2, static_cast<double>(weight) * weight,
                       out->simulated_independent, out->simulated_nonfinite);
  };
  for (int p = 0; p < n; ++p) add_error(shadows + static_cast<uint64_t>(p) * virtual_, w);
  if (assigned_.reduce_scatter) add_error(owner, 1.0f);
  backend.distance(all, floats(buf.error), nullptr, 2, 1.0, out->simulated, out->simulated_nonfinite);
  simulate_current_of_unreduced(backend, call, buf, *out);
}

// `current` of the reducible candidates of layers that are gathered now (TopK's, under
// sra): where a switch to such a candidate starts, both of its stages. The first re-encodes
// nothing; the second re-encodes the owner's sum, which holds every rank's g + r and the
// first stage's errors. Estimated as one rank's contribution, P copies of one rank's
// state, the sum's range was that of fully correlated ranks: the ranks' TopK residuals hold
// their own batches' noise, and the demo's layers leaving TopK for 3 and 4 bits realized
// 0.76-0.85 of their prediction (the owner's exact sum without the first stage's errors:
// 4 bits within 2%, 3 bits 0.92-0.97, 2 bits 0.76-0.80 of a real switch). So the step is
// simulated as the shadows are, on the real state and residuals: each other rank's
// encoding (its error, the new residual from none, is the first stage's), the owner's
// exact g + r, the sum, and its re-encoding with the real owner residual (the error left in
// it is the second stage's). Nothing persists; the buffers are the simulation's, done with.
void BucketProbe::simulate_current_of_unreduced(Backend& backend, const Call& call, const Buffers& buf,
                                                const ProbeOutput& out) {
  const std::span<const Segment> segments = assigned_.unreduced_reducible;
  if (segments.empty()) return;
  const int n = ranks_;
  const float w = call.average ? 1.0f / static_cast<float>(n) : 1.0f;
  const uint64_t vbytes = virtual_ * sizeof(float);
  const auto block = [&](int p, int b) { return buf.recv + (static_cast<uint64_t>(p) * 3 + b) * mine_; };
  const ElementSpan sum = floats(buf.sum), input = floats(buf.inputs);
  const uint64_t noise_seed = seed_ ^ 0x637572ull;  // not the shadows' rounding noise
  backend.fill_zero(buf.sum, vbytes);
  for (int p = 0; p < n; ++p) {
    backend.gather(replicate_, floats(block(p, 0)), mine_, 1.0f, false, buf.inputs);
    backend.gather(replicate_, floats(block(p, 1)), mine_, 1.0f, true, buf.inputs);  // g + r
    backend.find_nonfinite(sim_plan_, segments, input, buf.flags);
    if (p == rank_) {
      backend.accumulate_exact(sim_plan_, segments, input, nullptr, 0, buf.flags, sum);
      continue;
    }
    backend.fill_zero(buf.error, vbytes);
    const NoiseBase noise{noise_seed, static_cast<uint32_t>(p), call.step, 0};
    backend.encode(sim_plan_, segments, input, buf.error, 0, buf.flags, noise, buf.payload, 0);
    backend.decode_accumulate(sim_plan_, segments, buf.payload, 0, sum);
    backend.distance(segments, floats(buf.error), nullptr, 2, static_cast<double>(w) * w, out.current,
                     out.simulated_nonfinite);
  }
  if (call.average) backend.divide(buf.sum, virtual_, static_cast<float>(n));
  backend.fill_zero(buf.error, vbytes);
  for (int p = 0; p < n; ++p) backend.gather(replicate_, floats(block(p, 2)), mine_, 1.0f, true, buf.error);
  const NoiseBase noise{noise_seed, NoiseBase::kReencodeRankBit | static_cast<uint32_t>(rank_), call.step, 0};
  backend.encode(sim_plan_, segments, sum, buf.error, 0, nullptr, noise, buf.payload, 0);
  backend.distance(segments, floats(buf.error), nullptr, 2, 1.0, out.current, out.simulated_nonfinite);
}

// The sample measured two ways. Its content: every simulated candidate on each rank's g
// alone, weight w^2, as Engine::measure_whole_layers measures the whole layers (the
// estimate's composition factor is their ratio). Its real state, what each candidate
// makes now on the residuals the codecs in effect left (a switch's starting point,
// controller.h): each rank's g + r with weight w^2 (all ranks for gathered candidates and
// under all-gather; all but the owner, this rank, for the first stage of reduced layers),
// and the owner's sum of the current codecs' decoded values plus the real owner residual.
// (The reducible candidates of a layer that is not reduced now are simulated instead:
// simulate_current_of_unreduced.) Also the exact reduction for realized().
void BucketProbe::measure_reference(Backend& backend, const Call& call, const Buffers& buf, const ProbeOutput& out) {
  const int n = ranks_;
  const float w = call.average ? 1.0f / static_cast<float>(n) : 1.0f;
  const double w2 = static_cast<double>(w) * w;
  const Backend::Run all{0, 0, mine_};
  const uint64_t bytes = mine_ * sizeof(float);
  const auto block = [&](int p, int b) { return buf.recv + (static_cast<uint64_t>(p) * 3 + b) * mine_; };
  const std::span<const Segment> layers = sample_plan_.segments;
  Backend::Measure m;
  m.candidates = call.candidates;
  m.squared = out.current;
  m.nonfinite = out.reference_nonfinite;
  const auto measure = [&](const float* x, const float* residual, std::span<const uint8_t> which,
                           std::span<const uint8_t> mask, double weight) {
    m.measured = which;
    m.candidate_mask = mask;
    m.weight = weight;
    backend.measure(sample_plan_, layers, floats(x), residual, 0, m);
  };
  // The sample's content, as the engine measures the whole layers': every simulated
  // candidate on each rank's gradient alone.
  Backend::Measure content = m;
  content.squared = out.reference;
  content.measured = mine_layers_;
  content.candidate_mask = simulated_;
  content.weight = w2;
  for (int p = 0; p < n; ++p) backend.measure(sample_plan_, layers, floats(block(p, 0)), nullptr, 0, content);
  backend.fill_zero(buf.exact, bytes);
  backend.fill_zero(buf.owner, bytes);
  backend.fill_zero(buf.owner_sum, bytes);
  const ElementSpan owner_sum = floats(buf.owner_sum);
  for (int p = 0; p < n; ++p) {
    backend.gather({&all, 1}, floats(block(p, 0)), mine_, 1.0f, false, buf.x);
    backend.gather({&all, 1}, floats(block(p, 1)), mine_, 1.0f, true, buf.x);  // x = g + r
    backend.gather({&all, 1}, floats(buf.x), mine_, w, true, buf.exact);
    backend.gather({&all, 1}, floats(block(p, 2)), mine_, 1.0f, true, buf.owner);
    if (!assigned_.reduce_scatter) {
      measure(buf.x, nullptr, mine_layers_, simulated_, w2);
      continue;
    }
    measure(buf.x, nullptr, mine_layers_, gathered_, w2);
    const std::span<const Segment> reduced = assigned_.current_plan.segments;
    if (reduced.empty()) continue;
    if (p == rank_) {
      backend.accumulate_exact(assigned_.current_plan, reduced, floats(buf.x), nullptr, 0, nullptr, owner_sum);
      continue;
    }
    measure(buf.x, nullptr, assigned_.reduced, reducible_, w2);
    const NoiseBase noise{seed_ ^ 0x726566ull, static_cast<uint32_t>(p), call.step, 0};
    backend.encode(assigned_.current_plan, reduced, floats(buf.x), nullptr, 0, nullptr, noise, buf.payload, 0);
    backend.decode_accumulate(assigned_.current_plan, reduced, buf.payload, 0, owner_sum);
  }
  if (assigned_.reduce_scatter && !assigned_.current_plan.segments.empty()) {
    if (call.average) backend.divide(buf.owner_sum, mine_, static_cast<float>(n));
    measure(buf.owner_sum, buf.owner, assigned_.reduced, reducible_, 1.0);
  }
  backend.gather({&all, 1}, floats(buf.owner), mine_, 1.0f, true, buf.exact);
}

void BucketProbe::realized(Backend& backend, ElementSpan output, uint64_t count, const Buffers& buf,
                           const ProbeOutput& out) {
  if (mine_ == 0) return;
  backend.gather(out_runs_, output, count, 1.0f, false, buf.out);
  backend.distance(sample_plan_.segments, floats(buf.out), buf.exact, 2, 1.0, out.realized, out.realized_nonfinite);
}

}  // namespace lgreco::collective
