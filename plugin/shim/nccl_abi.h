// The parts of NCCL's C API the shim touches, declared here from nccl.h's facts (NCCL
// 2.28.9), so that liblgreco.so builds without nccl.h and never links libnccl.
//
// Names live in lgreco::nccl so that a file may include nccl.h beside this one
// (tests/unit/nccl_abi_test.cc does, and checks every value below against it). Every
// value here has been stable since NCCL 2.12, the oldest version the shim accepts.
#pragma once

#include <cstddef>
#include <cstdint>

struct ncclComm;     // opaque, as in nccl.h (ncclComm_t is ncclComm*)
struct CUstream_st;  // cudaStream_t

namespace lgreco::nccl {

using Comm = ::ncclComm*;
using Stream = ::CUstream_st*;

// ncclResult_t
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};

// ncclDataType_t
enum DataType : int {
  kInt8 = 0,
  kUint8 = 1,
  kInt32 = 2,
  kUint32 = 3,
  kInt64 = 4,
  kUint64 = 5,
  kFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBfloat16 = 9,
};

// ncclRedOp_t: the built-in operations; values from kNumOps up are operations a user
// created (ncclRedOpCreatePreMulSum), which the shim never compresses.
enum RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,
  kNumOps = 5,
};

// NCCL_VERSION(major, minor, patch) for versions since 2.9.
constexpr int version_code(int major, int minor, int patch) { return major * 10000 + minor * 100 + patch; }

// ncclUniqueId: 128 opaque bytes (for tools that create communicators).
struct UniqueId {
  char internal[128];
};

}  // namespace lgreco::nccl
