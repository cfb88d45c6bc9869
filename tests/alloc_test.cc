// "Nothing on the hot path allocates per message in steady state" (docs/design.md), measured:
// this binary counts every heap allocation of the process, and a push+pull iteration over a
// tensor of 64 slices must allocate no more than one over a tensor of 4 slices. What remains
// per iteration is control traffic (one commit, one round), independent of the data size.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "cluster_harness.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};

void* Allocate(size_t n, size_t align) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align)
                                              : std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t n) { return Allocate(n, 0); }
void* operator new[](size_t n) { return Allocate(n, 0); }
void* operator new(size_t n, std::align_val_t a) { return Allocate(n, static_cast<size_t>(a)); }
void* operator new[](size_t n, std::align_val_t a) { return Allocate(n, static_cast<size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace dsync::testing {
namespace {

// Allocations per push+pull iteration in steady state, for a tensor of `slices` slices.
double AllocationsPerIteration(uint32_t slices) {
  constexpr uint32_t kSliceFloats = 1024;
  Config cfg = TestConfig("bsp", 2, 1);
  cfg.slice_bytes = kSliceFloats * sizeof(float);
  LocalCluster cluster(cfg);
  EXPECT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  EXPECT_EQ(workers.size(), 1u);
  Worker& w = *workers[0];
  std::vector<float> params(slices * kSliceFloats, 0.5f), grad(params.size(), 0.01f);
  auto t = w.Register("t", params);
  EXPECT_TRUE(t.ok());
  auto iterate = [&] {
    EXPECT_TRUE(w.Wait(w.Pull(*t, params.data())).ok());
    EXPECT_TRUE(w.Wait(w.Push(*t, grad.data())).ok());
  };
  for (int i = 0; i < 20; ++i) iterate();  // pools and queues reach their steady size
  constexpr int kIters = 50;
  g_allocations = 0;
  g_counting = true;
  for (int i = 0; i < kIters; ++i) iterate();
  g_counting = false;
  const double per_iter = static_cast<double>(g_allocations.load()) / kIters;
  EXPECT_TRUE(w.Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
  return per_iter;
}

TEST(Allocations, DoNotGrowWithTheNumberOfDataMessages) {
  const double small = AllocationsPerIteration(4);
  const double large = AllocationsPerIteration(64);
  std::printf("heap allocations per push+pull iteration: 4 slices %.2f, 64 slices %.2f\n", small,
              large);
  // 64 slices = 256 data frames and as many acknowledgements per iteration: one allocation
  // per message would add hundreds. The slack absorbs what scales with time rather than
  // messages (heartbeats of a slower run on a loaded machine).
  EXPECT_LE(large, small + 3.0);
}

}  // namespace
}  // namespace dsync::testing
