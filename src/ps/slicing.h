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

// Copy j (0: the primary) of a slice whose primary is on rank `primary` lives on the j-th
// rank after it: the replicas of a slice are on distinct servers while j < num_servers.
inline uint32_t ReplicaRank(uint32_t primary, uint32_t j, uint32_t num_servers) {
  return static_cast<uint32_t>((uint64_t{primary} + j) % num_servers);
}

// The inverse: the primary of the slice whose copy `copy` is on rank `holder`, and which copy
// of a slice with that primary rank `rank` holds (`replicas` or more: none).
inline uint32_t PrimaryRank(uint32_t holder, uint32_t copy, uint32_t num_servers) {
  return static_cast<uint32_t>((uint64_t{holder} + num_servers - copy % num_servers) % num_servers);
}
inline uint32_t CopyNumber(uint32_t rank, uint32_t primary, uint32_t num_servers) {
  return static_cast<uint32_t>((uint64_t{rank} + num_servers - primary) % num_servers);
}

// Whether every slice still has a live copy with `replicas` copies per slice once the ranks
// marked in `lost` are gone: no `replicas` ranks in a row (cyclically) are all lost. That
// holds whatever tensors exist, so it is what the job checks before it goes on.
bool EverySliceHasACopy(const std::vector<bool>& lost, uint32_t replicas);

// By rank (of `num_servers`), whether a server is lost now: `losses` lists the servers lost
// and `takeovers` the ranks a new server took over since, each in order; a rank is lost when
// it was lost more often than taken over. Ids that are not servers of the job are ignored.
std::vector<bool> LostNow(const std::vector<NodeId>& losses, const std::vector<NodeId>& takeovers,
                          uint32_t num_servers);

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
