#include "plugin/collective/engine.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>

#include "config/log.h"
#include "controller/settings.h"
#include "kernels/lowrank.h"

namespace lgreco::collective {

namespace {

// Scratch buffers shared by all buckets of the engine, grown to the largest plan.
// The gathered part of an sra call (TopK layers) has its own, so that nothing it stages
// can alias the sra part's buffers.
enum Scratch : int {
  kSend = 0,
  kRecv,
  kAcc,
  kReencoded,
  kGathered,
  kPartSend,
  kPartGathered,
  kPartAcc,
  kLowRankP,
  kLowRankQ,
  // The error probe's staging (BucketProbe::Buffers), shared by the buckets.
  kProbeSend,
  kProbeRecv,
  kProbeInputs,
  kProbeSum,
  kProbeError,
  kProbePayload,
  kProbeFlags,
  kProbeX,
  kProbeOwner,
  kProbeOwnerSum,
  kProbeExact,
  kProbeOut,
  kScratchCount
};

// Below this many encoded bytes per call, auto prefers all-gather's single round.
constexpr uint64_t kSmallEncoding = 32 * 1024;

// The record every rank contributes when configurations are compared.
struct AgreementRecord {
  static constexpr uint32_t kMagic = 0x4c475241;  // "LGRA"
  uint32_t magic = kMagic;
  uint32_t ranks = 0;
  uint8_t valid = 0;     // the rank's configuration is valid and it can compress
  uint8_t pad[7] = {};
  uint64_t parameters = 0;  // digest of EngineOptions::parameters_text
  uint64_t layouts = 0;     // digest of the bucket layouts (registration, policies)
  uint64_t assignment = 0;  // digest of the assignment about to take effect
  uint64_t reserved = 0;
};
static_assert(sizeof(AgreementRecord) == 48);

uint64_t layouts_digest(const std::vector<BucketLayout>& buckets) {
  std::string text;
  for (const BucketLayout& b : buckets) {
    text += std::to_string(b.count) + ":" + dtype_name(b.dtype) + "{";
    for (const LayerLayout& l : b.layers) {
      text += l.name + "@" + std::to_string(l.offset) + "+" + std::to_string(l.numel) + "/" + std::to_string(l.rows) + "[";
      for (const CodecSpec& c : l.candidates) text += c.str() + ";";
      text += "]" + std::to_string(l.default_index) + ",";
    }
    text += "}";
  }
  return digest(text);
}

uint64_t assignment_digest(const controller::Assignment* a) {
  if (!a) return 0;
  std::string text = std::to_string(a->epoch) + "@" + std::to_string(a->effective_step) + ":";
  for (uint32_t c : a->choices) text += std::to_string(c) + ",";
  return digest(text);
}

}  // namespace

uint64_t digest(std::string_view text, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kScatterReduceAllGather: return "sra";
    case Algorithm::kAllGather: return "allgather";
  }
  return "?";
}

bool parse_algorithm(std::string_view text, Algorithm* a) {
  for (Algorithm c : {Algorithm::kAuto, Algorithm::kScatterReduceAllGather, Algorithm::kAllGather})
    if (text == algorithm_name(c)) {
      *a = c;
      return true;
    }
  return false;
}

// ---------------------------------------------------------------------------------------
// Options and layouts

EngineOptions EngineOptions::from_params(const config::Params& p, int rank) {
  EngineOptions o;
  o.mode = p.effective_mode();
  o.codec = p.codec;
  o.candidates = p.candidates;
  o.error_feedback = p.error_feedback;
  if (!parse_algorithm(p.algorithm, &o.algorithm)) o.algorithm = Algorithm::kAuto;
  if (!p.valid()) {
    o.valid = false;
    o.invalid_reason = std::to_string(p.errors.size()) + " invalid LGRECO_* parameter(s): " + p.errors.front();
  }
  try {
    o.controller = controller::settings_from_params(p, rank);
  } catch (const std::exception& e) {
    o.valid = false;
    if (o.invalid_reason.empty()) o.invalid_reason = e.what();
  }
  if (o.controller.objective == controller::Objective::kTime &&
      std::find(o.candidates.begin(), o.candidates.end(), CodecSpec::none()) == o.candidates.end())
    o.candidates.push_back(CodecSpec::none());
  // Settings that every rank must share. Paths, logging and the timeout may differ.
  std::string& t = o.parameters_text;
  t = std::string("mode=") + config::mode_name(o.mode) + " codec=" + o.codec.str() + " candidates=";
  for (const CodecSpec& c : o.candidates) t += c.str() + ";";
  char number[64];
  snprintf(number, sizeof number, "%a", p.alpha);
  t += std::string(" alpha=") + number + " objective=" + p.objective + " metric=" + p.error_metric;
  t += " schedule=" + std::to_string(p.warmup) + "/" + std::to_string(p.period) + "/" + std::to_string(p.window) +
       "/" + std::to_string(p.switch_lag);
  snprintf(number, sizeof number, "%a", p.solver_tolerance);
  t += std::string(" tolerance=") + number;
  o.probe.fraction = p.probe_fraction;
  snprintf(number, sizeof number, "%a", p.probe_fraction);
  t += std::string(" probe=") + number + "/" + std::to_string(p.probe_lead) + " loop=" + (p.budget_loop ? "1" : "0");
  t += std::string(" error_feedback=") + (p.error_feedback ? "1" : "0") +
       " algorithm=" + p.algorithm + " min_bytes=" + std::to_string(p.min_bytes) +
       " segment_bytes=" + std::to_string(p.segment_bytes) + " auto=" + (p.auto_mode ? "1" : "0");
  return o;
}

BucketLayout layout_from_registration(const config::RegisteredBucket& bucket, const EngineOptions& options) {
  BucketLayout out;
  out.count = bucket.count;
  out.dtype = bucket.dtype;
  for (const config::RegisteredLayer& layer : bucket.layers) {
    LayerLayout l;
    l.name = layer.name;
    l.offset = layer.offset;
    l.numel = layer.numel;
    if (layer.has_shape && layer.shape.size() >= 2 && layer.shape[0] > 0 && layer.numel % layer.shape[0] == 0)
      l.rows = layer.shape[0];
    // A low-rank codec applies where the layer is a matrix and its factors are smaller
    // than it (the L-GreCo reference's rule, config::low_rank_pays_off).
    auto applies = [&](const CodecSpec& c) {
      return c.family() != CodecFamily::kPowersgd ||
             (l.rows > 0 && config::low_rank_pays_off(layer, c.powersgd_params().rank));
    };
    const config::LayerPolicy policy = config::layer_policy(layer);
    switch (policy.kind) {
      case config::LayerPolicy::Kind::kNever: l.candidates = {CodecSpec::none()}; break;
      case config::LayerPolicy::Kind::kPinned:
        // Pinned by the user: kept even where its factors are large (the registration
        // refuses a pinned powersgd on a layer without a matrix shape).
        l.candidates = {policy.codec};
        break;
      case config::LayerPolicy::Kind::kAdaptive: {
        // The default where it applies, else `none` (a layer low rank does not pay on
        // stays uncompressed, as in the reference).
        const CodecSpec fallback = applies(options.codec) ? options.codec : CodecSpec::none();
        if (options.mode == config::Mode::kAdaptive) {
          for (const CodecSpec& c : options.candidates)
            if (applies(c)) l.candidates.push_back(c);
          l.default_index = static_cast<uint32_t>(std::find(l.candidates.begin(), l.candidates.end(), fallback) -
                                                  l.candidates.begin());
          if (l.default_index == l.candidates.size()) l.candidates.push_back(fallback);
        } else {
          l.candidates = {fallback};
        }
        break;
      }
    }
    out.layers.push_back(std::move(l));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Per-bucket state

// One measured call's errors on their way to the host. Its buffer, for L layers and C
// candidate columns: four tables of L x C doubles (the candidates measured on this rank's
// whole layers' gradients, and low-rank ones on their real state; the error probe's
// simulation, the sample's content and its real state), the realized error on the sample
// (L doubles), then flags: the whole-layer measurement's non-finite layers (L bytes), the
// simulation's (L x C), the sample measurements' and the realized error's (L each); then
// the gradient's magnitude on this rank (L doubles: sum |g| of each layer, for the drift).
struct Engine::Sample {
  uint32_t bucket = 0;
  uint64_t bytes = 0;
  std::unique_ptr<Backend::Buffer> device, host;
  std::unique_ptr<Event> ready;  // the read-back from device to host
  Backend::Measure measure;      // where the backend adds this call's whole-layer errors
  ProbeOutput probe;             // where the error probe writes
  double* magnitude = nullptr;   // where the layers' magnitude goes
  bool lead = false;             // a step of the first window's lead: the magnitude alone
  bool pool = false;             // a lead step of a later window: for the quantizers' pools

  struct Layout {
    uint64_t measured = 0, simulated, reference, current, independent, realized, nonfinite, simulated_nonfinite,
             reference_nonfinite, realized_nonfinite, magnitude, bytes;
    Layout(uint64_t layers, uint64_t columns)
        : simulated(layers * columns * sizeof(double)),
          reference(2 * simulated),
          current(3 * simulated),
          independent(4 * simulated),
          realized(5 * simulated),
          nonfinite(realized + layers * sizeof(double)),
          simulated_nonfinite(nonfinite + layers),
          reference_nonfinite(simulated_nonfinite + layers * columns),
          realized_nonfinite(reference_nonfinite + layers),
          magnitude((realized_nonfinite + layers + 7) / 8 * 8),
          bytes(magnitude + layers * sizeof(double)) {}
  };
};

// The marks around one call's exchanges and codec operations, read when the queue has
// passed them.
struct Engine::CallTiming {
  static constexpr int kMaxIntervals = 12;  // sra (2 + 4), gathered (1 + 2), low rank (2 + 3)
  uint64_t exchange[kMaxIntervals][2] = {}, codec[kMaxIntervals][2] = {};
  int exchanges = 0, codecs = 0;
  bool in_window = false;       // feeds the time objective's cost model
  double quant_elements = 0;    // elements of quantized layers in the call
  double encoded_bytes = 0;

  void start_codec(Backend& backend) { codec[codecs][0] = backend.mark(); }
  void stop_codec(Backend& backend) { codec[codecs++][1] = backend.mark(); }
  void start_exchange(Backend& backend) { exchange[exchanges][0] = backend.mark(); }
  void stop_exchange(Backend& backend) { exchange[exchanges++][1] = backend.mark(); }
  void release(Backend& backend) const {
    for (int i = 0; i < exchanges; ++i) backend.release_mark(exchange[i][0]), backend.release_mark(exchange[i][1]);
    for (int i = 0; i < codecs; ++i) backend.release_mark(codec[i][0]), backend.release_mark(codec[i][1]);
  }
  uint64_t last_mark() const { return codecs ? codec[codecs - 1][1] : exchange[exchanges - 1][1]; }
};

namespace {

// The byte counts of one bucket's exchanges under its current plan, and the scratch they
// need: computed once per assignment, the same numbers the calls then use.
struct ExchangeSizes {
  std::vector<uint64_t> send_bytes, send_offset, recv_bytes;  // sra's all-to-all, per rank
  std::vector<uint64_t> gather_bytes;                         // the all-gather, per rank
  uint64_t send = 0, recv = 0, acc = 0, reencoded = 0, gathered = 0;  // scratch bytes

  ExchangeSizes(const Plan& plan, Algorithm algorithm, int n, int me, uint64_t count) {
    if (algorithm == Algorithm::kAllGather) {
      gather_bytes.assign(n, plan.total_bytes);
      send = plan.total_bytes;
      gathered = plan.total_bytes * n;
      acc = count * 4;
      return;
    }
    // sra: every partition but this rank's own goes to its owner, back to back in rank order.
    const Partition& mine = plan.partitions[me];
    send_bytes.resize(n);
    send_offset.resize(n);
    recv_bytes.resize(n);
    for (int q = 0; q < n; ++q) {
      send_offset[q] = send;
      send_bytes[q] = q == me ? 0 : plan.partitions[q].bytes;
      recv_bytes[q] = q == me ? 0 : mine.bytes;
      send += send_bytes[q];
    }
    gather_bytes = plan.partition_bytes();
    recv = mine.bytes * (n - 1);
    acc = mine.count() * 4;
    reencoded = mine.bytes;
    gathered = plan.total_bytes;
  }
};

}  // namespace

struct Engine::BucketState {
  uint32_t layer_base = 0;            // global index of layer 0 (noise keys)
  std::vector<int32_t> controller_of;  // per layer: index among the controller's layers, or -1
  std::vector<uint8_t> measured;       // per layer: 1 if adaptive (its candidates are measured)
  std::vector<std::vector<uint32_t>> columns;  // per layer: its candidates' columns in the statistics
  std::unique_ptr<Backend::Buffer> residual;        // error feedback of this rank's encodings
  std::unique_ptr<Backend::Buffer> owner_residual;  // sra: of the owner's re-encoding
  uint64_t owner_begin = 0, owner_end = 0;          // the elements owner_residual covers
  std::unique_ptr<Backend::Buffer> flags;           // one byte per layer: input not finite
  std::vector<CodecSpec> codecs;                    // per layer, under the current assignment
  // The current algorithm's plan: for all-gather every layer in one partition; for sra
  // the reducible layers in P partitions, and the gathered ones (TopK) apart.
  Plan plan;
  Plan gathered;  // sra only: the layers whose codec is gathered, whole, one partition
  Plan whole;     // every layer whole, one partition
  Algorithm algorithm = Algorithm::kAllGather;
  std::optional<ExchangeSizes> sizes;           // of plan
  std::vector<uint64_t> gathered_bytes;         // per rank, of gathered
  uint64_t encoded_bytes = 0;                   // one encoding of the call: plan + gathered
  // The error probe of the adaptive layers (null without a controller or such layers),
  // and of their low-rank candidates (null without any).
  std::unique_ptr<BucketProbe> probe;
  std::unique_ptr<LowRankProbe> lowrank_probe;
  // Low rank (docs/ENGINE.md): the layers whose codec is powersgd now, with offsets into
  // P and Q; their warm-started Q and the seeded Q0 it restarts from; the floats of P and
  // Q per call. lowrank_measured: the adaptive layers with a powersgd candidate.
  std::vector<Backend::LowRankLayer> lowrank, lowrank_measured;
  std::vector<Segment> lowrank_segments;  // of `whole`, for the non-finite check
  std::unique_ptr<Backend::Buffer> q_warm, q0;
  std::unique_ptr<Backend::Buffer> q0_host;  // pinned staging of Q0's upload (stage_lowrank)
  uint64_t p_floats = 0, q_floats = 0;
  double quant_elements = 0;  // elements of layers whose codec quantizes
};

// One bucket under an assignment not yet in effect: what switching sets, computed and
// allocated, and what apply() copies from the state in effect when it takes effect.
struct Engine::StagedBucket {
  std::vector<CodecSpec> codecs;
  double quant_elements = 0;
  Plan plan, gathered, whole;
  Algorithm algorithm = Algorithm::kAllGather;
  std::optional<ExchangeSizes> sizes;
  std::vector<uint64_t> gathered_bytes;
  uint64_t encoded_bytes = 0;
  // Low rank: the layers, the seeded Q0 (uploaded) and the warm Q (Q0 for now; apply()
  // carries over the layers that stay low rank at the same rank).
  std::vector<Backend::LowRankLayer> lowrank;
  std::vector<Segment> lowrank_segments;
  std::unique_ptr<Backend::Buffer> q_warm, q0;
  uint64_t p_floats = 0, q_floats = 0;
  // sra's owner residual: kept, replaced by one for a new partition (the elements both
  // cover carry over at apply()), or dropped (all-gather: a later return to sra must not
  // find a residual many steps old).
  enum class Owner : uint8_t { kKeep, kReplace, kDrop } owner = Owner::kKeep;
  std::unique_ptr<Backend::Buffer> owner_residual;
  uint64_t owner_begin = 0, owner_end = 0;
  BucketProbe::Assignment probe;
};

struct Engine::Staged {
  std::shared_ptr<const controller::Assignment> assignment;
  std::vector<StagedBucket> buckets;
};

// A window's statistics on their way across ranks (send_window_sum).
struct Engine::PendingSum {
  uint64_t window_last = 0, sent_at = 0;
  size_t statistics = 0, exchanges = 0;  // doubles of the statistics; timed exchanges per rank
  double encoded = 0;                    // encoded bytes of the timed calls, the same on every rank
  std::optional<controller::ErrorStats> lead;  // the lead's statistics (pooled_lead_), summed after the window's
  std::unique_ptr<Event> ready;
};

// An assignment staged, the ranks' agreement on it in flight (stage_switch).
struct Engine::PendingSwitch {
  uint64_t step = 0;               // when it takes effect
  std::unique_ptr<Staged> staged;  // null: the assignment stays (a failed solve or staging)
  uint64_t epoch = 0;
  std::unique_ptr<Event> agreed;
};

Engine::Engine(EngineOptions options, std::vector<BucketLayout> buckets, Fabric& fabric, Backend& backend)
    : options_(std::move(options)), buckets_(std::move(buckets)), fabric_(fabric), backend_(backend) {
  scratch_.resize(kScratchCount);
  std::vector<controller::Layer> layers;
  uint32_t layer_base = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    validate(buckets_[b], b);
    auto state = std::make_unique<BucketState>();
    state->layer_base = layer_base;
    layer_base += static_cast<uint32_t>(buckets_[b].layers.size());
    for (const LayerLayout& l : buckets_[b].layers) {
      state->controller_of.push_back(-1);
      state->measured.push_back(0);
      state->columns.emplace_back();
      if (!l.adaptive()) continue;
      // Every measured candidate has one column of the statistics; a layer measures the
      // union of all layers' lists (a low-rank codec is a candidate only on matrices where
      // it pays off) and reads back its own columns.
      for (const CodecSpec& c : l.candidates) {
        auto it = std::find(measured_candidates_.begin(), measured_candidates_.end(), c);
        if (it == measured_candidates_.end()) {
          it = measured_candidates_.insert(measured_candidates_.end(), c);
          const Exchange e = exchange_of(c);
          lowrank_candidates_.push_back(e == Exchange::kLowRank ? 1 : 0);
          not_lowrank_candidates_.push_back(e == Exchange::kLowRank ? 0 : 1);
        }
        state->columns.back().push_back(static_cast<uint32_t>(it - measured_candidates_.begin()));
      }
      if (l.rows > 0 && std::any_of(l.candidates.begin(), l.candidates.end(), [](const CodecSpec& c) {
            return c.family() == CodecFamily::kPowersgd;
          })) {
        Backend::LowRankLayer m;
        m.layer = static_cast<uint32_t>(state->columns.size() - 1);
        m.offset = l.offset;
        m.rows = l.rows;
        m.cols = l.numel / l.rows;
        state->lowrank_measured.push_back(m);
      }
      controller::Layer layer;
      layer.name = std::to_string(b) + "/" + l.name;
      layer.numel = l.numel;
      layer.default_index = l.default_index;
      for (const CodecSpec& c : l.candidates) layer.candidates.push_back({c.str(), encoded_bytes(c, buckets_[b].dtype, l), 0.0});
      state->controller_of.back() = static_cast<int32_t>(layers.size());
      state->measured.back() = 1;
      controller_names_.push_back(layer.name);
      layers.push_back(std::move(layer));
    }
    state_of_.push_back(std::move(state));
  }
  if (!layers.empty() && options_.mode == config::Mode::kAdaptive && options_.valid) {
    controller::ControllerSettings settings = options_.controller;
    // The time objective needs a model at construction; the engine replaces it with
    // measurements at every submit.
    if (settings.objective == controller::Objective::kTime && !(settings.cost_model.link.bandwidth > 0))
      settings.cost_model.link.bandwidth = 1e9;
    try {
      controller_ = std::make_unique<controller::Controller>(settings, std::move(layers));
    } catch (const std::invalid_argument& e) {
      // Settings the parameter check let through but the controller refuses: this rank
      // still takes part in the agreement, as one whose configuration is invalid.
      options_.valid = false;
      options_.invalid_reason = std::string("the controller refuses its settings: ") + e.what();
    }
  }
  if (controller_) {
    ProbeSettings probe = options_.probe;
    probe.seed = options_.seed;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      BucketState& s = *state_of_[b];
      if (std::find(s.measured.begin(), s.measured.end(), 1) == s.measured.end()) continue;
      s.probe = std::make_unique<BucketProbe>(buckets_[b], static_cast<uint32_t>(b), s.measured, s.columns,
                                              measured_candidates_, fabric_.size(), fabric_.rank(), probe);
      if (lowrank_candidates_any()) {
        std::vector<int> designated(buckets_[b].layers.size());
        for (uint32_t l = 0; l < designated.size(); ++l) designated[l] = s.probe->designated(l);
        auto lowrank =
            std::make_unique<LowRankProbe>(buckets_[b], s.layer_base, s.measured, s.columns, measured_candidates_,
                                           designated, fabric_.size(), fabric_.rank(), options_.seed);
        if (!lowrank->empty()) s.lowrank_probe = std::move(lowrank);
      }
    }
    stats_.emplace(new_window_stats());
    pooled_lead_.emplace(new_window_stats());
  }
  // The agreement's records: allocated here, so that comparing configurations can never
  // fail on one rank alone.
  agreement_ = backend_.allocate(sizeof(AgreementRecord) * (fabric_.size() + 1));
  agreement_host_ = backend_.allocate_host(sizeof(AgreementRecord) * (fabric_.size() + 1));
}

Engine::~Engine() {
  if (controller_) controller_->stop();
  try {
    resolve_timings(true);
  } catch (...) {
  }
}

namespace {

// Diagnostics only: waits for the queue.
std::vector<float> floats_to_host(Backend& backend, const void* src, uint64_t n) {
  std::vector<float> out(n);
  if (n == 0) return out;
  const std::unique_ptr<Backend::Buffer> host = backend.allocate_host(n * 4);
  backend.await(*backend.read_back(host->data(), src, n * 4));
  std::memcpy(out.data(), host->data(), n * 4);
  return out;
}

}  // namespace

std::vector<float> Engine::residual_snapshot(uint32_t bucket) const {
  const BucketState& b = *state_of_.at(bucket);
  if (!b.residual) return {};
  return floats_to_host(backend_, b.residual->data(), buckets_[bucket].count);
}

std::pair<uint64_t, std::vector<float>> Engine::owner_residual_snapshot(uint32_t bucket) const {
  const BucketState& b = *state_of_.at(bucket);
  std::pair<uint64_t, std::vector<float>> out{b.owner_begin, {}};
  if (!b.owner_residual || b.algorithm != Algorithm::kScatterReduceAllGather) return out;
  out.second = floats_to_host(backend_, b.owner_residual->data(), b.owner_end - b.owner_begin);
  return out;
}

const BucketProbe* Engine::probe(uint32_t bucket) const { return state_of_.at(bucket)->probe.get(); }
const LowRankProbe* Engine::lowrank_probe(uint32_t bucket) const { return state_of_.at(bucket)->lowrank_probe.get(); }

uint64_t Engine::probe_sampled() const {
  uint64_t n = 0;
  for (const auto& b : state_of_)
    if (b->probe) n += b->probe->sampled_total();
  return n;
}

std::vector<CodecSpec> Engine::layer_codecs(uint32_t bucket) const { return state_of_.at(bucket)->codecs; }
Algorithm Engine::algorithm(uint32_t bucket) const { return state_of_.at(bucket)->algorithm; }

uint8_t* Engine::scratch(int which, uint64_t bytes) {
  auto& buffer = scratch_[which];
  // The new buffer before the old one goes: where it cannot be had, the plans in effect
  // keep theirs (an assignment is staged while they run).
  if (!buffer || buffer->bytes() < bytes) buffer = backend_.allocate(std::max<uint64_t>(bytes, 64));
  return static_cast<uint8_t*>(buffer->data());
}

uint32_t Engine::max_lowrank_candidate_rank() const {
  uint32_t rank = 0;
  for (const CodecSpec& c : measured_candidates_)
    if (c.family() == CodecFamily::kPowersgd) rank = std::max(rank, c.powersgd_params().rank);
  return rank;
}

std::string Engine::unsupported_codec() const {
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (const LayerLayout& l : buckets_[b].layers)
      for (const CodecSpec& c : l.candidates)
        if (const std::string why = backend_.unsupported(c); !why.empty())
          return "layer " + l.name + " of bucket " + std::to_string(b) + " may use " + c.str() + ", but " + why;
  return "";
}

// ---------------------------------------------------------------------------------------
// Agreement

std::string Engine::agree(uint64_t assignment, bool local_ok, const std::string& local_problem) {
  const std::unique_ptr<Event> sent = send_agreement(assignment, local_ok, local_problem);
  backend_.await(*sent);
  return read_agreement();
}

// The records travel from pinned host memory and back to it (slot 0: this rank's; then
// every rank's), so that neither copy blocks the host; nothing rewrites them before
// read_agreement, since one agreement is in flight at a time.
std::unique_ptr<Event> Engine::send_agreement(uint64_t assignment, bool local_ok, const std::string& local_problem) {
  if (!options_.valid && !warned_invalid_) {
    warned_invalid_ = true;
    LGRECO_WARN("ENGINE", "this rank's configuration is invalid, so no rank compresses: %s",
                options_.invalid_reason.c_str());
  }
  if (!local_ok) LGRECO_WARN("ENGINE", "this rank cannot compress, so no rank does: %s", local_problem.c_str());
  AgreementRecord mine;
  mine.ranks = static_cast<uint32_t>(fabric_.size());
  mine.valid = options_.valid && local_ok ? 1 : 0;
  mine.parameters = digest(options_.parameters_text);
  mine.layouts = layouts_digest(buckets_);
  mine.assignment = assignment;
  const int n = fabric_.size();
  auto* host = static_cast<uint8_t*>(agreement_host_->data());
  std::memcpy(host, &mine, sizeof mine);
  auto* device = static_cast<uint8_t*>(agreement_->data());
  backend_.upload(device, host, sizeof mine);
  const std::vector<uint64_t> bytes(n, sizeof(AgreementRecord));
  fabric_.all_gather_v(device, bytes, device + sizeof(AgreementRecord));
  return backend_.read_back(host + sizeof(AgreementRecord), device + sizeof(AgreementRecord),
                            sizeof(AgreementRecord) * n);
}

std::string Engine::read_agreement() const {
  const int n = fabric_.size();
  std::vector<AgreementRecord> all(n);
  std::memcpy(all.data(), static_cast<const uint8_t*>(agreement_host_->data()) + sizeof(AgreementRecord),
              sizeof(AgreementRecord) * n);
  // Every rank builds the same message from the same records. Assignments are compared
  // among valid ranks only (an invalid rank has none).
  std::string invalid, parameters, layouts, assignments, foreign;
  int first_valid = -1;
  auto add = [](std::string& list, int rank) { list += (list.empty() ? "" : ", ") + std::to_string(rank); };
  for (int r = 0; r < n; ++r) {
    const AgreementRecord& a = all[r];
    if (a.magic != AgreementRecord::kMagic || a.ranks != static_cast<uint32_t>(n)) {
      add(foreign, r);
      continue;
    }
    if (!a.valid) {
      add(invalid, r);
    } else if (first_valid < 0) {
      first_valid = r;
    } else if (a.assignment != all[first_valid].assignment) {
      add(assignments, r);
    }
    if (a.parameters != all[0].parameters) add(parameters, r);
    if (a.layouts != all[0].layouts) add(layouts, r);
  }
  std::string why;
  auto clause = [&why](const std::string& ranks, const std::string& text) {
    if (!ranks.empty()) why += (why.empty() ? "" : "; ") + text + " on rank(s) " + ranks;
  };
  clause(foreign, "an unreadable agreement record (a different lgreco version?)");
  clause(invalid, "an invalid configuration or a local failure (that rank's WARN says which)");
  clause(parameters, "LGRECO_* parameters that differ from rank 0's");
  clause(layouts, "bucket layouts (registration file) that differ from rank 0's");
  clause(assignments, "an assignment that differs from rank " + std::to_string(first_valid) +
                          "'s (a failed or non-deterministic solve?)");
  return why;
}

// ---------------------------------------------------------------------------------------
// Assignments and plans

std::unique_ptr<Engine::Staged> Engine::stage(std::shared_ptr<const controller::Assignment> assignment) {
  auto staged = std::make_unique<Staged>();
  staged->assignment = assignment;
  staged->buckets.resize(buckets_.size());
  const int n = fabric_.size();
  uint64_t send = 0, recv = 0, acc = 0, reencoded = 0, gathered = 0, part_send = 0, part_acc = 0;
  uint64_t lowrank_p = 0, lowrank_q = 0;  // floats
  BucketProbe::Scratch probe;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketState& s = *state_of_[b];
    StagedBucket& t = staged->buckets[b];
    const BucketLayout& layout = buckets_[b];
    for (size_t l = 0; l < layout.layers.size(); ++l) {
      const LayerLayout& layer = layout.layers[l];
      uint32_t choice = layer.default_index;
      if (s.controller_of[l] >= 0 && assignment && !assignment->choices.empty())
        choice = assignment->choices[s.controller_of[l]];
      t.codecs.push_back(layer.candidates[choice]);
      if (t.codecs.back().family() == CodecFamily::kQuant) t.quant_elements += static_cast<double>(layer.numel);
    }
    const size_t layers = layout.layers.size();
    std::vector<uint8_t> reduce_layers(layers), gather_layers(layers), lowrank_layers(layers), not_lowrank(layers);
    for (size_t l = 0; l < layers; ++l) {
      const Exchange e = exchange_of(t.codecs[l]);
      gather_layers[l] = e == Exchange::kGather;
      reduce_layers[l] = e == Exchange::kReduce;
      lowrank_layers[l] = e == Exchange::kLowRank;
      not_lowrank[l] = !lowrank_layers[l];
    }
    const bool any_lowrank = std::find(lowrank_layers.begin(), lowrank_layers.end(), 1) != lowrank_layers.end();
    t.whole = make_plan(layout, t.codecs, 1);
    stage_lowrank(static_cast<uint32_t>(b), lowrank_layers, t);
    lowrank_p = std::max(lowrank_p, t.p_floats);
    lowrank_q = std::max(lowrank_q, t.q_floats);
    t.algorithm = options_.algorithm;
    if (t.algorithm == Algorithm::kAuto)
      t.algorithm =
          n <= 2 || t.whole.total_bytes <= kSmallEncoding ? Algorithm::kAllGather : Algorithm::kScatterReduceAllGather;
    if (t.algorithm == Algorithm::kAllGather) {
      t.plan = any_lowrank ? make_plan(layout, t.codecs, 1, not_lowrank) : t.whole;
      t.owner = StagedBucket::Owner::kDrop;
    } else {
      t.plan = make_plan(layout, t.codecs, static_cast<uint32_t>(n), reduce_layers);
      if (std::find(gather_layers.begin(), gather_layers.end(), 1) != gather_layers.end())
        t.gathered = make_plan(layout, t.codecs, 1, gather_layers);
      const Partition& mine = t.plan.partitions[fabric_.rank()];
      // The owner's residual follows its partition: elements it keeps keep their residual.
      if (options_.error_feedback && (!s.owner_residual || s.owner_begin != mine.begin || s.owner_end != mine.end)) {
        t.owner = StagedBucket::Owner::kReplace;
        t.owner_residual = backend_.allocate(mine.count() * 4);
        t.owner_begin = mine.begin;
        t.owner_end = mine.end;
      }
    }
    t.sizes.emplace(t.plan, t.algorithm, n, fabric_.rank(), layout.count);
    t.gathered_bytes.assign(n, t.gathered.total_bytes);
    t.encoded_bytes = t.plan.total_bytes + t.gathered.total_bytes + 4 * (t.p_floats + t.q_floats);
    if (!t.gathered.segments.empty()) {
      const Segment& first = t.gathered.segments.front();
      const Segment& last = t.gathered.segments.back();
      part_send = std::max(part_send, t.gathered.total_bytes);
      part_acc = std::max(part_acc, (last.offset + last.count - first.offset) * 4);
    }
    send = std::max(send, t.sizes->send);
    recv = std::max(recv, t.sizes->recv);
    acc = std::max(acc, t.sizes->acc);
    reencoded = std::max(reencoded, t.sizes->reencoded);
    gathered = std::max(gathered, t.sizes->gathered);
    // Allocated once, before the first call compresses: nothing in effect uses them yet.
    if (options_.error_feedback && !s.residual) s.residual = backend_.allocate(layout.count * 4);
    if (!s.flags) s.flags = backend_.allocate(layout.layers.size());
    // What measuring needs is allocated here too, where a failure is still agreed on by
    // every rank, not in the middle of a call on one rank. The backend's preparations
    // only grow what it holds, so the plans in effect stay prepared.
    if (controller_) {
      backend_.prepare_measure(t.plan, measured_candidates_);
      backend_.prepare_measure(t.whole, measured_candidates_);
    }
    // The error probe: its shadows (allocated once), its simulation's preparation, and the
    // staging of the largest.
    if (s.probe) {
      t.probe = s.probe->for_assignment(t.codecs, t.algorithm == Algorithm::kScatterReduceAllGather);
      s.probe->prepare(backend_, measured_candidates_, t.probe);
      if (s.lowrank_probe) s.lowrank_probe->prepare(backend_);
      const BucketProbe::Scratch need = s.probe->scratch_bytes(t.probe);
      for (auto [total, one] : {std::pair{&probe.send, need.send}, {&probe.recv, need.recv}, {&probe.inputs, need.inputs},
                                {&probe.sum, need.sum}, {&probe.error, need.error}, {&probe.payload, need.payload},
                                {&probe.flags, need.flags}, {&probe.sample, need.sample}})
        *total = std::max(*total, one);
    }
    // And what the exchange's kernels need (a GPU's TopK selection scratch, cuBLAS).
    backend_.prepare_encode(t.plan);
    if (!t.gathered.segments.empty()) backend_.prepare_encode(t.gathered);
    const std::span<const Backend::LowRankLayer> measured_lowrank =
        controller_ ? std::span<const Backend::LowRankLayer>(s.lowrank_measured) : std::span<const Backend::LowRankLayer>();
    if (!t.lowrank.empty() || !measured_lowrank.empty())
      backend_.prepare_lowrank(t.lowrank, measured_lowrank, max_lowrank_candidate_rank(), layout.dtype,
                               options_.error_feedback);
  }
  if (controller_) {
    // One sample buffer per bucket to start with; a window that needs more (the queue lags
    // many calls behind) allocates them, and measures less if it cannot (begin_sample).
    if (spare_samples_.empty() && samples_.empty())
      for (size_t b = 0; b < buckets_.size(); ++b) spare_samples_.push_back(new_sample(static_cast<uint32_t>(b)));
    // The window's sum: the statistics, the lead's (where the controller pools them), then
    // the codec's time and elements, then each rank's slot of exchange times.
    if (!window_sum_) {
      const uint64_t statistics = stats_->reduction_buffer().size() * (controller_->pools_lead() ? 2 : 1);
      const uint64_t bytes = (statistics + 2 + n * kMaxTimedExchanges) * sizeof(double);
      window_sum_ = backend_.allocate(bytes);
      window_sum_host_ = backend_.allocate_host(bytes);
    }
  }
  // Scratch grows: the plans in effect use it until apply().
  scratch(kSend, send);
  scratch(kRecv, recv);
  scratch(kAcc, acc);
  scratch(kReencoded, reencoded);
  scratch(kGathered, gathered);
  if (lowrank_p) {
    scratch(kLowRankP, lowrank_p * 4);
    scratch(kLowRankQ, lowrank_q * 4);
  }
  if (part_send) {
    scratch(kPartSend, part_send);
    scratch(kPartGathered, part_send * n);
    scratch(kPartAcc, part_acc);
  }
  if (probe.send) {
    for (auto [which, bytes] : {std::pair{kProbeSend, probe.send}, {kProbeRecv, probe.recv}, {kProbeInputs, probe.inputs},
                                {kProbeSum, probe.sum}, {kProbeError, probe.error}, {kProbePayload, probe.payload},
                                {kProbeFlags, probe.flags}, {kProbeX, probe.sample}, {kProbeOwner, probe.sample},
                                {kProbeOwnerSum, probe.sample}, {kProbeExact, probe.sample}, {kProbeOut, probe.sample}})
      scratch(which, bytes);
  }
  return staged;
}

void Engine::switch_to(std::shared_ptr<const controller::Assignment> assignment) {
  apply(*stage(std::move(assignment)));
}

// Only enqueued copies here: the warm start and the owner residual carry over from the
// state in effect until now.
void Engine::apply(Staged& staged) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    BucketState& s = *state_of_[b];
    StagedBucket& t = staged.buckets[b];
    s.codecs = std::move(t.codecs);
    s.quant_elements = t.quant_elements;
    s.plan = std::move(t.plan);
    s.gathered = std::move(t.gathered);
    s.whole = std::move(t.whole);
    s.algorithm = t.algorithm;
    // A layer that stays low rank at the same rank keeps its Q (the warm start survives a
    // re-solve); any other starts from Q0.
    for (const Backend::LowRankLayer& x : t.lowrank)
      for (const Backend::LowRankLayer& old : s.lowrank)
        if (old.layer == x.layer && old.rank == x.rank)
          backend_.copy(static_cast<float*>(t.q_warm->data()) + x.q_offset,
                        static_cast<float*>(s.q_warm->data()) + old.q_offset, x.cols * x.rank * 4);
    s.lowrank = std::move(t.lowrank);
    s.lowrank_segments = std::move(t.lowrank_segments);
    s.q_warm = std::move(t.q_warm);
    s.q0 = std::move(t.q0);
    s.p_floats = t.p_floats;
    s.q_floats = t.q_floats;
    switch (t.owner) {
      case StagedBucket::Owner::kKeep: break;
      case StagedBucket::Owner::kDrop:
        s.owner_residual.reset();
        s.owner_begin = s.owner_end = 0;
        break;
      case StagedBucket::Owner::kReplace: {
        const uint64_t lo = std::max(t.owner_begin, s.owner_begin), hi = std::min(t.owner_end, s.owner_end);
        if (s.owner_residual && lo < hi)
          backend_.copy(static_cast<float*>(t.owner_residual->data()) + (lo - t.owner_begin),
                        static_cast<float*>(s.owner_residual->data()) + (lo - s.owner_begin), (hi - lo) * 4);
        s.owner_residual = std::move(t.owner_residual);
        s.owner_begin = t.owner_begin;
        s.owner_end = t.owner_end;
        break;
      }
    }
    s.sizes = std::move(t.sizes);
    s.gathered_bytes = std::move(t.gathered_bytes);
    s.encoded_bytes = t.encoded_bytes;
    if (s.probe) s.probe->set_assignment(std::move(t.probe));
  }
  assignment_ = std::move(staged.assignment);
}

// The low-rank layers of a bucket under its staged codecs: offsets into P and Q, Q0 (which
// every rank derives from the shared seed and the layer's global index, so that every
// rank holds the same Q), and the warm Q's buffer, Q0 for now.
void Engine::stage_lowrank(uint32_t bucket, std::span<const uint8_t> lowrank_layers, StagedBucket& t) {
  BucketState& s = *state_of_[bucket];
  const BucketLayout& layout = buckets_[bucket];
  uint64_t p = 0, q = 0;
  for (size_t l = 0; l < layout.layers.size(); ++l) {
    if (!lowrank_layers[l]) continue;
    Backend::LowRankLayer x;
    x.layer = static_cast<uint32_t>(l);
    x.offset = layout.layers[l].offset;
    x.rows = layout.layers[l].rows;
    x.cols = layout.layers[l].numel / x.rows;
    x.rank = t.codecs[l].powersgd_params().rank;
    x.p_offset = p;
    x.q_offset = q;
    p += x.rows * x.rank;
    q += x.cols * x.rank;
    t.lowrank.push_back(x);
  }
  t.p_floats = p;
  t.q_floats = q;
  for (const Backend::LowRankLayer& x : t.lowrank)
    for (const Segment& seg : t.whole.segments)
      if (seg.layer == x.layer) t.lowrank_segments.push_back(seg);
  if (t.lowrank.empty()) return;
  t.q_warm = backend_.allocate(q * 4);
  t.q0 = backend_.allocate(q * 4);
  // Q0 travels from pinned memory (pageable could make the copy wait for the queue). The
  // staging buffer is rewritten at the next switch only: by then this upload is done, since
  // the agreement read at this switch waited for work queued after it.
  if (!s.q0_host || s.q0_host->bytes() < q * 4) {
    s.q0_host.reset();
    s.q0_host = backend_.allocate_host(max_lowrank_q_floats(bucket) * 4);
  }
  auto* host = static_cast<float*>(s.q0_host->data());
  for (const Backend::LowRankLayer& x : t.lowrank)
    lowrank::initial_q(NoiseKey{options_.seed, 0, 0, s.layer_base + x.layer}, x.cols, x.rank, host + x.q_offset);
  backend_.upload(t.q0->data(), host, q * 4);
  backend_.copy(t.q_warm->data(), t.q0->data(), q * 4);
}

// The most floats of Q any assignment gives the bucket: every matrix layer at its largest
// low-rank candidate (so that Q0's pinned staging is allocated once).
uint64_t Engine::max_lowrank_q_floats(uint32_t bucket) const {
  uint64_t q = 0;
  for (const LayerLayout& l : buckets_[bucket].layers) {
    uint32_t rank = 0;
    for (const CodecSpec& c : l.candidates)
      if (c.family() == CodecFamily::kPowersgd) rank = std::max(rank, c.powersgd_params().rank);
    if (rank && l.rows) q += l.numel / l.rows * rank;
  }
  return q;
}

// ---------------------------------------------------------------------------------------
// The call

CallOutcome Engine::pass(std::string why) {
  ++counters_.passed_through;
  return CallOutcome{CallOutcome::Kind::kPassThrough, std::move(why)};
}

CallOutcome Engine::stop_compressing(std::string why, bool warn) {
  state_ = State::kPassThrough;
  pass_reason_ = why;
  if (controller_) controller_->stop();
  if (warn) LGRECO_WARN("ENGINE", "compression is off on this communicator (every rank passes through): %s", why.c_str());
  else LGRECO_INFO("ENGINE", "every call passes through: %s", why.c_str());
  return pass(std::move(why));
}

std::string Engine::check_call(const EngineCall& call) const {
  if (call.bucket >= buckets_.size())
    return "bucket " + std::to_string(call.bucket) + " of " + std::to_string(buckets_.size());
  if (call.count != buckets_[call.bucket].count || call.dtype != buckets_[call.bucket].dtype)
    return "a call of " + std::to_string(call.count) + " " + dtype_name(call.dtype) + " for bucket " +
           std::to_string(call.bucket) + " of " + std::to_string(buckets_[call.bucket].count) + " " +
           dtype_name(buckets_[call.bucket].dtype);
  if (call.step < last_step_) return "step " + std::to_string(call.step) + " after step " + std::to_string(last_step_);
  return "";
}

CallOutcome Engine::allreduce(const EngineCall& call) {
  ++counters_.calls;
  // The backend's count of the host's waits, brought into the counters as the call ends.
  struct CopyWaits {
    Engine& e;
    ~CopyWaits() {
      e.counters_.host_waits = e.backend_.wait_counters().waits;
      e.counters_.host_stalls = e.backend_.wait_counters().stalls;
    }
  } copy_waits{*this};
  if (state_ == State::kBroken) {
    ++counters_.errors;
    return CallOutcome{CallOutcome::Kind::kError, "lgreco: an earlier compressed allreduce failed: " + broken_reason_};
  }
  if (state_ == State::kPassThrough) return pass(pass_reason_);
  try {
    if (state_ == State::kUnchecked) return first_call(call);
    return run(call);
  } catch (const std::exception& e) {
    // Data may have been queued to peers: the exchange cannot be undone quietly. Breaking
    // the fabric makes the peers fail now rather than at their timeout.
    state_ = State::kBroken;
    broken_reason_ = e.what();
    ++counters_.errors;
    fabric_.abort(e.what());
    if (controller_) controller_->stop();
    LGRECO_WARN("ENGINE", "compressed allreduce of bucket %u at step %llu failed: %s; this communicator's later "
                "calls fail too", call.bucket, static_cast<unsigned long long>(call.step), e.what());
    return CallOutcome{CallOutcome::Kind::kError, std::string("lgreco: compressed allreduce failed: ") + e.what()};
  }
}

// The first call: check it and allocate for the default assignment, then compare
// configurations (every local outcome included) before anything is sent.
CallOutcome Engine::first_call(const EngineCall& call) {
  std::string problem = check_call(call);
  if (problem.empty()) problem = unsupported_codec();
  if (problem.empty() && options_.mode != config::Mode::kOff && options_.valid) {
    try {
      switch_to(controller_ ? controller_->assignment_for_step(call.step) : nullptr);
    } catch (const std::bad_alloc&) {
      problem = "cannot allocate the residual and staging buffers";
    } catch (const std::exception& e) {
      problem = std::string("cannot prepare the ") + backend_.name() + " backend: " + e.what();
    }
  }
  const std::string why = agree(assignment_digest(assignment_.get()), problem.empty(), problem);
  if (!why.empty()) return stop_compressing(why, true);
  if (options_.mode == config::Mode::kOff) return stop_compressing("LGRECO_MODE=off", false);
  if (fabric_.size() == 1 && options_.algorithm == Algorithm::kAuto)
    return stop_compressing("one rank: nothing to exchange, so nothing to compress", false);
  state_ = State::kCompressing;
  LGRECO_INFO("ENGINE", "compressing on %d ranks (%s fabric, %s backend), %zu buckets, %zu adaptive layers",
              fabric_.size(), fabric_.name().c_str(), backend_.name().c_str(), buckets_.size(),
              controller_names_.size());
  return run(call);
}

CallOutcome Engine::run(const EngineCall& call) {
  if (const std::string bad = check_call(call); !bad.empty())
    throw std::invalid_argument("engine: " + bad);  // the caller's mistake on this rank
  last_step_ = call.step;

  resolve_timings(false);
  collect_samples(false);
  if (controller_)
    if (std::optional<CallOutcome> stopped = advance_schedule(call.step)) return *stopped;

  BucketState& b = *state_of_[call.bucket];
  if (call.new_address) {
    if (b.residual) backend_.fill_zero(b.residual->data(), b.residual->bytes());
    if (b.owner_residual) backend_.fill_zero(b.owner_residual->data(), b.owner_residual->bytes());
  }
  const bool measuring = controller_ && controller_->schedule().measures(call.step);
  // Before the first window, its lead's steps measure the gradient's magnitude alone: the
  // first solve's drift has no window before it to compare with.
  const bool leading = controller_ && !measuring && controller_->schedule().leads_first_window(call.step);
  // The leads of the later windows measure for the quantizers' pools, where the controller
  // pools them (Controller::pools_lead): their windows alone see too few steps. Not the
  // first window's (step 0 included): its shadows are still young there.
  const bool pooling = controller_ && !measuring && controller_->pools_lead() &&
                       call.step >= controller_->schedule().settings().warmup &&
                       controller_->schedule().probes(call.step);
  Sample* sample = measuring || leading || pooling ? begin_sample(b, call) : nullptr;
  if (sample) sample->lead = leading, sample->pool = pooling;
  CallTiming timing;
  timing.in_window = measuring;
  timing.quant_elements = b.quant_elements;
  timing.encoded_bytes = static_cast<double>(b.encoded_bytes);

  // The error probe first, while the residuals still hold what this call adds to its input.
  const bool probing = b.probe && controller_->schedule().probes(call.step);
  if (probing) probe_step(b, call, leading ? nullptr : sample);
  if (probing && b.lowrank_probe) lowrank_probe_step(b, call, leading || pooling ? nullptr : sample);
  if (sample && leading) {
    measure_magnitude(b, call, *sample);
  } else if (sample) {
    if (!pooling) measure_lowrank(b, call, *sample);  // low-rank candidates are not pooled
    measure_whole_layers(b, call, *sample);
  }
  if (b.algorithm == Algorithm::kAllGather) {
    if (b.plan.total_bytes > 0) all_gather(b.plan, b, call, timing);
  } else {
    if (!b.gathered.segments.empty()) all_gather(b.gathered, b, call, timing);
    if (b.plan.total_bytes > 0) reduce_scatter_allgather(b, call, timing);
  }
  if (!b.lowrank.empty()) low_rank(b, call, timing);
  if (probing && sample && !leading)
    b.probe->realized(backend_, ElementSpan{call.recv, call.dtype, 0}, call.count, probe_buffers(), sample->probe);
  // A bucket of nothing runs no operation; its timing still needs a mark to be resolved by.
  if (timing.codecs == 0 && timing.exchanges == 0) {
    timing.start_codec(backend_);
    timing.stop_codec(backend_);
  }

  if (sample) finish_sample();
  timings_.push_back(timing);
  ++counters_.compressed_calls;
  counters_.uncompressed_bytes += call.count * dtype_size(call.dtype);
  counters_.encoded_bytes += b.encoded_bytes;
  return CallOutcome{};
}

// ---------------------------------------------------------------------------------------
// Statistics and timing

std::unique_ptr<Engine::Sample> Engine::new_sample(uint32_t bucket) {
  auto sample = std::make_unique<Sample>();
  sample->bucket = bucket;
  sample->bytes = Sample::Layout(buckets_[bucket].layers.size(), measured_candidates_.size()).bytes;
  sample->device = backend_.allocate(sample->bytes);
  sample->host = backend_.allocate_host(sample->bytes);
  return sample;
}

Engine::Sample* Engine::begin_sample(BucketState& b, const EngineCall& call) {
  // The window's end is a step every rank computes alike, sample or not: the statistics'
  // sum across ranks (a collective) happens there.
  if (!window_end_) {
    uint64_t end = call.step;
    while (!controller_->schedule().window_ends(end)) ++end;
    window_end_ = end;
  }
  const size_t layers = buckets_[call.bucket].layers.size();
  const Sample::Layout at(layers, measured_candidates_.size());
  // Sample buffers are recycled: a spare one that is large enough, else a new one. A
  // rank that cannot allocate one measures this call less: statistics are local until
  // the window's sum, so the ranks' calls stay the same.
  std::unique_ptr<Sample> sample;
  for (size_t i = spare_samples_.size(); i-- > 0;)
    if (spare_samples_[i]->device->bytes() >= at.bytes) {
      sample = std::move(spare_samples_[i]);
      spare_samples_.erase(spare_samples_.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  if (!sample) {
    try {
      sample = new_sample(call.bucket);
    } catch (const std::bad_alloc&) {
      LGRECO_WARN_ONCE("ENGINE", "sample allocation", "cannot allocate a statistics buffer (LGRECO_MAX_MEMORY?): "
                       "some calls of this window are not measured");
      return nullptr;
    }
  }
  sample->bucket = call.bucket;
  sample->bytes = at.bytes;
  auto* device = static_cast<uint8_t*>(sample->device->data());
  backend_.fill_zero(device, sample->bytes);
  sample->measure = Backend::Measure{};
  sample->measure.candidates = measured_candidates_;
  sample->measure.measured = b.measured;
  sample->measure.squared = reinterpret_cast<double*>(device + at.measured);
  sample->measure.nonfinite = device + at.nonfinite;
  sample->magnitude = reinterpret_cast<double*>(device + at.magnitude);
  sample->probe = ProbeOutput{reinterpret_cast<double*>(device + at.simulated), device + at.simulated_nonfinite,
                              reinterpret_cast<double*>(device + at.reference),
                              reinterpret_cast<double*>(device + at.current), device + at.reference_nonfinite,
                              reinterpret_cast<double*>(device + at.realized), device + at.realized_nonfinite,
                              reinterpret_cast<double*>(device + at.independent)};
  samples_.push_back(std::move(sample));
  return samples_.back().get();
}

// The sample's errors come back through read-backs that nobody waits for until the
// window ends (or they are already there).
void Engine::finish_sample() {
  Sample& s = *samples_.back();
  s.ready = backend_.read_back(s.host->data(), s.device->data(), s.bytes);
}

void Engine::collect_samples(bool wait) {
  while (!samples_.empty()) {
    Sample& s = *samples_.front();
    if (!wait && !s.ready->ready()) return;
    backend_.await(*s.ready);
    const BucketState& b = *state_of_[s.bucket];
    const size_t c = measured_candidates_.size();
    const Sample::Layout at(b.controller_of.size(), c);
    const auto* host = static_cast<const uint8_t*>(s.host->data());
    const auto table = [&](uint64_t offset) { return reinterpret_cast<const double*>(host + offset); };
    const double* measured = table(at.measured);
    const double* simulated = table(at.simulated);
    const double* reference = table(at.reference);
    const double* current = table(at.current);
    const double* independent = table(at.independent);
    const double* realized = table(at.realized);
    const double* magnitude = table(at.magnitude);
    std::vector<double> values[5];
    for (size_t l = 0; l < b.controller_of.size(); ++l) {
      const int32_t k = b.controller_of[l];
      if (k < 0) continue;
      // Every rank measured its part of the whole layer; the probe's rank for the layer also
      // simulated and measured its sample, and counts the sample.
      const bool mine = b.probe && b.probe->designated(static_cast<uint32_t>(l)) == fabric_.rank();
      // The low-rank probe simulates whole layers: their content is the reference (each
      // rank's share, as measured), and each rank adds its share of the ranks' errors
      // weighed as independent.
      const bool lowrank_shares = b.lowrank_probe && b.lowrank_probe->covers(static_cast<uint32_t>(l));
      if (s.lead) {  // the magnitude alone; an overflowed step adds nothing
        if (host[at.nonfinite + l] == 0) stats_->add_lead(static_cast<size_t>(k), magnitude[l], !b.probe || mine);
        continue;
      }
      bool bad = host[at.nonfinite + l] != 0;
      for (auto& v : values) v.clear();
      for (uint32_t column : b.columns[l]) {
        values[0].push_back(measured[l * c + column]);
        values[1].push_back(mine ? simulated[l * c + column] : 0.0);
        const bool shared = lowrank_shares && lowrank_candidates_[column];
        values[2].push_back(shared ? measured[l * c + column] : mine ? reference[l * c + column] : 0.0);
        values[3].push_back(mine ? current[l * c + column] : 0.0);
        values[4].push_back(mine || shared ? independent[l * c + column] : 0.0);
        bad |= mine && host[at.simulated_nonfinite + l * c + column] != 0;
      }
      bad |= mine && (host[at.reference_nonfinite + l] != 0 || host[at.realized_nonfinite + l] != 0);
      if (bad) values[0].assign(values[0].size(), std::numeric_limits<double>::infinity());
      controller::ErrorStats::Sample sample;
      sample.measured = values[0];
      sample.simulated = values[1];
      sample.reference = values[2];
      sample.current = values[3];
      sample.simulated_independent = values[4];
      sample.realized = mine ? realized[l] : 0.0;
      sample.magnitude = magnitude[l];
      sample.counted = !b.probe || mine;
      // A non-finite sample is counted as skipped.
      (s.pool ? *pooled_lead_ : *stats_).add(static_cast<size_t>(k), sample);
    }
    spare_samples_.push_back(std::move(samples_.front()));
    samples_.pop_front();
  }
}

void Engine::resolve_timings(bool wait) {
  while (!timings_.empty()) {
    const CallTiming& t = timings_.front();
    if (wait)
      backend_.await_mark(t.last_mark());
    else if (!backend_.mark_ready(t.last_mark())) return;
    double exchange_s[CallTiming::kMaxIntervals] = {}, codec_s = 0;
    for (int i = 0; i < t.exchanges; ++i) {
      exchange_s[i] = backend_.seconds_between(t.exchange[i][0], t.exchange[i][1]);
      counters_.exchange_seconds += exchange_s[i];
    }
    for (int i = 0; i < t.codecs; ++i) codec_s += backend_.seconds_between(t.codec[i][0], t.codec[i][1]);
    counters_.codec_seconds += codec_s;
    // Whole calls only, so that bytes and times cover the same calls on every rank.
    if (t.in_window && window_.exchange_seconds.size() + t.exchanges <= kMaxTimedExchanges) {
      window_.exchange_seconds.insert(window_.exchange_seconds.end(), exchange_s, exchange_s + t.exchanges);
      window_.encoded_bytes += t.encoded_bytes;
      window_.codec_seconds += codec_s;
      window_.quant_elements += t.quant_elements;
    }
    t.release(backend_);
    timings_.pop_front();
  }
}

// The controller's pipeline (docs/ENGINE.md, "The host waits for nothing it just
// queued"). With W the last step of a window and the switch at E = W + switch_lag:
//   W + 1 (its first call):   the window's statistics and timings are summed across ranks
//                             (queued, not read);
//   a later call, W + 2 at the latest: the sum is read and submitted; the solve begins;
//   E - 1:                    the assignment is staged (allocated, prepared) and the
//                             ranks' agreement on it queued;
//   E:                        the agreement is read; the assignment takes effect.
// Every result is read a step after it was queued. A lag of 2 reads the sum at once at
// W + 1, a lag of 1 the agreement too at E: there the host waits (counted as stalls).
// What happens at which step is the same on every rank: only submitting is rank-local
// (early where the sum is back early), and the controller hands out its result at E on
// every rank alike.
std::optional<CallOutcome> Engine::advance_schedule(uint64_t step) {
  if (pending_sum_ && (step > pending_sum_->sent_at || pending_sum_->ready->ready())) submit_window_sum();
  if (window_end_ && step > *window_end_) {
    send_window_sum(step);
    if (step + 1 >= controller_->schedule().effective_step(pending_sum_->window_last)) submit_window_sum();
  }
  if (switch_due_ && !pending_switch_ && step + 1 >= *switch_due_) stage_switch(*switch_due_);
  if (pending_switch_ && step >= pending_switch_->step) {
    const uint64_t at = pending_switch_->step;
    const std::string why = complete_switch();
    if (!why.empty()) return stop_compressing("from step " + std::to_string(at) + ": " + why, true);
  }
  return std::nullopt;
}

void Engine::send_window_sum(uint64_t step) {
  auto p = std::make_unique<PendingSum>();
  p->window_last = *window_end_;
  p->sent_at = step;
  window_end_.reset();
  // Work of the window's steps, queued a step ago or more.
  collect_samples(true);
  resolve_timings(true);
  // The statistics and the cost measurements, summed across ranks in one reduction. Each
  // rank's time of each timed exchange goes to its own slot, so that every rank can take,
  // exchange by exchange, the smallest: a rank's exchange also waits for slower peers'
  // encoding, and the rank that arrives last waits least, so its time is the closest to
  // what the link costs. Every rank timed the same exchanges.
  const int n = fabric_.size();
  const std::span<double> local = stats_->reduction_buffer();
  // The lead's statistics travel with the window's, where the controller pools them; the
  // next lead's collect into a fresh accumulator meanwhile.
  std::span<double> lead;
  if (controller_->pools_lead()) {
    p->lead = std::move(*pooled_lead_);
    pooled_lead_.emplace(new_window_stats());
    lead = p->lead->reduction_buffer();
  }
  p->statistics = local.size() + lead.size();
  p->exchanges = window_.exchange_seconds.size();
  p->encoded = window_.encoded_bytes;
  const size_t count = p->statistics + 2 + n * p->exchanges;
  if (count * sizeof(double) > window_sum_->bytes())
    throw std::logic_error("engine: the window's sum outgrew its buffer");
  // Pinned: the upload reads it later, and the sum comes back to it. Rewritten only at the
  // next window, after this sum was read.
  auto* host = static_cast<double*>(window_sum_host_->data());
  std::copy(lead.begin(), lead.end(), std::copy(local.begin(), local.end(), host));
  double* cost = host + p->statistics;
  std::fill(cost, cost + 2 + n * p->exchanges, 0.0);
  cost[0] = window_.codec_seconds;
  cost[1] = window_.quant_elements;
  std::copy(window_.exchange_seconds.begin(), window_.exchange_seconds.end(), cost + 2 + fabric_.rank() * p->exchanges);
  window_ = WindowCost{};
  auto* device = static_cast<double*>(window_sum_->data());
  backend_.upload(device, host, count * sizeof(double));
  fabric_.all_reduce_sum(std::span<double>(device, count));
  p->ready = backend_.read_back(host, device, count * sizeof(double));
  pending_sum_ = std::move(p);
}

void Engine::submit_window_sum() {
  const std::unique_ptr<PendingSum> p = std::move(pending_sum_);
  backend_.await(*p->ready);
  const int n = fabric_.size();
  const double* all = static_cast<const double*>(window_sum_host_->data());
  const std::span<double> local = stats_->reduction_buffer();
  std::copy(all, all + local.size(), local.begin());
  if (p->lead) std::copy(all + local.size(), all + p->statistics, p->lead->reduction_buffer().begin());
  const double* cost = all + p->statistics;
  double exchange_s = 0;
  for (size_t k = 0; k < p->exchanges; ++k) {
    double least = cost[2 + k];
    for (int r = 1; r < n; ++r) least = std::min(least, cost[2 + r * p->exchanges + k]);
    exchange_s += least;
  }
  const double codec_s = cost[0], quant_elements = cost[1];
  // A window without quantized layers cannot time the codec: keep the last measurement
  // (the same on every rank), or the next solve would take copy speed for codec speed.
  if (codec_s > 0 && quant_elements > 0) quant_throughput_ = quant_elements / codec_s;
  std::optional<controller::CostModel> model;
  if (exchange_s > 0 && p->encoded > 0) {
    model.emplace();
    model->link.bandwidth = p->encoded / exchange_s;
    if (quant_throughput_ > 0) model->families["quant"].throughput = quant_throughput_;
    LGRECO_INFO("ENGINE", "window ending at step %llu: exchanges moved %.4g encoded bytes/s, the codec %.4g elements/s",
                static_cast<unsigned long long>(p->window_last), model->link.bandwidth, quant_throughput_);
  }
  last_window_stats_ = *stats_;
  last_lead_stats_ = p->lead;
  controller_->submit(p->window_last, std::move(*stats_), model, std::move(p->lead));
  stats_.emplace(new_window_stats());
  switch_due_ = controller_->schedule().effective_step(p->window_last);
}

// At every switch step the ranks compare what they are about to use, whether or not their
// solve succeeded: a rank whose solve failed keeps its assignment, and must not be the one
// rank that skips the comparison. A rank that cannot stage the new assignment says so in
// the comparison, and every rank passes through from the switch on.
void Engine::stage_switch(uint64_t switch_step) {
  switch_due_.reset();
  auto p = std::make_unique<PendingSwitch>();
  p->step = switch_step;
  std::shared_ptr<const controller::Assignment> next = controller_->assignment_for_step(switch_step);
  p->epoch = next ? next->epoch : 0;
  std::string problem;
  if (next != assignment_) {
    try {
      p->staged = stage(next);
    } catch (const std::bad_alloc&) {
      problem = "cannot allocate the staging buffers of epoch " + std::to_string(p->epoch);
    } catch (const std::exception& e) {
      problem =
          "cannot prepare the " + backend_.name() + " backend for epoch " + std::to_string(p->epoch) + ": " + e.what();
    }
  }
  p->agreed = send_agreement(assignment_digest(next.get()), problem.empty(), problem);
  pending_switch_ = std::move(p);
}

std::string Engine::complete_switch() {
  const std::unique_ptr<PendingSwitch> p = std::move(pending_switch_);
  backend_.await(*p->agreed);
  std::string why = read_agreement();
  if (!why.empty()) return why;
  if (p->staged) apply(*p->staged);
  LGRECO_INFO("ENGINE", "step %llu: assignment epoch %llu in effect", static_cast<unsigned long long>(p->step),
              static_cast<unsigned long long>(p->epoch));
  return "";
}

// ---------------------------------------------------------------------------------------
// The algorithms

// Where a rank's own encoding's errors go: under ncclAvg the sum is divided by P
// afterwards, so such an error reaches the output divided by P (weight 1/P^2); the
// owner's re-encoding of the average reaches it as it is.
Backend::Measure Engine::first_stage_measure(const Sample& sample, ReduceOp op) const {
  Backend::Measure m = sample.measure;
  const double n = fabric_.size();
  if (op == ReduceOp::kAvg) m.weight = 1.0 / (n * n);
  return m;
}

// The whole layers' content, for the estimates (docs/CONTROLLER.md): every candidate but
// the low-rank ones on each rank's gradient alone, no residual (a state-free measurement,
// so that the sample's composition factor, this over the same on the sample, does not
// depend on what the codecs in effect left in the residuals), and each layer's magnitude
// sum |g| for the drift.
void Engine::measure_whole_layers(BucketState& b, const EngineCall& call, Sample& sample) {
  const ElementSpan input{const_cast<void*>(call.send), call.dtype, 0};
  Backend::Measure m = first_stage_measure(sample, call.op);
  if (lowrank_candidates_any()) m.candidate_mask = not_lowrank_candidates_;
  backend_.measure(b.whole, b.whole.segments, input, nullptr, 0, m);
  measure_magnitude(b, call, sample);
}

// Each layer's gradient magnitude sum |g| on this rank, for the drift and the normalized
// metric's weights; in the output's units, as the errors are (over P under ncclAvg), so
// that error x numel / magnitude^2 over the ranks' sum is the error relative to the
// gradient's energy per coordinate whatever the op.
void Engine::measure_magnitude(BucketState& b, const EngineCall& call, Sample& sample) {
  const ElementSpan input{const_cast<void*>(call.send), call.dtype, 0};
  const double weight = call.op == ReduceOp::kAvg ? 1.0 / fabric_.size() : 1.0;
  backend_.distance(b.whole.segments, input, nullptr, 1, weight, sample.magnitude, sample.measure.nonfinite);
}

// Low-rank candidates, on every adaptive matrix layer that has one: each rank's own
// gradient, one power iteration from a seeded start (Backend::measure_lowrank), weight
// 1/P^2 under ncclAvg as for every per-rank error. That is the layer's content: the
// candidates' own error-feedback state is the low-rank probe's (lowrank_probe.h). Without
// that probe (no controller's probe in the bucket), on the real state, gradient +
// residual: an estimate that misses what the candidate's own residual would hold.
void Engine::measure_lowrank(BucketState& b, const EngineCall& call, Sample& sample) {
  if (b.lowrank_measured.empty()) return;
  Backend::Measure m = first_stage_measure(sample, call.op);
  m.candidate_mask = lowrank_candidates_;
  const NoiseBase key{options_.seed, 0, call.step, b.layer_base};
  // With the low-rank probe, on the gradient alone: the layer's content, which is also the
  // reference of the probe's whole-layer simulation (collect_samples).
  const float* residual = b.residual && !b.lowrank_probe ? static_cast<float*>(b.residual->data()) : nullptr;
  backend_.measure_lowrank(b.lowrank_measured, ElementSpan{const_cast<void*>(call.send), call.dtype, 0}, residual, key,
                           m);
}

// PowerSGD's exchange of the bucket's low-rank layers (Vogels et al. 2019), batched: one
// allreduce of every layer's P, one of every layer's Q. P = M Q is linear in M, so the sum
// of the ranks' P is the P of the summed gradient; summed in rank order by the fabric, it
// is the same bits on every rank, and so is everything computed from it. Each rank keeps
// as its residual what its own M loses to the shared basis, M - P (M^T P)^T, and the
// summed Q is the next step's warm start.
void Engine::low_rank(BucketState& b, const EngineCall& call, CallTiming& timing) {
  const int n = fabric_.size();
  const ElementSpan input{const_cast<void*>(call.send), call.dtype, 0};
  float* residual = b.residual ? static_cast<float*>(b.residual->data()) : nullptr;
  uint8_t* flags = residual ? static_cast<uint8_t*>(b.flags->data()) : nullptr;
  auto* p = reinterpret_cast<float*>(scratch(kLowRankP, b.p_floats * 4));
  auto* q = reinterpret_cast<float*>(scratch(kLowRankQ, b.q_floats * 4));
  auto* q_warm = static_cast<float*>(b.q_warm->data());

  timing.start_codec(backend_);
  if (flags) backend_.find_nonfinite(b.whole, b.lowrank_segments, input, flags);
  backend_.lowrank_project(b.lowrank, input, residual, flags, q_warm, p);
  timing.stop_codec(backend_);

  const uint64_t sent_before = fabric_.counters().bytes_sent;
  timing.start_exchange(backend_);
  fabric_.all_reduce_sum(std::span<float>(p, b.p_floats));
  timing.stop_exchange(backend_);

  timing.start_codec(backend_);
  backend_.lowrank_orthonormalize(b.lowrank, p);
  backend_.lowrank_back_project(b.lowrank, input, residual, flags, p, q);
  timing.stop_codec(backend_);

  timing.start_exchange(backend_);
  fabric_.all_reduce_sum(std::span<float>(q, b.q_floats));
  timing.stop_exchange(backend_);
  counters_.wire_bytes_sent += fabric_.counters().bytes_sent - sent_before;

  timing.start_codec(backend_);
  const float scale = call.op == ReduceOp::kAvg ? 1.0f / static_cast<float>(n) : 1.0f;
  backend_.lowrank_reconstruct(b.lowrank, p, q, scale, ElementSpan{call.recv, call.dtype, 0});
  backend_.lowrank_keep(b.lowrank, q, static_cast<float*>(b.q0->data()), q_warm);
  timing.stop_codec(backend_);
}

// One all-gather of every segment of `plan` (one partition): each rank encodes the
// segments with its residual, all-gathers every rank's encoding and sums the decoded
// values in rank order, in float32, then narrows them into recv. For the all-gather
// algorithm the plan is the whole call; under sra it is the gathered layers (TopK),
// whose recv ranges the sra part does not touch.
void Engine::all_gather(const Plan& plan, BucketState& b, const EngineCall& call, CallTiming& timing) {
  const bool whole_call = &plan == &b.plan;
  const int n = fabric_.size();
  const ElementSpan input{const_cast<void*>(call.send), call.dtype, 0};
  float* residual = b.residual ? static_cast<float*>(b.residual->data()) : nullptr;
  uint8_t* flags = residual ? static_cast<uint8_t*>(b.flags->data()) : nullptr;
  const uint64_t first = plan.segments.front().offset;
  const uint64_t elements = plan.segments.back().offset + plan.segments.back().count - first;
  uint8_t* send = scratch(whole_call ? kSend : kPartSend, plan.total_bytes);
  uint8_t* gathered = scratch(whole_call ? kGathered : kPartGathered, plan.total_bytes * n);
  auto* acc = reinterpret_cast<float*>(scratch(whole_call ? kAcc : kPartAcc, elements * 4));
  const std::vector<uint64_t>& gather_bytes = whole_call ? b.sizes->gather_bytes : b.gathered_bytes;
  const NoiseBase noise{options_.seed, static_cast<uint32_t>(fabric_.rank()), call.step, b.layer_base};

  timing.start_codec(backend_);
  if (flags) backend_.find_nonfinite(plan, plan.segments, input, flags);
  backend_.encode(plan, plan.segments, input, residual, 0, flags, noise, send, 0);
  timing.stop_codec(backend_);

  const uint64_t sent_before = fabric_.counters().bytes_sent;
  timing.start_exchange(backend_);
  fabric_.all_gather_v(send, gather_bytes, gathered);
  timing.stop_exchange(backend_);
  counters_.wire_bytes_sent += fabric_.counters().bytes_sent - sent_before;

  timing.start_codec(backend_);
  backend_.fill_zero(acc, elements * 4);
  const ElementSpan sum{acc, DType::kFloat32, first};
  for (int p = 0; p < n; ++p)  // rank order: every rank adds the same values in the same order
    backend_.decode_accumulate(plan, plan.segments, gathered, p * plan.total_bytes, sum);
  // Divide and narrow each run of adjacent segments (one run for the whole call), so that
  // elements of layers outside the plan keep what recv holds.
  for (size_t i = 0; i < plan.segments.size();) {
    const uint64_t begin = plan.segments[i].offset;
    uint64_t end = begin + plan.segments[i].count;
    for (++i; i < plan.segments.size() && plan.segments[i].offset == end; ++i) end += plan.segments[i].count;
    float* run = acc + (begin - first);
    if (call.op == ReduceOp::kAvg) backend_.divide(run, end - begin, static_cast<float>(n));
    backend_.narrow(run, end - begin,
                    ElementSpan{static_cast<uint8_t*>(call.recv) + begin * dtype_size(call.dtype), call.dtype, 0});
  }
  timing.stop_codec(backend_);
}

controller::ErrorStats Engine::new_window_stats() const {
  controller::ErrorStats stats = controller_->new_stats();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketState& s = *state_of_[b];
    if (!s.probe) continue;
    for (size_t l = 0; l < s.controller_of.size(); ++l)
      if (s.controller_of[l] >= 0)
        stats.set_sample_scale(static_cast<size_t>(s.controller_of[l]),
                               static_cast<double>(buckets_[b].layers[l].numel) /
                                   static_cast<double>(s.probe->sampled(static_cast<uint32_t>(l))));
  }
  return stats;
}

BucketProbe::Buffers Engine::probe_buffers() {
  BucketProbe::Buffers p;
  const auto floats = [this](int which) { return reinterpret_cast<float*>(scratch(which, 0)); };
  p.send = floats(kProbeSend);
  p.recv = floats(kProbeRecv);
  p.inputs = floats(kProbeInputs);
  p.sum = floats(kProbeSum);
  p.error = floats(kProbeError);
  p.payload = scratch(kProbePayload, 0);
  p.flags = scratch(kProbeFlags, 0);
  p.x = floats(kProbeX);
  p.owner = floats(kProbeOwner);
  p.owner_sum = floats(kProbeOwnerSum);
  p.exact = floats(kProbeExact);
  p.out = floats(kProbeOut);
  return p;
}

// The error probe's step of this call (plugin/collective/probe.h), before anything of the
// call changes the residuals; its exchange's bytes are counted apart too.
void Engine::probe_step(BucketState& b, const EngineCall& call, Sample* sample) {
  BucketProbe::Call p;
  p.input = ElementSpan{const_cast<void*>(call.send), call.dtype, 0};
  p.count = call.count;
  p.residual = b.residual ? static_cast<const float*>(b.residual->data()) : nullptr;
  if (b.algorithm == Algorithm::kScatterReduceAllGather && b.owner_residual) {
    p.owner_residual = static_cast<const float*>(b.owner_residual->data());
    p.owner_first = b.owner_begin;
    p.owner_end = b.owner_end;
  }
  p.average = call.op == ReduceOp::kAvg;
  p.step = call.step;
  p.candidates = measured_candidates_;
  const uint64_t sent_before = fabric_.counters().bytes_sent;
  b.probe->step(backend_, fabric_, p, probe_buffers(), sample ? &sample->probe : nullptr);
  const uint64_t sent = fabric_.counters().bytes_sent - sent_before;
  counters_.probe_bytes_sent += sent;
  counters_.wire_bytes_sent += sent;
}

// The low-rank candidates' probe (plugin/collective/lowrank_probe.h): its two allreduces
// come after the quantization probe's all-to-all, on every rank alike.
void Engine::lowrank_probe_step(BucketState& b, const EngineCall& call, Sample* sample) {
  LowRankProbe::Call p;
  p.input = ElementSpan{const_cast<void*>(call.send), call.dtype, 0};
  p.count = call.count;
  p.step = call.step;
  p.average = call.op == ReduceOp::kAvg;
  p.error_feedback = b.residual != nullptr;
  const uint64_t sent_before = fabric_.counters().bytes_sent;
  b.lowrank_probe->step(backend_, fabric_, p, sample ? &sample->probe : nullptr);
  const uint64_t sent = fabric_.counters().bytes_sent - sent_before;
  counters_.probe_bytes_sent += sent;
  counters_.wire_bytes_sent += sent;
}

void Engine::reduce_scatter_allgather(BucketState& b, const EngineCall& call, CallTiming& timing) {
  const Plan& plan = b.plan;
  const ExchangeSizes& sizes = *b.sizes;
  const int n = fabric_.size(), me = fabric_.rank();
  const Partition& mine = plan.partitions[me];
  const ElementSpan input{const_cast<void*>(call.send), call.dtype, 0};
  float* residual = b.residual ? static_cast<float*>(b.residual->data()) : nullptr;
  uint8_t* flags = residual ? static_cast<uint8_t*>(b.flags->data()) : nullptr;
  uint8_t* send = scratch(kSend, sizes.send);
  uint8_t* recv = scratch(kRecv, sizes.recv);
  auto* acc = reinterpret_cast<float*>(scratch(kAcc, sizes.acc));
  uint8_t* reencoded = scratch(kReencoded, sizes.reencoded);
  uint8_t* gathered = scratch(kGathered, sizes.gathered);

  // Stage 1: encode every partition but this rank's own, back to back in rank order.
  timing.start_codec(backend_);
  if (flags) backend_.find_nonfinite(plan, plan.segments, input, flags);
  const NoiseBase noise{options_.seed, static_cast<uint32_t>(me), call.step, b.layer_base};
  for (int q = 0; q < n; ++q)
    if (q != me)
      backend_.encode(plan, plan.segments_of(plan.partitions[q]), input, residual, 0, flags, noise, send,
                      sizes.send_offset[q]);
  timing.stop_codec(backend_);

  const uint64_t sent_before = fabric_.counters().bytes_sent;
  timing.start_exchange(backend_);
  fabric_.all_to_all_v(send, sizes.send_bytes, recv, sizes.recv_bytes);
  timing.stop_exchange(backend_);

  // The owner's sum, in rank order; its own contribution exact (it never travels).
  timing.start_codec(backend_);
  const auto own = plan.segments_of(mine);
  const ElementSpan sum{acc, DType::kFloat32, mine.begin};
  backend_.fill_zero(acc, mine.count() * 4);
  uint64_t from = 0;
  for (int p = 0; p < n; ++p) {
    if (p == me) {
      backend_.accumulate_exact(plan, own, input, residual, 0, flags, sum);
    } else {
      backend_.decode_accumulate(plan, own, recv, from, sum);
      from += mine.bytes;
    }
  }
  if (call.op == ReduceOp::kAvg) backend_.divide(acc, mine.count(), static_cast<float>(n));
  float* owner_residual = b.owner_residual ? static_cast<float*>(b.owner_residual->data()) : nullptr;
  timing.stop_codec(backend_);
  // Stage 2: re-encode the sum with the owner's residual (its own noise stream).
  timing.start_codec(backend_);
  NoiseBase reencode = noise;
  reencode.rank = NoiseBase::kReencodeRankBit | static_cast<uint32_t>(me);
  backend_.encode(plan, own, sum, owner_residual, mine.begin, nullptr, reencode, reencoded, 0);
  timing.stop_codec(backend_);

  timing.start_exchange(backend_);
  fabric_.all_gather_v(reencoded, sizes.gather_bytes, gathered);
  timing.stop_exchange(backend_);
  counters_.wire_bytes_sent += fabric_.counters().bytes_sent - sent_before;

  timing.start_codec(backend_);
  uint64_t offset = 0;
  for (const Partition& p : plan.partitions) {
    backend_.decode(plan, plan.segments_of(p), gathered, offset, ElementSpan{call.recv, call.dtype, 0});
    offset += p.bytes;
  }
  timing.stop_codec(backend_);
}

std::unique_ptr<Engine> make_engine_or_pass_through(EngineOptions options, std::vector<BucketLayout> buckets,
                                                    Fabric& fabric, Backend& backend) {
  try {
    return std::make_unique<Engine>(options, std::move(buckets), fabric, backend);
  } catch (const std::invalid_argument& e) {
    options.valid = false;
    options.invalid_reason = std::string("the buckets' layouts: ") + e.what();
    return std::make_unique<Engine>(options, std::vector<BucketLayout>{}, fabric, backend);
  }
}

}  // namespace lgreco::collective
