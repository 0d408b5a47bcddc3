// What lgreco's NCCL net plugin offers and how, decided from the parameters, and the
// process's one plugin that the exported tables (exports.cc) serve.
//
// Kept apart from exports.cc so that the decisions are unit-tested without loading the
// library, and so that the C++ runtime it uses (std::string, threads) stays inside the
// core archive, whose symbols liblgreco.so does not export (--exclude-libs).
#pragma once
#include <memory>
#include <vector>

#include "config/params.h"
#include "plugin/net/net_plugin.h"
#include "plugin/net/nic.h"
#include "plugin/net/telemetry.h"

namespace lgreco::net {

// The devices to offer NCCL under `params`; empty, with one INFO or WARN line saying why,
// when lgreco should offer none:
//   invalid parameters                 WARN: NCCL uses its own transports, always safe
//   LGRECO_NET=off                     INFO: the shim still compresses
//   LGRECO_NET=auto and an RDMA device  INFO: NCCL keeps its IB transport
//   a malformed LGRECO_SOCKET_IFNAME   WARN
//   no interface qualifies             WARN
std::vector<Device> choose_devices(const config::Params& params, const SystemView& system);

// The plugin's options for `devices` under `params`. Sockets per connection are read as
// NCCL reads NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD: threads x sockets per
// thread with helper threads, else the sockets per thread alone.
NetPlugin::Options plugin_options(const config::Params& params, std::vector<Device> devices, Registry* telemetry);

// The process's plugin.
struct ProcessPlugin {
  std::unique_ptr<NetPlugin> plugin;  // null: no devices offered
  Registry telemetry;
  std::unique_ptr<Exporter> exporter;  // LGRECO_TELEMETRY_FILE; null without
};
// Made at the first call from config::params() and this host's interfaces, logging what
// it offers; thread-safe. Never destroyed: NCCL's proxy threads may still call in while
// the process exits.
ProcessPlugin& process_plugin();

}  // namespace lgreco::net
