#include "cuda/cuda_store.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <iterator>
#include <shared_mutex>
#include <vector>

#include "cuda/apply_kernels.h"
#include "cuda/cuda_device_memory.h"
#include "cuda/cuda_util.h"
#include "ps/optimizer.h"
#include "ps/slice_table.h"
#include "ps/trace.h"
#include "ps/version_ring.h"

namespace dsync::cuda {
namespace {

using ps::SliceKey;

Update UpdateOf(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSum: return Update::kSum;
    case OptimizerKind::kSgd: return Update::kSgd;
    case OptimizerKind::kMomentum: return Update::kMomentum;
    case OptimizerKind::kAdam: return Update::kAdam;
    case OptimizerKind::kAdamW: return Update::kAdamW;
  }
  return Update::kSgd;
}

struct Slice {
  uint64_t n = 0;
  DeviceBuffer params;
  // momentum: buf; adam, adamw: m, v (allocated, zeroed, on first use)
  DeviceBuffer state[ps::kMaxStateArrays];
  uint64_t steps = 0;
  // Delay compensation: the versions kept, ring.depth() rows GradientStride(n) floats apart.
  ps::VersionRing ring;
  DeviceBuffer kept;
  DeviceBuffer mean_square;      // the adaptive form's, n floats (null: none)
  std::vector<int32_t> rows_of;  // per gradient of the round applied: its kept row, or -1
};


// What one call uses: a stream, and the scratch a round copies gradients into. A call holds
// its lane alone, so rounds and reads issued by different threads at once (the server's
// apply thread, its transport threads answering pulls) overlap on the device instead of
// queueing behind one stream.
struct Lane {
  cudaStream_t stream = nullptr;
  DeviceBuffer scratch;
  uint64_t scratch_floats = 0;
  ~Lane() {
    if (stream) (void)cudaStreamDestroy(stream);
  }
};

class CudaStore final : public ps::ParamStore {
 public:
  // The device current at creation holds every slice; each entry point selects it, since a
  // calling thread may have another device current (a worker's GPUs, NCCL).
  explicit CudaStore(int device) : device_(device), device_memory_(device) {}

  std::string_view name() const override { return "cuda"; }

  // Pinned: host-to-device copies from it run asynchronously and at full PCIe/NVLink speed
  // (CUDA C++ Programming Guide, "Page-Locked Host Memory").
  void* AllocateHost(size_t bytes) override {
    void* p = nullptr;
    if (cudaMallocHost(&p, std::max<size_t>(bytes, 1)) == cudaSuccess) return p;
    (void)cudaGetLastError();  // the caller sees nullptr; leave no error behind for others
    return nullptr;
  }
  void FreeHost(void* ptr, size_t /*bytes*/) override { (void)cudaFreeHost(ptr); }

  // GPUDirect RDMA: buffers the NIC fills and reads directly. Every copy below uses
  // cudaMemcpyDefault (unified addressing tells host from device), so a gradient, initial
  // value or pull destination may be either kind.
  void* AllocateDevice(size_t bytes) override {
    if (cudaSetDevice(device_) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return device_memory_.Allocate(bytes);
  }
  void FreeDevice(void* ptr, size_t /*bytes*/) override {
    (void)cudaSetDevice(device_);
    device_memory_.Free(ptr);
  }
  const ps::DeviceMemory* device_memory() const override { return &device_memory_; }

  Status InitSlice(SliceKey key, std::span<const float> init) override {
    if (HasSlice(key)) {  // before allocating and copying a whole slice for nothing
      return Error(StatusCode::kAlreadyExists, "slice {:#x} already exists", key);
    }
    DSYNC_ASSIGN_OR_RETURN(LaneLease lane, TakeLane());
    auto slice = std::make_unique<Slice>();
    slice->n = init.size();
    DSYNC_ASSIGN_OR_RETURN(slice->params, DeviceAlloc(init.size(), "allocating a slice"));
    const float* input = init.data();
    DSYNC_RETURN_IF_ERROR(device_memory_.FlushBeforeReading({&input, 1}, init.size_bytes()));
    DSYNC_CUDA_RETURN(cudaMemcpyAsync(slice->params.get(), init.data(), init.size_bytes(),
                                      cudaMemcpyDefault, lane->stream),
                      "copying a slice's initial values");
    DSYNC_CUDA_RETURN(cudaStreamSynchronize(lane->stream), "initializing a slice");
    return slices_.Insert(key, std::move(slice));
  }

  bool HasSlice(SliceKey key) const override { return slices_.Find(key) != nullptr; }

  uint64_t SliceElements(SliceKey key) const override { return slices_.Elements(key); }

  using ParamStore::ApplyRound;
  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    std::span<const float> weights, const ps::Compensation& comp,
                    const OptimizerConfig& opt) override {
    DSYNC_ASSIGN_OR_RETURN(Slice * s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::CheckRoundWeights(grads.size(), weights.size()));
    DSYNC_RETURN_IF_ERROR(ps::CheckCompensation(grads.size(), comp));
    const bool adaptive = comp.adaptive && comp.depth > 0;
    if (comp.depth == s->ring.depth() && adaptive == static_cast<bool>(s->mean_square) &&
        grads.empty()) {
      return Status::Ok();
    }
    DSYNC_ASSIGN_OR_RETURN(LaneLease lane, TakeLane());
    if (comp.depth != s->ring.depth()) DSYNC_RETURN_IF_ERROR(Relayout(*s, comp.depth, lane.get()));
    if (adaptive && !s->mean_square) {
      DSYNC_ASSIGN_OR_RETURN(DeviceBuffer ms, DeviceAlloc(s->n, "allocating the mean square"));
      DSYNC_CUDA_RETURN(cudaMemsetAsync(ms.get(), 0, s->n * sizeof(float), lane->stream),
                        "zeroing the mean square");
      DSYNC_CUDA_RETURN(cudaStreamSynchronize(lane->stream), "zeroing the mean square");
      s->mean_square = std::move(ms);
    } else if (!adaptive) {
      s->mean_square.reset();
    }
    if (grads.empty()) return Status::Ok();
    DSYNC_RETURN_IF_ERROR(device_memory_.FlushBeforeReading(grads, s->n * sizeof(float)));
    const uint32_t slots = ps::OptimizerStateSlots(opt.kind);
    for (uint32_t i = 0; i < slots; ++i) {
      if (!s->state[i]) {
        // Zeroed before it joins the slice: a failure leaves no half-made state behind.
        DSYNC_ASSIGN_OR_RETURN(DeviceBuffer state, DeviceAlloc(s->n, "allocating optimizer state"));
        // On the lane's stream (non-blocking streams do not wait for the legacy default
        // stream), and waited for: this happens once per slice.
        DSYNC_CUDA_RETURN(cudaMemsetAsync(state.get(), 0, s->n * sizeof(float), lane->stream),
                          "zeroing optimizer state");
        DSYNC_CUDA_RETURN(cudaStreamSynchronize(lane->stream), "zeroing optimizer state");
        s->state[i] = std::move(state);
      }
    }
    // Every row is looked up before the round's own is taken, which may be one of them.
    const bool corrects = s->ring.RowsFor(comp, grads.size(), s->rows_of);
    KernelCompensation kc;
    if (s->ring.depth() > 0) {
      kc.kept = s->kept.get();
      kc.row_stride = GradientStride(s->n);
      kc.keep = s->ring.RowToKeep();  // recorded once the round ran
      kc.lambda = comp.lambda;
      kc.mean_square = s->mean_square.get();
    }
    // Once anything is queued on the stream, it is synchronized before returning, error or
    // not: the caller reuses the host gradient buffers as soon as this returns.
    const Status queued = EnqueueRound(s, lane.get(), grads, weights,
                                       corrects ? std::span<const int32_t>(s->rows_of)
                                                : std::span<const int32_t>(),
                                       kc, opt);
    const cudaError_t synced = cudaStreamSynchronize(lane->stream);
    DSYNC_RETURN_IF_ERROR(queued);
    if (synced != cudaSuccess) return CudaError(synced, "applying a round");
    ++s->steps;  // counted only once applied: adam's bias correction depends on it
    s->ring.Kept(kc.keep, comp.round);
    return Status::Ok();
  }

  // Copies the round's gradients to the device and launches the update, on the lane's
  // stream; the caller synchronizes.
  Status EnqueueRound(const Slice* s, Lane* lane, std::span<const float* const> grads,
                      std::span<const float> weights, std::span<const int32_t> rows,
                      KernelCompensation comp, const OptimizerConfig& opt) {
    // Padded so that every gradient slot keeps the kernel's 16-byte loads aligned.
    const uint64_t stride = GradientStride(s->n);
    // Where the weights, if any, go in the scratch: behind the gradients; the compensated
    // gradients' rows, if any, behind them (int32 in float-sized places).
    const uint64_t weights_at = stride * grads.size();
    const uint64_t rows_at = weights_at + weights.size();
    static_assert(sizeof(int32_t) == sizeof(float));
    {
      // Enqueue only; nsys projects the range onto the stream that runs the copies.
      trace::Scoped range(trace::Range::kStoreAggregate);
      // The scratch only grows: in steady state a round allocates nothing.
      const uint64_t need = rows_at + rows.size();
      if (need > lane->scratch_floats) {
        lane->scratch.reset();  // free first: the old and new areas need not coexist
        lane->scratch_floats = 0;
        DSYNC_ASSIGN_OR_RETURN(lane->scratch, DeviceAlloc(need, "allocating gradient scratch"));
        lane->scratch_floats = need;
      }
      for (size_t j = 0; j < grads.size(); ++j) {
        DSYNC_CUDA_RETURN(cudaMemcpyAsync(lane->scratch.get() + j * stride, grads[j],
                                          s->n * sizeof(float), cudaMemcpyDefault,
                                          lane->stream),
                          "copying a gradient to the device");
      }
      if (!weights.empty()) {
        DSYNC_CUDA_RETURN(cudaMemcpyAsync(lane->scratch.get() + weights_at,
                                          weights.data(), weights.size_bytes(),
                                          cudaMemcpyHostToDevice, lane->stream),
                          "copying the gradients' weights to the device");
      }
      if (!rows.empty()) {
        DSYNC_CUDA_RETURN(cudaMemcpyAsync(lane->scratch.get() + rows_at, rows.data(),
                                          rows.size_bytes(), cudaMemcpyHostToDevice,
                                          lane->stream),
                          "copying the kept rows of stale gradients to the device");
        // Device memory from cudaMalloc has no declared type; the kernel reads these as int32.
        comp.rows = reinterpret_cast<const int32_t*>(lane->scratch.get() + rows_at);
      }
    }
    trace::Scoped range(trace::Range::kStoreApply);
    const ps::OptimizerScalars sc =
        ps::MakeOptimizerScalars(opt, s->steps + 1, static_cast<uint32_t>(grads.size()));
    DSYNC_CUDA_RETURN(LaunchApplyRound(UpdateOf(opt.kind), s->params.get(), s->state[0].get(),
                                       s->state[1].get(), lane->scratch.get(),
                                       weights.empty() ? nullptr : lane->scratch.get() + weights_at,
                                       comp, static_cast<uint32_t>(grads.size()), stride, s->n, sc,
                                       lane->stream),
                      "launching the update kernel");
    return Status::Ok();
  }

  Status Read(SliceKey key, std::span<float> out) const override {
    DSYNC_ASSIGN_OR_RETURN(const Slice* s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::SliceTable<Slice>::CheckReadSize(key, out.size(), s->n));
    trace::Scoped range(trace::Range::kStoreRead);
    DSYNC_ASSIGN_OR_RETURN(LaneLease lane, TakeLane());
    const cudaError_t copied = cudaMemcpyAsync(out.data(), s->params.get(),
                                               s->n * sizeof(float), cudaMemcpyDefault,
                                               lane->stream);
    const cudaError_t synced = cudaStreamSynchronize(lane->stream);  // even if the copy failed
    DSYNC_CUDA_RETURN(copied, "reading a slice back");
    DSYNC_CUDA_RETURN(synced, "reading a slice back");
    return Status::Ok();
  }

  // On the lane's stream, not with cudaMemcpy: the lanes' non-blocking streams do not wait for
  // the legacy stream, whose copies from pageable memory may return before they are done.
  Status Snapshot(SliceKey key, ps::SliceSnapshot& out) const override {
    DSYNC_ASSIGN_OR_RETURN(const Slice* s, slices_.Get(key));
    DSYNC_ASSIGN_OR_RETURN(LaneLease lane, TakeLane());
    size_t arrays = 0;
    while (arrays < std::size(s->state) && s->state[arrays]) ++arrays;  // allocated in order
    out.params.resize(s->n);
    out.state.resize(arrays);
    cudaError_t copied = cudaMemcpyAsync(out.params.data(), s->params.get(),
                                         s->n * sizeof(float), cudaMemcpyDefault, lane->stream);
    for (size_t i = 0; i < arrays && copied == cudaSuccess; ++i) {
      out.state[i].resize(s->n);
      copied = cudaMemcpyAsync(out.state[i].data(), s->state[i].get(), s->n * sizeof(float),
                               cudaMemcpyDefault, lane->stream);
    }
    const std::vector<uint32_t> kept = s->ring.RowsOldestFirst();
    out.kept.resize(kept.size());
    for (size_t i = 0; i < kept.size() && copied == cudaSuccess; ++i) {
      out.kept[i].round = s->ring.RoundOf(kept[i]);
      out.kept[i].params.resize(s->n);
      copied = cudaMemcpyAsync(out.kept[i].params.data(), Row(*s, kept[i]),
                               s->n * sizeof(float), cudaMemcpyDefault, lane->stream);
    }
    out.mean_square.resize(s->mean_square ? s->n : 0);
    if (s->mean_square && copied == cudaSuccess) {
      copied = cudaMemcpyAsync(out.mean_square.data(), s->mean_square.get(), s->n * sizeof(float),
                               cudaMemcpyDefault, lane->stream);
    }
    const cudaError_t synced = cudaStreamSynchronize(lane->stream);  // even if a copy failed
    DSYNC_CUDA_RETURN(copied, "copying a slice into a snapshot");
    DSYNC_CUDA_RETURN(synced, "copying a slice into a snapshot");
    out.steps = s->steps;
    return Status::Ok();
  }

  Status Restore(SliceKey key, const ps::SliceSnapshot& in) override {
    DSYNC_RETURN_IF_ERROR(ps::CheckSnapshot(key, in));
    if (HasSlice(key)) {  // before allocating and copying a whole slice for nothing
      return Error(StatusCode::kAlreadyExists, "slice {:#x} already exists", key);
    }
    DSYNC_ASSIGN_OR_RETURN(LaneLease lane, TakeLane());
    auto slice = std::make_unique<Slice>();
    slice->n = in.params.size();
    DSYNC_ASSIGN_OR_RETURN(slice->params, DeviceAlloc(slice->n, "allocating a slice"));
    for (size_t i = 0; i < in.state.size(); ++i) {
      DSYNC_ASSIGN_OR_RETURN(slice->state[i],
                             DeviceAlloc(slice->n, "allocating optimizer state"));
    }
    const uint32_t depth = static_cast<uint32_t>(in.kept.size());
    if (depth > 0) {
      DSYNC_ASSIGN_OR_RETURN(slice->kept, DeviceAlloc(depth * GradientStride(slice->n),
                                                      "allocating kept versions"));
      std::vector<uint64_t> rounds;
      for (const ps::KeptVersion& k : in.kept) rounds.push_back(k.round);
      slice->ring.Assign(depth, rounds);
    }
    if (!in.mean_square.empty()) {
      DSYNC_ASSIGN_OR_RETURN(slice->mean_square, DeviceAlloc(slice->n, "allocating the mean square"));
    }
    cudaError_t copied = cudaMemcpyAsync(slice->params.get(), in.params.data(),
                                         slice->n * sizeof(float), cudaMemcpyDefault,
                                         lane->stream);
    for (size_t i = 0; i < in.state.size() && copied == cudaSuccess; ++i) {
      copied = cudaMemcpyAsync(slice->state[i].get(), in.state[i].data(),
                               slice->n * sizeof(float), cudaMemcpyDefault, lane->stream);
    }
    for (uint32_t i = 0; i < depth && copied == cudaSuccess; ++i) {
      copied = cudaMemcpyAsync(Row(*slice, i), in.kept[i].params.data(), slice->n * sizeof(float),
                               cudaMemcpyDefault, lane->stream);
    }
    if (slice->mean_square && copied == cudaSuccess) {
      copied = cudaMemcpyAsync(slice->mean_square.get(), in.mean_square.data(),
                               slice->n * sizeof(float), cudaMemcpyDefault, lane->stream);
    }
    // Even if a copy failed: nothing may still read `in` once this returns.
    const cudaError_t synced = cudaStreamSynchronize(lane->stream);
    DSYNC_CUDA_RETURN(copied, "copying a snapshot to the device");
    DSYNC_CUDA_RETURN(synced, "restoring a slice");
    slice->steps = in.steps;
    return slices_.Insert(key, std::move(slice));
  }

 private:
  static float* Row(const Slice& s, uint32_t row) {
    return s.kept.get() + static_cast<uint64_t>(row) * GradientStride(s.n);
  }

  // Lays the kept versions out in `depth` rows, keeping the newest (a job's depth is fixed, so
  // this runs when a slice first sees it, or after a Restore). Synchronous: it happens once.
  Status Relayout(Slice& s, uint32_t depth, Lane* lane) {
    DeviceBuffer rows;
    if (depth > 0) {
      DSYNC_ASSIGN_OR_RETURN(rows, DeviceAlloc(depth * GradientStride(s.n), "allocating kept versions"));
    }
    std::vector<uint64_t> rounds;
    const std::vector<uint32_t> keep = s.ring.RowsKeptAt(depth);
    for (size_t i = 0; i < keep.size(); ++i) {
      DSYNC_CUDA_RETURN(cudaMemcpyAsync(rows.get() + i * GradientStride(s.n), Row(s, keep[i]),
                                        s.n * sizeof(float), cudaMemcpyDeviceToDevice,
                                        lane->stream),
                        "moving kept versions");
      rounds.push_back(s.ring.RoundOf(keep[i]));
    }
    DSYNC_CUDA_RETURN(cudaStreamSynchronize(lane->stream), "moving kept versions");
    s.kept = std::move(rows);
    s.ring.Assign(depth, rounds);
    return Status::Ok();
  }

  void ReturnLane(std::unique_ptr<Lane> lane) const {
    std::lock_guard lock(lanes_mu_);
    idle_lanes_.push_back(std::move(lane));
  }

  // A lane for the length of one call: an idle one, or a new one when every lane is busy.
  // Lanes are shared by calls, not owned by threads: a thread per reconnecting worker would
  // otherwise leave a stream behind each. Lanes therefore number the most calls ever in
  // flight at once. Handing a lane to another thread is safe even with work still queued on
  // it: the stream orders that work before the next call's.
  class LaneLease {
   public:
    LaneLease(const CudaStore* store, std::unique_ptr<Lane> lane)
        : store_(store), lane_(std::move(lane)) {}
    LaneLease(LaneLease&&) = default;
    LaneLease& operator=(LaneLease&&) = delete;
    ~LaneLease() {
      if (lane_) store_->ReturnLane(std::move(lane_));
    }
    Lane* operator->() const { return lane_.get(); }
    Lane* get() const { return lane_.get(); }

   private:
    const CudaStore* store_;
    std::unique_ptr<Lane> lane_;
  };

  Result<LaneLease> TakeLane() const {
    DSYNC_CUDA_RETURN(cudaSetDevice(device_), "selecting the store's GPU");
    {
      std::lock_guard lock(lanes_mu_);
      if (!idle_lanes_.empty()) {
        std::unique_ptr<Lane> lane = std::move(idle_lanes_.back());
        idle_lanes_.pop_back();
        return LaneLease(this, std::move(lane));
      }
    }
    auto fresh = std::make_unique<Lane>();
    DSYNC_CUDA_RETURN(cudaStreamCreateWithFlags(&fresh->stream, cudaStreamNonBlocking),
                      "creating a CUDA stream");
    return LaneLease(this, std::move(fresh));
  }

  const int device_;
  CudaDeviceMemory device_memory_;
  ps::SliceTable<Slice> slices_;
  mutable std::mutex lanes_mu_;
  mutable std::vector<std::unique_ptr<Lane>> idle_lanes_;
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
  int device = 0;
  DSYNC_CUDA_RETURN(cudaGetDevice(&device), "finding the current GPU");
  return std::unique_ptr<ps::ParamStore>(std::make_unique<CudaStore>(device));
}

}  // namespace dsync::cuda
