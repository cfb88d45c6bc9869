// Cutting tensors into slices and spreading them over the servers (docs/contract.md, "Roles").
//
// Slices are placed round-robin over a counter that runs across tensors in registration
// order, so a few big tensors balance (their slices alternate) and so do many small ones
// (each starts where the previous one left off). Every worker registers the same tensors in
// the same order, so every worker computes the same placement.
#pragma once

#include <cstdint>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::ps {

struct SliceRef {
  uint32_t index = 0;     // slice number within the tensor
  uint64_t offset = 0;    // first element
  uint64_t elements = 0;
  uint32_t server = 0;    // server rank, 0..S-1
};

struct TensorLayout {
  TensorId tensor = 0;
  uint64_t elements = 0;
  std::vector<SliceRef> slices;
};

class SlicePlanner {
 public:
  // slice_bytes is rounded down to whole elements (at least one).
  SlicePlanner(uint64_t slice_bytes, uint32_t elem_size, uint32_t num_servers);

  Result<TensorLayout> Plan(TensorId tensor, uint64_t elements);
  // Takes back the latest Plan (a registration the servers refused), so that the next tensor
  // is placed as if the refused one had never been planned, as on every other worker.
  void Unplan(const TensorLayout& latest);
  uint64_t slice_elements() const { return slice_elements_; }

 private:
  uint64_t slice_elements_;
  uint32_t num_servers_;
  uint64_t next_slot_ = 0;  // placement counter across tensors
};

}  // namespace dsync::ps
