// A raw peer for attack and bad-input tests: a plain POSIX socket speaking (or mangling) the
// frame format by hand, a log sink to check why a node refused something, and a member that
// joined through the scheduler with the token the way any token holder can, keeping its
// admission alive with heartbeats, so that its credential opens a server's door.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dsync/config.h"
#include "ps/handshake.h"
#include "ps/protocol.h"

namespace dsync::testing {

using SteadyClock = std::chrono::steady_clock;
inline constexpr std::chrono::seconds kReplyTimeout{5};  // for answers that must come
using ps::FrameHeader;
using namespace std::chrono_literals;

struct Frame {
  FrameHeader header;
  std::string meta;
  std::vector<std::byte> payload;
};

// A plain POSIX socket speaking (or mangling) the frame format by hand.
class RawClient {
 public:
  RawClient() = default;
  ~RawClient() { Close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool Connect(uint16_t port) {
    Close();
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) {
      error_ = std::string("socket: ") + std::strerror(errno);
      return false;
    }
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      error_ = std::string("connect: ") + std::strerror(errno);
      return false;
    }
    return true;
  }

  bool SendBytes(const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    size_t sent = 0;
    while (sent < n) {
      ssize_t k = send(fd_, p + sent, n - sent, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        error_ = std::string("send: ") + std::strerror(errno);
        return false;
      }
      sent += static_cast<size_t>(k);
    }
    return true;
  }

  // Sends header + meta + payload exactly as given: the header's lengths are not touched, so
  // a test can make them lie.
  bool SendRaw(const FrameHeader& h, std::string_view meta, const void* payload, size_t n) {
    std::vector<std::byte> buf(sizeof(h) + meta.size() + n);
    std::memcpy(buf.data(), &h, sizeof(h));
    if (!meta.empty()) std::memcpy(buf.data() + sizeof(h), meta.data(), meta.size());
    if (n > 0) std::memcpy(buf.data() + sizeof(h) + meta.size(), payload, n);
    return SendBytes(buf.data(), buf.size());
  }

  // Sends a well-formed frame: meta_len and payload_len are set from the arguments.
  bool SendFrame(FrameHeader h, std::string_view meta = {}, const void* payload = nullptr,
                 size_t payload_len = 0) {
    h.meta_len = static_cast<uint32_t>(meta.size());
    h.payload_len = payload_len;
    return SendRaw(h, meta, payload, payload_len);
  }

  // Reads one whole frame; nullopt (and error()) on timeout, EOF or reset.
  std::optional<Frame> ReadFrame(std::chrono::milliseconds timeout = kReplyTimeout) {
    const auto deadline = SteadyClock::now() + timeout;
    Frame f;
    if (!ReadExact(&f.header, sizeof(f.header), deadline)) return std::nullopt;
    if (f.header.meta_len > ps::kMaxMetaBytes || f.header.payload_len > (16u << 20)) {
      error_ = "implausible frame lengths in the reply";
      return std::nullopt;
    }
    f.meta.resize(f.header.meta_len);
    f.payload.resize(f.header.payload_len);
    if (!ReadExact(f.meta.data(), f.meta.size(), deadline)) return std::nullopt;
    if (!ReadExact(f.payload.data(), f.payload.size(), deadline)) return std::nullopt;
    return f;
  }

  // True once the peer closed the connection (EOF or reset) within the timeout; false on a
  // timeout or when bytes arrive instead.
  bool IsClosed(std::chrono::milliseconds timeout = kReplyTimeout) {
    const auto deadline = SteadyClock::now() + timeout;
    for (;;) {
      const int rc = PollIn(deadline);
      if (rc == 0) {
        error_ = "the connection is still open";
        return false;
      }
      if (rc < 0) return true;
      char buf[256];
      ssize_t k = recv(fd_, buf, sizeof(buf), 0);
      if (k == 0) return true;
      if (k < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return true;  // ECONNRESET and friends
      }
      error_ = "unexpected bytes arrived instead of a close";
      return false;
    }
  }

  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    closed_ = false;
  }

  // "127.0.0.1:port" of this end, as the node names the connection in its log.
  std::string LocalAddress() const {
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    if (getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip));
    return fmt::format("{}:{}", ip, ntohs(addr.sin_port));
  }

  const std::string& error() const { return error_; }
  // The last failed read ended in EOF or a reset (not a timeout).
  bool peer_closed() const { return closed_; }

 private:
  // 1: readable (or hung up), 0: deadline passed, -1: poll error.
  int PollIn(SteadyClock::time_point deadline) {
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
      if (left.count() <= 0) return 0;
      pollfd pfd{fd_, POLLIN, 0};
      const int rc = poll(&pfd, 1, static_cast<int>(left.count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) return -1;
      if (rc == 0) continue;  // re-check the deadline
      return 1;
    }
  }

  bool ReadExact(void* data, size_t n, SteadyClock::time_point deadline) {
    auto* p = static_cast<char*>(data);
    size_t got = 0;
    while (got < n) {
      const int rc = PollIn(deadline);
      if (rc == 0) {
        error_ = "timed out waiting for a reply";
        return false;
      }
      if (rc < 0) {
        error_ = std::string("poll: ") + std::strerror(errno);
        return false;
      }
      ssize_t k = recv(fd_, p + got, n - got, 0);
      if (k == 0) {
        error_ = "the peer closed the connection";
        closed_ = true;
        return false;
      }
      if (k < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        error_ = std::string("recv: ") + std::strerror(errno);
        closed_ = errno == ECONNRESET;
        return false;
      }
      got += static_cast<size_t>(k);
    }
    return true;
  }

  int fd_ = -1;
  std::string error_;
  bool closed_ = false;
};

// Keeps what the nodes log, so that a test can check why a node refused a connection even
// when the refusal's error frame never arrives.
class CaptureSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  // Installed once, before any cluster runs (the logger's sink list is not thread-safe).
  static CaptureSink& Get() {
    static const std::shared_ptr<CaptureSink> sink = [] {
      auto s = std::make_shared<CaptureSink>();
      spdlog::default_logger()->sinks().push_back(s);
      return s;
    }();
    return *sink;
  }

  void Clear() {
    std::lock_guard lock(mutex_);
    lines_.clear();
  }

  // The first line that contains every one of `parts`, waiting up to `timeout` for it.
  std::optional<std::string> Find(const std::vector<std::string>& parts,
                                  std::chrono::milliseconds timeout = kReplyTimeout) {
    const auto deadline = SteadyClock::now() + timeout;
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        for (const std::string& line : lines_) {
          bool all = true;
          for (const std::string& p : parts) all = all && line.find(p) != std::string::npos;
          if (all) return line;
        }
      }
      if (SteadyClock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(2ms);
    }
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> lines_;
};


// A token holder that asked the scheduler to join and was admitted: it holds a worker (or
// observer) id, the credential for it, and what each server proves itself with. Its link to
// the scheduler stays open and heartbeats, so the admission stays live; it never commits
// unless a test makes it.
class Member {
 public:
  Member() = default;
  ~Member() { Stop(); }
  Member(const Member&) = delete;
  Member& operator=(const Member&) = delete;

  // Joins; the scheduler admits a worker only into a job that has started (or with the first
  // workers), so call it once the job runs.
  ::testing::AssertionResult Join(uint16_t scheduler_port, const std::string& token,
                                  bool observer = false) {
    if (!sched_.Connect(scheduler_port)) return ::testing::AssertionFailure() << sched_.error();
    ps::Hello hello;
    hello.role = Role::kWorker;
    hello.token = token;
    hello.observer = observer;
    ps::FrameHeader h = ps::MakeHeader(ps::MsgType::kHello, 0);
    h.request = 1;
    if (!sched_.SendFrame(h, ps::EncodeHello(hello))) {
      return ::testing::AssertionFailure() << sched_.error();
    }
    for (;;) {
      auto f = sched_.ReadFrame();
      if (!f) return ::testing::AssertionFailure() << "no welcome: " << sched_.error();
      if (f->header.msg_type() == ps::MsgType::kPending) continue;
      if (f->header.msg_type() != ps::MsgType::kHelloAck) {
        return ::testing::AssertionFailure()
               << ps::MsgTypeName(f->header.msg_type()) << ": " << f->meta;
      }
      auto w = ps::DecodeWelcome(ps::AsBytes(f->meta));
      if (!w.ok()) return ::testing::AssertionFailure() << w.status().ToString();
      welcome_ = std::move(w).value();
      break;
    }
    beating_ = true;
    heart_ = std::thread([this] {
      while (beating_.load()) {
        {
          std::lock_guard lock(send_mu_);
          (void)sched_.SendFrame(ps::MakeHeader(ps::MsgType::kHeartbeat, welcome_.id));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    return ::testing::AssertionSuccess();
  }

  NodeId id() const { return welcome_.id; }
  const ps::Welcome& welcome() const { return welcome_; }
  // Its hello to a server: the token and its credential (or another one, to lie).
  std::string HelloTo(const std::string& token, std::optional<ps::Tag> credential = {}) const {
    ps::Hello hello;
    hello.role = Role::kWorker;
    hello.token = token;
    hello.node = welcome_.id;
    hello.observer = welcome_.observer;
    hello.credential = credential.value_or(welcome_.credential);
    return ps::EncodeHello(hello);
  }
  // Sends a frame to the scheduler on its admitted link.
  bool SendToScheduler(const ps::FrameHeader& h, std::string_view meta = {}) {
    std::lock_guard lock(send_mu_);
    return sched_.SendFrame(h, meta);
  }
  // Reads the scheduler's next frame that is not a kPending.
  std::optional<Frame> ReadFromScheduler() {
    for (;;) {
      auto f = sched_.ReadFrame();
      if (!f || f->header.msg_type() != ps::MsgType::kPending) return f;
    }
  }
  bool SchedulerClosed() { return sched_.IsClosed(); }
  void Stop() {
    beating_ = false;
    if (heart_.joinable()) heart_.join();
    sched_.Close();
  }

 private:
  RawClient sched_;
  ps::Welcome welcome_;
  std::mutex send_mu_;
  std::atomic<bool> beating_{false};
  std::thread heart_;
};

}  // namespace dsync::testing
