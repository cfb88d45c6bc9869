// What a peer can make a node hold before it proves who it is, and what an admitted worker
// can make a server hold: bounded, and given back. A flood of idle connections costs a
// capped number of threads, all returned within the handshake timeout; a stranger's first
// frame is judged from its header alone; a silent or trickling stranger is dropped at the
// timeout; an admitted worker cannot stage more clocks than its delay bound lets it have in
// flight, and what it staged is reclaimed the moment it leaves.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster_harness.h"
#include "ps/handshake.h"
#include "ps/protocol.h"
#include "raw_client.h"

namespace dsync::testing {
namespace {

using ps::MsgType;

// AddressSanitizer keeps freed memory in quarantine (256 MiB), so RSS says nothing there.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeaningful = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeaningful = false;
#else
constexpr bool kRssMeaningful = true;
#endif
#else
constexpr bool kRssMeaningful = true;
#endif
constexpr const char* kToken = "test-token";
constexpr uint32_t kHandshakeMs = 1000;

// A field of /proc/self/status ("Threads", "VmRSS" in KiB).
uint64_t ProcStatus(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1));
  }
  return 0;
}

// A job with one real worker iterating on a count model (the sum optimizer): every element
// of the model is the number of gradients applied.
class StrangerTest : public ::testing::Test {
 protected:
  void Start(const char* sync) {
    Config cfg = TestConfig(sync, 1, 1);
    cfg.optimizer.kind = OptimizerKind::kSum;
    cfg.slice_bytes = 1024;
    cfg.handshake_timeout_ms = kHandshakeMs;
    cluster_ = std::make_unique<LocalCluster>(cfg);
    ASSERT_TRUE(cluster_->ok());
    auto workers = StartWorkers(cluster_->WorkerConfig(), 1);
    ASSERT_EQ(workers.size(), 1u);
    worker_ = std::move(workers[0]);
    auto t = worker_->Register("t", params_);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (int i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(Iterate());
  }

  void TearDown() override {
    if (worker_) worker_->Abandon();
    worker_.reset();
    cluster_.reset();
  }

  void Iterate() {
    Version v = 0;
    ASSERT_TRUE(worker_->Wait(worker_->Pull(0, params_.data()), &v).ok());
    ASSERT_EQ(params_[0], static_cast<float>(done_)) << "exactly the real gradients";
    ASSERT_TRUE(worker_->Wait(worker_->Push(0, grad_.data())).ok());
    ++done_;
  }

  uint16_t server_port() { return cluster_->server(0).port(); }

  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Worker> worker_;
  std::vector<float> params_ = std::vector<float>(600, 0.0f);  // 3 slices of 256 floats
  const std::vector<float> grad_ = std::vector<float>(600, 1.0f);
  uint64_t done_ = 0;
};

TEST_F(StrangerTest, TwoThousandIdleConnectionsCostCappedThreadsAllGivenBack) {
  ASSERT_NO_FATAL_FAILURE(Start("bsp"));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const uint64_t threads0 = ProcStatus("Threads");
  const uint64_t rss0 = ProcStatus("VmRSS");
  for (uint16_t port : {server_port(), cluster_->config().scheduler_port}) {
    SCOPED_TRACE(port == server_port() ? "server" : "scheduler");
    std::vector<int> fds;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 2000; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      ASSERT_GE(fd, 0) << std::strerror(errno);
      (void)connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      fds.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    // Every one of them came from 127.0.0.1: at most the per-source cap holds a reader and a
    // writer thread each; the rest were closed at accept.
    const uint64_t threads1 = ProcStatus("Threads");
    EXPECT_LE(threads1, threads0 + 2 * Config{}.max_pending_per_source + 2)
        << "threads during the flood";
    EXPECT_GE(threads1, threads0 + 2) << "the flood reached the node at all";
    // The cluster keeps training meanwhile.
    ASSERT_NO_FATAL_FAILURE(Iterate());
    // Within the handshake timeout (and a reaping period) it is all given back.
    std::this_thread::sleep_for(std::chrono::milliseconds(kHandshakeMs + 1200));
    EXPECT_LE(ProcStatus("Threads"), threads0 + 1) << "threads after the handshake timeout";
    if (kRssMeaningful) {
      EXPECT_LE(ProcStatus("VmRSS"), rss0 + 16 * 1024) << "KiB of memory still held";
    }
    for (int fd : fds) close(fd);
  }
  ASSERT_NO_FATAL_FAILURE(Iterate());
  std::printf("threads %lu -> %lu, RSS %lu KiB -> %lu KiB after 2 x 2000 idle connections\n",
              static_cast<unsigned long>(threads0),
              static_cast<unsigned long>(ProcStatus("Threads")),
              static_cast<unsigned long>(rss0), static_cast<unsigned long>(ProcStatus("VmRSS")));
}

TEST_F(StrangerTest, AStrangersOversizedFirstFrameIsJudgedFromItsHeaderAlone) {
  ASSERT_NO_FATAL_FAILURE(Start("bsp"));
  struct Case {
    const char* what;
    uint32_t meta_len;
    uint64_t payload_len;
  };
  for (const Case& c : {Case{"a 2 GiB payload", 10, 2ull << 30},
                        Case{"60000 bytes of metadata", 60000, 0}}) {
    SCOPED_TRACE(c.what);
    for (uint16_t port : {server_port(), cluster_->config().scheduler_port}) {
      RawClient raw;
      ASSERT_TRUE(raw.Connect(port)) << raw.error();
      FrameHeader h = ps::MakeHeader(MsgType::kHello, 0);
      h.request = 5;
      h.meta_len = c.meta_len;
      h.payload_len = c.payload_len;
      // The header alone: not one byte of what it announces follows.
      const auto sent = SteadyClock::now();
      ASSERT_TRUE(raw.SendRaw(h, {}, nullptr, 0)) << raw.error();
      auto f = raw.ReadFrame(std::chrono::milliseconds(2000));
      ASSERT_TRUE(f.has_value()) << raw.error();
      EXPECT_EQ(f->header.msg_type(), MsgType::kError);
      EXPECT_EQ(f->header.status, static_cast<uint16_t>(StatusCode::kPermissionDenied));
      EXPECT_NE(f->meta.find("the first frame must be a hello of at most 4096 bytes"),
                std::string::npos)
          << f->meta;
      EXPECT_TRUE(raw.IsClosed(std::chrono::milliseconds(2000))) << raw.error();
      EXPECT_LT(SteadyClock::now() - sent, std::chrono::milliseconds(kHandshakeMs))
          << "dropped on the header, not at the handshake timeout";
    }
  }
  ASSERT_NO_FATAL_FAILURE(Iterate());
}

TEST_F(StrangerTest, SilentAndTricklingStrangersAreDroppedAtTheHandshakeTimeout) {
  ASSERT_NO_FATAL_FAILURE(Start("bsp"));
  RawClient silent, trickle;
  ASSERT_TRUE(silent.Connect(server_port())) << silent.error();
  ASSERT_TRUE(trickle.Connect(cluster_->config().scheduler_port)) << trickle.error();
  const auto start = SteadyClock::now();
  // A byte of a hello header every 100 ms: traffic, but never a whole frame in time.
  const FrameHeader h = ps::MakeHeader(MsgType::kHello, 0);
  const auto* bytes = reinterpret_cast<const char*>(&h);
  bool trickle_closed = false;
  for (size_t i = 0; i < sizeof(h) && !trickle_closed; ++i) {
    if (!trickle.SendBytes(bytes + i, 1)) trickle_closed = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (SteadyClock::now() - start > std::chrono::milliseconds(3 * kHandshakeMs)) break;
  }
  EXPECT_TRUE(trickle_closed || trickle.IsClosed(std::chrono::milliseconds(1000)))
      << trickle.error();
  EXPECT_TRUE(silent.IsClosed(std::chrono::milliseconds(3000))) << silent.error();
  const auto elapsed = SteadyClock::now() - start;
  EXPECT_GE(elapsed, std::chrono::milliseconds(kHandshakeMs - 50));
  EXPECT_LT(elapsed, std::chrono::milliseconds(3 * kHandshakeMs));
  ASSERT_NO_FATAL_FAILURE(Iterate());
}

TEST_F(StrangerTest, AnAdmittedWorkerStagesNoMoreClocksThanItsBoundAndLeavesNothingBehind) {
  // bsp: a worker has its queued gradient and the one it pushes in flight, two clocks.
  ASSERT_NO_FATAL_FAILURE(Start("bsp"));
  Member m;
  ASSERT_TRUE(m.Join(cluster_->config().scheduler_port, kToken));
  RawClient c;
  ASSERT_TRUE(c.Connect(server_port())) << c.error();
  ASSERT_TRUE(c.SendFrame(ps::MakeHeader(MsgType::kHello, m.id()), m.HelloTo(kToken)));
  auto ack = c.ReadFrame();
  ASSERT_TRUE(ack && ack->header.msg_type() == MsgType::kHelloAck) << c.error();
  const std::vector<float> poison(256, 1000.0f);
  const Clock first = m.welcome().start_clock;
  for (Clock k = 0; k < 3; ++k) {
    FrameHeader p = ps::MakeHeader(MsgType::kPush, m.id());
    p.request = 10 + k;
    p.set_tensor(0);
    p.set_slice(0);
    p.set_clock(first + k);
    p.dtype = static_cast<uint8_t>(DType::kFloat32);
    ASSERT_TRUE(c.SendFrame(p, {}, poison.data(), poison.size() * sizeof(float)));
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << c.error();
    if (k < 2) {
      EXPECT_EQ(f->header.msg_type(), MsgType::kPushAck) << f->meta;
    } else {
      ASSERT_EQ(f->header.msg_type(), MsgType::kError);
      EXPECT_EQ(f->header.status, static_cast<uint16_t>(StatusCode::kResourceExhausted));
      EXPECT_NE(f->meta.find("already has 2 clocks staged"), std::string::npos) << f->meta;
    }
  }
  EXPECT_EQ(cluster_->server(0).stats().staged_slices, 2u);
  // It leaves: what it staged is void and given back at once.
  FrameHeader leave = ps::MakeHeader(MsgType::kLeave, m.id());
  ASSERT_TRUE(m.SendToScheduler(leave));
  const auto deadline = SteadyClock::now() + kReplyTimeout;
  while (cluster_->server(0).stats().staged_slices != 0 && SteadyClock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(cluster_->server(0).stats().staged_slices, 0u);
  m.Stop();
  ASSERT_NO_FATAL_FAILURE(Iterate());
  ASSERT_NO_FATAL_FAILURE(Iterate());
}

}  // namespace
}  // namespace dsync::testing
