// Finding the NCCL library that is already loaded in this process.
//
// lgreco never links libnccl: it must use the copy the framework loaded. dlsym(RTLD_NEXT)
// cannot see a libnccl that PyTorch loaded through an RTLD_LOCAL extension, so the
// loaded objects are scanned instead (shared/DESIGN.md).
#pragma once

#include <optional>
#include <string>

namespace lgreco::shim {

struct LoadedNccl {
  std::string path;      // the object that defines pncclAllReduce
  int version_code = 0;  // from its ncclGetVersion(), e.g. 22809 for 2.28.9
};

// The loaded object exporting both pncclAllReduce and ncclGetVersion: the one global
// symbol lookup finds after this library if any, else the first in load order; nothing
// if NCCL is not loaded (yet). Never loads a library itself.
std::optional<LoadedNccl> find_loaded_nccl();

// "2.28.9" for 22809 (the encoding NCCL uses since 2.9).
std::string nccl_version_name(int version_code);

}  // namespace lgreco::shim
