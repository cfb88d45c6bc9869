// LocalGpuGroup where the build found no nvcc or no NCCL: Create() says so, so that programs
// link `dsync_nccl` unconditionally and learn at run time what their build lacks.
#include "dsync/local_gpus.h"

namespace dsync {

Result<std::unique_ptr<LocalGpuGroup>> LocalGpuGroup::Create(Worker& /*worker*/,
                                                             LocalGpuOptions /*options*/) {
  return Error(StatusCode::kUnavailable,
               "local GPU aggregation: this build has no NCCL (CMake found no nvcc, or no "
               "nccl.h and libnccl next to the CUDA toolkit); install NCCL (e.g. the "
               "libnccl-dev package) and reconfigure, or push and pull host memory with "
               "dsync::Worker directly");
}

}  // namespace dsync
