// A compressed-allreduce session for a framework's own communication hook (PyTorch DDP's
// comm hook on CPU tensors, python/lgreco/torch.py): the same engine, controller and CPU
// backend the shim drives, over the socket fabric instead of NCCL.
//
// The caller owns the schedule: it opens one session per process group once the bucket
// layout is final, every rank with the same layout, and then makes the same calls on every
// rank, in the same order, one at a time (one thread), each naming its bucket and the
// training step. The engine's agreement runs at the first call: a rank whose
// configuration differs or is invalid makes every rank pass through together.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "config/params.h"
#include "kernels/dtype.h"

namespace lgreco::collective {
class Engine;
struct EngineCounters;
class SocketFabric;
class CpuBackend;
}  // namespace lgreco::collective

namespace lgreco::hook {

struct SessionOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_host = "127.0.0.1";  // rank 0's rendezvous address
  uint16_t master_port = 0;               // rank 0's rendezvous port (chosen by the caller)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // The buckets, as a registration document (docs/REGISTRATION.md): the hook builds it
  // from DDP's own buckets.
  std::string layout_json;
};

enum class Outcome : int { kDone = 0, kPassThrough = 1, kError = -1 };

class Session {
 public:
  // Rendezvous with the other ranks and the engine from the process's LGRECO_*
  // parameters. Throws std::runtime_error with a message naming the problem (a layout the
  // registration rules reject, a rendezvous that fails within the timeout).
  static std::unique_ptr<Session> open(const SessionOptions& options, const config::Params& params);
  ~Session();

  // The mean over ranks of `data` (count elements of bucket `bucket`'s dtype), in place.
  // kPassThrough: data is untouched and the caller reduces it itself (every rank gets the
  // same answer for the same call). kError: *message says why; the session is broken and
  // later calls fail too.
  Outcome allreduce_mean(uint32_t bucket, uint64_t step, void* data, uint64_t count, DType dtype,
                         std::string* message);

  uint32_t buckets() const;
  const collective::EngineCounters& counters() const;
  // One line: calls, compressed, bytes sent against an uncompressed ring allreduce.
  std::string summary() const;

 private:
  Session() = default;
  int rank_ = 0, world_size_ = 1;
  std::unique_ptr<collective::SocketFabric> fabric_;
  std::unique_ptr<collective::CpuBackend> backend_;
  std::unique_ptr<collective::Engine> engine_;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace lgreco::hook
