#include "plugin/collective/socket_fabric.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "config/log.h"
#include "config/params.h"

namespace lgreco::collective {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using transport::Fd;
using transport::IoResult;
using transport::IoStatus;
using transport::ListenHandle;
using transport::Progress;
using transport::SocketAddress;
namespace wire = transport::wire;

std::string hex(uint64_t value) {
  char text[24];
  snprintf(text, sizeof text, "0x%016" PRIx64, value);
  return text;
}

milliseconds remaining(Clock::time_point deadline) {
  return std::max(milliseconds(0), std::chrono::ceil<milliseconds>(deadline - Clock::now()));
}

std::string ms_text(milliseconds t) { return std::to_string(t.count()) + " ms"; }

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// --- Rendezvous protocol --------------------------------------------------------------
//
// On one TCP connection from each rank r > 0 to rank 0 (little-endian fields):
//   r -> 0  Join     magic, version, world_size, rank            (kJoinBytes)
//   0 -> r  Welcome  magic, version, status, comm_id, world_size (kWelcomeBytes)
//   r -> 0  r's ListenHandle for that comm_id                    (sizeof(ListenHandle))
//   0 -> r  every rank's ListenHandle, in rank order             (world_size of them)
// Every size is known from the world size both sides agreed on, so no length is read
// off the wire. Rank r opens its listener only after the Welcome, because the handle
// must name the communicator, which rank 0 draws.

constexpr uint64_t kRendezvousMagic = 0x315a56444e524752;  // "RGRNDVZ1"
constexpr uint32_t kRendezvousVersion = 1;
constexpr size_t kJoinBytes = 24;
constexpr size_t kWelcomeBytes = 32;

enum class JoinStatus : uint32_t { kWelcome = 0, kVersionMismatch, kWorldSizeMismatch, kBadRank, kDuplicateRank };

struct Join {
  uint64_t magic = kRendezvousMagic;
  uint32_t version = kRendezvousVersion;
  uint32_t world_size = 0;
  int32_t rank = 0;
};

struct Welcome {
  uint64_t magic = kRendezvousMagic;
  uint32_t version = kRendezvousVersion;
  uint32_t status = 0;
  uint64_t comm_id = 0;
  uint32_t world_size = 0;
};

std::array<uint8_t, kJoinBytes> encode(const Join& join) {
  std::array<uint8_t, kJoinBytes> bytes{};
  uint8_t* p = bytes.data();
  wire::put(p, join.magic);
  wire::put(p, join.version);
  wire::put(p, join.world_size);
  wire::put(p, join.rank);
  return bytes;
}

Join decode_join(const uint8_t* in) {
  Join join;
  join.magic = wire::get<uint64_t>(in);
  join.version = wire::get<uint32_t>(in);
  join.world_size = wire::get<uint32_t>(in);
  join.rank = wire::get<int32_t>(in);
  return join;
}

std::array<uint8_t, kWelcomeBytes> encode(const Welcome& welcome) {
  std::array<uint8_t, kWelcomeBytes> bytes{};
  uint8_t* p = bytes.data();
  wire::put(p, welcome.magic);
  wire::put(p, welcome.version);
  wire::put(p, welcome.status);
  wire::put(p, welcome.comm_id);
  wire::put(p, welcome.world_size);
  return bytes;
}

Welcome decode_welcome(const uint8_t* in) {
  Welcome welcome;
  welcome.magic = wire::get<uint64_t>(in);
  welcome.version = wire::get<uint32_t>(in);
  welcome.status = wire::get<uint32_t>(in);
  welcome.comm_id = wire::get<uint64_t>(in);
  welcome.world_size = wire::get<uint32_t>(in);
  return welcome;
}

// What rendezvous leaves each rank with.
struct Rendezvous {
  uint64_t comm_id = 0;
  std::unique_ptr<transport::Listener> listener;  // this rank's data listener
  std::vector<ListenHandle> handles;              // every rank's, in rank order
};

// Checks a handle that came over the wire for rank `rank` of communicator `comm_id`.
std::string check_peer_handle(const ListenHandle& handle, uint64_t comm_id, int rank) {
  std::string why = transport::check_handle(handle);
  if (!why.empty()) return why;
  if (handle.comm_id != comm_id)
    return "its handle names communicator " + hex(handle.comm_id) + ", not " + hex(comm_id);
  if (handle.rank != rank) return "its handle names rank " + std::to_string(handle.rank);
  return "";
}

// Moves all of a buffer over a rendezvous socket, waiting at most until `deadline`.
// `context` starts every error message ("...: sending this rank's listen handle").
void send_all(int fd, const void* data, size_t size, Clock::time_point deadline, const std::string& context) {
  size_t offset = 0;
  for (;;) {
    const IoResult io = transport::send_some(fd, data, size, &offset);
    if (io.status == IoStatus::kDone) return;
    if (io.status == IoStatus::kClosed)
      throw FabricError(context + ": the connection was closed (the peer failed or gave up; see its log)");
    if (io.status == IoStatus::kError) throw FabricError(context + ": " + transport::errno_text(io.error));
    if (Clock::now() >= deadline) throw FabricError(context + ": timed out");
    transport::wait_for(fd, POLLOUT, std::min(remaining(deadline), milliseconds(100)));
  }
}

void recv_all(int fd, void* data, size_t size, Clock::time_point deadline, const std::string& context,
              const std::string& timeout_hint) {
  size_t offset = 0;
  for (;;) {
    const IoResult io = transport::recv_some(fd, data, size, &offset);
    if (io.status == IoStatus::kDone) return;
    if (io.status == IoStatus::kClosed)
      throw FabricError(context + ": the connection was closed after " + std::to_string(offset) + " of " +
                        std::to_string(size) + " bytes (the peer failed or gave up; see its log)");
    if (io.status == IoStatus::kError) throw FabricError(context + ": " + transport::errno_text(io.error));
    if (Clock::now() >= deadline) throw FabricError(context + ": timed out (" + timeout_hint + ")");
    transport::wait_for(fd, POLLIN, std::min(remaining(deadline), milliseconds(100)));
  }
}

// Rank r > 0 connects to rank 0, retrying with backoff: ranks start in any order.
Fd connect_to_rank0(const SocketAddress& master, const SocketFabricOptions& options, Clock::time_point deadline) {
  milliseconds backoff(10);
  int last_error = 0;
  int attempts = 0;
  for (;;) {
    ++attempts;
    int error = 0;
    Fd fd = transport::start_connect(master, &error);
    if (error == 0) {
      // Wait for this attempt, but not so long that a SYN lost to a not-yet-listening
      // host holds up the retries.
      const short revents = transport::wait_for(fd.get(), POLLOUT, std::min(remaining(deadline), milliseconds(1000)));
      error = revents ? transport::connect_result(fd.get()) : ETIMEDOUT;
      if (error == 0 && (revents & POLLOUT)) {
        transport::set_no_delay(fd.get());
        LGRECO_TRACE("NET", "socket fabric: rank %d reached rank 0 at %s after %d attempt(s)", options.rank,
                     master.str().c_str(), attempts);
        return fd;
      }
      if (error == 0) error = ECONNRESET;
    }
    last_error = error;
    if (remaining(deadline) <= backoff)
      throw FabricError(
          "socket fabric, rank " + std::to_string(options.rank) + ": rendezvous: cannot reach rank 0 at " +
          master.str() + " within " + ms_text(options.timeout) + " (" + std::to_string(attempts) +
          " attempts, last: " + transport::errno_text(last_error) +
          "): rank 0 has not started, has failed, or MASTER_ADDR/MASTER_PORT (LGRECO_RENDEZVOUS_PORT) are wrong");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(500));
  }
}

Rendezvous join_rendezvous(const SocketFabricOptions& options, const SocketAddress& master,
                           Clock::time_point deadline) {
  const std::string me =
      "socket fabric, rank " + std::to_string(options.rank) + ": rendezvous with rank 0 at " + master.str();
  Fd fd = connect_to_rank0(master, options, deadline);

  Join join;
  join.world_size = static_cast<uint32_t>(options.world_size);
  join.rank = options.rank;
  const auto join_bytes = encode(join);
  send_all(fd.get(), join_bytes.data(), join_bytes.size(), deadline, me + ": sending the join request");

  uint8_t welcome_bytes[kWelcomeBytes];
  recv_all(fd.get(), welcome_bytes, sizeof welcome_bytes, deadline, me + ": waiting for rank 0's answer",
           "whatever listens there does not answer like an lgreco rank 0: another service on that port, such as "
           "torchrun's agent store on MASTER_PORT? See LGRECO_RENDEZVOUS_PORT");
  const Welcome welcome = decode_welcome(welcome_bytes);
  if (welcome.magic != kRendezvousMagic)
    throw FabricError(me + ": what listens there is not an lgreco rank 0 (magic " + hex(welcome.magic) +
                      "); check MASTER_ADDR/MASTER_PORT");
  switch (static_cast<JoinStatus>(welcome.status)) {
    case JoinStatus::kWelcome: break;
    case JoinStatus::kVersionMismatch:
      throw FabricError(me + ": rank 0 speaks rendezvous version " + std::to_string(welcome.version) + ", this rank " +
                        std::to_string(kRendezvousVersion) + " (different lgreco versions in one job?)");
    case JoinStatus::kWorldSizeMismatch:
      throw FabricError(me + ": rank 0 has WORLD_SIZE=" + std::to_string(welcome.world_size) + ", this rank " +
                        std::to_string(options.world_size));
    case JoinStatus::kBadRank:
      throw FabricError(me + ": rank 0 refused rank " + std::to_string(options.rank) + " as out of range");
    case JoinStatus::kDuplicateRank:
      throw FabricError(me + ": another process has already joined as rank " + std::to_string(options.rank) +
                        " (two processes with the same RANK?)");
    default: throw FabricError(me + ": rank 0 refused this rank (status " + std::to_string(welcome.status) + ")");
  }
  if (welcome.version != kRendezvousVersion || welcome.world_size != static_cast<uint32_t>(options.world_size))
    throw FabricError(me + ": rank 0's answer does not match this rank's version and WORLD_SIZE");

  Rendezvous result;
  result.comm_id = welcome.comm_id;
  // Listen on the interface this rank reaches rank 0 through: the one the other ranks
  // can reach too (a wildcard address would not do for the handle).
  SocketAddress local = SocketAddress::local_of(fd.get());
  local.set_port(0);
  result.listener = transport::listen(local, {result.comm_id, options.rank});
  const ListenHandle& mine = result.listener->handle();
  send_all(fd.get(), &mine, sizeof mine, deadline, me + ": sending this rank's listen handle");

  result.handles.resize(static_cast<size_t>(options.world_size));
  recv_all(fd.get(), result.handles.data(), result.handles.size() * sizeof(ListenHandle), deadline,
           me + ": waiting for the table of all ranks", "not every rank has joined within " + ms_text(options.timeout));
  for (int r = 0; r < options.world_size; ++r) {
    const std::string why = check_peer_handle(result.handles[static_cast<size_t>(r)], result.comm_id, r);
    if (!why.empty())
      throw FabricError(me + ": rank 0 sent an unusable entry for rank " + std::to_string(r) + ": " + why);
  }
  return result;
}

// At most one WARN line per interval for an event that anyone who can reach a port can
// repeat at will (connections that are not ranks of this job): a port scanner must not
// fill the log, nor cost the rank its time writing one. The next line that is shown
// counts those left out.
class WarnLimiter {
 public:
  void warn(const std::string& message) {
    const auto now = Clock::now();
    if (now < next_) {
      ++left_out_;
      return;
    }
    next_ = now + kInterval;
    if (left_out_ > 0) {
      LGRECO_WARN("NET", "%s (and %llu similar line(s) left out before it)", message.c_str(),
                  static_cast<unsigned long long>(left_out_));
    } else {
      LGRECO_WARN("NET", "%s", message.c_str());
    }
    left_out_ = 0;
  }

 private:
  static constexpr milliseconds kInterval{1000};
  Clock::time_point next_ = Clock::time_point::min();
  uint64_t left_out_ = 0;
};

// Why accept() itself failed: a problem of this process or host (out of descriptors or
// memory), which calling it again at once does not cure and no peer is to blame for.
std::string accept_failure(int error) {
  std::string text = "accept() failed: " + transport::errno_text(error);
  if (error == EMFILE || error == ENFILE)
    return text + " (this process or the system is out of file descriptors: raise the limit, ulimit -n)";
  return text + " (a problem of this process or host, not of a peer)";
}

// Connections rank 0 serves at rendezvous beyond the ranks themselves (strays that have
// not said anything yet): a bound, so that a flood of them cannot use up descriptors.
constexpr size_t kMaxStrayConnections = 64;

// Rank 0's side: serves every joining rank at once over poll().
class RendezvousHost {
 public:
  RendezvousHost(const SocketFabricOptions& options, const SocketAddress& master, Clock::time_point deadline)
      : options_(options),
        master_(master),
        deadline_(deadline),
        handshake_timeout_(std::min(options.handshake_timeout, options.timeout)),
        me_("socket fabric, rank 0: rendezvous on " + master.str()) {}

  Rendezvous run() {
    // Every address of MASTER_ADDR's family, as torchrun's TCPStore does: the name may
    // resolve here to another address than on the other hosts (Debian and Ubuntu map the
    // host's own name to 127.0.1.1 in /etc/hosts, which no other host can reach).
    const SocketAddress any = SocketAddress::wildcard(master_.family(), master_.port());
    try {
      server_ = transport::listen_tcp(any, /*reuse_address=*/true);
    } catch (const transport::TransportError& e) {
      if (e.error_number() == EADDRINUSE)
        throw FabricError(me_ + ": port " + std::to_string(master_.port()) + " is already in use on this host (" +
                          e.what() +
                          "): by torchrun's agent store, another job, or a process of an earlier run. Set "
                          "LGRECO_RENDEZVOUS_PORT to a free port, the same on every rank");
      throw FabricError(me_ + ": " + e.what());
    }
    LGRECO_INFO("NET", "%s: listening on %s for %d rank(s)", me_.c_str(), any.str().c_str(), options_.world_size - 1);
    result_.comm_id = transport::random_id();
    result_.handles.resize(static_cast<size_t>(options_.world_size));

    std::vector<pollfd> fds;
    while (!finished()) {
      const auto now = Clock::now();
      if (now >= deadline_) throw FabricError(timeout_message());
      drop_silent_strays(now);
      fds.clear();
      const bool accepting = joined_ < options_.world_size - 1 && has_room();
      if (accepting) fds.push_back({server_.get(), POLLIN, 0});
      for (const Joiner& j : joiners_)
        if (j.stage != Stage::kWaiting && j.stage != Stage::kDone && j.stage != Stage::kDropped)
          fds.push_back({j.fd.get(), static_cast<short>(sending(j.stage) ? POLLOUT : POLLIN), 0});
      const milliseconds wait = std::min(remaining(deadline_), milliseconds(100));
      ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
      if (accepting) accept_new();
      for (Joiner& j : joiners_) step(j);
      std::erase_if(joiners_, [](const Joiner& j) { return j.stage == Stage::kDropped; });
      if (joined_ == options_.world_size - 1 && !table_ready_) start_table();
    }
    // Leaving closes the rendezvous listener and every rendezvous connection (RAII):
    // the rendezvous port is free again once the fabric exists.
    return std::move(result_);
  }

 private:
  enum class Stage { kJoin, kWelcome, kHandle, kWaiting, kTable, kDone, kDropped };
  static bool sending(Stage s) { return s == Stage::kWelcome || s == Stage::kTable; }

  struct Joiner {
    Fd fd;
    std::optional<SocketAddress> peer;
    std::string address;
    Clock::time_point since;  // when it was accepted
    Stage stage = Stage::kJoin;
    int rank = -1;
    size_t offset = 0;
    std::array<uint8_t, kJoinBytes> join{};
    std::array<uint8_t, kWelcomeBytes> welcome{};
    ListenHandle handle{};
  };

  // Every rank has its table. Connections that never joined (strays still in kJoin)
  // do not count; they close when the host goes.
  bool finished() const {
    if (!table_ready_) return false;
    return std::all_of(joiners_.begin(), joiners_.end(),
                       [](const Joiner& j) { return j.rank < 0 || j.stage == Stage::kDone; });
  }

  bool has_room() const {
    return joiners_.size() < static_cast<size_t>(options_.world_size - 1) + kMaxStrayConnections;
  }

  void accept_new() {
    while (has_room()) {
      int error = 0;
      Fd fd = transport::accept_tcp(server_.get(), &error);
      if (!fd.valid()) {
        if (error == EAGAIN) return;
        // Persistent (EMFILE...): waiting cannot help, and the ranks still missing are
        // not to blame.
        throw FabricError(me_ + ": " + accept_failure(error));
      }
      transport::set_no_delay(fd.get());
      Joiner j;
      try {
        j.peer = SocketAddress::peer_of(fd.get());
        j.address = j.peer->str();
      } catch (const transport::TransportError&) {
        j.address = "(unknown address)";
      }
      j.fd = std::move(fd);
      j.since = Clock::now();
      joiners_.push_back(std::move(j));
    }
  }

  // A genuine rank sends its join request as soon as it is connected: a connection that
  // has not within the handshake timeout is someone else's (a port scanner, a health
  // check) and goes, so that strays cannot pile up.
  void drop_silent_strays(Clock::time_point now) {
    for (Joiner& j : joiners_) {
      if (j.stage != Stage::kJoin || now - j.since < handshake_timeout_) continue;
      strays_.warn(me_ + ": a connection from " + j.address + " sent " + std::to_string(j.offset) + " of " +
                   std::to_string(kJoinBytes) + " join bytes within " + ms_text(handshake_timeout_) +
                   "; dropped (not an lgreco rank)");
      j.stage = Stage::kDropped;
    }
  }

  // Refuses a joining lgreco rank whose settings cannot work with this job's: it learns
  // why, and this rank fails too, because the job as started cannot run.
  [[noreturn]] void refuse(Joiner& j, JoinStatus status, const std::string& why) {
    Welcome welcome;
    welcome.status = static_cast<uint32_t>(status);
    welcome.world_size = static_cast<uint32_t>(options_.world_size);
    const auto bytes = encode(welcome);
    size_t offset = 0;
    (void)transport::send_some(j.fd.get(), bytes.data(), bytes.size(), &offset);
    throw FabricError(me_ + ": " + why);
  }

  void step(Joiner& j) {
    if (j.stage == Stage::kJoin) {
      const IoResult io = transport::recv_some(j.fd.get(), j.join.data(), j.join.size(), &j.offset);
      if (io.status == IoStatus::kWouldBlock) return;
      if (io.status != IoStatus::kDone) {
        // Not yet a rank of ours: someone connected and left (a port check). Not fatal.
        strays_.warn(me_ + ": a connection from " + j.address + " closed before it joined; ignored");
        j.stage = Stage::kDropped;
        return;
      }
      const Join join = decode_join(j.join.data());
      if (join.magic != kRendezvousMagic) {
        strays_.warn(me_ + ": a connection from " + j.address + " is not an lgreco rank (magic " + hex(join.magic) +
                     "); ignored");
        j.stage = Stage::kDropped;
        return;
      }
      const std::string who = "rank " + std::to_string(join.rank) + " (from " + j.address + ")";
      if (join.version != kRendezvousVersion)
        refuse(j, JoinStatus::kVersionMismatch,
               who + " speaks rendezvous version " + std::to_string(join.version) + ", this rank " +
                   std::to_string(kRendezvousVersion) + " (different lgreco versions in one job?)");
      if (join.world_size != static_cast<uint32_t>(options_.world_size))
        refuse(j, JoinStatus::kWorldSizeMismatch,
               who + " has WORLD_SIZE=" + std::to_string(join.world_size) + ", this rank " +
                   std::to_string(options_.world_size));
      if (join.rank < 1 || join.rank >= options_.world_size)
        refuse(j, JoinStatus::kBadRank, who + " is out of range for WORLD_SIZE " + std::to_string(options_.world_size));
      for (const Joiner& other : joiners_)
        if (&other != &j && other.rank == join.rank)
          refuse(j, JoinStatus::kDuplicateRank,
                 "two processes joined as rank " + std::to_string(join.rank) + " (from " + other.address + " and " +
                     j.address + ")");
      j.rank = join.rank;
      Welcome welcome;
      welcome.comm_id = result_.comm_id;
      welcome.world_size = static_cast<uint32_t>(options_.world_size);
      j.welcome = encode(welcome);
      j.stage = Stage::kWelcome;
      j.offset = 0;
    }
    if (j.stage == Stage::kWelcome) {
      const IoResult io = transport::send_some(j.fd.get(), j.welcome.data(), j.welcome.size(), &j.offset);
      if (io.status == IoStatus::kWouldBlock) return;
      if (io.status != IoStatus::kDone) throw FabricError(lost(j));
      j.stage = Stage::kHandle;
      j.offset = 0;
    }
    if (j.stage == Stage::kHandle) {
      const IoResult io = transport::recv_some(j.fd.get(), &j.handle, sizeof j.handle, &j.offset);
      if (io.status == IoStatus::kWouldBlock) return;
      if (io.status != IoStatus::kDone) throw FabricError(lost(j));
      const std::string why = check_peer_handle(j.handle, result_.comm_id, j.rank);
      if (!why.empty())
        throw FabricError(me_ + ": rank " + std::to_string(j.rank) + " sent an unusable handle: " + why);
      result_.handles[static_cast<size_t>(j.rank)] = j.handle;
      j.stage = Stage::kWaiting;
      ++joined_;
    }
    if (j.stage == Stage::kTable) {
      const IoResult io = transport::send_some(j.fd.get(), table_.data(), table_.size(), &j.offset);
      if (io.status == IoStatus::kWouldBlock) return;
      if (io.status != IoStatus::kDone) throw FabricError(lost(j));
      j.stage = Stage::kDone;
    }
  }

  std::string lost(const Joiner& j) const {
    return me_ + ": lost the connection to rank " + std::to_string(j.rank) + " (" + j.address +
           ") during rendezvous (it failed; see its log)";
  }

  // Every rank has joined: rank 0 opens its data listener and the table goes out.
  void start_table() {
    result_.listener = transport::listen(data_address(), {result_.comm_id, 0});
    result_.handles[0] = result_.listener->handle();
    table_.resize(result_.handles.size() * sizeof(ListenHandle));
    std::memcpy(table_.data(), result_.handles.data(), table_.size());
    for (Joiner& j : joiners_) {
      if (j.rank < 0) continue;  // a stray that has not joined
      j.stage = Stage::kTable;
      j.offset = 0;
    }
    table_ready_ = true;
  }

  // Where rank 0's data listener goes: the address the joiners reached this host at (the
  // local end of their rendezvous connections), which they can reach again, rather than
  // MASTER_ADDR as it resolves here. An address that other hosts can reach is preferred
  // over a loopback one.
  SocketAddress data_address() const {
    std::optional<SocketAddress> chosen;
    const Joiner* remote = nullptr;
    for (const Joiner& j : joiners_) {
      if (j.rank < 0) continue;
      const SocketAddress local = SocketAddress::local_of(j.fd.get()).unmapped();
      if (!chosen || (chosen->is_loopback() && !local.is_loopback())) chosen = local;
      if (j.peer && !j.peer->is_loopback()) remote = &j;
    }
    if (!chosen) chosen = master_;  // unreachable: start_table runs once every rank has joined
    if (chosen->is_loopback() && remote)
      LGRECO_WARN("NET",
                  "%s: rank 0's data listener is on the loopback address %s, but rank %d connected from %s: ranks "
                  "on other hosts will not reach it (check the addresses this host's name resolves to)",
                  me_.c_str(), chosen->str().c_str(), remote->rank, remote->address.c_str());
    chosen->set_port(0);
    return *chosen;
  }

  std::string timeout_message() const {
    std::vector<int> missing;
    for (int r = 1; r < options_.world_size; ++r)
      if (std::none_of(joiners_.begin(), joiners_.end(),
                       [r](const Joiner& j) { return j.rank == r && j.stage >= Stage::kWaiting; }))
        missing.push_back(r);
    if (missing.empty())
      return me_ + ": timed out after " + ms_text(options_.timeout) +
             " sending the table of all ranks (a rank stopped reading; see its log)";
    return me_ + ": timed out after " + ms_text(options_.timeout) + ": rank(s) " + rank_list(missing) +
           " did not join (not started, crashed, or started with another MASTER_ADDR/MASTER_PORT/WORLD_SIZE)";
  }

  const SocketFabricOptions& options_;
  const SocketAddress master_;
  const Clock::time_point deadline_;
  const milliseconds handshake_timeout_;
  const std::string me_;
  Fd server_;
  Rendezvous result_;
  std::vector<Joiner> joiners_;
  int joined_ = 0;
  bool table_ready_ = false;
  std::vector<uint8_t> table_;
  WarnLimiter strays_;
};

// --- Full mesh ------------------------------------------------------------------------

struct MeshPeer {
  std::unique_ptr<transport::SendComm> send;
  std::unique_ptr<transport::RecvComm> recv;
};

// Handshakes one rank runs side by side on its data listener; more connections wait in
// the kernel's backlog until one of these ends (completes, is refused or times out).
constexpr size_t kMaxHandshakes = 64;

// Every listener exists before its handle leaves its rank, so a refused connection here
// means a dead peer: no retries, unlike the rendezvous.
std::vector<MeshPeer> connect_mesh(const SocketFabricOptions& options, Rendezvous& rv, Clock::time_point deadline) {
  using transport::PendingAccept;
  const int me = options.rank;
  const int world = options.world_size;
  const std::string context = "socket fabric, rank " + std::to_string(me) + ": connecting to the other ranks";
  const milliseconds handshake_timeout = std::min(options.handshake_timeout, options.timeout);
  std::vector<MeshPeer> peers(static_cast<size_t>(world));
  // A connection's reply comes when its peer steps its accept, which it does once it has
  // left rendezvous too: the connects get the whole mesh deadline, and a second more, so
  // that the mesh's own timeout, which names every missing rank, comes first.
  std::vector<std::unique_ptr<transport::PendingConnect>> connects(static_cast<size_t>(world));
  for (int q = 0; q < world; ++q)
    if (q != me)
      connects[static_cast<size_t>(q)] = transport::connect(rv.handles[static_cast<size_t>(q)], {rv.comm_id, me},
                                                            remaining(deadline) + milliseconds(1000));
  // Every connection that waits is taken at once and handshakes beside the others, so a
  // connection that says nothing (a port scanner, a stray process) holds up no rank; it
  // is dropped at its handshake deadline, or when the mesh is complete.
  std::unique_ptr<PendingAccept> waiting = rv.listener->accept(handshake_timeout);
  std::vector<std::unique_ptr<PendingAccept>> handshakes;
  WarnLimiter dropped;
  int connected = 0, accepted = 0;

  std::vector<pollfd> fds;
  for (;;) {
    for (int q = 0; q < world; ++q) {
      auto& pending = connects[static_cast<size_t>(q)];
      if (!pending) continue;
      const Progress p = pending->step();
      if (p == Progress::kError) throw FabricError(context + ": " + pending->error());
      if (p == Progress::kDone) {
        peers[static_cast<size_t>(q)].send = pending->take();
        pending.reset();
        ++connected;
      }
    }
    while (accepted < world - 1 && handshakes.size() < kMaxHandshakes) {
      waiting->step();
      if (waiting->stage() == PendingAccept::Stage::kWaitingForConnection) break;  // none waits
      // accept() itself failing (EMFILE...) is this rank's problem and does not pass.
      if (waiting->accept_error() != 0) throw FabricError(context + ": " + waiting->error());
      handshakes.push_back(std::move(waiting));
      waiting = rv.listener->accept(handshake_timeout);
    }
    for (auto& h : handshakes) {
      const Progress p = h->step();
      if (p == Progress::kPending) continue;
      if (p == Progress::kError) {
        // Not one of this communicator's ranks, or too slow to say so: someone else's
        // business. A real absence ends in the timeout below.
        dropped.warn(context + ": dropped a connection: " + h->error());
      } else {
        std::unique_ptr<transport::RecvComm> comm = h->take();
        const int r = comm->peer_rank();
        if (r < 0 || r >= world || r == me || peers[static_cast<size_t>(r)].recv)
          throw FabricError(context + ": unexpected connection from " + comm->peer_name() +
                            " (two processes with the same RANK?)");
        peers[static_cast<size_t>(r)].recv = std::move(comm);
        ++accepted;
      }
      h.reset();
    }
    std::erase(handshakes, nullptr);
    if (connected == world - 1 && accepted == world - 1) return peers;  // strays still handshaking close here

    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> to, from;
      for (int q = 0; q < world; ++q) {
        if (q == me) continue;
        if (!peers[static_cast<size_t>(q)].send) to.push_back(q);
        if (!peers[static_cast<size_t>(q)].recv) from.push_back(q);
      }
      throw FabricError(context + ": timed out after " + ms_text(options.timeout) +
                        (to.empty() ? "" : "; no connection to rank(s) " + rank_list(to)) +
                        (from.empty() ? "" : "; no connection from rank(s) " + rank_list(from)) +
                        " (they failed or are stuck; see their logs)");
    }
    fds.clear();
    auto wake = std::min(deadline, now + milliseconds(100));
    for (const auto& pending : connects)
      if (pending) {
        fds.push_back({pending->fd(), pending->poll_events(), 0});
        wake = std::min(wake, pending->deadline());
      }
    for (const auto& h : handshakes) {
      fds.push_back({h->fd(), h->poll_events(), 0});
      wake = std::min(wake, h->deadline());
    }
    if (accepted < world - 1 && handshakes.size() < kMaxHandshakes)
      fds.push_back({waiting->fd(), waiting->poll_events(), 0});
    ::poll(fds.data(), fds.size(), static_cast<int>(remaining(wake).count()));
  }
}

// --- Options ---------------------------------------------------------------------------

// A strictly parsed integer environment variable in [low, high].
int64_t env_integer(const char* name, int64_t low, int64_t high) {
  const char* value = getenv(name);
  if (!value || !*value)
    throw std::invalid_argument(std::string(name) +
                                " is not set (the socket fabric reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, "
                                "as torchrun sets them)");
  int64_t parsed = 0;
  const char* end = value + strlen(value);
  const auto [stop, error] = std::from_chars(value, end, parsed);
  if (error != std::errc() || stop != end || parsed < low || parsed > high)
    throw std::invalid_argument(std::string(name) + "='" + value + "' is not an integer in [" + std::to_string(low) +
                                ", " + std::to_string(high) + "]");
  return parsed;
}

void check_options(const SocketFabricOptions& o) {
  if (o.world_size < 1)
    throw std::invalid_argument("socket fabric: world size " + std::to_string(o.world_size) + " < 1");
  if (o.rank < 0 || o.rank >= o.world_size)
    throw std::invalid_argument("socket fabric: rank " + std::to_string(o.rank) + " is not in [0, " +
                                std::to_string(o.world_size) + ")");
  if (o.timeout.count() <= 0) throw std::invalid_argument("socket fabric: the timeout must be positive");
  if (o.handshake_timeout.count() <= 0)
    throw std::invalid_argument("socket fabric: the handshake timeout must be positive");
  if (o.world_size > 1 && o.master_host.empty()) throw std::invalid_argument("socket fabric: no rendezvous host");
  if (o.world_size > 1 && o.master_port == 0) throw std::invalid_argument("socket fabric: rendezvous port 0");
}

}  // namespace

SocketFabricOptions SocketFabricOptions::from_env() {
  SocketFabricOptions o;
  const char* host = getenv("MASTER_ADDR");
  if (!host || !*host)
    throw std::invalid_argument(
        "MASTER_ADDR is not set (the socket fabric reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun "
        "sets them)");
  o.master_host = host;
  const int64_t master_port = env_integer("MASTER_PORT", 1, 65535);
  o.world_size = static_cast<int>(env_integer("WORLD_SIZE", 1, 1 << 20));
  o.rank = static_cast<int>(env_integer("RANK", 0, o.world_size - 1));
  o.timeout = std::chrono::seconds(config::params().timeout_seconds);  // LGRECO_TIMEOUT
  // The rendezvous port. Under torchrun the agent's TCPStore holds MASTER_PORT on rank
  // 0's host for the whole job, which the workers learn from
  // TORCHELASTIC_USE_AGENT_STORE=True: the rendezvous moves to the next port.
  const config::Params& params = config::params();
  const char* agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (!params.valid() && params.entry("LGRECO_RENDEZVOUS_PORT")->origin.kind != config::Origin::Kind::kDefault &&
      params.rendezvous_port == 0)
    throw std::invalid_argument("LGRECO_RENDEZVOUS_PORT=" + params.entry("LGRECO_RENDEZVOUS_PORT")->value +
                                ": not a port from 1 to 65535");
  if (params.rendezvous_port != 0) {
    o.master_port = static_cast<uint16_t>(params.rendezvous_port);
    LGRECO_INFO("NET", "socket fabric: rendezvous on port %u (LGRECO_RENDEZVOUS_PORT)",
                static_cast<unsigned>(o.master_port));
  } else if (agent_store && (strcmp(agent_store, "True") == 0 || strcmp(agent_store, "true") == 0)) {
    if (master_port == 65535)
      throw std::invalid_argument(
          "MASTER_PORT=65535 is held by torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) and the socket "
          "fabric's rendezvous would take the next port, which does not exist: set LGRECO_RENDEZVOUS_PORT");
    o.master_port = static_cast<uint16_t>(master_port + 1);
    LGRECO_INFO("NET",
                "socket fabric: torchrun's agent store holds MASTER_PORT=%lld (TORCHELASTIC_USE_AGENT_STORE=True): "
                "rendezvous on port %u instead (LGRECO_RENDEZVOUS_PORT sets another)",
                static_cast<long long>(master_port), static_cast<unsigned>(o.master_port));
  } else {
    o.master_port = static_cast<uint16_t>(master_port);
  }
  return o;
}

// --- SocketFabric ---------------------------------------------------------------------

std::unique_ptr<SocketFabric> SocketFabric::create(const SocketFabricOptions& options) {
  check_options(options);
  const auto start = Clock::now();
  std::vector<Peer> peers(static_cast<size_t>(options.world_size));
  uint64_t comm_id = 0;
  if (options.world_size == 1) {
    comm_id = transport::random_id();
  } else {
    try {
      const SocketAddress master = SocketAddress::resolve(options.master_host, options.master_port);
      Rendezvous rv = options.rank == 0 ? RendezvousHost(options, master, start + options.timeout).run()
                                        : join_rendezvous(options, master, start + options.timeout);
      // The mesh gets a full timeout of its own: a rank may leave rendezvous late.
      std::vector<MeshPeer> mesh = connect_mesh(options, rv, Clock::now() + options.timeout);
      for (size_t q = 0; q < mesh.size(); ++q) {
        peers[q].send = std::move(mesh[q].send);
        peers[q].recv = std::move(mesh[q].recv);
      }
      comm_id = rv.comm_id;
      // rv.listener closes here: every connection it was for is made.
    } catch (const transport::TransportError& e) {
      const std::string message = "socket fabric, rank " + std::to_string(options.rank) + ": " + e.what();
      LGRECO_WARN("NET", "%s", message.c_str());
      throw FabricError(message);
    } catch (const FabricError& e) {
      LGRECO_WARN("NET", "%s", e.what());
      throw;
    }
  }
  LGRECO_INFO("NET", "socket fabric: rank %d of %d, communicator %s, connected in %lld ms", options.rank,
              options.world_size, hex(comm_id).c_str(),
              static_cast<long long>(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count()));
  return std::unique_ptr<SocketFabric>(new SocketFabric(options, comm_id, std::move(peers)));
}

SocketFabric::SocketFabric(const SocketFabricOptions& options, uint64_t comm_id, std::vector<Peer> peers)
    : rank_(options.rank),
      world_size_(options.world_size),
      timeout_(options.timeout),
      comm_id_(comm_id),
      peers_(std::move(peers)),
      watch_(static_cast<size_t>(options.world_size)) {}

SocketFabric::~SocketFabric() = default;

// The bookkeeping every operation shares: it refuses to start on a broken fabric, and
// counts the call and its wall time however it ends.
class SocketFabric::Operation {
 public:
  Operation(SocketFabric& fabric, const char* op) : fabric_(fabric), start_(Clock::now()) {
    fabric.begin_operation(op);
  }
  ~Operation() { fabric_.end_operation(std::chrono::duration<double>(Clock::now() - start_).count()); }
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;

 private:
  SocketFabric& fabric_;
  const Clock::time_point start_;
};

void SocketFabric::begin_operation(const char* op) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_reason_.empty())
    throw FabricError("socket fabric, rank " + std::to_string(rank_) + ": " + op +
                      ": the fabric is broken by an earlier error: " + broken_reason_);
  in_operation_ = true;
}

void SocketFabric::end_operation(double seconds) {
  std::vector<Peer> closing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++counters_.calls;
    counters_.busy_seconds += seconds;
    in_operation_ = false;
    // abort() from another thread during this operation only shut the sockets down; an
    // operation that completed all the same leaves the closing to here.
    if (!broken_reason_.empty()) closing.swap(peers_);
  }
}

bool SocketFabric::broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !broken_reason_.empty();
}

void SocketFabric::fail(const char* op, const std::string& detail) {
  const std::string prefix = "socket fabric, rank " + std::to_string(rank_) + ": " + op + ": ";
  std::string message = prefix + detail;
  std::vector<Peer> closing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_reason_.empty()) {
      broken_reason_ = message;
      final_traffic_ = traffic_locked();
    } else if (!abort_reason_.empty()) {
      // abort() from another thread shut the sockets down under this operation: that is
      // the cause, not the closed connection the operation then saw.
      message = prefix + "aborted from another thread: " + abort_reason_;
    }
    closing.swap(peers_);
  }
  LGRECO_WARN("NET", "%s", message.c_str());
  // Closing every connection makes the peers fail at once (their sockets report the
  // close) instead of each waiting out its own timeout.
  closing.clear();
  throw FabricError(message);
}

void SocketFabric::abort(const std::string& why) {
  std::vector<Peer> closing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_reason_.empty()) return;
    broken_reason_ = "socket fabric, rank " + std::to_string(rank_) + ": aborted: " + why;
    abort_reason_ = why;
    final_traffic_ = traffic_locked();
    if (in_operation_) {
      // Another thread is inside an operation, using these comms without the lock: do
      // not close them under it. Shutting the sockets down wakes its poll(), fails its
      // transfers, and shows the peers a closed connection at once; the operation sees
      // the flag, throws, and closes the connections itself.
      for (const Peer& p : peers_) {
        if (p.send) p.send->shutdown();
        if (p.recv) p.recv->shutdown();
      }
      abort_requested_.store(true, std::memory_order_relaxed);
    } else {
      closing.swap(peers_);
    }
  }
  closing.clear();  // closed connections make the peers fail at once
}

std::vector<PeerTraffic> SocketFabric::traffic_locked() const {
  std::vector<PeerTraffic> traffic;
  for (int q = 0; q < static_cast<int>(peers_.size()); ++q) {
    const Peer& p = peers_[static_cast<size_t>(q)];
    if (!p.send || !p.recv) continue;
    traffic.push_back({q, p.send->counters(), p.recv->counters()});
  }
  return traffic;
}

std::vector<PeerTraffic> SocketFabric::peer_traffic() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_reason_.empty() ? traffic_locked() : final_traffic_;
}

FabricCounters SocketFabric::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

void SocketFabric::exchange(const char* op, std::vector<Transfer>& transfers) {
  try {
    drive(op, transfers);
  } catch (const FabricError&) {
    throw;
  } catch (const std::exception& e) {
    // The transport refused a request (std::invalid_argument for a null buffer, a
    // TransportError...): receives may be posted into the caller's buffers, so the
    // connections must go, as on any other error.
    fail(op, std::string("the transport refused a transfer: ") + e.what());
  }
}

void SocketFabric::drive(const char* op, std::vector<Transfer>& transfers) {
  // The tag is the exchange's sequence number, the same on every rank as long as they
  // make the same calls; the transport refuses a message with another tag.
  const int tag = next_tag_;
  next_tag_ = (next_tag_ + 1) & 0x7fffffff;

  auto wire_bytes = [this](int q) {
    const Peer& p = peers_[static_cast<size_t>(q)];
    return p.send->counters().wire_bytes + p.recv->counters().wire_bytes;
  };
  const auto start = Clock::now();
  for (const Transfer& t : transfers) watch_[static_cast<size_t>(t.peer)] = {wire_bytes(t.peer), start};

  for (;;) {
    if (abort_requested_.load(std::memory_order_relaxed)) fail(op, "aborted from another thread");
    size_t pending = 0;
    bool unposted = false;
    for (Transfer& t : transfers) {
      if (t.done) continue;
      Peer& p = peers_[static_cast<size_t>(t.peer)];
      if (!t.request) {
        void* buffer = t.data;
        t.request = t.is_send ? p.send->isend(t.data, t.bytes, tag) : p.recv->irecv(1, &buffer, &t.bytes, &tag);
        if (!t.request) {  // the comm's request pool is full: post on a later round
          ++pending;
          unposted = true;
          continue;
        }
      }
      bool done = false;
      uint64_t size = 0;
      const Progress progress =
          t.is_send ? p.send->test(t.request, &done, &size) : p.recv->test(t.request, &done, &size);
      if (progress == Progress::kError) fail(op, t.is_send ? p.send->error() : p.recv->error());
      if (progress == Progress::kPending) {
        ++pending;
        continue;
      }
      t.done = true;
      t.request = nullptr;
      if (!t.is_send && size != t.bytes)
        fail(op, "rank " + std::to_string(t.peer) + " sent " + std::to_string(size) +
                     " bytes where this rank expected " + std::to_string(t.bytes) +
                     " (the ranks disagree on the byte counts: mismatched LGRECO_* settings between ranks?)");
    }
    if (pending == 0) break;

    // A peer that moves no bytes at all, in either direction, for the timeout is stuck,
    // dead without closing (a hung host), or in another call.
    const auto now = Clock::now();
    auto wait = milliseconds(1000);
    for (const Transfer& t : transfers) {
      if (t.done) continue;
      Watch& w = watch_[static_cast<size_t>(t.peer)];
      const uint64_t seen = wire_bytes(t.peer);
      if (seen != w.seen) {
        w.seen = seen;
        w.last = now;
      } else if (now - w.last >= timeout_) {
        const std::string q = "rank " + std::to_string(t.peer);
        fail(op, (t.is_send ? q + " has taken no data for " : q + " has sent nothing for ") + ms_text(timeout_) + " (" +
                     q + " is stuck, much slower, or dead, or the ranks disagree on the sequence of calls)");
      }
      wait = std::min(wait, std::chrono::ceil<milliseconds>(w.last + timeout_ - now));
    }

    pollfds_.clear();
    for (const Transfer& t : transfers) {
      if (t.done || !t.request) continue;
      const Peer& p = peers_[static_cast<size_t>(t.peer)];
      pollfds_.push_back(t.is_send ? pollfd{p.send->fd(), POLLOUT, 0} : pollfd{p.recv->fd(), POLLIN, 0});
    }
    if (unposted) wait = milliseconds(1);
    ::poll(pollfds_.data(), pollfds_.size(), static_cast<int>(std::max(wait, milliseconds(1)).count()));
  }

  uint64_t sent = 0, received = 0;
  for (const Transfer& t : transfers) (t.is_send ? sent : received) += t.bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.bytes_sent += sent;
  counters_.bytes_received += received;
}

namespace {

// Byte offsets of consecutive blocks of the given sizes.
void prefix_offsets(std::span<const uint64_t> bytes, std::vector<uint64_t>& offsets) {
  offsets.resize(bytes.size());
  uint64_t at = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    offsets[i] = at;
    at += bytes[i];
  }
}

}  // namespace

void SocketFabric::all_to_all_v(const uint8_t* send, std::span<const uint64_t> send_bytes, uint8_t* recv,
                                std::span<const uint64_t> recv_bytes) {
  constexpr const char* op = "all_to_all_v";
  Operation guard(*this, op);
  const size_t world = static_cast<size_t>(world_size_);
  if (send_bytes.size() != world || recv_bytes.size() != world)
    fail(op, "byte counts for " + std::to_string(send_bytes.size()) + " and " + std::to_string(recv_bytes.size()) +
                 " ranks in a world of " + std::to_string(world));
  const size_t me = static_cast<size_t>(rank_);
  if (send_bytes[me] != recv_bytes[me])
    fail(op, "this rank sends itself " + std::to_string(send_bytes[me]) + " bytes but expects " +
                 std::to_string(recv_bytes[me]));
  prefix_offsets(send_bytes, send_offsets_);
  prefix_offsets(recv_bytes, recv_offsets_);
  if (send_bytes[me] > 0) std::memmove(recv + recv_offsets_[me], send + send_offsets_[me], send_bytes[me]);
  if (world == 1) return;

  transfers_.clear();
  // Starting with the next rank spreads the traffic: not everyone serves rank 0 first.
  for (size_t k = 1; k < world; ++k) {
    const size_t q = (me + k) % world;
    transfers_.push_back({static_cast<int>(q), false, recv + recv_offsets_[q], recv_bytes[q]});
    transfers_.push_back({static_cast<int>(q), true, const_cast<uint8_t*>(send) + send_offsets_[q], send_bytes[q]});
  }
  exchange(op, transfers_);
}

void SocketFabric::all_gather_v(const uint8_t* send, std::span<const uint64_t> bytes, uint8_t* recv) {
  constexpr const char* op = "all_gather_v";
  Operation guard(*this, op);
  const size_t world = static_cast<size_t>(world_size_);
  if (bytes.size() != world)
    fail(op, "byte counts for " + std::to_string(bytes.size()) + " ranks in a world of " + std::to_string(world));
  const size_t me = static_cast<size_t>(rank_);
  prefix_offsets(bytes, recv_offsets_);
  if (bytes[me] > 0) std::memmove(recv + recv_offsets_[me], send, bytes[me]);
  if (world == 1) return;

  transfers_.clear();
  for (size_t k = 1; k < world; ++k) {
    const size_t q = (me + k) % world;
    transfers_.push_back({static_cast<int>(q), false, recv + recv_offsets_[q], bytes[q]});
    transfers_.push_back({static_cast<int>(q), true, const_cast<uint8_t*>(send), bytes[me]});
  }
  exchange(op, transfers_);
}

void SocketFabric::all_reduce_sum(std::span<float> data) { reduce_sum(data, "all_reduce_sum(float)"); }
void SocketFabric::all_reduce_sum(std::span<double> data) { reduce_sum(data, "all_reduce_sum(double)"); }

// Every element is summed in rank order, ((x0 + x1) + x2) + ..., in T, by exactly one
// rank or identically by all, so every rank ends with the same bits.
//
// Small buffers: all-gather everything, then every rank sums locally (one round trip).
// Large buffers: reduce-scatter then all-gather. Rank c owns chunk c of the elements; it
// receives chunk c from every rank, sums in rank order, and sends the sum to everyone.
// Each rank sends and receives about 2 (P-1)/P of the buffer, instead of (P-1) times it.
template <typename T>
void SocketFabric::reduce_sum(std::span<T> data, const char* op) {
  Operation guard(*this, op);
  const size_t world = static_cast<size_t>(world_size_);
  const size_t me = static_cast<size_t>(rank_);
  const size_t n = data.size();
  if (world == 1 || n == 0) return;
  uint8_t* const bytes = reinterpret_cast<uint8_t*>(data.data());
  // Values are read from received bytes with memcpy: no object of type T lives there.
  auto load = [](const uint8_t* at) {
    T v;
    std::memcpy(&v, at, sizeof v);
    return v;
  };

  constexpr size_t kSmallBytes = 64 * 1024;
  if (n * sizeof(T) <= kSmallBytes || n < world) {
    const uint64_t size = n * sizeof(T);
    scratch_.resize(world * size);
    std::memcpy(scratch_.data() + me * size, bytes, size);
    transfers_.clear();
    for (size_t k = 1; k < world; ++k) {
      const size_t q = (me + k) % world;
      transfers_.push_back({static_cast<int>(q), false, scratch_.data() + q * size, size});
      transfers_.push_back({static_cast<int>(q), true, bytes, size});
    }
    exchange(op, transfers_);
    for (size_t i = 0; i < n; ++i) {
      T sum = load(scratch_.data() + i * sizeof(T));
      for (size_t q = 1; q < world; ++q) sum += load(scratch_.data() + q * size + i * sizeof(T));
      data[i] = sum;
    }
    return;
  }

  // Chunk c: elements [begin(c), begin(c) + length(c)); the first n % P chunks are one longer.
  const size_t base = n / world, extra = n % world;
  auto begin = [&](size_t c) { return c * base + std::min(c, extra); };
  auto length = [&](size_t c) { return base + (c < extra ? 1 : 0); };
  const size_t mine = length(me);
  const uint64_t mine_bytes = mine * sizeof(T);
  uint8_t* const my_chunk = bytes + begin(me) * sizeof(T);

  // Reduce-scatter: chunk q of this rank's data to rank q; this rank's chunk from every rank.
  scratch_.resize(world * mine_bytes);
  transfers_.clear();
  for (size_t k = 1; k < world; ++k) {
    const size_t q = (me + k) % world;
    transfers_.push_back({static_cast<int>(q), false, scratch_.data() + q * mine_bytes, mine_bytes});
    transfers_.push_back({static_cast<int>(q), true, bytes + begin(q) * sizeof(T), length(q) * sizeof(T)});
  }
  exchange(op, transfers_);
  for (size_t i = 0; i < mine; ++i) {
    auto value = [&](size_t q) {
      return load(q == me ? my_chunk + i * sizeof(T) : scratch_.data() + q * mine_bytes + i * sizeof(T));
    };
    T sum = value(0);
    for (size_t q = 1; q < world; ++q) sum += value(q);
    std::memcpy(my_chunk + i * sizeof(T), &sum, sizeof sum);
  }

  // All-gather: this rank's summed chunk to everyone; chunk q from rank q.
  transfers_.clear();
  for (size_t k = 1; k < world; ++k) {
    const size_t q = (me + k) % world;
    transfers_.push_back({static_cast<int>(q), false, bytes + begin(q) * sizeof(T), length(q) * sizeof(T)});
    transfers_.push_back({static_cast<int>(q), true, my_chunk, mine_bytes});
  }
  exchange(op, transfers_);
}

}  // namespace lgreco::collective
