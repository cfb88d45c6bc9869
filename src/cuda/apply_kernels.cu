#include "cuda/apply_kernels.h"

namespace dsync::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 65535;

template <Update U>
__device__ __forceinline__ void Step(float& w, float* s0, float* s1, uint64_t i, float sum,
                                     const ps::OptimizerScalars& sc) {
  if constexpr (U == Update::kSum) {
    ps::SumStep(w, sum);
  } else if constexpr (U == Update::kSgd) {
    ps::SgdStep(w, sum, sc);
  } else if constexpr (U == Update::kMomentum) {
    ps::MomentumStep(w, s0[i], sum, sc);
  } else {
    ps::AdamStep(w, s0[i], s1[i], sum, sc);
  }
}

// Grid-stride loop: one pass over the parameters, each gradient read once. Sums run in
// gradient order, as the CPU store's do; nvcc may contract multiply-adds into FMAs, so
// results agree with the CPU store to rounding, not bit for bit (DESIGN.md §2, invariant 4).
template <Update U>
__global__ void ApplyRoundKernel(float* __restrict__ w, float* __restrict__ s0,
                                 float* __restrict__ s1, const float* __restrict__ g,
                                 uint32_t k, uint64_t stride, uint64_t n,
                                 ps::OptimizerScalars sc) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    float sum = g[i];
    for (uint32_t j = 1; j < k; ++j) sum += g[j * stride + i];
    float wi = w[i];
    Step<U>(wi, s0, s1, i, sum, sc);
    w[i] = wi;
  }
}

template <Update U>
cudaError_t Launch(float* w, float* s0, float* s1, const float* g, uint32_t k, uint64_t stride,
                   uint64_t n, const ps::OptimizerScalars& sc, cudaStream_t stream) {
  const uint64_t want = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < kMaxBlocks ? (want ? want : 1) : kMaxBlocks);
  ApplyRoundKernel<U><<<blocks, kThreads, 0, stream>>>(w, s0, s1, g, k, stride, n, sc);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchApplyRound(Update update, float* w, float* s0, float* s1, const float* grads,
                             uint32_t k, uint64_t stride, uint64_t n,
                             const ps::OptimizerScalars& sc, cudaStream_t stream) {
  switch (update) {
    case Update::kSum: return Launch<Update::kSum>(w, s0, s1, grads, k, stride, n, sc, stream);
    case Update::kSgd: return Launch<Update::kSgd>(w, s0, s1, grads, k, stride, n, sc, stream);
    case Update::kMomentum:
      return Launch<Update::kMomentum>(w, s0, s1, grads, k, stride, n, sc, stream);
    case Update::kAdam: return Launch<Update::kAdam>(w, s0, s1, grads, k, stride, n, sc, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsync::cuda
