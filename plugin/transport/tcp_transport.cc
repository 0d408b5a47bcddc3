#include "plugin/transport/tcp_transport.h"

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

#include "config/log.h"

namespace lgreco::transport {

namespace {

std::string hex(uint64_t value) {
  char text[24];
  snprintf(text, sizeof text, "0x%016" PRIx64, value);
  return text;
}

std::string peer_description(int rank, const std::string& address) {
  return rank == kUnknownRank ? address : "rank " + std::to_string(rank) + " at " + address;
}

std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

void check_timeout(const char* what, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0)
    throw std::invalid_argument(std::string(what) + ": the handshake timeout must be positive, not " +
                                ms_text(timeout));
}

// After `timeout` from now, saturating (a timeout of years must not wrap around).
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now);
  return timeout >= room ? std::chrono::steady_clock::time_point::max() : now + timeout;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

uint64_t random_id() {
  std::random_device device;
  for (;;) {
    const uint64_t id = static_cast<uint64_t>(device()) << 32 | device();
    if (id != 0) return id;
  }
}

// --- Wire format ----------------------------------------------------------------------

namespace wire {

void encode(const Hello& hello, uint8_t out[kHelloBytes]) {
  uint8_t* p = out;
  put(p, hello.magic);
  put(p, hello.version);
  put(p, hello.socket_index);
  put(p, hello.socket_count);
  put(p, hello.comm_id);
  put(p, hello.nonce);
  put(p, hello.from_rank);
  put(p, hello.to_rank);
  put(p, uint64_t{0});  // reserved
}

Hello decode_hello(const uint8_t in[kHelloBytes]) {
  const uint8_t* p = in;
  Hello hello;
  hello.magic = get<uint64_t>(p);
  hello.version = get<uint32_t>(p);
  hello.socket_index = get<uint16_t>(p);
  hello.socket_count = get<uint16_t>(p);
  hello.comm_id = get<uint64_t>(p);
  hello.nonce = get<uint64_t>(p);
  hello.from_rank = get<int32_t>(p);
  hello.to_rank = get<int32_t>(p);
  return hello;
}

void encode(const Reply& reply, uint8_t out[kReplyBytes]) {
  uint8_t* p = out;
  put(p, reply.magic);
  put(p, reply.version);
  put(p, reply.status);
  put(p, reply.comm_id);
  put(p, reply.rank);
  put(p, uint32_t{0});  // reserved
}

Reply decode_reply(const uint8_t in[kReplyBytes]) {
  const uint8_t* p = in;
  Reply reply;
  reply.magic = get<uint64_t>(p);
  reply.version = get<uint32_t>(p);
  reply.status = get<uint32_t>(p);
  reply.comm_id = get<uint64_t>(p);
  reply.rank = get<int32_t>(p);
  return reply;
}

void encode(const MessageHeader& header, uint8_t out[kMessageHeaderBytes]) {
  uint8_t* p = out;
  put(p, header.size);
  put(p, header.tag);
  put(p, header.sequence);
}

MessageHeader decode_header(const uint8_t in[kMessageHeaderBytes]) {
  const uint8_t* p = in;
  MessageHeader header;
  header.size = get<uint64_t>(p);
  header.tag = get<int32_t>(p);
  header.sequence = get<uint32_t>(p);
  return header;
}

const char* reply_status_name(uint32_t status) {
  switch (static_cast<ReplyStatus>(status)) {
    case ReplyStatus::kAccepted: return "accepted";
    case ReplyStatus::kVersionMismatch: return "protocol version mismatch";
    case ReplyStatus::kWrongCommunicator: return "wrong communicator id";
    case ReplyStatus::kWrongRank: return "wrong rank";
    case ReplyStatus::kStaleHandle: return "stale listen handle";
    case ReplyStatus::kBadSocketCount: return "unsupported socket count";
  }
  return "unknown reason";
}

}  // namespace wire

// --- Handles --------------------------------------------------------------------------

std::string check_handle(const ListenHandle& handle) {
  if (handle.magic != kHandleMagic)
    return "not an lgreco listen handle (magic " + hex(handle.magic) + ", expected " + hex(kHandleMagic) + ")";
  if (handle.version != kProtocolVersion)
    return "a listen handle of lgreco transport protocol version " + std::to_string(handle.version) +
           ", this process speaks version " + std::to_string(kProtocolVersion) +
           " (different lgreco versions in one job?)";
  // Several sockets per connection are a later addition (net-plugin issue): the field
  // exists so that old and new versions can tell each other apart.
  if (handle.socket_count != 1)
    return "a listen handle asking for " + std::to_string(handle.socket_count) +
           " sockets per connection; this version uses exactly 1";
  if (!SocketAddress::from_bytes(handle.address, handle.address_length))
    return "a listen handle whose address (" + std::to_string(handle.address_length) +
           " bytes) is neither IPv4 nor IPv6";
  if (handle.rank < kUnknownRank) return "a listen handle with an invalid rank " + std::to_string(handle.rank);
  return "";
}

std::string handle_address(const ListenHandle& handle) {
  std::optional<SocketAddress> address = SocketAddress::from_bytes(handle.address, handle.address_length);
  return address ? address->str() : "(invalid)";
}

// --- Requests and connections ---------------------------------------------------------

struct Request {
  enum class State : uint8_t {
    kFree,      // in the pool
    kQueued,    // posted, bytes still to move
    kComplete,  // all bytes moved; the slot returns to the pool when test() reports it
  };
  State state = State::kFree;
  // Send: one message.
  const uint8_t* send_data = nullptr;
  uint64_t send_size = 0;
  uint8_t header[wire::kMessageHeaderBytes] = {};
  size_t offset = 0;  // across header and payload
  // Receive: n messages, one per buffer.
  int n = 0;
  int received = 0;
  std::array<uint8_t*, kMaxRecvs> data{};
  std::array<uint64_t, kMaxRecvs> capacity{};
  std::array<int, kMaxRecvs> tags{};
  std::array<uint64_t, kMaxRecvs> sizes{};
  std::array<bool, kMaxRecvs> filled{};
};

// One connected socket with its fixed request pool and the FIFO of requests in flight.
// Messages are framed on the socket in posting order, so only the oldest queued request
// moves bytes; test() on any request first moves those posted before it.
class Connection {
 public:
  Connection(Fd fd, int peer_rank, std::string peer_name, bool sending)
      : fd_(std::move(fd)), peer_rank_(peer_rank), peer_name_(std::move(peer_name)), sending_(sending) {}

  Request* post_send(const void* data, uint64_t size, int tag) {
    if (!data && size > 0)
      throw std::invalid_argument("isend to " + peer_name_ + ": null data for " + std::to_string(size) + " bytes");
    if (size > kMaxMessageBytes)
      throw std::invalid_argument("isend to " + peer_name_ + ": " + std::to_string(size) + " bytes is more than " +
                                  std::to_string(kMaxMessageBytes) + " (a negative count turned unsigned?)");
    Request* r = allocate("isend");
    if (!r) return nullptr;
    r->send_data = static_cast<const uint8_t*>(data);
    r->send_size = size;
    r->offset = 0;
    wire::encode(wire::MessageHeader{size, tag, next_send_sequence_++}, r->header);
    enqueue(r);
    return r;
  }

  Request* post_recv(int n, void* const* data, const uint64_t* sizes, const int* tags) {
    if (n < 1 || n > kMaxRecvs)
      throw std::invalid_argument("irecv from " + peer_name_ + ": " + std::to_string(n) + " buffers, expected 1 to " +
                                  std::to_string(kMaxRecvs));
    if (!data || !sizes || !tags) throw std::invalid_argument("irecv from " + peer_name_ + ": null array");
    for (int i = 0; i < n; ++i)
      if (!data[i] && sizes[i] > 0) throw std::invalid_argument("irecv from " + peer_name_ + ": null buffer with room");
    Request* r = allocate("irecv");
    if (!r) return nullptr;
    r->n = n;
    r->received = 0;
    for (int i = 0; i < n; ++i) {
      r->data[i] = static_cast<uint8_t*>(data[i]);
      r->capacity[i] = sizes[i];
      r->tags[i] = tags[i];
      r->sizes[i] = 0;
      r->filled[i] = false;
    }
    enqueue(r);
    return r;
  }

  Progress test(Request* r, bool* done, uint64_t* sizes) {
    if (done) *done = false;
    if (!owns(r) || r->state == Request::State::kFree)
      throw std::invalid_argument("test on " + peer_name_ + ": not a request in flight on this connection");
    if (r->state == Request::State::kQueued && error_.empty()) progress();
    if (r->state != Request::State::kComplete) {
      if (error_.empty()) return Progress::kPending;
      r->state = Request::State::kFree;  // the connection is dead; nothing will complete
      return Progress::kError;
    }
    if (sizes) {
      if (sending_) {
        sizes[0] = r->send_size;
      } else {
        for (int i = 0; i < r->n; ++i) sizes[i] = r->sizes[i];
      }
    }
    r->state = Request::State::kFree;
    if (done) *done = true;
    return Progress::kDone;
  }

  short poll_events() const {
    if (!error_.empty() || count_ == 0) return 0;
    return sending_ ? POLLOUT : POLLIN;
  }

  CommCounters counters() const {
    CommCounters c;
    c.payload_bytes = payload_bytes_.load(std::memory_order_relaxed);
    c.wire_bytes = wire_bytes_.load(std::memory_order_relaxed);
    c.messages = messages_.load(std::memory_order_relaxed);
    c.busy_ns = busy_ns_.load(std::memory_order_relaxed);
    return c;
  }

  void check_usable(const char* what) const {
    if (!error_.empty()) throw TransportError(std::string(what) + " on a failed connection: " + error_);
  }

  int fd() const { return fd_.get(); }
  int peer_rank() const { return peer_rank_; }
  const std::string& peer_name() const { return peer_name_; }
  const std::string& error() const { return error_; }

 private:
  bool owns(const Request* r) const { return r >= pool_.data() && r < pool_.data() + pool_.size(); }

  Request* allocate(const char* what) {
    check_usable(what);
    if (count_ == kMaxRequests) return nullptr;  // every queued request holds a slot
    for (Request& r : pool_)
      if (r.state == Request::State::kFree) return &r;
    return nullptr;  // all slots hold complete requests nobody has tested yet
  }

  void enqueue(Request* r) {
    r->state = Request::State::kQueued;
    if (count_ == 0) busy_since_ns_ = now_ns();
    queue_[(head_ + count_) % kMaxRequests] = static_cast<uint8_t>(r - pool_.data());
    ++count_;
  }

  Request* head() { return &pool_[queue_[head_]]; }

  void complete_head() {
    head()->state = Request::State::kComplete;
    head_ = (head_ + 1) % kMaxRequests;
    --count_;
    if (count_ == 0) busy_ns_.fetch_add(static_cast<uint64_t>(now_ns() - busy_since_ns_), std::memory_order_relaxed);
  }

  void count_bytes(uint64_t wire, uint64_t payload) {
    wire_bytes_.fetch_add(wire, std::memory_order_relaxed);
    payload_bytes_.fetch_add(payload, std::memory_order_relaxed);
  }

  void progress() { sending_ ? progress_send() : progress_recv(); }

  void progress_send() {
    constexpr size_t kHeader = wire::kMessageHeaderBytes;
    while (count_ > 0 && error_.empty()) {
      Request* r = head();
      const size_t before = r->offset;
      const IoResult io = send_two_some(fd_.get(), r->header, kHeader, r->send_data, r->send_size, &r->offset);
      const size_t payload_before = before > kHeader ? before - kHeader : 0;
      const size_t payload_after = r->offset > kHeader ? r->offset - kHeader : 0;
      count_bytes(r->offset - before, payload_after - payload_before);
      if (io.status == IoStatus::kDone) {
        messages_.fetch_add(1, std::memory_order_relaxed);
        complete_head();
        continue;
      }
      if (io.status == IoStatus::kWouldBlock) return;
      if (io.status == IoStatus::kClosed) {
        fail(peer_name_ + " closed the connection while " + std::to_string(r->send_size) +
             " bytes were being sent to it (the peer process exited, crashed or gave up)");
      } else {
        fail("sending to " + peer_name_ + " failed: " + errno_text(io.error));
      }
    }
  }

  void progress_recv() {
    while (count_ > 0 && error_.empty()) {
      Request* r = head();
      if (!have_header_ && !receive_header(r)) return;
      uint8_t* buffer = r->data[slot_];
      const size_t before = payload_offset_;
      const IoResult io = recv_some(fd_.get(), buffer, payload_size_, &payload_offset_);
      count_bytes(payload_offset_ - before, payload_offset_ - before);
      if (io.status == IoStatus::kDone) {
        r->sizes[slot_] = payload_size_;
        r->filled[slot_] = true;
        have_header_ = false;
        messages_.fetch_add(1, std::memory_order_relaxed);
        if (++r->received == r->n) complete_head();
        continue;
      }
      record_recv_problem(io, "in the middle of a " + std::to_string(payload_size_) + "-byte message");
      return;
    }
  }

  // Reads the next message header and matches it to a buffer of the head request.
  // Returns false unless the header is complete and acceptable.
  bool receive_header(Request* r) {
    const size_t before = header_offset_;
    const IoResult io = recv_some(fd_.get(), header_, sizeof header_, &header_offset_);
    count_bytes(header_offset_ - before, 0);
    if (io.status != IoStatus::kDone) {
      record_recv_problem(io, header_offset_ == 0 ? "" : "in the middle of a message header");
      return false;
    }
    header_offset_ = 0;
    const wire::MessageHeader header = wire::decode_header(header_);
    if (header.sequence != next_recv_sequence_) {
      fail("message " + std::to_string(header.sequence) + " from " + peer_name_ + " arrived where message " +
           std::to_string(next_recv_sequence_) +
           " was due: the byte stream is out of step (corrupt, or not an "
           "lgreco peer of this version)");
      return false;
    }
    int slot = -1;
    for (int i = 0; i < r->n && slot < 0; ++i)
      if (!r->filled[i] && r->tags[i] == header.tag) slot = i;
    if (slot < 0) {
      std::string expected;
      for (int i = 0; i < r->n; ++i)
        if (!r->filled[i]) expected += (expected.empty() ? "" : ", ") + std::to_string(r->tags[i]);
      fail(peer_name_ + " sent a message with tag " + std::to_string(header.tag) +
           " where the posted receive expects tag " + expected +
           ": the ranks disagree on the sequence of operations (mismatched LGRECO_* settings between ranks?)");
      return false;
    }
    // The one length that comes off the wire is bounded here, before anything is
    // written: it must fit the buffer the caller posted.
    if (header.size > r->capacity[slot]) {
      fail(peer_name_ + " sent a message of " + std::to_string(header.size) +
           " bytes, but the receive posted for it has room for only " + std::to_string(r->capacity[slot]) +
           " bytes (mismatched LGRECO_* settings between ranks?)");
      return false;
    }
    ++next_recv_sequence_;
    have_header_ = true;
    slot_ = slot;
    payload_size_ = header.size;
    payload_offset_ = 0;
    return true;
  }

  // A receive that stopped short: nothing to do if no data has arrived yet, a failure of
  // the connection if the socket was closed or broke.
  void record_recv_problem(const IoResult& io, const std::string& where) {
    if (io.status == IoStatus::kWouldBlock) return;
    if (io.status == IoStatus::kClosed) {
      fail(peer_name_ + " closed the connection" + (where.empty() ? "" : " " + where) +
           " (the peer process exited, crashed or gave up)");
    } else {
      fail("receiving from " + peer_name_ + " failed: " + errno_text(io.error));
    }
  }

  // The connection is unusable from here on. Shutting the socket down makes the peer
  // see it at once (a sender stuck on a receiver that refused its message gets EPIPE)
  // instead of waiting for its own timeout.
  void fail(std::string message) {
    error_ = std::move(message);
    ::shutdown(fd_.get(), SHUT_RDWR);
    LGRECO_INFO("NET", "transport: %s", error_.c_str());
  }

  Fd fd_;
  const int peer_rank_;
  const std::string peer_name_;
  const bool sending_;

  std::array<Request, kMaxRequests> pool_{};
  std::array<uint8_t, kMaxRequests> queue_{};  // pool indices, oldest at head_
  int head_ = 0;
  int count_ = 0;
  uint32_t next_send_sequence_ = 0;
  uint32_t next_recv_sequence_ = 0;

  // The message being received (for the request at the head of the queue).
  uint8_t header_[wire::kMessageHeaderBytes] = {};
  size_t header_offset_ = 0;
  bool have_header_ = false;
  int slot_ = 0;
  uint64_t payload_size_ = 0;
  size_t payload_offset_ = 0;

  std::string error_;
  int64_t busy_since_ns_ = 0;
  std::atomic<uint64_t> payload_bytes_{0};
  std::atomic<uint64_t> wire_bytes_{0};
  std::atomic<uint64_t> messages_{0};
  std::atomic<uint64_t> busy_ns_{0};
};

// --- SendComm / RecvComm --------------------------------------------------------------

SendComm::SendComm(std::unique_ptr<Connection> connection) : connection_(std::move(connection)) {}
SendComm::~SendComm() = default;
Request* SendComm::isend(const void* data, uint64_t size, int tag) { return connection_->post_send(data, size, tag); }
Progress SendComm::test(Request* request, bool* done, uint64_t* size) { return connection_->test(request, done, size); }
int SendComm::peer_rank() const { return connection_->peer_rank(); }
const std::string& SendComm::peer_name() const { return connection_->peer_name(); }
int SendComm::fd() const { return connection_->fd(); }
short SendComm::poll_events() const { return connection_->poll_events(); }
CommCounters SendComm::counters() const { return connection_->counters(); }
const std::string& SendComm::error() const { return connection_->error(); }

RecvComm::RecvComm(std::unique_ptr<Connection> connection) : connection_(std::move(connection)) {}
RecvComm::~RecvComm() = default;
Request* RecvComm::irecv(int n, void* const* data, const uint64_t* sizes, const int* tags) {
  return connection_->post_recv(n, data, sizes, tags);
}
Progress RecvComm::test(Request* request, bool* done, uint64_t* sizes) {
  return connection_->test(request, done, sizes);
}
int RecvComm::peer_rank() const { return connection_->peer_rank(); }
const std::string& RecvComm::peer_name() const { return connection_->peer_name(); }
int RecvComm::fd() const { return connection_->fd(); }
short RecvComm::poll_events() const { return connection_->poll_events(); }
CommCounters RecvComm::counters() const { return connection_->counters(); }
const std::string& RecvComm::error() const { return connection_->error(); }

// --- Listening ------------------------------------------------------------------------

std::unique_ptr<Listener> listen(const SocketAddress& address, const Identity& self) {
  if (self.rank < kUnknownRank) throw TransportError("listen: invalid rank " + std::to_string(self.rank));
  std::unique_ptr<Listener> listener(new Listener());
  listener->fd_ = listen_tcp(address, /*reuse_address=*/false);
  listener->address_ = SocketAddress::local_of(listener->fd_.get());
  if (listener->address_.is_wildcard())
    throw TransportError("listen on " + listener->address_.str() +
                         ": a wildcard address cannot be put in a handle (peers could not reach it); "
                         "bind to the address of an interface");
  listener->self_ = self;
  ListenHandle& h = listener->handle_;
  h.magic = kHandleMagic;
  h.version = kProtocolVersion;
  h.socket_count = 1;
  h.address_length = static_cast<uint16_t>(listener->address_.length());
  h.comm_id = self.comm_id;
  h.nonce = random_id();
  h.rank = self.rank;
  std::memcpy(h.address, listener->address_.get(), listener->address_.length());
  LGRECO_INFO("NET", "transport: rank %d listening on %s (communicator %s)", self.rank,
              listener->address_.str().c_str(), hex(self.comm_id).c_str());
  return listener;
}

Listener::~Listener() = default;

std::unique_ptr<PendingAccept> Listener::accept(std::chrono::milliseconds handshake_timeout) {
  check_timeout("accept", handshake_timeout);
  return std::unique_ptr<PendingAccept>(new PendingAccept(this, handshake_timeout));
}

// --- Connecting -----------------------------------------------------------------------

std::unique_ptr<PendingConnect> connect(const ListenHandle& handle, const Identity& self,
                                        std::chrono::milliseconds timeout) {
  check_timeout("connect", timeout);
  const std::string why = check_handle(handle);
  if (!why.empty()) throw TransportError("cannot connect: " + why);
  if (handle.comm_id != self.comm_id)
    throw TransportError("cannot connect: the listen handle of " + handle_address(handle) +
                         " belongs to communicator " + hex(handle.comm_id) + ", this endpoint to " + hex(self.comm_id));
  std::unique_ptr<PendingConnect> pending(new PendingConnect());
  pending->timeout_ = timeout;
  pending->deadline_ = deadline_after(timeout);
  pending->self_ = self;
  pending->handle_ = handle;
  pending->peer_name_ = peer_description(handle.rank, handle_address(handle));
  wire::Hello hello;
  hello.magic = wire::kHelloMagic;
  hello.version = kProtocolVersion;
  hello.socket_index = 0;
  hello.socket_count = handle.socket_count;
  hello.comm_id = self.comm_id;
  hello.nonce = handle.nonce;
  hello.from_rank = self.rank;
  hello.to_rank = handle.rank;
  wire::encode(hello, pending->hello_);
  int error = 0;
  pending->fd_ = start_connect(*SocketAddress::from_bytes(handle.address, handle.address_length), &error);
  if (error != 0)
    pending->fail("cannot connect to " + pending->peer_name_ + ": " + errno_text(error) + " (is it still running?)");
  return pending;
}

PendingConnect::~PendingConnect() = default;

Progress PendingConnect::fail(std::string message) {
  error_ = std::move(message);
  stage_ = Stage::kFailed;
  fd_.reset();
  LGRECO_INFO("NET", "transport: %s", error_.c_str());
  return Progress::kError;
}

short PendingConnect::poll_events() const {
  switch (stage_) {
    case Stage::kConnecting:
    case Stage::kSendingHello: return POLLOUT;
    case Stage::kReceivingReply: return POLLIN;
    case Stage::kDone:
    case Stage::kFailed: return 0;
  }
  return 0;
}

Progress PendingConnect::step() {
  const Progress progress = advance();
  if (progress != Progress::kPending || std::chrono::steady_clock::now() < deadline_) return progress;
  switch (stage_) {
    case Stage::kConnecting:
      return fail("cannot connect to " + peer_name_ + " within " + ms_text(timeout_) +
                  " (no answer to the TCP connection: a host that drops packets, a firewall, or a wrong address)");
    case Stage::kSendingHello:
      return fail("handshake with " + peer_name_ + ": the hello could not be sent within " + ms_text(timeout_) +
                  " (the peer takes no data)");
    default:
      return fail(peer_name_ + " did not answer the handshake within " + ms_text(timeout_) + " (" +
                  std::to_string(offset_) + " of " + std::to_string(sizeof reply_) +
                  " reply bytes; it is not accepting connections now: stuck, slow to call accept, busy with "
                  "another connection, or not an lgreco endpoint)");
  }
}

Progress PendingConnect::advance() {
  if (stage_ == Stage::kConnecting) {
    // A non-blocking connect has finished when the socket turns writable; SO_ERROR then
    // says how.
    const short revents = wait_for(fd_.get(), POLLOUT, std::chrono::milliseconds(0));
    if (revents == 0) return Progress::kPending;
    const int error = connect_result(fd_.get());
    if (error != 0)
      return fail("cannot connect to " + peer_name_ + ": " + errno_text(error) + " (is it still running?)");
    if (!(revents & POLLOUT)) return fail("cannot connect to " + peer_name_ + ": the connection was closed at once");
    set_no_delay(fd_.get());
    stage_ = Stage::kSendingHello;
    offset_ = 0;
  }
  if (stage_ == Stage::kSendingHello) {
    const IoResult io = send_some(fd_.get(), hello_, sizeof hello_, &offset_);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status != IoStatus::kDone)
      return fail("handshake with " + peer_name_ + " failed while sending: " +
                  (io.status == IoStatus::kClosed ? std::string("the connection was closed") : errno_text(io.error)));
    stage_ = Stage::kReceivingReply;
    offset_ = 0;
  }
  if (stage_ == Stage::kReceivingReply) {
    const IoResult io = recv_some(fd_.get(), reply_, sizeof reply_, &offset_);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status == IoStatus::kClosed)
      return fail(peer_name_ + " closed the connection during the handshake after " + std::to_string(offset_) + " of " +
                  std::to_string(sizeof reply_) +
                  " bytes of its reply (it refused the connection without saying why, or is not an lgreco endpoint)");
    if (io.status == IoStatus::kError)
      return fail("handshake with " + peer_name_ + " failed while receiving: " + errno_text(io.error));
    return check_reply();
  }
  return stage_ == Stage::kDone ? Progress::kDone : Progress::kError;
}

Progress PendingConnect::check_reply() {
  const wire::Reply reply = wire::decode_reply(reply_);
  if (reply.magic != wire::kReplyMagic)
    return fail(peer_name_ + " is not an lgreco endpoint: its handshake reply has magic " + hex(reply.magic) +
                ", expected " + hex(wire::kReplyMagic));
  if (reply.status != static_cast<uint32_t>(wire::ReplyStatus::kAccepted)) {
    std::string detail;
    switch (static_cast<wire::ReplyStatus>(reply.status)) {
      case wire::ReplyStatus::kVersionMismatch:
        detail = ": it speaks lgreco transport protocol version " + std::to_string(reply.version) + ", this process " +
                 std::to_string(kProtocolVersion) + " (different lgreco versions in one job?)";
        break;
      case wire::ReplyStatus::kWrongCommunicator:
        detail = ": it belongs to communicator " + hex(reply.comm_id) + ", this endpoint to " + hex(self_.comm_id);
        break;
      case wire::ReplyStatus::kWrongRank:
        detail = ": it is rank " + std::to_string(reply.rank) + " and does not accept rank " +
                 std::to_string(self_.rank) + " there";
        break;
      default: break;
    }
    return fail(peer_name_ + " refused the connection (" + wire::reply_status_name(reply.status) + ")" + detail);
  }
  if (reply.version != kProtocolVersion || reply.comm_id != self_.comm_id ||
      (handle_.rank != kUnknownRank && reply.rank != handle_.rank))
    return fail(peer_name_ + " accepted the connection as rank " + std::to_string(reply.rank) + " of communicator " +
                hex(reply.comm_id) + " (protocol version " + std::to_string(reply.version) +
                "), which is not the listener its handle named");
  const int peer_rank = handle_.rank != kUnknownRank ? handle_.rank : reply.rank;
  comm_.reset(new SendComm(std::make_unique<Connection>(std::move(fd_), peer_rank, peer_name_, /*sending=*/true)));
  stage_ = Stage::kDone;
  LGRECO_TRACE("NET", "transport: connected to %s", peer_name_.c_str());
  return Progress::kDone;
}

std::unique_ptr<SendComm> PendingConnect::take() { return std::move(comm_); }

// --- Accepting ------------------------------------------------------------------------

PendingAccept::~PendingAccept() = default;

int PendingAccept::fd() const { return stage_ == Stage::kWaitingForConnection ? listener_->fd() : fd_.get(); }

short PendingAccept::poll_events() const {
  switch (stage_) {
    case Stage::kWaitingForConnection:
    case Stage::kReceivingHello: return POLLIN;
    case Stage::kSendingReply: return POLLOUT;
    case Stage::kDone:
    case Stage::kFailed: return 0;
  }
  return 0;
}

Progress PendingAccept::fail(std::string message) {
  error_ = std::move(message);
  stage_ = Stage::kFailed;
  fd_.reset();
  LGRECO_INFO("NET", "transport: %s", error_.c_str());
  return Progress::kError;
}

Progress PendingAccept::refuse(uint32_t reason, std::string message) {
  // Tell the connector why, so that its error says it too. The socket is fresh and the
  // reply tiny, so one attempt is enough; if it does not go out, the connector still sees
  // the connection closed.
  const Identity& self = listener_->identity();
  wire::encode(wire::Reply{wire::kReplyMagic, kProtocolVersion, reason, self.comm_id, self.rank}, reply_);
  size_t offset = 0;
  (void)send_some(fd_.get(), reply_, sizeof reply_, &offset);
  return fail(std::move(message));
}

Progress PendingAccept::step() {
  const Progress progress = advance();
  if (progress != Progress::kPending || std::chrono::steady_clock::now() < deadline_) return progress;
  if (stage_ == Stage::kReceivingHello)
    return fail("the connection from " + peer_address_ + " sent " + std::to_string(offset_) + " of " +
                std::to_string(sizeof hello_) + " handshake bytes within " + ms_text(timeout_) +
                " and was closed (not an lgreco endpoint, or stuck)");
  return fail("handshake with " + peer_description(peer_rank_, peer_address_) +
              ": the reply could not be sent within " + ms_text(timeout_) + " (the peer takes no data)");
}

Progress PendingAccept::advance() {
  if (stage_ == Stage::kWaitingForConnection) {
    int error = 0;
    Fd fd = accept_tcp(listener_->fd(), &error);
    if (!fd.valid()) {
      if (error == EAGAIN) return Progress::kPending;
      accept_error_ = error;
      const bool out_of_descriptors = error == EMFILE || error == ENFILE;
      return fail("accept() on " + listener_->address().str() + " failed: " + errno_text(error) +
                  (out_of_descriptors ? " (this process or the system is out of file descriptors: raise the limit, "
                                        "ulimit -n)"
                                      : " (a problem of this process or host, not of the peer)"));
    }
    try {
      peer_address_ = SocketAddress::peer_of(fd.get()).str();
    } catch (const TransportError&) {
      peer_address_ = "(unknown address)";
    }
    set_no_delay(fd.get());
    fd_ = std::move(fd);
    stage_ = Stage::kReceivingHello;
    offset_ = 0;
    deadline_ = deadline_after(timeout_);
  }
  if (stage_ == Stage::kReceivingHello) {
    const IoResult io = recv_some(fd_.get(), hello_, sizeof hello_, &offset_);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status == IoStatus::kClosed)
      return fail("the connection from " + peer_address_ + " was closed after " + std::to_string(offset_) + " of " +
                  std::to_string(sizeof hello_) + " handshake bytes (not an lgreco endpoint, or it gave up)");
    if (io.status == IoStatus::kError)
      return fail("handshake with " + peer_address_ + " failed while receiving: " + errno_text(io.error));
    const Progress checked = check_hello();
    if (checked != Progress::kPending) return checked;
    stage_ = Stage::kSendingReply;
    offset_ = 0;
  }
  if (stage_ == Stage::kSendingReply) {
    const IoResult io = send_some(fd_.get(), reply_, sizeof reply_, &offset_);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status != IoStatus::kDone)
      return fail("handshake with " + peer_description(peer_rank_, peer_address_) + " failed while replying: " +
                  (io.status == IoStatus::kClosed ? std::string("the connection was closed") : errno_text(io.error)));
    const std::string name = peer_description(peer_rank_, peer_address_);
    comm_.reset(new RecvComm(std::make_unique<Connection>(std::move(fd_), peer_rank_, name, /*sending=*/false)));
    stage_ = Stage::kDone;
    LGRECO_TRACE("NET", "transport: accepted %s", name.c_str());
  }
  return stage_ == Stage::kDone ? Progress::kDone : Progress::kError;
}

// Checks a complete hello. kPending: acceptable (the reply is ready to send).
Progress PendingAccept::check_hello() {
  const wire::Hello hello = wire::decode_hello(hello_);
  const Identity& self = listener_->identity();
  const ListenHandle& handle = listener_->handle();
  const std::string from = "the connection from " + peer_address_;
  if (hello.magic != wire::kHelloMagic)
    return fail(from + " is not an lgreco endpoint: its first bytes are not an lgreco handshake (magic " +
                hex(hello.magic) + ", expected " + hex(wire::kHelloMagic) + ")");
  using wire::ReplyStatus;
  if (hello.version != kProtocolVersion)
    return refuse(static_cast<uint32_t>(ReplyStatus::kVersionMismatch),
                  from + " speaks lgreco transport protocol version " + std::to_string(hello.version) +
                      ", this process " + std::to_string(kProtocolVersion) +
                      " (different lgreco versions in one job?)");
  if (hello.comm_id != self.comm_id)
    return refuse(static_cast<uint32_t>(ReplyStatus::kWrongCommunicator),
                  from + " belongs to communicator " + hex(hello.comm_id) + ", this listener to " + hex(self.comm_id) +
                      " (a process of another job, or of an earlier run of this one)");
  if (hello.nonce != handle.nonce)
    return refuse(static_cast<uint32_t>(ReplyStatus::kStaleHandle),
                  from +
                      " names a listen handle that is not this listener's (a stale handle of an earlier "
                      "listener on the same address?)");
  if (hello.from_rank < kUnknownRank ||
      (self.rank != kUnknownRank && hello.to_rank != kUnknownRank && hello.to_rank != self.rank))
    return refuse(static_cast<uint32_t>(ReplyStatus::kWrongRank),
                  from + " (rank " + std::to_string(hello.from_rank) + ") wants rank " + std::to_string(hello.to_rank) +
                      ", this listener is rank " + std::to_string(self.rank));
  if (hello.socket_count != handle.socket_count || hello.socket_index >= hello.socket_count)
    return refuse(static_cast<uint32_t>(ReplyStatus::kBadSocketCount),
                  from + " opens socket " + std::to_string(hello.socket_index) + " of " +
                      std::to_string(hello.socket_count) + ", this listener expects " +
                      std::to_string(handle.socket_count) + " per connection");
  peer_rank_ = hello.from_rank;
  wire::encode(wire::Reply{wire::kReplyMagic, kProtocolVersion, static_cast<uint32_t>(ReplyStatus::kAccepted),
                           self.comm_id, self.rank},
               reply_);
  return Progress::kPending;
}

std::unique_ptr<RecvComm> PendingAccept::take() { return std::move(comm_); }

}  // namespace lgreco::transport
