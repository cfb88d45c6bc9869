#include "cuda/apply_kernels.h"

#include "cuda/apply_thread.h"

namespace dsync::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 65535;

// Grid-stride: one pass over the parameters, each gradient read once; the per-thread work,
// float4 path included, is ApplyThread (apply_thread.h), which the host tests emulate. Sums
// run in gradient order, as the CPU store's do; nvcc may contract multiply-adds into FMAs, so
// results agree with the CPU store to rounding, not bit for bit (docs/contract.md, invariant 4).
template <Update U>
__global__ void __launch_bounds__(kThreads)
    ApplyRoundKernel(float* __restrict__ w, float* __restrict__ s0, float* __restrict__ s1,
                     const float* __restrict__ g, const float* __restrict__ weights,
                     KernelCompensation comp, uint32_t k, uint64_t stride, uint64_t n,
                     ps::OptimizerScalars sc) {
  ApplyThread<U>(static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                 static_cast<uint64_t>(gridDim.x) * blockDim.x, w, s0, s1, g, weights, comp, k,
                 stride, n, sc);
}

template <Update U>
cudaError_t Launch(float* w, float* s0, float* s1, const float* g, const float* weights,
                   const KernelCompensation& comp, uint32_t k, uint64_t stride, uint64_t n,
                   const ps::OptimizerScalars& sc, cudaStream_t stream) {
  // One thread per float4 group (plus the tail), or per element on the scalar path.
  const uint64_t items = UsesVec4<U>(w, s0, s1, g, k, stride, comp) ? n / 4 + n % 4 : n;
  const uint64_t want = (items + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < kMaxBlocks ? (want ? want : 1) : kMaxBlocks);
  // cudaGetLastError() also returns an error left by any earlier failed call on this
  // thread: clear it first, so that what we return is this launch's own.
  (void)cudaGetLastError();
  ApplyRoundKernel<U><<<blocks, kThreads, 0, stream>>>(w, s0, s1, g, weights, comp, k, stride, n,
                                                          sc);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchApplyRound(Update update, float* w, float* s0, float* s1, const float* grads,
                             const float* weights, const KernelCompensation& comp, uint32_t k,
                             uint64_t stride, uint64_t n, const ps::OptimizerScalars& sc,
                             cudaStream_t stream) {
  switch (update) {
    case Update::kSum:
      return Launch<Update::kSum>(w, s0, s1, grads, weights, comp, k, stride, n, sc, stream);
    case Update::kSgd:
      return Launch<Update::kSgd>(w, s0, s1, grads, weights, comp, k, stride, n, sc, stream);
    case Update::kMomentum:
      return Launch<Update::kMomentum>(w, s0, s1, grads, weights, comp, k, stride, n, sc, stream);
    case Update::kAdam:
      return Launch<Update::kAdam>(w, s0, s1, grads, weights, comp, k, stride, n, sc, stream);
    case Update::kAdamW:
      return Launch<Update::kAdamW>(w, s0, s1, grads, weights, comp, k, stride, n, sc, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsync::cuda
