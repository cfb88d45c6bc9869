#include "mlp_math.h"

#ifdef DSYNC_TRAIN_HAVE_CUDA
#include "cuda/cuda_store.h"  // DeviceAvailable: one notion of "visible" for store and worker
#include "gpu_mlp.h"
#endif

namespace dsync::train {

Result<MlpMathKind> ParseMlpMath(std::string_view text) {
  if (text == "cpu") return MlpMathKind::kCpu;
  if (text == "cuda") return MlpMathKind::kCuda;
  if (text == "auto") return MlpMathKind::kAuto;
  return Error(StatusCode::kInvalidArgument, "--worker-math '{}' is not one of cpu, cuda, auto",
               text);
}

std::string_view MlpMathName(MlpMathKind kind) {
  switch (kind) {
    case MlpMathKind::kCpu: return "cpu";
    case MlpMathKind::kCuda: return "cuda";
    case MlpMathKind::kAuto: return "auto";
  }
  return "?";
}

bool BuildHasCudaMath() {
#ifdef DSYNC_TRAIN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

Status LoadCudaMathLibraries() {
#ifdef DSYNC_TRAIN_HAVE_CUDA
  return GpuMlp::LoadLibraries();
#else
  return Error(StatusCode::kFailedPrecondition,
               "this build has no CUDA worker math (it was configured without nvcc or cuBLAS)");
#endif
}

Result<MlpMathKind> ResolveMlpMath(MlpMathKind requested) {
  if (requested == MlpMathKind::kCpu) return MlpMathKind::kCpu;
#ifdef DSYNC_TRAIN_HAVE_CUDA
  std::string why;
  if (!cuda::DeviceAvailable(&why)) {
    if (requested == MlpMathKind::kAuto) return MlpMathKind::kCpu;
    return Error(StatusCode::kFailedPrecondition,
                 "no CUDA device is visible ({}); use --worker-math cpu", why);
  }
  if (Status s = GpuMlp::LoadLibraries(); !s.ok()) {
    if (requested == MlpMathKind::kAuto) return MlpMathKind::kCpu;
    return s;
  }
  return MlpMathKind::kCuda;
#else
  if (requested == MlpMathKind::kAuto) return MlpMathKind::kCpu;
  return Error(StatusCode::kFailedPrecondition,
               "this build has no CUDA worker math (it was configured without nvcc or cuBLAS); "
               "use --worker-math cpu");
#endif
}

Result<std::unique_ptr<MlpMath>> MakeCudaMlp(const std::vector<uint32_t>& sizes,
                                             uint32_t max_batch) {
  DSYNC_RETURN_IF_ERROR(ResolveMlpMath(MlpMathKind::kCuda).status());
#ifdef DSYNC_TRAIN_HAVE_CUDA
  DSYNC_ASSIGN_OR_RETURN(std::unique_ptr<GpuMlp> gpu, GpuMlp::Create(sizes, max_batch));
  return std::unique_ptr<MlpMath>(std::move(gpu));
#else
  (void)sizes;
  (void)max_batch;
  return Error(StatusCode::kInternal, "unreachable: ResolveMlpMath refuses cuda here");
#endif
}

}  // namespace dsync::train
