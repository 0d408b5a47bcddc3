// The error probe: the error each candidate codec would make under its OWN error
// feedback, and the error the call actually made, measured on a sample of every
// adaptive layer (docs/ENGINE.md, "Statistics and the controller").
//
// Why. With error feedback a codec's error depends on its own past: the residual it left
// (up to one unit of its own width for a max-min quantizer) is added to the next input
// and widens every bucket's range, so 2-bit quantization measured on the input of a
// 4-bit run looks 2-3x better than it will be once it runs; TopK's residual holds many
// steps of unsent gradient. Measuring every candidate on the current run's state biased
// the search toward the narrow codecs (measured: 2.38x the predicted error for layers
// moved from 4 to 2 bits).
//
// How. Each adaptive layer has a fixed sample of whole granules (its codec buckets),
// the same on every rank, drawn from the engine's seed, and one rank that simulates it
// (its designated rank; layers are spread over the ranks by sample size). At every probe
// step (controller/schedule.h: each window and `probe_lead` steps before it) every rank
// sends each designated rank its exact gradient g on that rank's samples, and in the
// window's steps also its residual r and, where it owns the elements under sra, its owner
// residual r2 (one all-to-all: 4, then 12 bytes per sampled value). The designated rank:
//  - simulates every candidate c as the bucket's algorithm runs it, on every rank's g,
//    with a shadow residual per (rank, candidate) and under sra a shadow owner residual:
//    each rank's encode and decode, the owner's exact contribution, the sum, the owner's
//    re-encoding. The compression error of such a step, output minus the exact
//    reduction of what was encoded, is exactly -(w sum_p r_p + r_owner) of the new
//    shadow residuals (w = 1/P under ncclAvg, else 1), for any codec: errors that
//    correlate across ranks (TopK's, round to nearest) count as they reach the output.
//    This is `simulated`, the candidate in its own steady state; the same shadows'
//    errors weighed as independent across ranks (as `current` weighs them) are
//    `simulated_independent`: their ratio is how much the ranks' errors correlate;
//  - measures, with Backend::measure, every candidate on the sample's gradients alone
//    (`reference`, the sample's content), and on its REAL state (each rank's g + r; the
//    owner's sum, simulated with the current codecs, plus the real owner residual):
//    `current`, where a switch to the candidate would start from (under sra, a
//    quantizer of a layer that is gathered now has that switch's step simulated on the
//    real state, both stages: simulate_current_of_unreduced);
//  - measures the call's realized error on the sample: its output minus the exact
//    reduction of what it encoded, sum_p w (g_p + r_p) + r2: `realized`.
// The engine measures every candidate on the whole layers' gradients alone too
// (`measured`). The controller's estimate of a candidate is simulated x measured /
// reference: the sample's own-state error scaled by the ratio of the whole layer's content
// to the sample's. Sample and whole layer differ in content (a heavy-tailed layer's
// outliers are where they are); the ratio cancels that (measured on the demo: the sampled
// default's error alone swung by 45% between windows). Both contents are measured on g
// alone: a ratio taken on the real state would carry the state's own composition (a TopK
// residual piles up in a few elements) into every candidate.
//
// Shadow residuals persist across windows and switches. Without error feedback they
// restart from zero each step and r is 0. Everything runs through Backend operations and
// one Fabric all-to-all, enqueued like the rest of the call: no host wait, on the CPU and
// the CUDA backend alike. Memory per rank: (P + 1) floats per sampled value and probed
// candidate of the layers it simulates, plus staging; allocated when an assignment takes
// effect, where a failure is agreed.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/codec_spec.h"
#include "plugin/collective/backend.h"
#include "plugin/collective/fabric.h"
#include "plugin/collective/layout.h"
#include "plugin/collective/plan.h"

namespace lgreco::collective {

struct ProbeSettings {
  // Share of each layer's granules sampled, with at least min_granules (all of a
  // smaller layer). With 1/16 and 8 granules of 1024, 6.7% of ResNet-50's values.
  double fraction = 1.0 / 16;
  uint64_t min_granules = 8;
  uint64_t seed = 0;  // the engine's: the same on every rank
};

// Where the probe writes one call's measurements (backend memory, zeroed by the caller),
// for the layers this rank simulates; tables of L layers x C candidate columns:
// simulated[l * C + k] and its flag simulated_nonfinite[l * C + k]; reference[l * C + k]
// and current[l * C + k] (with reference_nonfinite[l] for both; the simulated part of
// current flags simulated_nonfinite[l * C + k]); realized[l]
// (realized_nonfinite[l]).
struct ProbeOutput {
  double* simulated = nullptr;
  uint8_t* simulated_nonfinite = nullptr;
  double* reference = nullptr;  // the sample's content: each candidate on g alone
  double* current = nullptr;    // each candidate on the sample's real state
  uint8_t* reference_nonfinite = nullptr;
  double* realized = nullptr;
  uint8_t* realized_nonfinite = nullptr;
  // simulated[l * C + k] with the ranks' errors weighed as independent, sum_p w^2
  // ||r_p||^2 (+ ||r_owner||^2), as `reference` and `current` weigh them; the two
  // together give TopK's correlation across ranks at its own state. Null: not measured.
  double* simulated_independent = nullptr;
};

class BucketProbe {
 public:
  // layout: the bucket; measured[l] = 1 for its adaptive layers; columns[l]: the
  // statistics column of each of layer l's candidates among `candidates` (the engine's
  // union list). Throws std::invalid_argument on inconsistent input.
  BucketProbe(const BucketLayout& layout, uint32_t bucket, std::span<const uint8_t> measured,
              const std::vector<std::vector<uint32_t>>& columns, std::span<const CodecSpec> candidates, int ranks,
              int rank, const ProbeSettings& settings);

  // Sampled values of layer l (0 for a layer that is not adaptive), and who simulates it.
  uint64_t sampled(uint32_t layer) const { return layers_[layer].sampled; }
  int designated(uint32_t layer) const { return layers_[layer].rank; }
  uint64_t sampled_total() const { return sampled_total_; }
  // Layer l's sampled call elements: runs whose `to` is the position within its sample.
  std::span<const Backend::Run> runs(uint32_t layer) const { return layers_[layer].runs; }
  // Whether candidate column k is simulated (quantization, TopK) rather than measured on
  // the whole layer alone (powersgd: measure_lowrank; none: no error).
  static bool simulates(const CodecSpec& c);

  // The codecs in effect for the bucket's layers and its algorithm: what the reference
  // measurement mirrors. for_assignment computes it without changing the probe (the
  // engine prepares an assignment a step before it takes effect); set_assignment makes
  // it the one in effect.
  struct Assignment {
    // The algorithm, which of this rank's layers are reduced by sra (their reference has
    // two stages) or not, and the plan of the reduced ones at their codecs over the
    // sample layout (the owner's sum).
    bool reduce_scatter = false;
    std::vector<uint8_t> reduced, unreduced;
    Plan current_plan;
    // Under sra, the simulation's reducible segments (of sim_plan_) of the layers that are
    // not reduced now (gathered: TopK): their `current` is simulated on the real state.
    std::vector<Segment> unreduced_reducible;
  };
  Assignment for_assignment(std::span<const CodecSpec> codecs, bool reduce_scatter) const;
  void set_assignment(Assignment assignment) { assigned_ = std::move(assignment); }
  void set_assignment(std::span<const CodecSpec> codecs, bool reduce_scatter) {
    set_assignment(for_assignment(codecs, reduce_scatter));
  }
  // Allocates the shadows (once; they persist) and prepares the backend for the
  // simulation and the measurements (of `candidates`, the statistics' columns) under
  // `assignment` (by default the one in effect); growth only, so the assignment in
  // effect stays prepared. Throws std::bad_alloc (or what Backend::prepare_* throw).
  void prepare(Backend& backend, std::span<const CodecSpec> candidates, const Assignment& assignment);
  void prepare(Backend& backend, std::span<const CodecSpec> candidates) { prepare(backend, candidates, assigned_); }

  // Staging one step needs under `assignment`, shared by the buckets of an engine.
  struct Scratch {
    uint64_t send = 0, recv = 0, inputs = 0, sum = 0, error = 0, payload = 0, flags = 0, sample = 0;
  };
  Scratch scratch_bytes(const Assignment& assignment) const;
  Scratch scratch_bytes() const { return scratch_bytes(assigned_); }
  struct Buffers {
    float* send = nullptr;
    float* recv = nullptr;
    float* inputs = nullptr;  // one rank's g, once per virtual layer
    float* sum = nullptr;     // the simulated reduction
    float* error = nullptr;   // the simulated compression error
    uint8_t* payload = nullptr;
    uint8_t* flags = nullptr;  // one byte per statistics slot
    // Each of the sample's size (this rank's layers): one rank's g + r, the owner
    // residuals, the reference's simulated owner sum, the exact reduction of what the call
    // encodes, and the call's output.
    float* x = nullptr;
    float* owner = nullptr;
    float* owner_sum = nullptr;
    float* exact = nullptr;
    float* out = nullptr;
  };

  // One probe step, before the call's own encoding (the residuals must not have moved
  // yet): exchanges the samples and advances the shadows of the layers this rank
  // simulates; with `out`, also measures simulated and reference errors (and prepares
  // realized()). `residual` covers the whole call; `owner_residual` the call elements
  // [owner_first, owner_end) (null under all-gather or without error feedback).
  struct Call {
    ElementSpan input;
    uint64_t count = 0;
    const float* residual = nullptr;
    const float* owner_residual = nullptr;
    uint64_t owner_first = 0, owner_end = 0;
    bool average = false;
    uint64_t step = 0;
    std::span<const CodecSpec> candidates;  // the statistics' columns
  };
  void step(Backend& backend, Fabric& fabric, const Call& call, const Buffers& buffers, const ProbeOutput* out);
  // After the call's output is written (a step with `out`): the realized error.
  void realized(Backend& backend, ElementSpan output, uint64_t count, const Buffers& buffers, const ProbeOutput& out);

 private:
  struct LayerSample {
    uint64_t sampled = 0;
    int rank = -1;
    uint64_t at = 0;                 // where its sample starts in its rank's sample layout
    std::vector<Backend::Run> runs;  // call elements; `to` relative to the layer's sample
  };
  void measure_reference(Backend& backend, const Call& call, const Buffers& buf, const ProbeOutput& out);
  void simulate_current_of_unreduced(Backend& backend, const Call& call, const Buffers& buf, const ProbeOutput& out);

  std::vector<LayerSample> layers_;
  int ranks_ = 1, rank_ = 0;
  uint64_t columns_ = 0, seed_ = 0, sampled_total_ = 0;
  // The exchange, to each rank q: its layers' samples (g; in windows also r, then r2).
  std::vector<uint64_t> part_at_, part_elements_;  // per rank q: values before its part, in it
  struct Transfer {
    std::vector<Backend::Run> g, r, r2;  // call elements -> the send buffer
    std::vector<uint64_t> send_bytes, recv_bytes;
  };
  Transfer lead_, window_;
  // Per candidate column: simulated (quant, TopK), and of those reducible or gathered.
  std::vector<uint8_t> simulated_, reducible_, gathered_;
  uint64_t mine_ = 0;  // values of the samples this rank simulates
  std::vector<Backend::Run> out_runs_;  // call elements -> this rank's sample layout
  // This rank's layers over its sample layout [0, mine_): one plan segment per layer
  // (segment.layer = the bucket's layer index) for the measurements.
  Plan sample_plan_;
  std::vector<uint8_t> mine_layers_;  // per bucket layer: 1 if this rank simulates it
  // The simulation: one virtual layer per (simulated layer, simulated candidate),
  // reducible candidates first; segment.layer = its statistics slot (layer * C + column).
  Plan sim_plan_;
  uint32_t reducible_segments_ = 0;
  std::vector<Backend::Run> replicate_;  // sample layout -> virtual layout
  uint64_t virtual_ = 0;
  std::unique_ptr<Backend::Buffer> shadows_, owner_shadow_;  // ranks x virtual, virtual
  Assignment assigned_;                                      // in effect (set_assignment)
};

}  // namespace lgreco::collective
