// Per-peer traffic of the net plugin's TCP transport: a registry of the open comms'
// counters that keeps the totals of closed ones, the Prometheus text exposition format
// (0.0.4) of those totals, and an exporter thread that writes it to a file (for
// node_exporter's textfile collector, or anyone who reads files).
//
//   Registry registry;
//   auto token = registry.register_source({peer, Direction::kSend, "eth0"},
//                                         [comm] { return comm->counters(); });
//   ...                                     // traffic
//   registry.unregister(token);             // before the comm is destroyed
//   Exporter exporter(registry, path, 10s, process_labels());
//
// NCCL opens and closes comms per communicator, so a peer's totals are the retained sum of
// its closed comms plus the current counters of its open ones. Give the same PeerKey to
// every comm with one peer (its host address without the ephemeral port) or the totals
// scatter over keys and the peer cap below is reached sooner.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "plugin/transport/tcp_transport.h"

namespace lgreco::net {

enum class Direction : uint8_t { kSend, kRecv };
const char* direction_name(Direction direction);  // "send", "recv"

// Whose traffic: the peer (any text; it is escaped on export), which way, which device.
struct PeerKey {
  std::string peer;
  Direction direction = Direction::kSend;
  std::string device;
  auto operator<=>(const PeerKey&) const = default;
};

// Totals for one PeerKey: retained counters of its closed comms plus its open ones.
struct PeerTraffic {
  PeerKey key;
  transport::CommCounters totals;
  double busy_seconds() const { return static_cast<double>(totals.busy_ns) * 1e-9; }
  // Achieved bandwidth, payload bytes per busy second; 0 when there was no busy time.
  double bandwidth() const;
};

// The comms' counters by peer. Thread-safe: any thread may register, unregister and take
// snapshots.
//
// Sources are called with the registry's lock held, by snapshot(), aggregate_bandwidth()
// and unregister(): once unregister() returns, its source is never called again, so the
// comm it reads may be destroyed. A source must therefore be cheap, must not block and
// must not call into the registry.
class Registry {
 public:
  using Source = std::function<transport::CommCounters()>;
  using Token = uint64_t;  // never 0

  // Peers whose totals are retained after their comms close. Past it, closed comms of
  // new keys are folded into the key {kOtherPeer, direction, ""}, so that a job that
  // churns through peers (or a caller that puts port numbers into peer names) keeps
  // bounded memory while no byte goes uncounted.
  static constexpr size_t kDefaultMaxPeers = 4096;
  static constexpr const char* kOtherPeer = "(other)";

  explicit Registry(size_t max_retained_peers = kDefaultMaxPeers);
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Starts counting `source` under `key`. Throws std::invalid_argument for an empty source.
  Token register_source(PeerKey key, Source source);
  // Reads the source one last time and adds it to its key's retained totals. Unknown
  // tokens (0, or one already unregistered) are ignored, so that a close after a failed
  // open is harmless.
  void unregister(Token token);

  // Totals per key, sorted by key (deterministic).
  std::vector<PeerTraffic> snapshot() const;
  // Payload bytes over busy seconds across every key of `direction`, closed comms
  // included: the achieved bandwidth the controller's time objective needs. 0 without
  // busy time.
  double aggregate_bandwidth(Direction direction) const;
  // Sources registered now.
  size_t live_sources() const;

 private:
  struct Live {
    PeerKey key;
    Source source;
  };
  void retain(const PeerKey& key, const transport::CommCounters& counters);  // lock held

  const size_t max_retained_;
  mutable std::mutex mutex_;
  Token next_token_ = 1;
  std::map<Token, Live> live_;
  std::map<PeerKey, transport::CommCounters> retained_;
};

// Labels every sample carries besides peer, direction and device, in the given order.
using Labels = std::vector<std::pair<std::string, std::string>>;
// {{"host", hostname}, {"pid", getpid()}}: tells the processes of one job apart.
Labels process_labels();

// The Prometheus text exposition format 0.0.4 of `traffic`: for each metric a HELP and a
// TYPE line, then one sample per entry, in the order given (snapshot() sorts them):
//   lgreco_net_payload_bytes_total{peer="...",direction="send",device="eth0",host="h",pid="1"} 123
//   lgreco_net_wire_bytes_total, lgreco_net_messages_total (integers),
//   lgreco_net_busy_seconds_total (exact decimal nanoseconds, "1.500000000").
// Label values are escaped as the format requires (\\, \", \n). No timestamps (the
// textfile collector refuses them). Throws std::invalid_argument for a common label whose
// name is not [a-zA-Z_][a-zA-Z0-9_]*, starts with "__", or repeats a label.
std::string prometheus_text(const std::vector<PeerTraffic>& traffic, const Labels& common);

// A thread that writes prometheus_text(registry.snapshot(), labels) to `path` at once,
// then every `interval`, and a last time when it stops. Each write replaces the file
// atomically: the text goes to "<path>.tmp.<pid>" in the same directory, which is then
// renamed over `path`, so a reader sees the old file or the new one, never a part. A
// write that fails logs one WARN (subsystem NET, once per path) and the thread carries
// on. `registry` must outlive the exporter. Only one exporter per path in a process.
class Exporter {
 public:
  Exporter(const Registry& registry, std::string path, std::chrono::milliseconds interval, Labels labels);
  ~Exporter();  // stop()
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  // Wakes the thread, which writes once more and ends; joins it. Returns as soon as that
  // write is done. Idempotent; safe from several threads.
  void stop();
  const std::string& path() const { return path_; }
  // Writes that succeeded and failed so far.
  uint64_t writes() const;
  uint64_t failures() const;

 private:
  void run();
  bool write_once();

  const Registry& registry_;
  const std::string path_;
  const std::chrono::milliseconds interval_;
  const Labels labels_;
  std::mutex join_mutex_;  // two threads calling stop() must not both join
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  uint64_t writes_ = 0;
  uint64_t failures_ = 0;
  std::thread thread_;
};

// Writes `text` to `path` atomically as Exporter does. Returns "" or what failed, naming
// the file and the error.
std::string write_file_atomically(const std::string& path, const std::string& text);

}  // namespace lgreco::net
