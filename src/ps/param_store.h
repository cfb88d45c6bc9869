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
};

}  // namespace dsync::ps
