// Compiles the shared optimizer math for the device, so a host-only construct slipping into
// ps/optimizer_math.h fails the build wherever nvcc exists, GPU or not. Nothing runs this.
#include "ps/optimizer_math.h"

namespace dsync::ps {

__global__ void OptimizerMathProbe(float* w, float* m, float* v, const float* sum, int n,
                                   OptimizerScalars s) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  SumStep(w[i], sum[i]);
  SgdStep(w[i], sum[i], s);
  MomentumStep(w[i], m[i], sum[i], s);
  AdamStep(w[i], m[i], v[i], sum[i], s);
  AdamWStep(w[i], m[i], v[i], sum[i], s);
}

}  // namespace dsync::ps
