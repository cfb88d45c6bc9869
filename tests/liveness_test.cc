// Liveness judged fairly: a node judges a peer silent only for time it was not itself
// stalled, and never while frames the peer sent sit unread. Here the scheduler's frames
// are held undelivered (as a stalled or starved reader would leave them in the socket) for
// twice the heartbeat timeout: no worker is evicted and no server declared hung, and the job
// goes on as if nothing happened once they are read.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <set>

#include "cluster_harness.h"
#include "ps/scheduler_node.h"
#include "wrapped_transport.h"

namespace dsync::testing {
namespace {

using namespace std::chrono_literals;

// Holds every frame in its reader while `held`: the peer's frames stay unread, which
// HasUnreadInput reports, exactly as a socket full of heartbeats nobody read yet.
class HeldFrames final : public WrappedTcp {
 public:
  void Hold(bool on) {
    std::lock_guard lock(mu_);
    held_ = on;
    cv_.notify_all();
  }
  void OnFrame(ps::PeerId peer, const ps::FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override {
    {
      std::unique_lock lock(mu_);
      waiting_.insert(peer);
      cv_.wait(lock, [&] { return !held_; });
      waiting_.erase(peer);
    }
    WrappedTcp::OnFrame(peer, h, meta, payload);
  }
  bool HasUnreadInput(ps::PeerId peer) const override {
    {
      std::lock_guard lock(mu_);
      if (waiting_.contains(peer)) return true;
    }
    return WrappedTcp::HasUnreadInput(peer);
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  std::set<ps::PeerId> waiting_;
};

TEST(Liveness, PeersWhoseFramesSitUnreadAreNotJudgedSilent) {
  Config cfg = TestConfig("bsp", 1, 2);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.heartbeat_interval_ms = 50;
  cfg.heartbeat_timeout_ms = 400;
  auto held = std::make_unique<HeldFrames>();
  HeldFrames* gate = held.get();
  auto scheduler = ps::StartScheduler(cfg, std::move(held));
  ASSERT_TRUE(scheduler.ok()) << scheduler.status().ToString();
  auto job = std::async(std::launch::async, [&] { return (*scheduler)->Run(); });
  Config node = cfg;
  node.scheduler_port = (*scheduler)->port();
  auto server = Server::Start(node);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto served = std::async(std::launch::async, [&] { return (*server)->Run(); });
  auto workers = StartWorkers(node, 2);
  ASSERT_EQ(workers.size(), 2u);
  std::vector<float> params(10, 0.0f), grad(10, 1.0f);
  for (auto& w : workers) ASSERT_TRUE(w->Register("t", params).ok());

  gate->Hold(true);
  std::this_thread::sleep_for(2 * 400ms);
  const SchedulerStats during = (*scheduler)->stats();
  EXPECT_EQ(during.workers_failed, 0u) << "a worker whose heartbeats sit unread is alive";
  EXPECT_EQ(during.live_workers, 2u);
  EXPECT_NE(job.wait_for(0s), std::future_status::ready)
      << "a server whose heartbeats sit unread is not hung: " << job.get().ToString();
  gate->Hold(false);

  // Training goes on, and ends cleanly.
  for (int i = 0; i < 3; ++i) {
    std::vector<Handle> pushes;
    for (auto& w : workers) {
      ASSERT_TRUE(w->Wait(w->Pull(0, params.data())).ok());
      pushes.push_back(w->Push(0, grad.data()));
    }
    for (size_t k = 0; k < workers.size(); ++k) ASSERT_TRUE(workers[k]->Wait(pushes[k]).ok());
  }
  for (auto& w : workers) ASSERT_TRUE(w->Leave().ok());
  ASSERT_EQ(job.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(job.get().ok());
  EXPECT_TRUE(served.get().ok());
  EXPECT_EQ((*scheduler)->stats().workers_failed, 0u);
  EXPECT_EQ((*scheduler)->stats().gradients_committed, 6u);
}

}  // namespace
}  // namespace dsync::testing
