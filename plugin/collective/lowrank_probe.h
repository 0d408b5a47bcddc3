// The error probe of low-rank (PowerSGD) candidates: each one run under its OWN error
// feedback on every adaptive matrix layer, as the exchange runs it (docs/ENGINE.md,
// "Statistics and the controller").
//
// Why. PowerSGD's error feedback keeps what a rank's M loses to the shared basis; that
// residual piles up until the warm-started power iteration picks it up, and it holds many
// steps of the gradient's weaker directions. Measured on the real state of another codec
// (one power iteration on g + a 4-bit quantizer's small residual), a rank-r candidate
// looked 6-28x better than a real run of it makes (tests/unit/probe_test.cc,
// lowrank_shadows_give_powersgd_its_own_steady_state_error).
//
// Why whole layers. The quantization and TopK probe (probe.h) simulates a sample of
// codec buckets. A low-rank codec's residual depends on the matrix's dimensions: the
// share of the residual one rank-r step takes away is about r / min(rows, cols), so a
// sample of rows (a smaller matrix) drains its residual faster and settles lower; measured
// on the test's matrices with an eighth of the rows, 0.18-0.65 of a real run's error.
// So every matrix layer with powersgd candidates is simulated whole.
//
// How. Every rank runs every low-rank candidate c on its own g with its own shadow
// residual r_c and factor Q_c, exactly as the exchange runs a layer (Engine::low_rank):
// P = (g + r_c) Q_c summed across ranks, orthonormalized, Q' = (g + r_c)^T P summed,
// r_c <- (g + r_c) - P Q'_own^T; Q_c starts at the layer's seeded Q0 and is warm-started
// from the summed Q', as the exchange's. The output's compression error of such a step is
// w sum_p r_p' (w = 1/P under ncclAvg), a sum no rank holds: each rank sketches its new
// residual (Backend::sketch, kLowRankSketchWidth buckets per layer and candidate, signs
// keyed by step, layer and candidate, the same on every rank), and the sketches are summed
// in the allreduce of Q'. The sum's sketch is the sketch of sum_p r_p', whose squared norm
// estimates ||sum_p r_p'||^2 without bias (relative spread about sqrt(2 / width) per step,
// 4.4%; exact for a layer of at most width values). At the window's steps the layer's
// designated rank (the quantization probe's, which counts the layer's sample) adds w^2
// x that (`simulated`), and every rank adds w^2 ||r_p'||^2, its share of the ranks'
// errors weighed as independent (`simulated_independent`). The engine measures the whole
// layer's content (`measured`, on g alone) and uses it as the reference too: the
// simulation is of the whole layer, so the content ratio is 1.
//
// Cost per probe step and rank: the candidates' P and Q' (what each candidate's own
// exchange sends) and width floats per layer and candidate, in two allreduces; C + 1 floats
// of backend memory per value of the layers (C low-rank candidates' shadows, and g's
// float32 copy), plus the factors, allocated once by prepare() where the engine agrees a
// failure and counted in LGRECO_MAX_MEMORY. Everything runs through Backend operations and
// two Fabric allreduces, enqueued like the rest of the call: no host wait, on the CPU and
// the CUDA backend alike.
//
// Not measured here: a candidate on the real state (`current`, where a switch would
// start); the controller places a switch to a low-rank codec on its growth curve as for
// TopK (controller.cc, mean_error).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/codec_spec.h"
#include "plugin/collective/backend.h"
#include "plugin/collective/fabric.h"
#include "plugin/collective/layout.h"
#include "plugin/collective/probe.h"

namespace lgreco::collective {

// Buckets of each layer's and candidate's residual sketch.
constexpr uint64_t kLowRankSketchWidth = 1024;

class LowRankProbe {
 public:
  // layout: the bucket; measured[l] = 1 for its adaptive layers; columns[l]: the
  // statistics column of each of layer l's candidates among `candidates` (the engine's
  // union list); designated[l]: the rank that counts layer l's sample; layer_base: the
  // bucket's first global layer index (with `seed`, the key of the seeded bases, the
  // exchange's own). Layers without a matrix shape or powersgd candidates are left out.
  LowRankProbe(const BucketLayout& layout, uint32_t layer_base, std::span<const uint8_t> measured,
               const std::vector<std::vector<uint32_t>>& columns, std::span<const CodecSpec> candidates,
               std::span<const int> designated, int ranks, int rank, uint64_t seed);

  bool empty() const { return values_ == 0; }
  // Whether layer l's low-rank columns are simulated here.
  bool covers(uint32_t layer) const { return covered_[layer] != 0; }

  // Allocates the state (once; it persists, and a second call does nothing), starts every
  // candidate's factor at the layer's seeded Q0 (uploaded from pinned memory, as the
  // exchange's), and prepares the backend's low-rank and distance operations for it.
  // Throws std::bad_alloc (or what Backend::prepare_lowrank throws).
  void prepare(Backend& backend);

  // One probe step of a call on `input` (the call's elements): advances every candidate's
  // shadows; with `out` (a window's step) also adds `simulated` (the designated rank's
  // layers) and `simulated_independent` (every rank's share) to its tables.
  struct Call {
    ElementSpan input;
    uint64_t count = 0;
    uint64_t step = 0;
    bool average = false;
    bool error_feedback = true;
  };
  void step(Backend& backend, Fabric& fabric, const Call& call, const ProbeOutput* out);

 private:
  std::vector<uint8_t> covered_;
  std::vector<Backend::Run> runs_;  // call elements -> the copy of g
  uint64_t values_ = 0;
  int ranks_ = 1, rank_ = 0;
  uint64_t seed_ = 0;
  uint32_t layer_base_ = 0;
  // Per low-rank candidate k: its layers (offset into the copy, P and Q offsets of their
  // own), their sketches (from its shadow; `to` into the sketch part of the allreduce),
  // the segments of this rank's designated layers' sketches (layer = statistics slot),
  // and of every layer's shadow (the independent share).
  struct Shadow {
    uint32_t column = 0;
    std::vector<Backend::LowRankLayer> layers;
    std::vector<Backend::SketchRun> sketches;
    std::vector<Segment> sketch_segments, shadow_segments;
  };
  std::vector<Shadow> shadows_of_;
  std::vector<Backend::LowRankLayer> all_layers_;
  uint64_t p_floats_ = 0, q_floats_ = 0, sketch_floats_ = 0;
  // State: per k a shadow (r_c of this rank) of the copy's size; this rank's g; P; the
  // sketches followed by Q' (one allreduce); Q and Q0, and Q0's pinned staging.
  std::unique_ptr<Backend::Buffer> shadows_, g_, p_, sketch_q_, q_, q0_, q0_host_;
};

}  // namespace lgreco::collective
