// plugin/shim/nccl_abi.h declares NCCL's types and values from facts, so that the shim
// builds without nccl.h. Where nccl.h is at hand (CUDA's include directory here and in
// CI), every value is checked against it at compile time.
#include "plugin/shim/nccl_abi.h"

#include <boost/test/unit_test.hpp>

#if __has_include(<nccl.h>)
#include <nccl.h>
#define LGRECO_HAVE_NCCL_H 1

namespace lgreco::nccl {
static_assert(kSuccess == ncclSuccess && kUnhandledCudaError == ncclUnhandledCudaError &&
              kSystemError == ncclSystemError && kInternalError == ncclInternalError &&
              kInvalidArgument == ncclInvalidArgument && kInvalidUsage == ncclInvalidUsage &&
              kRemoteError == ncclRemoteError && kInProgress == ncclInProgress);
static_assert(kInt8 == ncclInt8 && kUint8 == ncclUint8 && kInt32 == ncclInt32 && kUint32 == ncclUint32 &&
              kInt64 == ncclInt64 && kUint64 == ncclUint64 && kFloat16 == ncclFloat16 && kFloat32 == ncclFloat32 &&
              kFloat64 == ncclFloat64 && kBfloat16 == ncclBfloat16);
static_assert(kSum == ncclSum && kProd == ncclProd && kMax == ncclMax && kMin == ncclMin && kAvg == ncclAvg &&
              kNumOps == ncclNumOps);
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
