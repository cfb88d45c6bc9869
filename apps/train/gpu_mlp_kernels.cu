#include "gpu_mlp_kernels.h"

#include <thrust/execution_policy.h>
#include <thrust/reduce.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>
#include <thrust/transform_reduce.h>

#include <cstddef>
#include <new>

namespace dsync::train::gpu {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 65535;

unsigned Blocks(uint64_t n) {
  const uint64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want == 0 ? 1 : (want < kMaxBlocks ? want : kMaxBlocks));
}

__global__ void BiasActivationKernel(float* __restrict__ z, const float* __restrict__ bias,
                                     uint64_t n, uint32_t cols, bool relu) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    const float v = z[i] + bias[i % cols];
    z[i] = relu ? fmaxf(v, 0.0f) : v;
  }
}

// One thread per row: the MLP has 10 classes, too few to share a row between threads. A
// grid-stride loop over the rows, as the grid is capped at kMaxBlocks.
__global__ void SoftmaxCrossEntropyKernel(const float* __restrict__ logits,
                                          const uint8_t* __restrict__ labels, uint32_t rows,
                                          uint32_t classes, float grad_scale,
                                          float* __restrict__ dlogits,
                                          double* __restrict__ row_loss,
                                          uint32_t* __restrict__ row_correct) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t r = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += step) {
    const float* z = logits + r * classes;
    uint32_t best = 0;  // the first largest, as std::max_element
    for (uint32_t j = 1; j < classes; ++j) {
      if (z[j] > z[best]) best = j;
    }
    const uint32_t label = labels[r];
    row_correct[r] = best == label ? 1u : 0u;
    const float mx = z[best];
    double sum = 0;
    for (uint32_t j = 0; j < classes; ++j) sum += expf(z[j] - mx);
    const auto inv = static_cast<float>(1.0 / sum);
    const float p_label = expf(z[label] - mx) * inv;
    row_loss[r] = -log(fmax(static_cast<double>(p_label), 1e-30));
    if (dlogits) {
      float* d = dlogits + r * classes;
      for (uint32_t j = 0; j < classes; ++j) {
        const float onehot = j == label ? 1.0f : 0.0f;
        d[j] = (expf(z[j] - mx) * inv - onehot) * grad_scale;
      }
    }
  }
}

__global__ void ReluBackwardKernel(float* __restrict__ grad, const float* __restrict__ act,
                                   uint64_t n) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += step) {
    if (act[i] <= 0.0f) grad[i] = 0.0f;
  }
}

// Thrust's temporary storage comes from the scratch (thrust/examples/cuda/
// custom_temporary_allocation.cu shows the allocator interface).
struct ScratchAllocator {
  using value_type = char;
  ThrustScratch* scratch;
  char* allocate(std::ptrdiff_t bytes) {
    char* p = scratch->Take(static_cast<size_t>(bytes));
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(char* p, size_t /*bytes*/) { scratch->Give(p); }
};

struct Square {
  __host__ __device__ double operator()(float v) const {
    return static_cast<double>(v) * static_cast<double>(v);
  }
};

// Thrust reports failures by exceptions; callers here get the CUDA error code.
template <typename F>
cudaError_t Catching(F&& f) {
  try {
    (void)cudaGetLastError();  // so the check below sees this call's error only
    f();
    return cudaGetLastError();
  } catch (const thrust::system_error& e) {
    const auto code = static_cast<cudaError_t>(e.code().value());
    return code == cudaSuccess ? cudaErrorUnknown : code;
  } catch (const std::bad_alloc&) {
    return cudaErrorMemoryAllocation;
  } catch (...) {
    return cudaErrorUnknown;
  }
}

}  // namespace

cudaError_t LaunchBiasActivation(float* z, const float* bias, uint32_t rows, uint32_t cols,
                                 bool relu, cudaStream_t stream) {
  const uint64_t n = static_cast<uint64_t>(rows) * cols;
  // Clears an earlier call's (non-sticky) error, so the check below reports this launch's only.
  (void)cudaGetLastError();
  BiasActivationKernel<<<Blocks(n), kThreads, 0, stream>>>(z, bias, n, cols, relu);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropy(const float* logits, const uint8_t* labels, uint32_t rows,
                                      uint32_t classes, float grad_scale, float* dlogits,
                                      double* row_loss, uint32_t* row_correct,
                                      cudaStream_t stream) {
  (void)cudaGetLastError();  // as in LaunchBiasActivation
  SoftmaxCrossEntropyKernel<<<Blocks(rows), kThreads, 0, stream>>>(
      logits, labels, rows, classes, grad_scale, dlogits, row_loss, row_correct);
  return cudaGetLastError();
}

cudaError_t LaunchReluBackward(float* grad, const float* act, uint64_t n, cudaStream_t stream) {
  (void)cudaGetLastError();  // as in LaunchBiasActivation
  ReluBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(grad, act, n);
  return cudaGetLastError();
}

char* ThrustScratch::Take(size_t bytes) {
  bytes = bytes ? bytes : 1;  // a block even for an empty request: null means failure
  void* p = nullptr;
  if (busy_) {  // not expected (one reduction at a time), but served rather than refused
    return cudaMalloc(&p, bytes) == cudaSuccess ? static_cast<char*>(p) : nullptr;
  }
  if (bytes > bytes_) {
    Release();
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    block_ = static_cast<char*>(p);
    bytes_ = bytes;
  }
  busy_ = true;
  return block_;
}

void ThrustScratch::Give(char* block) {
  if (block == block_) {
    busy_ = false;
  } else {
    (void)cudaFree(block);
  }
}

void ThrustScratch::Release() {
  if (block_) (void)cudaFree(block_);
  block_ = nullptr;
  bytes_ = 0;
}

cudaError_t SumBatchMetrics(const double* row_loss, const uint32_t* row_correct, uint32_t rows,
                            ThrustScratch& scratch, cudaStream_t stream, double* loss_sum,
                            uint32_t* correct) {
  ScratchAllocator alloc{&scratch};
  return Catching([&] {
    const auto policy = thrust::cuda::par(alloc).on(stream);
    *loss_sum = thrust::reduce(policy, row_loss, row_loss + rows, 0.0);
    *correct = thrust::reduce(policy, row_correct, row_correct + rows, 0u);
  });
}

cudaError_t SumOfSquares(const float* v, uint64_t n, ThrustScratch& scratch, cudaStream_t stream,
                         double* out) {
  ScratchAllocator alloc{&scratch};
  return Catching([&] {
    *out = thrust::transform_reduce(thrust::cuda::par(alloc).on(stream), v, v + n, Square{}, 0.0,
                                    thrust::plus<double>());
  });
}

}  // namespace dsync::train::gpu
