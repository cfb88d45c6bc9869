// The CUDA store's device code behind a plain C++ interface, so that only apply_kernels.cu
// goes through nvcc and the store itself stays ordinary C++20.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ps/optimizer_math.h"

namespace dsync::cuda {

enum class Update : int { kSum, kSgd, kMomentum, kAdam, kAdamW };

// The gradient stride that keeps every gradient of a round 16-byte aligned: n rounded up to a
// multiple of 4 floats.
constexpr uint64_t GradientStride(uint64_t n) { return (n + 3) / 4 * 4; }

// Delay compensation in the kernel (ps/param_store.h, Compensation): where the slice's kept
// versions are and which of them each gradient is corrected toward. Passed by value.
struct KernelCompensation {
  float* kept = nullptr;          // device: the kept rows, `row_stride` floats apart
  uint64_t row_stride = 0;        // GradientStride(n): every row 16-byte aligned
  const int32_t* rows = nullptr;  // device, k: gradient j's row, or -1; null: none corrected
  int32_t keep = -1;              // the row that receives w before the update, or -1
  float lambda = 0.0f;
  // DC-ASGD's adaptive form: n floats, each element's running mean square of its gradients,
  // updated with every gradient before it is corrected; null: lambda as it is.
  float* mean_square = nullptr;
};

// One round on one slice, fused: for every element, the k gradients (device memory, laid out
// back to back `stride` floats apart) are summed in order 0..k-1 — the worker-id order that
// makes rounds deterministic — each times its weight when `weights` (device memory, k floats)
// is not null, and the optimizer step of ps/optimizer_math.h is applied to
// w (and its state s0, s1). k >= 1. With `comp.rows`, gradient j is first corrected toward
// kept row rows[j] (ps::Compensate) where that is not -1; with comp.keep >= 0, w as it was
// before the update is copied into that row, after every row the sum reads was read. Asynchronous on `stream`; returns the launch error, if
// any. Any pointer alignment and stride work; 16-byte aligned arrays and a stride that is a
// multiple of 4 (GradientStride) take the float4 path (apply_thread.h), with equal results.
cudaError_t LaunchApplyRound(Update update, float* w, float* s0, float* s1, const float* grads,
                             const float* weights, const KernelCompensation& comp, uint32_t k,
                             uint64_t stride, uint64_t n, const ps::OptimizerScalars& scalars,
                             cudaStream_t stream);

}  // namespace dsync::cuda
