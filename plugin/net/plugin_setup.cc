#include "plugin/net/plugin_setup.h"

#include <chrono>
#include <exception>
#include <string>
#include <utility>

#include "config/log.h"

namespace lgreco::net {

std::vector<Device> choose_devices(const config::Params& params, const SystemView& system) {
  if (!params.valid()) {
    LGRECO_WARN("NET", "lgreco offers NCCL no network devices: its configuration is invalid (see above); NCCL uses "
                "its own transports");
    return {};
  }
  if (params.net == "off") {
    LGRECO_INFO("NET", "LGRECO_NET=off: lgreco offers NCCL no network devices (compression is still installed)");
    return {};
  }
  std::string rdma;
  if (params.net == "auto" && has_rdma_device(system, &rdma)) {
    LGRECO_INFO("NET", "RDMA devices found (%s): lgreco offers NCCL no network devices so that NCCL keeps its IB "
                "transport (LGRECO_NET=socket to use lgreco's TCP transport anyway); compression works through "
                "the shim either way", rdma.c_str());
    return {};
  }
  std::string error;
  const InterfaceFilter filter = parse_interface_filter(params.socket_ifname, &error);
  if (!error.empty()) {
    LGRECO_WARN("NET", "LGRECO_SOCKET_IFNAME=%s: %s; lgreco offers NCCL no network devices",
                params.socket_ifname.c_str(), error.c_str());
    return {};
  }
  std::vector<Device> devices;
  for (const NetInterface& nic : find_interfaces(filter, system))
    devices.push_back(Device{nic.name, nic.address, nic.pci_path, nic.speed_mbps, nic.guid});
  if (devices.empty())
    LGRECO_WARN("NET", "no network interface is up with an address%s%s; lgreco offers NCCL no network devices",
                filter.empty() ? "" : " and matches LGRECO_SOCKET_IFNAME=", params.socket_ifname.c_str());
  return devices;
}

NetPlugin::Options plugin_options(const config::Params& params, std::vector<Device> devices, Registry* telemetry) {
  NetPlugin::Options options;
  options.devices = std::move(devices);
  options.helper_threads = static_cast<int>(params.socket_nthreads);
  options.sockets_per_connection =
      static_cast<int>(params.socket_nthreads == 0 ? params.nsocks_perthread
                                                   : params.socket_nthreads * params.nsocks_perthread);
  options.handshake_timeout = std::chrono::seconds(params.timeout_seconds);
  options.telemetry = telemetry;
  return options;
}

namespace {

void log_offer(const NetPlugin::Options& options) {
  std::string list;
  for (const Device& d : options.devices)
    list += (list.empty() ? "" : ", ") + d.name + " (" + d.address.str() + ", " + std::to_string(d.speed_mbps) +
            " Mbps" + (d.pci_path.empty() ? "" : ", " + d.pci_path) + ")";
  LGRECO_INFO("NET", "lgreco's TCP transport offers NCCL %zu device%s: %s; %d socket%s and %d helper thread%s per "
              "connection", options.devices.size(), options.devices.size() == 1 ? "" : "s", list.c_str(),
              options.sockets_per_connection, options.sockets_per_connection == 1 ? "" : "s", options.helper_threads,
              options.helper_threads == 1 ? "" : "s");
}

void start_exporter(const config::Params& params, ProcessPlugin& state) {
  if (params.telemetry_file.empty()) return;
  std::string path, error;
  if (!config::expand_path_pattern(params.telemetry_file, "hp", -1, &path, &error)) {
    LGRECO_WARN("NET", "LGRECO_TELEMETRY_FILE=%s: %s; no telemetry export", params.telemetry_file.c_str(),
                error.c_str());
    return;
  }
  try {
    state.exporter = std::make_unique<Exporter>(state.telemetry, path,
                                                std::chrono::seconds(params.telemetry_interval), process_labels());
  } catch (const std::exception& e) {  // no thread for it
    LGRECO_WARN("NET", "LGRECO_TELEMETRY_FILE=%s: cannot start the exporter: %s; no telemetry export", path.c_str(),
                e.what());
    return;
  }
  LGRECO_INFO("NET", "exporting per-peer telemetry to %s every %llu s", path.c_str(),
              static_cast<unsigned long long>(params.telemetry_interval));
}

ProcessPlugin* make_process_plugin() {
  auto* state = new ProcessPlugin;
  const config::Params& params = config::params();
  // Whatever fails here fails the same way on every rank of a job, and NCCL then uses its
  // own transports: offer no devices and say why, once.
  try {
    std::vector<Device> devices = choose_devices(params, SystemView::from_process());
    if (devices.empty()) return state;
    NetPlugin::Options options = plugin_options(params, std::move(devices), &state->telemetry);
    log_offer(options);
    state->plugin = std::make_unique<NetPlugin>(std::move(options));
  } catch (const std::exception& e) {  // getifaddrs failed, unusable socket counts
    LGRECO_WARN("NET", "lgreco offers NCCL no network devices: %s", e.what());
    return state;
  }
  start_exporter(params, *state);
  return state;
}

}  // namespace

ProcessPlugin& process_plugin() {
  static ProcessPlugin* const the_plugin = make_process_plugin();
  return *the_plugin;
}

}  // namespace lgreco::net
