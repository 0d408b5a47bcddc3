// Versions of the CUDA runtime lgreco carries (linked statically) and of the driver.
// Querying them creates no CUDA context, so it is safe at library load time, before a
// framework forks its worker processes.
#pragma once

namespace lgreco {

struct CudaVersions {
  bool built_with_cuda = false;
  int runtime = 0;  // e.g. 13000; 0 when built without CUDA
  int driver = 0;   // highest CUDA version the installed driver supports; 0 when none
};

CudaVersions cuda_versions();

}  // namespace lgreco
