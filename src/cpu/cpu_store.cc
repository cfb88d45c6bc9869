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
#include "ps/version_ring.h"

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
  // Delay compensation: the versions kept, ring.depth() rows of n floats.
  ps::VersionRing ring;
  FloatBuffer kept;
  FloatBuffer mean_square;       // the adaptive form's, n floats (null: none)
  std::vector<int32_t> rows_of;  // per gradient of the round applied: its kept row, or -1
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
                    std::span<const float> weights, const ps::Compensation& comp,
                    const OptimizerConfig& opt) override {
    DSYNC_ASSIGN_OR_RETURN(Slice * s, slices_.Get(key));
    DSYNC_RETURN_IF_ERROR(ps::CheckRoundWeights(grads.size(), weights.size()));
    DSYNC_RETURN_IF_ERROR(ps::CheckCompensation(grads.size(), comp));
    if (comp.depth != s->ring.depth()) DSYNC_RETURN_IF_ERROR(Relayout(*s, comp.depth));
    const bool adaptive = comp.adaptive && comp.depth > 0;
    if (adaptive && !s->mean_square) {
      s->mean_square = AllocFloats(s->n, true);
      if (!s->mean_square) return Error(StatusCode::kUnavailable, "out of host memory for the mean square");
    } else if (!adaptive) {
      s->mean_square.reset();
    }
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
    const bool corrects = s->ring.RowsFor(comp, grads.size(), s->rows_of);
    const int32_t keep = s->ring.RowToKeep();
    s->ring.Kept(keep, comp.round);  // nothing below fails
    ++s->steps;
    const ps::OptimizerScalars sc =
        ps::MakeOptimizerScalars(opt, s->steps, static_cast<uint32_t>(grads.size()));
    float sum[kBlock];
    for (uint64_t base = 0; base < s->n; base += kBlock) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kBlock, s->n - base));
      float* w = s->params.get() + base;
      if (corrects || s->mean_square) {
        SumCorrected(*s, grads, weights, comp.lambda, base, len, sum);
      } else if (weights.empty()) {
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
      // After the sum read the rows: the kept row may be the one a gradient was corrected toward.
      if (keep >= 0) std::memcpy(Row(*s, keep) + base, w, len * sizeof(float));
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
    out.kept.clear();
    for (uint32_t row : s->ring.RowsOldestFirst()) {
      const float* r = Row(*s, static_cast<int32_t>(row));
      out.kept.push_back({s->ring.RoundOf(row), std::vector<float>(r, r + s->n)});
    }
    out.mean_square.clear();
    if (s->mean_square) out.mean_square.assign(s->mean_square.get(), s->mean_square.get() + s->n);
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
    if (!in.kept.empty()) {
      const uint32_t depth = static_cast<uint32_t>(in.kept.size());
      slice->kept = AllocFloats(depth * slice->n, false);
      if (!slice->kept) return Error(StatusCode::kUnavailable, "out of host memory for kept versions");
      std::vector<uint64_t> rounds;
      for (uint32_t i = 0; i < depth; ++i) {
        std::memcpy(slice->kept.get() + i * slice->n, in.kept[i].params.data(),
                    slice->n * sizeof(float));
        rounds.push_back(in.kept[i].round);
      }
      slice->ring.Assign(depth, rounds);
    }
    if (!in.mean_square.empty()) {
      slice->mean_square = AllocFloats(slice->n, false);
      if (!slice->mean_square) return Error(StatusCode::kUnavailable, "out of host memory for the mean square");
      std::memcpy(slice->mean_square.get(), in.mean_square.data(), slice->n * sizeof(float));
    }
    return slices_.Insert(key, std::move(slice));
  }

 private:
  static float* Row(const Slice& s, int32_t row) {
    return s.kept.get() + static_cast<uint64_t>(row) * s.n;
  }

  // The round's sum over one block with stale gradients corrected (ps::Compensate) toward the
  // parameters before the round, each then weighed as without correction; with the adaptive
  // form, each gradient first updates the mean square its correction divides by.
  static void SumCorrected(const Slice& s, std::span<const float* const> grads,
                           std::span<const float> weights, float lambda, uint64_t base,
                           size_t len, float* sum) {
    const float* w = s.params.get() + base;
    float* ms = s.mean_square ? s.mean_square.get() + base : nullptr;
    for (size_t k = 0; k < grads.size(); ++k) {
      const float* g = grads[k] + base;
      const float* h = s.rows_of[k] >= 0 ? Row(s, s.rows_of[k]) + base : nullptr;
      if (ms) {
        for (size_t i = 0; i < len; ++i) ms[i] = ps::MeanSquareStep(ms[i], g[i]);
      }
      for (size_t i = 0; i < len; ++i) {
        float gi = g[i];
        if (h) {  // the square root only for a gradient it corrects
          gi = ps::Compensate(gi, w[i], h[i], ms ? ps::AdaptiveLambda(lambda, ms[i]) : lambda);
        }
        if (k == 0) {
          sum[i] = weights.empty() ? gi : ps::WeighFirst(gi, weights[0]);
        } else {
          sum[i] = weights.empty() ? sum[i] + gi : ps::AddWeighed(sum[i], gi, weights[k]);
        }
      }
    }
  }

  // Lays the kept versions out in `depth` rows, keeping the newest (a job's depth is fixed, so
  // this runs when a slice first sees it, or after a Restore).
  static Status Relayout(Slice& s, uint32_t depth) {
    FloatBuffer rows;
    if (depth > 0) {
      rows = AllocFloats(depth * s.n, false);
      if (!rows) return Error(StatusCode::kUnavailable, "out of host memory for kept versions");
    }
    std::vector<uint64_t> rounds;
    const std::vector<uint32_t> keep = s.ring.RowsKeptAt(depth);
    for (size_t i = 0; i < keep.size(); ++i) {
      std::memcpy(rows.get() + i * s.n, Row(s, static_cast<int32_t>(keep[i])), s.n * sizeof(float));
      rounds.push_back(s.ring.RoundOf(keep[i]));
    }
    s.kept = std::move(rows);
    s.ring.Assign(depth, rounds);
    return Status::Ok();
  }

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
