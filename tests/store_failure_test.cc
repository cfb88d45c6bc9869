// A round a server's store cannot apply (device memory gone, say) is never skipped: the slice
// keeps its version, the round fails, and the job ends with an error naming the round and the
// slice, instead of going on with one slice behind its copies and every later round.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "cluster_harness.h"
#include "forwarding_store.h"
#include "dsync/scheduler.h"
#include "ps/server_node.h"
#include "tcp/tcp_transport.h"

namespace dsync {
namespace {

using testing::StartWorkers;
using testing::TestConfig;

constexpr uint64_t kFailingRound = 3;

// The CPU store, failing every round from kFailingRound on for tensor 1 (tensor 0 goes on).
class FailingStore final : public testing::ForwardingStore {
 public:
  std::string_view name() const override { return "failing"; }
  using ForwardingStore::ApplyRound;
  Status ApplyRound(ps::SliceKey k, std::span<const float* const> grads,
                    std::span<const float> weights, const ps::Compensation& comp,
                    const OptimizerConfig& opt) override {
    if ((k >> 32) == 1 && comp.round >= kFailingRound && !grads.empty()) {
      return Error(StatusCode::kUnavailable, "out of device memory (injected)");
    }
    return cpu_->ApplyRound(k, grads, weights, comp, opt);
  }
};

TEST(StoreFailure, ARoundTheStoreCannotApplyEndsTheJobNamingTheRoundAndSlice) {
  Config cfg = TestConfig("bsp", 1, 2);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.role = Role::kScheduler;
  auto scheduler = Scheduler::Start(cfg);
  ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  cfg.scheduler_port = (*scheduler)->port();
  auto scheduler_done = std::async(std::launch::async, [&] { return (*scheduler)->Run(); });
  Config scfg = cfg;
  scfg.role = Role::kServer;
  scfg.port = 0;
  auto server = ps::StartServer(scfg, tcp::MakeTcpTransport({}), std::make_unique<FailingStore>());
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto server_done = std::async(std::launch::async, [&] { return (*server)->Run(); });

  Config wcfg = cfg;
  wcfg.role = Role::kWorker;
  auto workers = StartWorkers(wcfg, 2);
  ASSERT_EQ(workers.size(), 2u);
  std::atomic<uint64_t> highest_version_of_b{0};
  std::vector<std::thread> threads;
  for (auto& worker : workers) {
    threads.emplace_back([&, w = worker.get()] {
      std::vector<float> a(8, 0.0f), b(8, 0.0f), ones(8, 1.0f);
      auto ta = w->Register("a", a);
      auto tb = w->Register("b", b);
      if (!ta.ok() || !tb.ok()) return;
      // Bounded: the job ends within a few rounds of the failure, and every wait then fails.
      for (int step = 0; step < 20; ++step) {
        if (!w->Wait(w->Pull(*ta, a.data())).ok()) return;
        if (!w->Wait(w->Pull(*tb, b.data())).ok()) return;
        // tensor b never shows a round its store did not apply
        EXPECT_LE(b[0], static_cast<float>(2 * kFailingRound));
        highest_version_of_b = std::max<uint64_t>(highest_version_of_b, static_cast<uint64_t>(b[0]));
        w->Push(*ta, ones.data());
        w->Push(*tb, ones.data());
        if (!w->WaitAll().ok()) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(scheduler_done.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "the job did not end";
  const Status job = scheduler_done.get();
  EXPECT_FALSE(job.ok());
  EXPECT_NE(job.message().find("applying round 3 to tensor 1 slice 0"), std::string::npos)
      << job.ToString();
  EXPECT_NE(job.message().find("out of device memory (injected)"), std::string::npos)
      << job.ToString();
  // The scheduler names the server once: the server does not name itself in what it sends.
  const size_t named = job.message().find("server ");
  ASSERT_NE(named, std::string::npos) << job.ToString();
  EXPECT_EQ(job.message().find("server ", named + 1), std::string::npos) << job.ToString();
  ASSERT_EQ(server_done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  const Status served = server_done.get();
  EXPECT_FALSE(served.ok());
  EXPECT_NE(served.message().find("applying round 3 to tensor 1 slice 0"), std::string::npos)
      << served.ToString();
  EXPECT_EQ(highest_version_of_b.load(), 2 * kFailingRound);
  for (auto& w : workers) (void)w->Leave();
}

}  // namespace
}  // namespace dsync
