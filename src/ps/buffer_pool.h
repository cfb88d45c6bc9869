// Reused host buffers for gradients in flight and pull replies. Memory first-touch costs
// ~12-18 us per page on our machines and glibc returns large blocks to the kernel on free,
// so a buffer per message would fault on every page every time: buffers are kept in
// power-of-two size classes and handed out again.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "ps/param_store.h"
#include "ps/transport.h"

namespace dsync::ps {

class BufferPool {
 public:
  enum class Memory { kHost, kDevice };  // the store's AllocateHost or AllocateDevice

  // With a transport, every buffer is registered with it once, when created (RDMA).
  explicit BufferPool(ParamStore* store, Transport* transport = nullptr,
                      Memory memory = Memory::kHost)
      : store_(store), transport_(transport), memory_(memory) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes`, or nullptr when memory is exhausted or, for device
  // memory, when the transport cannot register it (then *why, if given, says so).
  void* Acquire(size_t bytes, Status* why = nullptr);
  void Release(void* buffer, size_t bytes);

  uint64_t created() const;  // buffers ever allocated (steady state: stops growing)

 private:
  static constexpr size_t kMinClass = 12;  // 4 KiB
  static constexpr size_t kClasses = 40;
  static size_t ClassOf(size_t bytes);
  void* Allocate(size_t bytes);
  void Free(void* p, size_t bytes);

  ParamStore* store_;
  Transport* transport_;
  Memory memory_;
  mutable std::mutex mu_;
  std::array<std::vector<void*>, kClasses> free_;
  uint64_t created_ = 0;
};

}  // namespace dsync::ps
