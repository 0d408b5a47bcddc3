// The TCP transport: lgreco's one way of moving bytes between processes, in the shape of
// NCCL's net API (src/transport/net_socket.cc at v2.28.9-1), so that the net-plugin ABI
// adapter (plugin/net/) is a thin layer over it and the socket fabric
// (plugin/collective/socket_fabric.h) uses the same code.
//
//   receiver                                  sender
//   listener = listen(address, self)
//   ... ships listener->handle() (128 plain bytes) to the sender out of band ...
//                                             pending = connect(handle, self)
//   pending = listener->accept()
//   step() both until kDone                   (never blocks; poll their fd() meanwhile)
//   recv = pending->take()                    send = pending->take()
//   r = recv->irecv(1, data, sizes, tags)     s = send->isend(data, size, tag)
//   recv->test(r, &done, sizes) until done    send->test(s, &done, &size) until done
//
// Connections are one-way, as in NCCL: a SendComm only sends, a RecvComm only receives.
// A handshake on every new connection proves that the peer is an lgreco endpoint of the
// same communicator that read this listener's handle; anything else is refused with a
// message saying what it was.
//
// Messages on a connection arrive in the order they were posted. Each is a 16-byte
// header (payload size, tag, sequence number) and the payload; a receive posted with a
// smaller buffer than the message is an error naming the peer and both sizes. Sizes are
// 64-bit: messages from 0 bytes to many GiB.
//
// Sockets and threads (ConnectionOptions). A listener advertises in its handle how many
// TCP sockets each connection to it has (1 to kMaxSockets); each side chooses its own
// number of helper threads. With one socket a message is its header then its payload on
// that socket. With S > 1 sockets the payload is cut into at most S chunks of at least
// kMinChunkBytes, chunk k on socket k, computed by both sides from the size alone (as
// NCCL's socket transport does); socket 0 carries every header, then chunk 0:
//
//   socket 0:  [hdr m][chunk 0 of m][hdr m+1][chunk 0 of m+1] ...
//   socket 1:  [chunk 1 of m]                [chunk 1 of m+1] ...   (if m has one)
//   socket k:  [chunk k of m] ...
//
// Without helper threads (the default) bytes move when test() is called, by whoever
// calls it (NCCL's proxy thread calls test() in a loop; the socket fabric polls fd() and
// calls test()). With T helper threads, thread t owns sockets t, t+T, ..., moves their
// bytes as soon as they can move (poll() on its sockets and a wake-up eventfd), and
// test() only observes completion. A comm, a listener and a pending connect/accept are
// used by one thread at a time; counters() and error() may be read from any thread.
//
// Receives match per tag across every posted request: an arriving message goes to the
// oldest posted request (in posting order) that has an unclaimed buffer with its tag,
// and requests complete independently. A message whose tag matches no posted buffer is
// not an error: its header is read and its payload stays in the socket until a receive
// with that tag is posted. Messages behind it on the connection wait meanwhile: the
// payloads are one ordered byte stream, and buffering them instead would take unbounded
// memory. That is safe only where the receiver never needs a later message first: NCCL
// with one buffer per receive (the net plugin advertises maxRecvs=1; with grouped
// receives NCCL's shared connections would break this, see net_plugin.cc), and the
// socket fabric, which posts each exchange's receives before it waits.
//
// Every connected socket has TCP keepalive and TCP_USER_TIMEOUT set from
// ConnectionOptions::user_timeout, so that a connection whose peer host vanished fails
// (with an error naming the peer) instead of waiting forever.
//
// Known limits (left for a later issue; read before writing the NCCL net-plugin adapter):
//  - One PendingAccept takes one connection at a time, in backlog order: a connection
//    that says nothing holds it until its handshake deadline (then it fails, with
//    accept_error() == 0), and genuine connectors queued behind may time out meanwhile.
//    The socket fabric runs many accepts side by side; the adapter, which NCCL asks for
//    one accept per connection, should start a new accept() after a peer's failure
//    instead of failing NCCL's accept, and choose its handshake timeouts: a connector's
//    deadline includes the time until the peer calls accept(), which NCCL does not bound.
//  - A message whose tag no posted receive has holds up the messages behind it (above).
//  - With helper threads, fd() and poll_events() say nothing useful (the threads own the
//    sockets): a caller waits by calling test() again.
//  - A rendezvous joiner (socket fabric) that reaches a service which accepts and stays
//    silent (another program on the port) waits for the whole timeout before it fails.
//  - The rendezvous carries no job identity: two jobs on one host with the same port can
//    admit each other's ranks (the second job's rank 0 fails to bind; its other ranks may
//    join the first). A token (TORCHELASTIC_RUN_ID or a parameter) in the join message
//    would refuse them.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "plugin/transport/socket.h"

namespace lgreco::transport {

// NCCL_NET_HANDLE_MAXSIZE: the bytes NCCL reserves for a listen handle.
inline constexpr size_t kHandleMaxBytes = 128;
// Version of the handle layout, the handshake and the message header. Peers of another
// version are refused (mixed lgreco installations in one job).
inline constexpr uint32_t kProtocolVersion = 1;
// Requests one comm can have in flight (NCCL_NET_MAX_REQUESTS).
inline constexpr int kMaxRequests = 32;
// Buffers one grouped irecv may post; each message's tag picks its buffer. (The net
// plugin advertises maxRecvs=1 to NCCL, which then posts one.)
inline constexpr int kMaxRecvs = 8;
// A rank that is not known: NCCL does not tell a net plugin the ranks it connects.
inline constexpr int kUnknownRank = -1;
// The largest message isend accepts; anything bigger is a caller's arithmetic gone wrong
// (a negative count turned unsigned), not a gradient.
inline constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 40;
// How long a handshake may take by default: on the accepting side from taking the
// connection to a complete valid hello (a genuine connector sends it at once), on the
// connecting side from connect() to the listener's reply (which includes the time the
// peer takes to call accept() and step it).
inline constexpr std::chrono::milliseconds kDefaultHandshakeTimeout{5000};
// Sockets one connection may have (NCCL's MAX_SOCKETS).
inline constexpr int kMaxSockets = 64;
// The smallest payload chunk of a message spread over several sockets (NCCL's
// MIN_CHUNKSIZE): smaller messages travel whole on socket 0.
inline constexpr uint64_t kMinChunkBytes = uint64_t{64} << 10;
// How long a connected socket may go without its peer acknowledging data or answering
// keepalive probes before the connection fails (TCP_USER_TIMEOUT).
inline constexpr std::chrono::milliseconds kDefaultUserTimeout{std::chrono::minutes(5)};

// How a connection moves its bytes.
struct ConnectionOptions {
  // TCP sockets per connection, 1 to kMaxSockets. listen() puts it in the handle;
  // connect() and accept() take the handle's (the listener decides), and ignore this.
  int sockets = 1;
  // Helper threads of this side, 0 to `sockets` of the connection: 0 moves bytes in
  // test(); T > 0 threads each own every T-th socket and move bytes by themselves.
  int helper_threads = 0;
  // TCP_USER_TIMEOUT and keepalive (idle time, probe interval, probe count derived from
  // it) on every connected socket; positive.
  std::chrono::milliseconds user_timeout = kDefaultUserTimeout;
};
// Why `options` are unusable ("" if they are): counts out of range, threads without
// sockets to own, a non-positive timeout. `sockets` is the connection's socket count.
std::string check_options(const ConnectionOptions& options, int sockets);

// Who an endpoint is: its communicator (a job-wide random id) and its rank in it.
struct Identity {
  uint64_t comm_id = 0;
  int rank = kUnknownRank;
};

// The bytes on the wire, exposed so that tests can play a misbehaving peer. All fields
// are little-endian.
namespace wire {

// Little-endian field access, so that what goes on the wire does not depend on the host:
// put() appends a field at `out` and advances it, get() reads one and advances `in`.
template <typename T>
void put(uint8_t*& out, T value) {
  using U = std::make_unsigned_t<T>;
  const U bits = static_cast<U>(value);
  for (size_t i = 0; i < sizeof(T); ++i) *out++ = static_cast<uint8_t>(bits >> (8 * i));
}
template <typename T>
T get(const uint8_t*& in) {
  using U = std::make_unsigned_t<T>;
  U bits = 0;
  for (size_t i = 0; i < sizeof(T); ++i) bits = static_cast<U>(bits | static_cast<U>(*in++) << (8 * i));
  return static_cast<T>(bits);
}

// Connector -> listener, first thing on every socket of a connection.
struct Hello {
  uint64_t magic = 0;  // kHelloMagic
  uint32_t version = 0;
  uint16_t socket_index = 0;  // which of socket_count sockets of one connection this is
  uint16_t socket_count = 0;
  uint64_t comm_id = 0;
  uint64_t nonce = 0;  // the listener's, read from its handle
  int32_t from_rank = kUnknownRank;
  int32_t to_rank = kUnknownRank;  // the rank the handle named
  // Random per connection, the same on each of its sockets (0 from a peer that only
  // knows single-socket connections), so that a listener accepting from several senders
  // groups sockets correctly.
  uint64_t connection_id = 0;
};
inline constexpr size_t kHelloBytes = 48;
inline constexpr uint64_t kHelloMagic = 0x4f4c4c4548434752;  // "RGCHELLO"

// Listener -> connector, the answer.
enum class ReplyStatus : uint32_t {
  kAccepted = 0,
  kVersionMismatch = 1,
  kWrongCommunicator = 2,
  kWrongRank = 3,
  kStaleHandle = 4,
  kBadSocketCount = 5,
};
const char* reply_status_name(uint32_t status);
struct Reply {
  uint64_t magic = 0;  // kReplyMagic
  uint32_t version = 0;
  uint32_t status = 0;  // ReplyStatus
  uint64_t comm_id = 0;
  int32_t rank = kUnknownRank;  // the listener's
};
inline constexpr size_t kReplyBytes = 32;
inline constexpr uint64_t kReplyMagic = 0x594c504552434752;  // "RGCREPLY"

// Before every payload.
struct MessageHeader {
  uint64_t size = 0;
  int32_t tag = 0;
  uint32_t sequence = 0;  // per connection, from 0; catches a stream out of step
};
inline constexpr size_t kMessageHeaderBytes = 16;

void encode(const Hello& hello, uint8_t out[kHelloBytes]);
Hello decode_hello(const uint8_t in[kHelloBytes]);
void encode(const Reply& reply, uint8_t out[kReplyBytes]);
Reply decode_reply(const uint8_t in[kReplyBytes]);
void encode(const MessageHeader& header, uint8_t out[kMessageHeaderBytes]);
MessageHeader decode_header(const uint8_t in[kMessageHeaderBytes]);

}  // namespace wire

// A random 64-bit id (never 0) from the operating system's entropy: communicator ids,
// listener nonces.
uint64_t random_id();

// What a receiver publishes so that senders can connect to it. Plain bytes: it is copied
// between processes as is (through NCCL's bootstrap or the fabric's rendezvous), so
// everything in it is checked again before use (check_handle). Host byte order, as NCCL's
// own handles.
struct ListenHandle {
  uint64_t magic;                             // kHandleMagic
  uint32_t version;                           // kProtocolVersion
  uint16_t socket_count;                      // sockets per connection the listener expects
  uint16_t address_length;                    // bytes of `address` in use
  uint64_t comm_id;                           // the listener's communicator
  uint64_t nonce;                             // random per listener: a connection must name it (no stale handles)
  int32_t rank;                               // the listener's rank, or kUnknownRank
  uint32_t reserved;                          // zero
  uint8_t address[SocketAddress::kMaxBytes];  // a sockaddr_in or sockaddr_in6
};
static_assert(sizeof(ListenHandle) <= kHandleMaxBytes, "a ListenHandle must fit NCCL_NET_HANDLE_MAXSIZE");
static_assert(std::is_trivially_copyable_v<ListenHandle> && std::is_standard_layout_v<ListenHandle>,
              "a ListenHandle is copied between processes as plain bytes");

inline constexpr uint64_t kHandleMagic = 0x314c444e48434752;  // "RGCHNDL1" in memory

// Why `handle` cannot be connected to ("" if it can): wrong magic or version, an address
// of a wrong length or family, a socket count out of 1..kMaxSockets.
std::string check_handle(const ListenHandle& handle);
// The handle's address ("(invalid)" when it has none).
std::string handle_address(const ListenHandle& handle);

// What step() and test() report.
enum class Progress { kPending, kDone, kError };

// Traffic on one comm, for telemetry. Bytes count as they move, not when a message ends.
struct CommCounters {
  uint64_t payload_bytes = 0;  // message payloads sent (SendComm) or received (RecvComm)
  uint64_t wire_bytes = 0;     // the same plus message headers: any sign of life
  uint64_t messages = 0;       // completed messages
  // Time during which the payload of some message was moving, as a union over concurrent
  // messages: on a sender from a message's first payload byte written to its last, on a
  // receiver from the moment its header arrived and matched a buffer to its last byte
  // (a message waiting for its receive to be posted does not count). It includes the
  // span still open, so payload_bytes / busy_ns is the achieved bandwidth at any time.
  uint64_t busy_ns = 0;
};

class SendComm;
class RecvComm;
class PendingAccept;
// One posted isend or irecv: a slot of its comm's fixed pool (the data path never
// allocates). Valid from isend/irecv until test() reports it done or failed.
struct Request;

// Listens for connections from senders.
class Listener {
 public:
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  const ListenHandle& handle() const { return handle_; }
  const Identity& identity() const { return self_; }
  const SocketAddress& address() const { return address_; }
  // Readable (POLLIN) when a connection waits to be accepted.
  int fd() const { return fd_.get(); }

  // Starts accepting the next connection. The returned object must not outlive this
  // listener. Several may be pending at once; each takes one connection, and each
  // connection it takes must complete the handshake (send a valid hello and take the
  // reply) within `handshake_timeout`, or it is closed and the PendingAccept fails.
  std::unique_ptr<PendingAccept> accept(std::chrono::milliseconds handshake_timeout = kDefaultHandshakeTimeout);
  // The same with this side's options (helper threads, user timeout; the socket count is
  // the handle's). Throws std::invalid_argument for unusable options.
  std::unique_ptr<PendingAccept> accept(const ConnectionOptions& options,
                                        std::chrono::milliseconds handshake_timeout = kDefaultHandshakeTimeout);

 private:
  friend class PendingAccept;
  friend std::unique_ptr<Listener> listen(const SocketAddress&, const Identity&, const ConnectionOptions&);
  Listener() = default;
  // A socket whose hello was valid but which belongs to a connection another
  // PendingAccept collects (or will): sockets of one connection may be accepted by
  // different PendingAccepts when several senders connect at once.
  struct Parked {
    uint64_t connection_id = 0;
    int index = 0;
    int rank = kUnknownRank;
    Fd fd;
    std::string address;
    std::chrono::steady_clock::time_point deadline;
  };
  Fd fd_;
  Identity self_;
  SocketAddress address_;
  ListenHandle handle_{};
  std::mutex parking_mutex_;
  std::vector<Parked> parked_;          // under parking_mutex_
  std::vector<uint64_t> claimed_;       // connection ids a PendingAccept collects; under parking_mutex_
};

// Listens on `address` (port 0: any free port) as endpoint `self`. The handle names the
// address actually bound; a wildcard address (0.0.0.0) is not something a peer can reach,
// so bind to a concrete interface. Throws TransportError.
std::unique_ptr<Listener> listen(const SocketAddress& address, const Identity& self);
// The same with `options.sockets` sockets per connection (in the handle); the other
// fields are each side's own and given to connect() and accept(). Throws
// std::invalid_argument for a socket count out of range.
std::unique_ptr<Listener> listen(const SocketAddress& address, const Identity& self, const ConnectionOptions& options);

// A connection being made to a listener: non-blocking connect, then the handshake.
class PendingConnect {
 public:
  enum class Stage { kConnecting, kSendingHello, kReceivingReply, kDone, kFailed };

  ~PendingConnect();
  // Moves as far as it can without blocking. kDone once (then take()); kError with error().
  Progress step();
  Stage stage() const { return stage_; }
  const std::string& error() const { return error_; }
  // After kError: the errno when this host could not make a socket or connection
  // (EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL: out of descriptors, memory or
  // ephemeral ports), which no peer can fix; 0 when the failure was the peer's or the
  // network's (refused, unreachable, timed out, closed).
  int local_error() const { return local_error_; }
  // What to poll for before stepping again (-1 and 0 once done or failed): the socket
  // that is furthest behind, when the connection has several.
  int fd() const;
  short poll_events() const;
  // When the handshake times out: step() at or after it fails with a message saying so.
  // Poll no longer than until then.
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  // The connection, once step() reported kDone; nullptr otherwise or a second time.
  std::unique_ptr<SendComm> take();

 private:
  friend std::unique_ptr<PendingConnect> connect(const ListenHandle&, const Identity&, const ConnectionOptions&,
                                                 std::chrono::milliseconds);
  PendingConnect() = default;
  // One socket of the connection and how far its handshake is.
  struct Link {
    Fd fd;
    Stage stage = Stage::kConnecting;
    uint8_t hello[wire::kHelloBytes] = {};
    uint8_t reply[wire::kReplyBytes] = {};
    size_t offset = 0;
  };
  Progress advance();  // step() without the deadline
  Progress advance(Link& link);
  Progress fail(std::string message);
  Progress check_reply(Link& link);
  const Link* behind() const;  // the least advanced link

  Stage stage_ = Stage::kConnecting;
  std::chrono::milliseconds timeout_{0};
  std::chrono::steady_clock::time_point deadline_;
  std::vector<Link> links_;
  ConnectionOptions options_;
  Identity self_;
  ListenHandle handle_{};
  std::string peer_name_;  // "rank 3 at 10.0.0.2:41234", for every message about this peer
  std::string error_;
  int local_error_ = 0;
  std::unique_ptr<SendComm> comm_;
};

// Connects endpoint `self` to the listener that published `handle`. Does not block: the
// connection is made by step(), which fails unless the TCP connection, the hello and the
// listener's reply are all done within `timeout` (a listener host that drops packets, a
// listener that never accepts, or one that never answers). Throws TransportError when the
// handle is unusable or names another communicator (self.comm_id); a refused connection
// is reported by step().
std::unique_ptr<PendingConnect> connect(const ListenHandle& handle, const Identity& self,
                                        std::chrono::milliseconds timeout = kDefaultHandshakeTimeout);
// The same with this side's options (helper threads, user timeout; the socket count is
// the handle's). Throws std::invalid_argument for unusable options.
std::unique_ptr<PendingConnect> connect(const ListenHandle& handle, const Identity& self,
                                        const ConnectionOptions& options,
                                        std::chrono::milliseconds timeout = kDefaultHandshakeTimeout);

// A connection being accepted: waiting for a sender, then the handshake. A connection
// that is not an lgreco endpoint of this communicator, or that does not complete the
// handshake within the listener's handshake timeout, fails this object (the listener
// stays usable: start another accept()). So does a failure of accept() itself
// (accept_error() says which).
class PendingAccept {
 public:
  enum class Stage { kWaitingForConnection, kReceivingHello, kSendingReply, kDone, kFailed };

  ~PendingAccept();
  Progress step();
  Stage stage() const { return stage_; }
  const std::string& error() const { return error_; }
  // After kError: the errno of a failed accept() call (EMFILE, ENFILE, ENOBUFS, ...),
  // which is this process's problem and fails every later accept() too; 0 when the
  // failure was the peer's (refused, closed, or too slow).
  int accept_error() const { return accept_error_; }
  int fd() const;
  short poll_events() const;
  // While handshaking: when the handshake times out (step() at or after it fails);
  // time_point::max() while waiting for a connection, which may take any time.
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  std::unique_ptr<RecvComm> take();

 private:
  friend class Listener;
  PendingAccept(Listener* listener, const ConnectionOptions& options, std::chrono::milliseconds handshake_timeout)
      : listener_(listener), options_(options), timeout_(handshake_timeout) {}
  // One collected socket of the connection.
  struct Link {
    Fd fd;
    size_t offset = 0;  // of the reply sent on it
  };
  Progress advance();  // step() without the deadline
  Progress collect();  // kReceivingHello: reads hellos until every socket is there
  Progress fail(std::string message);
  Progress refuse(uint32_t reason, std::string message);
  Progress check_hello(wire::Hello* hello);
  void adopt(uint64_t connection_id);           // claims it (parking_mutex_ held)
  void add_link(int index, Fd fd);
  void take_parked();                           // this connection's sockets the listener parked
  void park(const wire::Hello& hello, Fd fd);   // a socket of another connection
  void release();                               // gives the connection id and its sockets up
  int collected() const;

  Listener* listener_;
  const ConnectionOptions options_;
  const std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  int accept_error_ = 0;
  Stage stage_ = Stage::kWaitingForConnection;
  Fd fd_;  // the socket whose hello is being read
  std::string peer_address_;
  int peer_rank_ = kUnknownRank;
  uint64_t connection_id_ = 0;  // 0 until the first socket's hello is read
  std::vector<Link> links_;     // by socket index; fd invalid until collected
  uint8_t hello_[wire::kHelloBytes] = {};
  uint8_t reply_[wire::kReplyBytes] = {};
  size_t offset_ = 0;
  std::string error_;
  std::unique_ptr<RecvComm> comm_;
};

class Connection;  // what SendComm and RecvComm share (tcp_transport.cc)

// The sending end of a connection.
class SendComm {
 public:
  ~SendComm();
  SendComm(const SendComm&) = delete;
  SendComm& operator=(const SendComm&) = delete;

  // Posts one message of `size` bytes (0 allowed) from `data`, which must stay valid and
  // unchanged until test() reports the request done. nullptr when kMaxRequests requests
  // are in flight: test() some and post again. Throws TransportError on a failed comm and
  // std::invalid_argument for a null `data` with size > 0 or size > kMaxMessageBytes.
  Request* isend(const void* data, uint64_t size, int tag);
  // Moves bytes of every posted message in order (without helper threads; with them it
  // only looks). *done once `request` has been sent
  // entirely (its slot is then free again; *size, if given, is its size). kError: the
  // connection failed (error() says why) and every request with it. Throws
  // std::invalid_argument for a request that is not in flight on this comm.
  Progress test(Request* request, bool* done, uint64_t* size);

  int peer_rank() const;
  // "rank 3 at 10.0.0.2:41234" (or "10.0.0.2:41234" when the rank is unknown).
  const std::string& peer_name() const;
  // Without helper threads: the socket to poll (the first that waits), and for what.
  // With helper threads: socket 0, and 0 (the threads move the bytes).
  int fd() const;
  // From any thread, even while another uses this comm: shuts every socket of the
  // connection down, so that its poll wakes and its transfers fail at once and the peer
  // sees the connection closed. The comm is unusable after it.
  void shutdown() const;
  short poll_events() const;  // POLLOUT while messages wait to be sent, else 0
  CommCounters counters() const;
  const std::string& error() const;  // empty unless the connection failed
  int sockets() const;
  int helper_threads() const;

 private:
  friend class PendingConnect;
  explicit SendComm(std::unique_ptr<Connection> connection);
  std::unique_ptr<Connection> connection_;
};

// The receiving end of a connection.
class RecvComm {
 public:
  ~RecvComm();
  RecvComm(const RecvComm&) = delete;
  RecvComm& operator=(const RecvComm&) = delete;

  // Posts a receive of `n` messages (1..kMaxRecvs) into data[i] (room for sizes[i] bytes),
  // one per tag: each arriving message goes to the oldest posted request with an
  // unclaimed buffer of its tag (in posting order, then buffer order); a message whose
  // tag matches none waits for such a receive (see the top of this file). A message may
  // be smaller than its buffer (test() reports its size), not larger (an error naming
  // both sizes). nullptr when kMaxRequests requests are in flight. The arrays are copied.
  Request* irecv(int n, void* const* data, const uint64_t* sizes, const int* tags);
  // As SendComm::test; `sizes` (n entries, may be null) gets each message's size.
  Progress test(Request* request, bool* done, uint64_t* sizes);

  int peer_rank() const;
  const std::string& peer_name() const;
  int fd() const;
  void shutdown() const;  // as SendComm::shutdown
  short poll_events() const;  // POLLIN while receives are posted, else 0
  CommCounters counters() const;
  const std::string& error() const;
  int sockets() const;
  int helper_threads() const;

 private:
  friend class PendingAccept;
  explicit RecvComm(std::unique_ptr<Connection> connection);
  std::unique_ptr<Connection> connection_;
};

}  // namespace lgreco::transport
