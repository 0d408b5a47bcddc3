// Which network interfaces the net plugin offers NCCL as devices, and what it tells NCCL
// about each (name, address, speed, PCI path, guid).
//
// The choice follows NCCL's own socket transport (src/misc/socket.cc findInterfaces and
// ncclFindInterfaces at v2.28.9-1), so that LGRECO_SOCKET_IFNAME takes what
// NCCL_SOCKET_IFNAME takes and a job that switches to lgreco's transport keeps its NICs:
//
//   filter          "eth0,ib"  interfaces whose names begin with eth0 or ib
//                   "^docker"  every interface except those beginning with docker
//                   "=eth0"    exactly eth0 ("^=eth0": all but exactly eth0)
//   no filter       interfaces named ib*; if none, all but docker*, lo* and virbr*; if none,
//                   docker*; then lo*; then virbr*
//
// An interface qualifies when it is up and running (IFF_UP and IFF_RUNNING, as NCCL: a
// cable pulled means no device) and has a usable address. Each interface appears once.
// One address family serves all devices, so that every pair of devices can reach each
// other: IPv4 when any qualifying interface has an IPv4 address, IPv6 otherwise. IPv6
// link-local addresses (fe80::/10, usable only with a scope id that a listen handle does
// not carry) and ::1 (NCCL skips it too) never count.
//
// What is read comes in through SystemView, so that tests can describe any machine: a
// list of interface addresses (getifaddrs) and the root of a sysfs tree.
//
// Differences from NCCL, on purpose: NCCL_SOCKET_FAMILY and the NCCL_COMM_ID subnet
// hint are not consulted; a malformed filter is an error instead of matching nothing;
// up to kMaxDevices devices (NCCL's socket transport stops at 16).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "plugin/transport/socket.h"

namespace lgreco::net {

// The most devices find_interfaces returns: more than any training node has NICs, few
// enough that a host full of container veths cannot flood NCCL's topology with devices.
inline constexpr size_t kMaxDevices = 64;
// The speed reported for an interface whose sysfs speed is unreadable, -1 or 0 (virtual
// interfaces, loopback, some virtio NICs): NCCL's own default (10 Gbps), so that NCCL's
// topology search weighs such devices as it would with its internal socket transport.
inline constexpr int kDefaultSpeedMbps = 10000;

// A parsed LGRECO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME value.
struct InterfaceFilter {
  std::vector<std::string> names;  // prefixes (or exact names); empty: no filter, automatic choice
  bool exclude = false;            // leading '^': everything except what `names` match
  bool exact = false;              // leading '=': whole names, not prefixes

  bool empty() const { return names.empty(); }
  // Whether `interface_name` passes the filter. An empty filter passes everything.
  bool matches(std::string_view interface_name) const;
  // The filter written back in the syntax parse_interface_filter reads ("" when empty).
  std::string str() const;
};

// Parses NCCL_SOCKET_IFNAME's syntax: an optional '^', then an optional '=', then names
// separated by commas. Empty entries are skipped; "name:port" is accepted and the port
// ignored, as NCCL does for interface selection. Empty or all-blank text gives an empty
// filter (automatic choice). On anything malformed returns an empty filter and sets
// *error naming the entry: a name of IFNAMSIZ (16) characters or more (no interface can
// match it), a name with a blank, '/' or a control character, a port that is not a
// number in [0, 65535], '^' or '=' with no names after it.
InterfaceFilter parse_interface_filter(const std::string& text, std::string* error);

// One address of one interface, as getifaddrs reports it.
struct InterfaceAddress {
  std::string name;                  // "eth0"
  transport::SocketAddress address;  // port 0; empty for an entry with no IP address
  unsigned flags = 0;                // IFF_UP, IFF_RUNNING, IFF_LOOPBACK, ...
};

// What find_interfaces and has_rdma_device read.
struct SystemView {
  std::vector<InterfaceAddress> addresses;  // in getifaddrs order
  std::string sysfs_root = "/sys";

  // This process's interfaces (getifaddrs; entries without an IPv4 or IPv6 address are
  // left out) and /sys. Throws transport::TransportError when getifaddrs fails.
  static SystemView from_process();
};

// One device for NCCL.
struct NetInterface {
  std::string name;
  transport::SocketAddress address;    // port 0
  int speed_mbps = kDefaultSpeedMbps;  // <sysfs>/class/net/<name>/speed, else kDefaultSpeedMbps
  // realpath of <sysfs>/class/net/<name>/device (e.g. /sys/devices/pci0000:00/0000:00:03.0),
  // from which NCCL pairs NICs with GPUs; empty for virtual interfaces, which have none.
  std::string pci_path;
  // Stable across processes and runs on one host: a hash of the hardware address
  // (<sysfs>/class/net/<name>/address) when it has a non-zero one, else a hash of the
  // name. NCCL takes equal guids for ports of one NIC (net.asic in its search), so
  // interfaces sharing a MAC (VLANs of one port) are reported as the same hardware.
  uint64_t guid = 0;
  bool loopback = false;  // IFF_LOOPBACK
};

// The devices to offer, in the order NCCL would number them (the order of `addresses`).
// With a filter, exactly what it matches (including lo when asked for); without one, the
// automatic order described at the top. At most kMaxDevices. Empty when nothing
// qualifies.
std::vector<NetInterface> find_interfaces(const InterfaceFilter& filter, const SystemView& system);

// Whether an RDMA device exists: any entry in <sysfs>/class/infiniband (InfiniBand, RoCE,
// soft-RoCE all appear there). *which, when given, gets their names, sorted and
// comma-separated, for the log ("" when none). The plugin's LGRECO_NET=auto offers its TCP
// transport only where this is false, leaving RDMA hosts to NCCL's own IB transport.
bool has_rdma_device(const SystemView& system, std::string* which);

}  // namespace lgreco::net
