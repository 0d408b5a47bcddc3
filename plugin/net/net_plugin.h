// NCCL's network-plugin API over lgreco's TCP transport: the logic of every ncclNet call,
// in C++ types, with no global state, so that unit tests drive it directly. The exported
// ncclNetPlugin_v8 .. _v11 tables (plugin/net/exports.cc) are thin adapters onto one
// NetPlugin per process.
//
// How NCCL's proxy uses a net plugin (src/transport/net.cc at v2.28.9-1), and what this
// class does for each step:
//   listen(dev)       receiver: a transport Listener on the device's address; its
//                     ListenHandle (plain bytes) fills NCCL's 128-byte handle, which NCCL
//                     ships to the sender through its bootstrap.
//   connect(handle)   sender, called again and again with the same handle buffer until it
//                     returns a comm: the first call starts a PendingConnect (kept in a
//                     table keyed by the handle's address), each call steps it.
//   accept(listen)    receiver, likewise: steps a PendingAccept. A connection that fails
//                     its handshake (anything that is not an lgreco endpoint of this
//                     communicator, a port scanner, a truncated hello) is logged and a new
//                     accept starts: it must not fail NCCL's accept, whose genuine peer may
//                     still be on its way.
//   regMr             host memory only (ptrSupport = NCCL_PTR_HOST: NCCL stages GPU data in
//                     pinned host buffers for us); nothing to register with TCP.
//   isend/irecv       post on the transport; a NULL request means "busy, call again" as the
//                     API allows (the transport's fixed pool of kMaxRequests is full).
//   test              NCCL's proxy polls it; with helper threads the bytes move without it.
//   iflush            nothing to flush for host memory: request NULL.
//
// Every object handed to NCCL (listen, send and receive comms, requests) begins with a
// magic number checked on every call, so a stale or foreign pointer is an error naming the
// call, not a crash somewhere later. Errors are returned as NCCL's codes and logged once
// with the peer's name: ncclRemoteError when the peer (or the network) failed,
// ncclSystemError for this host's failures, ncclInvalidArgument / ncclInvalidUsage for a
// caller's mistake, ncclInternalError for lgreco's own.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/net/net_abi.h"
#include "plugin/transport/socket.h"
#include "plugin/transport/tcp_transport.h"

namespace lgreco::net {

class Registry;  // telemetry (plugin/net/telemetry.h)

// One network interface offered to NCCL as a device.
struct Device {
  std::string name;                 // "eth0"
  transport::SocketAddress address;  // the interface's address (port 0)
  std::string pci_path;             // /sys/devices/pci0000:00/...; empty for virtual interfaces
  int speed_mbps = 10000;
  uint64_t guid = 0;
};

class NetPlugin {
 public:
  struct Options {
    std::vector<Device> devices;
    // Sockets per connection (advertised in the listen handle) and helper threads per comm
    // (from LGRECO_SOCKET_NTHREADS and LGRECO_NSOCKS_PERTHREAD).
    int sockets_per_connection = 1;
    int helper_threads = 0;
    // How long a connect may take, from the TCP connect to the listener's reply. NCCL calls
    // connect on the sender and accept on the receiver during the same setup phase, so the
    // peer is there within seconds unless a rank died; LGRECO_TIMEOUT. An accepted
    // connection's handshake gets at most kAcceptHandshakeTimeout of it.
    std::chrono::milliseconds handshake_timeout{std::chrono::seconds(300)};
    Registry* telemetry = nullptr;  // per-peer counters; may be null
  };

  explicit NetPlugin(Options options);
  ~NetPlugin();
  NetPlugin(const NetPlugin&) = delete;
  NetPlugin& operator=(const NetPlugin&) = delete;

  int device_count() const { return static_cast<int>(options_.devices.size()); }
  const Device& device(int dev) const { return options_.devices.at(dev); }
  // The v11 properties; older versions copy the fields they have.
  abi::Result properties(int dev, abi::Properties_v11* props) const;

  // `comm_id`: the communicator's hash (v11 init), or 0 for older versions, which do not
  // tell the plugin: then only the listener's random nonce ties a connection to its handle.
  abi::Result listen(uint64_t comm_id, int dev, void* handle, void** listen_comm);
  abi::Result connect(uint64_t comm_id, int dev, void* handle, void** send_comm);
  abi::Result accept(void* listen_comm, void** recv_comm);
  abi::Result reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
  abi::Result dereg_mr(void* comm, void* mhandle);
  abi::Result isend(void* send_comm, void* data, size_t size, int tag, void** request);
  abi::Result irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags, void** request);
  abi::Result iflush(void* recv_comm, void** request);
  // `sizes`: one entry (send) or one per buffer of the receive (may be null).
  abi::Result test(void* request, int* done, int* sizes);
  abi::Result close_send(void* send_comm);
  abi::Result close_recv(void* recv_comm);
  abi::Result close_listen(void* listen_comm);

  // Connects started and not finished (NCCL gave up on them or is still calling).
  size_t pending_connects() const;

  // The largest message one isend or irecv buffer may hold: test() reports sizes as int.
  static constexpr uint64_t kMaxMessageBytes = 0x7fffffffu;

 private:
  struct PendingConnectEntry;
  // Accepts stepped side by side on one listen comm (see ListenObject).
  static constexpr size_t kMaxAcceptsInProgress = 8;
  // A genuine sender writes its hellos as soon as its TCP connects, so an accepted
  // connection that has not completed the handshake within this is not the peer NCCL
  // waits for; closing it frees its slot. Capped by Options::handshake_timeout.
  static constexpr std::chrono::milliseconds kAcceptHandshakeTimeout{std::chrono::seconds(30)};

  // This side's transport options for a connection of `sockets` sockets: the helper
  // threads of Options, at most one per socket.
  transport::ConnectionOptions connection_options(int sockets) const;
  std::chrono::milliseconds accept_handshake_timeout() const {
    return std::min(options_.handshake_timeout, kAcceptHandshakeTimeout);
  }

  // Connects started and not finished that are kept (see connect()); past this the oldest
  // go: NCCL has far fewer in progress at once.
  static constexpr size_t kMaxPendingConnects = 1024;

  Options options_;
  mutable std::mutex mutex_;  // guards pending_connects_ and next_connect_
  std::map<const void*, std::shared_ptr<PendingConnectEntry>> pending_connects_;
  uint64_t next_connect_ = 0;
};

// The plugin's 128-byte handle: the transport's ListenHandle, then zeros.
static_assert(sizeof(transport::ListenHandle) <= abi::kHandleMaxBytes);

}  // namespace lgreco::net
