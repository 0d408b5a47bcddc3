// NetPlugin (plugin/net/net_plugin.h) driven directly, in one process over loopback, the
// way NCCL's proxy drives a net plugin: listen, connect/accept polled until both return a
// comm, regMr, isend/irecv retried while they return no request, test polled. The
// exported tables and the dlopen path are exercised by the net_plugin suite (harness
// processes); this suite checks the adapter's own logic.
#include <sys/socket.h>
#include <unistd.h>

#include <boost/test/data/monomorphic.hpp>
#include <boost/test/data/test_case.hpp>
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "plugin/net/net_plugin.h"
#include "plugin/net/telemetry.h"
#include "plugin/transport/socket.h"

namespace lgreco::net {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

NetPlugin::Options loopback_options(Registry* telemetry = nullptr, int sockets = 1, int helper_threads = 0) {
  NetPlugin::Options options;
  options.devices.push_back(Device{"lo", transport::SocketAddress::resolve("127.0.0.1", 0), "", 10000, 7});
  options.sockets_per_connection = sockets;
  options.helper_threads = helper_threads;
  options.handshake_timeout = 5s;
  options.telemetry = telemetry;
  return options;
}

struct Pair {
  void* listen_comm = nullptr;
  void* send_comm = nullptr;
  void* recv_comm = nullptr;
  alignas(8) unsigned char handle[abi::kHandleMaxBytes];
};

// listen, then connect and accept polled alternately (NCCL runs them in two processes).
void connect_pair(NetPlugin& plugin, Pair& pair, uint64_t comm_id = 42) {
  std::memset(pair.handle, 0xA5, sizeof pair.handle);
  BOOST_REQUIRE_EQUAL(plugin.listen(comm_id, 0, pair.handle, &pair.listen_comm), nccl::kSuccess);
  BOOST_REQUIRE(pair.listen_comm);
  // The bytes past the transport's handle are zeroed, not left as NCCL's garbage.
  for (size_t i = sizeof(transport::ListenHandle); i < sizeof pair.handle; ++i) BOOST_REQUIRE_EQUAL(pair.handle[i], 0);
  const auto deadline = Clock::now() + 10s;
  while ((!pair.send_comm || !pair.recv_comm) && Clock::now() < deadline) {
    if (!pair.send_comm) BOOST_REQUIRE_EQUAL(plugin.connect(comm_id, 0, pair.handle, &pair.send_comm), nccl::kSuccess);
    if (!pair.recv_comm) BOOST_REQUIRE_EQUAL(plugin.accept(pair.listen_comm, &pair.recv_comm), nccl::kSuccess);
  }
  BOOST_REQUIRE_MESSAGE(pair.send_comm && pair.recv_comm, "connect/accept did not finish within 10 s");
  BOOST_CHECK_EQUAL(plugin.pending_connects(), 0u);
}

void close_pair(NetPlugin& plugin, Pair& pair) {
  BOOST_CHECK_EQUAL(plugin.close_send(pair.send_comm), nccl::kSuccess);
  BOOST_CHECK_EQUAL(plugin.close_recv(pair.recv_comm), nccl::kSuccess);
  BOOST_CHECK_EQUAL(plugin.close_listen(pair.listen_comm), nccl::kSuccess);
}

// Polls test() on both requests until both are done; returns the sizes test() reported.
void wait_both(NetPlugin& plugin, void* send_request, void* recv_request, int* sent_size, int* received_sizes) {
  bool send_done = false, recv_done = false;
  const auto deadline = Clock::now() + 20s;
  while ((!send_done || !recv_done) && Clock::now() < deadline) {
    int done = 0;
    if (!send_done) {
      BOOST_REQUIRE_EQUAL(plugin.test(send_request, &done, sent_size), nccl::kSuccess);
      send_done = done;
    }
    if (!recv_done) {
      BOOST_REQUIRE_EQUAL(plugin.test(recv_request, &done, received_sizes), nccl::kSuccess);
      recv_done = done;
    }
  }
  BOOST_REQUIRE_MESSAGE(send_done && recv_done, "requests not done within 20 s");
}

std::vector<unsigned char> random_bytes(size_t n, std::mt19937_64& rng) {
  std::vector<unsigned char> bytes(n);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(net_adapter)

BOOST_AUTO_TEST_CASE(properties_say_what_the_transport_does) {
  NetPlugin plugin(loopback_options());
  BOOST_REQUIRE_EQUAL(plugin.device_count(), 1);
  abi::Properties_v11 props;
  std::memset(&props, 0x5A, sizeof props);
  BOOST_REQUIRE_EQUAL(plugin.properties(0, &props), nccl::kSuccess);
  BOOST_CHECK_EQUAL(std::string(props.name), "lo");
  BOOST_CHECK(props.pciPath == nullptr);  // a virtual interface has no PCI device
  BOOST_CHECK_EQUAL(props.guid, 7u);
  BOOST_CHECK_EQUAL(props.ptrSupport, abi::kPtrHost);
  BOOST_CHECK_EQUAL(props.speed, 10000);
  BOOST_CHECK_EQUAL(props.maxRecvs, 1);  // no grouped receives from NCCL: no head-of-line blocking
  BOOST_CHECK_EQUAL(props.netDeviceType, abi::kDeviceHost);
  BOOST_CHECK_EQUAL(props.vProps.ndevs, 1);
  BOOST_CHECK_EQUAL(props.vProps.devs[0], 0);
  BOOST_CHECK_EQUAL(props.maxP2pBytes, NetPlugin::kMaxMessageBytes);
  BOOST_CHECK_EQUAL(props.maxMultiRequestSize, 1);
  BOOST_CHECK_EQUAL(plugin.properties(1, &props), nccl::kInvalidArgument);
  BOOST_CHECK_EQUAL(plugin.properties(-1, &props), nccl::kInvalidArgument);
}

// With one socket moved by test(), and with 4 sockets moved by 2 helper threads.
BOOST_DATA_TEST_CASE(messages_of_many_sizes_arrive_intact, boost::unit_test::data::make({1, 4}), sockets) {
  NetPlugin plugin(loopback_options(nullptr, sockets, sockets / 2));
  Pair pair;
  connect_pair(plugin, pair);
  // The listen handle carries the socket count to the connecting side.
  transport::ListenHandle handle;
  std::memcpy(&handle, pair.handle, sizeof handle);
  BOOST_CHECK_EQUAL(handle.socket_count, sockets);
  void* send_mr = nullptr;
  void* recv_mr = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.reg_mr(pair.send_comm, pair.handle, 1, abi::kPtrHost, &send_mr), nccl::kSuccess);
  BOOST_REQUIRE_EQUAL(plugin.reg_mr(pair.recv_comm, pair.handle, 1, abi::kPtrHost, &recv_mr), nccl::kSuccess);
  BOOST_CHECK(send_mr != nullptr);
  std::mt19937_64 rng(std::random_device{}());
  for (size_t size : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{65537}, size_t{3} << 20, size_t{1},
                      size_t{(3 << 20) + 5}}) {
    const std::vector<unsigned char> data = random_bytes(size, rng);
    std::vector<unsigned char> received(size + 64, 0xEE);  // poisoned, larger than the message
    const int tag = static_cast<int>(rng() % 1000);
    void* send_request = nullptr;
    void* recv_request = nullptr;
    void* buffers[1] = {received.data()};
    const size_t room[1] = {received.size()};
    const int tags[1] = {tag};
    BOOST_REQUIRE_EQUAL(plugin.irecv(pair.recv_comm, 1, buffers, room, tags, &recv_request), nccl::kSuccess);
    BOOST_REQUIRE_EQUAL(plugin.isend(pair.send_comm, const_cast<unsigned char*>(data.data()), size, tag,
                                     &send_request), nccl::kSuccess);
    BOOST_REQUIRE(send_request && recv_request);
    int sent = -1, got[1] = {-1};
    wait_both(plugin, send_request, recv_request, &sent, got);
    BOOST_CHECK_EQUAL(sent, static_cast<int>(size));
    BOOST_CHECK_EQUAL(got[0], static_cast<int>(size));
    BOOST_CHECK(std::equal(data.begin(), data.end(), received.begin()));
    BOOST_CHECK(std::all_of(received.begin() + size, received.end(), [](unsigned char b) { return b == 0xEE; }));
    // A finished request is no longer NCCL's to test.
    int done = 0;
    BOOST_CHECK_EQUAL(plugin.test(send_request, &done, nullptr), nccl::kInvalidArgument);
  }
  BOOST_CHECK_EQUAL(plugin.dereg_mr(pair.send_comm, send_mr), nccl::kSuccess);
  BOOST_CHECK_EQUAL(plugin.dereg_mr(pair.recv_comm, recv_mr), nccl::kSuccess);
  close_pair(plugin, pair);
}

BOOST_AUTO_TEST_CASE(a_full_request_pool_says_busy_and_recovers) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  connect_pair(plugin, pair);
  std::mt19937_64 rng(std::random_device{}());
  const size_t size = 1000;
  std::vector<std::vector<unsigned char>> data;
  std::vector<void*> sends;
  for (;;) {  // post until the plugin says busy (request NULL), as NCCL does
    data.push_back(random_bytes(size, rng));
    void* request = nullptr;
    BOOST_REQUIRE_EQUAL(plugin.isend(pair.send_comm, data.back().data(), size, static_cast<int>(sends.size()),
                                     &request), nccl::kSuccess);
    if (!request) break;
    sends.push_back(request);
    BOOST_REQUIRE_LE(sends.size(), static_cast<size_t>(abi::kMaxRequests));
  }
  BOOST_CHECK_EQUAL(sends.size(), static_cast<size_t>(abi::kMaxRequests));
  std::vector<std::vector<unsigned char>> received(sends.size(), std::vector<unsigned char>(size, 0xEE));
  for (size_t i = 0; i < sends.size(); ++i) {
    void* request = nullptr;
    void* buffers[1] = {received[i].data()};
    const size_t room[1] = {size};
    const int tags[1] = {static_cast<int>(i)};
    BOOST_REQUIRE_EQUAL(plugin.irecv(pair.recv_comm, 1, buffers, room, tags, &request), nccl::kSuccess);
    BOOST_REQUIRE(request);
    int sent = 0, got[1] = {0};
    wait_both(plugin, sends[i], request, &sent, got);
  }
  for (size_t i = 0; i < sends.size(); ++i) BOOST_CHECK(received[i] == data[i]);
  void* request = nullptr;  // slots are free again
  BOOST_CHECK_EQUAL(plugin.isend(pair.send_comm, data[0].data(), size, 0, &request), nccl::kSuccess);
  BOOST_CHECK(request);
  close_pair(plugin, pair);
}

BOOST_AUTO_TEST_CASE(grouped_receive_sorts_messages_by_tag) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  connect_pair(plugin, pair);
  std::mt19937_64 rng(std::random_device{}());
  const int n = transport::kMaxRecvs;
  std::vector<std::vector<unsigned char>> data, received;
  std::vector<void*> buffers;
  std::vector<size_t> room;
  std::vector<int> tags;
  for (int i = 0; i < n; ++i) {
    data.push_back(random_bytes(100 + 37 * i, rng));
    received.emplace_back(data.back().size() + 10, 0xEE);
    buffers.push_back(received.back().data());
    room.push_back(received.back().size());
    tags.push_back(1000 + i);
  }
  void* recv_request = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.irecv(pair.recv_comm, n, buffers.data(), room.data(), tags.data(), &recv_request),
                      nccl::kSuccess);
  BOOST_REQUIRE(recv_request);
  // Sent in reverse tag order: each still lands in its tag's buffer.
  std::vector<void*> sends;
  for (int i = n - 1; i >= 0; --i) {
    void* request = nullptr;
    BOOST_REQUIRE_EQUAL(plugin.isend(pair.send_comm, data[i].data(), data[i].size(), tags[i], &request),
                        nccl::kSuccess);
    BOOST_REQUIRE(request);
    sends.push_back(request);
  }
  std::vector<int> sizes(n, -1);
  int sent = 0;
  wait_both(plugin, sends[0], recv_request, &sent, sizes.data());  // the receive completes once all n arrived
  const auto deadline = Clock::now() + 10s;
  for (size_t i = 1; i < sends.size(); ++i)
    for (int done = 0; !done;) {
      BOOST_REQUIRE(Clock::now() < deadline);
      BOOST_REQUIRE_EQUAL(plugin.test(sends[i], &done, &sent), nccl::kSuccess);
    }
  for (int i = 0; i < n; ++i) {
    BOOST_CHECK_EQUAL(sizes[i], static_cast<int>(data[i].size()));
    BOOST_CHECK(std::equal(data[i].begin(), data[i].end(), received[i].begin()));
  }
  close_pair(plugin, pair);
}

BOOST_AUTO_TEST_CASE(bad_calls_are_errors_not_crashes) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  connect_pair(plugin, pair);
  void* request = nullptr;
  unsigned char byte = 1;
  void* mhandle = nullptr;
  // Wrong object kinds: a receive comm where a send comm belongs, and the reverse.
  BOOST_CHECK_EQUAL(plugin.isend(pair.recv_comm, &byte, 1, 0, &request), nccl::kInvalidArgument);
  void* buffers[1] = {&byte};
  const size_t room[1] = {1};
  const int tags[1] = {0};
  BOOST_CHECK_EQUAL(plugin.irecv(pair.send_comm, 1, buffers, room, tags, &request), nccl::kInvalidArgument);
  BOOST_CHECK_EQUAL(plugin.irecv(pair.recv_comm, 0, buffers, room, tags, &request), nccl::kInvalidArgument);
  BOOST_CHECK_EQUAL(plugin.irecv(pair.recv_comm, transport::kMaxRecvs + 1, buffers, room, tags, &request),
                    nccl::kInvalidArgument);
  BOOST_CHECK_EQUAL(plugin.accept(pair.send_comm, &request), nccl::kInvalidArgument);
  int done = 0;
  BOOST_CHECK_EQUAL(plugin.test(&byte, &done, nullptr), nccl::kInvalidArgument);
  // GPU memory is not something a host-memory transport can take.
  BOOST_CHECK_EQUAL(plugin.reg_mr(pair.send_comm, &byte, 1, abi::kPtrCuda, &mhandle), nccl::kInvalidArgument);
  BOOST_CHECK(mhandle == nullptr);
  BOOST_CHECK_EQUAL(plugin.isend(pair.send_comm, &byte, NetPlugin::kMaxMessageBytes + 1, 0, &request),
                    nccl::kInvalidArgument);
  BOOST_CHECK_EQUAL(plugin.listen(1, 5, pair.handle, &request), nccl::kInvalidArgument);
  // A handle that is not lgreco's (another plugin's, or corrupted in transit).
  unsigned char garbage[abi::kHandleMaxBytes];
  std::memset(garbage, 0x3C, sizeof garbage);
  void* send_comm = nullptr;
  BOOST_CHECK_EQUAL(plugin.connect(1, 0, garbage, &send_comm), nccl::kInvalidUsage);
  BOOST_CHECK(send_comm == nullptr);
  close_pair(plugin, pair);
  // Closed twice: caught by the magic number (the memory is freed, but the check reads it
  // before anything else; a use after free that this test can only make while the
  // allocator has not reused the block).
}

BOOST_AUTO_TEST_CASE(a_connection_from_another_communicator_is_refused_and_accept_keeps_waiting) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  std::memset(pair.handle, 0, sizeof pair.handle);
  BOOST_REQUIRE_EQUAL(plugin.listen(42, 0, pair.handle, &pair.listen_comm), nccl::kSuccess);
  // A raw connection that sends junk instead of a hello.
  transport::ListenHandle handle;
  std::memcpy(&handle, pair.handle, sizeof handle);
  const auto address = transport::SocketAddress::from_bytes(handle.address, handle.address_length);
  BOOST_REQUIRE(address);
  int error = 0;
  transport::Fd junk = transport::start_connect(*address, &error);
  BOOST_REQUIRE_EQUAL(error, 0);
  BOOST_REQUIRE(transport::wait_for(junk.get(), POLLOUT, 2000ms) & POLLOUT);
  unsigned char noise[64];
  std::memset(noise, 0x77, sizeof noise);
  size_t offset = 0;
  transport::send_some(junk.get(), noise, sizeof noise, &offset);
  // The junk fails its handshake; accept keeps returning success (no comm yet), then takes
  // the genuine connector.
  const auto deadline = Clock::now() + 10s;
  while (!pair.send_comm || !pair.recv_comm) {
    BOOST_REQUIRE(Clock::now() < deadline);
    BOOST_REQUIRE_EQUAL(plugin.accept(pair.listen_comm, &pair.recv_comm), nccl::kSuccess);
    if (!pair.send_comm) BOOST_REQUIRE_EQUAL(plugin.connect(42, 0, pair.handle, &pair.send_comm), nccl::kSuccess);
  }
  close_pair(plugin, pair);
}

// A peer that opens a TCP connection to the listener and then says nothing (a stuck
// process, a port scanner) must not hold up the genuine sender behind it: accept works on
// the next connection beside the silent one, long before that one's handshake times out.
BOOST_AUTO_TEST_CASE(a_silent_connection_does_not_delay_the_genuine_sender) {
  NetPlugin::Options options = loopback_options();
  options.handshake_timeout = 60s;
  NetPlugin plugin(options);
  Pair pair;
  BOOST_REQUIRE_EQUAL(plugin.listen(42, 0, pair.handle, &pair.listen_comm), nccl::kSuccess);
  transport::ListenHandle handle;
  std::memcpy(&handle, pair.handle, sizeof handle);
  const auto address = transport::SocketAddress::from_bytes(handle.address, handle.address_length);
  BOOST_REQUIRE(address.has_value());
  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) {
    const int fd = ::socket(address->family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
    BOOST_REQUIRE(fd >= 0);
    BOOST_REQUIRE_EQUAL(::connect(fd, address->get(), address->length()), 0);
    silent.push_back(fd);
    // accept takes the silent connection before the sender exists.
    BOOST_REQUIRE_EQUAL(plugin.accept(pair.listen_comm, &pair.recv_comm), nccl::kSuccess);
    BOOST_REQUIRE(pair.recv_comm == nullptr);
  }
  const auto start = Clock::now();
  const auto deadline = start + 10s;
  while ((!pair.send_comm || !pair.recv_comm) && Clock::now() < deadline) {
    if (!pair.send_comm) BOOST_REQUIRE_EQUAL(plugin.connect(42, 0, pair.handle, &pair.send_comm), nccl::kSuccess);
    if (!pair.recv_comm) BOOST_REQUIRE_EQUAL(plugin.accept(pair.listen_comm, &pair.recv_comm), nccl::kSuccess);
  }
  BOOST_REQUIRE_MESSAGE(pair.send_comm && pair.recv_comm, "the genuine sender was not accepted within 10 s");
  BOOST_TEST_MESSAGE("accepted behind 3 silent connections in "
                     << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count() << " ms");
  for (int fd : silent) ::close(fd);
  close_pair(plugin, pair);
}

// NCCL frees the handle buffer of a connect it abandons (an aborted communicator), and a
// later connect may get a buffer at the same address with another listener's handle in
// it: that connect must go to the new listener, not continue the abandoned one.
BOOST_AUTO_TEST_CASE(a_reused_handle_buffer_starts_a_new_connect) {
  NetPlugin plugin(loopback_options());
  Pair old_pair, new_pair;
  BOOST_REQUIRE_EQUAL(plugin.listen(42, 0, old_pair.handle, &old_pair.listen_comm), nccl::kSuccess);
  BOOST_REQUIRE_EQUAL(plugin.listen(42, 0, new_pair.handle, &new_pair.listen_comm), nccl::kSuccess);
  alignas(8) unsigned char buffer[abi::kHandleMaxBytes];
  std::memcpy(buffer, old_pair.handle, sizeof buffer);
  void* send_comm = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.connect(42, 0, buffer, &send_comm), nccl::kSuccess);  // never accepted: abandoned
  BOOST_REQUIRE(send_comm == nullptr);
  BOOST_REQUIRE_EQUAL(plugin.pending_connects(), 1u);
  std::memcpy(buffer, new_pair.handle, sizeof buffer);  // NCCL's next connect, same address
  const auto deadline = Clock::now() + 10s;
  while ((!send_comm || !new_pair.recv_comm) && Clock::now() < deadline) {
    if (!send_comm) BOOST_REQUIRE_EQUAL(plugin.connect(42, 0, buffer, &send_comm), nccl::kSuccess);
    if (!new_pair.recv_comm) BOOST_REQUIRE_EQUAL(plugin.accept(new_pair.listen_comm, &new_pair.recv_comm), nccl::kSuccess);
    // The abandoned connect's hello may still be accepted there (its sockets were closed
    // after it went out): that comm is NCCL's to drop, as the listener is.
    if (!old_pair.recv_comm) BOOST_REQUIRE_EQUAL(plugin.accept(old_pair.listen_comm, &old_pair.recv_comm), nccl::kSuccess);
  }
  BOOST_REQUIRE_MESSAGE(send_comm && new_pair.recv_comm, "the new connect did not reach its listener within 10 s");
  BOOST_CHECK_EQUAL(plugin.pending_connects(), 0u);
  // The send comm is connected to the new listener: a message arrives on its recv comm.
  uint64_t out = 0x1234567890abcdefull, in = 0;
  void* in_data[1] = {&in};
  const size_t room[1] = {sizeof in};
  const int tags[1] = {9};
  void* recv_request = nullptr;
  void* send_request = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.irecv(new_pair.recv_comm, 1, in_data, room, tags, &recv_request), nccl::kSuccess);
  BOOST_REQUIRE_EQUAL(plugin.isend(send_comm, &out, sizeof out, 9, &send_request), nccl::kSuccess);
  BOOST_REQUIRE(recv_request && send_request);
  int sent = -1, got[1] = {-1};
  wait_both(plugin, send_request, recv_request, &sent, got);
  BOOST_CHECK_EQUAL(in, out);
  new_pair.send_comm = send_comm;
  close_pair(plugin, new_pair);
  if (old_pair.recv_comm) BOOST_CHECK_EQUAL(plugin.close_recv(old_pair.recv_comm), nccl::kSuccess);
  BOOST_CHECK_EQUAL(plugin.close_listen(old_pair.listen_comm), nccl::kSuccess);
}

BOOST_AUTO_TEST_CASE(a_connect_across_communicators_fails) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  BOOST_REQUIRE_EQUAL(plugin.listen(42, 0, pair.handle, &pair.listen_comm), nccl::kSuccess);
  void* send_comm = nullptr;
  // The transport refuses a handle of another communicator before connecting.
  BOOST_CHECK_NE(plugin.connect(43, 0, pair.handle, &send_comm), nccl::kSuccess);
  BOOST_CHECK(send_comm == nullptr);
  BOOST_CHECK_EQUAL(plugin.pending_connects(), 0u);
  BOOST_CHECK_EQUAL(plugin.close_listen(pair.listen_comm), nccl::kSuccess);
}

BOOST_AUTO_TEST_CASE(a_peer_that_closes_mid_message_fails_the_receive) {
  NetPlugin plugin(loopback_options());
  Pair pair;
  connect_pair(plugin, pair);
  std::vector<unsigned char> received(64 << 20, 0xEE);
  void* buffers[1] = {received.data()};
  const size_t room[1] = {received.size()};
  const int tags[1] = {5};
  void* recv_request = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.irecv(pair.recv_comm, 1, buffers, room, tags, &recv_request), nccl::kSuccess);
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<unsigned char> data = random_bytes(received.size(), rng);
  void* send_request = nullptr;
  BOOST_REQUIRE_EQUAL(plugin.isend(pair.send_comm, const_cast<unsigned char*>(data.data()), data.size(), 5,
                                   &send_request), nccl::kSuccess);
  int done = 0;
  // Move some bytes, then the sender goes away with the message half sent.
  for (int i = 0; i < 3; ++i) {
    plugin.test(send_request, &done, nullptr);
    plugin.test(recv_request, &done, nullptr);
  }
  BOOST_REQUIRE_EQUAL(plugin.close_send(pair.send_comm), nccl::kSuccess);
  abi::Result result = nccl::kSuccess;
  const auto deadline = Clock::now() + 10s;
  done = 0;
  while (result == nccl::kSuccess && !done && Clock::now() < deadline) result = plugin.test(recv_request, &done, nullptr);
  BOOST_CHECK_EQUAL(done, 0);
  BOOST_CHECK_EQUAL(result, nccl::kRemoteError);
  BOOST_CHECK_EQUAL(plugin.close_recv(pair.recv_comm), nccl::kSuccess);
  BOOST_CHECK_EQUAL(plugin.close_listen(pair.listen_comm), nccl::kSuccess);
}

BOOST_AUTO_TEST_CASE(telemetry_counts_each_peer_and_keeps_closed_comms) {
  Registry registry;
  NetPlugin plugin(loopback_options(&registry));
  std::mt19937_64 rng(std::random_device{}());
  uint64_t total = 0;
  for (int round = 0; round < 2; ++round) {
    Pair pair;
    connect_pair(plugin, pair);
    const size_t size = 100000 + rng() % 1000;
    total += size;
    const std::vector<unsigned char> data = random_bytes(size, rng);
    std::vector<unsigned char> received(size);
    void* buffers[1] = {received.data()};
    const size_t room[1] = {size};
    const int tags[1] = {1};
    void* recv_request = nullptr;
    void* send_request = nullptr;
    BOOST_REQUIRE_EQUAL(plugin.irecv(pair.recv_comm, 1, buffers, room, tags, &recv_request), nccl::kSuccess);
    BOOST_REQUIRE_EQUAL(plugin.isend(pair.send_comm, const_cast<unsigned char*>(data.data()), size, 1,
                                     &send_request), nccl::kSuccess);
    int sent = 0, got[1] = {0};
    wait_both(plugin, send_request, recv_request, &sent, got);
    BOOST_CHECK_EQUAL(registry.live_sources(), 2u);
    close_pair(plugin, pair);
  }
  BOOST_CHECK_EQUAL(registry.live_sources(), 0u);
  const std::vector<PeerTraffic> traffic = registry.snapshot();
  // One peer host (127.0.0.1) per direction, whatever the ports were.
  BOOST_REQUIRE_EQUAL(traffic.size(), 2u);
  for (const PeerTraffic& t : traffic) {
    BOOST_CHECK_EQUAL(t.key.peer, "127.0.0.1");
    BOOST_CHECK_EQUAL(t.key.device, "lo");
    BOOST_CHECK_EQUAL(t.totals.payload_bytes, total);
    BOOST_CHECK_EQUAL(t.totals.messages, 2u);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco::net
