#include "config/version.h"

#if __has_include(<nccl.h>)
#include <nccl.h>
#endif

#ifndef LGRECO_GIT_REVISION
#define LGRECO_GIT_REVISION "unknown"
#endif

#define LGRECO_STR2(x) #x
#define LGRECO_STR(x) LGRECO_STR2(x)

namespace lgreco {

const char* version_string() {
  return LGRECO_STR(LGRECO_VERSION_MAJOR) "." LGRECO_STR(LGRECO_VERSION_MINOR) "." LGRECO_STR(
      LGRECO_VERSION_PATCH) " (git " LGRECO_GIT_REVISION ")";
}

int nccl_header_version_code() {
#ifdef NCCL_VERSION_CODE
  return NCCL_VERSION_CODE;
#else
  return 0;
#endif
}

}  // namespace lgreco
