// One thread's share of the fused update kernel (apply_kernels.cu), written as host+device
// code so that tests/apply_kernels_test.cc can emulate any grid on a CPU and check, bit for
// bit, the index logic of the float4 path, its scalar tail and its scalar fallback.
//
// float4 is CUDA's own type from <vector_types.h> (plain C++, usable by g++): host and device
// then share one definition whose 16-byte alignment the device's vector loads rely on.
#pragma once

#include <vector_types.h>

#include <cstdint>
#include <cstdlib>  // host emulation only: abort, memcpy
#include <cstring>

#include "cuda/apply_kernels.h"
#include "ps/optimizer_math.h"

namespace dsync::cuda {

// Per-element state arrays an update reads and writes (momentum: buf; adam, adamw: m, v). A
// variable, not a function, so that device code may use it without --expt-relaxed-constexpr.
template <Update U>
inline constexpr int kStateArrays =
    U == Update::kAdam || U == Update::kAdamW ? 2 : U == Update::kMomentum ? 1 : 0;

DSYNC_HD bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A 16-byte global access must be 16-byte aligned, or it reads wrong words or faults
// (CUDA C++ Programming Guide, "Device Memory Accesses"; float4's alignment: "Built-in Vector
// Types"). cudaMalloc returns 256-byte aligned memory, so in the store only the gradient
// stride can break it. Only the arrays update U touches count: sgd ignores s0 and s1.
template <Update U>
DSYNC_HD bool UsesVec4(const float* w, const float* s0, const float* s1, const float* g,
                       uint32_t k, uint64_t stride, const KernelCompensation& comp = {}) {
  bool ok = Aligned16(w) && Aligned16(g) && (k <= 1 || stride % 4 == 0);
  if constexpr (kStateArrays<U> >= 1) ok = ok && Aligned16(s0);
  if constexpr (kStateArrays<U> >= 2) ok = ok && Aligned16(s1);
  if (comp.kept != nullptr) ok = ok && Aligned16(comp.kept) && comp.row_stride % 4 == 0;
  if (comp.mean_square != nullptr) ok = ok && Aligned16(comp.mean_square);
  return ok;
}

// The device loads and stores whole float4s. The host emulation copies bytes instead (no
// aliasing questions) and aborts where the device would fault on a misaligned access.
DSYNC_HD float4 Load4(const float* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const float4*>(p);
#else
  if (!Aligned16(p)) std::abort();
  float4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

DSYNC_HD void Store4(float* p, const float4& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float4*>(p) = v;
#else
  if (!Aligned16(p)) std::abort();
  std::memcpy(p, &v, sizeof v);
#endif
}

// The optimizer step of ps/optimizer_math.h on one element; s0/s1 are dummies where unused.
template <Update U>
DSYNC_HD void Step(float& w, float& s0, float& s1, float sum, const ps::OptimizerScalars& sc) {
  if constexpr (U == Update::kSum) {
    ps::SumStep(w, sum);
  } else if constexpr (U == Update::kSgd) {
    ps::SgdStep(w, sum, sc);
  } else if constexpr (U == Update::kMomentum) {
    ps::MomentumStep(w, s0, sum, sc);
  } else if constexpr (U == Update::kAdam) {
    ps::AdamStep(w, s0, s1, sum, sc);
  } else {
    ps::AdamWStep(w, s0, s1, sum, sc);
  }
  (void)s0;
  (void)s1;
}

// Gradient j of element i as it enters the sum: corrected toward its kept row when it has one
// (ps::Compensate; w is the element's value before the update). With the adaptive form, `ms`
// (the element's running mean square, in a register) first takes in the gradient.
DSYNC_HD float TermOf(const float* __restrict__ g, const KernelCompensation& comp, uint32_t j,
                      uint64_t stride, uint64_t i, float w, float& ms) {
  const float gj = g[j * stride + i];
  if (comp.mean_square != nullptr) ms = ps::MeanSquareStep(ms, gj);
  if (comp.rows == nullptr || comp.rows[j] < 0) return gj;
  // The square root only for a gradient it corrects.
  const float lambda = comp.mean_square != nullptr ? ps::AdaptiveLambda(comp.lambda, ms) : comp.lambda;
  return ps::Compensate(gj, w, comp.kept[static_cast<uint64_t>(comp.rows[j]) * comp.row_stride + i],
                        lambda);
}

// The same for 4 consecutive elements, with 16-byte loads.
DSYNC_HD float4 TermOf4(const float* __restrict__ g, const KernelCompensation& comp, uint32_t j,
                        uint64_t stride, uint64_t i, const float4& w, float4& ms) {
  float4 gj = Load4(g + j * stride + i);
  if (comp.mean_square != nullptr) {
    ms.x = ps::MeanSquareStep(ms.x, gj.x);
    ms.y = ps::MeanSquareStep(ms.y, gj.y);
    ms.z = ps::MeanSquareStep(ms.z, gj.z);
    ms.w = ps::MeanSquareStep(ms.w, gj.w);
  }
  if (comp.rows == nullptr || comp.rows[j] < 0) return gj;
  float4 lambda{comp.lambda, comp.lambda, comp.lambda, comp.lambda};
  if (comp.mean_square != nullptr) {
    lambda.x = ps::AdaptiveLambda(comp.lambda, ms.x);
    lambda.y = ps::AdaptiveLambda(comp.lambda, ms.y);
    lambda.z = ps::AdaptiveLambda(comp.lambda, ms.z);
    lambda.w = ps::AdaptiveLambda(comp.lambda, ms.w);
  }
  const float4 h = Load4(comp.kept + static_cast<uint64_t>(comp.rows[j]) * comp.row_stride + i);
  gj.x = ps::Compensate(gj.x, w.x, h.x, lambda.x);
  gj.y = ps::Compensate(gj.y, w.y, h.y, lambda.y);
  gj.z = ps::Compensate(gj.z, w.z, h.z, lambda.z);
  gj.w = ps::Compensate(gj.w, w.w, h.w, lambda.w);
  return gj;
}

// The sum of the k >= 1 gradients of one element, in order 0..k-1, each corrected as TermOf
// says and weighed when `weights` is not null (ps/optimizer_math.h WeighFirst, AddWeighed).
DSYNC_HD float SumOf(const float* __restrict__ g, const float* __restrict__ weights,
                     const KernelCompensation& comp, uint32_t k, uint64_t stride, uint64_t i,
                     float w, float& ms) {
  if (weights == nullptr) {
    float sum = TermOf(g, comp, 0, stride, i, w, ms);
    for (uint32_t j = 1; j < k; ++j) sum += TermOf(g, comp, j, stride, i, w, ms);
    return sum;
  }
  float sum = ps::WeighFirst(TermOf(g, comp, 0, stride, i, w, ms), weights[0]);
  for (uint32_t j = 1; j < k; ++j) {
    sum = ps::AddWeighed(sum, TermOf(g, comp, j, stride, i, w, ms), weights[j]);
  }
  return sum;
}

// The same for 4 consecutive elements at once, with 16-byte loads: per element the very
// operations SumOf does.
DSYNC_HD float4 SumOf4(const float* __restrict__ g, const float* __restrict__ weights,
                       const KernelCompensation& comp, uint32_t k, uint64_t stride, uint64_t i,
                       const float4& w, float4& ms) {
  float4 sum = TermOf4(g, comp, 0, stride, i, w, ms);
  if (weights == nullptr) {
    for (uint32_t j = 1; j < k; ++j) {
      const float4 gj = TermOf4(g, comp, j, stride, i, w, ms);
      sum.x += gj.x;
      sum.y += gj.y;
      sum.z += gj.z;
      sum.w += gj.w;
    }
    return sum;
  }
  sum.x = ps::WeighFirst(sum.x, weights[0]);
  sum.y = ps::WeighFirst(sum.y, weights[0]);
  sum.z = ps::WeighFirst(sum.z, weights[0]);
  sum.w = ps::WeighFirst(sum.w, weights[0]);
  for (uint32_t j = 1; j < k; ++j) {
    const float4 gj = TermOf4(g, comp, j, stride, i, w, ms);
    sum.x = ps::AddWeighed(sum.x, gj.x, weights[j]);
    sum.y = ps::AddWeighed(sum.y, gj.y, weights[j]);
    sum.z = ps::AddWeighed(sum.z, gj.z, weights[j]);
    sum.w = ps::AddWeighed(sum.w, gj.w, weights[j]);
  }
  return sum;
}

// Thread `thread` of `threads` (grid-stride): with the float4 path it takes groups of 4
// elements q = thread, thread + threads, ... below n/4, then the n % 4 tail elements one
// each; otherwise single elements thread, thread + threads, ... Every element of [0, n) is
// owned by exactly one thread, and nothing outside it (nor gradient padding) is read.
// Per element, both paths sum the k >= 1 gradients in order 0..k-1 (corrected by `comp` and
// weighed by `weights`, k floats, when not null), keep w where comp says, and then call the
// same Step, so they give identical results.
template <Update U>
DSYNC_HD void ApplyThread(uint64_t thread, uint64_t threads, float* __restrict__ w,
                          float* __restrict__ s0, float* __restrict__ s1,
                          const float* __restrict__ g, const float* __restrict__ weights,
                          const KernelCompensation& comp, uint32_t k, uint64_t stride, uint64_t n,
                          const ps::OptimizerScalars& sc) {
  // The kept row may be one the sum reads (the oldest kept, which this round replaces): each
  // element is read by the sum before the same thread overwrites it.
  float* const keep =
      comp.keep >= 0 ? comp.kept + static_cast<uint64_t>(comp.keep) * comp.row_stride : nullptr;
  uint64_t scalar_from = 0;
  if (UsesVec4<U>(w, s0, s1, g, k, stride, comp)) {
    const uint64_t groups = n / 4;
    for (uint64_t q = thread; q < groups; q += threads) {
      const uint64_t i = 4 * q;
      float4 wv = Load4(w + i);
      float4 ms{};
      if (comp.mean_square != nullptr) ms = Load4(comp.mean_square + i);
      const float4 sum = SumOf4(g, weights, comp, k, stride, i, wv, ms);
      if (keep != nullptr) Store4(keep + i, wv);
      if (comp.mean_square != nullptr) Store4(comp.mean_square + i, ms);
      float4 a{}, b{};
      if constexpr (kStateArrays<U> >= 1) a = Load4(s0 + i);
      if constexpr (kStateArrays<U> >= 2) b = Load4(s1 + i);
      Step<U>(wv.x, a.x, b.x, sum.x, sc);
      Step<U>(wv.y, a.y, b.y, sum.y, sc);
      Step<U>(wv.z, a.z, b.z, sum.z, sc);
      Step<U>(wv.w, a.w, b.w, sum.w, sc);
      Store4(w + i, wv);
      if constexpr (kStateArrays<U> >= 1) Store4(s0 + i, a);
      if constexpr (kStateArrays<U> >= 2) Store4(s1 + i, b);
    }
    scalar_from = 4 * groups;
  }
  for (uint64_t i = scalar_from + thread; i < n; i += threads) {
    float wi = w[i];
    float ms = comp.mean_square != nullptr ? comp.mean_square[i] : 0.0f;
    const float sum = SumOf(g, weights, comp, k, stride, i, wi, ms);
    if (keep != nullptr) keep[i] = wi;
    if (comp.mean_square != nullptr) comp.mean_square[i] = ms;
    float a = 0.0f, b = 0.0f;
    if constexpr (kStateArrays<U> >= 1) a = s0[i];
    if constexpr (kStateArrays<U> >= 2) b = s1[i];
    Step<U>(wi, a, b, sum, sc);
    w[i] = wi;
    if constexpr (kStateArrays<U> >= 1) s0[i] = a;
    if constexpr (kStateArrays<U> >= 2) s1[i] = b;
  }
}

}  // namespace dsync::cuda
