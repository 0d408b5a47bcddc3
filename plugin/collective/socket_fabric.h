// SocketFabric: the Fabric for ranks that are processes (or threads, in tests), over the
// TCP transport (plugin/transport/tcp_transport.h). What lgreco-bench and the tests use
// where there is no NCCL; also the reference the NCCL fabric is checked against.
//
// Creation is collective: every rank calls SocketFabric::create with the same world
// size and rendezvous address, in any order, within the timeout.
//
//   1. Rendezvous at torchrun's MASTER_ADDR and the rendezvous port (MASTER_PORT; see
//      SocketFabricOptions::from_env for torchrun's agent store and
//      LGRECO_RENDEZVOUS_PORT). Rank 0 listens on that port on every address of
//      MASTER_ADDR's family (the name may resolve to a loopback alias on rank 0's own
//      host), draws a random communicator id, and tells it to each rank that connects;
//      each rank opens a transport listener for that communicator, on the address it
//      reached rank 0 from, and sends its ListenHandle; once all have, rank 0 opens its
//      own listener on the address the joiners reached it at, answers every rank with
//      the table of all handles and closes the rendezvous listener. Ranks that start
//      before rank 0 retry with backoff. Connections that are not ranks (port scanners)
//      are dropped after the handshake timeout and hold up nobody.
//   2. Full mesh: every rank connects to every other rank's listener (a send comm per
//      peer) and accepts a connection from each (a recv comm per peer); the transport's
//      handshake checks communicator and ranks. Every waiting connection is accepted at
//      once and the handshakes run side by side, so a silent stray does not stall the
//      ranks behind it. The data listeners close afterwards. A failing accept() itself
//      (out of file descriptors) ends creation at once with the errno.
//
// Operations post every receive and send they need and drive them together with poll(),
// so that no rank sends everything before receiving (which deadlocks on messages larger
// than the socket buffers). Every message carries the operation's sequence number as
// its tag, so ranks that disagree on the sequence of calls get an error, not garbage.
//
// Errors: a peer that moves no bytes for `timeout` while this rank waits for it, a closed
// connection (a dead peer is seen at once), or a byte count the peer disagrees with
// throws FabricError naming the operation, the peer and the likely cause. The fabric is
// then broken: it closes its connections (so that the peers fail at once too, instead
// of waiting out their timeout) and every later call throws. So does an argument the
// transport rejects in the middle of an operation (its message is kept).
//
// One thread at a time may call the operations; counters(), peer_traffic(), broken() and
// abort() may be called from any thread. abort() from another thread while an operation
// runs shuts every socket down (it closes nothing under the operating thread's feet);
// the operation then ends with FabricError at once and closes the connections itself.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "plugin/collective/fabric.h"
#include "plugin/transport/tcp_transport.h"

namespace lgreco::collective {

struct SocketFabricOptions {
  // How long any wait may last: connecting at rendezvous, waiting for the other ranks,
  // and, in an operation, a peer that moves no bytes.
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

  int rank = 0;
  int world_size = 1;
  std::string master_host = "127.0.0.1";  // rank 0's rendezvous address (a name or a numeric address)
  uint16_t master_port = 29500;           // the rendezvous port (not always MASTER_PORT: see from_env)
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // How long a connection to a rank's listener may take to identify itself (the
  // transport's handshake) before it is dropped as a stray; at most `timeout`.
  std::chrono::milliseconds handshake_timeout = transport::kDefaultHandshakeTimeout;

  // As torchrun sets them: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; the timeout from
  // LGRECO_TIMEOUT. The rendezvous port is
  //  - LGRECO_RENDEZVOUS_PORT when set (1..65535, the same on every rank);
  //  - else MASTER_PORT + 1 when TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent
  //    keeps its TCPStore on MASTER_PORT for the whole job (logged at INFO);
  //  - else MASTER_PORT.
  // Throws std::invalid_argument naming a variable that is missing or invalid.
  static SocketFabricOptions from_env();
};

// Traffic with one peer (the transport's counters of both directions), for telemetry.
struct PeerTraffic {
  int rank = -1;
  transport::CommCounters sent;
  transport::CommCounters received;
};

class SocketFabric final : public Fabric {
 public:
  // Rendezvous and full mesh (see above). Throws std::invalid_argument for impossible
  // options and FabricError when the other ranks cannot be reached within the timeout.
  static std::unique_ptr<SocketFabric> create(const SocketFabricOptions& options);
  ~SocketFabric() override;

  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  std::string name() const override { return "socket"; }

  void all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                    std::span<const uint64_t> recv_bytes) override;
  void all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) override;
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;

  FabricCounters counters() const override;
  // Any thread, at any time (see above). Never throws; idempotent.
  void abort(const std::string& why) override;

  // The communicator id rank 0 drew (the same on every rank).
  uint64_t comm_id() const { return comm_id_; }
  // One entry per other rank, in rank order.
  std::vector<PeerTraffic> peer_traffic() const;
  // Whether an error has broken the fabric (every call now throws).
  bool broken() const;

 private:
  struct Peer {
    std::unique_ptr<transport::SendComm> send;
    std::unique_ptr<transport::RecvComm> recv;
  };
  // One message of an operation: a send to or a receive from `peer`.
  struct Transfer {
    int peer = 0;
    bool is_send = false;
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
    transport::Request* request = nullptr;
    bool done = false;
  };
  class Operation;  // one call's bookkeeping: refusal when broken, call count, busy time

  SocketFabric(const SocketFabricOptions& options, uint64_t comm_id, std::vector<Peer> peers);

  // Posts every transfer and drives them all to completion, or throws FabricError
  // (whatever the transport throws included: the fabric is then broken).
  void exchange(const char* op, std::vector<Transfer>& transfers);
  void drive(const char* op, std::vector<Transfer>& transfers);
  template <typename T>
  void reduce_sum(std::span<T> data, const char* op);
  [[noreturn]] void fail(const char* op, const std::string& detail);
  // An operation starts (throws FabricError on a broken fabric) and ends.
  void begin_operation(const char* op);
  void end_operation(double seconds);
  std::vector<PeerTraffic> traffic_locked() const;

  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  const uint64_t comm_id_;
  std::vector<Peer> peers_;  // indexed by rank; this rank's entry stays empty
  int32_t next_tag_ = 0;

  // When each peer last moved a byte, during an exchange (indexed by rank).
  struct Watch {
    uint64_t seen = 0;  // wire bytes of both directions
    std::chrono::steady_clock::time_point last;
  };

  // Reused between calls, so that steady-state operations allocate nothing.
  std::vector<Transfer> transfers_;
  std::vector<uint8_t> scratch_;
  std::vector<uint64_t> send_offsets_, recv_offsets_;
  std::vector<Watch> watch_;
  std::vector<struct pollfd> pollfds_;

  // Set by abort() from another thread during an operation; the operation checks it.
  std::atomic<bool> abort_requested_{false};

  // Guards what other threads may read (counters, traffic, broken state), every change
  // to peers_, and in_operation_. peers_ changes only while no operation runs, or on the
  // operating thread itself, so an operation reads it without the lock.
  mutable std::mutex mutex_;
  bool in_operation_ = false;
  FabricCounters counters_;
  std::string broken_reason_;
  std::string abort_reason_;                // abort()'s `why`, when it broke the fabric
  std::vector<PeerTraffic> final_traffic_;  // peer_traffic() once the connections are closed
};

}  // namespace lgreco::collective
