// One iteration's traffic of a training loop: pull every tensor, push every gradient.
#pragma once

#include <span>

#include "dsync/worker.h"

namespace dsync::train {

// Pulls tensors[i] into out[i]; *version receives the lowest version read (the base of the
// gradient computed next).
Status PullAll(Worker& worker, std::span<const TensorId> tensors, std::span<float* const> out,
               Version* version);
// Pushes grads[i] for tensors[i] and waits until the clock they complete is committed.
Status PushAll(Worker& worker, std::span<const TensorId> tensors,
               std::span<const float* const> grads);
// Simulated extra compute time (stragglers, demos).
void SimulateCompute(double ms);

}  // namespace dsync::train
