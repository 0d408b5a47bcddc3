// The NCCL net-plugin tables liblgreco.so exports: ncclNetPlugin_v11, and v10, v9 and v8
// for older NCCLs (2.19 and later), each a thin adapter onto the process's one NetPlugin
// (net_plugin.h). NCCL finds them when NCCL_NET_PLUGIN=lgreco makes it open
// libnccl-net-lgreco.so (a name of this library), or when this library is preloaded and
// NCCL_NET_PLUGIN names it.
//
// init does three things, in this order:
//   1. hands lgreco's log lines to NCCL's logger (so NCCL_DEBUG=INFO shows them);
//   2. installs the collective shim (plugin/net/loader.h) on every call, so objects
//      loaded since the last communicator are reached too; this also pins the library,
//      because NCCL dlcloses a plugin that reports no devices;
//   3. on the first call only, makes the process's plugin (plugin_setup.h), which decides
//      which devices to offer (LGRECO_NET): none for `off`, none where an RDMA device
//      exists under `auto` (NCCL keeps its IB transport and compression still works
//      through the shim), else the interfaces LGRECO_SOCKET_IFNAME selects.
// A configuration that cannot be used (an invalid LGRECO_* value, no interface) offers no
// devices with a WARN: NCCL then uses its own transports, which is always safe.
//
// Only this file goes into liblgreco.so without the core archive (like entry_points.cc);
// it holds no logic beyond argument conversion, so that the C++ runtime's inline symbols
// (which keep default visibility) stay in the archive and out of the library's exports.
#include <exception>

#include "config/log.h"
#include "plugin/net/loader.h"
#include "plugin/net/net_abi.h"
#include "plugin/net/net_plugin.h"
#include "plugin/net/plugin_setup.h"

namespace lgreco::net {
namespace {

using abi::Result;

// What v11's init hands back as its context: the communicator it was made for.
struct Context {
  static constexpr uint64_t kMagic = 0x5854434e45545247;
  uint64_t magic = kMagic;
  uint64_t comm_id = 0;
};
// Versions before 11 name no communicator: their connections carry id 0, and only the
// listener's nonce ties a connection to its handle.
constexpr uint64_t kNoCommId = 0;

// Nothing may unwind into NCCL's C code.
template <typename Fn>
Result guarded(const char* call, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::exception& e) {
    LGRECO_WARN("NET", "%s: unexpected error in lgreco: %s", call, e.what());
  } catch (...) {
    LGRECO_WARN("NET", "%s: unexpected error in lgreco", call);
  }
  return nccl::kInternalError;
}

Result initialize(abi::Logger logger) {
  if (logger) log::set_nccl_logger(logger);
  install_shim();
  process_plugin();
  return nccl::kSuccess;
}

// The plugin, for calls that NCCL makes only after devices() reported some.
NetPlugin* plugin(const char* call) {
  NetPlugin* p = process_plugin().plugin.get();
  if (!p) LGRECO_WARN("NET", "%s: called although lgreco offered no devices", call);
  return p;
}

uint64_t comm_id_of(void* ctx) {
  const auto* context = static_cast<const Context*>(ctx);
  return context && context->magic == Context::kMagic ? context->comm_id : kNoCommId;
}

Result devices(int* ndev) {
  return guarded("devices", [&] {
    if (!ndev) return nccl::kInvalidArgument;
    NetPlugin* p = process_plugin().plugin.get();
    *ndev = p ? p->device_count() : 0;
    return nccl::kSuccess;
  });
}

Result properties_v11(int dev, abi::Properties_v11* props) {
  return guarded("getProperties", [&] {
    NetPlugin* p = plugin("getProperties");
    return p ? p->properties(dev, props) : nccl::kInternalError;
  });
}

Result listen(uint64_t comm_id, int dev, void* handle, void** listen_comm) {
  return guarded("listen", [&] {
    NetPlugin* p = plugin("listen");
    return p ? p->listen(comm_id, dev, handle, listen_comm) : nccl::kInternalError;
  });
}

Result connect(uint64_t comm_id, int dev, void* handle, void** send_comm, abi::DeviceHandle** device_handle) {
  return guarded("connect", [&] {
    // Only a NetDeviceType other than host makes NCCL ask for an offload handle.
    if (device_handle) *device_handle = nullptr;
    NetPlugin* p = plugin("connect");
    return p ? p->connect(comm_id, dev, handle, send_comm) : nccl::kInternalError;
  });
}

Result accept(void* listen_comm, void** recv_comm, abi::DeviceHandle** device_handle) {
  return guarded("accept", [&] {
    if (device_handle) *device_handle = nullptr;
    NetPlugin* p = plugin("accept");
    return p ? p->accept(listen_comm, recv_comm) : nccl::kInternalError;
  });
}

Result reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return guarded("regMr", [&] {
    NetPlugin* p = plugin("regMr");
    return p ? p->reg_mr(comm, data, size, type, mhandle) : nccl::kInternalError;
  });
}

Result reg_mr_dmabuf(void*, void*, size_t size, int, uint64_t, int, void** mhandle) {
  if (mhandle) *mhandle = nullptr;
  LGRECO_WARN("NET", "regMrDmaBuf of %zu bytes: lgreco's TCP transport takes host memory only (it reports no "
              "NCCL_PTR_DMABUF support)", size);
  return nccl::kInvalidUsage;
}

Result dereg_mr(void* comm, void* mhandle) {
  return guarded("deregMr", [&] {
    NetPlugin* p = plugin("deregMr");
    return p ? p->dereg_mr(comm, mhandle) : nccl::kInternalError;
  });
}

Result isend(void* send_comm, void* data, size_t size, int tag, void*, void*, void** request) {
  return guarded("isend", [&] {
    NetPlugin* p = plugin("isend");
    return p ? p->isend(send_comm, data, size, tag, request) : nccl::kInternalError;
  });
}

Result isend_v9(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  return isend(send_comm, data, size, tag, mhandle, nullptr, request);
}

Result isend_v8(void* send_comm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) {
    if (request) *request = nullptr;
    LGRECO_WARN("NET", "isend: negative size %d", size);
    return nccl::kInvalidArgument;
  }
  return isend(send_comm, data, static_cast<size_t>(size), tag, mhandle, nullptr, request);
}

Result irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void**, void**, void** request) {
  return guarded("irecv", [&] {
    NetPlugin* p = plugin("irecv");
    return p ? p->irecv(recv_comm, n, data, sizes, tags, request) : nccl::kInternalError;
  });
}

Result irecv_v9(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request) {
  return irecv(recv_comm, n, data, sizes, tags, mhandles, nullptr, request);
}

Result irecv_v8(void* recv_comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request) {
  if (request) *request = nullptr;
  if (n < 1 || n > transport::kMaxRecvs || !sizes) {
    LGRECO_WARN("NET", "irecv: %d buffers; lgreco's properties allow 1 to %d", n, transport::kMaxRecvs);
    return nccl::kInvalidArgument;
  }
  size_t sizes64[transport::kMaxRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) {
      LGRECO_WARN("NET", "irecv: buffer %d has a negative size %d", i, sizes[i]);
      return nccl::kInvalidArgument;
    }
    sizes64[i] = static_cast<size_t>(sizes[i]);
  }
  return irecv(recv_comm, n, data, sizes64, tags, mhandles, nullptr, request);
}

Result iflush(void* recv_comm, int, void**, int*, void**, void** request) {
  return guarded("iflush", [&] {
    NetPlugin* p = plugin("iflush");
    return p ? p->iflush(recv_comm, request) : nccl::kInternalError;
  });
}

Result test(void* request, int* done, int* sizes) {
  return guarded("test", [&] {
    NetPlugin* p = plugin("test");
    return p ? p->test(request, done, sizes) : nccl::kInternalError;
  });
}

Result close_send(void* comm) {
  return guarded("closeSend", [&] {
    NetPlugin* p = plugin("closeSend");
    return p ? p->close_send(comm) : nccl::kInternalError;
  });
}

Result close_recv(void* comm) {
  return guarded("closeRecv", [&] {
    NetPlugin* p = plugin("closeRecv");
    return p ? p->close_recv(comm) : nccl::kInternalError;
  });
}

Result close_listen(void* comm) {
  return guarded("closeListen", [&] {
    NetPlugin* p = plugin("closeListen");
    return p ? p->close_listen(comm) : nccl::kInternalError;
  });
}

// Device offload only (netDeviceType other than host): NCCL never calls these for lgreco.
Result get_device_mr(void*, void*, void** dptr_mhandle) {
  if (dptr_mhandle) *dptr_mhandle = nullptr;
  LGRECO_WARN("NET", "getDeviceMr: lgreco's transport has no device offload");
  return nccl::kInternalError;
}
Result irecv_consumed(void*, int, void*) {
  LGRECO_WARN("NET", "irecvConsumed: lgreco's transport has no device offload");
  return nccl::kInternalError;
}

// --- v11 ---------------------------------------------------------------------------------

Result init_v11(void** ctx, uint64_t comm_id, abi::CommConfig*, abi::Logger logger, abi::ProfilerCallback) {
  return guarded("init", [&] {
    if (!ctx) return nccl::kInvalidArgument;
    *ctx = nullptr;
    const Result result = initialize(logger);
    if (result != nccl::kSuccess) return result;
    *ctx = new Context{Context::kMagic, comm_id};
    return nccl::kSuccess;
  });
}

Result listen_v11(void* ctx, int dev, void* handle, void** listen_comm) {
  return listen(comm_id_of(ctx), dev, handle, listen_comm);
}

Result connect_v11(void* ctx, int dev, void* handle, void** send_comm, abi::DeviceHandle** device_handle) {
  return connect(comm_id_of(ctx), dev, handle, send_comm, device_handle);
}

Result finalize_v11(void* ctx) {
  auto* context = static_cast<Context*>(ctx);
  if (context && context->magic == Context::kMagic) {
    context->magic = 0;
    delete context;
  }
  return nccl::kSuccess;
}

Result set_net_attr_v11(void*, abi::NetAttr_v11*) {
  return nccl::kSuccess;  // hints for multi-NIC flow placement: nothing to tune over TCP
}

// --- v10, v9, v8 -------------------------------------------------------------------------

Result init_v10(abi::Logger logger, abi::ProfilerCallback) {
  return guarded("init", [&] { return initialize(logger); });
}
Result init_v9(abi::Logger logger) {
  return guarded("init", [&] { return initialize(logger); });
}

Result properties_v9(int dev, abi::Properties_v9* props) {
  if (!props) return nccl::kInvalidArgument;
  abi::Properties_v11 p11;
  const Result result = properties_v11(dev, &p11);
  if (result != nccl::kSuccess) return result;
  *props = abi::Properties_v9{p11.name, p11.pciPath, p11.guid, p11.ptrSupport, p11.regIsGlobal, p11.forceFlush,
                              p11.speed, p11.port, p11.latency, p11.maxComms, p11.maxRecvs, p11.netDeviceType,
                              p11.netDeviceVersion, p11.vProps, p11.maxP2pBytes, p11.maxCollBytes};
  return nccl::kSuccess;
}

Result properties_v8(int dev, abi::Properties_v8* props) {
  if (!props) return nccl::kInvalidArgument;
  abi::Properties_v11 p11;
  const Result result = properties_v11(dev, &p11);
  if (result != nccl::kSuccess) return result;
  *props = abi::Properties_v8{p11.name, p11.pciPath, p11.guid, p11.ptrSupport, p11.regIsGlobal, p11.speed,
                              p11.port, p11.latency, p11.maxComms, p11.maxRecvs, p11.netDeviceType,
                              p11.netDeviceVersion};
  return nccl::kSuccess;
}

Result listen_old(int dev, void* handle, void** listen_comm) { return listen(kNoCommId, dev, handle, listen_comm); }

Result connect_v10(int dev, abi::CommConfig*, void* handle, void** send_comm, abi::DeviceHandle** device_handle) {
  return connect(kNoCommId, dev, handle, send_comm, device_handle);
}
Result connect_old(int dev, void* handle, void** send_comm, abi::DeviceHandle** device_handle) {
  return connect(kNoCommId, dev, handle, send_comm, device_handle);
}

constexpr const char* kPluginName = "lgreco";

}  // namespace
}  // namespace lgreco::net

#define LGRECO_EXPORT extern "C" __attribute__((visibility("default")))

namespace n = lgreco::net;

LGRECO_EXPORT const lgreco::net::abi::Net_v11 ncclNetPlugin_v11 = {
    n::kPluginName,   n::init_v11,     n::devices,      n::properties_v11,  n::listen_v11,   n::connect_v11,
    n::accept,        n::reg_mr,       n::reg_mr_dmabuf, n::dereg_mr,       n::isend,        n::irecv,
    n::iflush,        n::test,         n::close_send,   n::close_recv,      n::close_listen, n::get_device_mr,
    n::irecv_consumed, nullptr /* makeVDevice: NCCL uses the physical devices */, n::finalize_v11,
    n::set_net_attr_v11};

LGRECO_EXPORT const lgreco::net::abi::Net_v10 ncclNetPlugin_v10 = {
    n::kPluginName, n::init_v10, n::devices,    n::properties_v9, n::listen_old,  n::connect_v10,    n::accept,
    n::reg_mr,      n::reg_mr_dmabuf, n::dereg_mr, n::isend,     n::irecv,       n::iflush,          n::test,
    n::close_send,  n::close_recv, n::close_listen, n::get_device_mr, n::irecv_consumed, nullptr};

LGRECO_EXPORT const lgreco::net::abi::Net_v9 ncclNetPlugin_v9 = {
    n::kPluginName, n::init_v9,   n::devices,   n::properties_v9, n::listen_old,   n::connect_old, n::accept,
    n::reg_mr,      n::reg_mr_dmabuf, n::dereg_mr, n::isend_v9,  n::irecv_v9,     n::iflush,      n::test,
    n::close_send,  n::close_recv, n::close_listen, n::get_device_mr, n::irecv_consumed, nullptr};

LGRECO_EXPORT const lgreco::net::abi::Net_v8 ncclNetPlugin_v8 = {
    n::kPluginName, n::init_v9,   n::devices,   n::properties_v8, n::listen_old,   n::connect_old, n::accept,
    n::reg_mr,      n::reg_mr_dmabuf, n::dereg_mr, n::isend_v8,  n::irecv_v8,     n::iflush,      n::test,
    n::close_send,  n::close_recv, n::close_listen, n::get_device_mr, n::irecv_consumed};
