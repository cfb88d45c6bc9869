// The map from slice keys to a store's slices, shared by the CPU and CUDA stores: they
// differ in where a slice's memory lives, not in how slices are found.
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "dsync/status.h"
#include "ps/param_store.h"

namespace dsync::ps {

// Slice: any type with a `uint64_t n` (its element count). The table guards the map, not
// the slices (see ParamStore: the server never uses one slice from two threads at once).
template <typename Slice>
class SliceTable {
 public:
  Status Insert(SliceKey key, std::unique_ptr<Slice> slice) {
    std::unique_lock lock(mu_);
    if (!slices_.emplace(key, std::move(slice)).second) {
      return Error(StatusCode::kAlreadyExists, "slice {:#x} already exists", key);
    }
    return Status::Ok();
  }

  Slice* Find(SliceKey key) const {
    std::shared_lock lock(mu_);
    auto it = slices_.find(key);
    return it == slices_.end() ? nullptr : it->second.get();
  }

  // The slice, or NotFound.
  Result<Slice*> Get(SliceKey key) const {
    Slice* s = Find(key);
    if (!s) return Error(StatusCode::kNotFound, "slice {:#x} does not exist", key);
    return s;
  }

  uint64_t Elements(SliceKey key) const {
    const Slice* s = Find(key);
    return s ? s->n : 0;
  }

  // For Read(): `out` must hold exactly the slice.
  static Status CheckReadSize(SliceKey key, size_t asked, uint64_t has) {
    if (asked == has) return Status::Ok();
    return Error(StatusCode::kInvalidArgument, "read of slice {:#x}: {} floats asked, it has {}",
                 key, asked, has);
  }

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<SliceKey, std::unique_ptr<Slice>> slices_;
};

}  // namespace dsync::ps
