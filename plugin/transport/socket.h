// Plain TCP sockets: an owner for file descriptors, socket addresses held by value, and
// byte movement that never blocks.
//
// This is the layer under the transport (plugin/transport/tcp_transport.h) and under the
// socket fabric's rendezvous (plugin/collective/socket_fabric.cc), so that the project has
// one place that talks to the socket API. Every socket made here is non-blocking and
// close-on-exec; sends never raise SIGPIPE (a dead peer is an error to report, not a
// signal that kills a training process).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace lgreco::transport {

// Thrown where something cannot even start (no socket, cannot bind, a malformed handle).
// Progress on something already started is reported by return values instead, because
// the net-plugin ABI adapter maps those to NCCL's status codes on every call.
// error_number() is the errno of the failed system call (0 when there was none), so that
// a caller can tell a port in use (EADDRINUSE) from other failures.
class TransportError : public std::runtime_error {
 public:
  explicit TransportError(const std::string& what, int error_number = 0)
      : std::runtime_error(what), error_number_(error_number) {}
  int error_number() const { return error_number_; }

 private:
  int error_number_;
};

// strerror(error) as a std::string (thread-safe).
std::string errno_text(int error);

// Owns one file descriptor and closes it when destroyed. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes the descriptor held now (if any) and holds `fd` instead.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// An IPv4 or IPv6 socket address, held by value so that it can travel inside a
// fixed-size handle.
class SocketAddress {
 public:
  // The largest sockaddr this class holds (sockaddr_in6).
  static constexpr size_t kMaxBytes = sizeof(sockaddr_in6);

  SocketAddress() = default;

  // `host` is a numeric address (127.0.0.1, ::1) or a name (looked up with getaddrinfo,
  // IPv4 first, because that is what torchrun's MASTER_ADDR usually means). Throws
  // TransportError naming the host when it does not resolve.
  static SocketAddress resolve(const std::string& host, uint16_t port);
  // From raw sockaddr bytes, e.g. out of a handle that came over the wire: nothing unless
  // the length fits and matches the family it claims.
  static std::optional<SocketAddress> from_bytes(const void* data, size_t length);
  // The wildcard address (0.0.0.0 or ::) of `family` (AF_INET or AF_INET6) with `port`.
  static SocketAddress wildcard(int family, uint16_t port);
  // The local (getsockname) and remote (getpeername) address of a socket. Throw
  // TransportError.
  static SocketAddress local_of(int fd);
  static SocketAddress peer_of(int fd);

  const sockaddr* get() const { return &storage_.any; }
  socklen_t length() const { return length_; }
  int family() const { return length_ == 0 ? AF_UNSPEC : storage_.any.sa_family; }
  bool empty() const { return length_ == 0; }
  uint16_t port() const;
  void set_port(uint16_t port);
  // 0.0.0.0 or ::, which a listener may bind to but a peer cannot connect to.
  bool is_wildcard() const;
  // 127.0.0.0/8, ::1, or ::ffff:127.x.y.z: an address only this host can reach.
  bool is_loopback() const;
  // The IPv4 address an IPv4-mapped IPv6 address (::ffff:a.b.c.d) stands for, as a
  // sockaddr_in; any other address unchanged.
  SocketAddress unmapped() const;
  // "127.0.0.1:29500" or "[::1]:29500"; "(none)" when empty.
  std::string str() const;

 private:
  union Storage {
    sockaddr any;
    sockaddr_in v4;
    sockaddr_in6 v6;
  };
  Storage storage_{};
  socklen_t length_ = 0;
};

// A non-blocking listening socket bound to `address` (port 0: the kernel picks one;
// read it back with SocketAddress::local_of). `reuse_address` sets SO_REUSEADDR so that a
// well-known port (MASTER_PORT) can be bound again while old connections linger in
// TIME_WAIT. Throws TransportError naming the address.
Fd listen_tcp(const SocketAddress& address, bool reuse_address);

// Starts a non-blocking connect. Returns the socket; *error is 0 when the connection is
// made or under way (wait for POLLOUT, then read connect_result), else the errno of the
// failure (the socket is then closed). Throws TransportError if no socket can be made.
Fd start_connect(const SocketAddress& address, int* error);
// After a started connect became writable: 0 if it is connected, else its errno.
int connect_result(int fd);

// Accepts one waiting connection on a listening socket, non-blocking. An invalid Fd with
// *error = EAGAIN means that none is waiting. Connections that failed before they were
// taken (ECONNABORTED, EPROTO and the other network errors accept(2) passes on) are
// skipped. Any other *error is the listener's own problem (EMFILE, ENFILE, ENOBUFS,
// ENOMEM, EINVAL): it does not go away by calling again at once.
Fd accept_tcp(int listen_fd, int* error);

// TCP_NODELAY on a connected socket: every message here is a header the peer waits for,
// and Nagle's algorithm would hold it back for a round trip.
void set_no_delay(int fd);

// TCP keepalive and TCP_USER_TIMEOUT on a connected socket, so that a connection whose
// peer host vanished (power loss, a cable pulled: no FIN, no RST) fails instead of waiting
// forever. TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged; keepalive
// probes, which start after half of `timeout` of silence, one every sixth of it, three in
// all, catch a connection that only receives. Whole seconds, at least 1. Returns 0, or
// the errno of the option that could not be set.
int set_keepalive(int fd, std::chrono::milliseconds timeout);

// What one call that moves bytes achieved.
enum class IoStatus {
  kDone,        // everything requested has moved
  kWouldBlock,  // some or none moved; the socket has no room (send) or no data (recv) now
  kClosed,      // the peer closed the connection (recv saw end of stream, send EPIPE/ECONNRESET)
  kError,       // another socket error; see `error`
};
struct IoResult {
  IoStatus status = IoStatus::kDone;
  int error = 0;  // errno for kError (and for kClosed when a send saw it)
};

// Sends bytes [*offset, size) of `data`, as many as the socket takes now, and advances
// *offset. Never blocks.
IoResult send_some(int fd, const void* data, size_t size, size_t* offset);
// The same over two consecutive parts (a message header, then its payload) in one system
// call, so that a small message costs one send and one TCP segment. *offset counts across
// both parts.
IoResult send_two_some(int fd, const void* first, size_t first_size, const void* second, size_t second_size,
                       size_t* offset);
// Receives into bytes [*offset, size) of `data`, as many as have arrived, and advances
// *offset. Never blocks.
IoResult recv_some(int fd, void* data, size_t size, size_t* offset);

// Waits up to `timeout` for `events` (POLLIN, POLLOUT) on one socket. Returns the
// revents (0 on timeout); POLLERR and POLLHUP are always reported.
short wait_for(int fd, short events, std::chrono::milliseconds timeout);

}  // namespace lgreco::transport
