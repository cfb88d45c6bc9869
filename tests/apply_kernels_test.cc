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
};

const Inputs& TheInputs() {
  static const Inputs in = [] {
    const size_t n = kSizes[std::size(kSizes) - 1];
    Inputs x;
    x.w = Random(n, 1, -2.0f, 2.0f);
    x.s0 = Random(n, 2, -2.0f, 2.0f);
    x.s1 = Random(n, 3, 0.01f, 2.0f);  // adam's second moment is never negative
    for (uint32_t j = 0; j < kMaxGrads; ++j) x.g[j] = Random(n, 10 + j, -2.0f, 2.0f);
    return x;
  }();
  return in;
}

// The reference: a plain loop calling ps/optimizer_math.h directly, not apply_thread.h.
struct Expected {
  std::vector<float> w, s0, s1;
};

// Staleness weights for up to kMaxGrads gradients: inverse's 1/(1+s) for s = 0, 1, 2.
const float kWeights[kMaxGrads] = {1.0f, 0.5f, static_cast<float>(1.0 / 3.0)};

// `weights`: null, or one per gradient (the round's sum weighs each gradient by its weight).
Expected Reference(Update u, uint64_t n, uint32_t k, const ps::OptimizerScalars& sc,
                   const float* weights = nullptr) {
  const Inputs& in = TheInputs();
  Expected e{{in.w.begin(), in.w.begin() + n},
             {in.s0.begin(), in.s0.begin() + n},
             {in.s1.begin(), in.s1.begin() + n}};
  for (uint64_t i = 0; i < n; ++i) {
    float sum = weights ? weights[0] * in.g[0][i] : in.g[0][i];
    for (uint32_t j = 1; j < k; ++j) sum += weights ? weights[j] * in.g[j][i] : in.g[j][i];
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
};

bool ExpectVec4(Update u, const Layout& l, uint32_t k, uint64_t stride) {
  bool ok = l.w == 0 && l.g == 0 && (k == 1 || stride % 4 == 0);
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
                 const float* weights, uint32_t k, uint64_t stride, uint64_t n,
                 const ps::OptimizerScalars& sc) {
  WithUpdate(u, [&]<Update U>() {
    for (uint64_t t = 0; t < threads; ++t) {
      ApplyThread<U>(t, threads, w, s0, s1, g, weights, k, stride, n, sc);
    }
  });
}

bool UsesVec4Of(Update u, const float* w, const float* s0, const float* s1, const float* g,
                uint32_t k, uint64_t stride) {
  return WithUpdate(u, [&]<Update U>() { return UsesVec4<U>(w, s0, s1, g, k, stride); });
}

class ApplyThreadEmulation : public ::testing::TestWithParam<Update> {};

TEST_P(ApplyThreadEmulation, EveryGridAndLayoutMatchesThePlainLoopBitForBit) {
  const Update u = GetParam();
  const Inputs& in = TheInputs();
  int vec4_runs = 0, scalar_runs = 0;
  for (uint64_t n : kSizes) {
    for (uint32_t k = 1; k <= kMaxGrads; ++k) {
      const ps::OptimizerScalars sc = Scalars(k);
      // Unweighted, and weighted by staleness: each path must match the plain loop.
      for (const float* weights : {static_cast<const float*>(nullptr), kWeights}) {
        const Expected want = Reference(u, n, k, sc, weights);
        for (const Layout& l : kLayouts) {
          const uint64_t stride =
              static_cast<uint64_t>(static_cast<int64_t>(GradientStride(n)) + l.stride_extra);
          for (uint64_t threads : kGrids) {
            SCOPED_TRACE(fmt::format("{}: n={} k={} stride={} layout '{}' grid of {} threads{}",
                                     Name(u), n, k, stride, l.name, threads,
                                     weights ? ", weighted" : ""));
            Guarded w(in.w.data(), n, l.w, kGuardValue);
            Guarded s0(in.s0.data(), n, l.s0, kGuardValue);
            Guarded s1(in.s1.data(), n, l.s1, kGuardValue);
            // k gradients `stride` apart; the padding between them is poison too.
            Arena garena(kGuard + l.g + (k - 1) * stride + n + kGuard, kPoison);
            float* g = garena.at(kGuard + l.g);
            for (uint32_t j = 0; j < k; ++j) std::copy(in.g[j].begin(), in.g[j].begin() + n, g + j * stride);
            const std::vector<float> g_before(garena.at(0), garena.end());

            const bool drop0 = l.null_unused && StateArraysOf(u) < 1;
            const bool drop1 = l.null_unused && StateArraysOf(u) < 2;
            float* p0 = drop0 ? nullptr : s0.data;
            float* p1 = drop1 ? nullptr : s1.data;
            const bool vec4 = UsesVec4Of(u, w.data, p0, p1, g, k, stride);
            ASSERT_EQ(vec4, ExpectVec4(u, l, k, stride));
            (vec4 ? vec4_runs : scalar_runs)++;

            EmulateGrid(u, threads, w.data, p0, p1, g, weights, k, stride, n, sc);

            ASSERT_EQ(Diff("w", w.data, want.w.data(), n), "");
            // Unused state arrays must come back as they went in.
            ASSERT_EQ(Diff("s0", s0.data, StateArraysOf(u) >= 1 ? want.s0.data() : in.s0.data(), n), "");
            ASSERT_EQ(Diff("s1", s1.data, StateArraysOf(u) >= 2 ? want.s1.data() : in.s1.data(), n), "");
            ASSERT_EQ(GuardsIntact("w", w), "");
            ASSERT_EQ(GuardsIntact("s0", s0), "");
            ASSERT_EQ(GuardsIntact("s1", s1), "");
            ASSERT_EQ(Diff("gradients", garena.at(0), g_before.data(), g_before.size()), "");
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
        EmulateGrid(Update::kSum, threads, w.data, nullptr, nullptr, g.data, nullptr, 1, n, n, sc);
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
        SCOPED_TRACE(fmt::format("{}: n={} k={}", Name(u), n, k));
        const ps::OptimizerScalars sc = Scalars(k);
        std::vector<float> got[2][3];
        for (int path = 0; path < 2; ++path) {
          const size_t off = path == 0 ? 0 : 1;
          const uint64_t stride = path == 0 ? GradientStride(n) : n + 1;
          DeviceArray w, s0, s1, g;
          for (DeviceArray* a : {&w, &s0, &s1}) {
            ASSERT_CUDA(a->Allocate(n + 1));
          }
          ASSERT_CUDA(g.Allocate(k * stride + 1));
          ASSERT_CUDA(cudaMemcpy(w.p + off, in.w.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          ASSERT_CUDA(cudaMemcpy(s0.p + off, in.s0.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          ASSERT_CUDA(cudaMemcpy(s1.p + off, in.s1.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          for (uint32_t j = 0; j < k; ++j) {
            ASSERT_CUDA(cudaMemcpy(g.p + off + j * stride, in.g[j].data(), n * sizeof(float),
                                   cudaMemcpyHostToDevice));
          }
          ASSERT_EQ(UsesVec4Of(u, w.p + off, s0.p + off, s1.p + off, g.p + off, k, stride), path == 0);
          ASSERT_CUDA(LaunchApplyRound(u, w.p + off, s0.p + off, s1.p + off, g.p + off, nullptr,
                                       k, stride, n, sc, nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          DeviceArray* arrays[3] = {&w, &s0, &s1};
          for (int a = 0; a < 3; ++a) {
            got[path][a].resize(n);
            ASSERT_CUDA(cudaMemcpy(got[path][a].data(), arrays[a]->p + off, n * sizeof(float),
                                   cudaMemcpyDeviceToHost));
          }
        }
        ASSERT_EQ(Diff("w", got[0][0].data(), got[1][0].data(), n), "");
        ASSERT_EQ(Diff("s0", got[0][1].data(), got[1][1].data(), n), "");
        ASSERT_EQ(Diff("s1", got[0][2].data(), got[1][2].data(), n), "");
        // And both did the round: close to the host's results (the device may fuse
        // multiply-adds, so not bit for bit).
        const Expected want = Reference(u, n, k, sc);
        for (uint64_t i = 0; i < n; ++i) {
          ASSERT_NEAR(got[0][0][i], want.w[i], 1e-5f * (1.0f + std::abs(want.w[i]))) << "w[" << i << "]";
        }
      }
    }
  }
}

}  // namespace

void PrintTo(Update u, std::ostream* os) { *os << Name(u); }

}  // namespace dsync::cuda
