#include "roles.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dsync/scheduler.h"
#include "dsync/server.h"
#include "ps/launcher_pipe.h"

namespace dsync::app {
namespace {

int Fail(const Status& status) {
  std::fprintf(stderr, "dsyncps: error: %s\n", status.ToString().c_str());
  return 1;
}

// The watcher's pipe, for the signal handler (one watcher at a time).
std::atomic<int> g_signal_fd{-1};
constexpr char kWakeByte = 0;  // from the destructor; never a signal number

void OnStopSignal(int sig) {
  const int fd = g_signal_fd.load();
  const char c = static_cast<char>(sig);
  if (fd >= 0) (void)!write(fd, &c, 1);
}

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

int Refuse(const Status& status) {
  std::fprintf(stderr, "dsyncps: error: %s\n", status.ToString().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// A handler rather than sigwait alone: OpenBLAS starts threads before main with nothing
// blocked, so the kernel may hand the signal to one of them. The handler only writes to a
// pipe; whichever thread runs it, the watcher's thread does the rest.
StopSignalWatcher::StopSignalWatcher() {
  const sigset_t set = StopSignals();
  pthread_sigmask(SIG_BLOCK, &set, &old_mask_);
  if (pipe2(pipe_, O_CLOEXEC) != 0) {
    spdlog::warn("cannot watch for SIGINT/SIGTERM ({}); they will end the process at once",
                 std::strerror(errno));
    pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    return;
  }
  g_signal_fd = pipe_[1];
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  thread_ = std::thread([this] { Loop(); });
}

StopSignalWatcher::~StopSignalWatcher() {
  if (!thread_.joinable()) return;
  (void)!write(pipe_[1], &kWakeByte, 1);
  thread_.join();
  // From here the process is on its way out: a stop signal now (or one sent earlier whose
  // thread has yet to run it; the disposition counts at delivery) is moot, and dying of it
  // would turn a clean exit into a kill.
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_IGN);
  g_signal_fd = -1;
  close(pipe_[0]);
  close(pipe_[1]);
  pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

void StopSignalWatcher::Arm(std::function<void()> stop) {
  std::unique_lock lock(mu_);
  stop_ = std::move(stop);
  if (signal_ != 0 && stop_) {
    lock.unlock();
    stop_();
  }
}

void StopSignalWatcher::Loop() {
  const sigset_t set = StopSignals();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);  // this thread takes them
  for (;;) {
    // poll before read: poll is never restarted after a handler (signal(7)), so a handler
    // that a sanitizer defers to the end of the interrupted call still gets to run; a
    // restarted read would wait for a byte that handler has yet to write.
    pollfd pfd{pipe_[0], POLLIN, 0};
    if (poll(&pfd, 1, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::warn("stop-signal watcher: poll failed ({})", std::strerror(errno));
      break;
    }
    char c = kWakeByte;
    const ssize_t n = read(pipe_[0], &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == kWakeByte) break;
    std::function<void()> stop;
    {
      std::lock_guard lock(mu_);
      if (signal_ != 0) continue;  // already stopping
      signal_ = c;
      stop = stop_;
    }
    spdlog::warn("signal {} received; stopping", static_cast<int>(c));
    if (stop) stop();
  }
}

namespace {

// Starts a role with the stop signals watched, lets `on_started` see it, runs it to the end
// and hands it to `report` for its closing line.
template <typename Role, typename OnStarted, typename Report>
int RunRole(const Config& config, OnStarted on_started, Report report) {
  std::unique_ptr<Role> role;  // outlives the watcher, which may call Stop
  StopSignalWatcher signals;   // before Start: the role's threads inherit its mask
  auto started = Role::Start(config);
  if (!started.ok()) return Fail(started.status());
  role = std::move(*started);
  signals.Arm([&role] { role->Stop(); });
  on_started(*role);
  const Status st = role->Run();
  report(*role);
  return st.ok() ? 0 : Fail(st);
}

}  // namespace

int RunScheduler(const Config& config) {
  return RunRole<Scheduler>(
      config,
      // The launcher learns the port from this line.
      [](Scheduler& scheduler) { ps::TellLauncher(std::to_string(scheduler.port())); },
      [](Scheduler& scheduler) {
        const SchedulerStats s = scheduler.stats();
        spdlog::info("scheduler: {} round(s), {} gradient(s), workers joined {}, left {}, "
                     "failed {}, max staleness {}{}{}",
                     s.rounds_closed, s.gradients_committed, s.workers_joined, s.workers_left,
                     s.workers_failed, s.max_staleness,
                     s.servers_lost ? fmt::format(", servers lost {}", s.servers_lost) : "",
                     s.damped_from ? fmt::format(", damped from round {}", *s.damped_from)
                     : s.growth_peak > 0.0
                         ? fmt::format(", never damped (the gradients' growth peaked at {:.2f} "
                                       "at round {})",
                                       s.growth_peak, s.growth_peak_round)
                         : "");
      });
}

int RunServer(const Config& config) {
  return RunRole<Server>(
      config, [](Server&) {},
      [](Server& server) {
        const ServerStats s = server.stats();
        spdlog::info("server {}: {} round(s), {} gradient(s), {} push(es), {} pull(s), "
                     "{} refused, {} staging buffer(s)",
                     server.id(), s.rounds_applied, s.gradients_applied, s.pushes_received,
                     s.pulls_answered, s.requests_refused, s.staging_buffers);
      });
}

}  // namespace dsync::app
