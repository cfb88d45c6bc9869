#include "cuda/cuda_device_memory.h"

#include <cuda.h>  // driver types only: the functions come from the runtime's entry points
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "cuda/cuda_util.h"

namespace dsync::cuda {
namespace {

// Driver functions reached through the runtime, so the library needs no link to libcuda
// (which machines without a GPU lack). The version is the one that introduced each.
void* DriverFunction(const char* name, unsigned version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found);
#else  // before 12.5 only the unversioned lookup exists; it gives the toolkit's version
  (void)version;
  const cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return fn;
}

using GetDeviceFn = CUresult (*)(CUdevice*, int);
using GetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
using GetHandleFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                 unsigned long long);

}  // namespace

CudaDeviceMemory::CudaDeviceMemory(int device)
    : device_(device), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
  // dma-buf export needs the driver call (CUDA 11.7+) and the device attribute saying the
  // GPU and kernel driver support it.
  export_fn_ = DriverFunction("cuMemGetHandleForAddressRange", 11070);
  auto get_device = reinterpret_cast<GetDeviceFn>(DriverFunction("cuDeviceGet", 2000));
  auto get_attribute =
      reinterpret_cast<GetAttributeFn>(DriverFunction("cuDeviceGetAttribute", 2000));
  int dmabuf = 0;
  CUdevice handle{};  // the driver's handle for the runtime's ordinal
  if (!export_fn_ || !get_device || !get_attribute) {
    unsupported_ = "the CUDA driver has no cuMemGetHandleForAddressRange (it needs CUDA 11.7+)";
  } else if (get_device(&handle, device_) != CUDA_SUCCESS ||
             get_attribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, handle) !=
                 CUDA_SUCCESS ||
             !dmabuf) {
    unsupported_ = fmt::format(
        "GPU {} cannot export its memory as a dma-buf (that needs NVIDIA's open GPU kernel "
        "modules, driver 515 or newer, on Linux 5.12 or newer)",
        device_);
  }
  // Does the GPU order a NIC's writes before its own later reads, or must we flush?
  int ordering = 0, options = 0;
  (void)cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device_);
  (void)cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device_);
  (void)cudaGetLastError();
  if (ordering < cudaGPUDirectRDMAWritesOrderingOwner) {
    if (options & cudaFlushGPUDirectRDMAWritesOptionHost) {
      flush_ = true;
    } else if (unsupported_.empty()) {
      unsupported_ = fmt::format(
          "GPU {} neither orders writes from a NIC nor can flush them", device_);
    }
  }
}

CudaDeviceMemory::~CudaDeviceMemory() {
  std::lock_guard lock(mu_);
  for (auto& [start, block] : blocks_) (void)cudaFree(block.raw);
}

void* CudaDeviceMemory::Allocate(size_t bytes) {
  const size_t size = (std::max<size_t>(bytes, 1) + page_ - 1) / page_ * page_;
  void* raw = nullptr;
  if (cudaMalloc(&raw, size) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (reinterpret_cast<uintptr_t>(raw) % page_ != 0) {
    // cudaMalloc guarantees only 256 bytes (large blocks are 2 MiB aligned in practice):
    // one page more, so that a page-aligned start fits inside the allocation.
    (void)cudaFree(raw);
    if (cudaMalloc(&raw, size + page_) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
  }
  const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + page_ - 1) / page_ * page_;
  std::lock_guard lock(mu_);
  blocks_[start] = Block{raw, size};
  return reinterpret_cast<void*>(start);
}

void CudaDeviceMemory::Free(void* ptr) {
  std::lock_guard lock(mu_);
  auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == blocks_.end()) return;
  (void)cudaFree(it->second.raw);
  blocks_.erase(it);
}

bool CudaDeviceMemory::Contains(const void* ptr, size_t bytes) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(mu_);
  auto it = blocks_.upper_bound(p);
  if (it == blocks_.begin()) return false;
  --it;
  return p + bytes <= it->first + it->second.bytes;
}

Result<int> CudaDeviceMemory::ExportDmaBuf(const void* ptr, size_t bytes) const {
  if (!unsupported_.empty()) return Error(StatusCode::kUnavailable, "{}", unsupported_);
  if (!Contains(ptr, bytes)) {
    return Error(StatusCode::kInvalidArgument,
                 "{} bytes at {} are not device memory of the CUDA store", bytes, ptr);
  }
  if (reinterpret_cast<uintptr_t>(ptr) % page_ != 0 || bytes % page_ != 0) {
    return Error(StatusCode::kInvalidArgument,
                 "a dma-buf range must be aligned to the {}-byte host page", page_);
  }
  DSYNC_CUDA_RETURN(cudaSetDevice(device_), "selecting the store's GPU");
  int fd = -1;
  const CUresult r = reinterpret_cast<GetHandleFn>(export_fn_)(
      &fd, reinterpret_cast<CUdeviceptr>(ptr), bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    return Error(StatusCode::kUnavailable,
                 "exporting {} bytes of GPU memory as a dma-buf failed (CUresult {})", bytes,
                 static_cast<int>(r));
  }
  return fd;
}

Status CudaDeviceMemory::FlushBeforeReading(std::span<const float* const> inputs,
                                            size_t bytes) const {
  if (!flush_) return Status::Ok();
  bool written = false;
  for (const float* p : inputs) written = written || Contains(p, bytes);
  if (!written) return Status::Ok();
  return CudaCheck(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                      cudaFlushGPUDirectRDMAWritesToOwner),
                   "flushing the NIC's writes into GPU memory");
}

}  // namespace dsync::cuda
