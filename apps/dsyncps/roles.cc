#include "roles.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "dsync/scheduler.h"
#include "dsync/server.h"

namespace dsync::app {
namespace {

Scheduler* g_scheduler = nullptr;
Server* g_server = nullptr;

void StopNodes() {
  if (g_scheduler) g_scheduler->Stop();
  if (g_server) g_server->Stop();
}

int Fail(const Status& status) {
  std::fprintf(stderr, "dsyncps: error: %s\n", status.ToString().c_str());
  return 1;
}

// A launcher waiting for the scheduler learns its port through DSYNC_READY_FD.
void AnnounceReady(uint16_t port) {
  const char* fd_text = std::getenv("DSYNC_READY_FD");
  if (!fd_text) return;
  const int fd = std::atoi(fd_text);
  const std::string line = fmt::format("{}\n", port);
  (void)!write(fd, line.data(), line.size());
  close(fd);
}

}  // namespace

void HandleStopSignals(void (*stop)()) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // inherited by every thread started later
  std::thread([set, stop] {
    int sig = 0;
    if (sigwait(&set, &sig) == 0) {
      spdlog::warn("signal {} received; stopping", sig);
      stop();
    }
  }).detach();
}

int RunScheduler(const Config& config) {
  HandleStopSignals(StopNodes);
  auto scheduler = Scheduler::Start(config);
  if (!scheduler.ok()) return Fail(scheduler.status());
  g_scheduler = scheduler->get();
  AnnounceReady((*scheduler)->port());
  Status st = (*scheduler)->Run();
  const SchedulerStats s = (*scheduler)->stats();
  spdlog::info("scheduler: {} round(s), {} gradient(s), workers joined {}, left {}, failed {}, "
               "max staleness {}",
               s.rounds_closed, s.gradients_committed, s.workers_joined, s.workers_left,
               s.workers_failed, s.max_staleness);
  g_scheduler = nullptr;
  return st.ok() ? 0 : Fail(st);
}

int RunServer(const Config& config) {
  HandleStopSignals(StopNodes);
  auto server = Server::Start(config);
  if (!server.ok()) return Fail(server.status());
  g_server = server->get();
  Status st = (*server)->Run();
  const ServerStats s = (*server)->stats();
  spdlog::info("server {}: {} round(s), {} gradient(s), {} push(es), {} pull(s), {} refused, "
               "{} staging buffer(s)",
               (*server)->id(), s.rounds_applied, s.gradients_applied, s.pushes_received,
               s.pulls_answered, s.requests_refused, s.staging_buffers);
  g_server = nullptr;
  return st.ok() ? 0 : Fail(st);
}

}  // namespace dsync::app
