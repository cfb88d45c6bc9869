#include "ps/buffer_pool.h"

#include <bit>

namespace dsync::ps {

size_t BufferPool::ClassOf(size_t bytes) {
  const size_t c = std::bit_width(bytes <= 1 ? size_t{1} : bytes - 1);
  return c < kMinClass ? kMinClass : c;
}

void* BufferPool::Allocate(size_t bytes) {
  return memory_ == Memory::kDevice ? store_->AllocateDevice(bytes) : store_->AllocateHost(bytes);
}

void BufferPool::Free(void* p, size_t bytes) {
  if (memory_ == Memory::kDevice) {
    store_->FreeDevice(p, bytes);
  } else {
    store_->FreeHost(p, bytes);
  }
}

BufferPool::~BufferPool() {
  for (size_t c = 0; c < kClasses; ++c) {
    for (void* p : free_[c]) {
      if (transport_) transport_->ForgetMemory(p, size_t{1} << c);
      Free(p, size_t{1} << c);
    }
  }
}

void* BufferPool::Acquire(size_t bytes, Status* why) {
  const size_t c = ClassOf(bytes);
  if (c >= kClasses) return nullptr;
  {
    std::lock_guard lock(mu_);
    if (!free_[c].empty()) {
      void* p = free_[c].back();
      free_[c].pop_back();
      return p;
    }
  }
  void* p = Allocate(size_t{1} << c);
  if (!p) return nullptr;
  if (transport_) {
    // Host memory the transport failed to register still works (registered per message);
    // device memory it cannot register is of no use to it.
    Status st = transport_->RegisterMemory(p, size_t{1} << c);
    if (!st.ok() && memory_ == Memory::kDevice) {
      transport_->ForgetMemory(p, size_t{1} << c);
      Free(p, size_t{1} << c);
      if (why) *why = std::move(st);
      return nullptr;
    }
  }
  std::lock_guard lock(mu_);
  ++created_;
  return p;
}

void BufferPool::Release(void* buffer, size_t bytes) {
  if (!buffer) return;
  const size_t c = ClassOf(bytes);
  std::lock_guard lock(mu_);
  free_[c].push_back(buffer);
}

uint64_t BufferPool::created() const {
  std::lock_guard lock(mu_);
  return created_;
}

}  // namespace dsync::ps
