#include "plugin/net/net_plugin.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <utility>

#include "config/log.h"
#include "plugin/net/telemetry.h"

namespace lgreco::net {
namespace {

using abi::Result;
using transport::Progress;

// First member of every object handed to NCCL: a stale or foreign pointer is caught.
constexpr uint64_t kListenMagic = 0x4e4c4c4e45545247;   // "GRTENLLN"-ish tags, distinct per kind
constexpr uint64_t kSendMagic = 0x444e45534e455447;
constexpr uint64_t kRecvMagic = 0x564345524e455447;
constexpr uint64_t kRequestMagic = 0x5145524e45545247;
// After close: a use after close says so instead of reading freed memory's old magic.
constexpr uint64_t kClosedMagic = 0x44455345544f4c43;

// regMr hands out this address: TCP needs no registration, but NCCL keeps the handle and
// passes it back with every isend/irecv, and some NCCL paths treat NULL as "not
// registered".
char g_memory_handle_marker;

struct RequestSlot {
  uint64_t magic = 0;  // kRequestMagic while NCCL holds it
  bool is_send = false;
  void* comm = nullptr;  // the SendObject or RecvObject
  transport::Request* request = nullptr;
  int buffers = 0;
};

template <typename Comm>
struct CommObject {
  uint64_t magic;
  std::unique_ptr<Comm> comm;
  RequestSlot slots[transport::kMaxRequests];
  bool error_logged = false;
  Registry* telemetry = nullptr;
  Registry::Token telemetry_token = 0;

  ~CommObject() {
    if (telemetry) telemetry->unregister(telemetry_token);
  }

  RequestSlot* free_slot() {
    for (RequestSlot& slot : slots)
      if (slot.magic == 0) return &slot;
    return nullptr;
  }
};
using SendObject = CommObject<transport::SendComm>;
using RecvObject = CommObject<transport::RecvComm>;

struct ListenObject {
  uint64_t magic = kListenMagic;
  int dev = 0;
  std::unique_ptr<transport::Listener> listener;
  // Accepts in progress, oldest first: at most one waits for a connection, the others
  // are handshaking with a connection they took. Several side by side keep a peer that
  // opens a connection and then stays silent from delaying the one NCCL expects.
  std::vector<std::unique_ptr<transport::PendingAccept>> pending;
  int refused = 0;  // connections that failed their handshake

  // Whether an accept in progress still waits for a connection (has taken none).
  bool one_waits() const {
    return std::any_of(pending.begin(), pending.end(), [](const auto& p) {
      return p->stage() == transport::PendingAccept::Stage::kWaitingForConnection;
    });
  }
};

template <typename T>
T* checked(void* object, uint64_t magic) {
  if (!object) return nullptr;
  T* typed = static_cast<T*>(object);
  return typed->magic == magic ? typed : nullptr;
}

// Telemetry counts per peer host: the peer's port changes with every connection, and
// NCCL makes new connections for every communicator.
std::string peer_host(const std::string& peer_name) {
  const size_t colon = peer_name.rfind(':');
  if (colon == std::string::npos || colon + 1 == peer_name.size()) return peer_name;
  for (size_t i = colon + 1; i < peer_name.size(); ++i)
    if (peer_name[i] < '0' || peer_name[i] > '9') return peer_name;
  return peer_name.substr(0, colon);
}

template <typename Object>
void count_traffic(Object* object, Registry* telemetry, Direction direction, const std::string& device) {
  if (!telemetry) return;
  auto* comm = object->comm.get();
  object->telemetry = telemetry;
  object->telemetry_token = telemetry->register_source(PeerKey{peer_host(comm->peer_name()), direction, device},
                                                       [comm] { return comm->counters(); });
}

Result invalid(const char* call, const char* what) {
  LGRECO_WARN("NET", "%s: %s", call, what);
  return nccl::kInvalidArgument;
}

}  // namespace

struct NetPlugin::PendingConnectEntry {
  // What the connect was started for. NCCL passes the same handle buffer on every call of
  // one connect, but frees it when it abandons the connect (an aborted communicator), and
  // a later connect may get a buffer at the same address: only equal bytes continue.
  transport::ListenHandle handle;
  int dev = 0;
  uint64_t comm_id = 0;
  uint64_t started = 0;  // order of starting, to drop the oldest abandoned connects first
  std::unique_ptr<transport::PendingConnect> pending;

  bool same_connect(const transport::ListenHandle& other, int other_dev, uint64_t other_comm_id) const {
    return dev == other_dev && comm_id == other_comm_id && std::memcmp(&handle, &other, sizeof handle) == 0;
  }
};

NetPlugin::NetPlugin(Options options) : options_(std::move(options)) {
  if (const std::string why = transport::check_options(connection_options(options_.sockets_per_connection),
                                                       options_.sockets_per_connection);
      !why.empty())
    throw std::invalid_argument("NetPlugin: " + why);
}

NetPlugin::~NetPlugin() = default;

transport::ConnectionOptions NetPlugin::connection_options(int sockets) const {
  transport::ConnectionOptions options;
  options.sockets = sockets;
  options.helper_threads = std::min(options_.helper_threads, sockets);
  return options;
}

Result NetPlugin::properties(int dev, abi::Properties_v11* props) const {
  if (!props) return invalid("getProperties", "null properties");
  if (dev < 0 || dev >= device_count()) {
    LGRECO_WARN("NET", "getProperties: device %d does not exist (lgreco offers %d)", dev, device_count());
    return nccl::kInvalidArgument;
  }
  const Device& d = options_.devices[dev];
  *props = abi::Properties_v11{};
  // NCCL keeps these pointers: they point into options_, which lives as long as the
  // plugin (the process, in the exported tables).
  props->name = const_cast<char*>(d.name.c_str());
  props->pciPath = d.pci_path.empty() ? nullptr : const_cast<char*>(d.pci_path.c_str());
  props->guid = d.guid;
  props->ptrSupport = abi::kPtrHost;
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  props->speed = d.speed_mbps;
  props->port = 0;
  props->latency = 0;
  props->maxComms = 65536;
  // One buffer per receive, as NCCL's own socket transport. With more, NCCL shares one
  // connection among several local ranks' sends (PXN) and posts their steps as grouped
  // receives; a sender may then run a step ahead of another, and over TCP its message
  // would wait in front of the one the receiver needs (head-of-line blocking: a hang).
  // NCCL's IB transport avoids that by letting the receiver clear each send; this
  // transport has no such receiver-driven flow control yet. irecv still takes up to
  // kMaxRecvs buffers.
  props->maxRecvs = 1;
  props->netDeviceType = abi::kDeviceHost;
  props->netDeviceVersion = abi::kDeviceInvalidVersion;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  props->maxP2pBytes = kMaxMessageBytes;
  props->maxCollBytes = kMaxMessageBytes;
  props->maxMultiRequestSize = 1;
  return nccl::kSuccess;
}

Result NetPlugin::listen(uint64_t comm_id, int dev, void* handle, void** listen_comm) {
  if (!handle || !listen_comm) return invalid("listen", "null handle or listenComm");
  *listen_comm = nullptr;
  if (dev < 0 || dev >= device_count()) {
    LGRECO_WARN("NET", "listen: device %d does not exist (lgreco offers %d)", dev, device_count());
    return nccl::kInvalidArgument;
  }
  transport::SocketAddress address = options_.devices[dev].address;
  address.set_port(0);
  auto object = std::make_unique<ListenObject>();
  object->dev = dev;
  try {
    object->listener = transport::listen(address, transport::Identity{comm_id, transport::kUnknownRank},
                                         connection_options(options_.sockets_per_connection));
  } catch (const transport::TransportError& e) {
    LGRECO_WARN("NET", "listen on %s (%s): %s", options_.devices[dev].name.c_str(), address.str().c_str(), e.what());
    return nccl::kSystemError;
  }
  std::memset(handle, 0, abi::kHandleMaxBytes);
  std::memcpy(handle, &object->listener->handle(), sizeof(transport::ListenHandle));
  LGRECO_TRACE("NET", "listening on %s (%s)", object->listener->address().str().c_str(),
               options_.devices[dev].name.c_str());
  *listen_comm = object.release();
  return nccl::kSuccess;
}

Result NetPlugin::connect(uint64_t comm_id, int dev, void* handle, void** send_comm) {
  if (!handle || !send_comm) return invalid("connect", "null handle or sendComm");
  *send_comm = nullptr;
  if (dev < 0 || dev >= device_count()) {
    LGRECO_WARN("NET", "connect: device %d does not exist (lgreco offers %d)", dev, device_count());
    return nccl::kInvalidArgument;
  }
  // The handle crossed NCCL's bootstrap from another process: check it before use.
  transport::ListenHandle listen_handle;
  std::memcpy(&listen_handle, handle, sizeof listen_handle);
  // Shared: another thread's connect may drop an entry (as abandoned) while this one steps it.
  std::shared_ptr<PendingConnectEntry> entry;
  std::shared_ptr<PendingConnectEntry> abandoned;  // destroyed outside the lock
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = pending_connects_.find(handle);
    if (found != pending_connects_.end()) {
      if (found->second->same_connect(listen_handle, dev, comm_id)) {
        entry = found->second;
      } else {
        abandoned = std::move(found->second);
        pending_connects_.erase(found);
      }
    }
  }
  if (abandoned)
    LGRECO_INFO("NET", "connect: dropping an abandoned connect to %s (NCCL reused its handle buffer for another)",
                transport::handle_address(abandoned->handle).c_str());
  abandoned.reset();
  if (!entry) {
    if (std::string why = transport::check_handle(listen_handle); !why.empty()) {
      LGRECO_WARN("NET", "connect: the handle NCCL passed is not a usable lgreco handle: %s (a peer with another "
                  "lgreco version or another net plugin?)", why.c_str());
      return nccl::kInvalidUsage;
    }
    auto created = std::make_shared<PendingConnectEntry>();
    created->handle = listen_handle;
    created->dev = dev;
    created->comm_id = comm_id;
    try {
      // The listener decides the socket count; this side's threads cannot exceed it.
      created->pending = transport::connect(listen_handle, transport::Identity{comm_id, transport::kUnknownRank},
                                            connection_options(listen_handle.socket_count),
                                            options_.handshake_timeout);
    } catch (const transport::TransportError& e) {
      LGRECO_WARN("NET", "connect to %s: %s", transport::handle_address(listen_handle).c_str(), e.what());
      return nccl::kSystemError;
    }
    entry = created;
    std::lock_guard<std::mutex> lock(mutex_);
    created->started = next_connect_++;
    pending_connects_[handle] = std::move(created);
    // Connects NCCL gave up on stay until their buffer is reused; bound how many.
    while (pending_connects_.size() > kMaxPendingConnects) {
      auto oldest = std::min_element(pending_connects_.begin(), pending_connects_.end(), [](const auto& a, const auto& b) {
        return a.second->started < b.second->started;
      });
      abandoned = std::move(oldest->second);
      pending_connects_.erase(oldest);
    }
  }
  abandoned.reset();
  // NCCL calls connect for one handle from one thread: stepping needs no lock.
  const Progress progress = entry->pending->step();
  if (progress == Progress::kPending) return nccl::kSuccess;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = pending_connects_.find(handle);
    if (found != pending_connects_.end() && found->second == entry) pending_connects_.erase(found);
  }
  if (progress == Progress::kError) {
    LGRECO_WARN("NET", "connect on %s: %s", options_.devices[dev].name.c_str(), entry->pending->error().c_str());
    // A host out of descriptors or ports fails every connect; a peer's failure is remote.
    return entry->pending->local_error() != 0 ? nccl::kSystemError : nccl::kRemoteError;
  }
  auto object = std::make_unique<SendObject>();
  object->magic = kSendMagic;
  object->comm = entry->pending->take();
  count_traffic(object.get(), options_.telemetry, Direction::kSend, options_.devices[dev].name);
  LGRECO_INFO("NET", "connected to %s over %s", object->comm->peer_name().c_str(), options_.devices[dev].name.c_str());
  *send_comm = object.release();
  return nccl::kSuccess;
}

size_t NetPlugin::pending_connects() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_connects_.size();
}

Result NetPlugin::accept(void* listen_comm, void** recv_comm) {
  if (!recv_comm) return invalid("accept", "null recvComm");
  *recv_comm = nullptr;
  ListenObject* listen = checked<ListenObject>(listen_comm, kListenMagic);
  if (!listen) return invalid("accept", "not an lgreco listen comm (closed, or another plugin's)");
  // Each call steps every accept in progress; a failed handshake makes room for the next
  // at once. The bound keeps one call short when a flood of bad connections is waiting.
  std::vector<std::unique_ptr<transport::PendingAccept>>& pending = listen->pending;
  for (int round = 0; round < 64; ++round) {
    if (!listen->one_waits() && pending.size() < kMaxAcceptsInProgress) {
      try {
        pending.push_back(listen->listener->accept(connection_options(listen->listener->handle().socket_count),
                                                   accept_handshake_timeout()));
      } catch (const std::exception& e) {  // options the listener's handle cannot take
        LGRECO_WARN("NET", "accept on %s: %s", listen->listener->address().str().c_str(), e.what());
        return nccl::kInternalError;
      }
    }
    bool refused_one = false;
    for (size_t i = 0; i < pending.size(); ++i) {
      transport::PendingAccept& accepting = *pending[i];
      const Progress progress = accepting.step();
      if (progress == Progress::kPending) continue;
      if (progress == Progress::kDone) {
        auto object = std::make_unique<RecvObject>();
        object->magic = kRecvMagic;
        object->comm = accepting.take();
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        count_traffic(object.get(), options_.telemetry, Direction::kRecv, options_.devices[listen->dev].name);
        LGRECO_INFO("NET", "accepted %s on %s", object->comm->peer_name().c_str(),
                    options_.devices[listen->dev].name.c_str());
        *recv_comm = object.release();
        return nccl::kSuccess;
      }
      const int accept_errno = accepting.accept_error();
      const std::string error = accepting.error();
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      --i;
      if (accept_errno != 0) {  // this process's problem (EMFILE, ...): it would fail again
        LGRECO_WARN("NET", "accept on %s: %s", listen->listener->address().str().c_str(), error.c_str());
        return nccl::kSystemError;
      }
      // Not our peer (a scanner, another job, a truncated or forged hello): refuse it and
      // keep waiting for the one NCCL expects. Logged in full for the first few only.
      refused_one = true;
      ++listen->refused;
      if (listen->refused <= 8)
        LGRECO_WARN("NET", "accept on %s: refused a connection: %s; still waiting for the peer",
                    listen->listener->address().str().c_str(), error.c_str());
      else
        LGRECO_INFO("NET", "accept on %s: refused connection %d: %s", listen->listener->address().str().c_str(),
                    listen->refused, error.c_str());
    }
    // Go round again only when a new accept may find work: a waiting one took a connection
    // (none waits now, and there is room) or a refusal made room.
    if (!refused_one && (listen->one_waits() || pending.size() >= kMaxAcceptsInProgress)) break;
  }
  return nccl::kSuccess;
}

Result NetPlugin::reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  if (!mhandle) return invalid("regMr", "null mhandle");
  *mhandle = nullptr;
  if (!checked<SendObject>(comm, kSendMagic) && !checked<RecvObject>(comm, kRecvMagic))
    return invalid("regMr", "not an lgreco send or receive comm");
  if (type != abi::kPtrHost) {
    LGRECO_WARN("NET", "regMr of %zu bytes at %p: memory type %d; lgreco's TCP transport takes host memory only "
                "(NCCL_PTR_HOST, as its properties say)", size, data, type);
    return nccl::kInvalidArgument;
  }
  *mhandle = &g_memory_handle_marker;
  return nccl::kSuccess;
}

Result NetPlugin::dereg_mr(void* comm, void* mhandle) {
  if (!checked<SendObject>(comm, kSendMagic) && !checked<RecvObject>(comm, kRecvMagic))
    return invalid("deregMr", "not an lgreco send or receive comm");
  if (mhandle != &g_memory_handle_marker) return invalid("deregMr", "not a handle from lgreco's regMr");
  return nccl::kSuccess;
}

namespace {

// A failed connection: one WARN per comm (NCCL calls test again and again meanwhile).
template <typename Object>
Result connection_failed(Object* object, const char* call, const std::string& error) {
  if (!object->error_logged) {
    object->error_logged = true;
    LGRECO_WARN("NET", "%s: connection to %s failed: %s", call, object->comm->peer_name().c_str(), error.c_str());
  }
  return nccl::kRemoteError;
}

}  // namespace

Result NetPlugin::isend(void* send_comm, void* data, size_t size, int tag, void** request) {
  if (!request) return invalid("isend", "null request");
  *request = nullptr;
  SendObject* object = checked<SendObject>(send_comm, kSendMagic);
  if (!object) return invalid("isend", "not an lgreco send comm (closed, or another plugin's)");
  if (size > kMaxMessageBytes) {
    LGRECO_WARN("NET", "isend to %s: %zu bytes; lgreco's properties allow at most %llu per message",
                object->comm->peer_name().c_str(), size, static_cast<unsigned long long>(kMaxMessageBytes));
    return nccl::kInvalidArgument;
  }
  RequestSlot* slot = object->free_slot();
  if (!slot) return nccl::kSuccess;  // busy: NCCL calls again
  try {
    transport::Request* posted = object->comm->isend(data, size, tag);
    if (!posted) return nccl::kSuccess;
    *slot = RequestSlot{kRequestMagic, true, object, posted, 1};
    *request = slot;
    return nccl::kSuccess;
  } catch (const transport::TransportError& e) {
    return connection_failed(object, "isend", e.what());
  } catch (const std::invalid_argument& e) {
    return invalid("isend", e.what());
  }
}

Result NetPlugin::irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags, void** request) {
  if (!request) return invalid("irecv", "null request");
  *request = nullptr;
  RecvObject* object = checked<RecvObject>(recv_comm, kRecvMagic);
  if (!object) return invalid("irecv", "not an lgreco receive comm (closed, or another plugin's)");
  if (n < 1 || n > transport::kMaxRecvs || !sizes) {
    LGRECO_WARN("NET", "irecv from %s: %d buffers; lgreco's properties allow 1 to %d (maxRecvs)",
                object->comm->peer_name().c_str(), n, transport::kMaxRecvs);
    return nccl::kInvalidArgument;
  }
  uint64_t sizes64[transport::kMaxRecvs];
  for (int i = 0; i < n; ++i) sizes64[i] = std::min<uint64_t>(sizes[i], kMaxMessageBytes);
  RequestSlot* slot = object->free_slot();
  if (!slot) return nccl::kSuccess;
  try {
    transport::Request* posted = object->comm->irecv(n, data, sizes64, tags);
    if (!posted) return nccl::kSuccess;
    *slot = RequestSlot{kRequestMagic, false, object, posted, n};
    *request = slot;
    return nccl::kSuccess;
  } catch (const transport::TransportError& e) {
    return connection_failed(object, "irecv", e.what());
  } catch (const std::invalid_argument& e) {
    return invalid("irecv", e.what());
  }
}

Result NetPlugin::iflush(void* recv_comm, void** request) {
  if (!request) return invalid("iflush", "null request");
  *request = nullptr;  // host memory: nothing to flush
  if (!checked<RecvObject>(recv_comm, kRecvMagic)) return invalid("iflush", "not an lgreco receive comm");
  return nccl::kSuccess;
}

Result NetPlugin::test(void* request, int* done, int* sizes) {
  if (!done) return invalid("test", "null done");
  *done = 0;
  RequestSlot* slot = checked<RequestSlot>(request, kRequestMagic);
  if (!slot) return invalid("test", "not a request in flight (completed already, or another plugin's)");
  bool finished = false;
  if (slot->is_send) {
    auto* object = static_cast<SendObject*>(slot->comm);
    uint64_t size = 0;
    const Progress progress = object->comm->test(slot->request, &finished, &size);
    if (progress == Progress::kError) return connection_failed(object, "test", object->comm->error());
    if (finished && sizes) sizes[0] = static_cast<int>(size);
  } else {
    auto* object = static_cast<RecvObject*>(slot->comm);
    uint64_t sizes64[transport::kMaxRecvs] = {};
    const Progress progress = object->comm->test(slot->request, &finished, sizes64);
    if (progress == Progress::kError) return connection_failed(object, "test", object->comm->error());
    if (finished && sizes)
      for (int i = 0; i < slot->buffers; ++i) sizes[i] = static_cast<int>(sizes64[i]);
  }
  if (finished) {
    *slot = RequestSlot{};  // free for the next isend/irecv
    *done = 1;
  }
  return nccl::kSuccess;
}

Result NetPlugin::close_send(void* send_comm) {
  SendObject* object = checked<SendObject>(send_comm, kSendMagic);
  if (!object) return invalid("closeSend", "not an lgreco send comm (closed twice?)");
  object->magic = kClosedMagic;
  delete object;
  return nccl::kSuccess;
}

Result NetPlugin::close_recv(void* recv_comm) {
  RecvObject* object = checked<RecvObject>(recv_comm, kRecvMagic);
  if (!object) return invalid("closeRecv", "not an lgreco receive comm (closed twice?)");
  object->magic = kClosedMagic;
  delete object;
  return nccl::kSuccess;
}

Result NetPlugin::close_listen(void* listen_comm) {
  ListenObject* object = checked<ListenObject>(listen_comm, kListenMagic);
  if (!object) return invalid("closeListen", "not an lgreco listen comm (closed twice?)");
  object->magic = kClosedMagic;
  object->pending.clear();
  delete object;
  return nccl::kSuccess;
}

}  // namespace lgreco::net
