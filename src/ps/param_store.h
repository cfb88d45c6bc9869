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

// Delay compensation keeps at most this many versions of a slice (StalenessPolicy's cap).
constexpr size_t kMaxKeptVersions = StalenessPolicy::kMaxCompensationDepth;

// Delay compensation for one ApplyRound (the staleness policy's dc:L,D;
// ps/optimizer_math.h Compensate). The store keeps, per slice, the parameters as they were
// before each of the last `depth` rounds that changed them, and corrects a gradient computed
// on version b with the parameters before the first kept round >= b changed them: exactly
// version b when the slice kept that far back, the oldest kept otherwise. A gradient of a
// version the slice has not changed since (every fresh one) is left as it is.
struct Compensation {
  float lambda = 0.0f;   // L; 0 with depth 0: nothing kept, nothing corrected
  uint32_t depth = 0;    // versions each slice keeps; 0: none (a store drops what it kept)
  uint64_t round = 0;    // the round applied: the slice is at version `round` before it
  std::span<const uint64_t> bases;  // empty, or each gradient's base version (<= round)
  // DC-ASGD's adaptive form: L / sqrt(ms) (ps/optimizer_math.h MeanSquareStep), ms kept per
  // element beside the versions (with depth 0, dropped too).
  bool adaptive = false;
};

// What ApplyRound refuses of a compensation.
inline Status CheckCompensation(size_t gradients, const Compensation& c) {
  // Nothing kept: nothing to correct toward, whatever the factor.
  if (c.depth == 0 && c.bases.empty()) return Status::Ok();
  if (c.depth > kMaxKeptVersions || !(c.lambda >= 0.0f)) {
    return Error(StatusCode::kInvalidArgument,
                 "delay compensation keeping {} version(s) with factor {} (at most {}, a "
                 "factor >= 0)",
                 c.depth, c.lambda, kMaxKeptVersions);
  }
  if (c.bases.size() != gradients && (c.lambda != 0.0f || !c.bases.empty())) {
    return Error(StatusCode::kInvalidArgument, "a round of {} gradient(s) came with {} base(s)",
                 gradients, c.bases.size());
  }
  for (uint64_t b : c.bases) {
    if (b > c.round) {
      return Error(StatusCode::kInvalidArgument,
                   "a gradient of version {} in round {}: no gradient is newer than its round", b,
                   c.round);
    }
  }
  return Status::Ok();
}

// A slice's parameters as they were before round `round` changed them (delay compensation).
struct KeptVersion {
  uint64_t round = 0;
  std::vector<float> params;
  bool operator==(const KeptVersion&) const = default;
};

// A slice's whole state, for checkpoints: its parameters, the optimizer state arrays it has
// (momentum: buf; adam and adamw: m, v; none before the first round that needs them), each
// as many floats as the parameters, the number of updates applied (adam's t), the versions it
// keeps for delay compensation, oldest first, and the adaptive form's running mean square of
// its gradients (empty where none is kept).
struct SliceSnapshot {
  std::vector<float> params;
  std::vector<std::vector<float>> state;
  uint64_t steps = 0;
  std::vector<KeptVersion> kept;
  std::vector<float> mean_square;
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
  if (!in.mean_square.empty() && in.mean_square.size() != in.params.size()) {
    return Error(StatusCode::kInvalidArgument,
                 "snapshot of tensor {} slice {}: its mean square holds {} floats, the "
                 "parameters {}",
                 tensor, index, in.mean_square.size(), in.params.size());
  }
  if (in.kept.size() > kMaxKeptVersions) {
    return Error(StatusCode::kInvalidArgument,
                 "snapshot of tensor {} slice {} keeps {} versions; at most {} are kept", tensor,
                 index, in.kept.size(), kMaxKeptVersions);
  }
  for (size_t i = 0; i < in.kept.size(); ++i) {
    if (in.kept[i].params.size() != in.params.size() ||
        (i > 0 && in.kept[i].round <= in.kept[i - 1].round)) {
      return Error(StatusCode::kInvalidArgument,
                   "snapshot of tensor {} slice {}: kept version {} (round {}) holds {} floats, "
                   "the parameters {}; kept versions go oldest first, one per round",
                   tensor, index, i, in.kept[i].round, in.kept[i].params.size(),
                   in.params.size());
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
  // With a compensation (see Compensation), each stale gradient is corrected before it is
  // weighed, and the parameters before the round are kept.
  virtual Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                            std::span<const float> weights, const Compensation& compensation,
                            const OptimizerConfig& optimizer) = 0;
  // No compensation (a slice that kept versions drops them).
  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    std::span<const float> weights, const OptimizerConfig& optimizer) {
    return ApplyRound(key, grads, weights, Compensation{}, optimizer);
  }
  // Every gradient weighing 1.
  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    const OptimizerConfig& optimizer) {
    return ApplyRound(key, grads, {}, Compensation{}, optimizer);
  }

  // Copies the slice's parameters into `out` (SliceElements(key) floats of host memory, or of
  // AllocateDevice memory).
  virtual Status Read(SliceKey key, std::span<float> out) const = 0;

  // Checkpoints (host memory, not a hot path). Snapshot copies the slice's parameters,
  // optimizer state and update count into `out` (its vectors are resized). Restore creates a
  // slice from a snapshot, as InitSlice does, with that state and count: the next ApplyRound
  // continues exactly where the snapshot's slice left off. A snapshot with more state arrays
  // than any optimizer has, or arrays of another length than the parameters, is refused. The
  // kept versions travel too, so that delay compensation goes on as it would have.
  virtual Status Snapshot(SliceKey key, SliceSnapshot& out) const = 0;
  virtual Status Restore(SliceKey key, const SliceSnapshot& in) = 0;
};

}  // namespace dsync::ps
