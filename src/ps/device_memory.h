// The GPUDirect RDMA seam: what a transport needs to let its NIC read and write a
// store's GPU memory directly. The CUDA store provides it; src/ps and the transports see
// only this interface, so neither depends on CUDA.
//
// The mechanism is the kernel's dma-buf: the GPU driver exports a device address range as a
// file descriptor and the NIC driver imports it (ibv_reg_dmabuf_mr), with no peer-memory
// kernel module (nvidia-peermem) involved.
#pragma once

#include <cstddef>
#include <string>

#include "dsync/status.h"

namespace dsync::ps {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // Whether [ptr, ptr + bytes) lies in device memory this provider handed out.
  virtual bool Contains(const void* ptr, size_t bytes) const = 0;
  // A dma-buf file descriptor for [ptr, ptr + bytes), both aligned to the host page size
  // (cuMemGetHandleForAddressRange's rule); the caller closes it.
  virtual Result<int> ExportDmaBuf(const void* ptr, size_t bytes) const = 0;
  // Empty when the GPU and its driver can export dma-bufs; otherwise why not.
  virtual std::string DmaBufUnsupported() const = 0;
};

}  // namespace dsync::ps
