#include "ps/optimizer.h"

#include <cmath>

namespace dsync::ps {

OptimizerScalars MakeOptimizerScalars(const OptimizerConfig& config, uint64_t step,
                                      uint32_t count) {
  // Every derived scalar in double, then rounded once, as torch computes them in Python
  // floats; both stores then see the same floats.
  const double lr = config.lr;
  const double wd = config.weight_decay;
  const double b1 = config.beta1;
  const double b2 = config.beta2;
  OptimizerScalars s;
  s.lr = config.lr;
  s.momentum = config.momentum;
  s.dampening_keep = static_cast<float>(1.0 - static_cast<double>(config.dampening));
  s.first_step = step <= 1;
  s.nesterov = config.nesterov;
  s.beta1 = config.beta1;
  s.beta2 = config.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - b1);
  s.one_minus_beta2 = static_cast<float>(1.0 - b2);
  s.eps = config.eps;
  s.weight_decay = config.weight_decay;
  s.count = static_cast<float>(count == 0 ? 1 : count);
  const double t = static_cast<double>(step == 0 ? 1 : step);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, t)));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, t)));
  s.decoupled_decay = static_cast<float>(1.0 - lr * wd);
  return s;
}

}  // namespace dsync::ps
