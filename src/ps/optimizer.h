// Host-side optimizer dispatch: how much state each optimizer keeps and the per-round scalars.
#pragma once

#include <cstdint>

#include "dsync/config.h"
#include "ps/optimizer_math.h"

namespace dsync::ps {

// Per-element state arrays the optimizer keeps beside the parameters.
inline uint32_t OptimizerStateSlots(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMomentum: return 1;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: return 2;
    case OptimizerKind::kSgd:
    case OptimizerKind::kSum: return 0;
  }
  return 0;
}

// Whether two optimizers do the same thing but for the learning rate, which may change
// during a job: what every registration of one tensor must agree on.
inline bool SameBesidesLearningRate(OptimizerConfig a, const OptimizerConfig& b) {
  a.lr = b.lr;
  return a == b;
}

// `step` counts the updates this slice has received including this one (adam's t >= 1;
// momentum's first step is 1); `count` the gradients in the round.
OptimizerScalars MakeOptimizerScalars(const OptimizerConfig& config, uint64_t step,
                                      uint32_t count);

}  // namespace dsync::ps
