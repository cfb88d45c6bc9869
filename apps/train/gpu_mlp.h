// The Mlp's worker math on a CUDA device: the same forward and backward passes, as cuBLAS
// GEMMs (plus a GEMV with a ones vector for the bias gradients) and small kernels for bias,
// ReLU and softmax cross-entropy; Thrust reduces the batch's loss, its correct predictions
// and the gradient's norm. Parameters are uploaded from host memory on every call (they come
// from the PS) and gradients downloaded into the host buffers the worker pushes; device
// buffers are allocated once, for `max_batch` samples. Built only with nvcc
// (DSYNC_TRAIN_HAVE_CUDA); mlp_math.h's MakeCudaMlp is the way in. cuBLAS is loaded (dlopen)
// when the first GpuMlp is created, not linked: see gpu_mlp.cc.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "gpu_mlp_kernels.h"
#include "mlp.h"

namespace dsync::train {

struct CublasApi;  // the cuBLAS entry points GpuMlp calls, loaded on first use

class GpuMlp final : public MlpMath {
 public:
  // Allocates every device buffer; an error when no device is usable.
  static Result<std::unique_ptr<GpuMlp>> Create(std::vector<uint32_t> sizes, uint32_t max_batch);
  // Opens cuBLAS (once per process) without touching a device.
  static Status LoadLibraries();
  ~GpuMlp() override;
  GpuMlp(const GpuMlp&) = delete;
  GpuMlp& operator=(const GpuMlp&) = delete;

  // As Mlp's; params and grads are host memory, batch <= max_batch. On an error status()
  // says what happened and the loss, the gradients and the norm are NaN.
  float Gradient(std::span<const float* const> params, const float* x, const uint8_t* labels,
                 uint32_t batch, std::span<float* const> grads) override;
  Evaluation Evaluate(std::span<const float* const> params, const Dataset& data,
                      uint32_t limit = 0) override;
  double last_gradient_norm() const override { return gradient_norm_; }
  Status status() const override { return status_; }

 private:
  struct DeviceFree {
    void operator()(void* p) const { (void)cudaFree(p); }
  };
  template <typename T>
  using DeviceArray = std::unique_ptr<T[], DeviceFree>;
  template <typename T>
  static Status Allocate(DeviceArray<T>& out, uint64_t n);

  GpuMlp(std::vector<uint32_t> sizes, uint32_t max_batch);
  Status Init();
  Status UploadParams(std::span<const float* const> params);
  Status UploadBatch(const float* x, const uint8_t* labels, uint32_t batch);
  // Activations of every layer for the uploaded batch; the last layer's are the logits.
  Status Forward(uint32_t batch);
  Status RunGradient(std::span<const float* const> params, const float* x, const uint8_t* labels,
                     uint32_t batch, std::span<float* const> grads, float* loss);
  Status RunEvaluate(std::span<const float* const> params, const Dataset& data, uint32_t n,
                     Evaluation* e);
  const float* weight(size_t layer) const { return params_.get() + offsets_[2 * (layer - 1)]; }
  const float* bias(size_t layer) const { return params_.get() + offsets_[2 * (layer - 1) + 1]; }

  std::vector<uint32_t> sizes_;
  uint32_t max_batch_;
  std::vector<uint64_t> offsets_;  // of each tensor in params_ / grads_ (registration order)
  uint64_t total_ = 0;
  const CublasApi* cublas_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DeviceArray<float> params_, grads_;
  DeviceArray<float> x_;
  DeviceArray<uint8_t> labels_;
  std::vector<DeviceArray<float>> act_;  // per layer, max_batch x size (act_[0] unused: x_)
  std::vector<DeviceArray<float>> dz_;   // gradient w.r.t. the pre-activations, per layer
  DeviceArray<float> ones_;              // max_batch ones: bias gradients as a GEMV
  DeviceArray<double> row_loss_;
  DeviceArray<uint32_t> row_correct_;
  gpu::ThrustScratch scratch_;
  std::vector<float> eval_x_;
  std::vector<uint8_t> eval_labels_;
  double gradient_norm_ = 0;
  Status status_;
};

}  // namespace dsync::train
