// The fused update kernel's per-thread work (cuda/apply_thread.h), emulated on the host for
// whole grids: the float4 path, its scalar tail and the scalar fallback must give results
// bit-identical to a plain loop over the ps/optimizer_math.h steps, update every element
// exactly once and touch nothing else. Runs without a GPU. The CudaApplyKernels case then
// checks, where a device is visible, that the two paths agree bit for bit on the device too.
#include <gtest/gtest.h>

#include "random_inputs.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cuda/apply_kernels.h"
#include "cuda/apply_thread.h"
#include "ps/optimizer_math.h"

namespace dsync::cuda {

// Found by argument-dependent lookup, so it lives in Update's namespace: readable test names.
void PrintTo(Update u, std::ostream* os);

namespace {

constexpr uint64_t kSizes[] = {1, 3, 4, 5, 1023, 4097, 100003};
constexpr uint64_t kGrids[] = {1, 3, 256, 1000};
constexpr uint32_t kMaxGrads = 3;
// Delay compensation: 3 kept rows; gradient 0 is fresh, 1 is corrected toward row 0, 2 toward
// row 2, which is also the row the round keeps w in (read before it is overwritten).
constexpr uint32_t kKeptRows = 3;
const int32_t kRowsOf[kMaxGrads] = {-1, 0, 2};
constexpr int32_t kKeepRow = 2;
constexpr float kLambda = 0.5f;
constexpr size_t kGuard = 8;  // floats before and after every array; 32 bytes keep alignment
// Around w and the state arrays: finite, so that any update of a guard changes its bits.
const float kGuardValue = -7777.0f;
// Around and between the gradients: reading one poisons the sum.
const float kPoison = std::bit_cast<float>(0x7fc0dead);

const char* Name(Update u) {
  switch (u) {
    case Update::kSum: return "sum";
    case Update::kSgd: return "sgd";
    case Update::kMomentum: return "momentum";
    case Update::kAdam: return "adam";
    case Update::kAdamW: return "adamw";
  }
  return "?";
}

int StateArraysOf(Update u) {
  return u == Update::kAdam || u == Update::kAdamW ? 2 : u == Update::kMomentum ? 1 : 0;
}

ps::OptimizerScalars Scalars(uint32_t k) {
  ps::OptimizerScalars s;
  s.lr = 0.01f;
  s.momentum = 0.9f;
  s.beta1 = 0.9f;
  s.beta2 = 0.999f;
  s.eps = 1e-8f;
  s.weight_decay = 0.01f;
  s.dampening_keep = 0.75f;
  s.one_minus_beta1 = 0.1f;
  s.one_minus_beta2 = 0.001f;
  s.count = static_cast<float>(k);
  s.step_size = 0.01f / (1.0f - 0.9f * 0.9f * 0.9f);  // step 3
  s.bias_correction2_sqrt = sqrtf(1.0f - 0.999f * 0.999f * 0.999f);
  s.decoupled_decay = 1.0f - 0.01f * 0.01f;
  return s;
}

using dsync::testing::Random;

// Inputs for the largest size; smaller sizes use prefixes.
struct Inputs {
  std::vector<float> w, s0, s1;
  std::vector<float> g[kMaxGrads];
  std::vector<float> kept[kKeptRows];
  std::vector<float> mean_square;
};

// Without delay compensation, with DC-ASGD's constant form, with its adaptive form.
enum class Dc { kNone, kConstant, kAdaptive };
const char* DcName(Dc dc) {
  return dc == Dc::kNone ? "" : dc == Dc::kConstant ? ", compensated" : ", adaptive";
}

const Inputs& TheInputs() {
  static const Inputs in = [] {
    const size_t n = kSizes[std::size(kSizes) - 1];
    Inputs x;
    x.w = Random(n, 1, -2.0f, 2.0f);
    x.s0 = Random(n, 2, -2.0f, 2.0f);
    x.s1 = Random(n, 3, 0.01f, 2.0f);  // adam's second moment is never negative
    for (uint32_t j = 0; j < kMaxGrads; ++j) x.g[j] = Random(n, 10 + j, -2.0f, 2.0f);
    for (uint32_t r = 0; r < kKeptRows; ++r) x.kept[r] = Random(n, 20 + r, -2.0f, 2.0f);
    x.mean_square = Random(n, 30, 0.0f, 2.0f);
    return x;
  }();
  return in;
}

// The reference: a plain loop calling ps/optimizer_math.h directly, not apply_thread.h.
struct Expected {
  std::vector<float> w, s0, s1;
  std::vector<float> kept[kKeptRows];
  std::vector<float> mean_square;
};

// Staleness weights for up to kMaxGrads gradients: inverse's 1/(1+s) for s = 0, 1, 2.
const float kWeights[kMaxGrads] = {1.0f, 0.5f, static_cast<float>(1.0 / 3.0)};

// `weights`: null, or one per gradient (the round's sum weighs each gradient by its weight).
// With compensation, gradient j is corrected toward kept row kRowsOf[j] and w kept in row
// kKeepRow; adaptive, each gradient first enters the element's mean square, which divides L.
Expected Reference(Update u, uint64_t n, uint32_t k, const ps::OptimizerScalars& sc,
                   const float* weights = nullptr, Dc dc = Dc::kNone) {
  const bool compensated = dc != Dc::kNone;
  const Inputs& in = TheInputs();
  Expected e;
  e.w.assign(in.w.begin(), in.w.begin() + n);
  e.s0.assign(in.s0.begin(), in.s0.begin() + n);
  e.s1.assign(in.s1.begin(), in.s1.begin() + n);
  for (uint32_t r = 0; r < kKeptRows; ++r) e.kept[r].assign(in.kept[r].begin(), in.kept[r].begin() + n);
  e.mean_square.assign(in.mean_square.begin(), in.mean_square.begin() + n);
  for (uint64_t i = 0; i < n; ++i) {
    const auto term = [&](uint32_t j) {
      const float g = in.g[j][i];
      float lambda = kLambda;
      if (dc == Dc::kAdaptive) {
        e.mean_square[i] = ps::kMeanSquareDecay * e.mean_square[i] + ps::kMeanSquareKeep * g * g;
        lambda = kLambda / sqrtf(e.mean_square[i] + ps::kMeanSquareEps);
      }
      if (!compensated || kRowsOf[j] < 0) return g;
      return g + lambda * g * g * (in.w[i] - in.kept[kRowsOf[j]][i]);
    };
    float sum = weights ? weights[0] * term(0) : term(0);
    for (uint32_t j = 1; j < k; ++j) sum += weights ? weights[j] * term(j) : term(j);
    if (compensated) e.kept[kKeepRow][i] = in.w[i];
    switch (u) {
      case Update::kSum: ps::SumStep(e.w[i], sum); break;
      case Update::kSgd: ps::SgdStep(e.w[i], sum, sc); break;
      case Update::kMomentum: ps::MomentumStep(e.w[i], e.s0[i], sum, sc); break;
      case Update::kAdam: ps::AdamStep(e.w[i], e.s0[i], e.s1[i], sum, sc); break;
      case Update::kAdamW: ps::AdamWStep(e.w[i], e.s0[i], e.s1[i], sum, sc); break;
    }
  }
  return e;
}

// Floats starting at a 64-byte boundary, so that offsets fix each array's alignment.
class Arena {
 public:
  explicit Arena(size_t n, float fill) : store_(n + 16, fill) {
    const auto addr = reinterpret_cast<uintptr_t>(store_.data());
    base_ = store_.data() + (64 - addr % 64) % 64 / sizeof(float);
  }
  float* at(size_t i) { return base_ + i; }
  float* end() { return store_.data() + store_.size(); }

 private:
  std::vector<float> store_;
  float* base_;
};

// Where each array starts, in floats past a 16-byte boundary, and the gradient stride.
struct Layout {
  const char* name;
  size_t w = 0, s0 = 0, s1 = 0, g = 0;
  int64_t stride_extra = 0;  // added to GradientStride(n); an odd total breaks alignment
  bool null_unused = false;  // pass nullptr for state arrays the update does not use
  size_t kept = 0;           // the kept rows (compensated rounds only)
  size_t mean_square = 0;    // the mean square (adaptive rounds only)
};

const Layout kLayouts[] = {
    {"aligned", 0, 0, 0, 0, 0, true},
    {"aligned, padded stride", 0, 0, 0, 0, 4},
    {"stride not a multiple of 4", 0, 0, 0, 0, 1},
    {"w +1 float", 1, 0, 0, 0, 0},
    {"g +2 floats", 0, 0, 0, 2, 0},
    {"s0 +3 floats", 0, 3, 0, 0, 0},
    {"s1 +1 float", 0, 0, 1, 0, 0},
    {"all +1 float, stride +1", 1, 1, 1, 1, 1},
    {"kept rows +1 float", 0, 0, 0, 0, 0, false, 1},
    {"mean square +2 floats", 0, 0, 0, 0, 0, false, 0, 2},
};

bool ExpectVec4(Update u, const Layout& l, uint32_t k, uint64_t stride, Dc dc) {
  bool ok = l.w == 0 && l.g == 0 && (k == 1 || stride % 4 == 0) &&
            (dc == Dc::kNone || l.kept == 0) && (dc != Dc::kAdaptive || l.mean_square == 0);
  if (StateArraysOf(u) >= 1) ok = ok && l.s0 == 0;
  if (StateArraysOf(u) >= 2) ok = ok && l.s1 == 0;
  return ok;
}

// One array with guards: [guard][offset][n data][guard].
struct Guarded {
  Guarded(const float* init, size_t count, size_t offset, float guard)
      : arena(kGuard + offset + count + kGuard, guard), data(arena.at(kGuard + offset)), n(count) {
    std::copy(init, init + count, data);
  }
  Arena arena;
  float* data;
  size_t n;
};

// The first element whose bits differ, described; empty when all match.
std::string Diff(const char* what, const float* got, const float* want, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      return fmt::format("{}[{}] = {} ({:#010x}), want {} ({:#010x})", what, i, got[i],
                         std::bit_cast<uint32_t>(got[i]), want[i],
                         std::bit_cast<uint32_t>(want[i]));
    }
  }
  return {};
}

std::string GuardsIntact(const char* what, Guarded& a) {
  for (float* p = a.arena.at(0); p != a.arena.end(); ++p) {
    if (p >= a.data && p < a.data + a.n) continue;
    if (std::bit_cast<uint32_t>(*p) != std::bit_cast<uint32_t>(kGuardValue)) {
      return fmt::format("{}: guard at {} written", what, p - a.data);
    }
  }
  return {};
}

// Calls f.template operator()<U>() for the update U that `u` names: the one switch from the
// runtime value to the template argument, for the emulation and the path check alike.
template <class F>
auto WithUpdate(Update u, F&& f) {
  switch (u) {
    case Update::kSum: return f.template operator()<Update::kSum>();
    case Update::kSgd: return f.template operator()<Update::kSgd>();
    case Update::kMomentum: return f.template operator()<Update::kMomentum>();
    case Update::kAdam: return f.template operator()<Update::kAdam>();
    case Update::kAdamW: break;
  }
  return f.template operator()<Update::kAdamW>();
}

// Runs every thread of a `threads`-thread grid, one after another.
void EmulateGrid(Update u, uint64_t threads, float* w, float* s0, float* s1, const float* g,
                 const float* weights, const KernelCompensation& comp, uint32_t k,
                 uint64_t stride, uint64_t n, const ps::OptimizerScalars& sc) {
  WithUpdate(u, [&]<Update U>() {
    for (uint64_t t = 0; t < threads; ++t) {
      ApplyThread<U>(t, threads, w, s0, s1, g, weights, comp, k, stride, n, sc);
    }
  });
}

bool UsesVec4Of(Update u, const float* w, const float* s0, const float* s1, const float* g,
                uint32_t k, uint64_t stride, const KernelCompensation& comp = {}) {
  return WithUpdate(u, [&]<Update U>() { return UsesVec4<U>(w, s0, s1, g, k, stride, comp); });
}

class ApplyThreadEmulation : public ::testing::TestWithParam<Update> {};

TEST_P(ApplyThreadEmulation, EveryGridAndLayoutMatchesThePlainLoopBitForBit) {
  const Update u = GetParam();
  const Inputs& in = TheInputs();
  int vec4_runs = 0, scalar_runs = 0;
  for (uint64_t n : kSizes) {
    for (uint32_t k = 1; k <= kMaxGrads; ++k) {
      const ps::OptimizerScalars sc = Scalars(k);
      // Unweighted, and weighted by staleness; without and with delay compensation: each
      // path must match the plain loop.
      for (const Dc dc : {Dc::kNone, Dc::kConstant, Dc::kAdaptive}) {
      const bool compensated = dc != Dc::kNone;
      // The largest size adds nothing to the compensation's index logic that 4097 does not.
      if (compensated && n > 4097) continue;
      for (const float* weights : {static_cast<const float*>(nullptr), kWeights}) {
        const Expected want = Reference(u, n, k, sc, weights, dc);
        for (const Layout& l : kLayouts) {
          // The same runs as "aligned".
          if ((!compensated && l.kept != 0) || (dc != Dc::kAdaptive && l.mean_square != 0)) continue;
          const uint64_t stride =
              static_cast<uint64_t>(static_cast<int64_t>(GradientStride(n)) + l.stride_extra);
          for (uint64_t threads : kGrids) {
            SCOPED_TRACE(fmt::format("{}: n={} k={} stride={} layout '{}' grid of {} threads{}{}",
                                     Name(u), n, k, stride, l.name, threads,
                                     weights ? ", weighted" : "", DcName(dc)));
            Guarded w(in.w.data(), n, l.w, kGuardValue);
            Guarded s0(in.s0.data(), n, l.s0, kGuardValue);
            Guarded s1(in.s1.data(), n, l.s1, kGuardValue);
            // k gradients `stride` apart; the padding between them is poison too.
            Arena garena(kGuard + l.g + (k - 1) * stride + n + kGuard, kPoison);
            float* g = garena.at(kGuard + l.g);
            for (uint32_t j = 0; j < k; ++j) std::copy(in.g[j].begin(), in.g[j].begin() + n, g + j * stride);
            const std::vector<float> g_before(garena.at(0), garena.end());
            // The kept rows, GradientStride(n) apart as the store lays them out; guards and
            // row padding must come back untouched.
            const uint64_t row_stride = GradientStride(n);
            const uint32_t rows = compensated ? kKeptRows : 0;
            Arena karena(kGuard + l.kept + rows * row_stride + kGuard, kGuardValue);
            float* kept = karena.at(kGuard + l.kept);
            for (uint32_t r = 0; r < rows; ++r) {
              std::copy(in.kept[r].begin(), in.kept[r].begin() + n, kept + r * row_stride);
            }
            KernelCompensation comp;
            if (compensated) {
              comp.kept = kept;
              comp.row_stride = row_stride;
              comp.rows = kRowsOf;
              comp.keep = kKeepRow;
              comp.lambda = kLambda;
            }
            const bool adaptive = dc == Dc::kAdaptive;
            Guarded ms(in.mean_square.data(), adaptive ? n : 0, l.mean_square, kGuardValue);
            if (adaptive) comp.mean_square = ms.data;

            const bool drop0 = l.null_unused && StateArraysOf(u) < 1;
            const bool drop1 = l.null_unused && StateArraysOf(u) < 2;
            float* p0 = drop0 ? nullptr : s0.data;
            float* p1 = drop1 ? nullptr : s1.data;
            const bool vec4 = UsesVec4Of(u, w.data, p0, p1, g, k, stride, comp);
            ASSERT_EQ(vec4, ExpectVec4(u, l, k, stride, dc));
            (vec4 ? vec4_runs : scalar_runs)++;

            EmulateGrid(u, threads, w.data, p0, p1, g, weights, comp, k, stride, n, sc);

            ASSERT_EQ(Diff("w", w.data, want.w.data(), n), "");
            // Unused state arrays must come back as they went in.
            ASSERT_EQ(Diff("s0", s0.data, StateArraysOf(u) >= 1 ? want.s0.data() : in.s0.data(), n), "");
            ASSERT_EQ(Diff("s1", s1.data, StateArraysOf(u) >= 2 ? want.s1.data() : in.s1.data(), n), "");
            ASSERT_EQ(GuardsIntact("w", w), "");
            ASSERT_EQ(GuardsIntact("s0", s0), "");
            ASSERT_EQ(GuardsIntact("s1", s1), "");
            ASSERT_EQ(Diff("gradients", garena.at(0), g_before.data(), g_before.size()), "");
            ASSERT_EQ(Diff("mean square", ms.data, want.mean_square.data(), ms.n), "");
            ASSERT_EQ(GuardsIntact("mean square", ms), "");
            for (uint32_t r = 0; r < rows; ++r) {
              ASSERT_EQ(Diff(fmt::format("kept row {}", r).c_str(), kept + r * row_stride,
                             want.kept[r].data(), n),
                        "");
              for (uint64_t i = n; i < row_stride; ++i) {
                ASSERT_EQ(std::bit_cast<uint32_t>(kept[r * row_stride + i]),
                          std::bit_cast<uint32_t>(kGuardValue)) << "row padding written";
              }
            }
            for (size_t i = 0; i < kGuard + l.kept; ++i) {
              ASSERT_EQ(std::bit_cast<uint32_t>(*karena.at(i)), std::bit_cast<uint32_t>(kGuardValue))
                  << "guard before the kept rows written";
            }
            for (float* p = kept + rows * row_stride; p != karena.end(); ++p) {
              ASSERT_EQ(std::bit_cast<uint32_t>(*p), std::bit_cast<uint32_t>(kGuardValue))
                  << "guard after the kept rows written";
            }
          }
        }
      }
      }
    }
  }
  // Both paths were exercised, not just one.
  EXPECT_GT(vec4_runs, 0);
  EXPECT_GT(scalar_runs, 0);
}

INSTANTIATE_TEST_SUITE_P(AllUpdates, ApplyThreadEmulation,
                         ::testing::Values(Update::kSum, Update::kSgd, Update::kMomentum,
                                           Update::kAdam, Update::kAdamW),
                         [](const ::testing::TestParamInfo<Update>& param) {
                           return std::string(Name(param.param));
                         });

// Write counting: with w = 0, one gradient of ones and the sum update, each time an element
// is handled adds exactly 1.0, so w[i] is the number of times element i was handled.
TEST(ApplyThreadEmulationCount, EveryElementIsHandledExactlyOnce) {
  const ps::OptimizerScalars sc = Scalars(1);
  for (uint64_t n : kSizes) {
    const std::vector<float> zeros(n, 0.0f), ones(n, 1.0f);
    for (size_t off : {size_t{0}, size_t{1}}) {
      for (uint64_t threads : kGrids) {
        SCOPED_TRACE(fmt::format("n={} offset={} grid of {} threads", n, off, threads));
        Guarded w(zeros.data(), n, off, kGuardValue);
        Guarded g(ones.data(), n, off, kGuardValue);
        ASSERT_EQ(UsesVec4<Update::kSum>(w.data, nullptr, nullptr, g.data, 1, n), off == 0);
        EmulateGrid(Update::kSum, threads, w.data, nullptr, nullptr, g.data, nullptr, {}, 1, n, n,
                    sc);
        ASSERT_EQ(Diff("w (times handled)", w.data, ones.data(), n), "");
        ASSERT_EQ(GuardsIntact("w", w), "");
      }
    }
  }
}

// --- on the device, where one is visible --------------------------------------------------

#define ASSERT_CUDA(call)                                                     \
  do {                                                                        \
    const cudaError_t err_ = (call);                                          \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_); \
  } while (0)

struct DeviceArray {
  float* p = nullptr;
  cudaError_t Allocate(uint64_t floats) {
    void* q = nullptr;
    const cudaError_t err = cudaMalloc(&q, floats * sizeof(float));
    p = static_cast<float*>(q);
    return err;
  }
  ~DeviceArray() {
    if (p) (void)cudaFree(p);
  }
};

// The same inputs through the float4 path (cudaMalloc'd arrays, stride GradientStride(n))
// and through the scalar path (every array one float in, stride n + 1): identical bits.
TEST(CudaApplyKernels, Vec4AndScalarPathsAgreeBitForBitOnTheDevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device is visible";
  }
  const Inputs& in = TheInputs();
  for (Update u : {Update::kSum, Update::kSgd, Update::kMomentum, Update::kAdam, Update::kAdamW}) {
    for (uint64_t n : {uint64_t{4097}, uint64_t{100003}}) {
      for (uint32_t k : {1u, 3u}) {
      for (const Dc dc : {Dc::kNone, Dc::kConstant, Dc::kAdaptive}) {
        const bool compensated = dc != Dc::kNone;
        SCOPED_TRACE(fmt::format("{}: n={} k={}{}", Name(u), n, k, DcName(dc)));
        const ps::OptimizerScalars sc = Scalars(k);
        std::vector<float> got[2][5];
        for (int path = 0; path < 2; ++path) {
          const size_t off = path == 0 ? 0 : 1;
          const uint64_t stride = path == 0 ? GradientStride(n) : n + 1;
          const uint64_t row_stride = GradientStride(n);
          DeviceArray w, s0, s1, g, kept, ms;
          for (DeviceArray* a : {&w, &s0, &s1, &ms}) {
            ASSERT_CUDA(a->Allocate(n + 1));
          }
          ASSERT_CUDA(cudaMemcpy(ms.p + off, in.mean_square.data(), n * sizeof(float),
                                 cudaMemcpyHostToDevice));
          ASSERT_CUDA(g.Allocate(k * stride + 1));
          ASSERT_CUDA(kept.Allocate(kKeptRows * row_stride + 1));
          for (uint32_t r = 0; r < kKeptRows; ++r) {
            ASSERT_CUDA(cudaMemcpy(kept.p + off + r * row_stride, in.kept[r].data(),
                                   n * sizeof(float), cudaMemcpyHostToDevice));
          }
          // The rows as the store passes them: int32 in device memory.
          DeviceArray rows;
          ASSERT_CUDA(rows.Allocate(kMaxGrads));
          ASSERT_CUDA(cudaMemcpy(rows.p, kRowsOf, sizeof kRowsOf, cudaMemcpyHostToDevice));
          KernelCompensation comp;
          if (compensated) {
            comp.kept = kept.p + off;
            comp.row_stride = row_stride;
            comp.rows = reinterpret_cast<const int32_t*>(rows.p);
            comp.keep = kKeepRow;
            comp.lambda = kLambda;
          }
          if (dc == Dc::kAdaptive) comp.mean_square = ms.p + off;
          ASSERT_CUDA(cudaMemcpy(w.p + off, in.w.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          ASSERT_CUDA(cudaMemcpy(s0.p + off, in.s0.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          ASSERT_CUDA(cudaMemcpy(s1.p + off, in.s1.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          for (uint32_t j = 0; j < k; ++j) {
            ASSERT_CUDA(cudaMemcpy(g.p + off + j * stride, in.g[j].data(), n * sizeof(float),
                                   cudaMemcpyHostToDevice));
          }
          ASSERT_EQ(UsesVec4Of(u, w.p + off, s0.p + off, s1.p + off, g.p + off, k, stride, comp),
                    path == 0);
          ASSERT_CUDA(LaunchApplyRound(u, w.p + off, s0.p + off, s1.p + off, g.p + off, nullptr,
                                       comp, k, stride, n, sc, nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          const float* arrays[5] = {w.p + off, s0.p + off, s1.p + off,
                                    kept.p + off + kKeepRow * row_stride, ms.p + off};
          for (int a = 0; a < 5; ++a) {
            got[path][a].resize(n);
            ASSERT_CUDA(cudaMemcpy(got[path][a].data(), arrays[a], n * sizeof(float),
                                   cudaMemcpyDeviceToHost));
          }
        }
        ASSERT_EQ(Diff("w", got[0][0].data(), got[1][0].data(), n), "");
        ASSERT_EQ(Diff("s0", got[0][1].data(), got[1][1].data(), n), "");
        ASSERT_EQ(Diff("s1", got[0][2].data(), got[1][2].data(), n), "");
        // And both did the round: close to the host's results (the device may fuse
        // multiply-adds, so not bit for bit), and kept w where they were told to.
        const Expected want = Reference(u, n, k, sc, nullptr, dc);
        for (uint64_t i = 0; i < n; ++i) {
          ASSERT_NEAR(got[0][0][i], want.w[i], 1e-5f * (1.0f + std::abs(want.w[i]))) << "w[" << i << "]";
        }
        if (compensated) {
          ASSERT_EQ(Diff("kept row", got[0][3].data(), want.kept[kKeepRow].data(), n), "");
        }
        ASSERT_EQ(Diff("mean square (paths)", got[0][4].data(), got[1][4].data(), n), "");
        for (uint64_t i = 0; i < n; ++i) {
          ASSERT_NEAR(got[0][4][i], want.mean_square[i], 1e-6f * (1.0f + want.mean_square[i]))
              << "mean square[" << i << "]";
        }
      }
      }
    }
  }
}

}  // namespace

void PrintTo(Update u, std::ostream* os) { *os << Name(u); }

}  // namespace dsync::cuda
