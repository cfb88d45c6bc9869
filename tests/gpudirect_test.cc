// GPUDirect RDMA routing in the server, without a GPU or a NIC: a store whose
// "device memory" is tracked host memory, and a TCP transport that claims it can move
// payloads of at least kDirectMin bytes to and from that memory. The server must put exactly
// those payloads there (pushes, initial values, pull replies), register every such buffer
// with the transport, keep small ones in host memory, and compute the same model bit for bit
// as a server without GPUDirect. The real pieces are tested where they can run: the RDMA
// side against soft-RoCE in the VM (rdma_cluster_test), the CUDA side on a GPU (store_test).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "cluster_harness.h"
#include "forwarding_store.h"
#include "cpu/cpu_store.h"
#include "dsync/scheduler.h"
#include "ps/server_node.h"
#include "tcp/tcp_transport.h"
#include "wrapped_transport.h"

namespace dsync {
namespace {

using testing::StartWorkers;
using testing::WrappedTcp;
using testing::TestConfig;

constexpr uint64_t kDirectMin = 16 * 1024;
constexpr size_t kBig = 6000;  // floats: 24000-byte payloads, above kDirectMin
constexpr size_t kSmall = 100;
constexpr uint32_t kWorkers = 2, kSteps = 12;

class FakeDeviceMemory final : public ps::DeviceMemory {
 public:
  ~FakeDeviceMemory() override {
    for (auto& [p, n] : blocks_) std::free(reinterpret_cast<void*>(p));
  }
  void* Allocate(size_t bytes) {
    const size_t size = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, size);
    std::memset(p, 0xff, size);  // NaN everywhere: a buffer read before it is filled shows
    std::lock_guard lock(mu_);
    blocks_[reinterpret_cast<uintptr_t>(p)] = size;
    ++allocations_;
    return p;
  }
  void Free(void* p) {
    std::lock_guard lock(mu_);
    blocks_.erase(reinterpret_cast<uintptr_t>(p));
    std::free(p);
  }
  bool Contains(const void* ptr, size_t bytes) const override {
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard lock(mu_);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return false;
    --it;
    return p + bytes <= it->first + it->second;
  }
  Result<int> ExportDmaBuf(const void*, size_t) const override {
    return Error(StatusCode::kUnimplemented, "a fake GPU exports nothing");
  }
  std::string DmaBufUnsupported() const override { return {}; }
  uint64_t allocations() const {
    std::lock_guard lock(mu_);
    return allocations_;
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> blocks_;
  uint64_t allocations_ = 0;
};

// The CPU store with fake device memory: it computes on host memory, so "device" payloads
// are read like any other.
class FakeGpuStore final : public testing::ForwardingStore {
 public:
  explicit FakeGpuStore(FakeDeviceMemory* memory) : memory_(memory) {}
  std::string_view name() const override { return "fake-gpu"; }
  void* AllocateDevice(size_t bytes) override { return memory_->Allocate(bytes); }
  void FreeDevice(void* p, size_t) override { memory_->Free(p); }
  const ps::DeviceMemory* device_memory() const override { return memory_; }

 private:
  FakeDeviceMemory* memory_;
};

struct DirectCounts {
  uint64_t device_received = 0, host_received = 0, device_sent = 0, host_sent = 0;
  uint64_t device_registered = 0, violations = 0;
};

// What a DirectTcp saw, shared with the test: the server destroys its transport when the job
// ends, and the test reads the counts after that.
struct DirectLog {
  DirectCounts Read() const {
    std::lock_guard lock(mu);
    return counts;
  }
  mutable std::mutex mu;
  DirectCounts counts;
};

// TCP underneath, GPUDirect claimed on top; every payload the server hands it is checked
// against the rule EnableDeviceMemory states.
class DirectTcp final : public WrappedTcp {
 public:
  DirectTcp(std::shared_ptr<DirectLog> log, bool can, bool register_fails = false)
      : log_(std::move(log)), can_(can), register_fails_(register_fails) {}

  std::string_view name() const override { return "direct-tcp"; }
  Status Send(ps::PeerId peer, ps::FrameHeader h, std::span<const std::byte> meta,
              const void* payload, uint64_t len, ps::SendDone done) override {
    if (len > 0) Check(payload, len, /*receive=*/false);
    return WrappedTcp::Send(peer, h, meta, payload, len, std::move(done));
  }
  Status RegisterMemory(const void* p, size_t bytes) override {
    std::lock_guard lock(mu_);
    if (memory_ && memory_->Contains(p, bytes)) {
      if (register_fails_) {
        return Error(StatusCode::kUnavailable, "ibv_reg_dmabuf_mr failed (test)");
      }
      std::lock_guard log_lock(log_->mu);
      ++log_->counts.device_registered;
    }
    return Status::Ok();
  }
  Result<uint64_t> EnableDeviceMemory(const ps::DeviceMemory* memory) override {
    if (!can_) return Error(StatusCode::kUnimplemented, "this NIC cannot (test)");
    std::lock_guard lock(mu_);
    memory_ = memory;
    return kDirectMin;
  }

  void* OnHeader(ps::PeerId peer, const ps::FrameHeader& h,
                 std::span<const std::byte> meta) override {
    void* p = WrappedTcp::OnHeader(peer, h, meta);
    if (p && h.payload_len > 0) Check(p, h.payload_len, /*receive=*/true);
    return p;
  }

 private:
  void Check(const void* p, uint64_t len, bool receive) {
    std::lock_guard lock(mu_);
    const bool device = memory_ && memory_->Contains(p, len);
    std::lock_guard log_lock(log_->mu);
    DirectCounts& c = log_->counts;
    if (device) {
      ++(receive ? c.device_received : c.device_sent);
      if (len < kDirectMin) ++c.violations;  // the CPU would have to copy it
    } else {
      ++(receive ? c.host_received : c.host_sent);
      if (memory_ && len >= kDirectMin) ++c.violations;  // staged for nothing
    }
  }

  const std::shared_ptr<DirectLog> log_;
  const bool can_;
  const bool register_fails_;  // the probe passed, but mapping GPU memory fails
  mutable std::mutex mu_;
  const ps::DeviceMemory* memory_ = nullptr;
};

struct JobResult {
  std::vector<float> big, small;
  ServerStats stats;
};

// One scheduler, one server with the given backends, kWorkers workers pushing gradients
// that depend on the model they pulled, so that any wrong byte changes the end result.
Result<JobResult> RunJob(Config cfg, std::unique_ptr<ps::Transport> transport,
                         std::unique_ptr<ps::ParamStore> store) {
  cfg.role = Role::kScheduler;
  DSYNC_ASSIGN_OR_RETURN(auto scheduler, Scheduler::Start(cfg));
  cfg.scheduler_port = scheduler->port();
  auto scheduler_done = std::async(std::launch::async, [&] { return scheduler->Run(); });
  Config scfg = cfg;
  scfg.role = Role::kServer;
  scfg.port = 0;
  auto server = ps::StartServer(scfg, std::move(transport), std::move(store));
  if (!server.ok()) {
    scheduler->Stop();
    (void)scheduler_done.get();
    return server.status();
  }
  auto server_done = std::async(std::launch::async, [&] { return (*server)->Run(); });

  Config wcfg = cfg;
  wcfg.role = Role::kWorker;
  auto workers = StartWorkers(wcfg, kWorkers);
  JobResult out;
  std::vector<std::thread> threads;
  std::mutex out_mu;
  for (uint32_t rank = 0; rank < workers.size(); ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> big(kBig), small(kSmall), gbig(kBig), gsmall(kSmall);
      for (size_t i = 0; i < kBig; ++i) big[i] = std::sin(0.01f * static_cast<float>(i));
      for (size_t i = 0; i < kSmall; ++i) small[i] = std::cos(0.1f * static_cast<float>(i));
      auto tb = w.Register("big", big);
      auto ts = w.Register("small", small);
      ASSERT_TRUE(tb.ok() && ts.ok());
      for (uint32_t step = 0; step < kSteps; ++step) {
        ASSERT_TRUE(w.Wait(w.Pull(*tb, big.data())).ok());
        ASSERT_TRUE(w.Wait(w.Pull(*ts, small.data())).ok());
        for (size_t i = 0; i < kBig; ++i) {
          gbig[i] = std::sin(big[i] * static_cast<float>(rank + 2) + 0.3f * static_cast<float>(step));
        }
        for (size_t i = 0; i < kSmall; ++i) gsmall[i] = small[i] * static_cast<float>(rank + 1) - 0.5f;
        w.Push(*tb, gbig.data());
        w.Push(*ts, gsmall.data());
        ASSERT_TRUE(w.WaitAll().ok());
      }
      ASSERT_TRUE(w.Wait(w.Pull(*tb, big.data())).ok());
      ASSERT_TRUE(w.Wait(w.Pull(*ts, small.data())).ok());
      if (rank == 0) {
        std::lock_guard lock(out_mu);
        out.big = big;
        out.small = small;
      }
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  if (scheduler_done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    scheduler->Stop();
    (*server)->Stop();
    return Error(StatusCode::kDeadlineExceeded, "the job did not finish");
  }
  DSYNC_RETURN_IF_ERROR(scheduler_done.get());
  DSYNC_RETURN_IF_ERROR(server_done.get());
  out.stats = (*server)->stats();
  return out;
}

Config JobConfig(const char* gpudirect) {
  Config cfg = TestConfig("bsp", 1, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kMomentum;
  cfg.optimizer.lr = 0.01f;
  cfg.gpudirect = ParseGpuDirect(gpudirect).value();
  return cfg;
}

TEST(GpuDirect, LargePayloadsGoToDeviceMemorySmallOnesStayOnTheHostAndTheModelIsExact) {
  auto reference = RunJob(JobConfig("off"), tcp::MakeTcpTransport({}),
                          cpu::MakeCpuStore());
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  EXPECT_EQ(reference->stats.device_buffers, 0u);

  FakeDeviceMemory memory;
  auto log = std::make_shared<DirectLog>();
  auto job = RunJob(JobConfig("on"), std::make_unique<DirectTcp>(log, /*can=*/true),
                    std::make_unique<FakeGpuStore>(&memory));
  ASSERT_TRUE(job.ok()) << job.status().ToString();

  ASSERT_EQ(job->big.size(), kBig);
  ASSERT_EQ(job->small.size(), kSmall);
  EXPECT_EQ(0, std::memcmp(job->big.data(), reference->big.data(), kBig * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(job->small.data(), reference->small.data(), kSmall * sizeof(float)));
  EXPECT_NE(job->big[0], std::sin(0.0f)) << "the model should have moved";

  const DirectCounts c = log->Read();
  EXPECT_EQ(c.violations, 0u);
  // Every push of the big tensor (and its initial values) arrived in device memory; every
  // pull reply of it left from there; the small tensor never touched it.
  EXPECT_GE(c.device_received, uint64_t{kWorkers} * kSteps + 1);
  EXPECT_GE(c.device_sent, uint64_t{kWorkers} * (kSteps + 1));
  EXPECT_GE(c.host_received, uint64_t{kWorkers} * kSteps);
  EXPECT_GE(c.host_sent, uint64_t{kWorkers} * (kSteps + 1));
  // Pooled: a handful of device buffers, each registered with the transport once.
  EXPECT_GT(job->stats.device_buffers, 0u);
  EXPECT_LE(job->stats.device_buffers, 16u);
  EXPECT_EQ(memory.allocations(), job->stats.device_buffers);
  EXPECT_EQ(c.device_registered, job->stats.device_buffers);
}

TEST(GpuDirect, AutoStagesThroughHostMemoryWhenTheTransportCannot) {
  FakeDeviceMemory memory;
  auto log = std::make_shared<DirectLog>();
  auto job = RunJob(JobConfig("auto"), std::make_unique<DirectTcp>(log, /*can=*/false),
                    std::make_unique<FakeGpuStore>(&memory));
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->stats.device_buffers, 0u);
  EXPECT_EQ(memory.allocations(), 0u);
  EXPECT_EQ(log->Read().device_received + log->Read().device_sent, 0u);
}

// The NIC passed the start-up probe but cannot map GPU memory after all (IOMMU, PCIe
// topology): the first failure turns GPUDirect off for good, and the job goes on through
// host memory with the same result.
TEST(GpuDirect, ARegistrationFailureFallsBackToHostMemoryOnceAndForAll) {
  auto reference = RunJob(JobConfig("off"), tcp::MakeTcpTransport({}), cpu::MakeCpuStore());
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  FakeDeviceMemory memory;
  auto log = std::make_shared<DirectLog>();
  auto job = RunJob(JobConfig("on"),
                    std::make_unique<DirectTcp>(log, /*can=*/true, /*register_fails=*/true),
                    std::make_unique<FakeGpuStore>(&memory));
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(0, std::memcmp(job->big.data(), reference->big.data(), kBig * sizeof(float)));
  EXPECT_EQ(job->stats.device_buffers, 0u);
  // One failed try, or one per connection whose payload raced the first failure.
  EXPECT_GE(memory.allocations(), 1u);
  EXPECT_LE(memory.allocations(), uint64_t{kWorkers});
  const DirectCounts c = log->Read();
  EXPECT_EQ(c.device_received + c.device_sent, 0u);
}

TEST(GpuDirect, OnFailsToStartSayingWhy) {
  {
    FakeDeviceMemory memory;
    auto job = RunJob(JobConfig("on"),
                      std::make_unique<DirectTcp>(std::make_shared<DirectLog>(), /*can=*/false),
                      std::make_unique<FakeGpuStore>(&memory));
    ASSERT_FALSE(job.ok());
    EXPECT_NE(job.status().message().find("--gpudirect on"), std::string::npos);
    EXPECT_NE(job.status().message().find("this NIC cannot (test)"), std::string::npos)
        << job.status().message();
  }
  {
    auto job = RunJob(JobConfig("on"), tcp::MakeTcpTransport({}), cpu::MakeCpuStore());
    ASSERT_FALSE(job.ok());
    EXPECT_NE(job.status().message().find("the cpu store keeps parameters in host memory"),
              std::string::npos)
        << job.status().message();
  }
  {
    FakeDeviceMemory memory;
    auto job = RunJob(JobConfig("on"), tcp::MakeTcpTransport({}),
                      std::make_unique<FakeGpuStore>(&memory));
    ASSERT_FALSE(job.ok());
    EXPECT_NE(job.status().message().find("the tcp transport cannot reach GPU memory"),
              std::string::npos)
        << job.status().message();
  }
}

TEST(GpuDirect, ConfigAcceptsAutoOnOffOnly) {
  for (const char* ok : {"auto", "on", "off"}) {
    auto c = Config::FromEnvironment({{"DSYNC_GPUDIRECT", ok}});
    ASSERT_TRUE(c.ok()) << ok;
    EXPECT_EQ(GpuDirectName(c->gpudirect), ok);
  }
  auto bad = Config::FromEnvironment({{"DSYNC_GPUDIRECT", "yes"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("gpudirect 'yes' is not one of auto, on, off"),
            std::string::npos);
}

}  // namespace
}  // namespace dsync
