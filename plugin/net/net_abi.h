// NCCL's network-plugin ABI, versions 8 to 11, as lgreco's own declarations.
//
// NCCL does not install its plugin headers, so these structs are written here from the
// public NCCL source at tag v2.28.9-1 (ext-net/example/nccl/net_v8.h ... net_v11.h,
// net.h, net_device.h, common.h). Field order and types are the ABI: NCCL reads these
// structs by offset. The static_asserts at the end pin the offsets of the fields that
// changed between versions, computed by hand from those headers for LP64 (x86-64 and
// aarch64 Linux); a mistake here would make NCCL read garbage, so change nothing
// without the header of that tag beside you. Other branches of NCCL (e.g. `cross-dc`)
// carry a different ncclNet_v11_t: do not copy from them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "plugin/shim/nccl_abi.h"

namespace lgreco::net::abi {

using Result = nccl::Result;  // ncclResult_t (an int-sized enum)

inline constexpr int kHandleMaxBytes = 128;  // NCCL_NET_HANDLE_MAXSIZE
inline constexpr int kPtrHost = 0x1;         // NCCL_PTR_HOST
inline constexpr int kPtrCuda = 0x2;         // NCCL_PTR_CUDA
inline constexpr int kPtrDmaBuf = 0x4;       // NCCL_PTR_DMABUF
inline constexpr int kMaxRequests = 32;      // NCCL_NET_MAX_REQUESTS
inline constexpr int kMaxDevsPerNic = 4;     // NCCL_NET_MAX_DEVS_PER_NIC
inline constexpr int kDeviceInvalidVersion = 0;  // NCCL_NET_DEVICE_INVALID_VERSION
inline constexpr int kTrafficClassUndef = -1;    // NCCL_NET_TRAFFIC_CLASS_UNDEF
inline constexpr uint64_t kMaxNetSizeBytes = uint64_t{1} << 40;  // NCCL_MAX_NET_SIZE_BYTES

// ncclDebugLogLevel and the NCCL_NET subsystem flag (common.h).
enum LogLevel : int { kLogNone = 0, kLogVersion = 1, kLogWarn = 2, kLogInfo = 3, kLogAbort = 4, kLogTrace = 5 };
inline constexpr unsigned long kLogSubsysInit = 1;
inline constexpr unsigned long kLogSubsysNet = 16;
using Logger = void (*)(int level, unsigned long flags, const char* file, int line, const char* format, ...);
using ProfilerCallback = Result (*)(void** event_handle, int type, void* phandle, int64_t plugin_id, void* ext_data);

enum DeviceType : int { kDeviceHost = 0, kDeviceUnpack = 1 };  // ncclNetDeviceType

struct DeviceHandle {  // ncclNetDeviceHandle_v7_t .. _v11_t (all the same)
  DeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
};

struct VDeviceProps {  // ncclNetVDeviceProps_v9_t .. _v11_t
  int ndevs;
  int devs[kMaxDevsPerNic];
};

struct CommConfig {  // ncclNetCommConfig_v10_t, _v11_t
  int trafficClass;
};

struct Properties_v8 {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int speed;  // Mbps
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  DeviceType netDeviceType;
  int netDeviceVersion;
};

struct Properties_v9 {  // also v10
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  DeviceType netDeviceType;
  int netDeviceVersion;
  VDeviceProps vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
};
using Properties_v10 = Properties_v9;

struct Properties_v11 {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  DeviceType netDeviceType;
  int netDeviceVersion;
  VDeviceProps vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
};

struct CommAttr_v11 {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
};
struct NetAttr_v11 {
  CommAttr_v11 sendCommAttr;
  CommAttr_v11 recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
};

struct Net_v11 {
  const char* name;
  Result (*init)(void** ctx, uint64_t commId, CommConfig* config, Logger logFunction, ProfilerCallback profFunction);
  Result (*devices)(int* ndev);
  Result (*getProperties)(int dev, Properties_v11* props);
  Result (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  Result (*connect)(void* ctx, int dev, void* handle, void** sendComm, DeviceHandle** sendDevComm);
  Result (*accept)(void* listenComm, void** recvComm, DeviceHandle** recvDevComm);
  Result (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  Result (*deregMr)(void* comm, void* mhandle);
  Result (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle, void** request);
  Result (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** phandles,
                  void** request);
  Result (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*closeSend)(void* sendComm);
  Result (*closeRecv)(void* recvComm);
  Result (*closeListen)(void* listenComm);
  Result (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecvConsumed)(void* recvComm, int n, void* request);
  Result (*makeVDevice)(int* d, VDeviceProps* props);
  Result (*finalize)(void* ctx);
  Result (*setNetAttr)(void* ctx, NetAttr_v11* netAttr);
};

struct Net_v10 {
  const char* name;
  Result (*init)(Logger logFunction, ProfilerCallback profFunction);
  Result (*devices)(int* ndev);
  Result (*getProperties)(int dev, Properties_v10* props);
  Result (*listen)(int dev, void* handle, void** listenComm);
  Result (*connect)(int dev, CommConfig* config, void* handle, void** sendComm, DeviceHandle** sendDevComm);
  Result (*accept)(void* listenComm, void** recvComm, DeviceHandle** recvDevComm);
  Result (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  Result (*deregMr)(void* comm, void* mhandle);
  Result (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle, void** request);
  Result (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** phandles,
                  void** request);
  Result (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*closeSend)(void* sendComm);
  Result (*closeRecv)(void* recvComm);
  Result (*closeListen)(void* listenComm);
  Result (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecvConsumed)(void* recvComm, int n, void* request);
  Result (*makeVDevice)(int* d, VDeviceProps* props);
};

struct Net_v9 {
  const char* name;
  Result (*init)(Logger logFunction);
  Result (*devices)(int* ndev);
  Result (*getProperties)(int dev, Properties_v9* props);
  Result (*listen)(int dev, void* handle, void** listenComm);
  Result (*connect)(int dev, void* handle, void** sendComm, DeviceHandle** sendDevComm);
  Result (*accept)(void* listenComm, void** recvComm, DeviceHandle** recvDevComm);
  Result (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  Result (*deregMr)(void* comm, void* mhandle);
  Result (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request);
  Result (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request);
  Result (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*closeSend)(void* sendComm);
  Result (*closeRecv)(void* recvComm);
  Result (*closeListen)(void* listenComm);
  Result (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecvConsumed)(void* recvComm, int n, void* request);
  Result (*makeVDevice)(int* d, VDeviceProps* props);
};

struct Net_v8 {
  const char* name;
  Result (*init)(Logger logFunction);
  Result (*devices)(int* ndev);
  Result (*getProperties)(int dev, Properties_v8* props);
  Result (*listen)(int dev, void* handle, void** listenComm);
  Result (*connect)(int dev, void* handle, void** sendComm, DeviceHandle** sendDevComm);
  Result (*accept)(void* listenComm, void** recvComm, DeviceHandle** recvDevComm);
  Result (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  Result (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  Result (*deregMr)(void* comm, void* mhandle);
  Result (*isend)(void* sendComm, void* data, int size, int tag, void* mhandle, void** request);
  Result (*irecv)(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request);
  Result (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  Result (*test)(void* request, int* done, int* sizes);
  Result (*closeSend)(void* sendComm);
  Result (*closeRecv)(void* recvComm);
  Result (*closeListen)(void* listenComm);
  Result (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  Result (*irecvConsumed)(void* recvComm, int n, void* request);
};

// Offsets from the v2.28.9-1 headers (LP64), so that a slip in field order fails the build.
static_assert(sizeof(DeviceHandle) == 32);
static_assert(offsetof(Properties_v8, speed) == 32 && offsetof(Properties_v8, netDeviceVersion) == 56 &&
              sizeof(Properties_v8) == 64);
static_assert(offsetof(Properties_v9, forceFlush) == 32 && offsetof(Properties_v9, vProps) == 64 &&
              offsetof(Properties_v9, maxP2pBytes) == 88 && sizeof(Properties_v9) == 104);
static_assert(offsetof(Properties_v11, maxMultiRequestSize) == 104 && sizeof(Properties_v11) == 112);
static_assert(sizeof(NetAttr_v11) == 44);
static_assert(offsetof(Net_v11, finalize) == 20 * sizeof(void*) &&
              offsetof(Net_v11, setNetAttr) == 21 * sizeof(void*) && sizeof(Net_v11) == 22 * sizeof(void*));
static_assert(sizeof(Net_v10) == 20 * sizeof(void*) && sizeof(Net_v9) == 20 * sizeof(void*) &&
              sizeof(Net_v8) == 19 * sizeof(void*));

}  // namespace lgreco::net::abi
