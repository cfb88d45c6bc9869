#include "mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <fmt/format.h>

namespace dsync::train {

Mlp::Mlp(std::vector<uint32_t> sizes, uint32_t max_batch)
    : sizes_(std::move(sizes)), max_batch_(max_batch) {
  const size_t layers = sizes_.size() - 1;
  a_.resize(layers + 1);
  dz_.resize(layers + 1);
  for (size_t l = 1; l <= layers; ++l) {
    specs_.push_back({fmt::format("layer{}.weight", l), uint64_t{sizes_[l]} * sizes_[l - 1]});
    specs_.push_back({fmt::format("layer{}.bias", l), sizes_[l]});
    a_[l].resize(size_t{max_batch_} * sizes_[l]);
    dz_[l].resize(size_t{max_batch_} * sizes_[l]);
  }
  dz_[0].resize(size_t{max_batch_} * sizes_[0]);
  eval_x_.resize(size_t{max_batch_} * sizes_[0]);
  eval_labels_.resize(max_batch_);
}

std::vector<std::vector<float>> Mlp::Initialize(uint32_t seed) const {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> values;
  for (size_t l = 1; l < sizes_.size(); ++l) {
    // He initialization for ReLU layers: N(0, 2 / fan_in).
    std::normal_distribution<float> n(0.0f, std::sqrt(2.0f / static_cast<float>(sizes_[l - 1])));
    std::vector<float> w(size_t{sizes_[l]} * sizes_[l - 1]);
    for (float& v : w) v = n(rng);
    values.push_back(std::move(w));
    values.emplace_back(sizes_[l], 0.0f);
  }
  return values;
}

void Mlp::Gather(const Dataset& data, const uint32_t* indices, uint32_t count, float* x,
                 uint8_t* labels) {
  const uint32_t f = data.features();
  for (uint32_t r = 0; r < count; ++r) {
    const uint8_t* img = data.image(indices[r]);
    for (uint32_t j = 0; j < f; ++j) x[size_t{r} * f + j] = static_cast<float>(img[j]) * (1.0f / 255.0f);
    labels[r] = data.labels[indices[r]];
  }
}

void Mlp::Forward(std::span<const float* const> params, const float* x, uint32_t batch) {
  const size_t layers = sizes_.size() - 1;
  const float* in = x;
  for (size_t l = 1; l <= layers; ++l) {
    const int n_in = static_cast<int>(sizes_[l - 1]);
    const int n_out = static_cast<int>(sizes_[l]);
    const float* w = params[2 * (l - 1)];
    const float* b = params[2 * (l - 1) + 1];
    float* out = a_[l].data();
    // out = in * W^T (batch x out)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(batch), n_out, n_in,
                1.0f, in, n_in, w, n_in, 0.0f, out, n_out);
    const bool hidden = l < layers;
    for (uint32_t r = 0; r < batch; ++r) {
      float* row = out + size_t{r} * static_cast<size_t>(n_out);
      for (int j = 0; j < n_out; ++j) {
        const float z = row[j] + b[j];
        row[j] = hidden ? std::max(z, 0.0f) : z;  // ReLU keeps z > 0 exactly: its mask
      }
    }
    in = out;
  }
}

double Mlp::SoftmaxLoss(const uint8_t* labels, uint32_t batch, uint32_t* correct) {
  const uint32_t c = classes();
  float* logits = a_.back().data();
  double loss = 0;
  for (uint32_t r = 0; r < batch; ++r) {
    float* row = logits + size_t{r} * c;
    const auto best = static_cast<uint32_t>(std::max_element(row, row + c) - row);
    if (best == labels[r]) ++*correct;
    const float mx = row[best];
    double sum = 0;
    for (uint32_t j = 0; j < c; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    const auto inv = static_cast<float>(1.0 / sum);
    for (uint32_t j = 0; j < c; ++j) row[j] *= inv;  // probabilities
    loss -= std::log(std::max(static_cast<double>(row[labels[r]]), 1e-30));
  }
  return loss;
}

float Mlp::Gradient(std::span<const float* const> params, const float* x, const uint8_t* labels,
                    uint32_t batch, std::span<float* const> grads) {
  Forward(params, x, batch);
  uint32_t correct = 0;
  const double loss = SoftmaxLoss(labels, batch, &correct);
  const size_t layers = sizes_.size() - 1;
  // d loss / d logits = (softmax - onehot) / batch
  const uint32_t c = classes();
  const float inv_batch = 1.0f / static_cast<float>(batch);
  float* dz = dz_[layers].data();
  const float* prob = a_[layers].data();
  for (uint32_t r = 0; r < batch; ++r) {
    for (uint32_t j = 0; j < c; ++j) {
      const float onehot = j == labels[r] ? 1.0f : 0.0f;
      dz[size_t{r} * c + j] = (prob[size_t{r} * c + j] - onehot) * inv_batch;
    }
  }
  for (size_t l = layers; l >= 1; --l) {
    const int n_in = static_cast<int>(sizes_[l - 1]);
    const int n_out = static_cast<int>(sizes_[l]);
    const float* in = l == 1 ? x : a_[l - 1].data();
    const float* dzl = dz_[l].data();
    // dW = dZ^T * in (out x in); db = column sums of dZ.
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_out, n_in, static_cast<int>(batch),
                1.0f, dzl, n_out, in, n_in, 0.0f, grads[2 * (l - 1)], n_in);
    float* db = grads[2 * (l - 1) + 1];
    std::fill(db, db + n_out, 0.0f);
    for (uint32_t r = 0; r < batch; ++r) {
      for (int j = 0; j < n_out; ++j) db[j] += dzl[size_t{r} * static_cast<size_t>(n_out) + static_cast<size_t>(j)];
    }
    if (l == 1) break;
    // dA(l-1) = dZ * W (batch x in), then through the ReLU of layer l-1.
    float* dprev = dz_[l - 1].data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(batch), n_in, n_out,
                1.0f, dzl, n_out, params[2 * (l - 1)], n_in, 0.0f, dprev, n_in);
    const float* act = a_[l - 1].data();
    const size_t n = size_t{batch} * static_cast<size_t>(n_in);
    for (size_t i = 0; i < n; ++i) {
      if (act[i] <= 0.0f) dprev[i] = 0.0f;
    }
  }
  // Squares summed in double (dsdot), as GpuMlp sums them: the two norms agree to rounding.
  double squares = 0;
  for (size_t t = 0; t < specs_.size(); ++t) {
    const auto n = static_cast<int>(specs_[t].size);
    squares += cblas_dsdot(n, grads[t], 1, grads[t], 1);
  }
  gradient_norm_ = std::sqrt(squares);
  return static_cast<float>(loss / batch);
}

Evaluation Mlp::Evaluate(std::span<const float* const> params, const Dataset& data,
                         uint32_t limit) {
  const uint32_t n = limit == 0 ? data.count : std::min(limit, data.count);
  std::vector<uint32_t> idx(max_batch_);
  uint32_t correct = 0;
  double loss = 0;
  for (uint32_t first = 0; first < n; first += max_batch_) {
    const uint32_t batch = std::min(max_batch_, n - first);
    std::iota(idx.begin(), idx.begin() + batch, first);
    Gather(data, idx.data(), batch, eval_x_.data(), eval_labels_.data());
    Forward(params, eval_x_.data(), batch);
    loss += SoftmaxLoss(eval_labels_.data(), batch, &correct);
  }
  Evaluation e;
  e.samples = n;
  e.accuracy = n ? static_cast<double>(correct) / n : 0;
  e.loss = n ? loss / n : 0;
  return e;
}

}  // namespace dsync::train
