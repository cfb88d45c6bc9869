// Per-element optimizer math, written once for both stores: the CPU store calls it in plain
// loops, the CUDA store from its fused kernels, so the CPU tests pin the arithmetic
// the GPU runs. Keep this header free of anything a device cannot execute (no std::, no
// exceptions, no host-only calls). tests/optimizer_math_cuda_probe.cu compiles it with nvcc.
#pragma once

#include <math.h>  // sqrtf on host and device alike

#include <cstdint>

#if defined(__CUDACC__)
#define DSYNC_HD __host__ __device__ __forceinline__
#else
#define DSYNC_HD inline
#endif

namespace dsync::ps {

// Everything a round's update needs besides the data, computed once per round on the host.
struct OptimizerScalars {
  float lr = 0.0f;
  float momentum = 0.0f;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float eps = 0.0f;
  float weight_decay = 0.0f;
  float count = 1.0f;        // gradients in the round: the mean divides the sum by it
  float bias_correction1 = 1.0f;  // adam: 1 - beta1^t
  float bias_correction2 = 1.0f;  // adam: 1 - beta2^t
};

// The round's gradient as the optimizers see it: the mean of the members' gradients.
DSYNC_HD float RoundMean(float sum, const OptimizerScalars& s) { return sum / s.count; }

// sum: theta += sum of the round's gradients (exactness tests count with it).
DSYNC_HD void SumStep(float& w, float sum) { w += sum; }

DSYNC_HD void SgdStep(float& w, float sum, const OptimizerScalars& s) {
  const float g = RoundMean(sum, s) + s.weight_decay * w;
  w -= s.lr * g;
}

// Heavy-ball momentum (as torch.optim.SGD with momentum, dampening 0): v = mu v + g.
DSYNC_HD void MomentumStep(float& w, float& v, float sum, const OptimizerScalars& s) {
  const float g = RoundMean(sum, s) + s.weight_decay * w;
  v = s.momentum * v + g;
  w -= s.lr * v;
}

// Adam (Kingma & Ba), bias-corrected, eps outside the square root.
DSYNC_HD void AdamStep(float& w, float& m, float& v, float sum, const OptimizerScalars& s) {
  const float g = RoundMean(sum, s) + s.weight_decay * w;
  m = s.beta1 * m + (1.0f - s.beta1) * g;
  v = s.beta2 * v + (1.0f - s.beta2) * g * g;
  const float m_hat = m / s.bias_correction1;
  const float v_hat = v / s.bias_correction2;
  w -= s.lr * m_hat / (sqrtf(v_hat) + s.eps);
}

}  // namespace dsync::ps
