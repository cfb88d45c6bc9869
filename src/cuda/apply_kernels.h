// The CUDA store's device code behind a plain C++ interface, so that only apply_kernels.cu
// goes through nvcc and the store itself stays ordinary C++20.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ps/optimizer_math.h"

namespace dsync::cuda {

enum class Update : int { kSum, kSgd, kMomentum, kAdam };

// One round on one slice, fused: for every element, the k gradients (device memory, laid out
// back to back `stride` floats apart) are summed in order 0..k-1 — the worker-id order that
// makes rounds deterministic — and the optimizer step of ps/optimizer_math.h is applied to
// w (and its state s0, s1). Asynchronous on `stream`; returns the launch error, if any.
cudaError_t LaunchApplyRound(Update update, float* w, float* s0, float* s1, const float* grads,
                             uint32_t k, uint64_t stride, uint64_t n,
                             const ps::OptimizerScalars& scalars, cudaStream_t stream);

}  // namespace dsync::cuda
