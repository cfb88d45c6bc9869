// LocalGpuGroup over NCCL (include/dsync/local_gpus.h). One thread drives every GPU of the
// process: a single-process communicator clique from ncclCommInitAll, one stream per device,
// and every per-device NCCL call inside ncclGroupStart/ncclGroupEnd, as NCCL requires when
// one thread manages several devices (NCCL User Guide, "Group Calls: Management Of Multiple
// GPUs From One Thread"; otherwise the first call may block waiting for the other ranks).
#include "dsync/local_gpus.h"

#include "cuda/cuda_util.h"

#include <cuda_runtime_api.h>
#include <fmt/ranges.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <optional>
#include <unordered_map>

#if DSYNC_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
#define DSYNC_NCCL_HAS_AVG 1  // ncclAvg appeared in NCCL 2.10
#endif

namespace dsync {
namespace {

using cuda::CudaCheck;
using cuda::CudaError;
using cuda::DeviceBuffer;
using cuda::PinnedAlloc;
using cuda::PinnedBuffer;

Status NcclError(ncclResult_t r, std::string_view what) {
  const StatusCode code = r == ncclInvalidArgument || r == ncclInvalidUsage
                              ? StatusCode::kInvalidArgument
                              : StatusCode::kUnavailable;
  std::string detail;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  // The library's own explanation (which rank, which buffer), when it left one.
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') {
    detail = fmt::format(" [{}]", last);
  }
#endif
  return Error(code, "{}: {}{} (set NCCL_DEBUG=WARN for NCCL's log)", what,
               ncclGetErrorString(r), detail);
}

// Every call leaves the caller's current device as it found it.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
  }
  ~CurrentDeviceGuard() {
    if (saved_ >= 0) (void)cudaSetDevice(saved_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int saved_ = -1;
};

// "local: reduce" / "local: broadcast" in the project's NVTX domain (src/ps/trace.h).
class NvtxRange {
 public:
  explicit NvtxRange([[maybe_unused]] const char* name) {
#if DSYNC_HAVE_NVTX
    static const nvtxDomainHandle_t domain = nvtxDomainCreateA("dsyncps");
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.colorType = NVTX_COLOR_ARGB;
    a.color = 0xFF9467BD;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    nvtxDomainRangePushEx(domain, &a);
    domain_ = domain;
#endif
  }
  ~NvtxRange() {
#if DSYNC_HAVE_NVTX
    nvtxDomainRangePop(domain_);
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
#if DSYNC_HAVE_NVTX
  nvtxDomainHandle_t domain_ = nullptr;
#endif
};

std::string_view MemoryTypeName(cudaMemoryType type) {
  switch (type) {
    case cudaMemoryTypeUnregistered: return "pageable host memory";
    case cudaMemoryTypeHost: return "pinned host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
  }
  return "memory of unknown type";
}

class NcclGroup final : public LocalGpuGroup {
 public:
  NcclGroup(Worker& worker, std::vector<int> devices, LocalReduce reduce, bool nccl_avg)
      : worker_(worker), devices_(std::move(devices)), reduce_(reduce), nccl_avg_(nccl_avg) {}

  ~NcclGroup() override {
    std::lock_guard lock(mu_);
    for (auto& [id, e] : tensors_) {
      if (WaitPending(id, e).code() == StatusCode::kFailedPrecondition && e.pending_push) {
        // The iteration was never committed: the worker may still read this buffer, so it
        // is left allocated rather than freed under it.
        spdlog::warn("LocalGpuGroup destroyed with tensor {} pushed in an uncommitted "
                     "iteration (clock {}); its staging buffer is leaked",
                     id, e.pending_clock);
        (void)e.grad.release();
      }
    }
    CurrentDeviceGuard guard;
    for (size_t d = 0; d < streams_.size(); ++d) {
      if (streams_[d] != nullptr) (void)cudaStreamSynchronize(streams_[d]);
    }
    // Finalize every communicator inside one group, then destroy them, as NCCL's own
    // single-process example does (docs/examples/01_communicators/
    // 01_multiple_devices_single_process): finalizing one rank alone from this single thread
    // may wait for peers that are never finalized.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
    if (ncclGroupStart() == ncclSuccess) {
      for (ncclComm_t comm : comms_) {
        if (comm != nullptr) (void)ncclCommFinalize(comm);
      }
      (void)ncclGroupEnd();
    }
#endif
    for (ncclComm_t comm : comms_) {
      if (comm != nullptr) (void)ncclCommDestroy(comm);
    }
    for (size_t d = 0; d < streams_.size(); ++d) {
      if (streams_[d] == nullptr) continue;
      (void)cudaSetDevice(devices_[d]);
      (void)cudaStreamDestroy(streams_[d]);
    }
  }

  Status Init() {
    CurrentDeviceGuard guard;
    streams_.assign(devices_.size(), nullptr);
    for (size_t d = 0; d < devices_.size(); ++d) {
      DSYNC_CUDA_RETURN(cudaSetDevice(devices_[d]),
                        fmt::format("cudaSetDevice({})", devices_[d]));
      // A blocking stream (not cudaStreamNonBlocking): work the caller queued on the legacy
      // default stream, such as the kernels that computed the gradients, runs before ours.
      DSYNC_CUDA_RETURN(cudaStreamCreate(&streams_[d]),
                        fmt::format("cudaStreamCreate on CUDA device {}", devices_[d]));
    }
    comms_.assign(devices_.size(), nullptr);
    if (ncclResult_t r = ncclCommInitAll(comms_.data(), static_cast<int>(devices_.size()),
                                         devices_.data());
        r != ncclSuccess) {
      comms_.clear();
      return NcclError(r, fmt::format("ncclCommInitAll over CUDA devices [{}]",
                                      fmt::join(devices_, ", ")));
    }
    return Status::Ok();
  }

  size_t size() const override { return devices_.size(); }
  const std::vector<int>& devices() const override { return devices_; }
  LocalReduce reduce() const override { return reduce_; }

  Result<TensorId> Register(std::string_view name, std::span<const float> init) override {
    std::lock_guard lock(mu_);
    CurrentDeviceGuard guard;
    DSYNC_CUDA_RETURN(cudaSetDevice(devices_[0]), fmt::format("cudaSetDevice({})", devices_[0]));
    Entry e;
    e.n = init.size();
    DSYNC_ASSIGN_OR_RETURN(e.grad, PinnedAlloc(e.n, fmt::format("cudaMallocHost for tensor "
                                                                "'{}' (gradient staging)",
                                                                name)));
    DSYNC_ASSIGN_OR_RETURN(e.model, PinnedAlloc(e.n, fmt::format("cudaMallocHost for tensor "
                                                                 "'{}' (model staging)",
                                                                 name)));
    // One reduction target on the root GPU serves every tensor (calls are serialized); it
    // only grows, so iterations allocate nothing.
    if (e.n > scratch_floats_) {
      void* p = nullptr;
      DSYNC_CUDA_RETURN(cudaMalloc(&p, e.n * sizeof(float)),
                        fmt::format("cudaMalloc of {} floats on CUDA device {} for tensor '{}'",
                                    e.n, devices_[0], name));
      scratch_.reset(static_cast<float*>(p));
      scratch_floats_ = e.n;
    }
    DSYNC_ASSIGN_OR_RETURN(const TensorId id, worker_.Register(name, init));
    tensors_.insert_or_assign(id, std::move(e));
    return id;
  }

  Status Push(TensorId tensor, std::span<const float* const> grads) override {
    std::lock_guard lock(mu_);
    DSYNC_ASSIGN_OR_RETURN(Entry * e, Find(tensor));
    DSYNC_RETURN_IF_ERROR(CheckBuffers(grads, "grads"));
    DSYNC_RETURN_IF_ERROR(WaitPending(tensor, *e));  // the staging buffer is about to change
    DSYNC_RETURN_IF_ERROR(ReduceToHost(*e, grads).WithContext(Where("push", tensor)));
    e->pending_clock = worker_.clock();
    e->pending_push = worker_.Push(tensor, e->grad.get());
    return Status::Ok();
  }

  Result<Version> Pull(TensorId tensor, std::span<float* const> params) override {
    std::lock_guard lock(mu_);
    DSYNC_ASSIGN_OR_RETURN(Entry * e, Find(tensor));
    DSYNC_RETURN_IF_ERROR(CheckBuffers(params, "params"));
    Version version = 0;
    DSYNC_RETURN_IF_ERROR(worker_.Wait(worker_.Pull(tensor, e->model.get()), &version)
                              .WithContext(Where("pull", tensor)));
    DSYNC_RETURN_IF_ERROR(BroadcastFromHost(*e, params).WithContext(Where("pull", tensor)));
    return version;
  }

  Result<Version> PushPull(TensorId tensor, std::span<const float* const> grads,
                           std::span<float* const> params) override {
    std::lock_guard lock(mu_);
    DSYNC_ASSIGN_OR_RETURN(Entry * e, Find(tensor));
    DSYNC_RETURN_IF_ERROR(CheckBuffers(grads, "grads"));
    DSYNC_RETURN_IF_ERROR(CheckBuffers(params, "params"));
    DSYNC_RETURN_IF_ERROR(WaitPending(tensor, *e));
    DSYNC_RETURN_IF_ERROR(ReduceToHost(*e, grads).WithContext(Where("push-pull", tensor)));
    // The pull waits for this iteration's commit, which also completes the push: once it
    // returns, the worker no longer reads the gradient staging buffer.
    Version version = 0;
    DSYNC_RETURN_IF_ERROR(
        worker_.Wait(worker_.PushPull(tensor, e->grad.get(), e->model.get()), &version)
            .WithContext(Where("push-pull", tensor)));
    DSYNC_RETURN_IF_ERROR(BroadcastFromHost(*e, params).WithContext(Where("push-pull", tensor)));
    return version;
  }

  Status Flush() override {
    std::lock_guard lock(mu_);
    Status first;
    for (auto& [id, e] : tensors_) {
      Status st = WaitPending(id, e);
      if (first.ok()) first = st;
    }
    return first;
  }

 private:
  struct Entry {
    uint64_t n = 0;
    PinnedBuffer grad;   // the group's reduced gradient; Worker::Push reads it
    PinnedBuffer model;  // Worker::Pull writes the model here
    std::optional<Handle> pending_push;  // from Push(), not yet waited for
    Clock pending_clock = 0;
  };

  static std::string Where(std::string_view op, TensorId tensor) {
    return fmt::format("local GPU group {} of tensor {}", op, tensor);
  }

  Result<Entry*> Find(TensorId tensor) {
    auto it = tensors_.find(tensor);
    if (it == tensors_.end()) {
      return Error(StatusCode::kNotFound,
                   "tensor {} was not registered through this LocalGpuGroup (register it with "
                   "LocalGpuGroup::Register, which sets up its staging buffers)",
                   tensor);
    }
    return &it->second;
  }

  // One pointer per GPU, each in that GPU's memory: a mix-up would otherwise surface as
  // garbage or an illegal address inside an NCCL kernel.
  template <typename T>
  Status CheckBuffers(std::span<T> ptrs, std::string_view role) const {
    if (ptrs.size() != devices_.size()) {
      return Error(StatusCode::kInvalidArgument,
                   "{} holds {} pointers; the group has {} GPUs (one pointer per GPU, in "
                   "devices() order)",
                   role, ptrs.size(), devices_.size());
    }
    for (size_t d = 0; d < ptrs.size(); ++d) {
      const void* p = ptrs[d];
      if (p == nullptr) {
        return Error(StatusCode::kInvalidArgument, "{}[{}] is null", role, d);
      }
      cudaPointerAttributes attr{};
      DSYNC_CUDA_RETURN(cudaPointerGetAttributes(&attr, p),
                        fmt::format("cudaPointerGetAttributes({}[{}])", role, d));
      if (attr.type == cudaMemoryTypeManaged) continue;
      if (attr.type != cudaMemoryTypeDevice || attr.device != devices_[d]) {
        return Error(StatusCode::kInvalidArgument,
                     "{}[{}] must be device memory of CUDA device {} (devices()[{}]); it is {}{}",
                     role, d, devices_[d], d, MemoryTypeName(attr.type),
                     attr.type == cudaMemoryTypeDevice
                         ? fmt::format(" of CUDA device {}", attr.device)
                         : std::string());
      }
    }
    return Status::Ok();
  }

  // A push of this tensor from an earlier Push() must be complete before its staging buffer
  // is rewritten (Worker: buffers stay valid until Wait returns). Worker::Wait answers
  // FailedPrecondition at once, keeping the push, while its iteration is not committed yet:
  // then the buffer stays reserved.
  Status WaitPending(TensorId tensor, Entry& e) {
    if (!e.pending_push) return Status::Ok();
    Status st = worker_.Wait(*e.pending_push)
                    .WithContext(fmt::format("push of tensor {} in clock {}", tensor,
                                             e.pending_clock));
    if (st.code() == StatusCode::kFailedPrecondition && worker_.clock() == e.pending_clock) {
      return st;
    }
    e.pending_push.reset();
    return st;
  }

  // Issues call(d) for every GPU inside one NCCL group; a failed call does not skip
  // ncclGroupEnd, which must balance ncclGroupStart.
  template <typename Call>
  Status Grouped(std::string_view what, Call&& call) {
    if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) {
      return NcclError(r, "ncclGroupStart");
    }
    ncclResult_t first = ncclSuccess;
    size_t failed = 0;
    for (size_t d = 0; d < devices_.size(); ++d) {
      const ncclResult_t r = call(d);
      if (r != ncclSuccess && first == ncclSuccess) {
        first = r;
        failed = d;
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    if (first != ncclSuccess) {
      return NcclError(first, fmt::format("{} on CUDA device {}", what, devices_[failed]));
    }
    if (end != ncclSuccess) return NcclError(end, fmt::format("ncclGroupEnd after {}", what));
    return Status::Ok();
  }

  // Streams are synchronized only after ncclGroupEnd returned (NCCL "Group Calls": inside a
  // group the operations may not be enqueued yet).
  // Waits for every stream even after one fails (the others may still use the caller's
  // buffers) and reports the first failure.
  Status SyncAll(std::string_view what) {
    Status first = Status::Ok();
    for (size_t d = 0; d < streams_.size(); ++d) {
      if (cudaError_t err = cudaStreamSynchronize(streams_[d]);
          err != cudaSuccess && first.ok()) {
        first = CudaError(err, fmt::format("cudaStreamSynchronize on CUDA device {} ({})",
                                           devices_[d], what));
      }
    }
    return first;
  }

  // For an error returned after work was queued: waits for every stream (ignoring its status),
  // since the queued work may still use the caller's buffers or the pinned staging buffers,
  // then returns st unchanged.
  Status Drained(Status st) {
    if (!st.ok()) (void)SyncAll("after an error");
    return st;
  }

  // grads[d] -> (sum or mean) on the root GPU -> e.grad (host). Returns with every stream
  // idle: the caller may reuse grads, and e.grad holds the result.
  Status ReduceToHost(Entry& e, std::span<const float* const> grads) {
    if (e.n == 0) return Status::Ok();
    NvtxRange range("local: reduce");
    CurrentDeviceGuard guard;
    ncclRedOp_t op = ncclSum;
#if DSYNC_NCCL_HAS_AVG
    if (reduce_ == LocalReduce::kAverage && nccl_avg_) op = ncclAvg;
#endif
    // recvbuff matters on the root only (NCCL API, ncclReduce). Every error return from here
    // on drains the streams first: queued work may still read grads and write e.grad.
    DSYNC_RETURN_IF_ERROR(Drained(Grouped("ncclReduce", [&](size_t d) {
      return ncclReduce(grads[d], d == 0 ? scratch_.get() : nullptr, e.n, ncclFloat32, op,
                        /*root=*/0, comms_[d], streams_[d]);
    })));
    DSYNC_RETURN_IF_ERROR(Drained(
        CudaCheck(cudaSetDevice(devices_[0]), fmt::format("cudaSetDevice({})", devices_[0]))));
    DSYNC_RETURN_IF_ERROR(
        Drained(CudaCheck(cudaMemcpyAsync(e.grad.get(), scratch_.get(), e.n * sizeof(float),
                                          cudaMemcpyDeviceToHost, streams_[0]),
                          "cudaMemcpyAsync of the reduced gradient to the host")));
    DSYNC_RETURN_IF_ERROR(SyncAll("gradient reduction"));
    if (reduce_ == LocalReduce::kAverage && !nccl_avg_) {
      const float inv = 1.0f / static_cast<float>(devices_.size());
      std::for_each(e.grad.get(), e.grad.get() + e.n, [inv](float& x) { x *= inv; });
    }
    return Status::Ok();
  }

  // e.model (host) -> params[0] on the root GPU -> every params[d].
  Status BroadcastFromHost(const Entry& e, std::span<float* const> params) {
    if (e.n == 0) return Status::Ok();
    NvtxRange range("local: broadcast");
    CurrentDeviceGuard guard;
    DSYNC_CUDA_RETURN(cudaSetDevice(devices_[0]), fmt::format("cudaSetDevice({})", devices_[0]));
    // Every error return from here on drains the streams first: queued work may still read
    // e.model (pinned) and write params.
    DSYNC_RETURN_IF_ERROR(
        Drained(CudaCheck(cudaMemcpyAsync(params[0], e.model.get(), e.n * sizeof(float),
                                          cudaMemcpyHostToDevice, streams_[0]),
                          "cudaMemcpyAsync of the pulled model to the root GPU")));
    // In place on the root (sendbuff == recvbuff); sendbuff is ignored elsewhere (NCCL API,
    // ncclBroadcast). Same stream as the copy above, so the broadcast reads the new model.
    DSYNC_RETURN_IF_ERROR(Drained(Grouped("ncclBroadcast", [&](size_t d) {
      return ncclBroadcast(params[d], params[d], e.n, ncclFloat32, /*root=*/0, comms_[d],
                           streams_[d]);
    })));
    return SyncAll("model broadcast");
  }

  Worker& worker_;
  const std::vector<int> devices_;
  const LocalReduce reduce_;
  const bool nccl_avg_;  // ncclAvg is usable (built and running with NCCL >= 2.10)
  std::vector<cudaStream_t> streams_;
  std::vector<ncclComm_t> comms_;
  DeviceBuffer scratch_;  // on devices_[0]
  uint64_t scratch_floats_ = 0;
  std::unordered_map<TensorId, Entry> tensors_;
  std::mutex mu_;  // one operation at a time: the streams and scratch are shared
};

}  // namespace

Result<std::unique_ptr<LocalGpuGroup>> LocalGpuGroup::Create(Worker& worker,
                                                             LocalGpuOptions options) {
  // Devices first: NCCL is not touched on a machine without a usable GPU.
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    const std::string why = err != cudaSuccess ? fmt::format("{} ({})", cudaGetErrorString(err),
                                                             cudaGetErrorName(err))
                                               : std::string("the CUDA runtime reports 0 devices");
    return Error(StatusCode::kUnavailable,
                 "local GPU aggregation: no CUDA device is visible ({}); run this worker on a "
                 "machine with GPUs (check nvidia-smi and CUDA_VISIBLE_DEVICES), or push and pull "
                 "host memory with dsync::Worker directly",
                 why);
  }
  std::vector<int> devices = std::move(options.devices);
  if (devices.empty()) {
    devices.resize(static_cast<size_t>(count));
    std::iota(devices.begin(), devices.end(), 0);
  }
  std::vector<int> seen;
  for (int d : devices) {
    if (d < 0) {
      return Error(StatusCode::kInvalidArgument,
                   "local GPU aggregation: CUDA device ordinal {} is negative", d);
    }
    if (d >= count) {
      return Error(StatusCode::kUnavailable,
                   "local GPU aggregation: asked for CUDA devices [{}] but only {} device(s) are "
                   "visible (ordinals 0..{}); check CUDA_VISIBLE_DEVICES, or ask for fewer",
                   fmt::join(devices, ", "), count, count - 1);
    }
    if (std::find(seen.begin(), seen.end(), d) != seen.end()) {
      return Error(StatusCode::kInvalidArgument,
                   "local GPU aggregation: CUDA device {} is listed twice (NCCL runs one rank "
                   "per GPU)",
                   d);
    }
    seen.push_back(d);
  }
  bool nccl_avg = false;
#if DSYNC_NCCL_HAS_AVG
  // The library loaded at run time may be older than the header built against.
  int version = 0;
  nccl_avg = ncclGetVersion(&version) == ncclSuccess && version >= NCCL_VERSION(2, 10, 0);
#endif
  auto group = std::make_unique<NcclGroup>(worker, std::move(devices), options.reduce, nccl_avg);
  DSYNC_RETURN_IF_ERROR(group->Init().WithContext("local GPU aggregation"));
  return std::unique_ptr<LocalGpuGroup>(std::move(group));
}

}  // namespace dsync
