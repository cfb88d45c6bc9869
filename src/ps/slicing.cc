#include "ps/slicing.h"

#include <algorithm>

namespace dsync::ps {

SlicePlanner::SlicePlanner(uint64_t slice_bytes, uint32_t elem_size, uint32_t num_servers)
    : slice_elements_(std::max<uint64_t>(1, slice_bytes / std::max<uint32_t>(1, elem_size))),
      num_servers_(std::max<uint32_t>(1, num_servers)) {}

Result<TensorLayout> SlicePlanner::Plan(TensorId tensor, uint64_t elements) {
  if (elements == 0) {
    return Error(StatusCode::kInvalidArgument, "tensor {} has no elements", tensor);
  }
  const uint64_t count = (elements + slice_elements_ - 1) / slice_elements_;
  if (count > UINT32_MAX) {
    return Error(StatusCode::kOutOfRange, "tensor {} needs {} slices; raise the slice size",
                 tensor, count);
  }
  TensorLayout layout;
  layout.tensor = tensor;
  layout.elements = elements;
  layout.slices.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    SliceRef s;
    s.index = static_cast<uint32_t>(i);
    s.offset = i * slice_elements_;
    s.elements = std::min(slice_elements_, elements - s.offset);
    s.server = static_cast<uint32_t>(next_slot_++ % num_servers_);
    layout.slices.push_back(s);
  }
  return layout;
}

bool EverySliceHasACopy(const std::vector<bool>& lost, uint32_t replicas) {
  const size_t n = lost.size();
  for (size_t start = 0; start < n; ++start) {
    size_t j = 0;
    while (j < replicas && j < n && lost[(start + j) % n]) ++j;
    if (j == replicas || j == n) return false;
  }
  return true;
}

void SlicePlanner::Unplan(const TensorLayout& latest) {
  next_slot_ -= std::min<uint64_t>(next_slot_, latest.slices.size());
}

std::vector<bool> LostNow(const std::vector<NodeId>& losses, const std::vector<NodeId>& takeovers,
                          uint32_t num_servers) {
  std::vector<int64_t> balance(num_servers, 0);
  for (NodeId id : losses) {
    if (id >= kFirstServerId && id - kFirstServerId < num_servers) ++balance[id - kFirstServerId];
  }
  for (NodeId id : takeovers) {
    if (id >= kFirstServerId && id - kFirstServerId < num_servers) --balance[id - kFirstServerId];
  }
  std::vector<bool> lost(num_servers);
  for (uint32_t r = 0; r < num_servers; ++r) lost[r] = balance[r] > 0;
  return lost;
}

}  // namespace dsync::ps
