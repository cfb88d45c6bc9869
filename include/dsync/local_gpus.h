// One worker process that drives several local GPUs (BytePS's hierarchical scheme): the
// GPUs sum their gradients with NCCL onto one root GPU, the process pushes that one gradient
// to the parameter servers, pulls the model once and broadcasts it to every GPU with NCCL.
// The servers therefore see ONE worker and ONE gradient per process and iteration.
//
// Built into the `dsync_nccl` library: the real thing where nvcc and NCCL exist
// (DSYNC_HAVE_NCCL=1), otherwise a stub whose Create() says what is missing. Link
// `dsync_nccl` only where this class is used, so that other binaries do not need libnccl.
//
// Scaling: the round's gradient on the servers is the mean over the *processes* in it
// (sgd, momentum, adam; `sum` adds them). With LocalReduce::kAverage (the default) a process
// pushes the mean of its GPUs' gradients, so P processes of G GPUs each train like P x G
// single-GPU workers with the same learning rate. LocalReduce::kSum pushes the sum instead
// (what the `sum` optimizer's exactness checks want, or a user who scales the rate by G).
// Processes with different G weigh alike in a round either way.
//
// Determinism: the order in which NCCL adds the GPUs' gradients is NCCL's choice (it depends
// on the topology and algorithm NCCL picks), so results match a host-side sum within float
// rounding, not bit for bit (invariant 4 of docs/contract.md covers the servers' sum only).
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"
#include "dsync/worker.h"

namespace dsync {

enum class LocalReduce {
  kAverage,  // push (g_0 + ... + g_{G-1}) / G   (ncclAvg)
  kSum,      // push  g_0 + ... + g_{G-1}        (ncclSum)
};

struct LocalGpuOptions {
  // CUDA device ordinals (as the process sees them, after CUDA_VISIBLE_DEVICES); empty: all
  // visible devices. devices[0] is the root GPU that stages to and from the host.
  std::vector<int> devices;
  LocalReduce reduce = LocalReduce::kAverage;
};

// Every call is synchronous on the GPUs: it returns once the group's device work is done,
// so grads may be overwritten and params read right away. The caller must have finished
// writing grads[d] before the call (e.g. cudaStreamSynchronize on the stream that computed
// it; work on the legacy default stream is ordered before ours automatically). Calls are
// serialized by a mutex (the NCCL calls of all GPUs are issued by the calling thread), and
// the current CUDA device of the calling thread is left as it was.
//
// One iteration with several tensors:   for each t: Push(t, grads_t)
//                                        for each t: Pull(t, params_t)
// (the pushes commit the iteration; each pull then returns the next model). With a single
// tensor, or for the last one pushed, PushPull(t, grads_t, params_t) does both in one call.
class LocalGpuGroup {
 public:
  // `worker` must outlive the group. Unavailable, with what to do, where the build has no
  // CUDA/NCCL, no device is visible, or fewer devices are visible than asked for; no NCCL
  // call is made before the devices are checked.
  static Result<std::unique_ptr<LocalGpuGroup>> Create(Worker& worker,
                                                       LocalGpuOptions options = {});
  // Waits for the pushes this group issued (the worker's buffers are the group's), then
  // releases the communicators, streams and buffers. Destroy it after the last iteration's
  // pushes completed (PushPull, Flush or Worker::Leave), before the worker.
  virtual ~LocalGpuGroup() = default;
  LocalGpuGroup(const LocalGpuGroup&) = delete;
  LocalGpuGroup& operator=(const LocalGpuGroup&) = delete;

  virtual size_t size() const = 0;  // GPUs in the group
  virtual const std::vector<int>& devices() const = 0;
  virtual LocalReduce reduce() const = 0;

  // Worker::Register (same rules: every process registers the same tensors in the same
  // order before its first push), plus the tensor's pinned host staging buffers, allocated
  // once here and reused by every iteration. Copying init to the GPUs is the caller's job
  // (or call Pull, which broadcasts the model).
  virtual Result<TensorId> Register(std::string_view name, std::span<const float> init) = 0;

  // grads[d]: device memory of devices()[d] holding the tensor's element count; not
  // modified. Reduces them onto the root GPU, copies the result to pinned host memory and
  // starts Worker::Push from there. Does not wait for the push to complete (that needs the
  // iteration's other tensors); a failure shows at this tensor's next Push, at Flush(), or
  // at Worker::WaitAll().
  virtual Status Push(TensorId tensor, std::span<const float* const> grads) = 0;

  // Worker::Pull into pinned host memory, copy to the root GPU, ncclBroadcast into every
  // params[d] (device memory of devices()[d]). Returns the version pulled.
  virtual Result<Version> Pull(TensorId tensor, std::span<float* const> params) = 0;

  // Push, then pull the model of the next iteration (Worker::PushPull): returns once this
  // iteration is committed, so use it for the only tensor or for the last one pushed.
  virtual Result<Version> PushPull(TensorId tensor, std::span<const float* const> grads,
                                   std::span<float* const> params) = 0;

  // Waits for every push started by Push(); the first failure, if any.
  virtual Status Flush() = 0;

 protected:
  LocalGpuGroup() = default;
};

}  // namespace dsync
