// GpuMlp's device code behind a plain C++ interface, so that only gpu_mlp_kernels.cu goes
// through nvcc. Every launch is asynchronous on `stream` and returns the launch error; the
// Thrust reductions return once their result is on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dsync::train::gpu {

// z[r][j] += bias[j] over a rows x cols row-major matrix, then max(z, 0) when `relu`.
cudaError_t LaunchBiasActivation(float* z, const float* bias, uint32_t rows, uint32_t cols,
                                 bool relu, cudaStream_t stream);

// Per row of the logits (rows x classes): softmax, cross-entropy -log p[label] into
// row_loss, 1 into row_correct when the first largest logit is the label's; and, when
// `dlogits` is not null, (p - onehot) * grad_scale into it. The same float/double steps as
// Mlp::SoftmaxLoss.
cudaError_t LaunchSoftmaxCrossEntropy(const float* logits, const uint8_t* labels, uint32_t rows,
                                      uint32_t classes, float grad_scale, float* dlogits,
                                      double* row_loss, uint32_t* row_correct,
                                      cudaStream_t stream);

// grad[i] = 0 where act[i] <= 0: the ReLU's derivative (act = max(z, 0)).
cudaError_t LaunchReluBackward(float* grad, const float* act, uint64_t n, cudaStream_t stream);

// Device memory Thrust borrows for its temporary storage: kept between calls and grown only
// when a call needs more, so a training step allocates nothing once warm.
class ThrustScratch {
 public:
  ThrustScratch() = default;
  ~ThrustScratch() { Release(); }
  ThrustScratch(const ThrustScratch&) = delete;
  ThrustScratch& operator=(const ThrustScratch&) = delete;

  // Reserves `bytes` (for Thrust's allocator); null when cudaMalloc fails or it is in use.
  char* Take(size_t bytes);
  void Give(char* block);

 private:
  void Release();
  char* block_ = nullptr;
  size_t bytes_ = 0;
  bool busy_ = false;
};

// Sums of row_loss and row_correct over `rows` (thrust::reduce on `stream`).
cudaError_t SumBatchMetrics(const double* row_loss, const uint32_t* row_correct, uint32_t rows,
                            ThrustScratch& scratch, cudaStream_t stream, double* loss_sum,
                            uint32_t* correct);

// Sum of v[i]^2 in double (thrust::transform_reduce on `stream`).
cudaError_t SumOfSquares(const float* v, uint64_t n, ThrustScratch& scratch, cudaStream_t stream,
                         double* out);

}  // namespace dsync::train::gpu
