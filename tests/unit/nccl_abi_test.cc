// plugin/shim/nccl_abi.h declares NCCL's types and values from facts, so that the shim
// builds without nccl.h. Where nccl.h is at hand (CUDA's include directory here and in
// CI), every value is checked against it at compile time.
#include "plugin/shim/nccl_abi.h"

#include <boost/test/unit_test.hpp>

#if __has_include(<nccl.h>)
#include <nccl.h>
#define LGRECO_HAVE_NCCL_H 1

namespace lgreco::nccl {
static_assert(int(kSuccess) == int(ncclSuccess) && int(kUnhandledCudaError) == int(ncclUnhandledCudaError) &&
              int(kSystemError) == int(ncclSystemError) && int(kInternalError) == int(ncclInternalError) &&
              int(kInvalidArgument) == int(ncclInvalidArgument) && int(kInvalidUsage) == int(ncclInvalidUsage) &&
              int(kRemoteError) == int(ncclRemoteError) && int(kInProgress) == int(ncclInProgress));
static_assert(int(kInt8) == int(ncclInt8) && int(kUint8) == int(ncclUint8) && int(kInt32) == int(ncclInt32) && int(kUint32) == int(ncclUint32) &&
              int(kInt64) == int(ncclInt64) && int(kUint64) == int(ncclUint64) && int(kFloat16) == int(ncclFloat16) && int(kFloat32) == int(ncclFloat32) &&
              int(kFloat64) == int(ncclFloat64) && int(kBfloat16) == int(ncclBfloat16));
static_assert(int(kSum) == int(ncclSum) && int(kProd) == int(ncclProd) && int(kMax) == int(ncclMax) && int(kMin) == int(ncclMin) && int(kAvg) == int(ncclAvg) &&
              int(kNumOps) == int(ncclNumOps));
static_assert(sizeof(Result) == sizeof(ncclResult_t) && sizeof(DataType) == sizeof(ncclDataType_t) &&
              sizeof(RedOp) == sizeof(ncclRedOp_t));
static_assert(sizeof(UniqueId) == sizeof(ncclUniqueId));
static_assert(version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE);
static_assert(std::is_same_v<Comm, ncclComm_t>);
}  // namespace lgreco::nccl
#else
#define LGRECO_HAVE_NCCL_H 0
#endif

BOOST_AUTO_TEST_SUITE(nccl_abi)

BOOST_AUTO_TEST_CASE(declared_values_match_nccl_h_where_it_exists) {
  // The checks are static_asserts above; this case records whether they were compiled.
  BOOST_TEST_MESSAGE("nccl.h " << (LGRECO_HAVE_NCCL_H ? "found: values checked" : "absent: values not checked"));
  BOOST_TEST(lgreco::nccl::version_code(2, 28, 9) == 22809);
}

BOOST_AUTO_TEST_SUITE_END()
