#include "cpu/cpu_store.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "ps/optimizer.h"
#include "ps/slice_table.h"
#include "ps/trace.h"

namespace dsync::cpu {
namespace {

using ps::SliceKey;

constexpr size_t kPage = 4096;
// Gradients are summed block by block in a stack buffer that stays in L1/L2, then the
// optimizer runs over the block: one pass over the parameters, same order of additions as
// summing whole gradients one after another (so the result is bit-identical to that).
constexpr size_t kBlock = 2048;

size_t RoundUpToPage(size_t n) { return (n + kPage - 1) / kPage * kPage; }

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuffer = std::unique_ptr<float[], FreeDeleter>;

FloatBuffer AllocFloats(size_t n, bool zero) {
  auto* p = static_cast<float*>(std::aligned_alloc(kPage, RoundUpToPage(std::max<size_t>(n, 1) * sizeof(float))));
  if (p && zero) std::memset(p, 0, n * sizeof(float));
  return FloatBuffer(p);
}

struct Slice {
  uint64_t n = 0;
  FloatBuffer params;
  // momentum: buf; adam, adamw: m, v (allocated on first use)
  FloatBuffer state[ps::kMaxStateArrays];
  uint64_t steps = 0;    // updates applied (adam's t; momentum's first step is 1)
};

class CpuStore final : public ps::ParamStore {
 public:
  std::string_view name() const override { return "cpu"; }

  void* AllocateHost(size_t bytes) override {
    return std::aligned_alloc(kPage, RoundUpToPage(std::max<size_t>(bytes, 1)));
  }
  void FreeHost(void* ptr, size_t /*bytes*/) override { std::free(ptr); }

  Status InitSlice(SliceKey key, std::span<const float> init) override {
    DSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Slice> slice, NewSlice(init));
    return slices_.Insert(key, std::move(slice));
  }

  bool HasSlice(SliceKey key) const override { return slices_.Find(key) != nullptr; }

  uint64_t SliceElements(SliceKey key) const override { return slices_.Elements(key); }

  using ParamStore::ApplyRound;
  Status ApplyRound(SliceKey key, std::span<const float* const> grads,
                    std::span<const float> weights, const OptimizerConfig& opt) override {
    DSYNC_ASSIGN_OR_RETURN(Slice * s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::CheckRoundWeights(grads.size(), weights.size()));
    if (grads.empty()) return Status::Ok();
    // One range: the sum is fused with the update block by block (no separate aggregate).
    trace::Scoped range(trace::Range::kStoreApply);
    const uint32_t slots = ps::OptimizerStateSlots(opt.kind);
    for (uint32_t i = 0; i < slots; ++i) {
      if (!s->state[i]) {
        s->state[i] = AllocFloats(s->n, true);
        if (!s->state[i]) return Error(StatusCode::kUnavailable, "out of host memory for optimizer state");
      }
    }
    ++s->steps;
    const ps::OptimizerScalars sc =
        ps::MakeOptimizerScalars(opt, s->steps, static_cast<uint32_t>(grads.size()));
    float sum[kBlock];
    for (uint64_t base = 0; base < s->n; base += kBlock) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kBlock, s->n - base));
      if (weights.empty()) {
        std::memcpy(sum, grads[0] + base, len * sizeof(float));
        for (size_t k = 1; k < grads.size(); ++k) {
          const float* g = grads[k] + base;
          for (size_t i = 0; i < len; ++i) sum[i] += g[i];
        }
      } else {
        const float* g0 = grads[0] + base;
        for (size_t i = 0; i < len; ++i) sum[i] = ps::WeighFirst(g0[i], weights[0]);
        for (size_t k = 1; k < grads.size(); ++k) {
          const float* g = grads[k] + base;
          for (size_t i = 0; i < len; ++i) sum[i] = ps::AddWeighed(sum[i], g[i], weights[k]);
        }
      }
      float* w = s->params.get() + base;
      switch (opt.kind) {
        case OptimizerKind::kSum:
          for (size_t i = 0; i < len; ++i) ps::SumStep(w[i], sum[i]);
          break;
        case OptimizerKind::kSgd:
          for (size_t i = 0; i < len; ++i) ps::SgdStep(w[i], sum[i], sc);
          break;
        case OptimizerKind::kMomentum: {
          float* v = s->state[0].get() + base;
          for (size_t i = 0; i < len; ++i) ps::MomentumStep(w[i], v[i], sum[i], sc);
          break;
        }
        case OptimizerKind::kAdam: {
          float* m = s->state[0].get() + base;
          float* v = s->state[1].get() + base;
          for (size_t i = 0; i < len; ++i) ps::AdamStep(w[i], m[i], v[i], sum[i], sc);
          break;
        }
        case OptimizerKind::kAdamW: {
          float* m = s->state[0].get() + base;
          float* v = s->state[1].get() + base;
          for (size_t i = 0; i < len; ++i) ps::AdamWStep(w[i], m[i], v[i], sum[i], sc);
          break;
        }
      }
    }
    return Status::Ok();
  }

  Status Read(SliceKey key, std::span<float> out) const override {
    DSYNC_ASSIGN_OR_RETURN(const Slice* s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::SliceTable<Slice>::CheckReadSize(key, out.size(), s->n));
    trace::Scoped range(trace::Range::kStoreRead);
    std::memcpy(out.data(), s->params.get(), s->n * sizeof(float));
    return Status::Ok();
  }

  Status Snapshot(SliceKey key, ps::SliceSnapshot& out) const override {
    DSYNC_ASSIGN_OR_RETURN(const Slice* s, slices_.Get(key));
    out.params.assign(s->params.get(), s->params.get() + s->n);
    out.state.clear();
    for (const FloatBuffer& state : s->state) {
      if (!state) break;  // allocated in order: momentum's one, adam's two
      out.state.emplace_back(state.get(), state.get() + s->n);
    }
    out.steps = s->steps;
    return Status::Ok();
  }

  Status Restore(SliceKey key, const ps::SliceSnapshot& in) override {
    DSYNC_RETURN_IF_ERROR(ps::CheckSnapshot(key, in));
    DSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Slice> slice, NewSlice(in.params));
    for (size_t i = 0; i < in.state.size(); ++i) {
      slice->state[i] = AllocFloats(slice->n, false);
      if (!slice->state[i]) {
        return Error(StatusCode::kUnavailable, "out of host memory for optimizer state");
      }
      std::memcpy(slice->state[i].get(), in.state[i].data(), slice->n * sizeof(float));
    }
    slice->steps = in.steps;
    return slices_.Insert(key, std::move(slice));
  }

 private:
  // A slice holding `init`, not yet in the table.
  static Result<std::unique_ptr<Slice>> NewSlice(std::span<const float> init) {
    auto slice = std::make_unique<Slice>();
    slice->n = init.size();
    slice->params = AllocFloats(init.size(), false);
    if (!slice->params) {
      return Error(StatusCode::kUnavailable, "out of host memory for a slice of {} floats",
                   init.size());
    }
    std::memcpy(slice->params.get(), init.data(), init.size_bytes());
    return slice;
  }

  ps::SliceTable<Slice> slices_;
};

}  // namespace

std::unique_ptr<ps::ParamStore> MakeCpuStore() { return std::make_unique<CpuStore>(); }

}  // namespace dsync::cpu
