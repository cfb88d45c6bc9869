// The ParamStore contract, checked against independent double-precision formulas for every
// optimizer: random inputs (never zeros), sizes that are not multiples of any block or
// vector width, results read into poisoned buffers so unwritten elements show. The suite is
// parameterized over store factories so the CUDA store runs the same checks.
#include <gtest/gtest.h>

#include "random_inputs.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "cpu/cpu_store.h"
#if DSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "cuda/cuda_store.h"
#endif
#include "runtime/backends.h"
#include "ps/buffer_pool.h"
#include "ps/param_store.h"

namespace dsync::ps {
namespace {

struct StoreCase {
  const char* name;
  // Null with the reason in *skip when the store cannot run on this machine.
  std::function<std::unique_ptr<ParamStore>(std::string* skip)> make;
};

void PrintTo(const StoreCase& c, std::ostream* os) { *os << c.name; }

class StoreTest : public ::testing::TestWithParam<StoreCase> {
 protected:
  void SetUp() override {
    std::string skip;
    store_ = GetParam().make(&skip);
    if (!store_) GTEST_SKIP() << skip;
  }
  std::unique_ptr<ParamStore> store_;
};

using dsync::testing::Random;

// Reference optimizer in double, written from the formulas, not from optimizer_math.h.
struct Reference {
  std::vector<double> w, s0, s1;
  uint64_t t = 0;
  // `weights`: empty, or each gradient's staleness weight.
  void Step(const OptimizerConfig& o, const std::vector<std::vector<float>>& grads,
            const std::vector<float>& weights = {}) {
    ++t;
    for (size_t i = 0; i < w.size(); ++i) {
      double sum = 0;
      for (size_t k = 0; k < grads.size(); ++k) {
        sum += (weights.empty() ? 1.0 : static_cast<double>(weights[k])) * grads[k][i];
      }
      if (o.kind == OptimizerKind::kSum) {
        w[i] += sum;
        continue;
      }
      if (o.kind == OptimizerKind::kAdamW) w[i] *= 1 - static_cast<double>(o.lr) * o.weight_decay;
      const double g = sum / static_cast<double>(grads.size()) +
                       (o.kind == OptimizerKind::kAdamW ? 0.0 : o.weight_decay * w[i]);
      switch (o.kind) {
        case OptimizerKind::kSgd:
          w[i] -= o.lr * g;
          break;
        case OptimizerKind::kMomentum:
          s0[i] = o.momentum * s0[i] + g;
          w[i] -= o.lr * s0[i];
          break;
        case OptimizerKind::kAdam:
        case OptimizerKind::kAdamW: {
          s0[i] = o.beta1 * s0[i] + (1 - o.beta1) * g;
          s1[i] = o.beta2 * s1[i] + (1 - o.beta2) * g * g;
          const double mh = s0[i] / (1 - std::pow(static_cast<double>(o.beta1), t));
          const double vh = s1[i] / (1 - std::pow(static_cast<double>(o.beta2), t));
          w[i] -= o.lr * mh / (std::sqrt(vh) + o.eps);
          break;
        }
        default:
          break;
      }
    }
  }
};

OptimizerConfig Optimizer(OptimizerKind kind) {
  OptimizerConfig o;
  o.kind = kind;
  o.lr = 0.05f;
  o.momentum = 0.9f;
  o.weight_decay = 0.01f;
  return o;
}

TEST_P(StoreTest, EveryOptimizerMatchesTheReferenceOverSeveralRounds) {
  for (OptimizerKind kind : {OptimizerKind::kSum, OptimizerKind::kSgd, OptimizerKind::kMomentum,
                             OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    SCOPED_TRACE(std::string(OptimizerName(kind)));
    for (size_t n : {size_t{1}, size_t{3}, size_t{4099}, size_t{10007}}) {
      const SliceKey key = MakeSliceKey(static_cast<uint32_t>(kind), static_cast<uint32_t>(n));
      const std::vector<float> init = Random(n, 1);
      ASSERT_TRUE(store_->InitSlice(key, init).ok());
      Reference ref{{init.begin(), init.end()}, std::vector<double>(n), std::vector<double>(n)};
      const OptimizerConfig opt = Optimizer(kind);
      for (uint32_t round = 0; round < 3; ++round) {
        std::vector<std::vector<float>> grads;
        for (uint32_t k = 0; k < round + 1; ++k) grads.push_back(Random(n, 100 + round * 10 + k));
        std::vector<const float*> ptrs;
        for (const auto& g : grads) ptrs.push_back(g.data());
        ASSERT_TRUE(store_->ApplyRound(key, ptrs, opt).ok());
        ref.Step(opt, grads);
      }
      std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());  // poisoned
      ASSERT_TRUE(store_->Read(key, out).ok());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(out[i], ref.w[i], 1e-5 * std::max(1.0, std::abs(ref.w[i])))
            << "element " << i << " of " << n;
      }
    }
  }
}

// Staleness weights (inverse's 1/(1+s) for s = 0, 2, 1): each gradient counts its weight in
// the sum every optimizer uses.
TEST_P(StoreTest, StalenessWeightsScaleEachGradientForEveryOptimizer) {
  const std::vector<float> weights = {1.0f, 1.0f / 3.0f, 0.5f};
  for (OptimizerKind kind : {OptimizerKind::kSum, OptimizerKind::kSgd, OptimizerKind::kMomentum,
                             OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    SCOPED_TRACE(std::string(OptimizerName(kind)));
    const size_t n = 4099;
    const SliceKey key = MakeSliceKey(10 + static_cast<uint32_t>(kind), 0);
    const std::vector<float> init = Random(n, 2);
    ASSERT_TRUE(store_->InitSlice(key, init).ok());
    Reference ref{{init.begin(), init.end()}, std::vector<double>(n), std::vector<double>(n)};
    const OptimizerConfig opt = Optimizer(kind);
    for (uint32_t round = 0; round < 3; ++round) {
      std::vector<std::vector<float>> grads;
      for (uint32_t k = 0; k < 3; ++k) grads.push_back(Random(n, 500 + round * 10 + k));
      std::vector<const float*> ptrs;
      for (const auto& g : grads) ptrs.push_back(g.data());
      ASSERT_TRUE(store_->ApplyRound(key, ptrs, weights, opt).ok());
      ref.Step(opt, grads, weights);
    }
    std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(store_->Read(key, out).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[i], ref.w[i], 1e-5 * std::max(1.0, std::abs(ref.w[i])))
          << "element " << i << " of " << n;
    }
  }
}

// A weight of exactly 1 (a fresh gradient under any policy) sums bit for bit as no weights.
TEST_P(StoreTest, WeightsOfOneAreBitIdenticalToNoWeights) {
  const size_t n = 1027;
  const SliceKey plain = MakeSliceKey(20, 0), weighed = MakeSliceKey(20, 1);
  const std::vector<float> init = Random(n, 3);
  ASSERT_TRUE(store_->InitSlice(plain, init).ok());
  ASSERT_TRUE(store_->InitSlice(weighed, init).ok());
  const std::vector<float> ones = {1.0f, 1.0f, 1.0f};
  for (uint32_t round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> grads;
    for (uint32_t k = 0; k < 3; ++k) grads.push_back(Random(n, 600 + round * 10 + k));
    std::vector<const float*> ptrs;
    for (const auto& g : grads) ptrs.push_back(g.data());
    ASSERT_TRUE(store_->ApplyRound(plain, ptrs, Optimizer(OptimizerKind::kAdam)).ok());
    ASSERT_TRUE(store_->ApplyRound(weighed, ptrs, ones, Optimizer(OptimizerKind::kAdam)).ok());
  }
  std::vector<float> a(n), b(n);
  ASSERT_TRUE(store_->Read(plain, a).ok());
  ASSERT_TRUE(store_->Read(weighed, b).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), n * sizeof(float)));
}

TEST_P(StoreTest, SumsInTheGivenOrderExactly) {
  // Order matters in floating point: (big + 1) - big loses the 1, big + (1 - big) keeps it.
  const SliceKey key = MakeSliceKey(0, 0);
  ASSERT_TRUE(store_->InitSlice(key, std::vector<float>(5, 0.0f)).ok());
  const std::vector<float> big(5, 1e8f), one(5, 1.0f), minus(5, -1e8f);
  const float* order[] = {big.data(), one.data(), minus.data()};
  ASSERT_TRUE(store_->ApplyRound(key, order, Optimizer(OptimizerKind::kSum)).ok());
  std::vector<float> out(5);
  ASSERT_TRUE(store_->Read(key, out).ok());
  for (float x : out) EXPECT_EQ(x, (1e8f + 1.0f) + -1e8f);
}

TEST_P(StoreTest, AnEmptyRoundChangesNothing) {
  const SliceKey key = MakeSliceKey(1, 0);
  const std::vector<float> init = Random(100, 5);
  ASSERT_TRUE(store_->InitSlice(key, init).ok());
  ASSERT_TRUE(store_->ApplyRound(key, {}, Optimizer(OptimizerKind::kAdam)).ok());
  std::vector<float> out(100);
  ASSERT_TRUE(store_->Read(key, out).ok());
  EXPECT_EQ(out, init);
}

TEST_P(StoreTest, ErrorsAreValues) {
  const SliceKey key = MakeSliceKey(2, 0);
  std::vector<float> out(4);
  EXPECT_EQ(store_->Read(key, out).code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->ApplyRound(key, {}, Optimizer(OptimizerKind::kSgd)).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(store_->InitSlice(key, std::vector<float>(8, 1.0f)).ok());
  EXPECT_EQ(store_->InitSlice(key, std::vector<float>(8, 1.0f)).code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(store_->Read(key, out).code(), StatusCode::kInvalidArgument);
  // One weight per gradient, or none: anything else is refused and changes nothing.
  const std::vector<float> g(8, 5.0f);
  const float* two[] = {g.data(), g.data()};
  const std::vector<float> one_weight = {0.5f};
  const Status mismatch = store_->ApplyRound(key, two, one_weight, Optimizer(OptimizerKind::kSum));
  EXPECT_EQ(mismatch.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.message().find("2 gradient(s) came with 1 weight(s)"), std::string::npos)
      << mismatch.message();
  std::vector<float> all(8);
  ASSERT_TRUE(store_->Read(key, all).ok());
  EXPECT_EQ(all, std::vector<float>(8, 1.0f));
  EXPECT_EQ(store_->SliceElements(key), 8u);
  EXPECT_TRUE(store_->HasSlice(key));
  EXPECT_FALSE(store_->HasSlice(MakeSliceKey(2, 1)));
}

TEST_P(StoreTest, PooledBuffersAreReusedNotReallocated) {
  BufferPool pool(store_.get());
  std::vector<void*> first;
  for (int i = 0; i < 4; ++i) first.push_back(pool.Acquire(4 << 20));
  for (void* p : first) pool.Release(p, 4 << 20);
  EXPECT_EQ(pool.created(), 4u);
  for (int round = 0; round < 10; ++round) {
    std::vector<void*> again;
    for (int i = 0; i < 4; ++i) again.push_back(pool.Acquire((4 << 20) - 100));
    for (void* p : again) pool.Release(p, (4 << 20) - 100);
  }
  EXPECT_EQ(pool.created(), 4u);  // steady state: no new memory
  void* small = pool.Acquire(10);
  EXPECT_EQ(pool.created(), 5u);
  pool.Release(small, 10);
}

TEST_P(StoreTest, RoundsOnDifferentSlicesRunFromSeveralThreadsAtOnce) {
  // The server applies rounds on one thread while transport threads read other slices for
  // pulls; the CUDA store gives each thread its own stream. Each thread owns one slice here;
  // the main thread reads every slice at the end, after the other threads' streams.
  constexpr int kThreads = 4, kRounds = 12;
  const OptimizerConfig opt = Optimizer(OptimizerKind::kMomentum);
  std::vector<Reference> refs(kThreads);
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t n = 4097 + static_cast<size_t>(t) * 3;
      const SliceKey key = MakeSliceKey(9, static_cast<uint32_t>(t));
      const std::vector<float> init = Random(n, 40 + static_cast<uint32_t>(t));
      Reference& ref = refs[t];
      ref = Reference{{init.begin(), init.end()}, std::vector<double>(n), std::vector<double>(n)};
      if (!store_->InitSlice(key, init).ok()) {
        failures[t] = "InitSlice failed";
        return;
      }
      std::vector<float> out(n);
      for (uint32_t round = 0; round < kRounds; ++round) {
        const std::vector<std::vector<float>> grads = {
            Random(n, 1000 * static_cast<uint32_t>(t) + 2 * round),
            Random(n, 1000 * static_cast<uint32_t>(t) + 2 * round + 1)};
        const float* ptrs[] = {grads[0].data(), grads[1].data()};
        Status st = store_->ApplyRound(key, ptrs, opt);
        ref.Step(opt, grads);
        std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
        if (st.ok()) st = store_->Read(key, out);
        if (!st.ok()) {
          failures[t] = st.ToString();
          return;
        }
        for (size_t i = 0; i < n; ++i) {
          if (!(std::abs(out[i] - ref.w[i]) <= 1e-5 * std::max(1.0, std::abs(ref.w[i])))) {
            failures[t] = fmt::format("round {} element {}: {} instead of {}", round, i,
                                      out[i], ref.w[i]);
            return;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(failures[t], "") << "thread " << t;
    const size_t n = refs[t].w.size();
    std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(store_->Read(MakeSliceKey(9, static_cast<uint32_t>(t)), out).ok());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[i], refs[t].w[i], 1e-5 * std::max(1.0, std::abs(refs[t].w[i])));
    }
  }
}

// GPUDirect RDMA: payloads the NIC wrote into AllocateDevice memory are initial values and
// gradients like host ones, and a pull can be read into that memory; the results equal the
// host path's bit for bit. A store without device memory says so with nullptr.
TEST_P(StoreTest, DeviceBuffersServeAsGradientsInitialValuesAndReadTargets) {
  const DeviceMemory* memory = store_->device_memory();
  if (!memory) {
    EXPECT_EQ(store_->AllocateDevice(4096), nullptr);
    return;
  }
#if DSYNC_HAVE_CUDA
  constexpr size_t n = 10007;
  const size_t bytes = n * sizeof(float);
  const std::vector<float> init = Random(n, 5);
  const std::vector<std::vector<float>> grads = {Random(n, 6), Random(n, 7)};
  float* dinit = static_cast<float*>(store_->AllocateDevice(bytes));
  float* dg0 = static_cast<float*>(store_->AllocateDevice(bytes));
  float* dg1 = static_cast<float*>(store_->AllocateDevice(bytes));
  float* dout = static_cast<float*>(store_->AllocateDevice(bytes));
  ASSERT_TRUE(dinit && dg0 && dg1 && dout);
  EXPECT_TRUE(memory->Contains(dg0, bytes));
  EXPECT_FALSE(memory->Contains(init.data(), bytes));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(dg0) % page, 0u) << "dma-buf ranges are page aligned";
  ASSERT_EQ(cudaMemcpy(dinit, init.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dg0, grads[0].data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dg1, grads[1].data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  // From pageable memory cudaMemcpy may return before the copy is done, and the store's
  // streams do not wait for the legacy stream: finish here, as the NIC would have.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const OptimizerConfig opt = Optimizer(OptimizerKind::kAdam);
  const SliceKey host_key = MakeSliceKey(11, 0), device_key = MakeSliceKey(11, 1);
  ASSERT_TRUE(store_->InitSlice(host_key, init).ok());
  ASSERT_TRUE(store_->InitSlice(device_key, {dinit, n}).ok());
  const float* host_ptrs[] = {grads[0].data(), grads[1].data()};
  const float* device_ptrs[] = {dg0, dg1};
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(store_->ApplyRound(host_key, host_ptrs, opt).ok());
    ASSERT_TRUE(store_->ApplyRound(device_key, device_ptrs, opt).ok());
  }
  std::vector<float> from_host(n, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> from_device(n, std::numeric_limits<float>::quiet_NaN());
  ASSERT_EQ(cudaMemset(dout, 0xff, bytes), cudaSuccess);  // NaN: unwritten elements show
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memset is asynchronous
  ASSERT_TRUE(store_->Read(host_key, from_host).ok());
  ASSERT_TRUE(store_->Read(device_key, {dout, n}).ok());
  ASSERT_EQ(cudaMemcpy(from_device.data(), dout, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(from_host.data(), from_device.data(), bytes));
  EXPECT_NE(from_host[0], init[0]);
  // dma-buf export works where the GPU supports it, and otherwise says why.
  auto fd = memory->ExportDmaBuf(dg0, (bytes + page - 1) / page * page);
  if (memory->DmaBufUnsupported().empty()) {
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    EXPECT_GE(*fd, 0);
    close(*fd);
  } else {
    ASSERT_FALSE(fd.ok());
    EXPECT_EQ(fd.status().message(), memory->DmaBufUnsupported());
  }
  for (float* p : {dinit, dg0, dg1, dout}) store_->FreeDevice(p, bytes);
  EXPECT_FALSE(memory->Contains(dg0, bytes));
#else
  FAIL() << "a store with device memory in a build without CUDA";
#endif
}

// torch.optim's single-tensor formulas (PyTorch 1.13, foreach=False, amsgrad=False), written
// here in double from torch's source, independently of optimizer_math.h: SGD with momentum,
// dampening and nesterov (the buffer starts as a copy of the first gradient), Adam with its
// L2 decay in the gradient, AdamW with decoupled decay.
struct TorchReference {
  OptimizerConfig o;
  std::vector<double> w, buf, m, v;
  uint64_t t = 0;

  void Step(const std::vector<std::vector<float>>& grads) {
    ++t;
    const double lr = o.lr, wd = o.weight_decay, mu = o.momentum, damp = o.dampening;
    const double b1 = o.beta1, b2 = o.beta2, eps = o.eps;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(t));
    for (size_t i = 0; i < w.size(); ++i) {
      double d = 0;
      for (const auto& g : grads) d += g[i];
      d /= static_cast<double>(grads.size());
      if (o.kind == OptimizerKind::kAdamW) {
        w[i] *= 1 - lr * wd;
      } else {
        d += wd * w[i];
      }
      switch (o.kind) {
        case OptimizerKind::kSgd:
          w[i] -= lr * d;
          break;
        case OptimizerKind::kMomentum:
          buf[i] = t == 1 ? d : mu * buf[i] + (1 - damp) * d;
          d = o.nesterov ? d + mu * buf[i] : buf[i];
          w[i] -= lr * d;
          break;
        case OptimizerKind::kAdam:
        case OptimizerKind::kAdamW: {
          m[i] = b1 * m[i] + (1 - b1) * d;
          v[i] = b2 * v[i] + (1 - b2) * d * d;
          const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
          w[i] -= (lr / bc1) * m[i] / denom;
          break;
        }
        case OptimizerKind::kSum:
          break;
      }
    }
  }
};

// 25 rounds of 1 and of 3 gradients, elements in five magnitudes (1e-3 .. 1e2), against
// torch's formulas in double: relative error <= 1e-6 on every element, the denominator
// max(|reference|, 1e-3). The gradients lean away from zero on each element (with noise of
// either sign), so no weight crosses zero, where a relative error means nothing.
TEST_P(StoreTest, MatchesTorchOptimFormulasWithinOneMillionthRelative) {
  struct Case {
    const char* what;
    OptimizerConfig o;
  };
  const auto make = [](OptimizerKind kind, float lr, float wd) {
    OptimizerConfig o;
    o.kind = kind;
    o.lr = lr;
    o.weight_decay = wd;
    o.momentum = 0.9f;
    return o;
  };
  std::vector<Case> cases;
  for (float wd : {0.0f, 0.01f}) {
    cases.push_back({"sgd", make(OptimizerKind::kSgd, 0.01f, wd)});
    cases.push_back({"momentum", make(OptimizerKind::kMomentum, 0.01f, wd)});
    OptimizerConfig damp = make(OptimizerKind::kMomentum, 0.01f, wd);
    damp.dampening = 0.3f;
    damp.momentum = 0.8f;
    cases.push_back({"momentum, dampening 0.3", damp});
    OptimizerConfig nesterov = make(OptimizerKind::kMomentum, 0.01f, wd);
    nesterov.nesterov = true;
    cases.push_back({"momentum, nesterov", nesterov});
    cases.push_back({"adam", make(OptimizerKind::kAdam, 0.01f, wd)});
    OptimizerConfig betas = make(OptimizerKind::kAdam, 0.003f, wd);
    betas.beta1 = 0.8f;
    betas.beta2 = 0.99f;
    betas.eps = 1e-6f;
    cases.push_back({"adam, betas 0.8 0.99, eps 1e-6", betas});
    // torch's default decay for AdamW. Its factor 1 - lr * wd, rounded to float once per
    // round as in torch, alone may drift up to 25 x 3e-8 from the double reference.
    cases.push_back({"adamw", make(OptimizerKind::kAdamW, 0.01f, wd)});
  }
  constexpr size_t kN = 1003;
  constexpr uint32_t kRounds = 25;
  const float kScales[] = {1e-3f, 1e-1f, 1.0f, 10.0f, 100.0f};
  uint32_t slice = 0;
  for (const Case& c : cases) {
    ASSERT_TRUE(ValidateOptimizer(c.o).ok()) << c.what;
    for (uint32_t k : {1u, 3u}) {
      SCOPED_TRACE(fmt::format("{}, weight decay {}, {} gradient(s) per round", c.what,
                               c.o.weight_decay, k));
      const SliceKey key = MakeSliceKey(77, slice++);
      std::vector<float> init = Random(kN, 11 + slice, 0.5f, 2.0f);
      const std::vector<float> sign = Random(kN, 13 + slice);
      for (size_t i = 0; i < kN; ++i) init[i] *= kScales[i % 5] * (sign[i] < 0 ? -1.0f : 1.0f);
      ASSERT_TRUE(store_->InitSlice(key, init).ok());
      TorchReference ref{c.o, {init.begin(), init.end()}, std::vector<double>(kN),
                         std::vector<double>(kN), std::vector<double>(kN)};
      for (uint32_t round = 0; round < kRounds; ++round) {
        std::vector<std::vector<float>> grads;
        for (uint32_t j = 0; j < k; ++j) {
          std::vector<float> lean = Random(kN, 1000 + round * 7 + j, 0.2f, 1.0f);
          const std::vector<float> noise = Random(kN, 5000 + round * 7 + j, -0.3f, 0.3f);
          for (size_t i = 0; i < kN; ++i) {
            // Away from zero: a weight w > 0 gets gradients < 0 on the whole (w -= lr g).
            lean[i] = kScales[i % 5] * ((init[i] > 0 ? -lean[i] : lean[i]) + noise[i]);
          }
          grads.push_back(std::move(lean));
        }
        std::vector<const float*> ptrs;
        for (const auto& g : grads) ptrs.push_back(g.data());
        ASSERT_TRUE(store_->ApplyRound(key, ptrs, c.o).ok());
        ref.Step(grads);
      }
      std::vector<float> out(kN, std::numeric_limits<float>::quiet_NaN());  // poisoned
      ASSERT_TRUE(store_->Read(key, out).ok());
      double worst = 0;
      size_t worst_at = 0;
      for (size_t i = 0; i < kN; ++i) {
        const double rel = std::abs(out[i] - ref.w[i]) / std::max(std::abs(ref.w[i]), 1e-3);
        if (!(rel <= worst)) {
          worst = rel;
          worst_at = i;
        }
      }
      // AdamW rounds twice per round, as torch does (w *= 1 - lr wd, then w -= step): over 25
      // rounds float32's own rounding reaches ~1.5e-6 of the double reference, in torch too.
      const double tolerance = c.o.kind == OptimizerKind::kAdamW ? 2e-6 : 1e-6;
      EXPECT_LE(worst, tolerance) << "element " << worst_at << ": " << out[worst_at] << " vs "
                                  << ref.w[worst_at];
      RecordProperty(fmt::format("worst_{}", slice), fmt::format("{}: {:.3g}", c.what, worst));
      // The weights moved: a store that ignored the rounds would not pass by accident.
      EXPECT_NE(out[0], init[0]);
    }
  }
}

// What tells torch's formulas from the old ones: with dampening, the momentum buffer's first
// value is the gradient itself (not (1 - dampening) times it); with nesterov, the step is
// g + momentum * buf.
TEST_P(StoreTest, MomentumStartsItsBufferUndampedAndNesterovLooksAhead) {
  OptimizerConfig o;
  o.kind = OptimizerKind::kMomentum;
  o.lr = 0.5f;
  o.momentum = 0.5f;
  o.dampening = 0.5f;
  const SliceKey key = MakeSliceKey(78, 0);
  ASSERT_TRUE(store_->InitSlice(key, std::vector<float>{1.0f}).ok());
  const std::vector<float> g{1.0f};
  const float* one[] = {g.data()};
  std::vector<float> out(1);
  ASSERT_TRUE(store_->ApplyRound(key, one, o).ok());  // buf = 1; w = 1 - 0.5
  ASSERT_TRUE(store_->Read(key, out).ok());
  EXPECT_EQ(out[0], 0.5f);
  ASSERT_TRUE(store_->ApplyRound(key, one, o).ok());  // buf = 0.5 + 0.5 = 1; w = 0.5 - 0.5
  ASSERT_TRUE(store_->Read(key, out).ok());
  EXPECT_EQ(out[0], 0.0f);

  o.dampening = 0.0f;
  o.nesterov = true;
  const SliceKey nkey = MakeSliceKey(78, 1);
  ASSERT_TRUE(store_->InitSlice(nkey, std::vector<float>{1.0f}).ok());
  ASSERT_TRUE(store_->ApplyRound(nkey, one, o).ok());  // buf = 1; g = 1 + 0.5; w = 1 - 0.75
  ASSERT_TRUE(store_->Read(nkey, out).ok());
  EXPECT_EQ(out[0], 0.25f);
  ASSERT_TRUE(store_->ApplyRound(nkey, one, o).ok());  // buf = 1.5; g = 1.75; w = 0.25 - 0.875
  ASSERT_TRUE(store_->Read(nkey, out).ok());
  EXPECT_EQ(out[0], -0.625f);
}

// Rounds `first` .. `first + count - 1` of two gradients each, the same for every slice they
// are applied to.
Status ApplyRounds(ParamStore& store, SliceKey key, size_t n, const OptimizerConfig& opt,
                   uint32_t first, uint32_t count) {
  for (uint32_t round = first; round < first + count; ++round) {
    const std::vector<std::vector<float>> grads = {Random(n, 700 + 2 * round),
                                                   Random(n, 701 + 2 * round)};
    const float* ptrs[] = {grads[0].data(), grads[1].data()};
    DSYNC_RETURN_IF_ERROR(store.ApplyRound(key, ptrs, opt));
  }
  return Status::Ok();
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  // memcmp may not be handed the null data() of an empty vector, even for no bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// A checkpoint resumes exactly: a slice restored from a snapshot, in the same store or in a
// fresh one, continues bit for bit as the slice it was taken from. Every optimizer's state
// and update count must survive for that (momentum's first step and adam's bias correction
// depend on the count).
TEST_P(StoreTest, RestoredSlicesContinueBitForBitForEveryOptimizer) {
  struct Case {
    const char* what;
    OptimizerConfig o;
    size_t state_arrays;
  };
  OptimizerConfig nesterov = Optimizer(OptimizerKind::kMomentum);
  nesterov.nesterov = true;
  OptimizerConfig damp = Optimizer(OptimizerKind::kMomentum);
  damp.dampening = 0.3f;
  const Case cases[] = {{"sum", Optimizer(OptimizerKind::kSum), 0},
                        {"sgd", Optimizer(OptimizerKind::kSgd), 0},
                        {"momentum", Optimizer(OptimizerKind::kMomentum), 1},
                        {"momentum, nesterov", nesterov, 1},
                        {"momentum, dampening 0.3", damp, 1},
                        {"adam", Optimizer(OptimizerKind::kAdam), 2},
                        {"adamw", Optimizer(OptimizerKind::kAdamW), 2}};
  constexpr size_t n = 4099;
  constexpr uint32_t kBefore = 3, kAfter = 3;
  uint32_t slice = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const SliceKey key = MakeSliceKey(80, slice++), copy = MakeSliceKey(80, slice++);
    const std::vector<float> init = Random(n, 8 + slice);
    ASSERT_TRUE(store_->InitSlice(key, init).ok());
    Status st = ApplyRounds(*store_, key, n, c.o, 0, kBefore);
    ASSERT_TRUE(st.ok()) << st.ToString();

    SliceSnapshot snap;
    st = store_->Snapshot(key, snap);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(snap.steps, kBefore);
    ASSERT_EQ(snap.state.size(), c.state_arrays);
    for (const auto& state : snap.state) EXPECT_EQ(state.size(), n);
    std::vector<float> now(n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(store_->Read(key, now).ok());
    EXPECT_TRUE(SameFloats(snap.params, now));

    st = store_->Restore(copy, snap);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(store_->SliceElements(copy), n);
    // A snapshot of the restored slice is the snapshot it was restored from.
    SliceSnapshot again;
    ASSERT_TRUE(store_->Snapshot(copy, again).ok());
    EXPECT_EQ(again.steps, snap.steps);
    EXPECT_TRUE(SameFloats(again.params, snap.params));
    ASSERT_EQ(again.state.size(), snap.state.size());
    for (size_t i = 0; i < snap.state.size(); ++i) {
      EXPECT_TRUE(SameFloats(again.state[i], snap.state[i])) << "state array " << i;
    }

    std::string skip;
    std::unique_ptr<ParamStore> fresh = GetParam().make(&skip);
    ASSERT_TRUE(fresh) << skip;
    st = fresh->Restore(key, snap);
    ASSERT_TRUE(st.ok()) << st.ToString();

    for (auto [store, k] : {std::pair{store_.get(), key}, std::pair{store_.get(), copy},
                            std::pair{fresh.get(), key}}) {
      st = ApplyRounds(*store, k, n, c.o, kBefore, kAfter);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    std::vector<float> original(n, std::numeric_limits<float>::quiet_NaN());  // poisoned
    std::vector<float> restored(n, std::numeric_limits<float>::quiet_NaN());
    std::vector<float> elsewhere(n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(store_->Read(key, original).ok());
    ASSERT_TRUE(store_->Read(copy, restored).ok());
    ASSERT_TRUE(fresh->Read(key, elsewhere).ok());
    EXPECT_FALSE(SameFloats(original, now));  // the later rounds moved the weights
    EXPECT_TRUE(SameFloats(restored, original));
    EXPECT_TRUE(SameFloats(elsewhere, original));
  }
}

// Before any round a slice has no optimizer state and no updates; restored, it is the slice
// InitSlice makes, and stays so through the rounds that allocate the state.
TEST_P(StoreTest, ASnapshotBeforeAnyRoundRestoresAsInitSliceWould) {
  constexpr size_t n = 1027;
  uint32_t slice = 0;
  for (OptimizerKind kind : {OptimizerKind::kMomentum, OptimizerKind::kAdam}) {
    SCOPED_TRACE(std::string(OptimizerName(kind)));
    const SliceKey key = MakeSliceKey(81, slice++), copy = MakeSliceKey(81, slice++);
    const std::vector<float> init = Random(n, 20 + slice);
    ASSERT_TRUE(store_->InitSlice(key, init).ok());
    SliceSnapshot snap;
    snap.state.assign(2, std::vector<float>(3, 1.0f));  // resized away by Snapshot
    snap.steps = 9;
    ASSERT_TRUE(store_->Snapshot(key, snap).ok());
    EXPECT_TRUE(snap.state.empty());
    EXPECT_EQ(snap.steps, 0u);
    EXPECT_TRUE(SameFloats(snap.params, init));
    const Status st = store_->Restore(copy, snap);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (SliceKey k : {key, copy}) {
      const Status applied = ApplyRounds(*store_, k, n, Optimizer(kind), 0, 3);
      ASSERT_TRUE(applied.ok()) << applied.ToString();
    }
    std::vector<float> a(n, std::numeric_limits<float>::quiet_NaN());
    std::vector<float> b(n, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(store_->Read(key, a).ok());
    ASSERT_TRUE(store_->Read(copy, b).ok());
    EXPECT_TRUE(SameFloats(a, b));
  }
}

TEST_P(StoreTest, BadSnapshotsAreRefusedSayingWhatIsWrong) {
  constexpr size_t n = 10;
  const SliceKey key = MakeSliceKey(82, 0), target = MakeSliceKey(82, 5);
  const OptimizerConfig adam = Optimizer(OptimizerKind::kAdam);
  ASSERT_TRUE(store_->InitSlice(key, Random(n, 30)).ok());
  ASSERT_TRUE(ApplyRounds(*store_, key, n, adam, 0, 1).ok());
  SliceSnapshot good;
  ASSERT_TRUE(store_->Snapshot(key, good).ok());
  ASSERT_EQ(good.state.size(), 2u);

  // An unknown slice: as Read says.
  SliceSnapshot none;
  std::vector<float> out(n);
  const Status unknown = store_->Snapshot(MakeSliceKey(82, 9), none);
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
  EXPECT_EQ(unknown.code(), store_->Read(MakeSliceKey(82, 9), out).code());

  const auto refused = [&](const SliceSnapshot& bad, const std::string& says) {
    const Status st = store_->Restore(target, bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("tensor 82 slice 5"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
    EXPECT_FALSE(store_->HasSlice(target));
  };
  SliceSnapshot three = good;
  three.state.push_back(std::vector<float>(n));
  refused(three, "has 3 optimizer state arrays; no optimizer has more than 2");
  SliceSnapshot short_state = good;
  short_state.state[1].resize(n - 1);
  refused(short_state, "optimizer state array 1 holds 9 floats, the parameters 10");
  refused(SliceSnapshot{}, "has no parameters");

  // Over an existing slice: refused as InitSlice is, and the slice is left as it was.
  std::vector<float> before(n), after(n);
  ASSERT_TRUE(store_->Read(key, before).ok());
  SliceSnapshot other = good;
  for (float& x : other.params) x += 1.0f;
  const Status exists = store_->Restore(key, other);
  EXPECT_EQ(exists.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(exists.code(), store_->InitSlice(key, other.params).code());
  EXPECT_NE(exists.message().find("already exists"), std::string::npos) << exists.message();
  ASSERT_TRUE(store_->Read(key, after).ok());
  EXPECT_TRUE(SameFloats(before, after));

  // Still usable: the good snapshot restores and continues as its slice does.
  const Status st = store_->Restore(target, good);
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (SliceKey k : {key, target}) ASSERT_TRUE(ApplyRounds(*store_, k, n, adam, 1, 2).ok());
  ASSERT_TRUE(store_->Read(key, before).ok());
  ASSERT_TRUE(store_->Read(target, after).ok());
  EXPECT_TRUE(SameFloats(before, after));
}

// --- delay compensation -------------------------------------------------------------------

// A schedule of rounds for a compensated slice: the round's number, each gradient's base
// (-1: no gradients at all, the round changes nothing and keeps nothing).
struct CompensatedRound {
  uint64_t round;
  std::vector<int64_t> bases;
};

// Rounds 0..9 with fresh and stale gradients, staler than the depth of 2 kept versions at
// times, and rounds 3 and 6 without gradients.
const std::vector<CompensatedRound>& CompensatedSchedule() {
  static const std::vector<CompensatedRound> rounds = {
      {0, {0, 0}},    {1, {0, 1}},    {2, {1, 2, 0}}, {3, {}},      {4, {2, 4}},
      {5, {3, 5, 4}}, {6, {}},        {7, {5}},       {8, {1, 8}},  {9, {9, 7, 6}}};
  return rounds;
}

std::vector<std::vector<float>> GradientsOf(const CompensatedRound& r, size_t n) {
  std::vector<std::vector<float>> grads;
  for (size_t k = 0; k < r.bases.size(); ++k) {
    grads.push_back(Random(n, static_cast<uint32_t>(900 + 10 * r.round + k)));
  }
  return grads;
}

Status ApplyCompensated(ParamStore& store, SliceKey key, size_t n, const OptimizerConfig& opt,
                        const CompensatedRound& r, float lambda, uint32_t depth,
                        std::span<const float> weights = {}, bool adaptive = false) {
  const std::vector<std::vector<float>> grads = GradientsOf(r, n);
  std::vector<const float*> ptrs;
  std::vector<uint64_t> bases;
  for (size_t k = 0; k < grads.size(); ++k) {
    ptrs.push_back(grads[k].data());
    bases.push_back(static_cast<uint64_t>(r.bases[k]));
  }
  Compensation comp{lambda, depth, r.round, bases, adaptive};
  return store.ApplyRound(key, ptrs, weights.first(std::min(weights.size(), ptrs.size())), comp, opt);
}

// The same in double, written from DC-ASGD's formula and the rule the stores document: the
// slice keeps its parameters from before each of the last `depth` rounds that changed it, and
// a gradient of base b is corrected toward those before the first kept round >= b.
// Adaptive (DC-ASGD-a): each gradient first enters a running mean of g * g per element
// (decay 0.95), by whose square root L is divided.
struct CompensatedReference {
  Reference opt;
  std::vector<std::pair<uint64_t, std::vector<double>>> kept;  // oldest first
  std::vector<double> mean_square;
  uint64_t corrected = 0;
  void Step(const OptimizerConfig& o, const CompensatedRound& r, size_t n, double lambda,
            size_t depth, const std::vector<float>& weights = {}, bool adaptive = false) {
    if (r.bases.empty()) return;
    std::vector<std::vector<float>> grads = GradientsOf(r, n);
    mean_square.resize(n);
    for (size_t k = 0; k < grads.size(); ++k) {
      const std::vector<double>* base = nullptr;
      for (const auto& [round, w] : kept) {
        if (round >= static_cast<uint64_t>(r.bases[k])) {
          base = &w;
          break;
        }
      }
      corrected += base != nullptr ? 1 : 0;
      for (size_t i = 0; i < n; ++i) {
        const double g = grads[k][i];
        double l = lambda;
        if (adaptive) {
          mean_square[i] = 0.95 * mean_square[i] + 0.05 * g * g;
          l = lambda / std::sqrt(mean_square[i]);
        }
        if (base != nullptr) grads[k][i] = static_cast<float>(g + l * g * g * (opt.w[i] - (*base)[i]));
      }
    }
    kept.emplace_back(r.round, opt.w);
    if (kept.size() > depth) kept.erase(kept.begin());
    opt.Step(o, grads, weights.empty() ? weights
                                       : std::vector<float>(weights.begin(),
                                                            weights.begin() + grads.size()));
  }
};

// Each stale gradient is corrected toward the version it was computed on (or the oldest kept),
// before it is weighed, for every optimizer; fresh ones are not corrected.
TEST_P(StoreTest, DelayCompensationCorrectsStaleGradientsTowardTheKeptVersions) {
  constexpr size_t n = 4099;
  constexpr uint32_t kDepth = 2;
  for (const bool adaptive : {false, true}) {
  // The adaptive form's L is divided by |g|: of the order of the constant form's L * |g|.
  const float kLambda = adaptive ? 0.2f : 0.25f;
  for (const bool weighed : {false, true}) {
    for (OptimizerKind kind : {OptimizerKind::kSum, OptimizerKind::kSgd, OptimizerKind::kMomentum,
                               OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
      SCOPED_TRACE(fmt::format("{}{}{}", OptimizerName(kind), weighed ? ", weighed" : "",
                               adaptive ? ", adaptive" : ""));
      const uint32_t variant = (weighed ? 1 : 0) + (adaptive ? 10 : 0);
      const SliceKey key = MakeSliceKey(90 + variant, static_cast<uint32_t>(kind));
      const std::vector<float> init = Random(n, 40);
      ASSERT_TRUE(store_->InitSlice(key, init).ok());
      CompensatedReference ref;
      ref.opt = Reference{{init.begin(), init.end()}, std::vector<double>(n), std::vector<double>(n)};
      const OptimizerConfig opt = Optimizer(kind);
      const std::vector<float> weights = weighed ? std::vector<float>{1.0f, 0.5f, 0.25f}
                                                 : std::vector<float>{};
      for (const CompensatedRound& r : CompensatedSchedule()) {
        const Status st =
            ApplyCompensated(*store_, key, n, opt, r, kLambda, kDepth, weights, adaptive);
        ASSERT_TRUE(st.ok()) << st.ToString();
        ref.Step(opt, r, n, kLambda, kDepth, weights, adaptive);
      }
      // 10 stale gradients; base 1 in round 8 reaches past the 2 kept versions (rounds 5 and
      // 7): the oldest kept serves.
      EXPECT_EQ(ref.corrected, 10u);
      std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());
      ASSERT_TRUE(store_->Read(key, out).ok());
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(out[i], ref.opt.w[i], 1e-5 * std::max(1.0, std::abs(ref.opt.w[i])))
            << "element " << i;
      }
      // And the correction mattered: without it the result is elsewhere.
      const SliceKey plain = MakeSliceKey(92 + variant, static_cast<uint32_t>(kind));
      ASSERT_TRUE(store_->InitSlice(plain, init).ok());
      for (const CompensatedRound& r : CompensatedSchedule()) {
        ASSERT_TRUE(ApplyCompensated(*store_, plain, n, opt, r, 0.0f, 0, weights).ok());
      }
      std::vector<float> uncorrected(n);
      ASSERT_TRUE(store_->Read(plain, uncorrected).ok());
      EXPECT_FALSE(SameFloats(out, uncorrected));
      SliceSnapshot snap;
      ASSERT_TRUE(store_->Snapshot(key, snap).ok());
      EXPECT_EQ(snap.kept.size(), kDepth);
      EXPECT_EQ(snap.mean_square.size(), adaptive ? n : 0);
    }
  }
  }
}

// Fresh gradients are not touched: a compensated round of fresh gradients is bit for bit the
// round without compensation, while the versions are kept all the same.
TEST_P(StoreTest, CompensationOfFreshGradientsIsBitIdenticalToNone) {
  constexpr size_t n = 1027;
  const std::vector<float> init = Random(n, 41);
  const SliceKey a = MakeSliceKey(94, 0), b = MakeSliceKey(94, 1);
  ASSERT_TRUE(store_->InitSlice(a, init).ok());
  ASSERT_TRUE(store_->InitSlice(b, init).ok());
  const OptimizerConfig opt = Optimizer(OptimizerKind::kAdam);
  for (uint64_t round = 0; round < 5; ++round) {
    const CompensatedRound r{round, {static_cast<int64_t>(round), static_cast<int64_t>(round)}};
    ASSERT_TRUE(ApplyCompensated(*store_, a, n, opt, r, 3.0f, 4).ok());
    ASSERT_TRUE(ApplyCompensated(*store_, b, n, opt, r, 0.0f, 0).ok());
  }
  std::vector<float> x(n), y(n);
  ASSERT_TRUE(store_->Read(a, x).ok());
  ASSERT_TRUE(store_->Read(b, y).ok());
  EXPECT_TRUE(SameFloats(x, y));
  SliceSnapshot snap;
  ASSERT_TRUE(store_->Snapshot(a, snap).ok());
  ASSERT_EQ(snap.kept.size(), 4u);
  EXPECT_EQ(snap.kept.front().round, 1u);
  EXPECT_EQ(snap.kept.back().round, 4u);
  ASSERT_TRUE(store_->Snapshot(b, snap).ok());
  EXPECT_TRUE(snap.kept.empty());
}

// The kept versions travel in snapshots: a slice restored mid-schedule, here or in a fresh
// store, compensates the later stale gradients bit for bit as the original does; a restored
// slice laid out for a smaller depth keeps the newest versions.
TEST_P(StoreTest, SnapshotsCarryTheKeptVersionsAndRestoredSlicesCompensateAlike) {
  for (const bool adaptive : {false, true}) {
  SCOPED_TRACE(adaptive ? "adaptive" : "constant");
  constexpr size_t n = 2053;
  constexpr float kLambda = 0.5f;
  constexpr uint32_t kDepth = 3;
  const OptimizerConfig opt = Optimizer(OptimizerKind::kMomentum);
  const uint32_t tensor = adaptive ? 97 : 95;
  const SliceKey key = MakeSliceKey(tensor, 0), copy = MakeSliceKey(tensor, 1);
  ASSERT_TRUE(store_->InitSlice(key, Random(n, 42)).ok());
  const auto& schedule = CompensatedSchedule();
  const size_t half = 6;  // rounds 0..5
  for (size_t i = 0; i < half; ++i) {
    ASSERT_TRUE(ApplyCompensated(*store_, key, n, opt, schedule[i], kLambda, kDepth, {}, adaptive).ok());
  }
  SliceSnapshot snap;
  ASSERT_TRUE(store_->Snapshot(key, snap).ok());
  ASSERT_EQ(snap.mean_square.size(), adaptive ? n : 0);
  ASSERT_EQ(snap.kept.size(), 3u);  // rounds 2, 4, 5 (3 changed nothing)
  EXPECT_EQ(snap.kept[0].round, 2u);
  EXPECT_EQ(snap.kept[1].round, 4u);
  EXPECT_EQ(snap.kept[2].round, 5u);
  for (const KeptVersion& k : snap.kept) EXPECT_EQ(k.params.size(), n);

  std::string skip;
  std::unique_ptr<ParamStore> fresh = GetParam().make(&skip);
  ASSERT_TRUE(fresh) << skip;
  ASSERT_TRUE(store_->Restore(copy, snap).ok());
  ASSERT_TRUE(fresh->Restore(key, snap).ok());
  SliceSnapshot again;
  ASSERT_TRUE(store_->Snapshot(copy, again).ok());
  ASSERT_EQ(again.kept.size(), snap.kept.size());
  for (size_t i = 0; i < snap.kept.size(); ++i) {
    EXPECT_EQ(again.kept[i].round, snap.kept[i].round);
    EXPECT_TRUE(SameFloats(again.kept[i].params, snap.kept[i].params)) << "kept version " << i;
  }
  EXPECT_TRUE(SameFloats(again.mean_square, snap.mean_square));
  for (size_t i = half; i < schedule.size(); ++i) {
    for (auto [store, k] : {std::pair{store_.get(), key}, std::pair{store_.get(), copy},
                            std::pair{fresh.get(), key}}) {
      const Status st = ApplyCompensated(*store, k, n, opt, schedule[i], kLambda, kDepth, {}, adaptive);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  std::vector<float> original(n), restored(n, std::numeric_limits<float>::quiet_NaN()),
      elsewhere(n, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(store_->Read(key, original).ok());
  ASSERT_TRUE(store_->Read(copy, restored).ok());
  ASSERT_TRUE(fresh->Read(key, elsewhere).ok());
  EXPECT_TRUE(SameFloats(restored, original));
  EXPECT_TRUE(SameFloats(elsewhere, original));

  // Restored, then applied with a depth of 2: the newest two versions stay (rounds 4 and 5; a
  // round without gradients keeps nothing), then round 7's replaces round 4's.
  const SliceKey smaller = MakeSliceKey(tensor, 2);
  ASSERT_TRUE(store_->Restore(smaller, snap).ok());
  ASSERT_TRUE(ApplyCompensated(*store_, smaller, n, opt, schedule[half], kLambda, 2, {}, adaptive).ok());
  ASSERT_TRUE(store_->Snapshot(smaller, again).ok());
  ASSERT_EQ(again.kept.size(), 2u);
  EXPECT_EQ(again.kept[0].round, 4u);
  EXPECT_TRUE(SameFloats(again.kept[0].params, snap.kept[1].params));
  EXPECT_EQ(again.kept[1].round, 5u);
  ASSERT_TRUE(ApplyCompensated(*store_, smaller, n, opt, schedule[half + 1], kLambda, 2, {}, adaptive).ok());
  ASSERT_TRUE(store_->Snapshot(smaller, again).ok());
  ASSERT_EQ(again.kept.size(), 2u);
  EXPECT_EQ(again.kept[0].round, 5u);
  EXPECT_TRUE(SameFloats(again.kept[0].params, snap.kept[2].params));
  EXPECT_EQ(again.kept[1].round, schedule[half + 1].round);
  // And a job without compensation drops what was kept.
  ASSERT_TRUE(ApplyCompensated(*store_, smaller, n, opt, schedule[half + 2], 0.0f, 0).ok());
  ASSERT_TRUE(store_->Snapshot(smaller, again).ok());
  EXPECT_TRUE(again.kept.empty());
  EXPECT_TRUE(again.mean_square.empty());
  }
}

TEST_P(StoreTest, BadCompensationsAreRefusedAndChangeNothing) {
  constexpr size_t n = 17;
  const SliceKey key = MakeSliceKey(96, 0);
  ASSERT_TRUE(store_->InitSlice(key, Random(n, 43)).ok());
  const OptimizerConfig opt = Optimizer(OptimizerKind::kSgd);
  ASSERT_TRUE(ApplyCompensated(*store_, key, n, opt, {0, {0, 0}}, 1.0f, 2).ok());
  std::vector<float> before(n), after(n);
  ASSERT_TRUE(store_->Read(key, before).ok());
  SliceSnapshot kept_before;
  ASSERT_TRUE(store_->Snapshot(key, kept_before).ok());
  const std::vector<float> g = Random(n, 44);
  const float* ptrs[] = {g.data(), g.data()};
  const auto refused = [&](const Compensation& c, const std::string& says) {
    const Status st = store_->ApplyRound(key, ptrs, {}, c, opt);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
  };
  const uint64_t one_base[] = {0};
  const uint64_t future[] = {0, 7};
  refused(Compensation{1.0f, 2, 1, one_base}, "a round of 2 gradient(s) came with 1 base(s)");
  refused(Compensation{1.0f, 2, 1, future},
          "a gradient of version 7 in round 1: no gradient is newer than its round");
  refused(Compensation{1.0f, 65, 1, {}}, "keeping 65 version(s)");
  refused(Compensation{-1.0f, 2, 1, {}}, "factor -1");
  ASSERT_TRUE(store_->Read(key, after).ok());
  EXPECT_TRUE(SameFloats(before, after));
  SliceSnapshot kept_after;
  ASSERT_TRUE(store_->Snapshot(key, kept_after).ok());
  ASSERT_EQ(kept_after.kept.size(), kept_before.kept.size());
  EXPECT_EQ(kept_after.kept[0].round, kept_before.kept[0].round);
  EXPECT_EQ(kept_after.steps, kept_before.steps);

  // Kept versions that do not fit the parameters, or out of order, are refused on Restore.
  SliceSnapshot bad = kept_before;
  bad.kept.push_back({5, std::vector<float>(n - 1)});
  Status st = store_->Restore(MakeSliceKey(96, 1), bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("kept version 1 (round 5) holds 16 floats, the parameters 17"),
            std::string::npos) << st.message();
  bad.kept.back() = {0, std::vector<float>(n)};
  st = store_->Restore(MakeSliceKey(96, 1), bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  bad = kept_before;
  bad.mean_square.assign(n + 1, 0.0f);
  st = store_->Restore(MakeSliceKey(96, 1), bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("its mean square holds 18 floats, the parameters 17"),
            std::string::npos) << st.message();
  EXPECT_FALSE(store_->HasSlice(MakeSliceKey(96, 1)));
}

std::vector<StoreCase> Stores() {
  std::vector<StoreCase> v = {{"cpu", [](std::string*) { return cpu::MakeCpuStore(); }}};
#if DSYNC_HAVE_CUDA
  v.push_back({"cuda", [](std::string* skip) -> std::unique_ptr<ParamStore> {
                 auto s = cuda::MakeCudaStore();
                 if (s.ok()) return std::move(*s);
                 *skip = s.status().message();  // e.g. CI: compiled, no GPU to run on
                 return nullptr;
               }});
#endif
  return v;
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest, ::testing::ValuesIn(Stores()),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// Asking for the CUDA store where it cannot run is a clear error naming the way out; where
// it can, --store cuda and --store auto both give it.
TEST(StoreSelection, CudaWithoutAGpuIsAClearErrorAndAutoFallsBack) {
  Config c;
  c.store = StoreKind::kCuda;
  auto cuda = runtime::MakeParamStore(c);
  c.store = StoreKind::kAuto;
  auto any = runtime::MakeParamStore(c);
  ASSERT_TRUE(any.ok()) << any.status().ToString();
#if DSYNC_HAVE_CUDA
  if (cuda::DeviceAvailable()) {
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    EXPECT_EQ((*cuda)->name(), "cuda");
    EXPECT_EQ((*any)->name(), "cuda");
    return;
  }
#endif
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("--store cpu"), std::string::npos)
      << cuda.status().message();
  EXPECT_EQ((*any)->name(), "cpu");
}

#if DSYNC_HAVE_CUDA
// The GPU runs the same per-element math (ps/optimizer_math.h) as the CPU store; nvcc's
// fused multiply-adds are the only difference allowed.
TEST(CudaStore, MatchesTheCpuStoreWithinOneMillionthForEveryOptimizer) {
  auto gpu = cuda::MakeCudaStore();
  if (!gpu.ok()) GTEST_SKIP() << gpu.status().message();
  auto cpu = cpu::MakeCpuStore();
  for (OptimizerKind kind : {OptimizerKind::kSum, OptimizerKind::kSgd, OptimizerKind::kMomentum,
                             OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    SCOPED_TRACE(std::string(OptimizerName(kind)));
    // Sizes that are not multiples of any block, warp or vector width, and one of 4 MiB.
    for (size_t n : {size_t{1}, size_t{5}, size_t{1023}, size_t{65537}, size_t{1} << 20}) {
      const SliceKey key = MakeSliceKey(static_cast<uint32_t>(kind), static_cast<uint32_t>(n));
      const std::vector<float> init = Random(n, 7);
      ASSERT_TRUE(cpu->InitSlice(key, init).ok());
      ASSERT_TRUE((*gpu)->InitSlice(key, init).ok());
      // Rounds 2 and 3 weigh their gradients by staleness (inverse's 1/(1+s)).
      const std::vector<float> weights = {0.25f, 1.0f, 0.5f, 1.0f / 3.0f};
      for (uint32_t round = 0; round < 4; ++round) {
        std::vector<std::vector<float>> grads;
        for (uint32_t k = 0; k < round + 1; ++k) grads.push_back(Random(n, 300 + round * 10 + k));
        std::vector<const float*> ptrs;
        for (const auto& g : grads) ptrs.push_back(g.data());
        const std::span<const float> w =
            round < 2 ? std::span<const float>() : std::span<const float>(weights).first(round + 1);
        ASSERT_TRUE(cpu->ApplyRound(key, ptrs, w, Optimizer(kind)).ok());
        ASSERT_TRUE((*gpu)->ApplyRound(key, ptrs, w, Optimizer(kind)).ok());
      }
      // Two more slices through the compensated schedule, constant and adaptive: stale
      // gradients corrected toward kept versions, and some weighed.
      const SliceKey dc = MakeSliceKey(100 + static_cast<uint32_t>(kind), static_cast<uint32_t>(n));
      const SliceKey dca = MakeSliceKey(110 + static_cast<uint32_t>(kind), static_cast<uint32_t>(n));
      for (SliceKey k : {dc, dca}) {
        ASSERT_TRUE(cpu->InitSlice(k, init).ok());
        ASSERT_TRUE((*gpu)->InitSlice(k, init).ok());
        for (const CompensatedRound& r : CompensatedSchedule()) {
          const std::vector<float> dc_weights = {1.0f, 0.5f, 0.25f};
          for (ParamStore* store : {cpu.get(), gpu->get()}) {
            const Status st = ApplyCompensated(*store, k, n, Optimizer(kind), r, 0.25f, 2,
                                               r.round % 2 ? dc_weights : std::vector<float>{},
                                               k == dca);
            ASSERT_TRUE(st.ok()) << st.ToString();
          }
        }
      }
      for (SliceKey k : {key, dc, dca}) {
        std::vector<float> a(n, std::numeric_limits<float>::quiet_NaN());
        std::vector<float> b(n, std::numeric_limits<float>::quiet_NaN());  // poisoned
        ASSERT_TRUE(cpu->Read(k, a).ok());
        ASSERT_TRUE((*gpu)->Read(k, b).ok());
        // `sum` adds whole gradients: its compensations multiply differences of values that
        // grow round by round, and with them a fused multiply-add's rounding.
        const float tolerance = k != key && kind == OptimizerKind::kSum ? 1e-5f : 1e-6f;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_NEAR(b[i], a[i], tolerance * std::max(1.0f, std::abs(a[i])))
              << (k == dc ? "compensated " : k == dca ? "adaptive " : "") << "element " << i
              << " of " << n;
        }
      }
    }
  }
}
#endif

}  // namespace
}  // namespace dsync::ps
