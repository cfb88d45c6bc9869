// A whole job over RDMA: scheduler, two servers and two workers in one process,
// every connection an RC queue pair. The same bsp job over TCP gives the reference: the
// model must be bit for bit the same, whatever carried the bytes. Runs where an RDMA device
// is usable (in CI: inside the soft-RoCE VM, scripts/test-rdma.sh); skips elsewhere.
#include <gtest/gtest.h>

#include <thread>

#include "cluster_harness.h"
#include "runtime/backends.h"
#include "rdma/rdma_device.h"
#include "rdma/rdma_transport.h"

namespace dsync::testing {
namespace {

struct Model {
  std::vector<float> w;
  std::vector<float> big;
};

// Two workers, bsp, sgd: w is cut into several slices over both servers (eager frames), and
// `big` (1 MiB) travels by rendezvous.
Model Train(const std::string& transport, const std::string& host) {
  constexpr uint32_t kWorkers = 2, kDim = 37, kBatch = 8, kSteps = 20, kBig = 1 << 18;
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.transport = ParseTransport(transport).value();
  cfg.bind_host = host;
  cfg.scheduler_host = host;
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.05f;
  cfg.slice_bytes = 64 << 10;
  LocalCluster cluster(cfg);
  if (!cluster.ok()) return {};
  const LinearData data(kDim, 1024, 7);
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  if (workers.size() != kWorkers) return {};
  std::vector<Model> out(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> params(kDim, 0.0f), grad(kDim), big(kBig, 1.0f), big_grad(kBig);
      auto tw = w.Register("w", params);
      auto tb = w.Register("big", big);
      ASSERT_TRUE(tw.ok() && tb.ok());
      for (uint32_t step = 0; step < kSteps; ++step) {
        ASSERT_TRUE(w.Wait(w.Pull(*tw, params.data())).ok());
        ASSERT_TRUE(w.Wait(w.Pull(*tb, big.data())).ok());
        float gb = 0;
        data.Gradient(params.data(), 0.0f, (step * kWorkers + rank) * kBatch, kBatch,
                      grad.data(), &gb);
        for (uint32_t i = 0; i < kBig; ++i) {
          big_grad[i] = 0.001f * static_cast<float>((i + step + rank) % 17) - big[i] * 0.01f;
        }
        w.Push(*tw, grad.data());
        w.Push(*tb, big_grad.data());
        ASSERT_TRUE(w.WaitAll().ok());
      }
      ASSERT_TRUE(w.Wait(w.Pull(*tw, params.data())).ok());
      ASSERT_TRUE(w.Wait(w.Pull(*tb, big.data())).ok());
      out[rank] = {params, big};
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(cluster.WaitFinished().ok());
  EXPECT_EQ(out[0].w, out[1].w) << "workers disagree on the final model";
  return out[0];
}

TEST(RdmaCluster, BspJobOverRdmaEndsWithTheTcpModelBitForBit) {
  auto dev = rdma::ChooseDevice({});
  if (!dev.ok()) GTEST_SKIP() << dev.status().message();
  const Model tcp = Train("tcp", "127.0.0.1");
  const Model rdma = Train("rdma", dev->ipv4);
  ASSERT_EQ(tcp.w.size(), 37u);
  ASSERT_EQ(rdma.w.size(), tcp.w.size());
  EXPECT_EQ(rdma.w, tcp.w);
  EXPECT_EQ(rdma.big, tcp.big);
  EXPECT_NE(rdma.w, std::vector<float>(37, 0.0f));  // it trained
}

// A buffer registered for speed, then unregistered and freed, may come back at the same
// address with other pages behind it: the next pull must land in the new pages (a stale
// registration would write into the old ones and leave the poison in place).
TEST(RdmaCluster, RegisteredBuffersFreedAndAllocatedAgainGetTheRightData) {
  auto dev = rdma::ChooseDevice({});
  if (!dev.ok()) GTEST_SKIP() << dev.status().message();
  constexpr size_t kN = 1 << 16;  // 256 KiB: by rendezvous, straight into the buffer
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.transport = TransportKind::kRdma;
  cfg.bind_host = dev->ipv4;
  cfg.scheduler_host = dev->ipv4;
  cfg.optimizer.kind = OptimizerKind::kSum;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  Worker& w = *workers[0];
  auto t = w.Register("w", std::vector<float>(kN, 1.0f));
  ASSERT_TRUE(t.ok());
  const std::vector<float> ones(kN, 1.0f);
  for (int round = 0; round < 6; ++round) {
    std::vector<float> buf(kN, -7.0f);  // poisoned; often the pages of the last iteration's
    ASSERT_TRUE(w.RegisterBuffer(buf.data(), kN * sizeof(float)).ok());
    ASSERT_TRUE(w.Wait(w.Pull(*t, buf.data())).ok());
    for (size_t i = 0; i < kN; i += 4093) {
      ASSERT_EQ(buf[i], 1.0f + static_cast<float>(round)) << "round " << round << " element " << i;
    }
    ASSERT_EQ(buf[kN - 1], 1.0f + static_cast<float>(round));
    w.Push(*t, ones.data());
    ASSERT_TRUE(w.WaitAll().ok());
    w.UnregisterBuffer(buf.data(), kN * sizeof(float));
  }
  ASSERT_TRUE(w.Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
}

TEST(RdmaCluster, AServerOnLoopbackIsRefusedWithTheAddressToUse) {
  auto dev = rdma::ChooseDevice({});
  if (!dev.ok()) GTEST_SKIP() << dev.status().message();
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.transport = TransportKind::kRdma;
  auto c = InProcessCluster::Start(cfg);  // binds 127.0.0.1, which no RDMA device has
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(dev->ipv4), std::string::npos) << c.status().message();
}

TEST(RdmaDevice, TheInterfacePicksTheDeviceOnThatNic) {
  auto dev = rdma::ChooseDevice({});
  if (!dev.ok()) GTEST_SKIP() << dev.status().message();
  rdma::DeviceOptions on_it;
  on_it.interface_ip = dev->ipv4;
  auto same = rdma::ChooseDevice(on_it);
  ASSERT_TRUE(same.ok()) << same.status().message();
  EXPECT_EQ(same->device, dev->device);
  EXPECT_EQ(same->netdev, dev->netdev);
  // A node told to use an address no RDMA device carries is not handed another NIC's device.
  rdma::DeviceOptions elsewhere;
  elsewhere.interface_ip = "192.0.2.77";
  auto none = rdma::ChooseDevice(elsewhere);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no RoCE v2 GID for 192.0.2.77"), std::string::npos)
      << none.status().message();
  // Through the node's configuration: --interface by NIC name, then by another address.
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.transport = TransportKind::kRdma;
  cfg.bind_host = dev->netdev;
  auto t = runtime::MakeTransport(cfg);
  EXPECT_TRUE(t.ok()) << t.status().message();
  cfg.bind_host = "192.0.2.77";
  auto refused = runtime::MakeTransport(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("192.0.2.77"), std::string::npos)
      << refused.status().message();
}

// GPUDirect RDMA needs the NIC's kernel driver to import dma-bufs. Soft-RoCE's cannot: the
// transport must say so (a server with --gpudirect auto then logs it and stages through
// pinned host memory, as every job above does), and a GPU that cannot export is reported
// before the NIC is asked.
class NoGpuMemory final : public ps::DeviceMemory {
 public:
  std::string unsupported;
  bool Contains(const void*, size_t) const override { return false; }
  Result<int> ExportDmaBuf(const void*, size_t) const override {
    return Error(StatusCode::kUnimplemented, "no GPU");
  }
  std::string DmaBufUnsupported() const override { return unsupported; }
};

TEST(RdmaGpuDirect, ADeviceWithoutDmaBufSaysItCannotRegisterGpuMemory) {
  auto dev = rdma::ChooseDevice({});
  if (!dev.ok()) GTEST_SKIP() << dev.status().message();
  auto t = rdma::MakeRdmaTransport({});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  NoGpuMemory memory;
  memory.unsupported = "GPU 0 cannot export its memory as a dma-buf (test)";
  auto r = (*t)->EnableDeviceMemory(&memory);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), memory.unsupported);
  memory.unsupported.clear();
  r = (*t)->EnableDeviceMemory(&memory);
  if (dev->device.rfind("rxe", 0) != 0 && r.ok()) {
    GTEST_SKIP() << dev->device << " supports dma-buf registration";
  }
  ASSERT_FALSE(r.ok()) << dev->device << " should not support dma-buf";
  EXPECT_NE(r.status().message().find("RDMA device " + dev->device + " cannot register GPU memory"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("ibv_reg_dmabuf_mr"), std::string::npos);
}

}  // namespace
}  // namespace dsync::testing
