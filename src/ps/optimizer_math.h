// Per-element optimizer math, written once for both stores: the CPU store calls it in plain
// loops, the CUDA store from its fused kernels, so the CPU tests pin the arithmetic
// the GPU runs. Keep this header free of anything a device cannot execute (no std::, no
// exceptions, no host-only calls). tests/optimizer_math_cuda_probe.cu compiles it with nvcc.
//
// The formulas are PyTorch 1.13's single-tensor (foreach=False) torch.optim.SGD, Adam
// (amsgrad=False) and AdamW, in the same form: the same operations on the same values, with
// the scalars torch computes in Python doubles computed in double on the host (optimizer.cc)
// and rounded once, so a front end that compares with torch.optim agrees to float rounding.
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
  float dampening_keep = 1.0f;  // momentum: 1 - dampening
  // momentum: this is the slice's first step, where torch starts the buffer as a copy of the
  // gradient (no dampening) instead of decaying a zero buffer.
  bool first_step = false;
  bool nesterov = false;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float one_minus_beta1 = 1.0f;
  float one_minus_beta2 = 1.0f;
  float eps = 0.0f;
  float weight_decay = 0.0f;
  float count = 1.0f;  // gradients in the round: the mean divides the sum by it
  float step_size = 0.0f;               // adam, adamw: lr / (1 - beta1^t)
  float bias_correction2_sqrt = 1.0f;   // adam, adamw: sqrt(1 - beta2^t)
  float decoupled_decay = 1.0f;         // adamw: 1 - lr * weight_decay
};

// A round's sum with each gradient weighed by its staleness (StalenessPolicy::Weight, worked
// out on the host once per gradient): the first gradient times its weight, then
// sum + weight * g in member order. A weight of exactly 1 leaves every term as the plain sum
// has it (1 * g == g, and sum + 1 * g rounds like sum + g, fused or not), so fresh gradients
// are summed bit for bit as without weights.
DSYNC_HD float WeighFirst(float g, float weight) { return weight * g; }
DSYNC_HD float AddWeighed(float sum, float g, float weight) { return sum + weight * g; }

// Delay compensation (DC-ASGD, Zheng et al. 2017, "Asynchronous Stochastic Gradient Descent
// with Delay Compensation"): a gradient g computed on the parameters w_base, applied to w,
// is corrected to first order toward w with g * g standing in for the Hessian's diagonal:
// g + lambda * g * g * (w - w_base). The stores call it only for stale gradients, so fresh
// ones stay bit for bit what they were.
DSYNC_HD float Compensate(float g, float w, float w_base, float lambda) {
  return g + lambda * g * g * (w - w_base);
}

// DC-ASGD's adaptive form (DC-ASGD-a) scales lambda by 1 / sqrt(ms), ms a running mean of
// g * g per element, updated with every gradient (fresh ones too), in member order, before
// that gradient is corrected; the paper's decay. Since ms >= (1 - decay) * g * g after the
// update, the correction stays below lambda * |g| * |w - w_base| / sqrt(1 - decay).
constexpr float kMeanSquareDecay = 0.95f;
constexpr float kMeanSquareKeep = 1.0f - kMeanSquareDecay;
// Only keeps 0 / 0 away (a zero gradient on an element never seen nonzero).
constexpr float kMeanSquareEps = 1e-12f;
DSYNC_HD float MeanSquareStep(float ms, float g) {
  return kMeanSquareDecay * ms + kMeanSquareKeep * g * g;
}
DSYNC_HD float AdaptiveLambda(float lambda, float ms) { return lambda / sqrtf(ms + kMeanSquareEps); }

// The round's gradient as the optimizers see it: the mean of the members' gradients.
DSYNC_HD float RoundMean(float sum, const OptimizerScalars& s) { return sum / s.count; }

// sum: theta += sum of the round's gradients (exactness tests count with it).
DSYNC_HD void SumStep(float& w, float sum) { w += sum; }

// torch.optim.SGD without momentum: w -= lr * (g + wd * w).
DSYNC_HD void SgdStep(float& w, float sum, const OptimizerScalars& s) {
  const float g = RoundMean(sum, s) + s.weight_decay * w;
  w -= s.lr * g;
}

// torch.optim.SGD with momentum, dampening and nesterov; `buf` is the momentum buffer.
DSYNC_HD void MomentumStep(float& w, float& buf, float sum, const OptimizerScalars& s) {
  float g = RoundMean(sum, s) + s.weight_decay * w;
  if (s.first_step) {
    buf = g;
  } else {
    buf = s.momentum * buf + s.dampening_keep * g;
  }
  if (s.nesterov) {
    g = g + s.momentum * buf;
  } else {
    g = buf;
  }
  w -= s.lr * g;
}

// Adam's update from its moments and the (already decayed) gradient g, as torch writes it:
// denom = sqrt(v) / sqrt(bc2) + eps; w -= (lr / bc1) * m / denom.
DSYNC_HD void AdamMoments(float& w, float& m, float& v, float g, const OptimizerScalars& s) {
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  w -= s.step_size * (m / denom);
}

// torch.optim.Adam (amsgrad off): L2 weight decay folded into the gradient.
DSYNC_HD void AdamStep(float& w, float& m, float& v, float sum, const OptimizerScalars& s) {
  const float g = RoundMean(sum, s) + s.weight_decay * w;
  AdamMoments(w, m, v, g, s);
}

// torch.optim.AdamW: the weights decay first (w *= 1 - lr * wd), the gradient stays as is.
DSYNC_HD void AdamWStep(float& w, float& m, float& v, float sum, const OptimizerScalars& s) {
  w *= s.decoupled_decay;
  AdamMoments(w, m, v, RoundMean(sum, s), s);
}

}  // namespace dsync::ps
