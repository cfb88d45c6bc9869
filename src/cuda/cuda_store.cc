#include "cuda/cuda_store.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "cuda/apply_kernels.h"
#include "ps/optimizer.h"
#include "ps/slice_table.h"

namespace dsync::cuda {
namespace {

using ps::SliceKey;

Status CudaError(cudaError_t err, std::string_view what) {
  return Error(StatusCode::kUnavailable, "{}: {} ({})", what, cudaGetErrorString(err),
               cudaGetErrorName(err));
}

#define DSYNC_CUDA_RETURN(call, what)                           \
  do {                                                          \
    if (cudaError_t err_ = (call); err_ != cudaSuccess) {       \
      return CudaError(err_, what);                             \
    }                                                           \
  } while (0)

struct DeviceFree {
  void operator()(float* p) const { (void)cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<float, DeviceFree>;

Result<DeviceBuffer> DeviceAlloc(uint64_t n, std::string_view what) {
  void* p = nullptr;
  DSYNC_CUDA_RETURN(cudaMalloc(&p, std::max<uint64_t>(n, 1) * sizeof(float)), what);
  return DeviceBuffer(static_cast<float*>(p));
}

Update UpdateOf(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSum: return Update::kSum;
    case OptimizerKind::kSgd: return Update::kSgd;
    case OptimizerKind::kMomentum: return Update::kMomentum;
    case OptimizerKind::kAdam: return Update::kAdam;
  }
  return Update::kSgd;
}

struct Slice {
  uint64_t n = 0;
  DeviceBuffer params;
  DeviceBuffer state[2];  // momentum: v; adam: m, v (allocated, zeroed, on first use)
  uint64_t steps = 0;
};

class CudaStore final : public ps::ParamStore {
 public:
  ~CudaStore() override {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }

  Status Init() {
    DSYNC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                      "creating the CUDA store's stream");
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }

  // Pinned: host-to-device copies from it run asynchronously and at full PCIe/NVLink speed
  // (CUDA C++ Programming Guide, "Page-Locked Host Memory").
  void* AllocateHost(size_t bytes) override {
    void* p = nullptr;
    return cudaMallocHost(&p, std::max<size_t>(bytes, 1)) == cudaSuccess ? p : nullptr;
  }
  void FreeHost(void* ptr, size_t /*bytes*/) override { (void)cudaFreeHost(ptr); }

  Status InitSlice(SliceKey key, std::span<const float> init) override {
    auto slice = std::make_unique<Slice>();
    slice->n = init.size();
    DSYNC_ASSIGN_OR_RETURN(slice->params, DeviceAlloc(init.size(), "allocating a slice"));
    {
      std::lock_guard lock(stream_mu_);
      DSYNC_CUDA_RETURN(cudaMemcpyAsync(slice->params.get(), init.data(), init.size_bytes(),
                                        cudaMemcpyHostToDevice, stream_),
                        "copying a slice's initial values");
      DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "initializing a slice");
    }
    return slices_.Insert(key, std::move(slice));
  }

  bool HasSlice(SliceKey key) const override { return slices_.Find(key) != nullptr; }

  uint64_t SliceElements(SliceKey key) const override { return slices_.Elements(key); }

  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    const OptimizerConfig& opt) override {
    DSYNC_ASSIGN_OR_RETURN(Slice * s, slices_.Get(key));
    if (grads.empty()) return Status::Ok();
    // One stream and one gradient scratch area serve every slice: rounds on different slices
    // are serialized here (first version; per-thread streams would overlap them).
    std::lock_guard lock(stream_mu_);
    const uint32_t slots = ps::OptimizerStateSlots(opt.kind);
    for (uint32_t i = 0; i < slots; ++i) {
      if (!s->state[i]) {
        DSYNC_ASSIGN_OR_RETURN(s->state[i], DeviceAlloc(s->n, "allocating optimizer state"));
        DSYNC_CUDA_RETURN(cudaMemsetAsync(s->state[i].get(), 0, s->n * sizeof(float), stream_),
                          "zeroing optimizer state");
      }
    }
    // The scratch only grows: in steady state a round allocates nothing.
    const uint64_t need = s->n * grads.size();
    if (need > scratch_floats_) {
      DSYNC_ASSIGN_OR_RETURN(scratch_, DeviceAlloc(need, "allocating gradient scratch"));
      scratch_floats_ = need;
    }
    for (size_t j = 0; j < grads.size(); ++j) {
      DSYNC_CUDA_RETURN(cudaMemcpyAsync(scratch_.get() + j * s->n, grads[j], s->n * sizeof(float),
                                        cudaMemcpyHostToDevice, stream_),
                        "copying a gradient to the device");
    }
    ++s->steps;
    const ps::OptimizerScalars sc =
        ps::MakeOptimizerScalars(opt, s->steps, static_cast<uint32_t>(grads.size()));
    DSYNC_CUDA_RETURN(LaunchApplyRound(UpdateOf(opt.kind), s->params.get(), s->state[0].get(),
                                       s->state[1].get(), scratch_.get(),
                                       static_cast<uint32_t>(grads.size()), s->n, s->n, sc,
                                       stream_),
                      "launching the update kernel");
    // The caller reuses the host gradient buffers once this returns.
    DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "applying a round");
    return Status::Ok();
  }

  Status Read(SliceKey key, std::span<float> out) const override {
    DSYNC_ASSIGN_OR_RETURN(const Slice* s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::SliceTable<Slice>::CheckReadSize(key, out.size(), s->n));
    std::lock_guard lock(stream_mu_);
    DSYNC_CUDA_RETURN(cudaMemcpyAsync(out.data(), s->params.get(), s->n * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_),
                      "reading a slice back");
    DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "reading a slice back");
    return Status::Ok();
  }

 private:
  ps::SliceTable<Slice> slices_;
  mutable std::mutex stream_mu_;  // guards the stream and the scratch
  cudaStream_t stream_ = nullptr;
  DeviceBuffer scratch_;
  uint64_t scratch_floats_ = 0;
};

}  // namespace

bool DeviceAvailable(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (why) {
      *why = err != cudaSuccess ? fmt::format("{} ({})", cudaGetErrorString(err),
                                              cudaGetErrorName(err))
                                : std::string("no device");
    }
    return false;
  }
  return true;
}

Result<std::unique_ptr<ps::ParamStore>> MakeCudaStore() {
  std::string why;
  if (!DeviceAvailable(&why)) {
    return Error(StatusCode::kUnavailable,
                 "no CUDA device is visible ({}); use --store cpu (or --store auto, which picks "
                 "the GPU when there is one)",
                 why);
  }
  auto store = std::make_unique<CudaStore>();
  DSYNC_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<ps::ParamStore>(std::move(store));
}

}  // namespace dsync::cuda
