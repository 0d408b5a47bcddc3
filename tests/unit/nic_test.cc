// The net plugin's choice of devices: NCCL_SOCKET_IFNAME's filter syntax and its errors,
// the automatic order (ib first, then all but docker/lo/virbr, then lo), the one-family
// rule (IPv4 first, IPv6 without link-local), each device's speed, PCI path and guid from
// a fake sysfs tree, RDMA detection, and this machine's own lo.
#include "plugin/net/nic.h"

#include <arpa/inet.h>
#include <net/if.h>

#include <boost/test/unit_test.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace lgreco::net {
namespace {

namespace fs = std::filesystem;
using test::contains;
using transport::SocketAddress;

constexpr unsigned kUp = IFF_UP | IFF_RUNNING;

InterfaceAddress addr(const std::string& name, const std::string& ip, unsigned flags = kUp) {
  return {name, SocketAddress::resolve(ip, 0), flags};
}

std::vector<std::string> names_of(const std::vector<NetInterface>& devices) {
  std::vector<std::string> out;
  for (const auto& d : devices) out.push_back(d.name);
  return out;
}

InterfaceFilter parse_ok(const std::string& text) {
  std::string error;
  InterfaceFilter filter = parse_interface_filter(text, &error);
  BOOST_TEST_INFO("filter '" << text << "'");
  BOOST_TEST(error == "");
  return filter;
}

std::vector<std::string> chosen(const std::string& filter_text, const std::vector<InterfaceAddress>& addresses) {
  SystemView system;
  system.addresses = addresses;
  system.sysfs_root = "/nonexistent-sysfs";
  return names_of(find_interfaces(parse_ok(filter_text), system));
}

// A fake sysfs tree: class/net/<if>/{speed,address,device} and class/infiniband.
struct FakeSysfs {
  test::TempDir dir;
  std::string root = dir.file("sys");

  FakeSysfs() { fs::create_directories(root + "/class/net"); }
  std::string net_dir(const std::string& name) const { return root + "/class/net/" + name; }
  void write(const std::string& path, const std::string& text) const {
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path) << text;
  }
  void interface(const std::string& name, const std::string& speed, const std::string& mac) const {
    fs::create_directories(net_dir(name));
    if (!speed.empty()) write(net_dir(name) + "/speed", speed + "\n");
    if (!mac.empty()) write(net_dir(name) + "/address", mac + "\n");
  }
  // A physical NIC: its device link points into devices/pci..., as in the real /sys.
  std::string attach_pci(const std::string& name, const std::string& bdf) const {
    const std::string device = root + "/devices/pci0000:00/" + bdf;
    fs::create_directories(device);
    fs::create_symlink("../../../devices/pci0000:00/" + bdf, net_dir(name) + "/device");
    return fs::canonical(device).string();
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(nic)

BOOST_AUTO_TEST_CASE(filter_syntax_prefix_exclude_exact) {
  InterfaceFilter f = parse_ok("eth");
  BOOST_TEST(f.names == std::vector<std::string>{"eth"});
  BOOST_TEST(!f.exclude);
  BOOST_TEST(!f.exact);
  BOOST_TEST(f.matches("eth0"));
  BOOST_TEST(f.matches("eth"));
  BOOST_TEST(!f.matches("et"));
  BOOST_TEST(!f.matches("ib0"));

  f = parse_ok("^docker,lo");
  BOOST_TEST(f.exclude);
  BOOST_TEST(f.names == (std::vector<std::string>{"docker", "lo"}));
  BOOST_TEST(!f.matches("docker0"));
  BOOST_TEST(!f.matches("lo"));
  BOOST_TEST(f.matches("eth0"));

  f = parse_ok("=eth0");
  BOOST_TEST(f.exact);
  BOOST_TEST(f.matches("eth0"));
  BOOST_TEST(!f.matches("eth01"));
  BOOST_TEST(!f.matches("eth"));

  f = parse_ok("^=eth0");
  BOOST_TEST(f.exclude);
  BOOST_TEST(f.exact);
  BOOST_TEST(!f.matches("eth0"));
  BOOST_TEST(f.matches("eth01"));
  BOOST_TEST(f.str() == "^=eth0");
}

BOOST_AUTO_TEST_CASE(filter_skips_empty_entries_and_ignores_ports) {
  std::string error;
  InterfaceFilter f = parse_interface_filter(",eth0,, ib1 ,", &error);
  BOOST_TEST(error == "");
  BOOST_TEST(f.names == (std::vector<std::string>{"eth0", "ib1"}));
  f = parse_ok("eth0:29500,ib");
  BOOST_TEST(f.names == (std::vector<std::string>{"eth0", "ib"}));
  BOOST_TEST(parse_ok("").empty());
  BOOST_TEST(parse_ok("   ").empty());
  BOOST_TEST(parse_ok("").matches("anything"));
}

BOOST_AUTO_TEST_CASE(filter_errors_name_the_entry) {
  struct Case {
    std::string text, expect;
  } cases[] = {
      {"eth0,abcdefghijklmnop", "entry 'abcdefghijklmnop' is 16 characters long"},
      {"eth0,eth 1", "entry 'eth 1' contains a blank"},
      {"eth0,^eth1", "entry '^eth1' contains '^'"},
      {"=^eth1", "entry '^eth1' contains '^'"},
      {"a/b", "entry 'a/b' contains '/'"},
      {"eth0:port", "entry 'eth0:port': port 'port' is not a number"},
      {"eth0:70000", "port '70000'"},
      {":1234", "entry ':1234' has no interface name"},
      {"^", "no interface names"},
      {"^=,,", "no interface names"},
  };
  for (const Case& c : cases) {
    std::string error;
    const InterfaceFilter f = parse_interface_filter(c.text, &error);
    BOOST_TEST_INFO("filter '" << c.text << "'");
    BOOST_TEST(contains(error, c.expect), error);
    BOOST_TEST(contains(error, "'" + c.text + "'"), error);
    BOOST_TEST(f.empty());
  }
  // 15 characters is the longest name Linux allows, and fine.
  std::string error;
  parse_interface_filter("abcdefghijklmno", &error);
  BOOST_TEST(error == "");
}

BOOST_AUTO_TEST_CASE(filters_choose_exactly_what_they_match) {
  const std::vector<InterfaceAddress> a = {addr("lo", "127.0.0.1", kUp | IFF_LOOPBACK),
                                           addr("eth0", "10.0.0.1"),
                                           addr("eth1", "10.0.1.1"),
                                           addr("ib0", "10.1.0.1"),
                                           addr("docker0", "172.17.0.1"),
                                           addr("eth10", "10.0.2.1")};
  BOOST_TEST(chosen("eth", a) == (std::vector<std::string>{"eth0", "eth1", "eth10"}));
  BOOST_TEST(chosen("=eth1", a) == (std::vector<std::string>{"eth1"}));
  BOOST_TEST(chosen("=eth", a).empty());
  BOOST_TEST(chosen("^eth,ib", a) == (std::vector<std::string>{"lo", "docker0"}));
  BOOST_TEST(chosen("^=eth1", a) == (std::vector<std::string>{"lo", "eth0", "ib0", "docker0", "eth10"}));
  // Address order, not list order; eth1 is a prefix of eth10.
  BOOST_TEST(chosen("ib0,eth1", a) == (std::vector<std::string>{"eth1", "ib0", "eth10"}),
             boost::test_tools::per_element());
  BOOST_TEST(chosen("lo", a) == (std::vector<std::string>{"lo"}));
  BOOST_TEST(chosen("wlan", a).empty());
}

BOOST_AUTO_TEST_CASE(automatic_order_ib_then_others_then_loopback) {
  std::vector<InterfaceAddress> a = {addr("lo", "127.0.0.1", kUp | IFF_LOOPBACK),
                                     addr("docker0", "172.17.0.1"),
                                     addr("eth0", "10.0.0.1"),
                                     addr("virbr0", "192.168.122.1"),
                                     addr("ib0", "10.1.0.1"),
                                     addr("ib1", "10.1.1.1")};
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"ib0", "ib1"}));
  a.pop_back();
  a.pop_back();
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"eth0"}));
  a.erase(a.begin() + 2);                                              // eth0
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"docker0"}));  // NCCL: docker before lo
  a.erase(a.begin() + 1);                                              // docker0
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"lo"}));
  a.erase(a.begin());  // lo
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"virbr0"}));
  BOOST_TEST(chosen("", {}).empty());
}

BOOST_AUTO_TEST_CASE(down_or_not_running_interfaces_do_not_count) {
  const std::vector<InterfaceAddress> a = {addr("ib0", "10.1.0.1", IFF_UP),  // no carrier
                                           addr("ib1", "10.1.1.1", IFF_RUNNING), addr("eth0", "10.0.0.1", 0),
                                           addr("eth1", "10.0.1.1")};
  BOOST_TEST(chosen("", a) == (std::vector<std::string>{"eth1"}));
  BOOST_TEST(chosen("ib", a).empty());
}

BOOST_AUTO_TEST_CASE(one_entry_per_interface_ipv4_first) {
  SystemView system;
  system.sysfs_root = "/nonexistent-sysfs";
  system.addresses = {addr("eth0", "fe80::1"),  addr("eth0", "2001:db8::1"), addr("eth0", "10.0.0.1"),
                      addr("eth0", "10.0.0.2"), addr("eth1", "2001:db8::2"),  // IPv6 only
                      addr("eth2", "10.0.2.1")};
  const auto devices = find_interfaces(parse_ok("eth"), system);
  BOOST_TEST(names_of(devices) == (std::vector<std::string>{"eth0", "eth2"}));
  BOOST_REQUIRE(devices.size() == 2u);
  BOOST_TEST(devices[0].address.str() == "10.0.0.1:0");
  BOOST_TEST(devices[1].address.str() == "10.0.2.1:0");
}

BOOST_AUTO_TEST_CASE(ipv6_only_hosts_skip_link_local_and_loopback) {
  SystemView system;
  system.sysfs_root = "/nonexistent-sysfs";
  system.addresses = {addr("lo", "::1", kUp | IFF_LOOPBACK), addr("eth0", "fe80::1"), addr("eth1", "fe80::2"),
                      addr("eth1", "2001:db8::2"), addr("eth0", "2001:db8::1")};
  const auto devices = find_interfaces(InterfaceFilter{}, system);
  BOOST_REQUIRE(devices.size() == 2u);
  BOOST_TEST(devices[0].name == "eth1");
  BOOST_TEST(devices[0].address.str() == "[2001:db8::2]:0");
  BOOST_TEST(devices[1].address.str() == "[2001:db8::1]:0");
  // Only link-local: nothing usable.
  system.addresses = {addr("eth0", "fe80::1")};
  BOOST_TEST(find_interfaces(InterfaceFilter{}, system).empty());
}

BOOST_AUTO_TEST_CASE(at_most_64_devices) {
  SystemView system;
  system.sysfs_root = "/nonexistent-sysfs";
  for (int i = 0; i < 100; ++i)
    system.addresses.push_back(addr("eth" + std::to_string(i), "10.0.0." + std::to_string(i + 1)));
  const auto devices = find_interfaces(InterfaceFilter{}, system);
  BOOST_TEST(devices.size() == kMaxDevices);
  BOOST_TEST(devices.front().name == "eth0");
  BOOST_TEST(devices.back().name == "eth63");
}

BOOST_AUTO_TEST_CASE(properties_from_sysfs) {
  FakeSysfs sys;
  sys.interface("eth0", "25000", "0c:42:a1:00:00:01");
  const std::string eth0_pci = sys.attach_pci("eth0", "0000:00:03.0");
  sys.interface("eth1", "-1", "0C:42:A1:00:00:02");  // link down speed
  sys.attach_pci("eth1", "0000:00:04.0");
  sys.interface("veth0", "10000", "6a:11:22:33:44:55");   // virtual: no device link
  sys.interface("lo", "", "00:00:00:00:00:00");           // speed unreadable
  sys.interface("tun0", "0", "");                         // no hardware address
  sys.interface("eth2", "garbage", "0c:42:a1:00:00:01");  // the same MAC as eth0 (a VLAN of it)
  SystemView system;
  system.sysfs_root = sys.root;
  system.addresses = {addr("lo", "127.0.0.1", kUp | IFF_LOOPBACK),
                      addr("eth0", "10.0.0.1"),
                      addr("eth1", "10.0.1.1"),
                      addr("veth0", "10.0.2.1"),
                      addr("tun0", "10.0.3.1"),
                      addr("eth2", "10.0.4.1")};
  const auto devices = find_interfaces(parse_ok("^nothing"), system);
  BOOST_REQUIRE(devices.size() == 6u);
  const NetInterface &lo = devices[0], &eth0 = devices[1], &eth1 = devices[2], &veth0 = devices[3], &tun0 = devices[4],
                     &eth2 = devices[5];
  BOOST_TEST(eth0.speed_mbps == 25000);
  BOOST_TEST(eth1.speed_mbps == kDefaultSpeedMbps);
  BOOST_TEST(veth0.speed_mbps == 10000);
  BOOST_TEST(lo.speed_mbps == kDefaultSpeedMbps);
  BOOST_TEST(tun0.speed_mbps == kDefaultSpeedMbps);
  BOOST_TEST(eth2.speed_mbps == kDefaultSpeedMbps);

  BOOST_TEST(eth0.pci_path == eth0_pci);
  BOOST_TEST(contains(eth0.pci_path, "/devices/pci0000:00/0000:00:03.0"));
  BOOST_TEST(contains(eth1.pci_path, "0000:00:04.0"));
  BOOST_TEST(veth0.pci_path == "");
  BOOST_TEST(lo.pci_path == "");

  BOOST_TEST(lo.loopback);
  BOOST_TEST(!eth0.loopback);

  // Guids: distinct hardware, distinct guids; the same MAC (any case) is the same NIC;
  // loopback's zero MAC and a missing one fall back to the name.
  BOOST_TEST(eth0.guid == eth2.guid);
  BOOST_TEST(eth0.guid != eth1.guid);
  BOOST_TEST(lo.guid != tun0.guid);
  BOOST_TEST(lo.guid != eth0.guid);
  BOOST_TEST(veth0.guid != eth0.guid);
  // Stable: the same view gives the same guids again.
  const auto again = find_interfaces(parse_ok("^nothing"), system);
  for (size_t i = 0; i < devices.size(); ++i) BOOST_TEST(again[i].guid == devices[i].guid);
  // The address carries no port.
  BOOST_TEST(eth0.address.port() == 0);
}

BOOST_AUTO_TEST_CASE(rdma_devices_from_sysfs) {
  FakeSysfs sys;
  SystemView system;
  system.sysfs_root = sys.root;
  std::string which = "stale";
  BOOST_TEST(!has_rdma_device(system, &which));  // no class/infiniband at all
  BOOST_TEST(which == "");
  fs::create_directories(sys.root + "/class/infiniband");
  BOOST_TEST(!has_rdma_device(system, &which));  // the class exists, no device
  fs::create_directories(sys.root + "/class/infiniband/rxe0");
  fs::create_directories(sys.root + "/class/infiniband/mlx5_0");
  BOOST_TEST(has_rdma_device(system, &which));
  BOOST_TEST(which == "mlx5_0,rxe0");
  BOOST_TEST(has_rdma_device(system, nullptr));
}

BOOST_AUTO_TEST_CASE(this_machine_has_lo) {
  const SystemView system = SystemView::from_process();
  BOOST_TEST(system.sysfs_root == "/sys");
  const auto devices = find_interfaces(parse_ok("lo"), system);
  BOOST_REQUIRE(devices.size() == 1u);
  BOOST_TEST(devices[0].name == "lo");
  BOOST_TEST(devices[0].address.str() == "127.0.0.1:0");
  BOOST_TEST(devices[0].loopback);
  BOOST_TEST(devices[0].pci_path == "");
  BOOST_TEST(devices[0].speed_mbps > 0);
  // The automatic choice finds something on any machine with lo up.
  BOOST_TEST(!find_interfaces(InterfaceFilter{}, system).empty());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco::net
