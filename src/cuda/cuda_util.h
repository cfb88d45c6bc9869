// CUDA runtime errors as Status values, and owning device / pinned float buffers: shared by
// the CUDA store and the NCCL group (src/cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string_view>

#include "dsync/status.h"

namespace dsync::cuda {

inline Status CudaError(cudaError_t err, std::string_view what) {
  return Error(StatusCode::kUnavailable, "{}: {} ({})", what, cudaGetErrorString(err),
               cudaGetErrorName(err));
}

inline Status CudaCheck(cudaError_t err, std::string_view what) {
  return err == cudaSuccess ? Status::Ok() : CudaError(err, what);
}

#define DSYNC_CUDA_RETURN(call, what)                                \
  do {                                                               \
    if (cudaError_t err_ = (call); err_ != cudaSuccess) {            \
      return ::dsync::cuda::CudaError(err_, what);                   \
    }                                                                \
  } while (0)

struct DeviceFree {
  void operator()(float* p) const { (void)cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<float, DeviceFree>;

struct PinnedFree {
  void operator()(float* p) const { (void)cudaFreeHost(p); }
};
using PinnedBuffer = std::unique_ptr<float, PinnedFree>;

// n floats (at least one) of device memory on the current device.
inline Result<DeviceBuffer> DeviceAlloc(uint64_t n, std::string_view what) {
  void* p = nullptr;
  DSYNC_CUDA_RETURN(cudaMalloc(&p, std::max<uint64_t>(n, 1) * sizeof(float)), what);
  return DeviceBuffer(static_cast<float*>(p));
}

// Pinned, so device copies from and to it run asynchronously at full speed (CUDA C++
// Programming Guide, "Page-Locked Host Memory").
inline Result<PinnedBuffer> PinnedAlloc(uint64_t n, std::string_view what) {
  void* p = nullptr;
  DSYNC_CUDA_RETURN(cudaMallocHost(&p, std::max<uint64_t>(n, 1) * sizeof(float)), what);
  return PinnedBuffer(static_cast<float*>(p));
}

}  // namespace dsync::cuda
