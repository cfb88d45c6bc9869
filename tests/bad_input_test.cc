// Hostile and broken peers against a running job: raw sockets on 127.0.0.1 feed a server
// and the scheduler frames no real node would send (no hello, a wrong token, unknown
// tensors, wrong lengths and dtypes, truncated frames, another protocol version, random
// bytes, oversized lengths, duplicate pushes). The raw client that gets past a server's
// door is a token holder the scheduler admitted (raw_client.h's Member): what it sends
// after that is what an admitted but buggy or hostile worker could send. Each case checks the node's specific answer
// (or that it dropped the connection), that it keeps serving a real worker, that the model
// is unchanged (the `sum` optimizer makes every element count the gradients applied), and
// that the server's refusal counters moved as expected. Refusals that also drop the link
// must deliver their error frame before the close, and are checked in the node's log too.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cluster_harness.h"
#include "ps/commit_proof.h"
#include "ps/handshake.h"
#include "ps/protocol.h"
#include "raw_client.h"

namespace dsync::testing {
namespace {

using namespace std::chrono_literals;
using ps::FrameHeader;
using ps::MsgType;
constexpr uint64_t kSliceBytes = 1024;    // 256 float32 per slice
constexpr size_t kBig = 1000;             // tensor 0: slices of 256, 256, 256, 232 floats
constexpr size_t kSmall = 3;              // tensor 1: one slice of 3 floats
constexpr uint32_t kSliceFloats = kSliceBytes / sizeof(float);
constexpr WorkerId kFakeWorker = 1999;    // an id nobody was admitted as
constexpr const char* kToken = "test-token";
constexpr int kSetupIterations = 3;

std::string HelloMeta(std::string token, WorkerId node = kFakeWorker, Role role = Role::kWorker) {
  ps::Hello hello;
  hello.role = role;
  hello.token = std::move(token);
  hello.node = node;
  return ps::EncodeHello(hello);
}

FrameHeader Header(MsgType type, uint64_t request) {
  FrameHeader h = ps::MakeHeader(type, kFakeWorker);
  h.request = request;
  return h;
}

FrameHeader PushHeader(uint32_t tensor, uint32_t slice, Clock clock, uint64_t request) {
  FrameHeader h = Header(MsgType::kPush, request);
  h.set_tensor(tensor);
  h.set_slice(slice);
  h.set_clock(clock);
  h.dtype = static_cast<uint8_t>(DType::kFloat32);
  return h;
}

FrameHeader PullHeader(uint32_t tensor, uint32_t slice, uint64_t request) {
  FrameHeader h = Header(MsgType::kPull, request);
  h.set_tensor(tensor);
  h.set_slice(slice);
  h.set_min_version(0);  // any version: answer now
  return h;
}

std::string LearningRateMeta(float lr) {
  std::vector<std::byte> meta;
  ps::EncodeLearningRate(lr, meta);
  return std::string(ps::AsText(meta));
}

// A gradient no real push sends: applied even once it would show in every element.
std::vector<float> Poison(size_t n) { return std::vector<float>(n, 1000.0f); }

// The frame is a kError refusing `about` (request echoed) with `code`, mentioning each text.
void ExpectError(const std::optional<Frame>& f, const RawClient& c, StatusCode code,
                 MsgType about, uint64_t request, const std::vector<std::string>& mentions) {
  ASSERT_TRUE(f.has_value()) << "no error frame: " << c.error();
  EXPECT_EQ(f->header.magic, ps::kFrameMagic);
  EXPECT_EQ(f->header.version, ps::kProtocolVersion);
  ASSERT_EQ(f->header.msg_type(), MsgType::kError)
      << "got " << ps::MsgTypeName(f->header.msg_type()) << " instead";
  EXPECT_EQ(f->header.status, static_cast<uint16_t>(code))
      << "got " << StatusCodeName(static_cast<StatusCode>(f->header.status)) << ": " << f->meta;
  EXPECT_EQ(f->header.refused(), about) << "kError names the refused request";
  EXPECT_EQ(f->header.request, request);
  EXPECT_EQ(f->header.payload_len, 0u);
  for (const std::string& m : mentions) {
    EXPECT_NE(f->meta.find(m), std::string::npos) << "'" << m << "' not in: " << f->meta;
  }
}

struct Counters {
  uint64_t refused = 0;
  uint64_t dropped = 0;
  uint64_t pushes = 0;
  uint64_t staging = 0;
};

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CaptureSink::Get().Clear();
    // Quorum 1 and a large bound: the admitted raw client (member_), a live worker that
    // never commits, holds no round; each round is the real worker's one gradient.
    Config cfg = TestConfig("dsync:1000,1", 2, 1);
    cfg.optimizer.kind = OptimizerKind::kSum;
    cfg.slice_bytes = kSliceBytes;
    cluster_ = std::make_unique<LocalCluster>(cfg);
    ASSERT_TRUE(cluster_->ok());
    auto workers = StartWorkers(cluster_->WorkerConfig(), 1);
    ASSERT_EQ(workers.size(), 1u);
    worker_ = std::move(workers[0]);
    auto ta = worker_->Register("a", a_);
    auto tb = worker_->Register("b", b_);
    ASSERT_TRUE(ta.ok()) << ta.status().ToString();
    ASSERT_TRUE(tb.ok()) << tb.status().ToString();
    ASSERT_EQ(*ta, 0u);
    ASSERT_EQ(*tb, 1u);
    // Placement is round-robin over server ranks (= ids 1, 2): tensor 0's slices 0 and 2 and
    // tensor 1's slice 0 live on rank 0; tensor 0's slices 1 and 3 on rank 1.
    for (uint32_t rank = 0; rank < 2; ++rank) {
      for (size_t i = 0; i < cluster_->num_servers(); ++i) {
        if (cluster_->server(i).id() == kFirstServerId + rank) by_rank_[rank] = &cluster_->server(i);
      }
      ASSERT_NE(by_rank_[rank], nullptr);
    }
    for (int i = 0; i < kSetupIterations; ++i) ASSERT_NO_FATAL_FAILURE(Iterate());
    ASSERT_NO_FATAL_FAILURE(ExpectModel());
    ASSERT_TRUE(member_.Join(cluster_->config().scheduler_port, kToken));
    ASSERT_NE(member_.id(), worker_->job().worker_id);
    EXPECT_EQ(by_rank_[0]->stats().slices, 3u);
    EXPECT_EQ(by_rank_[1]->stats().slices, 2u);
    for (Server* s : by_rank_) {
      EXPECT_EQ(s->stats().requests_refused, 0u);
      EXPECT_EQ(s->stats().connections_dropped, 0u);
    }
  }

  // Whatever a test left behind: the worker goes first (as a crash would), then the cluster.
  void TearDown() override {
    member_.Stop();
    if (worker_) worker_->Abandon();
    worker_.reset();
    cluster_.reset();
  }

  Server& server0() { return *by_rank_[0]; }
  Server& server1() { return *by_rank_[1]; }
  uint16_t port0() { return server0().port(); }

  // One real iteration: pull both tensors, push all-ones, wait for the commit.
  void Iterate() {
    ASSERT_NO_FATAL_FAILURE(Pull());
    auto h1 = worker_->Push(0, ones_a_.data());
    auto h2 = worker_->Push(1, ones_b_.data());
    Status s1 = worker_->Wait(h1), s2 = worker_->Wait(h2);
    ASSERT_TRUE(s1.ok()) << s1.ToString();
    ASSERT_TRUE(s2.ok()) << s2.ToString();
    ++completed_;
  }

  // Pulls both tensors; returns the lowest version read.
  Version Pull() {
    Version va = 0, vb = 0;
    Status s1 = worker_->Wait(worker_->Pull(0, a_.data()), &va);
    Status s2 = worker_->Wait(worker_->Pull(1, b_.data()), &vb);
    EXPECT_TRUE(s1.ok()) << s1.ToString();
    EXPECT_TRUE(s2.ok()) << s2.ToString();
    return std::min(va, vb);
  }

  // The real worker's pull sees exactly the gradients it completed: one per round.
  void ExpectModel() {
    Version v = Pull();
    for (int tries = 0; tries < 500 && v < completed_; ++tries) {
      std::this_thread::sleep_for(2ms);
      v = Pull();
    }
    ASSERT_EQ(v, completed_) << "the model version is the number of rounds";
    const auto want = static_cast<float>(completed_);
    for (size_t i = 0; i < a_.size(); ++i) ASSERT_EQ(a_[i], want) << "a[" << i << "]";
    for (size_t i = 0; i < b_.size(); ++i) ASSERT_EQ(b_[i], want) << "b[" << i << "]";
  }

  static Counters CountersOf(Server& s) {
    const ServerStats st = s.stats();
    return {st.requests_refused, st.connections_dropped, st.pushes_received, st.staging_buffers};
  }
  std::array<Counters, 2> Snapshot() { return {CountersOf(server0()), CountersOf(server1())}; }

  // After a case against server rank 0: its counters moved by exactly the given amounts
  // (rank 1 saw nothing), the server keeps serving a real worker, and the model holds exactly
  // the real worker's gradients.
  void AfterCase(const std::array<Counters, 2>& before, uint64_t refused, uint64_t dropped) {
    // Hellos refused (and dropped) because the member's previous link was still open.
    const uint64_t retried = std::exchange(auth_retries_, 0);
    refused += retried;
    dropped += retried;
    const Counters now0 = CountersOf(server0()), now1 = CountersOf(server1());
    expect_refused_ += refused;
    expect_dropped_ += dropped;
    EXPECT_EQ(now0.refused - before[0].refused, refused) << "requests_refused on server rank 0";
    EXPECT_EQ(now0.dropped - before[0].dropped, dropped) << "connections_dropped on rank 0";
    EXPECT_EQ(now1.refused, before[1].refused) << "server rank 1 was not involved";
    EXPECT_EQ(now1.dropped, before[1].dropped) << "server rank 1 was not involved";
    ASSERT_NO_FATAL_FAILURE(Iterate()) << "the server must keep serving";
    ASSERT_NO_FATAL_FAILURE(ExpectModel()) << "the bad input must not change the model";
    // Counters are stable once the real traffic went through.
    EXPECT_EQ(CountersOf(server0()).refused - before[0].refused, refused);
    EXPECT_EQ(CountersOf(server0()).dropped - before[0].dropped, dropped);
  }

  // The log line prefix of a refusal of connection `c` by server rank 0 / the scheduler.
  std::string ServerRefusal(MsgType about, const RawClient& c) {
    return fmt::format("server {}: refused {} from {}: ", server0().id(), ps::MsgTypeName(about),
                       c.LocalAddress());
  }
  // The transport's refusal of a stranger's first frame (before any node sees it).
  static std::string TransportRefusal(const RawClient& c) {
    return fmt::format("tcp: dropping the connection from {}: ", c.LocalAddress());
  }
  static std::string SchedulerRefusal(MsgType about, const RawClient& c) {
    return fmt::format("scheduler: refusing {} from {}: ", ps::MsgTypeName(about),
                       c.LocalAddress());
  }

  // A refusal that also drops the link: the error frame arrives first, then the connection
  // closes, and the node logged the refusal of this very connection (`log_prefix`) for the
  // expected reason.
  void ExpectRefusedAndDropped(RawClient& c, uint64_t request, StatusCode code, MsgType about,
                               const std::string& log_prefix,
                               const std::vector<std::string>& mentions) {
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << "the error frame was lost before the close: " << c.error();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, code, about, request, mentions));
    EXPECT_TRUE(c.IsClosed()) << c.error();
    std::vector<std::string> parts = mentions;
    parts.push_back(log_prefix);
    EXPECT_TRUE(CaptureSink::Get().Find(parts).has_value())
        << "no log line '" << log_prefix << "...' mentioning " << ::testing::PrintToString(mentions);
  }

  // A raw client that presented the admitted member's credential. A link of the member's
  // that a case just closed may still be open on the server for a moment (one connection
  // per id): retried until the server let go of it.
  void Authenticate(RawClient& c, uint16_t port) {
    const auto deadline = SteadyClock::now() + kReplyTimeout;
    for (;;) {
      ASSERT_TRUE(c.Connect(port)) << c.error();
      FrameHeader h = Header(MsgType::kHello, 1);
      h.sender = member_.id();
      ASSERT_TRUE(c.SendFrame(h, member_.HelloTo(kToken))) << c.error();
      auto ack = c.ReadFrame();
      ASSERT_TRUE(ack.has_value()) << "no hello-ack: " << c.error();
      if (ack->header.msg_type() == MsgType::kError &&
          ack->header.status == static_cast<uint16_t>(StatusCode::kAlreadyExists) &&
          SteadyClock::now() < deadline) {
        ++auth_retries_;
        std::this_thread::sleep_for(5ms);
        continue;
      }
      ASSERT_EQ(ack->header.msg_type(), MsgType::kHelloAck)
          << ps::MsgTypeName(ack->header.msg_type()) << ": " << ack->meta;
      EXPECT_EQ(ack->header.request, 1u);
      return;
    }
  }

  // The raw link is still usable: a heartbeat is taken silently and a pull of tensor 0
  // slice 0 is answered with the current model.
  void ExpectLinkUsable(RawClient& c, uint64_t request) {
    ASSERT_TRUE(c.SendFrame(Header(MsgType::kHeartbeat, request))) << c.error();
    ASSERT_TRUE(c.SendFrame(PullHeader(0, 0, request + 1))) << c.error();
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << "no pull reply: " << c.error();
    ASSERT_EQ(f->header.msg_type(), MsgType::kPullReply)
        << ps::MsgTypeName(f->header.msg_type()) << ": " << f->meta;
    EXPECT_EQ(f->header.request, request + 1) << "the heartbeat got no answer; the pull did";
    EXPECT_EQ(f->header.tensor(), 0u);
    EXPECT_EQ(f->header.slice(), 0u);
    EXPECT_EQ(f->header.dtype, static_cast<uint8_t>(DType::kFloat32));
    EXPECT_EQ(f->header.slice_version(), completed_) << "slice version";
    ASSERT_EQ(f->payload.size(), kSliceBytes);
    std::vector<float> values(kSliceFloats);
    std::memcpy(values.data(), f->payload.data(), kSliceBytes);
    for (uint32_t i = 0; i < kSliceFloats; ++i) {
      ASSERT_EQ(values[i], static_cast<float>(completed_)) << "element " << i;
    }
  }

  // --- the cases --------------------------------------------------------------------------

  // 1. A push as the very first frame, without a hello: the transport drops the stranger
  // from the header alone (its payload is never read, the server never sees the frame).
  void CaseNoHello() {
    SCOPED_TRACE("push before hello");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_TRUE(c.Connect(port0())) << c.error();
    const auto poison = Poison(kSliceFloats);
    ASSERT_TRUE(c.SendFrame(PushHeader(0, 0, worker_->clock(), 11), {}, poison.data(), kSliceBytes))
        << c.error();
    ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndDropped(c, 11, StatusCode::kPermissionDenied,
                                                    MsgType::kPush, TransportRefusal(c),
                                                    {"the first frame must be a hello"}));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes) << "nothing was staged";
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, /*refused=*/0, /*dropped=*/0));
  }

  // 2. A hello with the wrong cluster token.
  void CaseWrongToken() {
    SCOPED_TRACE("wrong token");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_TRUE(c.Connect(port0())) << c.error();
    ASSERT_TRUE(c.SendFrame(Header(MsgType::kHello, 21), HelloMeta("not-the-token"))) << c.error();
    ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndDropped(c, 21, StatusCode::kPermissionDenied,
                                                    MsgType::kHello,
                                                    ServerRefusal(MsgType::kHello, c),
                                                    {"wrong cluster token"}));
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 1, 1));
  }

  // 3. An authenticated push to a tensor the server does not hold; pulls of slices that are
  // not there. The link stays open.
  void CaseUnknownTensor() {
    SCOPED_TRACE("unknown tensor");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    const auto poison = Poison(kSliceFloats);
    ASSERT_TRUE(c.SendFrame(PushHeader(99, 0, worker_->clock(), 31), {}, poison.data(), kSliceBytes))
        << c.error();
    auto f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kNotFound, MsgType::kPush, 31,
                                        {"tensor 99", "not on server"}));
    // Tensor 0 exists, but its slice 1 lives on the other server; slice 99 nowhere.
    ASSERT_TRUE(c.SendFrame(PullHeader(0, 1, 32))) << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kNotFound, MsgType::kPull, 32,
                                        {"slice 1", "not on server"}));
    ASSERT_TRUE(c.SendFrame(PullHeader(0, 99, 33))) << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(
        ExpectError(f, c, StatusCode::kNotFound, MsgType::kPull, 33, {"slice 99"}));
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(c, 34));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 3, 0));
  }

  // 4. A push whose payload is not the slice's size.
  void CaseWrongLength() {
    SCOPED_TRACE("wrong length");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    const auto poison = Poison(2 * kSliceFloats);
    ASSERT_TRUE(c.SendFrame(PushHeader(0, 0, worker_->clock(), 41), {}, poison.data(), 100))
        << c.error();
    auto f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kInvalidArgument, MsgType::kPush, 41,
                                        {"100 bytes", "expected 1024"}));
    // Too long is refused alike (the server reads the payload away, then the link goes on).
    ASSERT_TRUE(
        c.SendFrame(PushHeader(0, 2, worker_->clock(), 42), {}, poison.data(), 2 * kSliceBytes))
        << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kInvalidArgument, MsgType::kPush, 42,
                                        {"2048 bytes", "expected 1024"}));
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(c, 43));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 2, 0));
  }

  // 5. A push of the right length in another dtype.
  void CaseWrongDtype() {
    SCOPED_TRACE("wrong dtype");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    const std::vector<double> poison(kSliceFloats / 2, 1000.0);  // 1024 bytes of float64
    FrameHeader h = PushHeader(0, 0, worker_->clock(), 51);
    h.dtype = static_cast<uint8_t>(DType::kFloat64);
    ASSERT_TRUE(c.SendFrame(h, {}, poison.data(), kSliceBytes)) << c.error();
    auto f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kInvalidArgument, MsgType::kPush, 51,
                                        {"dtype", "float64"}));
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(c, 52));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 1, 0));
  }

  // 6. A push cut off in the middle of its payload: nothing is staged.
  void CaseTruncated() {
    SCOPED_TRACE("truncated push");
    const auto before = Snapshot();
    const Clock clock = worker_->clock();
    const auto poison = Poison(kSliceFloats);
    {
      RawClient c;
      ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
      FrameHeader h = PushHeader(0, 0, clock, 61);
      h.payload_len = kSliceBytes;  // announces 1024 bytes...
      ASSERT_TRUE(c.SendRaw(h, {}, poison.data(), 100)) << c.error();  // ...sends 100
    }  // and closes
    // The same (worker, tensor, slice, clock) pushed whole on a new link is accepted, not a
    // duplicate: the truncated one staged nothing (whichever the server handled first).
    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    ASSERT_TRUE(c.SendFrame(PushHeader(0, 0, clock, 62), {}, poison.data(), kSliceBytes))
        << c.error();
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << c.error();
    ASSERT_EQ(f->header.msg_type(), MsgType::kPushAck)
        << ps::MsgTypeName(f->header.msg_type()) << ": " << f->meta;
    EXPECT_EQ(f->header.request, 62u);
    EXPECT_EQ(f->header.clock(), clock);
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes + 1) << "only the whole push";
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 7. A peer of another protocol version is told why, then dropped.
  void CaseWrongVersion() {
    SCOPED_TRACE("protocol version 99");
    const auto before = Snapshot();
    RawClient c;
    ASSERT_TRUE(c.Connect(port0())) << c.error();
    FrameHeader h = Header(MsgType::kHello, 71);
    h.version = 99;
    ASSERT_TRUE(c.SendFrame(h, HelloMeta(kToken))) << c.error();
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << c.error();
    ASSERT_EQ(f->header.msg_type(), MsgType::kError);
    EXPECT_EQ(f->header.version, ps::kProtocolVersion);
    EXPECT_EQ(f->header.status, static_cast<uint16_t>(StatusCode::kUnimplemented)) << f->meta;
    EXPECT_EQ(f->header.request, 71u);
    EXPECT_NE(f->meta.find("protocol version 99"), std::string::npos) << f->meta;
    EXPECT_TRUE(c.IsClosed()) << c.error();
    // Dropped by the transport before the server saw a frame: no refusal is counted.
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 8. Random bytes, on a fresh link and on an authenticated one.
  void CaseRandomBytes() {
    SCOPED_TRACE("random bytes");
    const auto before = Snapshot();
    std::mt19937 rng(1234);
    std::vector<uint8_t> junk(4096);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    junk[0] = 'G';  // never the magic
    {
      RawClient c;
      ASSERT_TRUE(c.Connect(port0())) << c.error();
      (void)c.SendBytes(junk.data(), junk.size());  // may fail once the server hung up
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
    {
      RawClient c;
      ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
      (void)c.SendBytes(junk.data(), junk.size());
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 9. Lengths over the limits are dropped from the header alone: the server neither waits
  // for the announced bytes nor allocates for them.
  void CaseOversizedLengths() {
    SCOPED_TRACE("oversized lengths");
    const auto before = Snapshot();
    {
      RawClient c;
      ASSERT_TRUE(c.Connect(port0())) << c.error();
      FrameHeader h = Header(MsgType::kHello, 91);
      h.meta_len = ps::kMaxMetaBytes + 1;
      ASSERT_TRUE(c.SendRaw(h, {}, nullptr, 0)) << c.error();  // not one metadata byte follows
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
    {
      RawClient c;
      ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
      FrameHeader h = PushHeader(0, 0, worker_->clock(), 92);
      h.payload_len = ps::kMaxPayloadBytes + 1;
      ASSERT_TRUE(c.SendRaw(h, {}, nullptr, 0)) << c.error();
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
    const Counters now = CountersOf(server0());
    EXPECT_EQ(now.staging, before[0].staging) << "no staging buffer for an oversized push";
    EXPECT_EQ(now.pushes, before[0].pushes);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 10. The same (tensor, slice, clock) pushed twice by one worker.
  void CaseDuplicatePush() {
    SCOPED_TRACE("duplicate push");
    const auto before = Snapshot();
    // A clock the real worker pushes right after this case: were the fake gradient ever
    // taken for the real one, the model would show it.
    const Clock clock = worker_->clock() + 1;
    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    const auto poison = Poison(kSliceFloats);
    ASSERT_TRUE(c.SendFrame(PushHeader(0, 2, clock, 101), {}, poison.data(), kSliceBytes))
        << c.error();
    auto f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << c.error();
    ASSERT_EQ(f->header.msg_type(), MsgType::kPushAck)
        << ps::MsgTypeName(f->header.msg_type()) << ": " << f->meta;
    EXPECT_EQ(f->header.request, 101u);
    EXPECT_EQ(f->header.tensor(), 0u);
    EXPECT_EQ(f->header.slice(), 2u);
    EXPECT_EQ(f->header.clock(), clock);
    ASSERT_TRUE(c.SendFrame(PushHeader(0, 2, clock, 102), {}, poison.data(), kSliceBytes))
        << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kAlreadyExists, MsgType::kPush, 102,
                                        {"twice", fmt::format("clock {}", clock)}));
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(c, 103));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes + 1);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 1, 0));
    ASSERT_NO_FATAL_FAILURE(Iterate()) << "the real worker's own push of that clock";
    ASSERT_NO_FATAL_FAILURE(ExpectModel());
  }

  // 11. The scheduler's port: random bytes, no hello, a wrong token.
  void CaseScheduler() {
    SCOPED_TRACE("scheduler");
    const auto before = Snapshot();
    const uint16_t port = cluster_->config().scheduler_port;
    const SchedulerStats sched_before = cluster_->scheduler().stats();
    {
      std::mt19937 rng(99);
      std::vector<uint8_t> junk(4096);
      for (auto& b : junk) b = static_cast<uint8_t>(rng());
      junk[0] = 'G';
      RawClient c;
      ASSERT_TRUE(c.Connect(port)) << c.error();
      (void)c.SendBytes(junk.data(), junk.size());
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
    {
      RawClient c;
      ASSERT_TRUE(c.Connect(port)) << c.error();
      FrameHeader h = Header(MsgType::kCommit, 111);
      h.set_clock(worker_->clock());
      ASSERT_TRUE(c.SendFrame(h)) << c.error();
      ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndDropped(c, 111, StatusCode::kPermissionDenied,
                                                      MsgType::kCommit, TransportRefusal(c),
                                                      {"the first frame must be a hello"}));
    }
    {
      RawClient c;
      ASSERT_TRUE(c.Connect(port)) << c.error();
      ASSERT_TRUE(c.SendFrame(Header(MsgType::kHello, 112), HelloMeta("not-the-token")))
          << c.error();
      ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndDropped(c, 112, StatusCode::kPermissionDenied,
                                                      MsgType::kHello,
                                                      SchedulerRefusal(MsgType::kHello, c),
                                                      {"wrong cluster token"}));
    }
    const SchedulerStats s = cluster_->scheduler().stats();
    EXPECT_EQ(s.workers_joined, sched_before.workers_joined) << "nobody joined";
    EXPECT_EQ(s.live_workers, 2u) << "the real worker and the admitted member";
    EXPECT_EQ(s.workers_failed, 0u);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 12. More handshakes and requests a server refuses: hellos from non-workers and
  // malformed ones, a scheduler-only frame, a second hello with a bad token (dropped);
  // payloads on frames that carry none and bad registrations (answered, link kept).
  void CaseOtherRefusals() {
    SCOPED_TRACE("other refusals");
    const auto before = Snapshot();
    // Dropped: hellos from a non-worker, from a node id below the workers', malformed; a
    // scheduler-only frame; a second hello with a bad token on an authenticated link.
    struct Drop {
      bool authenticate;
      MsgType type;
      std::string meta;
      StatusCode code;
      std::string mention;
    };
    const std::vector<Drop> drops = {
        {false, MsgType::kHello, HelloMeta(kToken, 0, Role::kServer),
         StatusCode::kPermissionDenied, "only workers"},
        {false, MsgType::kHello, HelloMeta(kToken, 5), StatusCode::kPermissionDenied,
         "only workers"},
        {false, MsgType::kHello, "{\"role\": \"worker\", \"tok", StatusCode::kProtocol,
         "hello is not a JSON object"},
        {true, MsgType::kCommit, "", StatusCode::kProtocol, "may not send commit"},
        // The scheduler's change of the learning rate, from a worker: servers take it from
        // the scheduler only.
        {true, MsgType::kLearningRate, LearningRateMeta(100.0f), StatusCode::kProtocol,
         "may not send learning-rate"},
        {true, MsgType::kHello, HelloMeta("not-the-token"), StatusCode::kPermissionDenied,
         "wrong cluster token"},
    };
    uint64_t drop_request = 120;
    for (const Drop& d : drops) {
      SCOPED_TRACE(d.mention);
      RawClient c;
      if (d.authenticate) {
        ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
      } else {
        ASSERT_TRUE(c.Connect(port0())) << c.error();
      }
      ++drop_request;
      ASSERT_TRUE(c.SendFrame(Header(d.type, drop_request), d.meta)) << c.error();
      ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndDropped(c, drop_request, d.code, d.type,
                                                      ServerRefusal(d.type, c), {d.mention}));
    }

    RawClient c;
    ASSERT_NO_FATAL_FAILURE(Authenticate(c, port0()));
    const auto poison = Poison(kSliceFloats);
    // A pull with a payload: the payload is read away and the pull refused.
    ASSERT_TRUE(c.SendFrame(PullHeader(0, 0, 131), {}, poison.data(), 16)) << c.error();
    auto f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(
        ExpectError(f, c, StatusCode::kProtocol, MsgType::kPull, 131, {"carry no payload"}));
    // Registrations of tensor 0 slice 0 that do not match it.
    const auto init = [&](const std::string& name, uint64_t elements, DType dtype,
                          uint64_t request) {
      std::vector<std::byte> meta;
      ps::EncodeInit({name, elements, 0, std::nullopt, {}}, meta);
      FrameHeader h = Header(MsgType::kInit, request);
      h.dtype = static_cast<uint8_t>(dtype);
      return c.SendFrame(h, ps::AsText(meta), poison.data(), kSliceBytes);
    };
    ASSERT_TRUE(init("evil", kBig, DType::kFloat32, 132)) << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, StatusCode::kInvalidArgument, MsgType::kInit, 132,
                                        {"'a'", "'evil'", "same tensors"}));
    ASSERT_TRUE(init("a", kBig, DType::kFloat64, 133)) << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(
        ExpectError(f, c, StatusCode::kInvalidArgument, MsgType::kInit, 133, {"dtype float64"}));
    ASSERT_TRUE(c.SendFrame(Header(MsgType::kInit, 134), "junk", poison.data(), kSliceBytes))
        << c.error();
    f = c.ReadFrame();
    ASSERT_NO_FATAL_FAILURE(
        ExpectError(f, c, StatusCode::kProtocol, MsgType::kInit, 134, {"init metadata"}));
    // A matching registration of an existing slice is acknowledged, and its values ignored:
    // the first registration is the model.
    ASSERT_TRUE(init("a", kBig, DType::kFloat32, 135)) << c.error();
    f = c.ReadFrame();
    ASSERT_TRUE(f.has_value()) << c.error();
    ASSERT_EQ(f->header.msg_type(), MsgType::kInitAck)
        << ps::MsgTypeName(f->header.msg_type()) << ": " << f->meta;
    EXPECT_EQ(f->header.request, 135u);
    EXPECT_EQ(f->header.slice_version(), completed_) << "the slice's version";
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(c, 136));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes);
    EXPECT_EQ(server0().stats().slices, 3u) << "no slice was added or replaced";
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, drops.size() + 4, drops.size()));
  }

  // 15. Changes of the learning rate the scheduler refuses: one that is not finite or is
  // negative (answered; the worker stays a member and its next change is taken), and any
  // from an observer. The job's optimizer is sum, so a taken change leaves the model as is.
  void CaseLearningRateRequests() {
    SCOPED_TRACE("learning rate");
    const auto before = Snapshot();
    uint64_t request = 150;
    for (float lr : {std::numeric_limits<float>::quiet_NaN(),
                     std::numeric_limits<float>::infinity(), -0.5f}) {
      FrameHeader h = Header(MsgType::kSetLearningRate, ++request);
      h.sender = member_.id();
      ASSERT_TRUE(member_.SendToScheduler(h, LearningRateMeta(lr)));
      ASSERT_NO_FATAL_FAILURE(ExpectError(member_.ReadFromScheduler(), RawClient{},
                                          StatusCode::kInvalidArgument,
                                          MsgType::kSetLearningRate, request,
                                          {"must be a finite number >= 0"}));
    }
    // Malformed (3 bytes, not a float), from another admitted worker: refused and dropped.
    Member extra;
    ASSERT_TRUE(extra.Join(cluster_->config().scheduler_port, kToken));
    FrameHeader h = Header(MsgType::kSetLearningRate, ++request);
    h.sender = extra.id();
    ASSERT_TRUE(extra.SendToScheduler(h, "abc"));
    ASSERT_NO_FATAL_FAILURE(ExpectError(extra.ReadFromScheduler(), RawClient{},
                                        StatusCode::kProtocol, MsgType::kSetLearningRate,
                                        request, {"not 4"}));
    EXPECT_TRUE(extra.SchedulerClosed()) << "a malformed frame drops the link";
    extra.Stop();
    // Its link lost, the worker is declared failed.
    const auto deadline = SteadyClock::now() + kReplyTimeout;
    while (cluster_->scheduler().stats().workers_failed == expect_failed_ &&
           SteadyClock::now() < deadline) {
      std::this_thread::sleep_for(2ms);
    }
    ++expect_failed_;
    // The real worker, through the API: refused before anything is sent.
    auto bad = worker_->SetLearningRate(std::numeric_limits<float>::infinity());
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    auto good = worker_->SetLearningRate(0.25f);
    ASSERT_TRUE(good.ok()) << good.status().ToString();
    EXPECT_EQ(*good, completed_) << "the first round not yet announced";
    // An observer may not.
    Member observer;
    ASSERT_TRUE(observer.Join(cluster_->config().scheduler_port, kToken, /*observer=*/true));
    h = Header(MsgType::kSetLearningRate, ++request);
    h.sender = observer.id();
    ASSERT_TRUE(observer.SendToScheduler(h, LearningRateMeta(0.5f)));
    ASSERT_NO_FATAL_FAILURE(ExpectError(observer.ReadFromScheduler(), RawClient{},
                                        StatusCode::kPermissionDenied,
                                        MsgType::kSetLearningRate, request, {"read-only"}));
    Config oc = cluster_->WorkerConfig();
    oc.observer = true;
    auto api_observer = Worker::Start(oc);
    ASSERT_TRUE(api_observer.ok()) << api_observer.status().ToString();
    auto refused = (*api_observer)->SetLearningRate(0.5f);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied);
    ASSERT_TRUE((*api_observer)->Leave().ok());
    observer.Stop();
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // 13. Impostors at a server's door: a second link under an admitted id, an admitted
  // credential presented for another id, an id nobody was admitted as (with no credential
  // and with a made-up one). Each is refused and dropped before anything it sends is read.
  void CaseImpostors() {
    SCOPED_TRACE("impostors");
    const auto before = Snapshot();
    const uint64_t staged = server0().stats().staged_slices;  // earlier cases' pushes
    RawClient first;
    ASSERT_NO_FATAL_FAILURE(Authenticate(first, port0()));
    struct Impostor {
      std::string meta;
      StatusCode code;
      std::string mention;
    };
    ps::Tag made_up{};
    made_up.fill(0x42);
    const std::vector<Impostor> impostors = {
        {member_.HelloTo(kToken), StatusCode::kAlreadyExists, "a second connection under its id"},
        {HelloMeta(kToken, worker_->job().worker_id), StatusCode::kPermissionDenied,
         "presented no valid credential"},
        {[&] {
           ps::Hello h;
           h.token = kToken;
           h.node = worker_->job().worker_id;
           h.credential = member_.welcome().credential;  // the member's, for another id
           return ps::EncodeHello(h);
         }(),
         StatusCode::kPermissionDenied, "presented no valid credential"},
        {HelloMeta(kToken, kFakeWorker), StatusCode::kPermissionDenied, "no valid credential"},
        {[&] {
           ps::Hello h;
           h.token = kToken;
           h.node = kFakeWorker;
           h.credential = made_up;
           return ps::EncodeHello(h);
         }(),
         StatusCode::kPermissionDenied, "no valid credential"},
    };
    uint64_t request = 140;
    const auto poison = Poison(kSliceFloats);
    for (const Impostor& i : impostors) {
      SCOPED_TRACE(i.mention);
      RawClient c;
      ASSERT_TRUE(c.Connect(port0())) << c.error();
      ++request;
      ASSERT_TRUE(c.SendFrame(Header(MsgType::kHello, request), i.meta)) << c.error();
      // A push for a future clock right behind the hello: never staged.
      (void)c.SendFrame(PushHeader(0, 0, worker_->clock() + 1, request + 100), {}, poison.data(),
                        kSliceBytes);
      auto f = c.ReadFrame();
      ASSERT_NO_FATAL_FAILURE(ExpectError(f, c, i.code, MsgType::kHello, request, {i.mention}));
      // The push behind it is refused by the transport too (a stranger's frame), then the
      // link closes; nothing else ever comes back.
      for (auto more = c.ReadFrame(); more; more = c.ReadFrame()) {
        EXPECT_EQ(more->header.msg_type(), MsgType::kError) << more->meta;
      }
      EXPECT_TRUE(c.peer_closed()) << c.error();
      EXPECT_TRUE(CaptureSink::Get().Find({ServerRefusal(MsgType::kHello, c), i.mention}));
    }
    ASSERT_NO_FATAL_FAILURE(ExpectLinkUsable(first, 160));
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes) << "nothing was staged";
    EXPECT_EQ(server0().stats().staged_slices, staged);
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, impostors.size(), impostors.size()));
  }

  // A commit of `clock` on the member's scheduler link, claiming `tensors`.
  static bool SendCommit(Member& m, Clock clock, std::vector<ps::CommittedTensor> tensors,
                         ps::Tag receipts, uint64_t request) {
    ps::CommitProof proof;
    proof.tensors = std::move(tensors);
    proof.receipts = receipts;
    std::vector<std::byte> meta;
    ps::EncodeCommit(proof, meta);
    FrameHeader h = ps::MakeHeader(MsgType::kCommit, m.id());
    h.request = request;
    h.set_clock(clock);
    h.set_base(0);
    return m.SendToScheduler(h, ps::AsText(meta));
  }

  // The scheduler refused member m's commit as unproved and expelled it; no round ever
  // named it, and the servers reclaimed what it staged at once.
  void ExpectUnprovedCommitExpelled(Member& m, uint64_t request, uint32_t failed_before,
                                    uint64_t staged_before) {
    auto f = m.ReadFromScheduler();
    ASSERT_TRUE(f.has_value()) << "no answer to the commit";
    ASSERT_EQ(f->header.msg_type(), MsgType::kError) << ps::MsgTypeName(f->header.msg_type());
    EXPECT_EQ(f->header.refused(), MsgType::kCommit);
    EXPECT_EQ(f->header.request, request);
    EXPECT_EQ(f->header.status, static_cast<uint16_t>(StatusCode::kPermissionDenied)) << f->meta;
    EXPECT_NE(f->meta.find("not proved by the servers' receipts"), std::string::npos) << f->meta;
    EXPECT_TRUE(m.SchedulerClosed()) << "the worker is dropped";
    const auto deadline = SteadyClock::now() + kReplyTimeout;
    while ((cluster_->scheduler().stats().workers_failed == failed_before ||
            server0().stats().staged_slices != staged_before) &&
           SteadyClock::now() < deadline) {
      std::this_thread::sleep_for(2ms);
    }
    EXPECT_EQ(cluster_->scheduler().stats().workers_failed, failed_before + 1)
        << "expelled: declared failed";
    ++expect_failed_;
    EXPECT_EQ(server0().stats().staged_slices, staged_before) << "its staging reclaimed at once";
    EXPECT_NE(CaptureSink::Get().Find({fmt::format("worker {} declared dead", m.id()),
                                       "its commit was refused"}),
              std::nullopt);
    for (const RoundRecord& r : cluster_->scheduler().history()) {
      for (const RoundMember& mem : r.members) EXPECT_NE(mem.worker, m.id()) << r.round;
    }
  }

  // 14. Commits the servers did not prove: one with no push at all; one after a push of one
  // slice; one after every slice of a tensor on one server but none on the other. Each is
  // refused, its worker expelled, its staging reclaimed; the model never sees it.
  void CaseUnprovedCommits() {
    SCOPED_TRACE("unproved commits");
    const auto before = Snapshot();
    const uint16_t sched = cluster_->config().scheduler_port;
    // The real worker's tensors: a = 4 slices from rank 0 (ranks 0, 1, 0, 1), b = 1 on rank 0.
    const std::vector<ps::CommittedTensor> both = {{0, 4, 0}, {1, 1, 0}};
    const auto poison = Poison(kSliceFloats);
    uint32_t failed = cluster_->scheduler().stats().workers_failed;
    const uint64_t staged = server0().stats().staged_slices;  // earlier cases' pushes
    {
      Member m;
      ASSERT_TRUE(m.Join(sched, kToken));
      ASSERT_TRUE(SendCommit(m, m.welcome().start_clock, both, {}, 171));
      ASSERT_NO_FATAL_FAILURE(ExpectUnprovedCommitExpelled(m, 171, failed++, staged));
    }
    // Push one slice of `a` (rank 0's slice 0), then commit `a` with what the server gave.
    // Then every slice of `a` on rank 0 (0 and 2), none on rank 1.
    for (const std::vector<uint32_t>& slices : {std::vector<uint32_t>{0},
                                                 std::vector<uint32_t>{0, 2}}) {
      Member m;
      ASSERT_TRUE(m.Join(sched, kToken));
      RawClient c;
      ASSERT_TRUE(c.Connect(port0())) << c.error();
      ASSERT_TRUE(c.SendFrame(Header(MsgType::kHello, 1), m.HelloTo(kToken))) << c.error();
      auto ack = c.ReadFrame();
      ASSERT_TRUE(ack && ack->header.msg_type() == MsgType::kHelloAck) << c.error();
      ps::Tag receipts{};
      uint64_t request = 180;
      for (uint32_t slice : slices) {
        ASSERT_TRUE(c.SendFrame(PushHeader(0, slice, m.welcome().start_clock, ++request), {},
                                poison.data(), kSliceBytes))
            << c.error();
        auto f = c.ReadFrame();
        ASSERT_TRUE(f && f->header.msg_type() == MsgType::kPushAck) << c.error();
        if (f->meta.size() == receipts.size()) {
          ps::Tag t;
          std::memcpy(t.data(), f->meta.data(), t.size());
          ps::XorInto(receipts, t);
        }
      }
      EXPECT_EQ(receipts == ps::Tag{}, slices.size() == 1)
          << "a receipt comes once every slice of the tensor on that server is staged";
      EXPECT_EQ(server0().stats().staged_slices, staged + slices.size());
      ASSERT_TRUE(SendCommit(m, m.welcome().start_clock, {{0, 4, 0}}, receipts, 190));
      ASSERT_NO_FATAL_FAILURE(ExpectUnprovedCommitExpelled(m, 190, failed++, staged));
      EXPECT_TRUE(c.IsClosed()) << "the server drops the links of a worker that is gone";
    }
    EXPECT_EQ(CountersOf(server0()).pushes, before[0].pushes + 3) << "staged, then reclaimed";
    ASSERT_NO_FATAL_FAILURE(AfterCase(before, 0, 0));
  }

  // After every case: two more real iterations, the count is exact on every server, only
  // the real worker's gradients were ever applied, and the job ends cleanly.
  void Finish() {
    ASSERT_NO_FATAL_FAILURE(Iterate());
    ASSERT_NO_FATAL_FAILURE(Iterate());
    ASSERT_NO_FATAL_FAILURE(ExpectModel());
    const WorkerId me = worker_->job().worker_id;
    ASSERT_NE(me, kFakeWorker);
    const auto history = cluster_->scheduler().history();
    EXPECT_EQ(history.size(), completed_);
    for (const RoundRecord& r : history) {
      ASSERT_EQ(r.members.size(), 1u) << "round " << r.round;
      EXPECT_EQ(r.members[0].worker, me) << "round " << r.round;
    }
    for (Server* s : by_rank_) {
      // A slice's new version is visible to pulls a moment before the round is counted.
      const auto deadline = SteadyClock::now() + kReplyTimeout;
      while (s->stats().rounds_applied < completed_ && SteadyClock::now() < deadline) {
        std::this_thread::sleep_for(1ms);
      }
      const ServerStats st = s->stats();
      EXPECT_EQ(st.rounds_applied, completed_) << "server " << s->id();
      EXPECT_EQ(st.gradients_applied, completed_) << "server " << s->id();
    }
    // The member leaves gracefully first, then the real worker.
    FrameHeader leave = ps::MakeHeader(MsgType::kLeave, member_.id());
    leave.request = 77;
    ASSERT_TRUE(member_.SendToScheduler(leave));
    auto ack = member_.ReadFromScheduler();
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->header.msg_type(), MsgType::kLeaveAck) << ack->meta;
    member_.Stop();
    Status left = worker_->Leave();
    ASSERT_TRUE(left.ok()) << left.ToString();
    Status done = cluster_->WaitFinished();
    EXPECT_TRUE(done.ok()) << done.ToString();
    EXPECT_EQ(cluster_->scheduler().stats().workers_left, 2u);
    EXPECT_EQ(cluster_->scheduler().stats().workers_failed, expect_failed_);
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Worker> worker_;
  Member member_;
  std::array<Server*, 2> by_rank_{nullptr, nullptr};
  std::vector<float> a_ = std::vector<float>(kBig, 0.0f);
  std::vector<float> b_ = std::vector<float>(kSmall, 0.0f);
  const std::vector<float> ones_a_ = std::vector<float>(kBig, 1.0f);
  const std::vector<float> ones_b_ = std::vector<float>(kSmall, 1.0f);
  uint64_t completed_ = 0;
  uint64_t expect_refused_ = 0;  // on server rank 0, over the test's cases
  uint64_t expect_dropped_ = 0;
  uint64_t auth_retries_ = 0;  // hellos refused as a second link of the member
  uint32_t expect_failed_ = 0;  // workers the cases got expelled
};

TEST_F(BadInputTest, PushBeforeHelloIsDeniedAndDropped) {
  ASSERT_NO_FATAL_FAILURE(CaseNoHello());
  Finish();
}

TEST_F(BadInputTest, WrongTokenIsDeniedAndDropped) {
  ASSERT_NO_FATAL_FAILURE(CaseWrongToken());
  Finish();
}

TEST_F(BadInputTest, UnknownTensorIsNotFoundAndTheLinkStaysUsable) {
  ASSERT_NO_FATAL_FAILURE(CaseUnknownTensor());
  Finish();
}

TEST_F(BadInputTest, WrongLengthIsRefusedWithBothByteCounts) {
  ASSERT_NO_FATAL_FAILURE(CaseWrongLength());
  Finish();
}

TEST_F(BadInputTest, WrongDtypeIsRefused) {
  ASSERT_NO_FATAL_FAILURE(CaseWrongDtype());
  Finish();
}

TEST_F(BadInputTest, TruncatedPushStagesNothing) {
  ASSERT_NO_FATAL_FAILURE(CaseTruncated());
  Finish();
}

TEST_F(BadInputTest, OtherProtocolVersionIsToldWhyThenDropped) {
  ASSERT_NO_FATAL_FAILURE(CaseWrongVersion());
  Finish();
}

TEST_F(BadInputTest, RandomBytesDropTheConnection) {
  ASSERT_NO_FATAL_FAILURE(CaseRandomBytes());
  Finish();
}

TEST_F(BadInputTest, OversizedLengthsAreDroppedUnread) {
  ASSERT_NO_FATAL_FAILURE(CaseOversizedLengths());
  Finish();
}

TEST_F(BadInputTest, DuplicatePushIsAlreadyExists) {
  ASSERT_NO_FATAL_FAILURE(CaseDuplicatePush());
  Finish();
}

TEST_F(BadInputTest, SchedulerDropsRandomBytesAndRefusesStrangers) {
  ASSERT_NO_FATAL_FAILURE(CaseScheduler());
  Finish();
}

TEST_F(BadInputTest, OtherHandshakesAndRequestsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(CaseOtherRefusals());
  Finish();
}

TEST_F(BadInputTest, LearningRateChangesThatAreNotFiniteOrFromObserversAreRefused) {
  ASSERT_NO_FATAL_FAILURE(CaseLearningRateRequests());
  Finish();
}

TEST_F(BadInputTest, ImpostorsAreRefusedAtTheServersDoor) {
  ASSERT_NO_FATAL_FAILURE(CaseImpostors());
  Finish();
}

TEST_F(BadInputTest, CommitsTheServersDidNotProveAreRefusedAndTheirWorkersExpelled) {
  ASSERT_NO_FATAL_FAILURE(CaseUnprovedCommits());
  Finish();
}

// Every case against one job, one after the other: refusals do not accumulate into damage.
TEST_F(BadInputTest, AllCasesInOneJob) {
  ASSERT_NO_FATAL_FAILURE(CaseNoHello());
  ASSERT_NO_FATAL_FAILURE(CaseWrongToken());
  ASSERT_NO_FATAL_FAILURE(CaseUnknownTensor());
  ASSERT_NO_FATAL_FAILURE(CaseWrongLength());
  ASSERT_NO_FATAL_FAILURE(CaseWrongDtype());
  ASSERT_NO_FATAL_FAILURE(CaseTruncated());
  ASSERT_NO_FATAL_FAILURE(CaseWrongVersion());
  ASSERT_NO_FATAL_FAILURE(CaseRandomBytes());
  ASSERT_NO_FATAL_FAILURE(CaseOversizedLengths());
  ASSERT_NO_FATAL_FAILURE(CaseDuplicatePush());
  ASSERT_NO_FATAL_FAILURE(CaseScheduler());
  ASSERT_NO_FATAL_FAILURE(CaseOtherRefusals());
  ASSERT_NO_FATAL_FAILURE(CaseImpostors());
  ASSERT_NO_FATAL_FAILURE(CaseUnprovedCommits());
  const ServerStats s0 = server0().stats();
  EXPECT_EQ(s0.requests_refused, expect_refused_);
  EXPECT_EQ(s0.connections_dropped, expect_dropped_);
  EXPECT_EQ(server1().stats().requests_refused, 0u);
  EXPECT_EQ(server1().stats().connections_dropped, 0u);
  Finish();
}

// A refusal that drops the connection still delivers its error frame, so that a peer learns
// why: a worker started with the wrong token fails with "wrong cluster token", not with
// "connection closed". (The close used to discard the queued frame; SendError now closes
// once the frame has left.)
TEST_F(BadInputTest, RefusalsThatDropAlwaysDeliverTheError) {
  constexpr int kTries = 20;
  int server_lost = 0, scheduler_lost = 0, worker_misreported = 0;
  for (int i = 0; i < kTries; ++i) {
    for (uint16_t port : {port0(), cluster_->config().scheduler_port}) {
      RawClient c;
      ASSERT_TRUE(c.Connect(port)) << c.error();
      ASSERT_TRUE(c.SendFrame(Header(MsgType::kHello, 7), HelloMeta("not-the-token"))) << c.error();
      auto f = c.ReadFrame();
      if (!f) {
        ++(port == port0() ? server_lost : scheduler_lost);
      } else {
        ExpectError(f, c, StatusCode::kPermissionDenied, MsgType::kHello, 7, {"token"});
      }
      EXPECT_TRUE(c.IsClosed()) << c.error();
    }
  }
  for (int i = 0; i < 5; ++i) {
    Config bad = cluster_->WorkerConfig();
    bad.token = "not-the-token";
    auto w = Worker::Start(bad);
    ASSERT_FALSE(w.ok());
    if (w.status().code() != StatusCode::kPermissionDenied) {
      ++worker_misreported;
      ADD_FAILURE() << "a worker with the wrong token was told: " << w.status().ToString();
    }
  }
  EXPECT_EQ(server_lost, 0) << "of " << kTries << " refused hellos at the server";
  EXPECT_EQ(scheduler_lost, 0) << "of " << kTries << " refused hellos at the scheduler";
  EXPECT_EQ(worker_misreported, 0) << "of 5 workers started with the wrong token";
  Finish();
}

}  // namespace
}  // namespace dsync::testing
