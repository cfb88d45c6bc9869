#include "ps/optimizer.h"

#include <cmath>

namespace dsync::ps {

OptimizerScalars MakeOptimizerScalars(const OptimizerConfig& config, uint64_t step,
                                      uint32_t count) {
  OptimizerScalars s;
  s.lr = config.lr;
  s.momentum = config.momentum;
  s.beta1 = config.beta1;
  s.beta2 = config.beta2;
  s.eps = config.eps;
  s.weight_decay = config.weight_decay;
  s.count = static_cast<float>(count == 0 ? 1 : count);
  // Bias corrections in double, then rounded once, so both stores see the same floats.
  const double t = static_cast<double>(step == 0 ? 1 : step);
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(config.beta1), t));
  s.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(config.beta2), t));
  return s;
}

}  // namespace dsync::ps
