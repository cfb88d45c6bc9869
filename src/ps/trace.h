// NVTX3 ranges for profiling: what each role and store is doing, named so that an
// `nsys profile` timeline reads without a legend (README, "Profiling with nsys"). All ranges
// live in the NVTX domain "dsyncps", one category per layer (worker, server, store).
//
// Without NVTX3 headers (no CUDA toolkit at build time) every call here is a no-op and
// Enabled() is false. With them and no tool attached, a range costs one call through a
// no-op function pointer (NVTX's own design), so the ranges stay on in release builds.
#pragma once

#include <cstdint>
#include <string_view>

namespace dsync::trace {

enum class Range : uint8_t {
  kWorkerPush,          // sending a tensor's slices to the servers
  kWorkerPull,          // from a pull request to its last slice (start/end: crosses threads)
  kWorkerWaitForBound,  // Wait() on a pull the delay bound still holds back
  kWorkerWaitForPull,   // Wait() on a pull that is on the wire
  kWorkerWaitForPush,   // Wait() on a push until its clock is committed
  kServerPush,          // staging a received gradient slice
  kServerPull,          // reading a slice and sending it back
  kServerRound,         // applying one round to every slice of the server (payload: round)
  kStoreAggregate,      // gathering a round's gradients where the update runs (GPU: H2D)
  kStoreApply,          // summing in worker order and applying the optimizer
  kStoreRead,           // reading a slice back for a pull
  kCount
};

// "worker: push", "store: apply", ...: the names the timeline shows.
std::string_view Name(Range r);

// Whether this build emits NVTX ranges.
bool Enabled();

// Push/pop ranges nest on the calling thread.
void Push(Range r, uint64_t payload = 0);
void Pop();

// Start/end ranges may end on another thread; 0 is "no range" (End(0) does nothing).
uint64_t Start(Range r);
void End(uint64_t id);

class Scoped {
 public:
  explicit Scoped(Range r, uint64_t payload = 0) { Push(r, payload); }
  ~Scoped() { Pop(); }
  Scoped(const Scoped&) = delete;
  Scoped& operator=(const Scoped&) = delete;
};

}  // namespace dsync::trace
