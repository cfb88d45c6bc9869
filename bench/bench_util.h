// Small helpers shared by the benchmark programs: clocks, medians, pre-touched buffers, an
// in-process cluster (no GoogleTest), and the loopback socket baseline.
//
// Benchmarks are not tests: nothing here asserts on timings. Each program prints a table
// for people and one `RESULT {json}` line for scripts.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "dsync/config.h"
#include "dsync/in_process_cluster.h"
#include "dsync/scheduler.h"
#include "dsync/server.h"
#include "dsync/status.h"
#include "dsync/worker.h"

namespace dsync::bench {

constexpr uint64_t kMiB = 1ull << 20;
constexpr double kGB = 1e9;  // bandwidths are reported in GB/s = 1e9 bytes per second

using SteadyClock = std::chrono::steady_clock;

inline double Seconds(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline double Min(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

inline double Max(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
}

// Benchmarks report, they do not chat: library logs at warn and above only.
inline void QuietLogs() { spdlog::set_level(spdlog::level::warn); }

// Page-aligned float buffer that is written once at allocation, so that first-touch page
// faults (~12 us per 4 KiB page on these VMs) never land inside a timed section.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  explicit FloatBuffer(size_t n, float fill = 0.0f) : n_(n) {
    const size_t bytes = (std::max<size_t>(n, 1) * sizeof(float) + 4095) / 4096 * 4096;
    p_ = static_cast<float*>(std::aligned_alloc(4096, bytes));
    if (p_ == nullptr) throw std::bad_alloc();
    std::fill(p_, p_ + n_, fill);
  }
  ~FloatBuffer() { std::free(p_); }
  FloatBuffer(FloatBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  FloatBuffer& operator=(FloatBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;

  float* data() { return p_; }
  const float* data() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(float); }
  float& operator[](size_t i) { return p_[i]; }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};

// Fills with small distinct values (no denormals, no NaN), deterministic.
inline void FillPattern(float* p, size_t n, float scale, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = scale * (0.5f + static_cast<float>(x >> 8) * (1.0f / 16777216.0f));
  }
}

// Keeps the compiler from dropping a computation whose result is otherwise unused.
inline void DoNotOptimize(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

// The optimizers named on a command line (--optimizers sgd,adam).
inline Result<std::vector<OptimizerKind>> ParseOptimizers(const std::vector<std::string>& names) {
  std::vector<OptimizerKind> kinds;
  for (const std::string& name : names) {
    DSYNC_ASSIGN_OR_RETURN(OptimizerKind k, ParseOptimizer(name));
    kinds.push_back(k);
  }
  return kinds;
}

// --- in-process cluster ---------------------------------------------------------------

inline Config BenchConfig(uint32_t servers, uint32_t workers) {
  Config c;
  c.sync = SyncMode::Bsp();
  c.num_servers = servers;
  c.num_workers = workers;
  c.scheduler_port = 0;
  c.token = "bench-token";
  c.heartbeat_interval_ms = 500;
  c.heartbeat_timeout_ms = 10000;  // a busy 2-core machine must not look like a dead worker
  c.connect_timeout_ms = 10000;
  return c;
}

// Sum over servers of the pool's buffers ever created.
inline uint64_t StagingBuffers(InProcessCluster& cluster) {
  uint64_t n = 0;
  for (size_t i = 0; i < cluster.num_servers(); ++i) n += cluster.server(i).stats().staging_buffers;
  return n;
}

// --- loopback baseline ----------------------------------------------------------------

// A connected TCP pair on 127.0.0.1 (default socket options, like the transport's sockets
// apart from TCP_NODELAY, which does not matter for bulk transfers).
inline Status LoopbackPair(int* send_fd, int* recv_fd) {
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0) return Error(StatusCode::kUnavailable, "socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(lfd);
    return Error(StatusCode::kUnavailable, "listen on 127.0.0.1: {}", std::strerror(err));
  }
  int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (cfd < 0 || connect(cfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    if (cfd >= 0) close(cfd);
    close(lfd);
    return Error(StatusCode::kUnavailable, "connect to 127.0.0.1: {}", std::strerror(err));
  }
  int afd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  const int err = errno;
  close(lfd);
  if (afd < 0) {
    close(cfd);
    return Error(StatusCode::kUnavailable, "accept: {}", std::strerror(err));
  }
  *send_fd = cfd;
  *recv_fd = afd;
  return Status::Ok();
}

// One thread send()s `total` bytes in `chunk`-byte calls from a pre-touched buffer, another
// recv()s them into a reused pre-touched buffer; returns the seconds of each repetition
// (after an untimed one of a single chunk).
inline Result<std::vector<double>> MeasureLoopback(uint64_t chunk, uint64_t total_bytes, int reps) {
  int sfd = -1, rfd = -1;
  DSYNC_RETURN_IF_ERROR(LoopbackPair(&sfd, &rfd));
  std::vector<char> src(chunk, 1), dst(chunk, 0);
  std::vector<double> times;
  std::atomic<bool> failed{false};
  for (int rep = 0; rep <= reps && !failed; ++rep) {
    const uint64_t total = rep == 0 ? chunk : total_bytes;  // rep 0 warms the connection up
    const auto t0 = SteadyClock::now();
    std::thread sender([&] {
      for (uint64_t sent = 0; sent < total;) {
        const uint64_t want = std::min<uint64_t>(chunk, total - sent);
        uint64_t off = 0;
        while (off < want) {
          ssize_t k = send(sfd, src.data() + off, want - off, MSG_NOSIGNAL);
          if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            failed = true;
            shutdown(sfd, SHUT_RDWR);
            return;
          }
          off += static_cast<uint64_t>(k);
        }
        sent += want;
      }
    });
    for (uint64_t got = 0; got < total;) {
      const uint64_t want = std::min<uint64_t>(chunk, total - got);
      ssize_t k = recv(rfd, dst.data(), want, 0);
      if (k <= 0) {
        if (k < 0 && errno == EINTR) continue;
        failed = true;
        shutdown(rfd, SHUT_RDWR);  // unblocks the sender
        break;
      }
      got += static_cast<uint64_t>(k);
    }
    sender.join();
    const auto t1 = SteadyClock::now();
    if (rep > 0) times.push_back(Seconds(t0, t1));
  }
  close(sfd);
  close(rfd);
  if (failed) return Error(StatusCode::kUnavailable, "loopback transfer failed");
  return times;
}

}  // namespace dsync::bench
