#include "ps/rendezvous.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

namespace dsync::ps {
namespace {

constexpr const char* kMagic = "dsyncps-scheduler";

std::string Line(const std::string& host, uint16_t port) {
  return fmt::format("{} {} {}\n", kMagic, host, port);
}

// Reads the file; false while it is missing. A file that is there but not ours is an error.
Result<bool> ReadRendezvous(const std::string& path, std::string* host, uint16_t* port) {
  std::ifstream in(path);
  if (!in) return false;
  std::string magic, h;
  long long p = -1;
  in >> magic >> h >> p;
  if (magic != kMagic || h.empty() || p <= 0 || p > 65535) {
    return Error(StatusCode::kInvalidArgument,
                 "the rendezvous file {} does not hold a scheduler's address (expected '{} HOST "
                 "PORT'); is it another program's file?",
                 path, kMagic);
  }
  *host = h;
  *port = static_cast<uint16_t>(p);
  return true;
}

}  // namespace

Status WriteRendezvous(const std::string& path, const std::string& host, uint16_t port) {
  const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    return Error(StatusCode::kInvalidArgument, "cannot write the rendezvous file {} ({})", tmp,
                 std::strerror(errno));
  }
  const std::string line = Line(host, port);
  const bool written = std::fwrite(line.data(), 1, line.size(), f) == line.size() &&
                       std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  std::fclose(f);
  // rename(2) replaces the file in one step: a reader sees the old one or the whole new one.
  if (!written || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return Error(StatusCode::kInvalidArgument, "cannot write the rendezvous file {} ({})", path,
                 std::strerror(err));
  }
  return Status::Ok();
}

void RemoveRendezvous(const std::string& path, const std::string& host, uint16_t port) {
  std::string h;
  uint16_t p = 0;
  auto ours = ReadRendezvous(path, &h, &p);
  if (ours.ok() && *ours && h == host && p == port) std::remove(path.c_str());
}

Result<Config> FindScheduler(const Config& config) {
  if (config.rendezvous.empty()) return config;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::milliseconds(config.connect_timeout_ms);
  Config found = config;
  bool said = false;
  for (;;) {
    DSYNC_ASSIGN_OR_RETURN(bool there,
                           ReadRendezvous(config.rendezvous, &found.scheduler_host,
                                          &found.scheduler_port));
    if (there) return found;
    if (std::chrono::steady_clock::now() >= deadline) {
      return Error(StatusCode::kDeadlineExceeded,
                   "the rendezvous file {} did not appear within {} ms: is the scheduler "
                   "running with the same --rendezvous, on a file system this node shares?",
                   config.rendezvous, config.connect_timeout_ms);
    }
    if (!said && std::chrono::steady_clock::now() - start > std::chrono::seconds(1)) {
      spdlog::info("waiting for the scheduler's address in {} (for up to {} s)",
                   config.rendezvous, config.connect_timeout_ms / 1000.0);
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Result<PeerId> ReconnectScheduler(Transport& transport, const Config& config,
                                  uint32_t timeout_ms) {
  std::string host = config.scheduler_host;
  uint16_t port = config.scheduler_port;
  if (!config.rendezvous.empty()) (void)ReadRendezvous(config.rendezvous, &host, &port);
  return transport.Connect(host, port, timeout_ms);
}

}  // namespace dsync::ps
