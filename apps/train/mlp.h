// A multilayer perceptron (ReLU hidden layers, softmax cross-entropy) whose worker-side math
// runs on OpenBLAS: forward and backward passes are matrix products over the minibatch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsync/status.h"
#include "fashion_mnist.h"

namespace dsync::train {

struct ParamSpec {
  std::string name;
  uint64_t size = 0;
};

struct Evaluation {
  double accuracy = 0;  // fraction of correct predictions
  double loss = 0;      // mean cross-entropy
  uint32_t samples = 0;
};

// The worker-side math a training loop runs: Mlp (OpenBLAS) or GpuMlp (cuBLAS, gpu_mlp.h).
class MlpMath {
 public:
  virtual ~MlpMath() = default;
  // See Mlp::Gradient and Mlp::Evaluate.
  virtual float Gradient(std::span<const float* const> params, const float* x,
                         const uint8_t* labels, uint32_t batch, std::span<float* const> grads) = 0;
  virtual Evaluation Evaluate(std::span<const float* const> params, const Dataset& data,
                              uint32_t limit = 0) = 0;
  // L2 norm of the gradient the last Gradient call wrote, every tensor together.
  virtual double last_gradient_norm() const = 0;
  // The first error (a device's, a batch above the buffers): results since then are NaN and
  // must not be pushed. The CPU math never fails.
  virtual Status status() const { return Status::Ok(); }
};

class Mlp final : public MlpMath {
 public:
  // sizes: input, hidden..., classes (e.g. 784, 256, 128, 10). Workspace for `max_batch`.
  Mlp(std::vector<uint32_t> sizes, uint32_t max_batch);

  // In registration order: layer1.weight (out x in, row-major), layer1.bias, layer2.weight...
  const std::vector<ParamSpec>& params() const { return specs_; }
  uint32_t inputs() const { return sizes_.front(); }
  uint32_t classes() const { return sizes_.back(); }

  // He-initialized weights, zero biases; the same seed gives the same model on every worker.
  std::vector<std::vector<float>> Initialize(uint32_t seed) const;

  // Mean cross-entropy of the batch (x: batch x inputs, row-major) and its gradient with
  // respect to every parameter (grads[i] has params()[i].size floats).
  float Gradient(std::span<const float* const> params, const float* x, const uint8_t* labels,
                 uint32_t batch, std::span<float* const> grads) override;

  // Accuracy and loss over the first `limit` samples of `data` (0: all), in batches.
  Evaluation Evaluate(std::span<const float* const> params, const Dataset& data,
                      uint32_t limit = 0) override;
  double last_gradient_norm() const override { return gradient_norm_; }

  // Pixels of images[first..first+count) (wrapping around) scaled to [0, 1] into x.
  static void Gather(const Dataset& data, const uint32_t* indices, uint32_t count, float* x,
                     uint8_t* labels);

 private:
  // Forward pass over `batch` rows of x; leaves pre-activations in z_ and activations in a_.
  void Forward(std::span<const float* const> params, const float* x, uint32_t batch);
  // Softmax over the logits in place; returns the summed cross-entropy and counts hits.
  double SoftmaxLoss(const uint8_t* labels, uint32_t batch, uint32_t* correct);

  std::vector<uint32_t> sizes_;
  uint32_t max_batch_;
  std::vector<ParamSpec> specs_;
  std::vector<std::vector<float>> a_;   // activations per layer (a_[0] unused: the input)
  std::vector<std::vector<float>> dz_;  // gradient w.r.t. pre-activations per layer
  std::vector<float> eval_x_;
  std::vector<uint8_t> eval_labels_;
  double gradient_norm_ = 0;
};

}  // namespace dsync::train
