// Conformance suite for the Transport seam (src/ps/transport.h). Every transport runs the
// same tests through a factory; a transport that does not speak plain TCP framing on its
// listening port (RDMA) skips the raw-socket cases.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "dsync/config.h"
#include "net_util.h"
#include "ps/protocol.h"
#include "ps/transport.h"
#include "tcp/tcp_transport.h"
#if DSYNC_HAVE_RDMA
#include "rdma/rdma_transport.h"
#endif

namespace dsync::ps {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kWait = 30s;  // generous: the suite also runs under sanitizers and valgrind

// A byte pattern that depends on position and seed, so shifted or swapped data is caught.
std::byte PatternByte(size_t i, uint32_t seed) {
  const uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed * 40503u;
  return static_cast<std::byte>((x >> 13) ^ (i >> 20));
}
void Fill(std::byte* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = PatternByte(i, seed);
}
// Index of the first byte that differs from the pattern, or -1.
int64_t FirstMismatch(const std::byte* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != PatternByte(i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}
std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  Fill(v.data(), n, seed);
  return v;
}

struct Received {
  PeerId peer = kNoPeer;
  FrameHeader header;
  std::vector<std::byte> meta;
  void* handed = nullptr;  // what OnHeader returned
  void* got = nullptr;     // what OnFrame received
  std::shared_ptr<std::byte[]> payload;
};

struct Lost {
  PeerId peer = kNoPeer;
  FrameHeader header;
  void* handed = nullptr;
  void* got = nullptr;
};

// Records every callback, checks the threading contract, and lets tests hook in.
class Recorder : public TransportHandler {
 public:
  enum Event { kConnected, kHeader, kFrame, kLost, kDisconnected };

  // Hooks run outside the recorder's lock, so they may call into the transport.
  std::function<bool(const FrameHeader&)> discard;  // true: OnHeader returns nullptr
  std::function<void(PeerId, const FrameHeader&)> after_header;
  std::function<void(PeerId, const FrameHeader&)> after_frame;

  // Inbound peers are trusted at once (the stranger rules have tests of their own).
  Transport* trust_inbound = nullptr;

  void OnConnected(PeerId peer, bool inbound) override {
    Guard g(this, peer);
    if (inbound && trust_inbound) trust_inbound->Trust(peer);
    std::lock_guard lock(mu_);
    events_[peer].push_back(kConnected);
    connected_.push_back({peer, inbound});
    cv_.notify_all();
  }

  void* OnHeader(PeerId peer, const FrameHeader& header, std::span<const std::byte>) override {
    Guard g(this, peer);
    void* dst = nullptr;
    if (!discard || !discard(header)) {
      // One spare byte so that even an empty payload gets a distinct non-null buffer.
      std::shared_ptr<std::byte[]> buf(new std::byte[header.payload_len + 1]);
      dst = buf.get();
      std::lock_guard lock(mu_);
      pending_[peer] = std::move(buf);
    }
    {
      std::lock_guard lock(mu_);
      events_[peer].push_back(kHeader);
      handed_[peer] = dst;
      ++headers_;
      cv_.notify_all();
    }
    if (after_header) after_header(peer, header);
    return dst;
  }

  void OnFrame(PeerId peer, const FrameHeader& header, std::span<const std::byte> meta,
               void* payload) override {
    Guard g(this, peer);
    {
      std::lock_guard lock(mu_);
      Received r;
      r.peer = peer;
      r.header = header;
      r.meta.assign(meta.begin(), meta.end());
      r.handed = handed_[peer];
      r.got = payload;
      if (payload != nullptr) r.payload = std::move(pending_[peer]);
      pending_.erase(peer);
      frames_.push_back(std::move(r));
      events_[peer].push_back(kFrame);
      cv_.notify_all();
    }
    if (after_frame) after_frame(peer, header);
  }

  void OnPayloadLost(PeerId peer, const FrameHeader& header, void* payload) override {
    Guard g(this, peer);
    std::lock_guard lock(mu_);
    lost_.push_back({peer, header, handed_[peer], payload});
    pending_.erase(peer);
    events_[peer].push_back(kLost);
    cv_.notify_all();
  }

  void OnDisconnected(PeerId peer, const Status& why) override {
    Guard g(this, peer);
    std::lock_guard lock(mu_);
    disconnected_[peer].push_back(why);
    events_[peer].push_back(kDisconnected);
    cv_.notify_all();
  }

  // Waits until pred() (evaluated under the lock) holds; false on timeout.
  bool WaitUntil(const std::function<bool()>& pred, Clock::duration timeout = kWait) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, pred);
  }
  bool WaitFrames(size_t n) {
    return WaitUntil([&] { return frames_.size() >= n; });
  }
  bool WaitHeaders(size_t n) {
    return WaitUntil([&] { return headers_ >= n; });
  }
  bool WaitDisconnected(PeerId peer) {
    return WaitUntil([&] { return disconnected_.count(peer) > 0; });
  }
  // The first inbound peer not yet returned by an earlier call.
  PeerId WaitInbound() {
    PeerId found = kNoPeer;
    WaitUntil([&] {
      for (auto& [peer, inbound] : connected_) {
        if (inbound && taken_.insert(peer).second) {
          found = peer;
          return true;
        }
      }
      return false;
    });
    return found;
  }

  std::vector<Received> TakeFrames() {
    std::lock_guard lock(mu_);
    return std::exchange(frames_, {});
  }
  std::vector<Lost> lost() {
    std::lock_guard lock(mu_);
    return lost_;
  }
  std::vector<Event> events(PeerId peer) {
    std::lock_guard lock(mu_);
    return events_[peer];
  }
  Status why(PeerId peer) {
    std::lock_guard lock(mu_);
    auto it = disconnected_.find(peer);
    return it == disconnected_.end() ? Status::Ok() : it->second.front();
  }
  size_t headers() {
    std::lock_guard lock(mu_);
    return headers_;
  }
  size_t inbound() {
    std::lock_guard lock(mu_);
    return std::count_if(connected_.begin(), connected_.end(),
                         [](const auto& c) { return c.second; });
  }

  // After this, any callback is a contract violation.
  void Stop() { stopped_.store(true); }
  int violations() const { return violations_.load(); }
  int late_callbacks() const { return late_.load(); }

  // Every peer saw OnConnected first and OnDisconnected exactly once, last.
  void ExpectLifecycles() {
    std::lock_guard lock(mu_);
    for (auto& [peer, ev] : events_) {
      ASSERT_FALSE(ev.empty());
      EXPECT_EQ(ev.front(), kConnected) << "peer " << peer;
      EXPECT_EQ(std::count(ev.begin(), ev.end(), kConnected), 1) << "peer " << peer;
      EXPECT_EQ(ev.back(), kDisconnected) << "peer " << peer;
      EXPECT_EQ(std::count(ev.begin(), ev.end(), kDisconnected), 1) << "peer " << peer;
    }
  }

 private:
  // Flags overlapping callbacks for one peer and callbacks after Stop().
  struct Guard {
    Guard(Recorder* r, PeerId peer) : r_(r), peer_(peer) {
      if (r_->stopped_.load()) ++r_->late_;
      std::lock_guard lock(r_->active_mu_);
      if (!r_->active_.insert(peer_).second) ++r_->violations_;
    }
    ~Guard() {
      std::lock_guard lock(r_->active_mu_);
      r_->active_.erase(peer_);
    }
    Recorder* r_;
    PeerId peer_;
  };

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<PeerId, std::vector<Event>> events_;
  std::vector<std::pair<PeerId, bool>> connected_;
  std::set<PeerId> taken_;
  std::map<PeerId, std::shared_ptr<std::byte[]>> pending_;
  std::map<PeerId, void*> handed_;
  std::vector<Received> frames_;
  std::vector<Lost> lost_;
  std::map<PeerId, std::vector<Status>> disconnected_;
  size_t headers_ = 0;

  std::mutex active_mu_;
  std::set<PeerId> active_;
  std::atomic<int> violations_{0};
  std::atomic<int> late_{0};
  std::atomic<bool> stopped_{false};
};

// Counts done() calls per frame so that "exactly once" can be checked.
class DoneTracker {
 public:
  explicit DoneTracker(size_t n) : calls_(n), codes_(n, StatusCode::kOk) {}
  SendDone For(size_t i) {
    return [this, i](const Status& st) { Record(i, st); };
  }
  void Record(size_t i, const Status& st) {
    std::lock_guard lock(mu_);
    ++calls_[i];
    codes_[i] = st.code();
    if (st.ok()) ++ok_;
    ++total_;
    cv_.notify_all();
  }
  bool WaitAll(Clock::duration timeout = kWait) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return total_ >= calls_.size(); });
  }
  size_t total() {
    std::lock_guard lock(mu_);
    return total_;
  }
  size_t ok() {
    std::lock_guard lock(mu_);
    return ok_;
  }
  void ExpectEachOnce() {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < calls_.size(); ++i) EXPECT_EQ(calls_[i], 1) << "frame " << i;
  }
  StatusCode code(size_t i) {
    std::lock_guard lock(mu_);
    return codes_[i];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> calls_;
  std::vector<StatusCode> codes_;
  size_t total_ = 0;
  size_t ok_ = 0;
};

struct TransportKind {
  std::string name;
  // Null where the transport cannot run on this machine; skip() then says why.
  std::function<std::unique_ptr<Transport>()> make;
  bool raw_tcp = false;  // its listener speaks the frame format over plain TCP
  // The address to listen on and connect to (RDMA: the IP of the RDMA netdev).
  std::function<std::string(Transport&)> host = [](Transport&) { return "127.0.0.1"; };
  std::function<std::string()> skip = [] { return std::string(); };
  // The same transport with the given limits on unauthenticated peers.
  std::function<std::unique_ptr<Transport>(ps::AdmissionLimits)> limited;
};
// gtest would otherwise print the struct's bytes, padding included.
void PrintTo(const TransportKind& kind, std::ostream* os) { *os << kind.name; }

FrameHeader TestHeader(MsgType type, uint64_t round) {
  FrameHeader h = MakeHeader(type, 1000);
  h.set_round(round);
  return h;
}

// A plain socket for feeding a listener bytes no transport would send.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    timeval tv{10, 0};  // reads fail instead of hanging
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawClient() { Close(); }
  bool connected() const { return connected_; }
  bool Write(const void* p, size_t n) {
    return send(fd_, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  }
  // Reads exactly n bytes; false on EOF, error or timeout.
  bool Read(void* p, size_t n) {
    size_t got = 0;
    while (got < n) {
      ssize_t k = recv(fd_, static_cast<char*>(p) + got, n - got, 0);
      if (k <= 0) return false;
      got += static_cast<size_t>(k);
    }
    return true;
  }
  // True when the other side closed (EOF or reset) within the receive timeout.
  bool SeesClose() {
    char c;
    ssize_t k = recv(fd_, &c, 1, 0);
    return k == 0 || (k < 0 && (errno == ECONNRESET || errno == EPIPE));
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

class TransportTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override {
    server_ = GetParam().make();
    if (!server_) GTEST_SKIP() << GetParam().skip();
    client_ = GetParam().make();
    host_ = GetParam().host(*server_);
    server_h_.trust_inbound = server_.get();
    server_->SetHandler(&server_h_);
    client_->SetHandler(&client_h_);
    auto port = server_->Listen(host_, 0);
    ASSERT_TRUE(port.ok()) << port.status().ToString();
    ASSERT_NE(*port, 0);
    port_ = *port;
  }

  void TearDown() override {
    if (!server_) return;  // skipped
    client_->Shutdown();
    server_->Shutdown();
    client_h_.Stop();
    server_h_.Stop();
    client_h_.ExpectLifecycles();
    server_h_.ExpectLifecycles();
    EXPECT_EQ(client_h_.violations(), 0) << "overlapping callbacks for one peer";
    EXPECT_EQ(server_h_.violations(), 0) << "overlapping callbacks for one peer";
  }

  // Connects the client to the server; returns {client's peer id, server's peer id}.
  std::pair<PeerId, PeerId> ConnectPair() {
    auto peer = client_->Connect(host_, port_, 5000);
    EXPECT_TRUE(peer.ok()) << peer.status().ToString();
    if (!peer.ok()) return {kNoPeer, kNoPeer};
    PeerId server_peer = server_h_.WaitInbound();
    EXPECT_NE(server_peer, kNoPeer);
    return {*peer, server_peer};
  }

  bool raw_tcp() const { return GetParam().raw_tcp; }
  const std::string& host() const { return host_; }

  // Handlers first: they must outlive the transports.
  Recorder server_h_;
  Recorder client_h_;
  std::unique_ptr<Transport> server_;
  std::unique_ptr<Transport> client_;
  uint16_t port_ = 0;
  std::string host_;
};

TEST_P(TransportTest, RoundTripPreservesHeaderMetaAndPayloadZeroCopy) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  EXPECT_EQ(client_->PeerAddress(cp), fmt::format("{}:{}", host(), port_));
  EXPECT_TRUE(server_->PeerAddress(sp).starts_with(host() + ":")) << server_->PeerAddress(sp);

  const std::vector<size_t> sizes = {0, 1, 4093, 4u << 20, 64u << 20};
  const std::vector<size_t> meta_sizes = {0, 7, 1, kMaxMetaBytes, 300};
  std::vector<std::vector<std::byte>> payloads, metas;
  DoneTracker done(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    payloads.push_back(Pattern(sizes[i], static_cast<uint32_t>(i)));
    metas.push_back(Pattern(meta_sizes[i], static_cast<uint32_t>(100 + i)));
    FrameHeader h = TestHeader(MsgType::kPush, 10 + i);
    h.set_tensor(static_cast<uint32_t>(7 * i));
    h.set_slice(static_cast<uint32_t>(i + 1));
    h.dtype = 1;
    h.flags = 0x5a;
    h.status = 3;
    h.set_min_version(0xdeadbeefcafe0000ull + i);
    h.request = 99 + i;
    h.meta_len = 12345;  // the transport sets both lengths from the arguments
    h.payload_len = 54321;
    ASSERT_TRUE(client_->Send(cp, h, metas[i], payloads[i].data(), sizes[i], done.For(i)).ok());
  }
  ASSERT_TRUE(server_h_.WaitFrames(sizes.size()));
  ASSERT_TRUE(done.WaitAll());
  done.ExpectEachOnce();
  EXPECT_EQ(done.ok(), sizes.size());

  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const Received& r = frames[i];
    SCOPED_TRACE(fmt::format("frame {} ({} bytes)", i, sizes[i]));
    EXPECT_EQ(r.peer, sp);
    EXPECT_EQ(r.header.magic, kFrameMagic);
    EXPECT_EQ(r.header.version, kProtocolVersion);
    EXPECT_EQ(r.header.msg_type(), MsgType::kPush);
    EXPECT_EQ(r.header.sender, 1000u);
    EXPECT_EQ(r.header.tensor(), 7 * i);
    EXPECT_EQ(r.header.slice(), i + 1);
    EXPECT_EQ(r.header.dtype, 1);
    EXPECT_EQ(r.header.flags, 0x5a);
    EXPECT_EQ(r.header.status, 3);
    EXPECT_EQ(r.header.round(), 10 + i);
    EXPECT_EQ(r.header.min_version(), 0xdeadbeefcafe0000ull + i);
    EXPECT_EQ(r.header.request, 99 + i);
    EXPECT_EQ(r.header.meta_len, meta_sizes[i]);
    EXPECT_EQ(r.header.payload_len, sizes[i]);
    EXPECT_EQ(r.meta, metas[i]);
    // Zero copy: the payload arrives in the very buffer OnHeader handed out.
    ASSERT_NE(r.got, nullptr);
    EXPECT_EQ(r.got, r.handed);
    EXPECT_EQ(r.got, r.payload.get());
    EXPECT_EQ(FirstMismatch(r.payload.get(), sizes[i], static_cast<uint32_t>(i)), -1);
  }
  auto ev = server_h_.events(sp);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.front(), Recorder::kConnected);
}

TEST_P(TransportTest, TenThousandFramesArriveInOrder) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  constexpr size_t kFrames = 10000;
  const auto payload = Pattern(64, 1);
  DoneTracker done(kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    const auto i32 = static_cast<uint32_t>(i);
    std::span<const std::byte> meta(reinterpret_cast<const std::byte*>(&i32), sizeof(i32));
    ASSERT_TRUE(client_
                    ->Send(cp, TestHeader(MsgType::kPush, i), meta, payload.data(),
                           i % 3 == 0 ? 0 : payload.size(), done.For(i))
                    .ok());
  }
  ASSERT_TRUE(server_h_.WaitFrames(kFrames));
  ASSERT_TRUE(done.WaitAll());  // the payload must outlive the sends
  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    ASSERT_EQ(frames[i].header.round(), i);
    uint32_t m = 0;
    ASSERT_EQ(frames[i].meta.size(), sizeof(m));
    std::memcpy(&m, frames[i].meta.data(), sizeof(m));
    ASSERT_EQ(m, i);
    ASSERT_EQ(frames[i].header.payload_len, i % 3 == 0 ? 0 : payload.size());
    if (frames[i].header.payload_len > 0) {
      ASSERT_EQ(std::memcmp(frames[i].payload.get(), payload.data(), payload.size()), 0);
    }
  }
}

TEST_P(TransportTest, ConcurrentSendersOnOneConnectionDeliverEachFrameOnce) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  constexpr uint32_t kThreads = 4;
  constexpr uint64_t kPerThread = 2500;
  const auto payload = Pattern(512, 9);
  DoneTracker done(kThreads * kPerThread);
  std::vector<std::thread> threads;
  std::atomic<int> send_errors{0};
  for (uint32_t t = 0; t < kThreads; ++t) {
    // cp by an init-capture: clang before 16 cannot capture structured bindings.
    threads.emplace_back([&, t, cp = cp] {
      for (uint64_t i = 0; i < kPerThread; ++i) {
        FrameHeader h = TestHeader(MsgType::kPush, i);
        h.set_tensor(t);
        if (!client_->Send(cp, h, {}, payload.data(), (i % 5) * 100, done.For(t * kPerThread + i))
                 .ok()) {
          ++send_errors;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(send_errors.load(), 0);
  ASSERT_TRUE(server_h_.WaitFrames(kThreads * kPerThread));
  ASSERT_TRUE(done.WaitAll());
  done.ExpectEachOnce();
  EXPECT_EQ(done.ok(), kThreads * kPerThread);

  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), kThreads * kPerThread);
  std::vector<uint64_t> next(kThreads, 0);  // each thread's frames stay in its send order
  for (const Received& r : frames) {
    ASSERT_LT(r.header.tensor(), kThreads);
    ASSERT_EQ(r.header.round(), next[r.header.tensor()]++);
    ASSERT_EQ(r.header.payload_len, (r.header.round() % 5) * 100);
    ASSERT_EQ(std::memcmp(r.payload.get(), payload.data(), r.header.payload_len), 0);
  }
  for (uint32_t t = 0; t < kThreads; ++t) EXPECT_EQ(next[t], kPerThread);
}

TEST_P(TransportTest, SendDoneOncePerFrameAndBufferReusableAfterIt) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  constexpr size_t kRounds = 100;
  constexpr size_t kBytes = 256u << 10;
  std::vector<std::byte> buffer(kBytes);  // one buffer, rewritten after each done()
  DoneTracker done(kRounds);
  for (size_t i = 0; i < kRounds; ++i) {
    Fill(buffer.data(), kBytes, static_cast<uint32_t>(i));
    std::promise<Status> sent;
    auto fut = sent.get_future();
    ASSERT_TRUE(client_
                    ->Send(cp, TestHeader(MsgType::kPush, i), {}, buffer.data(), kBytes,
                           [&sent, &done, i](const Status& st) {
                             done.Record(i, st);
                             sent.set_value(st);
                           })
                    .ok());
    ASSERT_EQ(fut.wait_for(kWait), std::future_status::ready);
    EXPECT_TRUE(fut.get().ok());
  }
  ASSERT_TRUE(server_h_.WaitFrames(kRounds));
  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), kRounds);
  for (size_t i = 0; i < kRounds; ++i) {
    EXPECT_EQ(FirstMismatch(frames[i].payload.get(), kBytes, static_cast<uint32_t>(i)), -1)
        << "frame " << i;
  }
  std::this_thread::sleep_for(50ms);  // a duplicate done() would show up here
  done.ExpectEachOnce();
  EXPECT_EQ(done.ok(), kRounds);
}

TEST_P(TransportTest, BothSidesSendLargePayloadsAtOnce) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  constexpr size_t kFrames = 6;
  constexpr size_t kBytes = 8u << 20;
  const auto a = Pattern(kBytes, 1);
  const auto b = Pattern(kBytes, 2);
  DoneTracker done_a(kFrames), done_b(kFrames);
  // By init-captures: clang before 16 cannot capture structured bindings.
  std::thread ta([&, cp = cp] {
    for (size_t i = 0; i < kFrames; ++i) {
      EXPECT_TRUE(
          client_->Send(cp, TestHeader(MsgType::kPush, i), {}, a.data(), kBytes, done_a.For(i))
              .ok());
    }
  });
  std::thread tb([&, sp = sp] {
    for (size_t i = 0; i < kFrames; ++i) {
      EXPECT_TRUE(
          server_->Send(sp, TestHeader(MsgType::kPullReply, i), {}, b.data(), kBytes, done_b.For(i))
              .ok());
    }
  });
  ta.join();
  tb.join();
  ASSERT_TRUE(server_h_.WaitFrames(kFrames));
  ASSERT_TRUE(client_h_.WaitFrames(kFrames));
  ASSERT_TRUE(done_a.WaitAll());
  ASSERT_TRUE(done_b.WaitAll());
  EXPECT_EQ(done_a.ok(), kFrames);
  EXPECT_EQ(done_b.ok(), kFrames);
  for (const Received& r : server_h_.TakeFrames()) {
    EXPECT_EQ(FirstMismatch(r.payload.get(), kBytes, 1), -1);
  }
  for (const Received& r : client_h_.TakeFrames()) {
    EXPECT_EQ(r.header.msg_type(), MsgType::kPullReply);
    EXPECT_EQ(FirstMismatch(r.payload.get(), kBytes, 2), -1);
  }
}

TEST_P(TransportTest, NullDestinationDiscardsPayloadAndNextFramesArrive) {
  server_h_.discard = [](const FrameHeader& h) { return h.flags == 1; };
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  struct Spec {
    uint8_t flags;
    size_t bytes;
  };
  const std::vector<Spec> specs = {{1, 3u << 20}, {0, 1024}, {1, 0}, {1, 17}, {0, 100u << 10}};
  std::vector<std::vector<std::byte>> payloads;
  DoneTracker done(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    payloads.push_back(Pattern(specs[i].bytes, static_cast<uint32_t>(i)));
    FrameHeader h = TestHeader(MsgType::kPush, i);
    h.flags = specs[i].flags;
    const auto meta = Pattern(5, static_cast<uint32_t>(i));
    ASSERT_TRUE(client_->Send(cp, h, meta, payloads[i].data(), specs[i].bytes, done.For(i)).ok());
  }
  ASSERT_TRUE(server_h_.WaitFrames(specs.size()));
  ASSERT_TRUE(done.WaitAll());
  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(frames[i].header.round(), i);
    EXPECT_EQ(frames[i].header.payload_len, specs[i].bytes);
    EXPECT_EQ(frames[i].meta, Pattern(5, static_cast<uint32_t>(i)));
    if (specs[i].flags == 1) {
      EXPECT_EQ(frames[i].got, nullptr);
    } else {
      ASSERT_NE(frames[i].got, nullptr);
      EXPECT_EQ(FirstMismatch(frames[i].payload.get(), specs[i].bytes, static_cast<uint32_t>(i)),
                -1);
    }
  }
}

TEST_P(TransportTest, RandomBytesDropTheConnectionAndTheListenerKeepsServing) {
  if (!raw_tcp()) GTEST_SKIP() << "listener does not take raw TCP";
  RawClient raw(port_);
  ASSERT_TRUE(raw.connected());
  const PeerId bad = server_h_.WaitInbound();
  ASSERT_NE(bad, kNoPeer);
  std::mt19937 rng(42);
  std::vector<uint8_t> junk(4096);
  for (auto& b : junk) b = static_cast<uint8_t>(rng());
  junk[0] = 'G';  // never the magic
  ASSERT_TRUE(raw.Write(junk.data(), junk.size()));
  ASSERT_TRUE(server_h_.WaitDisconnected(bad));
  EXPECT_EQ(server_h_.why(bad).code(), StatusCode::kProtocol) << server_h_.why(bad).ToString();
  EXPECT_EQ(server_h_.headers(), 0u);
  EXPECT_TRUE(raw.SeesClose());

  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  const auto payload = Pattern(1000, 3);
  DoneTracker done(1);
  ASSERT_TRUE(
      client_->Send(cp, TestHeader(MsgType::kPush, 1), {}, payload.data(), 1000, done.For(0)).ok());
  ASSERT_TRUE(server_h_.WaitFrames(1));
  ASSERT_TRUE(done.WaitAll());
  EXPECT_EQ(FirstMismatch(server_h_.TakeFrames()[0].payload.get(), 1000, 3), -1);
}

TEST_P(TransportTest, OtherProtocolVersionGetsAnErrorFrameThenClose) {
  if (!raw_tcp()) GTEST_SKIP() << "listener does not take raw TCP";
  RawClient raw(port_);
  ASSERT_TRUE(raw.connected());
  const PeerId bad = server_h_.WaitInbound();
  FrameHeader h = MakeHeader(MsgType::kHello, 1000);
  h.version = kProtocolVersion + 1;
  h.request = 77;
  ASSERT_TRUE(raw.Write(&h, sizeof(h)));

  FrameHeader reply;
  ASSERT_TRUE(raw.Read(&reply, sizeof(reply)));
  EXPECT_EQ(reply.magic, kFrameMagic);
  EXPECT_EQ(reply.version, kProtocolVersion);
  EXPECT_EQ(reply.msg_type(), MsgType::kError);
  EXPECT_EQ(reply.status, static_cast<uint16_t>(StatusCode::kUnimplemented));
  EXPECT_EQ(reply.request, 77u);
  EXPECT_EQ(reply.payload_len, 0u);
  ASSERT_GT(reply.meta_len, 0u);
  ASSERT_LE(reply.meta_len, kMaxMetaBytes);
  std::string message(reply.meta_len, '\0');
  ASSERT_TRUE(raw.Read(message.data(), message.size()));
  EXPECT_NE(message.find("version"), std::string::npos) << message;
  EXPECT_TRUE(raw.SeesClose());

  ASSERT_TRUE(server_h_.WaitDisconnected(bad));
  EXPECT_EQ(server_h_.why(bad).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(server_h_.headers(), 0u);
}

TEST_P(TransportTest, OversizedLengthsAreDroppedBeforeAnyCallback) {
  if (!raw_tcp()) GTEST_SKIP() << "listener does not take raw TCP";
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(variant == 0 ? "meta_len" : "payload_len");
    RawClient raw(port_);
    ASSERT_TRUE(raw.connected());
    const PeerId bad = server_h_.WaitInbound();
    FrameHeader h = MakeHeader(MsgType::kPush, 1000);
    if (variant == 0) {
      h.meta_len = kMaxMetaBytes + 1;
    } else {
      h.payload_len = kMaxPayloadBytes + 1;
    }
    ASSERT_TRUE(raw.Write(&h, sizeof(h)));
    ASSERT_TRUE(server_h_.WaitDisconnected(bad));
    EXPECT_EQ(server_h_.why(bad).code(), StatusCode::kProtocol) << server_h_.why(bad).ToString();
    EXPECT_EQ(server_h_.headers(), 0u);
    EXPECT_TRUE(raw.SeesClose());
  }
}

TEST_P(TransportTest, TruncatedPayloadReportsTheLostBufferThenDisconnects) {
  if (!raw_tcp()) GTEST_SKIP() << "listener does not take raw TCP";
  RawClient raw(port_);
  ASSERT_TRUE(raw.connected());
  const PeerId bad = server_h_.WaitInbound();
  FrameHeader h = MakeHeader(MsgType::kPush, 1000);
  h.payload_len = 1u << 20;
  ASSERT_TRUE(raw.Write(&h, sizeof(h)));
  const auto part = Pattern(1024, 0);
  ASSERT_TRUE(raw.Write(part.data(), part.size()));
  raw.Close();

  ASSERT_TRUE(server_h_.WaitDisconnected(bad));
  EXPECT_EQ(server_h_.why(bad).code(), StatusCode::kUnavailable);
  auto lost = server_h_.lost();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].peer, bad);
  EXPECT_NE(lost[0].got, nullptr);
  EXPECT_EQ(lost[0].got, lost[0].handed);
  EXPECT_EQ(lost[0].header.payload_len, 1u << 20);
  EXPECT_EQ(server_h_.events(bad),
            (std::vector<Recorder::Event>{Recorder::kConnected, Recorder::kHeader, Recorder::kLost,
                                          Recorder::kDisconnected}));
  EXPECT_TRUE(server_h_.TakeFrames().empty());
}

TEST_P(TransportTest, SendToClosedOrUnknownPeerFailsWithoutDone) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  std::atomic<int> done_calls{0};
  auto count = [&](const Status&) { ++done_calls; };
  EXPECT_FALSE(client_->Send(cp + 1000, TestHeader(MsgType::kPush, 0), {}, nullptr, 0, count).ok());

  client_->Close(cp);
  ASSERT_TRUE(client_h_.WaitDisconnected(cp));
  ASSERT_TRUE(server_h_.WaitDisconnected(sp));
  EXPECT_EQ(client_h_.why(cp).code(), StatusCode::kAborted) << client_h_.why(cp).ToString();
  EXPECT_FALSE(server_h_.why(sp).ok());
  EXPECT_FALSE(client_->Send(cp, TestHeader(MsgType::kPush, 0), {}, nullptr, 0, count).ok());
  EXPECT_FALSE(server_->Send(sp, TestHeader(MsgType::kPush, 0), {}, nullptr, 0, count).ok());
  client_->Close(cp);  // closing twice is harmless
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(done_calls.load(), 0);
}

TEST_P(TransportTest, FramesQueuedWhenTheConnectionDiesFailExactlyOnce) {
  // The server stalls in OnHeader, so the client's frames back up in its queue; then the
  // server drops the connection.
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  server_h_.after_header = [&](PeerId, const FrameHeader&) {
    std::unique_lock lock(m);
    cv.wait_for(lock, kWait, [&] { return release; });
  };
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  constexpr size_t kFrames = 32;
  constexpr size_t kBytes = 4u << 20;
  const auto payload = Pattern(kBytes, 5);
  DoneTracker done(kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    ASSERT_TRUE(
        client_->Send(cp, TestHeader(MsgType::kPush, i), {}, payload.data(), kBytes, done.For(i))
            .ok());
  }
  ASSERT_TRUE(server_h_.WaitHeaders(1));
  // Let the socket buffers fill; far from all 128 MiB can be in flight.
  std::this_thread::sleep_for(200ms);
  EXPECT_LT(done.total(), kFrames);
  server_->Close(sp);
  {
    std::lock_guard lock(m);
    release = true;
  }
  cv.notify_all();

  ASSERT_TRUE(done.WaitAll());
  done.ExpectEachOnce();
  EXPECT_LT(done.ok(), kFrames);
  EXPECT_NE(done.code(kFrames - 1), StatusCode::kOk);
  EXPECT_TRUE(client_h_.WaitDisconnected(cp));
  EXPECT_TRUE(server_h_.WaitDisconnected(sp));
  EXPECT_FALSE(client_h_.why(cp).ok());
}

TEST_P(TransportTest, CloseFromInsideOnFrameStopsDelivery) {
  server_h_.after_frame = [&](PeerId peer, const FrameHeader& h) {
    if (h.msg_type() == MsgType::kLeave) server_->Close(peer);
  };
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kPush, 0), {}, nullptr, 0).ok());
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kLeave, 1), {}, nullptr, 0).ok());
  for (uint64_t i = 2; i < 50; ++i) {
    (void)client_->Send(cp, TestHeader(MsgType::kPush, i), {}, nullptr, 0);  // may race the close
  }
  ASSERT_TRUE(server_h_.WaitDisconnected(sp));
  EXPECT_EQ(server_h_.why(sp).code(), StatusCode::kAborted) << server_h_.why(sp).ToString();
  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(frames.back().header.msg_type(), MsgType::kLeave);
  EXPECT_TRUE(client_h_.WaitDisconnected(cp));
}

TEST_P(TransportTest, CloseFromInsideOnHeaderAbandonsTheBigPayload) {
  server_h_.after_header = [&](PeerId peer, const FrameHeader& h) {
    if (h.flags == 2) server_->Close(peer);
  };
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  const auto payload = Pattern(64u << 20, 1);
  FrameHeader h = TestHeader(MsgType::kPush, 0);
  h.flags = 2;
  DoneTracker done(1);
  ASSERT_TRUE(client_->Send(cp, h, {}, payload.data(), payload.size(), done.For(0)).ok());
  ASSERT_TRUE(server_h_.WaitDisconnected(sp));
  EXPECT_TRUE(server_h_.TakeFrames().empty());
  auto lost = server_h_.lost();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].got, lost[0].handed);
  ASSERT_TRUE(done.WaitAll());
  done.ExpectEachOnce();
}

TEST_P(TransportTest, ConnectToAClosedPortFailsWithinTheTimeout) {
  // A port that was free a moment ago; nothing listens there.
  const uint16_t port = dsync::testing::FreeLoopbackPort();
  ASSERT_NE(port, 0);

  const auto start = Clock::now();
  auto peer = client_->Connect(host(), port, 300);
  const auto elapsed = Clock::now() - start;
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(peer.status().message().find(fmt::format("{}:{}", host(), port)), std::string::npos)
      << peer.status().message();
  EXPECT_GE(elapsed, 250ms);  // it retried rather than giving up at once
  EXPECT_LT(elapsed, 3s);
}

// A listener whose handler trusts nobody until told, with small limits on strangers.
class Strangers {
 public:
  Strangers(const TransportKind& kind, const std::string& host, ps::AdmissionLimits limits) {
    server_ = kind.limited(limits);
    server_->SetHandler(&h_);
    auto port = server_->Listen(host, 0);
    EXPECT_TRUE(port.ok()) << port.status().ToString();
    port_ = port.ok() ? *port : 0;
  }
  ~Strangers() {
    server_->Shutdown();
    h_.Stop();
  }
  Transport& server() { return *server_; }
  Recorder& h() { return h_; }
  uint16_t port() const { return port_; }

 private:
  Recorder h_;
  std::unique_ptr<Transport> server_;
  uint16_t port_ = 0;
};

TEST_P(TransportTest, AStrangerMaySendOneSmallHelloAndNothingElse) {
  ps::AdmissionLimits limits;
  limits.handshake_timeout = 5s;
  Strangers s(GetParam(), host(), limits);
  // Sent without waiting for completion: it must outlive the client transport.
  static const std::vector<std::byte> payload(100, std::byte{7});
  const std::string hello(200, 'h');
  // A push as the first frame: dropped from its header, nothing delivered.
  auto peer = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  const PeerId first = s.h().WaitInbound();
  ASSERT_NE(first, kNoPeer);
  ASSERT_TRUE(client_->Send(*peer, TestHeader(MsgType::kPush, 1), {}, payload.data(),
                            payload.size())
                  .ok());
  EXPECT_TRUE(s.h().WaitDisconnected(first));
  EXPECT_EQ(s.h().headers(), 0u) << "nothing a stranger sends but a hello reaches the node";
  EXPECT_NE(s.h().why(first).message().find("the first frame must be a hello"),
            std::string::npos)
      << s.h().why(first).ToString();
  // A hello is delivered; a second frame before the node trusts the peer is not.
  peer = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(peer.ok());
  const PeerId second = s.h().WaitInbound();
  ASSERT_TRUE(client_->Send(*peer, TestHeader(MsgType::kHello, 2), AsBytes(hello), nullptr, 0).ok());
  ASSERT_TRUE(s.h().WaitFrames(1));
  ASSERT_TRUE(client_->Send(*peer, TestHeader(MsgType::kPull, 3), {}, nullptr, 0).ok());
  EXPECT_TRUE(s.h().WaitDisconnected(second));
  EXPECT_EQ(s.h().TakeFrames().size(), 1u);
  // Trusted after its hello, a peer sends what it likes.
  peer = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(peer.ok());
  const PeerId third = s.h().WaitInbound();
  ASSERT_TRUE(client_->Send(*peer, TestHeader(MsgType::kHello, 4), AsBytes(hello), nullptr, 0).ok());
  ASSERT_TRUE(s.h().WaitFrames(1));
  s.server().Trust(third);
  ASSERT_TRUE(client_->Send(*peer, TestHeader(MsgType::kPush, 5), {}, payload.data(),
                            payload.size())
                  .ok());
  ASSERT_TRUE(s.h().WaitFrames(2));
  EXPECT_EQ(s.h().TakeFrames().back().header.round(), 5u);
  EXPECT_EQ(s.h().why(third).code(), StatusCode::kOk) << "still connected";
}

TEST_P(TransportTest, SilentStrangersAreDroppedAtTheHandshakeTimeoutTrustedPeersAreNot) {
  ps::AdmissionLimits limits;
  limits.handshake_timeout = 300ms;
  Strangers s(GetParam(), host(), limits);
  const auto start = Clock::now();
  auto silent = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(silent.ok()) << silent.status().ToString();
  const PeerId stranger = s.h().WaitInbound();
  auto known = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(known.ok());
  const PeerId trusted = s.h().WaitInbound();
  s.server().Trust(trusted);
  EXPECT_TRUE(s.h().WaitDisconnected(stranger));
  EXPECT_GE(Clock::now() - start, 250ms);
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_EQ(s.h().why(stranger).code(), StatusCode::kDeadlineExceeded)
      << s.h().why(stranger).ToString();
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(s.h().why(trusted).code(), StatusCode::kOk) << "a trusted peer may be silent";
  ASSERT_TRUE(client_->Send(*known, TestHeader(MsgType::kPull, 9), {}, nullptr, 0).ok());
  EXPECT_TRUE(s.h().WaitFrames(1));
}

TEST_P(TransportTest, StrangersBeyondThePerSourceCapAreTurnedAwayUntilOneIsTrusted) {
  ps::AdmissionLimits limits;
  limits.handshake_timeout = 10s;
  limits.max_pending_per_source = 2;
  Strangers s(GetParam(), host(), limits);
  std::vector<PeerId> inbound;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(client_->Connect(host(), s.port(), 5000).ok());
    inbound.push_back(s.h().WaitInbound());
    ASSERT_NE(inbound.back(), kNoPeer);
  }
  // The third is refused before the node sets anything up for it.
  (void)client_->Connect(host(), s.port(), 300);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(s.h().inbound(), 2u) << "only the first two strangers got in";
  // Once one proves itself, there is room for another stranger.
  s.server().Trust(inbound[0]);
  auto fourth = client_->Connect(host(), s.port(), 5000);
  ASSERT_TRUE(fourth.ok()) << fourth.status().ToString();
  EXPECT_NE(s.h().WaitInbound(), kNoPeer);
}

TEST_P(TransportTest, ListenOnABusyPortFails) {
  Recorder h;
  auto other = GetParam().make();
  other->SetHandler(&h);
  auto port = other->Listen(host(), port_);
  EXPECT_FALSE(port.ok());
  other->Shutdown();
}

TEST_P(TransportTest, ManyConnectCloseCycles) {
  for (int i = 0; i < 100; ++i) {
    auto [cp, sp] = ConnectPair();
    ASSERT_NE(cp, kNoPeer);
    if (i % 2 == 0) {
      client_->Close(cp);
    } else {
      server_->Close(sp);
    }
    ASSERT_TRUE(client_h_.WaitDisconnected(cp));
    ASSERT_TRUE(server_h_.WaitDisconnected(sp));
  }
  // Still fully working afterwards.
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kPush, 1), {}, nullptr, 0).ok());
  ASSERT_TRUE(server_h_.WaitFrames(1));
}

TEST_P(TransportTest, ShutdownWithLiveConnectionsAndInFlightSends) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  auto [cp2, sp2] = ConnectPair();
  ASSERT_NE(cp2, kNoPeer);
  constexpr size_t kFrames = 16;
  const auto payload = Pattern(4u << 20, 8);
  DoneTracker done(kFrames), back(kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    ASSERT_TRUE(client_
                    ->Send(i % 2 ? cp : cp2, TestHeader(MsgType::kPush, i), {}, payload.data(),
                           payload.size(), done.For(i))
                    .ok());
    ASSERT_TRUE(server_
                    ->Send(sp, TestHeader(MsgType::kPullReply, i), {}, payload.data(),
                           payload.size(), back.For(i))
                    .ok());
  }
  const auto start = Clock::now();
  client_->Shutdown();
  client_h_.Stop();
  // Every frame got its done() by the time Shutdown returned.
  EXPECT_EQ(done.total(), kFrames);
  done.ExpectEachOnce();
  server_->Shutdown();
  server_h_.Stop();
  EXPECT_EQ(back.total(), kFrames);
  back.ExpectEachOnce();
  EXPECT_LT(Clock::now() - start, 10s);

  client_->Shutdown();  // idempotent
  server_->Shutdown();
  EXPECT_FALSE(client_->Send(cp, TestHeader(MsgType::kPush, 0), {}, nullptr, 0).ok());
  EXPECT_FALSE(client_->Connect(host(), port_, 100).ok());
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(client_h_.late_callbacks(), 0);
  EXPECT_EQ(server_h_.late_callbacks(), 0);
  EXPECT_TRUE(client_h_.WaitDisconnected(cp));
  EXPECT_TRUE(server_h_.WaitDisconnected(sp2));
}

TEST_P(TransportTest, FramesWhoseSendCompletedArriveEvenIfTheSenderShutsDownAtOnce) {
  // The scheduler's end of job: send kShutdown to every server, wait for the sends to
  // complete, shut the transport down. The servers must get the frame, not just see the
  // connection drop (over RDMA the disconnect travels apart from the data).
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  const auto big = Pattern(1u << 20, 9);
  DoneTracker done(2);
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kPush, 1), {}, big.data(), big.size(),
                            done.For(0)).ok());
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kShutdown, 2), {}, nullptr, 0, done.For(1))
                  .ok());
  ASSERT_TRUE(done.WaitAll());
  EXPECT_EQ(done.ok(), 2u);
  client_->Shutdown();
  ASSERT_TRUE(server_h_.WaitFrames(2));
  auto frames = server_h_.TakeFrames();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(FirstMismatch(frames[0].payload.get(), big.size(), 9), -1);
  EXPECT_EQ(frames[1].header.msg_type(), MsgType::kShutdown);
  EXPECT_TRUE(server_h_.WaitDisconnected(sp));
}

TEST_P(TransportTest, ShutdownFromInsideACallbackDoesNotDeadlock) {
  server_h_.after_frame = [&](PeerId, const FrameHeader& h) {
    if (h.msg_type() == MsgType::kShutdown) server_->Shutdown();
  };
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  ASSERT_TRUE(client_->Send(cp, TestHeader(MsgType::kShutdown, 0), {}, nullptr, 0).ok());
  ASSERT_TRUE(server_h_.WaitDisconnected(sp));
  EXPECT_EQ(server_h_.why(sp).code(), StatusCode::kAborted);
  ASSERT_TRUE(client_h_.WaitDisconnected(cp));
  EXPECT_FALSE(client_->Connect(host(), port_, 200).ok());  // no longer listening
  server_->Shutdown();                                           // from outside: joins the threads
}

TEST_P(TransportTest, DestructorShutsDown) {
  auto [cp, sp] = ConnectPair();
  ASSERT_NE(cp, kNoPeer);
  const auto payload = Pattern(1u << 20, 4);
  DoneTracker done(4);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(client_
                    ->Send(cp, TestHeader(MsgType::kPush, i), {}, payload.data(), payload.size(),
                           done.For(i))
                    .ok());
  }
  client_.reset();
  client_h_.Stop();
  EXPECT_EQ(done.total(), 4u);
  EXPECT_TRUE(server_h_.WaitDisconnected(sp));
  client_ = GetParam().make();  // for TearDown
}

TEST(TcpTransport, EmulatedLinkDelayHoldsEveryFrameAtLeastThatLong) {
  Recorder server_h, client_h;
  auto server = tcp::MakeTcpTransport();
  auto delayed = tcp::MakeTcpTransport({25ms, {}});
  server_h.trust_inbound = server.get();
  server->SetHandler(&server_h);
  delayed->SetHandler(&client_h);
  auto port = server->Listen("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  auto peer = delayed->Connect("127.0.0.1", *port, 5000);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  ASSERT_NE(server_h.WaitInbound(), kNoPeer);
  for (uint64_t i = 0; i < 3; ++i) {
    const auto sent = Clock::now();
    ASSERT_TRUE(delayed->Send(*peer, TestHeader(MsgType::kPull, i), {}, nullptr, 0).ok());
    ASSERT_TRUE(server_h.WaitFrames(i + 1));
    EXPECT_GE(Clock::now() - sent, 25ms) << "frame " << i << " left before its delay";
  }
  auto frames = server_h.TakeFrames();
  ASSERT_EQ(frames.size(), 3u);
  for (uint64_t i = 0; i < frames.size(); ++i) EXPECT_EQ(frames[i].header.round(), i);
  delayed->Shutdown();
  server->Shutdown();
  client_h.Stop();
  server_h.Stop();
}

std::vector<TransportKind> Kinds() {
  std::vector<TransportKind> v(2);
  v[0].name = "tcp";
  v[0].make = [] { return tcp::MakeTcpTransport(); };
  v[0].limited = [](ps::AdmissionLimits a) { return tcp::MakeTcpTransport({0us, a}); };
  v[0].raw_tcp = true;
  // The emulated link latency must not change any behaviour but timing.
  v[1] = v[0];
  v[1].name = "tcp_delayed";
  v[1].make = [] { return tcp::MakeTcpTransport({2ms, {}}); };
  v[1].limited = [](ps::AdmissionLimits a) { return tcp::MakeTcpTransport({2ms, a}); };
#if DSYNC_HAVE_RDMA
  // Runs where an RDMA device is usable: in CI, inside the soft-RoCE VM
  // (scripts/test-rdma.sh); elsewhere it skips, saying why.
  TransportKind rdma;
  rdma.name = "rdma";
  rdma.limited = [](ps::AdmissionLimits a) -> std::unique_ptr<Transport> {
    rdma::RdmaOptions o;
    o.admission = a;
    auto made = rdma::MakeRdmaTransport(o);
    if (!made.ok()) return nullptr;
    return std::move(*made);
  };
  rdma.make = [limited = rdma.limited] { return limited({}); };
  rdma.host = [](Transport& made) {
    return dynamic_cast<rdma::RdmaTransport&>(made).device().ipv4;
  };
  rdma.skip = [] { return rdma::MakeRdmaTransport().status().message(); };
  v.push_back(std::move(rdma));
#endif
  return v;
}

#if DSYNC_HAVE_RDMA
// The DSYNC_RDMA_* variables (no device needed): unset ones keep the defaults, set ones
// replace them, and a bad value is refused naming its variable and what it accepts.
TEST(RdmaTunables, ReadFromTheEnvironmentAndCheckedThere) {
  using Env = std::map<std::string, std::string>;
  auto read = [](const Env& env, rdma::RdmaTunables& t) {
    return rdma::ReadRdmaTunables(t, [&env](const char* name) -> const char* {
      const auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  };
  rdma::RdmaTunables t;
  ASSERT_TRUE(read({}, t).ok());
  EXPECT_EQ(t.slots, 32u);
  EXPECT_EQ(t.slot_bytes, 8192u);
  EXPECT_EQ(t.max_rendezvous, 16u);
  EXPECT_EQ(t.spin, std::chrono::microseconds(200));
  EXPECT_EQ(t.retry_count, 7);

  ASSERT_TRUE(read({{"DSYNC_RDMA_SLOTS", "64"},
                    {"DSYNC_RDMA_SLOT_BYTES", "4096"},
                    {"DSYNC_RDMA_MAX_RENDEZVOUS", "4"},
                    {"DSYNC_RDMA_SPIN_US", "0"},
                    {"DSYNC_RDMA_RETRY_COUNT", "5"}},
                   t)
                  .ok());
  EXPECT_EQ(t.slots, 64u);
  EXPECT_EQ(t.slot_bytes, 4096u);
  EXPECT_EQ(t.max_rendezvous, 4u);
  EXPECT_EQ(t.spin, std::chrono::microseconds(0));
  EXPECT_EQ(t.retry_count, 5);

  const std::pair<Env, std::string> refused[] = {
      {{{"DSYNC_RDMA_SLOTS", "3"}}, "DSYNC_RDMA_SLOTS: '3' is not a whole number from 4 to 4096"},
      {{{"DSYNC_RDMA_SLOTS", "4097"}}, "DSYNC_RDMA_SLOTS: '4097' is not a whole number"},
      {{{"DSYNC_RDMA_SLOTS", "many"}}, "DSYNC_RDMA_SLOTS: 'many' is not a whole number"},
      {{{"DSYNC_RDMA_SLOT_BYTES", "100"}}, "DSYNC_RDMA_SLOT_BYTES: '100' is not a whole number from 512"},
      {{{"DSYNC_RDMA_SLOT_BYTES", "1001"}}, "DSYNC_RDMA_SLOT_BYTES: '1001' is not a multiple of 8"},
      {{{"DSYNC_RDMA_MAX_RENDEZVOUS", "0"}}, "DSYNC_RDMA_MAX_RENDEZVOUS: '0' is not a whole number from 1"},
      {{{"DSYNC_RDMA_SPIN_US", "-1"}}, "DSYNC_RDMA_SPIN_US: '-1' is not a whole number"},
      {{{"DSYNC_RDMA_RETRY_COUNT", "8"}}, "DSYNC_RDMA_RETRY_COUNT: '8' is not a whole number from 0 to 7"},
      // Each in range, together too small for the largest control frame, which goes eagerly.
      {{{"DSYNC_RDMA_SLOTS", "4"}}, "DSYNC_RDMA_SLOTS x DSYNC_RDMA_SLOT_BYTES is 4 x 8192 = 32768 bytes, below the"},
      {{{"DSYNC_RDMA_SLOTS", "64"}, {"DSYNC_RDMA_SLOT_BYTES", "512"}}, "is 64 x 512 = 32768 bytes"},
  };
  for (const auto& [env, message] : refused) {
    rdma::RdmaTunables kept;
    kept.slots = 48;
    const Status st = read(env, kept);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << message;
    EXPECT_NE(st.message().find(message), std::string::npos) << st.message();
    EXPECT_EQ(kept.slots, 48u) << "a refused value changes nothing: " << message;
    EXPECT_EQ(kept.slot_bytes, 8192u) << message;
  }
  // MakeRdmaTransport refuses what ReadRdmaTunables would (callers that set the fields).
  rdma::RdmaTunables small;
  small.slots = 4;
  EXPECT_FALSE(rdma::Validate(small).ok());
  small.slots = 32;
  small.retry_count = 8;
  EXPECT_NE(rdma::Validate(small).message().find("at most 7"), std::string::npos);
  small.retry_count = 7;
  small.slots = 4096;
  small.slot_bytes = 1u << 20;
  EXPECT_NE(rdma::Validate(small).message().find("above the 67108864 a connection may pin"),
            std::string::npos);
  // Every variable it reads is known to the check of unknown DSYNC_* names.
  for (std::string_view name : rdma::RdmaTunableVariables()) {
    EXPECT_TRUE(Config::UnknownVariables({{std::string(name), "1"}}).empty()) << name;
  }
  EXPECT_EQ(rdma::RdmaTunableVariables().size(), 5u);
}
#endif

INSTANTIATE_TEST_SUITE_P(
    Transports, TransportTest, ::testing::ValuesIn(Kinds()),
    [](const ::testing::TestParamInfo<TransportKind>& p) { return p.param.name; });

}  // namespace
}  // namespace dsync::ps
