// The compressed-allreduce engine of one communicator.
//
// The caller (the shim, lgreco-bench, the demo, tests) knows which bucket a call is and
// which step it belongs to (config/bucket_matcher.h); the engine turns the call into codec
// operations on a Backend and exchanges on a Fabric, keeps the error-feedback residuals,
// measures the candidates' errors for the L-GreCo controller and applies its assignments,
// switching at the same step on every rank.
//
// Algorithms (EngineOptions::algorithm; docs/ENGINE.md has the derivations):
//   scatter-reduce-allgather (sra): the call is split into one partition per rank,
//     balanced by encoded bytes on codec bucket boundaries (plugin/collective/plan.h).
//     Each rank encodes the partitions it does not own and sends each to its owner
//     (all-to-all); the owner sums, in rank order and in float32, the decoded
//     contributions and its own exact values, re-encodes the sum with its own
//     error-feedback residual, and every rank all-gathers and decodes all partitions.
//     Every rank decodes the same bytes, so outputs are bit-identical. Bytes sent per
//     rank: about 2 (P-1)/P of one encoding; two quantizations.
//   all-gather: every rank encodes the whole call, all-gathers every encoding, and sums
//     the decoded values in rank order. One quantization, (P-1) encodings sent per rank:
//     better for 2 ranks and for small buckets (one round of latency instead of two).
//   auto: all-gather for at most 2 ranks or encodings up to 32 KiB, else sra.
//
// Everything is enqueued on the backend's and fabric's queue. The host reads results
// back (the statistics summed across ranks, the ranks' agreement on an assignment) a
// step after it queued them, so that it waits for nothing it just queued: with a
// switch lag of 3 or more, no wait in the steady state finds the queue behind (only the
// first call's comparison of configurations waits; docs/ENGINE.md, "The host waits for
// nothing it just queued"). Backend::wait_counters() counts the waits.
//
// Failures: before a call's data is queued to peers, a problem that every rank sees alike
// (different configurations, an invalid parameter on any rank, a failed allocation)
// makes every rank pass through, with one WARN saying why. A failure after data was
// queued (a peer died or timed out, a size mismatch) returns kError with the fabric's
// message; the engine is then broken and every later call returns kError too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/params.h"
#include "config/registration.h"
#include "controller/controller.h"
#include "kernels/codec_spec.h"
#include "plugin/collective/backend.h"
#include "plugin/collective/fabric.h"
#include "plugin/collective/layout.h"
#include "plugin/collective/lowrank_probe.h"
#include "plugin/collective/plan.h"
#include "plugin/collective/probe.h"

namespace lgreco::collective {

enum class Algorithm : uint8_t { kAuto, kScatterReduceAllGather, kAllGather };
const char* algorithm_name(Algorithm algorithm);  // "auto", "sra", "allgather"
bool parse_algorithm(std::string_view text, Algorithm* algorithm);

enum class ReduceOp : uint8_t { kSum, kAvg };

struct EngineOptions {
  // kOff: every call passes through (after the configurations were compared).
  config::Mode mode = config::Mode::kAdaptive;
  CodecSpec codec;                    // the default codec of adaptive layers
  std::vector<CodecSpec> candidates;  // what adaptive layers choose among; holds `codec`
  bool error_feedback = true;
  Algorithm algorithm = Algorithm::kAuto;
  uint64_t seed = 0x6c677265636f2121ull;  // rounding noise; the same on every rank
  controller::ControllerSettings controller;
  // The error probe's sample (plugin/collective/probe.h); its seed is `seed`.
  ProbeSettings probe;

  // What ranks compare before compressing. A rank whose configuration is invalid still
  // takes part (valid = false), so that every rank passes through together.
  bool valid = true;
  std::string invalid_reason;
  std::string parameters_text;  // every setting ranks must agree on, in canonical text

  // From the LGRECO_* parameters. An invalid parameter set gives valid = false (never
  // throws). With the time objective, `none` joins the candidates: where the link is
  // faster than the codec, not compressing is the fastest choice.
  static EngineOptions from_params(const config::Params& params, int rank);
};

// A registered bucket as the engine sees it: each layer's candidates from its policy
// (config::layer_policy) and the mode.
BucketLayout layout_from_registration(const config::RegisteredBucket& bucket, const EngineOptions& options);

struct EngineCall {
  uint32_t bucket = 0;  // index into the engine's buckets
  uint64_t step = 0;    // the communicator's step; never goes backwards
  const void* send = nullptr;
  void* recv = nullptr;  // may equal send
  uint64_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  // The bucket's buffer moved (a new model or a reallocation): its residuals restart.
  bool new_address = false;
};

struct CallOutcome {
  enum class Kind : uint8_t {
    kDone,         // recv holds the (compressed) reduction
    kPassThrough,  // nothing was sent; the caller must reduce uncompressed
    kError,        // data was in flight and the exchange failed; `message` says why
  };
  Kind kind = Kind::kDone;
  std::string message;
};

struct EngineCounters {
  uint64_t calls = 0, compressed_calls = 0, passed_through = 0, errors = 0;
  uint64_t uncompressed_bytes = 0;  // count x element size of compressed calls
  uint64_t encoded_bytes = 0;       // one encoding of those calls (what the controller minimises)
  uint64_t wire_bytes_sent = 0;     // bytes this rank sent to peers for them (the probe's included)
  uint64_t probe_bytes_sent = 0;    // of those, the error probe's exchanges
  // Time in fabric operations and in encode/decode operations, read from the backend's
  // marks once the queue has passed them (a CUDA backend's lag a few calls behind).
  double exchange_seconds = 0;
  double codec_seconds = 0;
  // The host's waits for queued work (Backend::WaitCounters), and of those the ones that
  // found it unfinished: the host blocked there.
  uint64_t host_waits = 0, host_stalls = 0;
};

class Engine {
 public:
  // Throws std::invalid_argument on layouts that break plugin/collective/layout.h's rules
  // or when the options cannot make a controller (a caller's bug, not a user's input).
  Engine(EngineOptions options, std::vector<BucketLayout> buckets, Fabric& fabric, Backend& backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Collective: every rank makes the same calls. Never throws.
  CallOutcome allreduce(const EngineCall& call);

  // Whether calls are compressed (the configurations agreed and nothing failed). False
  // before the first call.
  bool compressing() const { return state_ == State::kCompressing; }
  const EngineCounters& counters() const { return counters_; }
  const std::vector<BucketLayout>& buckets() const { return buckets_; }
  // The codec of each layer of a bucket under the assignment in effect.
  std::vector<CodecSpec> layer_codecs(uint32_t bucket) const;
  // The algorithm a bucket uses under the assignment in effect.
  Algorithm algorithm(uint32_t bucket) const;
  uint64_t epoch() const { return assignment_ ? assignment_->epoch : 0; }
  std::shared_ptr<const controller::Assignment> assignment() const { return assignment_; }
  // This rank's error-feedback residual of a bucket, copied to the host (empty without
  // error feedback or before the first compressed call): for tests and diagnostics.
  std::vector<float> residual_snapshot(uint32_t bucket) const;
  // Under sra, the owner residual of this rank's partition of a bucket and the first call
  // element it covers (empty otherwise): for tests and diagnostics.
  std::pair<uint64_t, std::vector<float>> owner_residual_snapshot(uint32_t bucket) const;
  // Null in uniform mode or when no layer is adaptive.
  const controller::Controller* controller() const { return controller_.get(); }
  // The statistics of the last window, summed across ranks, as submitted to the
  // controller (empty before the first): for tests and diagnostics.
  const std::optional<controller::ErrorStats>& last_window_stats() const { return last_window_stats_; }
  // The same of its lead's steps, where the controller pools them (Controller::pools_lead;
  // empty otherwise): for tests and diagnostics.
  const std::optional<controller::ErrorStats>& last_lead_stats() const { return last_lead_stats_; }
  // Values the error probe samples, over all buckets (0 without a controller), and a
  // bucket's probe (null without one): for tests and diagnostics.
  uint64_t probe_sampled() const;
  const BucketProbe* probe(uint32_t bucket) const;
  const LowRankProbe* lowrank_probe(uint32_t bucket) const;  // null: none in the bucket
  // Global index of each adaptive layer in the controller: "bucket/layer" names.
  const std::vector<std::string>& controller_layer_names() const { return controller_names_; }

 private:
  enum class State : uint8_t { kUnchecked, kCompressing, kPassThrough, kBroken };
  struct BucketState;
  struct Sample;
  struct CallTiming;
  struct StagedBucket;
  struct Staged;         // an assignment's plans and buffers, ready to take effect
  struct PendingSum;     // a window's statistics on their way across ranks
  struct PendingSwitch;  // an assignment staged, the ranks' agreement on it in flight
  // Exchanges of a window whose times are compared across ranks (later calls are not timed).
  static constexpr size_t kMaxTimedExchanges = 128;

  CallOutcome first_call(const EngineCall& call);
  CallOutcome run(const EngineCall& call);
  std::string check_call(const EngineCall& call) const;  // "" or what is wrong
  CallOutcome pass(std::string why);
  CallOutcome stop_compressing(std::string why, bool warn);
  // Compares the ranks' configurations and the assignment about to take effect; every
  // rank gets the same answer. Returns "" or what differs. send_agreement queues the
  // exchange of the records, read_agreement reads them once the returned event is ready;
  // agree does both.
  std::string agree(uint64_t assignment_digest, bool local_ok, const std::string& local_problem);
  std::unique_ptr<Event> send_agreement(uint64_t assignment_digest, bool local_ok, const std::string& local_problem);
  std::string read_agreement() const;
  // An assignment's plans and buffers: stage() allocates and prepares everything it
  // needs and changes nothing in effect (throws std::bad_alloc, or what the backend's
  // prepare_* throw); apply() puts it in effect and allocates nothing.
  std::unique_ptr<Staged> stage(std::shared_ptr<const controller::Assignment> assignment);
  void apply(Staged& staged);
  void switch_to(std::shared_ptr<const controller::Assignment> assignment);  // stage and apply at once
  // The controller's pipeline at the start of each call of `step`: sum a finished
  // window, submit it, stage the next assignment and agree on it, switch. Returns an
  // outcome when the ranks disagree (every rank then passes through).
  std::optional<CallOutcome> advance_schedule(uint64_t step);
  void send_window_sum(uint64_t step);
  void submit_window_sum();
  void stage_switch(uint64_t switch_step);
  std::string complete_switch();                        // "" or why the ranks disagree
  std::unique_ptr<Sample> new_sample(uint32_t bucket);  // throws std::bad_alloc
  Sample* begin_sample(BucketState& b, const EngineCall& call);  // null: not measured
  void finish_sample();
  void collect_samples(bool wait);  // measured errors that reached the host, into stats_
  void resolve_timings(bool wait);  // marks the queue has passed, into counters and window_
  void reduce_scatter_allgather(BucketState& b, const EngineCall& call, CallTiming& timing);
  BucketProbe::Buffers probe_buffers();
  controller::ErrorStats new_window_stats() const;  // the controller's, with the probe's sample scales
  void probe_step(BucketState& b, const EngineCall& call, Sample* sample);
  void lowrank_probe_step(BucketState& b, const EngineCall& call, Sample* sample);
  void all_gather(const Plan& plan, BucketState& b, const EngineCall& call, CallTiming& timing);
  void measure_whole_layers(BucketState& b, const EngineCall& call, Sample& sample);
  void measure_magnitude(BucketState& b, const EngineCall& call, Sample& sample);
  void measure_lowrank(BucketState& b, const EngineCall& call, Sample& sample);
  void low_rank(BucketState& b, const EngineCall& call, CallTiming& timing);
  void stage_lowrank(uint32_t bucket, std::span<const uint8_t> lowrank_layers, StagedBucket& staged);
  uint64_t max_lowrank_q_floats(uint32_t bucket) const;
  bool lowrank_candidates_any() const {
    return std::find(lowrank_candidates_.begin(), lowrank_candidates_.end(), 1) != lowrank_candidates_.end();
  }
  uint32_t max_lowrank_candidate_rank() const;  // of the measured candidates; 0: none
  std::string unsupported_codec() const;  // "" or the first codec the backend cannot run
  uint8_t* scratch(int which, uint64_t bytes);
  Backend::Measure first_stage_measure(const Sample& sample, ReduceOp op) const;

  EngineOptions options_;
  std::vector<BucketLayout> buckets_;
  Fabric& fabric_;
  Backend& backend_;
  State state_ = State::kUnchecked;
  std::string broken_reason_, pass_reason_;
  bool warned_invalid_ = false;

  std::vector<std::unique_ptr<BucketState>> state_of_;
  std::vector<CodecSpec> measured_candidates_;  // the candidate list of adaptive layers
  // Per measured candidate: 1 if its codec is low rank (measure_lowrank), or not.
  std::vector<uint8_t> lowrank_candidates_, not_lowrank_candidates_;
  std::vector<std::string> controller_names_;
  std::unique_ptr<controller::Controller> controller_;
  std::shared_ptr<const controller::Assignment> assignment_;
  std::optional<uint64_t> switch_due_;  // a submitted window's assignment is due at this step
  std::unique_ptr<PendingSum> pending_sum_;
  std::unique_ptr<PendingSwitch> pending_switch_;
  uint64_t last_step_ = 0;

  // Statistics of the current window.
  std::optional<controller::ErrorStats> stats_, last_window_stats_;
  // The lead steps' statistics of the coming window, where the controller pools them.
  std::optional<controller::ErrorStats> pooled_lead_, last_lead_stats_;
  std::optional<uint64_t> window_end_;  // the window being measured ends at this step
  std::deque<std::unique_ptr<Sample>> samples_;  // measured, not yet in stats_
  std::vector<std::unique_ptr<Sample>> spare_samples_;
  std::deque<CallTiming> timings_;  // calls whose marks have not been read
  struct WindowCost {
    std::vector<double> exchange_seconds;  // per timed exchange of the window
    double encoded_bytes = 0, codec_seconds = 0, quant_elements = 0;
  } window_;
  double quant_throughput_ = 0;  // elements/s of the quantization codec, last measured

  // The agreement's records (device, and pinned host memory they come back to), and the
  // window statistics' sum (the same): allocated where a failure is still agreed on.
  std::unique_ptr<Backend::Buffer> agreement_, agreement_host_, window_sum_, window_sum_host_;
  std::vector<std::unique_ptr<Backend::Buffer>> scratch_;
  EngineCounters counters_;
};

// An engine for `buckets`, or, where their layouts are rejected (the constructor's
// std::invalid_argument), an engine with no buckets marked invalid with the reason: this
// rank still joins the engine's agreement, so every rank passes through together instead
// of one rank failing alone. What else the constructor throws (an allocation) propagates.
std::unique_ptr<Engine> make_engine_or_pass_through(EngineOptions options, std::vector<BucketLayout> buckets,
                                                    Fabric& fabric, Backend& backend);

// FNV-1a, 64 bits: the digests ranks compare (not a security measure; collisions between
// honest configurations are what matters, and 64 bits make them negligible).
uint64_t digest(std::string_view text, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace lgreco::collective
