// The version of lgreco, and of what it was built against.
#pragma once

#define LGRECO_VERSION_MAJOR 0
#define LGRECO_VERSION_MINOR 1
#define LGRECO_VERSION_PATCH 0

namespace lgreco {

// "0.1.0 (git 1a2b3c4)"; the git part is set by the build when a checkout is present.
const char* version_string();

// NCCL_VERSION_CODE of the nccl.h the library was compiled against, or 0 if none.
int nccl_header_version_code();

}  // namespace lgreco
