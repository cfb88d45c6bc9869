// The CUDA store's side of GPUDirect RDMA (ps/device_memory.h): page-aligned device buffers
// a NIC can register through dma-buf, and the flush that makes a NIC's writes visible to the
// GPU before a kernel reads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>

#include "dsync/status.h"
#include "ps/device_memory.h"

namespace dsync::cuda {

class CudaDeviceMemory final : public ps::DeviceMemory {
 public:
  explicit CudaDeviceMemory(int device);
  ~CudaDeviceMemory() override;
  CudaDeviceMemory(const CudaDeviceMemory&) = delete;
  CudaDeviceMemory& operator=(const CudaDeviceMemory&) = delete;

  // At least `bytes` of device memory whose start and size are host-page aligned (the rule
  // for exporting it as a dma-buf), or nullptr. The caller selects the device.
  void* Allocate(size_t bytes);
  void Free(void* ptr);

  bool Contains(const void* ptr, size_t bytes) const override;
  Result<int> ExportDmaBuf(const void* ptr, size_t bytes) const override;
  std::string DmaBufUnsupported() const override { return unsupported_; }

  // Before the GPU reads `inputs` (each `bytes` long): where any of them is memory of ours
  // that a NIC wrote, makes those writes visible to the next kernel or copy, if the GPU does
  // not order them by itself (CUDA Driver API, cuFlushGPUDirectRDMAWrites). The caller
  // selects the device. GPUs that order them (Hopper) skip even the lookups.
  Status FlushBeforeReading(std::span<const float* const> inputs, size_t bytes) const;

 private:
  struct Block {
    void* raw = nullptr;  // what cudaMalloc returned
    size_t bytes = 0;     // usable from the aligned start
  };
  const int device_;
  size_t page_;
  std::string unsupported_;  // empty: dma-buf export works
  bool flush_ = false;       // NIC writes need a flush before the GPU reads them
  void* export_fn_ = nullptr;  // cuMemGetHandleForAddressRange, from the driver
  mutable std::mutex mu_;
  std::map<uintptr_t, Block> blocks_;  // by aligned start
};

}  // namespace dsync::cuda
