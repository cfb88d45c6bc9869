#include "rdma/mr_cache.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace dsync::rdma {

std::string RegistrationError(int err, size_t bytes) {
  std::string msg = fmt::format("registering {} bytes with the RDMA device failed: {}", bytes,
                                std::strerror(err));
  rlimit lim{};
  if ((err == ENOMEM || err == EPERM || err == EAGAIN) && getrlimit(RLIMIT_MEMLOCK, &lim) == 0 &&
      lim.rlim_cur != RLIM_INFINITY) {
    msg += fmt::format(
        "; the locked-memory limit is {} KiB, too low for RDMA: raise it (ulimit -l unlimited; "
        "systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1; or memlock in "
        "/etc/security/limits.conf)",
        lim.rlim_cur / 1024);
  }
  return msg;
}

MrCache::MrCache(ibv_pd* pd, int access)
    : pd_(pd), access_(access), page_(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE))) {}

std::pair<uintptr_t, uintptr_t> MrCache::Pages(const void* addr, size_t len) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  return {a & ~(page_ - 1), (a + (len ? len : 1) + page_ - 1) & ~(page_ - 1)};
}

MrCache::~MrCache() {
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.mr) ibv_dereg_mr(e.mr);
  }
}

void MrCache::SetDeviceMemory(const ps::DeviceMemory* memory) {
  std::lock_guard lock(mu_);
  device_memory_ = memory;
}

// The dma-buf route (rdma-core's ibv_reg_dmabuf_mr(3)): the GPU driver exports the range as
// a file descriptor, the NIC driver maps it; the iova is the range's virtual address, so work
// requests use device pointers exactly like host ones. The fd may be closed at once: the MR
// holds its own reference to the dma-buf.
Result<ibv_mr*> MrCache::RegisterDevice(uintptr_t begin, uintptr_t end) {
  const void* p = reinterpret_cast<const void*>(begin);
  DSYNC_ASSIGN_OR_RETURN(int fd, device_memory_->ExportDmaBuf(p, end - begin));
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, 0, end - begin, begin, fd, access_);
  const int err = errno;
  close(fd);
  if (!mr) {
    return Error(StatusCode::kUnavailable,
                 "registering {} bytes of GPU memory with the RDMA device (ibv_reg_dmabuf_mr) "
                 "failed: {}",
                 end - begin, std::strerror(err));
  }
  ++stats_.device_registrations;
  return mr;
}

Result<MrCache::Entry*> MrCache::RegisterLocked(uintptr_t begin, uintptr_t end, bool pinned) {
  ibv_mr* mr = nullptr;
  if (device_memory_ && device_memory_->Contains(reinterpret_cast<const void*>(begin),
                                                 end - begin)) {
    DSYNC_ASSIGN_OR_RETURN(mr, RegisterDevice(begin, end));
  } else {
    mr = ibv_reg_mr(pd_, reinterpret_cast<void*>(begin), end - begin, access_);
    if (!mr) return Error(StatusCode::kUnavailable, "{}", RegistrationError(errno, end - begin));
  }
  ++stats_.registrations;
  entries_.push_front(Entry{begin, end, mr, 0, pinned, true});
  return &entries_.front();
}

void MrCache::DropLocked(std::list<Entry>::iterator it) {
  if (it->mr) {
    ibv_dereg_mr(it->mr);
    ++stats_.deregistrations;
  }
  entries_.erase(it);
}

Result<MrCache::Ref> MrCache::Acquire(const void* addr, size_t len) {
  const auto [begin, end] = Pages(addr, len);
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.valid && e.begin <= begin && end <= e.end) {
      ++e.refs;
      ++stats_.hits;
      return Ref{e.mr, &e};
    }
  }
  DSYNC_ASSIGN_OR_RETURN(Entry * e, RegisterLocked(begin, end, false));
  e->refs = 1;
  return Ref{e->mr, e};
}

void MrCache::Release(const Ref& ref) {
  if (!ref.entry) return;
  std::lock_guard lock(mu_);
  Entry* e = ref.entry;
  if (e->refs > 0) --e->refs;
  if (e->refs == 0 && (!e->pinned || !e->valid)) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (&*it == e) {
        DropLocked(it);
        break;
      }
    }
  }
}

Status MrCache::Pin(const void* addr, size_t len) {
  const auto [begin, end] = Pages(addr, len);
  std::lock_guard lock(mu_);
  for (Entry& e : entries_) {
    if (e.valid && e.begin <= begin && end <= e.end) {
      e.pinned = true;
      return Status::Ok();
    }
  }
  return RegisterLocked(begin, end, true).status();
}

void MrCache::Invalidate(const void* addr, size_t len) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t b = a + (len ? len : 1);
  std::lock_guard lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->begin < b && a < it->end) {  // shares a page with the freed memory
      it->valid = false;
      if (it->refs == 0) DropLocked(it);
    }
    it = next;
  }
}

MrCache::Stats MrCache::stats() const {
  std::lock_guard lock(mu_);
  Stats s = stats_;
  s.entries = entries_.size();
  return s;
}

}  // namespace dsync::rdma
