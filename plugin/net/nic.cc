#include "plugin/net/nic.h"

#include <ifaddrs.h>
#include <net/if.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

namespace lgreco::net {
namespace {

namespace fs = std::filesystem;

std::string_view trim_blanks(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// What is wrong with one filter entry's name ("" if nothing). Linux refuses '/' and
// blanks in interface names (dev_valid_name), so such an entry can never match; '^' and
// '=' are taken as a misplaced prefix ("eth0,^eth1" does not exclude eth1 in NCCL either,
// it looks for an interface called "^eth1").
std::string name_problem(std::string_view name) {
  if (name.size() >= IFNAMSIZ)
    return "is " + std::to_string(name.size()) + " characters long; interface names have at most " +
           std::to_string(IFNAMSIZ - 1);
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isspace(u) || std::iscntrl(u)) return "contains a blank or control character";
    if (c == '/') return "contains '/'";
    if (c == '^' || c == '=')
      return std::string("contains '") + c + "', which only means something at the start of the list";
  }
  return "";
}

// Linux has no IFF_RUNNING without IFF_UP, but a fake SystemView can say anything: ask for
// both, as "up" is what the documentation promises.
bool usable_flags(unsigned flags) { return (flags & IFF_UP) && (flags & IFF_RUNNING); }

bool is_link_local_v6(const transport::SocketAddress& address) {
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(address.get());
  return IN6_IS_ADDR_LINKLOCAL(&v6->sin6_addr);
}

bool is_loopback_v6(const transport::SocketAddress& address) {
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(address.get());
  return IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr);
}

struct Candidate {
  const InterfaceAddress* v4 = nullptr;  // its first IPv4 address
  const InterfaceAddress* v6 = nullptr;  // its first usable IPv6 address
};

// NCCL's findInterfaces for one filter, plus the one-family rule (nic.h): the interfaces
// that qualify, in the order their address of the chosen family appears.
std::vector<const InterfaceAddress*> select(const InterfaceFilter& filter, const SystemView& system) {
  std::vector<std::pair<std::string, Candidate>> candidates;  // first-seen order; few entries
  auto candidate_of = [&](const std::string& name) -> Candidate& {
    for (auto& [n, c] : candidates)
      if (n == name) return c;
    return candidates.emplace_back(name, Candidate{}).second;
  };
  bool any_v4 = false;
  for (const InterfaceAddress& entry : system.addresses) {
    if (!usable_flags(entry.flags) || !filter.matches(entry.name)) continue;
    const int family = entry.address.family();
    if (family == AF_INET) {
      Candidate& c = candidate_of(entry.name);
      if (!c.v4) c.v4 = &entry;
      any_v4 = true;
    } else if (family == AF_INET6 && !is_link_local_v6(entry.address) && !is_loopback_v6(entry.address)) {
      Candidate& c = candidate_of(entry.name);
      if (!c.v6) c.v6 = &entry;
    }
  }
  std::vector<const InterfaceAddress*> chosen;
  for (const auto& [name, c] : candidates) {
    const InterfaceAddress* address = any_v4 ? c.v4 : c.v6;
    if (address) chosen.push_back(address);
  }
  // candidates are in order of first appearance of any family; NCCL numbers devices in
  // the order of the address it keeps.
  std::stable_sort(chosen.begin(), chosen.end(), std::less<>());  // entries are elements of one vector
  if (chosen.size() > kMaxDevices) chosen.resize(kMaxDevices);
  return chosen;
}

// A name that is safe to put into a sysfs path (a fake SystemView could hold anything).
bool path_safe(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

std::optional<std::string> read_first_line(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

int read_speed(const fs::path& net_dir) {
  const auto text = read_first_line(net_dir / "speed");
  if (!text) return kDefaultSpeedMbps;
  const std::string_view s = trim_blanks(*text);
  long long speed = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), speed);
  if (ec != std::errc() || end != s.data() + s.size() || speed <= 0 || speed > INT32_MAX) return kDefaultSpeedMbps;
  return static_cast<int>(speed);
}

std::string read_pci_path(const fs::path& net_dir) {
  std::error_code ec;
  const fs::path device = net_dir / "device";
  if (!fs::exists(fs::symlink_status(device, ec))) return "";
  const fs::path real = fs::canonical(device, ec);
  return ec ? "" : real.string();
}

uint64_t fnv1a(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t read_guid(const fs::path& net_dir, const std::string& name) {
  if (const auto mac = read_first_line(net_dir / "address")) {
    std::string text(trim_blanks(*mac));
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
    // Loopback and tunnels report 00:00:...; those would all collide.
    const bool nonzero = std::any_of(text.begin(), text.end(),
                                     [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) && c != '0'; });
    if (nonzero) return fnv1a("mac:" + text);
  }
  return fnv1a("name:" + name);
}

NetInterface describe(const InterfaceAddress& entry, const SystemView& system) {
  NetInterface out;
  out.name = entry.name;
  out.address = entry.address;
  out.address.set_port(0);
  out.loopback = (entry.flags & IFF_LOOPBACK) != 0;
  if (path_safe(entry.name)) {
    const fs::path net_dir = fs::path(system.sysfs_root) / "class" / "net" / entry.name;
    out.speed_mbps = read_speed(net_dir);
    out.pci_path = read_pci_path(net_dir);
    out.guid = read_guid(net_dir, entry.name);
  } else {
    out.guid = fnv1a("name:" + entry.name);
  }
  return out;
}

}  // namespace

bool InterfaceFilter::matches(std::string_view interface_name) const {
  if (names.empty()) return true;
  bool listed = false;
  for (const std::string& name : names) {
    if (exact ? interface_name == name : interface_name.starts_with(name)) {
      listed = true;
      break;
    }
  }
  return listed != exclude;
}

std::string InterfaceFilter::str() const {
  if (names.empty()) return "";
  std::string out = std::string(exclude ? "^" : "") + (exact ? "=" : "");
  for (size_t i = 0; i < names.size(); ++i) out += (i ? "," : "") + names[i];
  return out;
}

InterfaceFilter parse_interface_filter(const std::string& text, std::string* error) {
  error->clear();
  InterfaceFilter filter;
  std::string_view rest = trim_blanks(text);
  if (rest.empty()) return filter;
  if (rest.front() == '^') {
    filter.exclude = true;
    rest.remove_prefix(1);
  }
  if (!rest.empty() && rest.front() == '=') {
    filter.exact = true;
    rest.remove_prefix(1);
  }
  auto fail = [&](const std::string& message) {
    *error = "interface list '" + text + "': " + message;
    return InterfaceFilter{};
  };
  // One pass over the text; every iteration consumes one comma-separated entry.
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view raw = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::string_view entry = trim_blanks(raw);
    if (entry.empty()) continue;
    std::string_view name = entry;
    if (const size_t colon = entry.find(':'); colon != std::string_view::npos) {
      name = trim_blanks(entry.substr(0, colon));
      const std::string_view port = trim_blanks(entry.substr(colon + 1));
      unsigned long value = 0;
      const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
      if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value > 65535)
        return fail("entry '" + std::string(entry) + "': port '" + std::string(port) +
                    "' is not a number from 0 to 65535");
      if (name.empty()) return fail("entry '" + std::string(entry) + "' has no interface name");
    }
    if (const std::string problem = name_problem(name); !problem.empty())
      return fail("entry '" + std::string(name) + "' " + problem);
    filter.names.emplace_back(name);
  }
  if (filter.names.empty()) return fail("no interface names after '^' or '='");
  return filter;
}

SystemView SystemView::from_process() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    const int error = errno;
    throw transport::TransportError("getifaddrs failed: " + transport::errno_text(error), error);
  }
  const std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> owner(list, freeifaddrs);
  SystemView view;
  for (const ifaddrs* entry = list; entry; entry = entry->ifa_next) {
    if (!entry->ifa_addr || !entry->ifa_name) continue;
    const int family = entry->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    const size_t length = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    auto address = transport::SocketAddress::from_bytes(entry->ifa_addr, length);
    if (!address) continue;
    address->set_port(0);
    view.addresses.push_back({entry->ifa_name, *address, entry->ifa_flags});
  }
  return view;
}

std::vector<NetInterface> find_interfaces(const InterfaceFilter& filter, const SystemView& system) {
  std::vector<const InterfaceAddress*> chosen;
  if (!filter.empty()) {
    chosen = select(filter, system);
  } else {
    // ncclFindInterfaces' automatic order (without the NCCL_COMM_ID subnet hint).
    static const InterfaceFilter kStages[] = {
        {{"ib"}, false, false},     {{"docker", "lo", "virbr"}, true, false},
        {{"docker"}, false, false}, {{"lo"}, false, false},
        {{"virbr"}, false, false},
    };
    for (const InterfaceFilter& stage : kStages) {
      chosen = select(stage, system);
      if (!chosen.empty()) break;
    }
  }
  std::vector<NetInterface> out;
  out.reserve(chosen.size());
  for (const InterfaceAddress* entry : chosen) out.push_back(describe(*entry, system));
  return out;
}

bool has_rdma_device(const SystemView& system, std::string* which) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(fs::path(system.sysfs_root) / "class" / "infiniband", ec);
  // A directory of RDMA devices is short; the bound only guards against a broken file system.
  for (size_t n = 0; !ec && it != fs::directory_iterator() && n < 4096; it.increment(ec), ++n)
    names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end());
  if (which) {
    which->clear();
    for (size_t i = 0; i < names.size(); ++i) *which += (i ? "," : "") + names[i];
  }
  return !names.empty();
}

}  // namespace lgreco::net
