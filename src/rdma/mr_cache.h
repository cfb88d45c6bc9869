// Memory-registration cache: ibv_reg_mr pins pages and costs tens of microseconds
// or more, so registrations are reused. Granularity is the page: a request for [p, p+n)
// registers the pages it touches, and any later request inside them shares that entry.
// Entries are reference counted by the operations using them.
//
// What a free means for a registration: the MR keeps the *old* physical pages pinned, so
// memory freed and reallocated at the same address would silently be written to the wrong
// pages. The cache therefore keeps an unused entry only for memory whose lifetime it is told
// about (Pin: the transport's pools, the PS's pooled buffers), and drops it when told the
// memory is freed (Invalidate). Other memory (a caller's vector) is registered while an
// operation uses it and deregistered when the last one ends.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <utility>

#include "dsync/status.h"
#include "ps/device_memory.h"

namespace dsync::rdma {

class MrCache {
 public:
  struct Entry;
  // What an operation holds: the MR to use (lkey/rkey) and the entry to release.
  struct Ref {
    ibv_mr* mr = nullptr;
    Entry* entry = nullptr;
    explicit operator bool() const { return mr != nullptr; }
  };

  explicit MrCache(ibv_pd* pd, int access);
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // A registration covering [addr, addr + len), shared when one exists; the error explains
  // a failed registration (memlock limit, bad address).
  Result<Ref> Acquire(const void* addr, size_t len);
  void Release(const Ref& ref);

  // GPUDirect RDMA: from now on, ranges inside `memory` are registered through its dma-buf
  // export (ibv_reg_dmabuf_mr) instead of ibv_reg_mr, which cannot pin device memory.
  void SetDeviceMemory(const ps::DeviceMemory* memory);

  // Long-lived memory: registered now and kept while unused, until Invalidate.
  Status Pin(const void* addr, size_t len);
  // The memory is being freed: no later Acquire may use a registration of it. Entries still
  // in use are deregistered when their last user releases them.
  void Invalidate(const void* addr, size_t len);

  struct Stats {
    uint64_t registrations = 0;    // ibv_reg_mr and ibv_reg_dmabuf_mr calls
    uint64_t device_registrations = 0;  // of those, of GPU memory (ibv_reg_dmabuf_mr)
    uint64_t hits = 0;             // Acquire served by an existing entry
    uint64_t deregistrations = 0;  // ibv_dereg_mr calls
    size_t entries = 0;            // live entries
  };
  Stats stats() const;

  struct Entry {
    uintptr_t begin = 0, end = 0;  // page-aligned
    ibv_mr* mr = nullptr;
    uint32_t refs = 0;
    bool pinned = false;   // keep while unused
    bool valid = true;     // false once invalidated: never handed out again
  };

 private:
  // The page-aligned [begin, end) holding [addr, addr + len).
  std::pair<uintptr_t, uintptr_t> Pages(const void* addr, size_t len) const;
  Result<Entry*> RegisterLocked(uintptr_t begin, uintptr_t end, bool pinned);
  Result<ibv_mr*> RegisterDevice(uintptr_t begin, uintptr_t end);
  void DropLocked(std::list<Entry>::iterator it);

  ibv_pd* pd_;
  int access_;
  const ps::DeviceMemory* device_memory_ = nullptr;  // under mu_
  uintptr_t page_;
  mutable std::mutex mu_;
  std::list<Entry> entries_;  // few: pools and buffers in flight; list keeps Entry* stable
  Stats stats_;
};

// The message for a failed ibv_reg_mr, with the memlock limit when that is the likely cause.
std::string RegistrationError(int err, size_t bytes);

}  // namespace dsync::rdma
