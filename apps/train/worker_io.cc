#include "worker_io.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace dsync::train {

Status PullAll(Worker& worker, std::span<const TensorId> tensors, std::span<float* const> out,
               Version* version) {
  std::vector<Handle> handles;
  handles.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) handles.push_back(worker.Pull(tensors[i], out[i]));
  *version = ~Version{0};
  for (Handle h : handles) {
    Version v = 0;
    DSYNC_RETURN_IF_ERROR(worker.Wait(h, &v));
    *version = std::min(*version, v);
  }
  return Status::Ok();
}

Status PushAll(Worker& worker, std::span<const TensorId> tensors,
               std::span<const float* const> grads) {
  std::vector<Handle> handles;
  handles.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) handles.push_back(worker.Push(tensors[i], grads[i]));
  for (Handle h : handles) DSYNC_RETURN_IF_ERROR(worker.Wait(h));
  return Status::Ok();
}

void SimulateCompute(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace dsync::train
