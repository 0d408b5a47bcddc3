// What the net plugin offers NCCL under each LGRECO_NET and LGRECO_SOCKET_IFNAME, on
// described machines (with and without RDMA devices), and the transport options read from
// LGRECO_SOCKET_NTHREADS and LGRECO_NSOCKS_PERTHREAD as NCCL reads its own pair.
#include "plugin/net/plugin_setup.h"

#include <net/if.h>

#include <boost/test/unit_test.hpp>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco::net {
namespace {

using test::contains;
using transport::SocketAddress;

config::Params params_from(std::vector<std::pair<std::string, std::string>> environment) {
  config::ParamSources sources;
  sources.environment = std::move(environment);
  sources.read_file = [](const std::string&, bool* missing, std::string*) -> std::optional<std::string> {
    *missing = true;
    return std::nullopt;
  };
  return config::load_params(sources);
}

// A host with eth0 and lo, and optionally an RDMA device in its sysfs tree.
struct Host {
  test::TempDir dir;
  SystemView system;
  explicit Host(bool with_rdma) {
    system.sysfs_root = dir.file("sys");
    std::filesystem::create_directories(system.sysfs_root + "/class/net");
    if (with_rdma) std::filesystem::create_directories(system.sysfs_root + "/class/infiniband/mlx5_0");
    system.addresses = {{"lo", SocketAddress::resolve("127.0.0.1", 0), IFF_UP | IFF_RUNNING | IFF_LOOPBACK},
                        {"eth0", SocketAddress::resolve("10.0.0.7", 0), IFF_UP | IFF_RUNNING}};
  }
};

std::vector<std::string> names(const std::vector<Device>& devices) {
  std::vector<std::string> out;
  for (const Device& d : devices) out.push_back(d.name);
  return out;
}

using Names = std::vector<std::string>;

}  // namespace

BOOST_AUTO_TEST_SUITE(plugin_setup)

BOOST_AUTO_TEST_CASE(auto_offers_tcp_only_where_no_rdma_device_exists) {
  test::LogToFile log;
  BOOST_TEST(names(choose_devices(params_from({}), Host(false).system)) == Names{"eth0"});
  BOOST_TEST(names(choose_devices(params_from({}), Host(true).system)).empty());
  BOOST_TEST(contains(log.text(), "RDMA devices found (mlx5_0)"), log.text());
  BOOST_TEST(contains(log.text(), "LGRECO_NET=socket"), log.text());
}

BOOST_AUTO_TEST_CASE(socket_offers_tcp_even_beside_rdma) {
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_NET", "socket"}}), Host(true).system)) == Names{"eth0"});
}

BOOST_AUTO_TEST_CASE(off_offers_nothing_and_says_compression_stays) {
  test::LogToFile log;
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_NET", "off"}}), Host(false).system)).empty());
  BOOST_TEST(contains(log.text(), "LGRECO_NET=off"), log.text());
  BOOST_TEST(contains(log.text(), "compression is still installed"), log.text());
}

BOOST_AUTO_TEST_CASE(ifname_selects_and_a_malformed_one_offers_nothing_with_a_warn) {
  test::LogToFile log;
  const Host host(false);
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_SOCKET_IFNAME", "=lo"}}), host.system)) == Names{"lo"});
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_SOCKET_IFNAME", "^=eth0"}}), host.system)) == Names{"lo"});
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_SOCKET_IFNAME", "^"}}), host.system)).empty());
  BOOST_TEST(contains(log.text(), "WARN NET LGRECO_SOCKET_IFNAME=^:"), log.text());
  BOOST_TEST(names(choose_devices(params_from({{"LGRECO_SOCKET_IFNAME", "wlan"}}), host.system)).empty());
  BOOST_TEST(contains(log.text(), "matches LGRECO_SOCKET_IFNAME=wlan"), log.text());
}

BOOST_AUTO_TEST_CASE(invalid_parameters_offer_nothing) {
  test::LogToFile log;
  const config::Params params = params_from({{"LGRECO_NET", "ib"}});
  BOOST_TEST(!params.valid());
  BOOST_TEST(choose_devices(params, Host(false).system).empty());
  BOOST_TEST(contains(log.text(), "configuration is invalid"), log.text());
}

BOOST_AUTO_TEST_CASE(sockets_are_threads_times_sockets_per_thread_as_nccl_reads_them) {
  struct Case {
    const char* nthreads;
    const char* nsocks;
    int sockets, threads;
  };
  for (const Case c : {Case{"2", "2", 4, 2}, Case{"4", "2", 8, 4}, Case{"0", "3", 3, 0}, Case{"1", "1", 1, 1}}) {
    const config::Params params =
        params_from({{"LGRECO_SOCKET_NTHREADS", c.nthreads}, {"LGRECO_NSOCKS_PERTHREAD", c.nsocks}});
    BOOST_TEST_INFO(c.nthreads << " threads x " << c.nsocks << " sockets");
    BOOST_TEST_REQUIRE(params.valid());
    const NetPlugin::Options options = plugin_options(params, {}, nullptr);
    BOOST_TEST(options.sockets_per_connection == c.sockets);
    BOOST_TEST(options.helper_threads == c.threads);
    // Every combination the parameters accept makes a plugin the transport accepts.
    BOOST_CHECK_NO_THROW(NetPlugin{options});
  }
  const config::Params defaults = params_from({});
  const NetPlugin::Options options = plugin_options(defaults, {}, nullptr);
  BOOST_TEST(options.sockets_per_connection == 4);
  BOOST_TEST(options.helper_threads == 2);
  BOOST_TEST(options.handshake_timeout.count() == static_cast<long>(defaults.timeout_seconds) * 1000);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco::net
