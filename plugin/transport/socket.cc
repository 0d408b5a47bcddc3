#include "plugin/transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace lgreco::transport {

std::string errno_text(int error) {
  char buffer[256];
  // The GNU strerror_r returns a pointer to the text, which may or may not be `buffer`.
  return strerror_r(error, buffer, sizeof buffer);
}

void Fd::reset(int fd) {
  if (fd_ >= 0 && fd_ != fd) {
    // The descriptor is gone whatever close() returns (EINTR included, on Linux), so
    // retrying could close a descriptor another thread has just been given.
    ::close(fd_);
  }
  fd_ = fd;
}

// --- SocketAddress --------------------------------------------------------------------

SocketAddress SocketAddress::resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0) {
    throw TransportError("cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, &freeaddrinfo);
  const addrinfo* chosen = nullptr;
  for (const addrinfo* a = found; a; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      chosen = a;
      break;
    }
    if (a->ai_family == AF_INET6 && !chosen) chosen = a;
  }
  if (!chosen) throw TransportError("host '" + host + "' has no IPv4 or IPv6 address");
  std::optional<SocketAddress> address = from_bytes(chosen->ai_addr, chosen->ai_addrlen);
  if (!address) throw TransportError("host '" + host + "' resolved to an unusable address");
  address->set_port(port);
  return *address;
}

std::optional<SocketAddress> SocketAddress::from_bytes(const void* data, size_t length) {
  if (!data || length < sizeof(sa_family_t) || length > kMaxBytes) return std::nullopt;
  SocketAddress address;
  std::memcpy(&address.storage_, data, length);
  const sa_family_t family = address.storage_.any.sa_family;
  if (!(family == AF_INET && length == sizeof(sockaddr_in)) && !(family == AF_INET6 && length == sizeof(sockaddr_in6)))
    return std::nullopt;
  address.length_ = static_cast<socklen_t>(length);
  return address;
}

namespace {

template <typename GetName>
SocketAddress name_of(int fd, GetName get_name, const char* what) {
  sockaddr_storage storage{};
  socklen_t length = sizeof storage;
  if (get_name(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0)
    throw TransportError(std::string(what) + " failed: " + errno_text(errno));
  std::optional<SocketAddress> address = SocketAddress::from_bytes(&storage, length);
  if (!address) throw TransportError(std::string(what) + " returned an address that is neither IPv4 nor IPv6");
  return *address;
}

}  // namespace

SocketAddress SocketAddress::local_of(int fd) { return name_of(fd, ::getsockname, "getsockname"); }
SocketAddress SocketAddress::peer_of(int fd) { return name_of(fd, ::getpeername, "getpeername"); }

uint16_t SocketAddress::port() const {
  if (family() == AF_INET) return ntohs(storage_.v4.sin_port);
  if (family() == AF_INET6) return ntohs(storage_.v6.sin6_port);
  return 0;
}

void SocketAddress::set_port(uint16_t port) {
  if (family() == AF_INET) storage_.v4.sin_port = htons(port);
  if (family() == AF_INET6) storage_.v6.sin6_port = htons(port);
}

SocketAddress SocketAddress::wildcard(int family, uint16_t port) {
  SocketAddress address;
  if (family == AF_INET) {
    address.storage_.v4.sin_family = AF_INET;
    address.storage_.v4.sin_addr.s_addr = htonl(INADDR_ANY);
    address.length_ = sizeof(sockaddr_in);
  } else if (family == AF_INET6) {
    address.storage_.v6.sin6_family = AF_INET6;
    address.storage_.v6.sin6_addr = in6addr_any;
    address.length_ = sizeof(sockaddr_in6);
  } else {
    throw TransportError("no wildcard address for address family " + std::to_string(family));
  }
  address.set_port(port);
  return address;
}

bool SocketAddress::is_loopback() const {
  if (family() == AF_INET) return (ntohl(storage_.v4.sin_addr.s_addr) >> 24) == 127;
  if (family() == AF_INET6) {
    const in6_addr& a = storage_.v6.sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

SocketAddress SocketAddress::unmapped() const {
  if (family() != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&storage_.v6.sin6_addr)) return *this;
  SocketAddress address;
  address.storage_.v4.sin_family = AF_INET;
  address.storage_.v4.sin_port = storage_.v6.sin6_port;
  std::memcpy(&address.storage_.v4.sin_addr, &storage_.v6.sin6_addr.s6_addr[12], 4);
  address.length_ = sizeof(sockaddr_in);
  return address;
}

bool SocketAddress::is_wildcard() const {
  if (family() == AF_INET) return storage_.v4.sin_addr.s_addr == htonl(INADDR_ANY);
  if (family() == AF_INET6) return IN6_IS_ADDR_UNSPECIFIED(&storage_.v6.sin6_addr);
  return false;
}

std::string SocketAddress::str() const {
  char text[INET6_ADDRSTRLEN] = {};
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &storage_.v4.sin_addr, text, sizeof text);
    return std::string(text) + ":" + std::to_string(port());
  }
  if (family() == AF_INET6) {
    inet_ntop(AF_INET6, &storage_.v6.sin6_addr, text, sizeof text);
    return "[" + std::string(text) + "]:" + std::to_string(port());
  }
  return "(none)";
}

// --- Making sockets -------------------------------------------------------------------

namespace {

Fd make_socket(int family) {
  Fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    const int error = errno;
    throw TransportError("cannot create a TCP socket: " + errno_text(error), error);
  }
  return fd;
}

// Errors accept(2) reports for a connection that failed before it was taken (Linux passes
// the network errors of the new socket on, and tells callers to treat them like EAGAIN).
bool connection_already_failed(int error) {
  switch (error) {
    case ECONNABORTED:
    case EPROTO:
    case ENETDOWN:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH: return true;
    default: return false;
  }
}

}  // namespace

Fd listen_tcp(const SocketAddress& address, bool reuse_address) {
  if (address.empty()) throw TransportError("cannot listen: no address given");
  Fd fd = make_socket(address.family());
  const int one = 1;
  if (reuse_address && setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
    const int error = errno;
    throw TransportError("cannot set SO_REUSEADDR on a socket for " + address.str() + ": " + errno_text(error), error);
  }
  if (::bind(fd.get(), address.get(), address.length()) != 0) {
    const int error = errno;
    throw TransportError("cannot bind to " + address.str() + ": " + errno_text(error), error);
  }
  // SOMAXCONN: a rank-0 rendezvous listener may see every rank of a large job at once.
  if (::listen(fd.get(), SOMAXCONN) != 0) {
    const int error = errno;
    throw TransportError("cannot listen on " + address.str() + ": " + errno_text(error), error);
  }
  return fd;
}

Fd start_connect(const SocketAddress& address, int* error) {
  Fd fd = make_socket(address.family());
  *error = 0;
  if (::connect(fd.get(), address.get(), address.length()) == 0) return fd;
  // EINPROGRESS is the normal answer of a non-blocking connect; EINTR means the same.
  if (errno == EINPROGRESS || errno == EINTR) return fd;
  *error = errno;
  return Fd();
}

int connect_result(int fd) {
  int error = 0;
  socklen_t length = sizeof error;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) return errno;
  return error;
}

Fd accept_tcp(int listen_fd, int* error) {
  // Bounded, so that a flood of connections reset before they are taken cannot hold the
  // caller here: after that many, report "none waiting" and let it poll again.
  for (int skipped = 0; skipped < 64;) {
    Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd.valid()) {
      *error = 0;
      return fd;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    if (connection_already_failed(errno)) {
      ++skipped;  // that connection is gone; the next one may be fine
      continue;
    }
    *error = errno;
    return Fd();
  }
  *error = EAGAIN;
  return Fd();
}

void set_no_delay(int fd) {
  const int one = 1;
  // A failure only costs latency: not worth failing a connection for.
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int set_keepalive(int fd, std::chrono::milliseconds timeout) {
  const int64_t seconds = std::max<int64_t>(1, timeout.count() / 1000);
  const int one = 1;
  const int idle = static_cast<int>(std::clamp<int64_t>(seconds / 2, 1, 32767));  // kernel maximum
  const int interval = static_cast<int>(std::clamp<int64_t>(seconds / 6, 1, 32767));
  const int count = 3;
  const unsigned user_timeout = static_cast<unsigned>(std::clamp<int64_t>(timeout.count(), 1, INT32_MAX));
  if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout) != 0)
    return errno;
  return 0;
}

// --- Moving bytes ---------------------------------------------------------------------

namespace {

IoResult classify_send_error(int error) {
  if (error == EAGAIN || error == EWOULDBLOCK) return {IoStatus::kWouldBlock, 0};
  if (error == EPIPE || error == ECONNRESET) return {IoStatus::kClosed, error};
  return {IoStatus::kError, error};
}

}  // namespace

IoResult send_some(int fd, const void* data, size_t size, size_t* offset) {
  return send_two_some(fd, data, size, nullptr, 0, offset);
}

IoResult send_two_some(int fd, const void* first, size_t first_size, const void* second, size_t second_size,
                       size_t* offset) {
  const size_t total = first_size + second_size;
  while (*offset < total) {
    iovec parts[2];
    int count = 0;
    if (*offset < first_size) {
      parts[count++] = {const_cast<uint8_t*>(static_cast<const uint8_t*>(first)) + *offset, first_size - *offset};
      if (second_size > 0) parts[count++] = {const_cast<void*>(second), second_size};
    } else {
      const size_t at = *offset - first_size;
      parts[count++] = {const_cast<uint8_t*>(static_cast<const uint8_t*>(second)) + at, second_size - at};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = count;
    // The kernel moves at most about 2 GiB per call; the loop moves the rest.
    const ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return classify_send_error(errno);
    }
    *offset += static_cast<size_t>(sent);
  }
  return {IoStatus::kDone, 0};
}

IoResult recv_some(int fd, void* data, size_t size, size_t* offset) {
  while (*offset < size) {
    const ssize_t got = ::recv(fd, static_cast<uint8_t*>(data) + *offset, size - *offset, 0);
    if (got > 0) {
      *offset += static_cast<size_t>(got);
      continue;
    }
    if (got == 0) return {IoStatus::kClosed, 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return {IoStatus::kWouldBlock, 0};
    if (errno == ECONNRESET) return {IoStatus::kClosed, errno};
    return {IoStatus::kError, errno};
  }
  return {IoStatus::kDone, 0};
}

short wait_for(int fd, short events, std::chrono::milliseconds timeout) {
  pollfd entry{fd, events, 0};
  const int ms = static_cast<int>(std::clamp<int64_t>(timeout.count(), 0, 1 << 30));
  const int rc = ::poll(&entry, 1, ms);
  return rc > 0 ? entry.revents : 0;
}

}  // namespace lgreco::transport
