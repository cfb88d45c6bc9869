// The ParamStore seam: where slices live and how rounds are applied. The CPU
// store (src/cpu) and the CUDA store (src/cuda) implement it; src/ps decides
// *what* to apply, the store only *how*.
//
// A store is not internally synchronized per slice: the server never applies and reads the
// same slice concurrently. Different slices may be used from different threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/device_memory.h"

namespace dsync::ps {

using SliceKey = uint64_t;  // (tensor << 32) | slice index
inline SliceKey MakeSliceKey(uint32_t tensor, uint32_t slice) {
  return (static_cast<uint64_t>(tensor) << 32) | slice;
}

// `weights` of ApplyRound must be empty or hold one weight per gradient.
inline Status CheckRoundWeights(size_t gradients, size_t weights) {
  if (weights == 0 || weights == gradients) return Status::Ok();
  return Error(StatusCode::kInvalidArgument, "a round of {} gradient(s) came with {} weight(s)",
               gradients, weights);
}

// A slice's whole state, for checkpoints: its parameters, the optimizer state arrays it has
// (momentum: buf; adam and adamw: m, v; none before the first round that needs them), each
// as many floats as the parameters, and the number of updates applied (adam's t).
struct SliceSnapshot {
  std::vector<float> params;
  std::vector<std::vector<float>> state;
  uint64_t steps = 0;
};

// Optimizers keep at most this many state arrays per slice (adam's m and v).
constexpr size_t kMaxStateArrays = 2;

// What Restore refuses: no parameters, more state arrays than any optimizer has, or an array
// of another length than the parameters.
inline Status CheckSnapshot(SliceKey key, const SliceSnapshot& in) {
  const uint64_t tensor = key >> 32, index = key & 0xffffffff;
  if (in.params.empty()) {
    return Error(StatusCode::kInvalidArgument, "snapshot of tensor {} slice {} has no parameters",
                 tensor, index);
  }
  if (in.state.size() > kMaxStateArrays) {
    return Error(StatusCode::kInvalidArgument,
                 "snapshot of tensor {} slice {} has {} optimizer state arrays; no optimizer has "
                 "more than {}",
                 tensor, index, in.state.size(), kMaxStateArrays);
  }
  for (size_t i = 0; i < in.state.size(); ++i) {
    if (in.state[i].size() != in.params.size()) {
      return Error(StatusCode::kInvalidArgument,
                   "snapshot of tensor {} slice {}: optimizer state array {} holds {} floats, the "
                   "parameters {}",
                   tensor, index, i, in.state[i].size(), in.params.size());
    }
  }
  return Status::Ok();
}

class ParamStore {
 public:
  virtual ~ParamStore() = default;
  virtual std::string_view name() const = 0;

  // Host memory that gradients are received into and pulls are sent from. The CUDA store
  // returns pinned memory so that copies to the device run asynchronously. Callers pool it.
  virtual void* AllocateHost(size_t bytes) = 0;
  virtual void FreeHost(void* ptr, size_t bytes) = 0;

  // GPUDirect RDMA: device memory that payloads can be received into and pulls sent from
  // directly by the NIC (see ps/device_memory.h). ApplyRound, InitSlice and Read accept it
  // wherever they accept host memory from AllocateHost. A store without device memory (the
  // CPU store) returns nullptr and no DeviceMemory.
  virtual void* AllocateDevice(size_t /*bytes*/) { return nullptr; }
  virtual void FreeDevice(void* /*ptr*/, size_t /*bytes*/) {}
  virtual const DeviceMemory* device_memory() const { return nullptr; }

  // Creates a float32 slice holding `init`; optimizer state starts at zero.
  virtual Status InitSlice(SliceKey key, std::span<const float> init) = 0;
  virtual bool HasSlice(SliceKey key) const = 0;
  virtual uint64_t SliceElements(SliceKey key) const = 0;  // 0 when absent

  // Applies one round to a slice: the gradients are summed in the order given (the
  // worker-id order that makes rounds deterministic), each times its weight when `weights`
  // is not empty (one per gradient: the staleness policy's; ps/optimizer_math.h WeighFirst,
  // AddWeighed), then the optimizer updates the parameters with that sum (`sum`) or with the
  // sum divided by grads.size() (the others). No gradients: nothing changes.
  virtual Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                            std::span<const float> weights,
                            const OptimizerConfig& optimizer) = 0;
  // Every gradient weighing 1.
  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    const OptimizerConfig& optimizer) {
    return ApplyRound(key, grads, {}, optimizer);
  }

  // Copies the slice's parameters into `out` (SliceElements(key) floats of host memory, or of
  // AllocateDevice memory).
  virtual Status Read(SliceKey key, std::span<float> out) const = 0;

  // Checkpoints (host memory, not a hot path). Snapshot copies the slice's parameters,
  // optimizer state and update count into `out` (its vectors are resized). Restore creates a
  // slice from a snapshot, as InitSlice does, with that state and count: the next ApplyRound
  // continues exactly where the snapshot's slice left off. A snapshot with more state arrays
  // than any optimizer has, or arrays of another length than the parameters, is refused.
  virtual Status Snapshot(SliceKey key, SliceSnapshot& out) const = 0;
  virtual Status Restore(SliceKey key, const SliceSnapshot& in) = 0;
};

}  // namespace dsync::ps
