#include "plugin/hook/session.h"

#include <cinttypes>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "config/log.h"
#include "config/registration.h"
#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/engine.h"
#include "plugin/collective/socket_fabric.h"

namespace lgreco::hook {

std::unique_ptr<Session> Session::open(const SessionOptions& options, const config::Params& params) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size)
    throw std::runtime_error("rank " + std::to_string(options.rank) + " of a world of " +
                             std::to_string(options.world_size) + ": not a rank of it");
  if (options.master_port == 0) throw std::runtime_error("no rendezvous port");
  // The layout first: a bad one is this rank's own mistake, found before any waiting.
  config::Registration layout;
  try {
    layout = config::parse_registration(options.layout_json, "the comm hook's bucket layout");
  } catch (const config::RegistrationError& e) {
    throw std::runtime_error(e.what());
  }
  std::unique_ptr<Session> s(new Session());
  s->rank_ = options.rank;
  s->world_size_ = options.world_size;
  collective::SocketFabricOptions so;
  so.rank = options.rank;
  so.world_size = options.world_size;
  so.master_host = options.master_host;
  so.master_port = options.master_port;
  so.timeout = options.timeout;
  try {
    s->fabric_ = collective::SocketFabric::create(so);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("connecting the ranks: ") + e.what());
  }
  s->backend_ = std::make_unique<collective::CpuBackend>();
  collective::EngineOptions engine_options = collective::EngineOptions::from_params(params, options.rank);
  std::vector<collective::BucketLayout> buckets;
  for (const config::RegisteredBucket& b : layout.buckets)
    buckets.push_back(collective::layout_from_registration(b, engine_options));
  s->engine_ = collective::make_engine_or_pass_through(engine_options, std::move(buckets), *s->fabric_, *s->backend_);
  LGRECO_INFO("ENGINE", "comm hook: rank %d/%d: %zu buckets, %zu layers", options.rank, options.world_size,
              layout.buckets.size(), layout.layer_count());
  return s;
}

Session::~Session() {
  if (engine_) LGRECO_INFO("ENGINE", "comm hook: rank %d/%d: %s", rank_, world_size_, summary().c_str());
}

const collective::EngineCounters& Session::counters() const { return engine_->counters(); }

uint32_t Session::buckets() const { return static_cast<uint32_t>(engine_->buckets().size()); }

Outcome Session::allreduce_mean(uint32_t bucket, uint64_t step, void* data, uint64_t count, DType dtype,
                                std::string* message) {
  if (broken_) {
    *message = "the session failed before: " + broken_reason_;
    return Outcome::kError;
  }
  // The engine's own pass-through (invalid, disagreeing or off) covers every bucket, so
  // a bucket it does not know is a caller's mistake only while it compresses.
  if (bucket >= engine_->buckets().size() && !engine_->buckets().empty()) {
    *message = "bucket " + std::to_string(bucket) + " is not in the layout (" + std::to_string(buckets()) +
               " buckets): the caller's layout changed without a new session";
    return Outcome::kError;
  }
  collective::EngineCall call;
  call.bucket = bucket;
  call.step = step;
  call.send = data;
  call.recv = data;
  call.count = count;
  call.dtype = dtype;
  call.op = collective::ReduceOp::kAvg;
  const collective::CallOutcome outcome = engine_->allreduce(call);
  switch (outcome.kind) {
    case collective::CallOutcome::Kind::kDone: return Outcome::kDone;
    case collective::CallOutcome::Kind::kPassThrough: return Outcome::kPassThrough;
    case collective::CallOutcome::Kind::kError: break;
  }
  broken_ = true;
  broken_reason_ = outcome.message;
  *message = outcome.message;
  return Outcome::kError;
}

std::string Session::summary() const {
  const collective::EngineCounters& c = engine_->counters();
  char text[256];
  snprintf(text, sizeof text,
           "%" PRIu64 " calls, %" PRIu64 " compressed, %" PRIu64 " passed through; %" PRIu64
           " gradient bytes compressed, %" PRIu64 " bytes sent by this rank",
           c.calls, c.compressed_calls, c.passed_through, c.uncompressed_bytes, c.wire_bytes_sent);
  return text;
}

}  // namespace lgreco::hook
