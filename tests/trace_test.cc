// NVTX ranges: the PS roles and the store emit named ranges around push, pull,
// aggregate, apply and waiting for the bound. Checked through NVTX's own injection interface
// (tests/nvtx_recorder.cc), i.e. what nsys would receive, on the CPU path.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "cluster_harness.h"
#include "nvtx_recorder.h"
#include "ps/trace.h"

namespace dsync::testing {
namespace {

using trace::Range;

TEST(Trace, RangeNamesSayTheLayerAndAreDistinct) {
  std::set<std::string_view> names;
  for (int i = 0; i < static_cast<int>(Range::kCount); ++i) {
    const std::string_view n = trace::Name(static_cast<Range>(i));
    EXPECT_TRUE(n.starts_with("worker: ") || n.starts_with("server: ") ||
                n.starts_with("store: "))
        << n;
    EXPECT_TRUE(names.insert(n).second) << "duplicate range name " << n;
  }
}

// The recorder (nvtx_recorder.cc) is linked only where NVTX is.
#if DSYNC_HAVE_NVTX
bool Contains(const std::vector<NvtxRecord>& v, std::string_view name) {
  return std::any_of(v.begin(), v.end(), [&](const NvtxRecord& r) { return r.name == name; });
}

// Worker 1 pushes late, so worker 0's pull of the next model is held back by the bound
// (bsp): that wait must show as "worker: wait for bound".
TEST(Trace, RolesAndTheCpuStoreEmitNamedNvtxRanges) {
  ASSERT_TRUE(trace::Enabled());
  Config cfg = TestConfig("bsp", 1, 2);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.store = StoreKind::kCpu;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 2);
  ASSERT_EQ(workers.size(), 2u);
  constexpr int kSteps = 2;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> params(100, 1.0f), grad(100, 0.5f);
      auto t = w.Register("w", params);
      ASSERT_TRUE(t.ok());
      for (int step = 0; step < kSteps; ++step) {
        ASSERT_TRUE(w.Wait(w.Pull(*t, params.data())).ok());
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        const Handle push = w.Push(*t, grad.data());
        ASSERT_TRUE(w.Wait(push).ok());
      }
      ASSERT_TRUE(w.Wait(w.Pull(*t, params.data())).ok());
      EXPECT_FLOAT_EQ(params[0], 1.0f + 2 * kSteps * 0.5f);
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());
  workers.clear();

  const NvtxSnapshot s = NvtxRecorded();
  ASSERT_TRUE(s.injected) << "NVTX never called the injection's initialization";
  EXPECT_EQ(std::count(s.domains.begin(), s.domains.end(), "dsyncps"), 1);
  EXPECT_EQ(s.categories.at(1), "worker");
  EXPECT_EQ(s.categories.at(2), "server");
  EXPECT_EQ(s.categories.at(3), "store");
  for (int i = 0; i < static_cast<int>(Range::kCount); ++i) {
    const std::string name(trace::Name(static_cast<Range>(i)));
    EXPECT_EQ(std::count(s.registered.begin(), s.registered.end(), name), 1) << name;
  }
  for (const char* name : {"worker: push", "worker: wait for bound", "server: push",
                           "server: pull", "server: round", "store: apply", "store: read"}) {
    EXPECT_TRUE(Contains(s.pushed, name)) << name << " was never pushed";
  }
  EXPECT_TRUE(Contains(s.started, "worker: pull"));
  // Layer categories travel with every range.
  for (const NvtxRecord& r : s.pushed) {
    const uint32_t want = r.name.starts_with("worker") ? 1 : r.name.starts_with("server") ? 2 : 3;
    EXPECT_EQ(r.category, want) << r.name;
  }
  // Rounds carry their number: round 0 shows no payload, later rounds theirs.
  std::set<uint64_t> rounds;
  for (const NvtxRecord& r : s.pushed) {
    if (r.name == "server: round" && r.has_payload) rounds.insert(r.payload);
  }
  EXPECT_EQ(rounds, (std::set<uint64_t>{1}));
  // Every range ends: a profile with dangling ranges reads wrong.
  EXPECT_EQ(s.open_pushes, 0);
  EXPECT_EQ(s.unbalanced_pops, 0);
  EXPECT_EQ(s.open_starts, 0);
  EXPECT_EQ(s.unknown_ends, 0);
}
#else
TEST(Trace, RolesAndTheCpuStoreEmitNamedNvtxRanges) {
  GTEST_SKIP() << "built without NVTX3 headers (they come with the CUDA toolkit)";
}
#endif

}  // namespace
}  // namespace dsync::testing
