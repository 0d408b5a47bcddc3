#include "plugin/transport/tcp_transport.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <system_error>
#include <thread>

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
  put(p, hello.connection_id);
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
  hello.connection_id = get<uint64_t>(p);
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
  if (handle.socket_count < 1 || handle.socket_count > kMaxSockets)
    return "a listen handle asking for " + std::to_string(handle.socket_count) + " sockets per connection; 1 to " +
           std::to_string(kMaxSockets) + " are possible";
  if (!SocketAddress::from_bytes(handle.address, handle.address_length))
    return "a listen handle whose address (" + std::to_string(handle.address_length) +
           " bytes) is neither IPv4 nor IPv6";
  if (handle.rank < kUnknownRank) return "a listen handle with an invalid rank " + std::to_string(handle.rank);
  return "";
}

std::string check_options(const ConnectionOptions& options, int sockets) {
  if (sockets < 1 || sockets > kMaxSockets)
    return std::to_string(sockets) + " sockets per connection; 1 to " + std::to_string(kMaxSockets) + " are possible";
  if (options.helper_threads < 0 || options.helper_threads > sockets)
    return std::to_string(options.helper_threads) + " helper threads for " + std::to_string(sockets) +
           " socket(s); 0 to the socket count are possible (each thread owns at least one socket)";
  if (options.user_timeout.count() <= 0)
    return "a user timeout of " + ms_text(options.user_timeout) + "; it must be positive";
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
  uint64_t order = 0;  // posting order: receives match the oldest request first
  // Send: one message.
  const uint8_t* send_data = nullptr;
  uint64_t send_size = 0;
  uint8_t header[wire::kMessageHeaderBytes] = {};
  int parts_left = 0;    // chunks (one per socket that carries one) not yet sent
  bool started = false;  // its first payload byte has moved (busy time)
  // Receive: n messages, one per buffer.
  int n = 0;
  int filled_count = 0;
  std::array<uint8_t*, kMaxRecvs> data{};
  std::array<uint64_t, kMaxRecvs> capacity{};
  std::array<int, kMaxRecvs> tags{};
  std::array<uint64_t, kMaxRecvs> sizes{};
  std::array<bool, kMaxRecvs> claimed{};   // a message's header matched it
  std::array<int, kMaxRecvs> chunks_left{};  // of that message
};

namespace {

// Which bytes of a message of `size` bytes socket `k` of `sockets` carries. Both sides
// compute it from the size alone (NCCL's socket transport: chunks of
// max(64 KiB, size / sockets), chunk k on socket k). Socket 0 always has a chunk (maybe
// empty): it carries the header.
struct Chunk {
  uint64_t offset = 0;
  uint64_t size = 0;
  bool exists = false;
};
uint64_t chunk_bytes(uint64_t size, int sockets) {
  if (sockets == 1) return size;
  return std::max(kMinChunkBytes, (size + static_cast<uint64_t>(sockets) - 1) / static_cast<uint64_t>(sockets));
}
Chunk chunk_of(uint64_t size, int sockets, int k) {
  const uint64_t chunk = chunk_bytes(size, sockets);
  if (k == 0) return {0, std::min(size, chunk), true};
  const uint64_t offset = chunk * static_cast<uint64_t>(k);
  if (offset >= size) return {};
  return {offset, std::min(size - offset, chunk), true};
}
int chunk_count(uint64_t size, int sockets) {
  const uint64_t chunk = chunk_bytes(size, sockets);
  return chunk == 0 ? 1 : static_cast<int>(std::max<uint64_t>(1, (size + chunk - 1) / chunk));
}

// Slots of the receiver's table of matched messages (socket 0 reads headers ahead of
// the other sockets; it waits when it is this far ahead of the slowest).
constexpr uint64_t kArrivalSlots = uint64_t{kMaxRequests} * kMaxRecvs;
// Parts one drive of a socket moves before it lets the others have a turn.
constexpr int kPartsPerDrive = 64;

}  // namespace

// The sockets of one connection, its fixed request pool, and (optionally) the helper
// threads that move its bytes. All shared state is under mu_; system calls that move
// bytes run without it, on the part of a message that the socket's driver owns.
class Connection {
 public:
  Connection(std::vector<Fd> fds, int peer_rank, std::string peer_name, bool sending, int helper_threads)
      : peer_rank_(peer_rank), peer_name_(std::move(peer_name)), sending_(sending),
        socket_count_(static_cast<int>(fds.size())) {
    for (int i = 0; i < socket_count_; ++i) sockets_[static_cast<size_t>(i)].fd = std::move(fds[static_cast<size_t>(i)]);
    for (int t = 0; t < helper_threads; ++t) {
      Fd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      if (!wake.valid()) {
        const int error = errno;
        stop_threads();
        throw TransportError("cannot create an eventfd for a helper thread of the connection with " + peer_name_ +
                             ": " + errno_text(error), error);
      }
      wake_fds_.push_back(std::move(wake));
    }
    try {
      threads_.reserve(static_cast<size_t>(helper_threads));
      for (int t = 0; t < helper_threads; ++t) threads_.emplace_back([this, t] { run(t); });
    } catch (const std::system_error& e) {
      stop_threads();
      throw TransportError("cannot start the helper threads of the connection with " + peer_name_ + ": " + e.what());
    }
  }

  ~Connection() { stop_threads(); }

  Request* post_send(const void* data, uint64_t size, int tag) {
    if (!data && size > 0)
      throw std::invalid_argument("isend to " + peer_name_ + ": null data for " + std::to_string(size) + " bytes");
    if (size > kMaxMessageBytes)
      throw std::invalid_argument("isend to " + peer_name_ + ": " + std::to_string(size) + " bytes is more than " +
                                  std::to_string(kMaxMessageBytes) + " (a negative count turned unsigned?)");
    {
      std::lock_guard<std::mutex> lock(mu_);
      Request* r = allocate("isend");
      // The send ring holds messages until every socket is past them.
      if (!r || posted_ - min_seq(0) >= static_cast<uint64_t>(kMaxRequests)) return nullptr;
      r->send_data = static_cast<const uint8_t*>(data);
      r->send_size = size;
      r->parts_left = chunk_count(size, socket_count_);
      r->started = false;
      wire::encode(wire::MessageHeader{size, tag, static_cast<uint32_t>(posted_)}, r->header);
      send_ring_[posted_ % kMaxRequests] = Posted{static_cast<uint8_t>(r - pool_.data()), size};
      ++posted_;
      enqueue(r);
      wake();
      return r;
    }
  }

  Request* post_recv(int n, void* const* data, const uint64_t* sizes, const int* tags) {
    if (n < 1 || n > kMaxRecvs)
      throw std::invalid_argument("irecv from " + peer_name_ + ": " + std::to_string(n) + " buffers, expected 1 to " +
                                  std::to_string(kMaxRecvs));
    if (!data || !sizes || !tags) throw std::invalid_argument("irecv from " + peer_name_ + ": null array");
    for (int i = 0; i < n; ++i)
      if (!data[i] && sizes[i] > 0) throw std::invalid_argument("irecv from " + peer_name_ + ": null buffer with room");
    std::lock_guard<std::mutex> lock(mu_);
    Request* r = allocate("irecv");
    if (!r) return nullptr;
    r->n = n;
    r->filled_count = 0;
    for (int i = 0; i < n; ++i) {
      r->data[i] = static_cast<uint8_t*>(data[i]);
      r->capacity[i] = sizes[i];
      r->tags[i] = tags[i];
      r->sizes[i] = 0;
      r->claimed[i] = false;
      r->chunks_left[i] = 0;
    }
    enqueue(r);
    wake();  // a header may be waiting for this receive
    return r;
  }

  Progress test(Request* r, bool* done, uint64_t* sizes) {
    if (done) *done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!owns(r) || r->state == Request::State::kFree)
        throw std::invalid_argument("test on " + peer_name_ + ": not a request in flight on this connection");
    }
    if (threads_.empty()) drive_all();
    std::unique_lock<std::mutex> lock(mu_);
    if (r->state != Request::State::kComplete) {
      if (!failed()) return Progress::kPending;
      r->state = Request::State::kFree;  // the connection is dead; nothing will complete
      --in_flight_;
      lock.unlock();
      // After kError the caller may free its buffers: no helper thread may write into
      // them any more (the sockets are shut down, so the threads end at once).
      stop_threads();
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
    --in_flight_;
    if (done) *done = true;
    return Progress::kDone;
  }

  int fd() const {
    const Socket* s = waiting_socket();
    return s ? s->fd.get() : sockets_[0].fd.get();
  }

  short poll_events() const {
    if (failed() || !threads_.empty()) return 0;
    if (const Socket* s = waiting_socket()) return s->wants;
    std::lock_guard<std::mutex> lock(mu_);
    if (queued_ == 0) return 0;
    return sending_ ? POLLOUT : POLLIN;
  }

  CommCounters counters() const {
    CommCounters c;
    c.payload_bytes = payload_bytes_.load(std::memory_order_relaxed);
    c.wire_bytes = wire_bytes_.load(std::memory_order_relaxed);
    c.messages = messages_.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    c.busy_ns = busy_ns_ + (active_ > 0 ? static_cast<uint64_t>(now_ns() - active_since_ns_) : 0);
    return c;
  }

  void check_usable(const char* what) const {
    if (failed()) throw TransportError(std::string(what) + " on a failed connection: " + error_);
  }

  int peer_rank() const { return peer_rank_; }
  const std::string& peer_name() const { return peer_name_; }
  // error_ is written once, before failed_ is set: a reader that sees failed_ sees it.
  const std::string& error() const {
    static const std::string none;
    return failed() ? error_ : none;
  }
  int sockets() const { return socket_count_; }
  int helper_threads() const { return static_cast<int>(threads_.size()); }

  // Any thread, while another drives the connection: shuts every socket down (its poll
  // wakes, its transfers fail, the peer sees the connection closed). Reads only the
  // descriptors, fixed from construction to destruction.
  void shutdown_sockets() const {
    for (int i = 0; i < socket_count_; ++i) ::shutdown(sockets_[static_cast<size_t>(i)].fd.get(), SHUT_RDWR);
  }

 private:
  // One socket and the part of a message its driver is moving. Only its driver (test()'s
  // caller, or the helper thread that owns it) touches it, except `seq`, which changes
  // under mu_ because other sockets' drivers read it.
  struct Socket {
    Fd fd;
    uint64_t seq = 0;  // the message this socket works on
    bool have_part = false;
    Request* request = nullptr;
    int buffer = 0;                     // receive: which buffer of the request
    const uint8_t* header = nullptr;    // send, socket 0: the header before the part
    size_t header_size = 0;
    uint8_t* data = nullptr;            // where the part comes from or goes to
    uint64_t part_size = 0;
    size_t offset = 0;                  // send: across header and part; receive: in the part
    uint8_t header_bytes[wire::kMessageHeaderBytes] = {};  // receive, socket 0
    size_t header_offset = 0;
    bool header_read = false;           // read, waiting for a receive to match (or room)
    short wants = 0;                    // what its last drive waited for (no helper threads)
  };
  // What one drive of a socket achieved.
  struct Drive {
    short wait = 0;           // POLLIN/POLLOUT: blocked on the socket; 0: nothing to do
    bool progressed = false;  // moved bytes or changed state: drive again before sleeping
  };
  // A matched message, for the sockets that carry its other chunks.
  struct Arrival {
    Request* request = nullptr;
    int buffer = 0;
    uint64_t size = 0;
  };

  bool failed() const { return failed_.load(std::memory_order_acquire); }


  // Without helper threads: the socket a caller should wait for. One in the middle of a
  // part comes first: socket 0 waiting for the next header while another socket still
  // receives this message's chunk would sleep through that chunk.
  const Socket* waiting_socket() const {
    if (!threads_.empty()) return nullptr;
    const Socket* first = nullptr;
    for (int i = 0; i < socket_count_; ++i) {
      const Socket& s = sockets_[static_cast<size_t>(i)];
      if (!s.wants) continue;
      if (s.have_part) return &s;
      if (!first) first = &s;
    }
    return first;
  }
  bool owns(const Request* r) const { return r >= pool_.data() && r < pool_.data() + pool_.size(); }

  // mu_ held.
  Request* allocate(const char* what) {
    check_usable(what);
    if (in_flight_ == kMaxRequests) return nullptr;
    for (Request& r : pool_)
      if (r.state == Request::State::kFree) return &r;
    return nullptr;
  }

  // mu_ held.
  void enqueue(Request* r) {
    r->state = Request::State::kQueued;
    r->order = next_order_++;
    ++in_flight_;
    ++queued_;
  }

  // mu_ held. The request's bytes have all moved.
  void complete(Request* r) {
    r->state = Request::State::kComplete;
    --queued_;
  }

  // mu_ held. The smallest message number a socket from `first` on still works on.
  uint64_t min_seq(int first) const {
    uint64_t low = UINT64_MAX;
    for (int i = first; i < socket_count_; ++i) low = std::min(low, sockets_[static_cast<size_t>(i)].seq);
    return low;
  }

  // Busy time: a union of the spans of the messages whose payload moves (mu_ held).
  void message_started() {
    if (active_++ == 0) active_since_ns_ = now_ns();
  }
  void message_ended() {
    if (--active_ == 0) busy_ns_ += static_cast<uint64_t>(now_ns() - active_since_ns_);
  }

  void count_bytes(uint64_t wire, uint64_t payload) {
    if (wire) wire_bytes_.fetch_add(wire, std::memory_order_relaxed);
    if (payload) payload_bytes_.fetch_add(payload, std::memory_order_relaxed);
  }

  // Wakes every helper thread (mu_ may be held): something changed that one may wait for.
  void wake() {
    for (const Fd& w : wake_fds_) {
      const uint64_t one = 1;
      (void)!::write(w.get(), &one, sizeof one);
    }
  }

  // Without helper threads: drives every socket until none makes progress.
  void drive_all() {
    for (int round = 0; round < 16; ++round) {
      bool progressed = false;
      for (int i = 0; i < socket_count_; ++i) {
        const Drive d = drive(i);
        sockets_[static_cast<size_t>(i)].wants = d.wait;
        progressed |= d.progressed;
      }
      if (!progressed || failed()) return;
    }
  }

  Drive drive(int i) { return sending_ ? drive_send(i) : drive_recv(i); }

  Drive drive_send(int i) {
    Socket& s = sockets_[static_cast<size_t>(i)];
    Drive d;
    for (int parts = 0; parts < kPartsPerDrive;) {
      if (!s.have_part) {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed() || s.seq == posted_) return d;
        const Posted& posted = send_ring_[s.seq % kMaxRequests];
        const Chunk c = chunk_of(posted.size, socket_count_, i);
        if (!c.exists) {  // a message too small to reach this socket
          ++s.seq;
          d.progressed = true;
          continue;
        }
        // This socket's part is still to send, so the request has not completed.
        Request* r = &pool_[posted.request];
        s.have_part = true;
        s.request = r;
        s.header = i == 0 ? r->header : nullptr;
        s.header_size = i == 0 ? wire::kMessageHeaderBytes : 0;
        s.data = const_cast<uint8_t*>(r->send_data) + c.offset;
        s.part_size = c.size;
        s.offset = 0;
      }
      const size_t before = s.offset;
      const IoResult io = send_two_some(s.fd.get(), s.header, s.header_size, s.data, s.part_size, &s.offset);
      const size_t payload_before = before > s.header_size ? before - s.header_size : 0;
      const size_t payload_after = s.offset > s.header_size ? s.offset - s.header_size : 0;
      count_bytes(s.offset - before, payload_after - payload_before);
      if (s.offset != before) d.progressed = true;
      if (payload_after > payload_before || io.status == IoStatus::kDone) {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed()) return d;
        Request* r = s.request;
        if (payload_after > payload_before && !r->started) {
          r->started = true;
          message_started();
        }
        if (io.status == IoStatus::kDone) {
          if (--r->parts_left == 0) {
            if (r->started) message_ended();
            messages_.fetch_add(1, std::memory_order_relaxed);
            complete(r);
          }
          s.have_part = false;
          ++s.seq;
          ++parts;
          d.progressed = true;
          continue;
        }
      }
      if (io.status == IoStatus::kWouldBlock) {
        d.wait = POLLOUT;
        return d;
      }
      if (io.status == IoStatus::kClosed) {
        fail(peer_name_ + " closed the connection while " + std::to_string(s.request->send_size) +
             " bytes were being sent to it (the peer process exited, crashed or gave up)");
      } else {
        fail("sending to " + peer_name_ + " failed: " + errno_text(io.error));
      }
      return d;
    }
    d.progressed = true;  // more to do: come back before sleeping
    return d;
  }

  Drive drive_recv(int i) {
    Socket& s = sockets_[static_cast<size_t>(i)];
    Drive d;
    for (int parts = 0; parts < kPartsPerDrive;) {
      if (!s.have_part) {
        if (i == 0) {
          if (!s.header_read) {
            if (s.header_offset == 0) {
              // Nothing is read while nothing is posted: a peer's close is then reported
              // by the test() of the next receive, not by the irecv that posts it.
              std::lock_guard<std::mutex> lock(mu_);
              if (failed() || queued_ == 0) return d;
            }
            const size_t before = s.header_offset;
            const IoResult io = recv_some(s.fd.get(), s.header_bytes, sizeof s.header_bytes, &s.header_offset);
            count_bytes(s.header_offset - before, 0);
            if (s.header_offset != before) d.progressed = true;
            if (io.status != IoStatus::kDone) {
              if (io.status == IoStatus::kWouldBlock) {
                d.wait = POLLIN;
              } else {
                recv_failed(io, s.header_offset == 0 ? "" : "in the middle of a message header");
              }
              return d;
            }
            s.header_offset = 0;
            s.header_read = true;
          }
          bool wake_others = false;
          {
            std::lock_guard<std::mutex> lock(mu_);
            if (failed() || !match_header(s)) return d;
            wake_others = socket_count_ > 1;
          }
          if (wake_others) wake();
          d.progressed = true;
        } else {
          std::lock_guard<std::mutex> lock(mu_);
          if (failed() || s.seq >= known_) return d;
          const Arrival& a = arrivals_[s.seq % kArrivalSlots];
          const Chunk c = chunk_of(a.size, socket_count_, i);
          if (!c.exists) {
            ++s.seq;
            if (header_waits_) wake();  // socket 0 may wait for this socket to catch up
            d.progressed = true;
            continue;
          }
          s.have_part = true;
          s.request = a.request;
          s.buffer = a.buffer;
          s.data = a.request->data[a.buffer] + c.offset;
          s.part_size = c.size;
          s.offset = 0;
        }
      }
      const size_t before = s.offset;
      const IoResult io = recv_some(s.fd.get(), s.data, s.part_size, &s.offset);
      count_bytes(s.offset - before, s.offset - before);
      if (s.offset != before) d.progressed = true;
      if (io.status == IoStatus::kDone) {
        bool wake_socket0 = false;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (failed()) return d;
          Request* r = s.request;
          if (--r->chunks_left[s.buffer] == 0) {
            message_ended();
            messages_.fetch_add(1, std::memory_order_relaxed);
            if (++r->filled_count == r->n) complete(r);
          }
          s.have_part = false;
          ++s.seq;
          wake_socket0 = i > 0 && header_waits_;
        }
        if (wake_socket0) wake();
        ++parts;
        d.progressed = true;
        continue;
      }
      if (io.status == IoStatus::kWouldBlock) {
        d.wait = POLLIN;
      } else {
        recv_failed(io, "in the middle of a " + std::to_string(s.request->sizes[s.buffer]) + "-byte message");
      }
      return d;
    }
    d.progressed = true;
    return d;
  }

  // mu_ held. Matches the header socket 0 has read to the oldest posted buffer of its
  // tag and makes chunk 0 socket 0's part. False while it must wait (no buffer of its
  // tag yet, or socket 0 is too far ahead of the others) or when the stream is broken.
  bool match_header(Socket& s) {
    const wire::MessageHeader header = wire::decode_header(s.header_bytes);
    if (header.sequence != static_cast<uint32_t>(s.seq)) {
      fail_locked("message " + std::to_string(header.sequence) + " from " + peer_name_ + " arrived where message " +
                  std::to_string(static_cast<uint32_t>(s.seq)) +
                  " was due: the byte stream is out of step (corrupt, or not an lgreco peer of this version)");
      return false;
    }
    header_waits_ = true;
    if (socket_count_ > 1 && s.seq - min_seq(1) >= kArrivalSlots) return false;
    Request* match = nullptr;
    int buffer = -1;
    for (Request& r : pool_) {
      if (r.state != Request::State::kQueued || (match && r.order > match->order)) continue;
      for (int b = 0; b < r.n; ++b)
        if (!r.claimed[b] && r.tags[b] == header.tag) {
          match = &r;
          buffer = b;
          break;
        }
    }
    if (!match) return false;  // waits for a receive with this tag (header_waits_)
    // The one length that comes off the wire is bounded here, before anything is
    // written: it must fit the buffer the caller posted.
    if (header.size > match->capacity[buffer]) {
      fail_locked(peer_name_ + " sent a message of " + std::to_string(header.size) + " bytes with tag " +
                  std::to_string(header.tag) + ", but the receive posted for it has room for only " +
                  std::to_string(match->capacity[buffer]) + " bytes (mismatched LGRECO_* settings between ranks?)");
      return false;
    }
    header_waits_ = false;
    match->claimed[buffer] = true;
    match->sizes[buffer] = header.size;
    match->chunks_left[buffer] = chunk_count(header.size, socket_count_);
    arrivals_[s.seq % kArrivalSlots] = Arrival{match, buffer, header.size};
    known_ = s.seq + 1;
    message_started();
    s.header_read = false;
    const Chunk c = chunk_of(header.size, socket_count_, 0);
    s.have_part = true;
    s.request = match;
    s.buffer = buffer;
    s.data = match->data[buffer];
    s.part_size = c.size;
    s.offset = 0;
    return true;
  }

  // A receive that stopped short with the socket closed or broken.
  void recv_failed(const IoResult& io, const std::string& where) {
    if (io.status == IoStatus::kClosed) {
      fail(peer_name_ + " closed the connection" + (where.empty() ? "" : " " + where) +
           " (the peer process exited, crashed or gave up)");
    } else {
      fail("receiving from " + peer_name_ + " failed: " + errno_text(io.error));
    }
  }

  void fail(std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked(std::move(message));
  }

  // The connection is unusable from here on (the first failure's message stays).
  // Shutting the sockets down makes the peer see it at once (a sender stuck on a
  // receiver that refused its message gets EPIPE) and wakes this side's threads.
  void fail_locked(std::string message) {
    if (failed()) return;
    error_ = std::move(message);
    failed_.store(true, std::memory_order_release);
    for (int i = 0; i < socket_count_; ++i) ::shutdown(sockets_[static_cast<size_t>(i)].fd.get(), SHUT_RDWR);
    wake();
    LGRECO_INFO("NET", "transport: %s", error_.c_str());
  }

  // A helper thread: drives its sockets, sleeps in poll() when none can move.
  void run(int t) {
    char name[16];
    snprintf(name, sizeof name, "lgreco-tcp-%c%d", sending_ ? 's' : 'r', t);
    pthread_setname_np(pthread_self(), name);
    const int stride = static_cast<int>(wake_fds_.size());
    std::array<pollfd, kMaxSockets + 1> fds;
    while (!stop_.load(std::memory_order_acquire)) {
      size_t n = 0;
      bool again = false;
      for (int i = t; i < socket_count_; i += stride) {
        const Drive d = drive(i);
        again |= d.progressed;
        if (d.wait) fds[n++] = pollfd{sockets_[static_cast<size_t>(i)].fd.get(), d.wait, 0};
      }
      const int wake_fd = wake_fds_[static_cast<size_t>(t)].get();
      fds[n++] = pollfd{wake_fd, POLLIN, 0};
      // The timeout is only a safety net: every change a thread waits for wakes it.
      const int rc = ::poll(fds.data(), n, again ? 0 : 1000);
      if (rc > 0 && (fds[n - 1].revents & POLLIN)) {
        uint64_t count;
        (void)!::read(wake_fd, &count, sizeof count);
      }
    }
  }

  // Ends and joins the helper threads (bounded: a thread only ever waits in poll(),
  // which the wake-up ends, or in a non-blocking system call).
  void stop_threads() {
    if (threads_.empty()) return;
    stop_.store(true, std::memory_order_release);
    wake();
    for (std::thread& t : threads_)
      if (t.joinable()) t.join();
  }

  const int peer_rank_;
  const std::string peer_name_;
  const bool sending_;
  const int socket_count_;
  std::array<Socket, kMaxSockets> sockets_{};
  std::vector<Fd> wake_fds_;  // one eventfd per helper thread
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::array<Request, kMaxRequests> pool_{};
  int in_flight_ = 0;        // requests not free (posted, or complete and not yet tested)
  int queued_ = 0;           // requests with bytes still to move
  uint64_t next_order_ = 0;
  // Send: posted messages by message number (socket drivers walk it).
  struct Posted {
    uint8_t request = 0;  // pool index
    uint64_t size = 0;    // the message's own: the request may be reused before a socket
                          // without a chunk of it walks past (it completed without that socket)
  };
  std::array<Posted, kMaxRequests> send_ring_{};
  uint64_t posted_ = 0;
  // Receive: messages whose header socket 0 matched, by message number.
  std::array<Arrival, kArrivalSlots> arrivals_{};
  uint64_t known_ = 0;        // messages matched so far
  bool header_waits_ = false;  // socket 0 holds a header it cannot match yet

  std::string error_;
  std::atomic<bool> failed_{false};
  int active_ = 0;  // messages whose payload is moving
  int64_t active_since_ns_ = 0;
  uint64_t busy_ns_ = 0;
  std::atomic<uint64_t> payload_bytes_{0};
  std::atomic<uint64_t> wire_bytes_{0};
  std::atomic<uint64_t> messages_{0};
};

// --- SendComm / RecvComm --------------------------------------------------------------

SendComm::SendComm(std::unique_ptr<Connection> connection) : connection_(std::move(connection)) {}
SendComm::~SendComm() = default;
Request* SendComm::isend(const void* data, uint64_t size, int tag) { return connection_->post_send(data, size, tag); }
Progress SendComm::test(Request* request, bool* done, uint64_t* size) { return connection_->test(request, done, size); }
int SendComm::peer_rank() const { return connection_->peer_rank(); }
const std::string& SendComm::peer_name() const { return connection_->peer_name(); }
int SendComm::fd() const { return connection_->fd(); }
void SendComm::shutdown() const { connection_->shutdown_sockets(); }
short SendComm::poll_events() const { return connection_->poll_events(); }
CommCounters SendComm::counters() const { return connection_->counters(); }
const std::string& SendComm::error() const { return connection_->error(); }
int SendComm::sockets() const { return connection_->sockets(); }
int SendComm::helper_threads() const { return connection_->helper_threads(); }

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
void RecvComm::shutdown() const { connection_->shutdown_sockets(); }
short RecvComm::poll_events() const { return connection_->poll_events(); }
CommCounters RecvComm::counters() const { return connection_->counters(); }
const std::string& RecvComm::error() const { return connection_->error(); }
int RecvComm::sockets() const { return connection_->sockets(); }
int RecvComm::helper_threads() const { return connection_->helper_threads(); }

// --- Listening ------------------------------------------------------------------------

std::unique_ptr<Listener> listen(const SocketAddress& address, const Identity& self) {
  return listen(address, self, ConnectionOptions{});
}

std::unique_ptr<Listener> listen(const SocketAddress& address, const Identity& self, const ConnectionOptions& options) {
  if (self.rank < kUnknownRank) throw TransportError("listen: invalid rank " + std::to_string(self.rank));
  if (const std::string why = check_options(options, options.sockets); !why.empty())
    throw std::invalid_argument("listen on " + address.str() + ": " + why);
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
  h.socket_count = static_cast<uint16_t>(options.sockets);
  h.address_length = static_cast<uint16_t>(listener->address_.length());
  h.comm_id = self.comm_id;
  h.nonce = random_id();
  h.rank = self.rank;
  std::memcpy(h.address, listener->address_.get(), listener->address_.length());
  LGRECO_INFO("NET", "transport: rank %d listening on %s (communicator %s, %d socket(s) per connection)", self.rank,
              listener->address_.str().c_str(), hex(self.comm_id).c_str(), options.sockets);
  return listener;
}

Listener::~Listener() = default;

std::unique_ptr<PendingAccept> Listener::accept(std::chrono::milliseconds handshake_timeout) {
  return accept(ConnectionOptions{}, handshake_timeout);
}

std::unique_ptr<PendingAccept> Listener::accept(const ConnectionOptions& options,
                                                std::chrono::milliseconds handshake_timeout) {
  check_timeout("accept", handshake_timeout);
  if (const std::string why = check_options(options, handle_.socket_count); !why.empty())
    throw std::invalid_argument("accept on " + address_.str() + ": " + why);
  return std::unique_ptr<PendingAccept>(new PendingAccept(this, options, handshake_timeout));
}

// --- Connecting -----------------------------------------------------------------------

std::unique_ptr<PendingConnect> connect(const ListenHandle& handle, const Identity& self,
                                        std::chrono::milliseconds timeout) {
  return connect(handle, self, ConnectionOptions{}, timeout);
}

std::unique_ptr<PendingConnect> connect(const ListenHandle& handle, const Identity& self,
                                        const ConnectionOptions& options, std::chrono::milliseconds timeout) {
  check_timeout("connect", timeout);
  const std::string why = check_handle(handle);
  if (!why.empty()) throw TransportError("cannot connect: " + why);
  if (handle.comm_id != self.comm_id)
    throw TransportError("cannot connect: the listen handle of " + handle_address(handle) +
                         " belongs to communicator " + hex(handle.comm_id) + ", this endpoint to " + hex(self.comm_id));
  if (const std::string bad = check_options(options, handle.socket_count); !bad.empty())
    throw std::invalid_argument("connect to " + handle_address(handle) + ": " + bad);
  std::unique_ptr<PendingConnect> pending(new PendingConnect());
  pending->timeout_ = timeout;
  pending->deadline_ = deadline_after(timeout);
  pending->options_ = options;
  pending->self_ = self;
  pending->handle_ = handle;
  pending->peer_name_ = peer_description(handle.rank, handle_address(handle));
  const uint64_t connection_id = random_id();
  const SocketAddress address = *SocketAddress::from_bytes(handle.address, handle.address_length);
  pending->links_.resize(handle.socket_count);
  for (int i = 0; i < handle.socket_count; ++i) {
    PendingConnect::Link& link = pending->links_[static_cast<size_t>(i)];
    wire::Hello hello;
    hello.magic = wire::kHelloMagic;
    hello.version = kProtocolVersion;
    hello.socket_index = static_cast<uint16_t>(i);
    hello.socket_count = handle.socket_count;
    hello.comm_id = self.comm_id;
    hello.nonce = handle.nonce;
    hello.from_rank = self.rank;
    hello.to_rank = handle.rank;
    hello.connection_id = connection_id;
    wire::encode(hello, link.hello);
    int error = 0;
    link.fd = start_connect(address, &error);
    if (error != 0) {
      const bool local = error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM ||
                         error == EADDRNOTAVAIL;
      if (local) pending->local_error_ = error;
      pending->fail("cannot connect to " + pending->peer_name_ + ": " + errno_text(error) +
                    (local ? " (a problem of this host: out of file descriptors, memory or ephemeral ports)"
                           : " (is it still running?)"));
      break;
    }
  }
  return pending;
}

PendingConnect::~PendingConnect() = default;

Progress PendingConnect::fail(std::string message) {
  error_ = std::move(message);
  stage_ = Stage::kFailed;
  links_.clear();
  LGRECO_INFO("NET", "transport: %s", error_.c_str());
  return Progress::kError;
}

const PendingConnect::Link* PendingConnect::behind() const {
  const Link* least = nullptr;
  for (const Link& link : links_)
    if (link.stage != Stage::kDone && (!least || link.stage < least->stage)) least = &link;
  return least;
}

int PendingConnect::fd() const {
  const Link* link = behind();
  return link ? link->fd.get() : -1;
}

short PendingConnect::poll_events() const {
  const Link* link = behind();
  if (!link || stage_ == Stage::kDone || stage_ == Stage::kFailed) return 0;
  switch (link->stage) {
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
  const Link* link = behind();
  switch (stage_) {
    case Stage::kConnecting:
      return fail("cannot connect to " + peer_name_ + " within " + ms_text(timeout_) +
                  " (no answer to the TCP connection: a host that drops packets, a firewall, or a wrong address)");
    case Stage::kSendingHello:
      return fail("handshake with " + peer_name_ + ": the hello could not be sent within " + ms_text(timeout_) +
                  " (the peer takes no data)");
    default:
      return fail(peer_name_ + " did not answer the handshake within " + ms_text(timeout_) + " (" +
                  std::to_string(link ? link->offset : 0) + " of " + std::to_string(wire::kReplyBytes) +
                  " reply bytes; it is not accepting connections now: stuck, slow to call accept, busy with "
                  "another connection, or not an lgreco endpoint)");
  }
}

Progress PendingConnect::advance() {
  if (stage_ == Stage::kDone) return Progress::kDone;
  if (stage_ == Stage::kFailed) return Progress::kError;
  bool all_done = true;
  for (Link& link : links_) {
    const Progress p = advance(link);
    if (p == Progress::kError) return p;
    all_done &= p == Progress::kDone;
  }
  if (!all_done) {
    stage_ = behind()->stage;
    return Progress::kPending;
  }
  const wire::Reply reply = wire::decode_reply(links_[0].reply);
  const int peer_rank = handle_.rank != kUnknownRank ? handle_.rank : reply.rank;
  std::vector<Fd> fds;
  for (Link& link : links_) fds.push_back(std::move(link.fd));
  try {
    comm_.reset(new SendComm(
        std::make_unique<Connection>(std::move(fds), peer_rank, peer_name_, /*sending=*/true, options_.helper_threads)));
  } catch (const TransportError& e) {
    return fail(e.what());
  }
  links_.clear();
  stage_ = Stage::kDone;
  LGRECO_TRACE("NET", "transport: connected to %s", peer_name_.c_str());
  return Progress::kDone;
}

Progress PendingConnect::advance(Link& link) {
  if (link.stage == Stage::kConnecting) {
    // A non-blocking connect has finished when the socket turns writable; SO_ERROR then
    // says how.
    const short revents = wait_for(link.fd.get(), POLLOUT, std::chrono::milliseconds(0));
    if (revents == 0) return Progress::kPending;
    const int error = connect_result(link.fd.get());
    if (error != 0)
      return fail("cannot connect to " + peer_name_ + ": " + errno_text(error) + " (is it still running?)");
    if (!(revents & POLLOUT)) return fail("cannot connect to " + peer_name_ + ": the connection was closed at once");
    set_no_delay(link.fd.get());
    if (const int e = set_keepalive(link.fd.get(), options_.user_timeout); e != 0)
      return fail("cannot set TCP keepalive on the connection to " + peer_name_ + ": " + errno_text(e));
    link.stage = Stage::kSendingHello;
    link.offset = 0;
  }
  if (link.stage == Stage::kSendingHello) {
    const IoResult io = send_some(link.fd.get(), link.hello, sizeof link.hello, &link.offset);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status != IoStatus::kDone)
      return fail("handshake with " + peer_name_ + " failed while sending: " +
                  (io.status == IoStatus::kClosed ? std::string("the connection was closed") : errno_text(io.error)));
    link.stage = Stage::kReceivingReply;
    link.offset = 0;
  }
  if (link.stage == Stage::kReceivingReply) {
    const IoResult io = recv_some(link.fd.get(), link.reply, sizeof link.reply, &link.offset);
    if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
    if (io.status == IoStatus::kClosed)
      return fail(peer_name_ + " closed the connection during the handshake after " + std::to_string(link.offset) +
                  " of " + std::to_string(sizeof link.reply) +
                  " bytes of its reply (it refused the connection without saying why, or is not an lgreco endpoint)");
    if (io.status == IoStatus::kError)
      return fail("handshake with " + peer_name_ + " failed while receiving: " + errno_text(io.error));
    return check_reply(link);
  }
  return link.stage == Stage::kDone ? Progress::kDone : Progress::kError;
}

Progress PendingConnect::check_reply(Link& link) {
  const wire::Reply reply = wire::decode_reply(link.reply);
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
  link.stage = Stage::kDone;
  return Progress::kDone;
}

std::unique_ptr<SendComm> PendingConnect::take() { return std::move(comm_); }

// --- Accepting ------------------------------------------------------------------------

// Parked sockets wait at most this many at once per listener; more are closed (their
// connectors fail), so that a flood of half-connections cannot grow memory without bound.
constexpr size_t kMaxParked = 1024;

PendingAccept::~PendingAccept() { release(); }

int PendingAccept::fd() const {
  switch (stage_) {
    case Stage::kWaitingForConnection: return listener_->fd();
    case Stage::kReceivingHello: return fd_.valid() ? fd_.get() : listener_->fd();
    case Stage::kSendingReply:
      for (const Link& link : links_)
        if (link.offset < wire::kReplyBytes) return link.fd.get();
      return -1;
    case Stage::kDone:
    case Stage::kFailed: return -1;
  }
  return -1;
}

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

int PendingAccept::collected() const {
  int count = 0;
  for (const Link& link : links_) count += link.fd.valid() ? 1 : 0;
  return count;
}

void PendingAccept::adopt(uint64_t connection_id) {
  connection_id_ = connection_id;
  listener_->claimed_.push_back(connection_id);
  links_.clear();
  links_.resize(listener_->handle_.socket_count);
}

void PendingAccept::add_link(int index, Fd fd) {
  if (links_.empty()) links_.resize(listener_->handle_.socket_count);
  links_[static_cast<size_t>(index)].fd = std::move(fd);
}

void PendingAccept::take_parked() {
  std::lock_guard<std::mutex> lock(listener_->parking_mutex_);
  for (Listener::Parked& p : listener_->parked_) {
    if (p.connection_id != connection_id_) continue;
    Link& link = links_[static_cast<size_t>(p.index)];
    if (!link.fd.valid()) {
      link.fd = std::move(p.fd);
      peer_rank_ = p.rank;
      peer_address_ = p.address;
    }
    p.fd.reset();  // a duplicate of an index already here is dropped
  }
  std::erase_if(listener_->parked_, [](const Listener::Parked& p) { return !p.fd.valid(); });
}

void PendingAccept::park(const wire::Hello& hello, Fd fd) {
  std::lock_guard<std::mutex> lock(listener_->parking_mutex_);
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(listener_->parked_, [&](const Listener::Parked& p) { return p.deadline <= now; });
  if (listener_->parked_.size() >= kMaxParked) return;  // closed: its connector fails
  Listener::Parked p;
  p.connection_id = hello.connection_id;
  p.index = hello.socket_index;
  p.rank = hello.from_rank;
  p.fd = std::move(fd);
  p.address = peer_address_;
  p.deadline = deadline_after(timeout_);
  listener_->parked_.push_back(std::move(p));
}

void PendingAccept::release() {
  if (connection_id_ == 0) return;
  std::lock_guard<std::mutex> lock(listener_->parking_mutex_);
  std::erase(listener_->claimed_, connection_id_);
  connection_id_ = 0;
}

Progress PendingAccept::fail(std::string message) {
  error_ = std::move(message);
  stage_ = Stage::kFailed;
  // When the culprit is the socket being read (garbage, closed, silent), the sockets
  // collected so far belong to a genuine connection: another PendingAccept may finish
  // it. Otherwise (this connection's own deadline, a failed reply) they close.
  if (fd_.valid() && connection_id_ != 0) {
    const uint64_t id = connection_id_;
    release();
    for (size_t i = 0; i < links_.size(); ++i) {
      if (!links_[i].fd.valid()) continue;
      wire::Hello hello;
      hello.connection_id = id;
      hello.socket_index = static_cast<uint16_t>(i);
      hello.from_rank = peer_rank_;
      park(hello, std::move(links_[i].fd));
    }
  }
  release();
  links_.clear();
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
  if (stage_ == Stage::kReceivingHello && fd_.valid())
    return fail("the connection from " + peer_address_ + " sent " + std::to_string(offset_) + " of " +
                std::to_string(sizeof hello_) + " handshake bytes within " + ms_text(timeout_) +
                " and was closed (not an lgreco endpoint, or stuck)");
  if (stage_ == Stage::kReceivingHello)
    return fail("the connection from " + peer_description(peer_rank_, peer_address_) + " opened " +
                std::to_string(collected()) + " of its " + std::to_string(listener_->handle_.socket_count) +
                " sockets within " + ms_text(timeout_) + " and was closed (the peer failed while connecting)");
  return fail("handshake with " + peer_description(peer_rank_, peer_address_) +
              ": the reply could not be sent within " + ms_text(timeout_) + " (the peer takes no data)");
}

Progress PendingAccept::advance() {
  if (stage_ == Stage::kWaitingForConnection) {
    if (listener_->handle_.socket_count > 1) {
      // A connection some other PendingAccept parked sockets of, which nobody collects.
      std::lock_guard<std::mutex> lock(listener_->parking_mutex_);
      const auto now = std::chrono::steady_clock::now();
      std::erase_if(listener_->parked_, [&](const Listener::Parked& p) { return p.deadline <= now; });
      for (const Listener::Parked& p : listener_->parked_)
        if (std::find(listener_->claimed_.begin(), listener_->claimed_.end(), p.connection_id) ==
            listener_->claimed_.end()) {
          adopt(p.connection_id);
          break;
        }
    }
    if (connection_id_ != 0) {
      take_parked();
      stage_ = Stage::kReceivingHello;
      deadline_ = deadline_after(timeout_);
    } else {
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
      if (const int e = set_keepalive(fd_.get(), options_.user_timeout); e != 0)
        return fail("cannot set TCP keepalive on the connection from " + peer_address_ + ": " + errno_text(e));
      stage_ = Stage::kReceivingHello;
      offset_ = 0;
      deadline_ = deadline_after(timeout_);
    }
  }
  if (stage_ == Stage::kReceivingHello) {
    const Progress collecting = collect();
    if (collecting != Progress::kPending || stage_ != Stage::kSendingReply) return collecting;
  }
  if (stage_ == Stage::kSendingReply) {
    bool all_sent = true;
    for (Link& link : links_) {
      const IoResult io = send_some(link.fd.get(), reply_, sizeof reply_, &link.offset);
      if (io.status == IoStatus::kWouldBlock) {
        all_sent = false;
        continue;
      }
      if (io.status != IoStatus::kDone)
        return fail("handshake with " + peer_description(peer_rank_, peer_address_) + " failed while replying: " +
                    (io.status == IoStatus::kClosed ? std::string("the connection was closed") : errno_text(io.error)));
    }
    if (!all_sent) return Progress::kPending;
    const std::string name = peer_description(peer_rank_, peer_address_);
    std::vector<Fd> fds;
    for (Link& link : links_) fds.push_back(std::move(link.fd));
    try {
      comm_.reset(new RecvComm(
          std::make_unique<Connection>(std::move(fds), peer_rank_, name, /*sending=*/false, options_.helper_threads)));
    } catch (const TransportError& e) {
      return fail(e.what());
    }
    release();
    links_.clear();
    stage_ = Stage::kDone;
    LGRECO_TRACE("NET", "transport: accepted %s", name.c_str());
  }
  return stage_ == Stage::kDone ? Progress::kDone : Progress::kError;
}

// Reads hellos until every socket of the connection is here (one at a time, on fd_;
// sockets of other connections are parked for the PendingAccepts that collect them).
// kPending while waiting; stage_ becomes kSendingReply when complete, or goes back to
// kWaitingForConnection when nothing of a connection has been collected.
Progress PendingAccept::collect() {
  const int count = listener_->handle_.socket_count;
  // Bounded: each round takes one socket of the backlog.
  for (int round = 0; round < 2 * kMaxSockets + 2; ++round) {
    if (fd_.valid()) {
      const IoResult io = recv_some(fd_.get(), hello_, sizeof hello_, &offset_);
      if (io.status == IoStatus::kWouldBlock) return Progress::kPending;
      if (io.status == IoStatus::kClosed)
        return fail("the connection from " + peer_address_ + " was closed after " + std::to_string(offset_) + " of " +
                    std::to_string(sizeof hello_) + " handshake bytes (not an lgreco endpoint, or it gave up)");
      if (io.status == IoStatus::kError)
        return fail("handshake with " + peer_address_ + " failed while receiving: " + errno_text(io.error));
      wire::Hello hello;
      const Progress checked = check_hello(&hello);
      if (checked != Progress::kPending) return checked;
      offset_ = 0;
      if (count == 1) {
        peer_rank_ = hello.from_rank;
        add_link(0, std::move(fd_));
      } else {
        if (hello.connection_id == 0)
          return refuse(static_cast<uint32_t>(wire::ReplyStatus::kBadSocketCount),
                        "the connection from " + peer_address_ + " opens socket " +
                            std::to_string(hello.socket_index) + " of " + std::to_string(count) +
                            " without a connection id (an lgreco version without several sockets per connection?)");
        bool mine = false;
        {
          std::lock_guard<std::mutex> lock(listener_->parking_mutex_);
          if (connection_id_ == 0 && std::find(listener_->claimed_.begin(), listener_->claimed_.end(),
                                               hello.connection_id) == listener_->claimed_.end())
            adopt(hello.connection_id);
          mine = hello.connection_id == connection_id_;
        }
        if (!mine) {
          park(hello, std::move(fd_));
        } else if (links_[hello.socket_index].fd.valid()) {
          return refuse(static_cast<uint32_t>(wire::ReplyStatus::kBadSocketCount),
                        "the connection from " + peer_address_ + " opens its socket " +
                            std::to_string(hello.socket_index) + " twice");
        } else {
          peer_rank_ = hello.from_rank;
          add_link(hello.socket_index, std::move(fd_));
        }
      }
    }
    if (connection_id_ != 0) take_parked();
    if (collected() == count) {
      const Identity& self = listener_->identity();
      wire::encode(wire::Reply{wire::kReplyMagic, kProtocolVersion,
                               static_cast<uint32_t>(wire::ReplyStatus::kAccepted), self.comm_id, self.rank},
                   reply_);
      stage_ = Stage::kSendingReply;
      return Progress::kPending;
    }
    int error = 0;
    Fd next = accept_tcp(listener_->fd(), &error);
    if (!next.valid()) {
      if (error != EAGAIN) {
        accept_error_ = error;
        return fail("accept() on " + listener_->address().str() + " failed: " + errno_text(error) +
                    " (a problem of this process or host, not of the peer)");
      }
      if (connection_id_ == 0) {  // only sockets of other connections came: start over
        stage_ = Stage::kWaitingForConnection;
        deadline_ = std::chrono::steady_clock::time_point::max();
      }
      return Progress::kPending;
    }
    try {
      peer_address_ = SocketAddress::peer_of(next.get()).str();
    } catch (const TransportError&) {
      peer_address_ = "(unknown address)";
    }
    set_no_delay(next.get());
    fd_ = std::move(next);
    if (const int e = set_keepalive(fd_.get(), options_.user_timeout); e != 0)
      return fail("cannot set TCP keepalive on the connection from " + peer_address_ + ": " + errno_text(e));
    if (connection_id_ == 0) deadline_ = deadline_after(timeout_);
  }
  return Progress::kPending;
}

// Checks a complete hello. kPending: acceptable.
Progress PendingAccept::check_hello(wire::Hello* out) {
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
  *out = hello;
  return Progress::kPending;
}

std::unique_ptr<RecvComm> PendingAccept::take() { return std::move(comm_); }

}  // namespace lgreco::transport
