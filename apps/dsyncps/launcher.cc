// The process launcher behind `dsyncps local` and `dsyncps train` (launcher.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "launcher.h"
#include "ps/keys.h"
#include "ps/net_address.h"
#include "ps/settings.h"
#include "roles.h"
#include "runtime/exec_image.h"

namespace dsync::app {
namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr int kSchedulerStartMs = 15000;  // a scheduler not listening by then never will
// Once the scheduler has ended, the rest have this long to end by themselves.
// How long processes asked to stop (SIGTERM) may take before they are killed.
constexpr std::chrono::seconds kGraceAfterStop{5};

struct Child {
  std::string name;
  std::string program;     // what runs: this program, or a worker's own command
  bool is_worker = false;
  int index = -1;          // workers: their index in the plan
  bool on_demand = false;  // started by LaunchHooks::start_worker
  std::map<std::string, std::string> env;
  pid_t pid = -1;
  int out = -1;            // its stdout+stderr
  std::string partial;     // an unfinished output line
  bool exited = false;
  int status = 0;
  std::vector<std::string> argv;
  SteadyClock::time_point start_at;  // joiners start late
  bool started = false;
  std::string result;  // a worker's "final loss ..." / "completed ..." line
  std::string error;   // the reason in its last error line
  int ready = -1;      // workers: the pipe on which they say they have joined
  bool joined = false;
  std::string stopped;  // why the launcher signalled it ("" if it did not)
};

int g_signal_pipe[2] = {-1, -1};

// A signal and who sent it, as the handler writes it to the pipe (one write of a few
// bytes: atomic, pipe(7)).
struct SignalNote {
  int sig;
  pid_t sender;
};

void OnSignal(int sig, siginfo_t* info, void*) {
  const SignalNote note{sig, info != nullptr ? info->si_pid : 0};
  (void)!write(g_signal_pipe[1], &note, sizeof note);
}

void CatchStopSignals() {
  struct sigaction sa {};
  sa.sa_sigaction = OnSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// "pid 123 (slurmstepd)": who sent a stop signal, for the message (0: the kernel or a
// terminal's Ctrl-C).
std::string DescribeSender(pid_t pid) {
  if (pid <= 0) return "the terminal or the kernel";
  std::ifstream comm(fmt::format("/proc/{}/comm", pid));
  std::string name;
  std::getline(comm, name);
  return name.empty() ? fmt::format("pid {}", pid) : fmt::format("pid {} ({})", pid, name);
}

// fork + exec of `self` with the given arguments and extra environment; the child's stdout
// and stderr go to a pipe returned in *out. `ready_fd` (or -1) is passed on as fd 3.
pid_t Spawn(const std::string& self, const std::vector<std::string>& args,
            const std::map<std::string, std::string>& env, int ready_fd, int* out) {
  // This launcher said what was wrong with the environment it hands on (Config::
  // UnknownVariables); the processes it starts need not say it again, each.
  auto checked = env;
  checked[std::string(ps::kEnvironmentChecked)] = "1";
  const runtime::ExecImage image(self, args, checked);  // before fork: see exec_image.h
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  const pid_t parent = getpid();
  // The child must not run the launcher's handler for a stop signal: it would write to the
  // launcher's signal pipe, and the launcher would stop the job as if it had been signalled
  // (a worker told to stop between fork and exec did that). So the stop signals stay blocked
  // across fork until the child has put back the default action.
  sigset_t stop, old;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  const pid_t pid = fork();
  if (pid < 0) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    close(p[0]);
    close(p[1]);
    return -1;
  }
  if (pid == 0) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);  // one sent meanwhile now ends the child
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != parent) _exit(1);
    // A process group of its own: whatever it starts (a user's data loaders) is stopped with
    // it (kill(-pid)), and cannot hold the launcher after it ended.
    setpgid(0, 0);
    dup2(p[1], STDOUT_FILENO);
    dup2(p[1], STDERR_FILENO);
    if (ready_fd >= 0) {
      if (ready_fd != 3) dup2(ready_fd, 3);  // dup2 clears close-on-exec on the copy
      fcntl(3, F_SETFD, 0);
    }
    image.ExecOrExit();
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  setpgid(pid, pid);  // also here: whichever runs first, the group exists before any kill
  close(p[1]);
  // Never blocking: a process the child started may hold the write end after the child ended.
  fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
  *out = p[0];
  return pid;
}

// Reaps `pid` once it has exited (waiting for that when `block`), and first stops what it
// left in its process group. Until the exited child is reaped its pid cannot be reused, so
// the group id still names its group (waitid's WNOWAIT, wait(2)); killing the group after
// the reap could hit an unrelated group that has taken the id since.
bool Reap(pid_t pid, int* status, bool block) {
  siginfo_t info{};
  const int options = WEXITED | WNOWAIT | (block ? 0 : WNOHANG);
  while (waitid(P_PID, static_cast<id_t>(pid), &info, options) != 0) {
    if (errno != EINTR) return false;
  }
  if (info.si_pid != pid) return false;  // WNOHANG: still running
  kill(-pid, SIGKILL);
  return waitpid(pid, status, 0) == pid;
}

// Reads the scheduler's port from the ready pipe, bounded in time.
int ReadPort(int fd, int timeout_ms) {
  std::string text;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
  while (SteadyClock::now() < deadline) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 100) <= 0) continue;
    char buf[32];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.find('\n') != std::string::npos) return std::atoi(text.c_str());
  }
  return -1;
}

void Emit(const Child& c, std::string_view line, const LaunchHooks& hooks) {
  if (hooks.on_line && !hooks.on_line(c.index, line)) return;
  if (hooks.print) {
    hooks.print(c.name, line);
  } else {
    std::printf("[%s] %.*s\n", c.name.c_str(), static_cast<int>(line.size()), line.data());
  }
}

// The reason in a child's error line: after dsyncps's "error: " or the log's "[error] ".
std::string_view ErrorText(std::string_view line) {
  for (std::string_view tag : {"error: ", "[error] "}) {
    if (auto at = line.find(tag); at != std::string_view::npos) {
      return line.substr(at + tag.size());
    }
  }
  return {};
}

// Keeps what the summary and a failure report need from a line, then relays it.
void Take(Child& c, std::string_view line, const LaunchHooks& hooks) {
  if (c.is_worker && (line.find("final ") != std::string_view::npos ||
                      line.find("completed") != std::string_view::npos)) {
    c.result = std::string(line);
  }
  if (std::string_view why = ErrorText(line); !why.empty()) c.error = std::string(why);
  Emit(c, line, hooks);
}

void Relay(Child& c, bool flush, const LaunchHooks& hooks) {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(c.out, buf, sizeof(buf));
    if (n <= 0) {
      if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        close(c.out);
        c.out = -1;
        flush = true;
      }
      break;
    }
    c.partial.append(buf, static_cast<size_t>(n));
    if (static_cast<size_t>(n) < sizeof(buf)) break;
  }
  size_t start = 0;
  for (size_t nl; (nl = c.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    Take(c, std::string_view(c.partial.data() + start, nl - start), hooks);
  }
  c.partial.erase(0, start);
  if (flush && !c.partial.empty()) {
    Take(c, c.partial, hooks);
    c.partial.clear();
  }
  std::fflush(stdout);
}

std::string Describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return "unknown status";
}

// Starts a worker with a ready pipe as fd 3 (DSYNC_READY_FD): it writes a line there once it
// has joined the job, which tells a worker that failed before joining from one that died in it.
void SpawnWorker(Child& c) {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) {
    c.pid = -1;
    return;
  }
  auto env = c.env;
  env["DSYNC_READY_FD"] = "3";
  c.pid = Spawn(c.program, c.argv, env, ready[1], &c.out);
  close(ready[1]);
  fcntl(ready[0], F_SETFL, fcntl(ready[0], F_GETFL) | O_NONBLOCK);  // as the output pipe
  c.ready = ready[0];
}

// Whether a worker that has ended said it had joined; closes its ready pipe. Its write end is
// gone with it, so the read returns at once.
bool JoinedBeforeExit(Child& c) {
  if (c.ready < 0) return c.joined;
  char buf[64];
  for (ssize_t n; (n = read(c.ready, buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;  // EAGAIN: a process it started holds the pipe; what is there was read
    c.joined = c.joined || std::memchr(buf, '\n', static_cast<size_t>(n)) != nullptr;
  }
  close(c.ready);
  c.ready = -1;
  return c.joined;
}

// "worker 1 failed before joining the job (exit code 2: model 'x' is not ...)"
std::string FailedBeforeJoining(const Child& c) {
  return fmt::format("{} failed before joining the job ({}{}{})", c.name, Describe(c.status),
                     c.error.empty() ? "" : ": ", c.error);
}

}  // namespace

std::vector<std::string> SplitWords(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// "I=VALUE" -> (I, VALUE)
static bool ParseIndexed(const std::string& spec, uint32_t limit, uint32_t* index, std::string* value) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos) return false;
  char* end = nullptr;
  const unsigned long i = std::strtoul(spec.c_str(), &end, 10);
  if (end != spec.c_str() + eq || i >= limit) return false;
  *index = static_cast<uint32_t>(i);
  *value = spec.substr(eq + 1);
  return true;
}

// Every "I=VALUE" of a repeated flag; false (after saying why) on a malformed one.
bool ParseIndexedAll(const std::vector<std::string>& specs, uint32_t limit, const char* flag,
                     const char* what, std::map<uint32_t, std::string>* out) {
  for (const std::string& spec : specs) {
    uint32_t i = 0;
    std::string v;
    if (!ParseIndexed(spec, limit, &i, &v)) {
      std::fprintf(stderr, "dsyncps: error: %s '%s' is not WORKER=%s with WORKER < %u\n", flag,
                   spec.c_str(), what, limit);
      return false;
    }
    (*out)[i] = v;
  }
  return true;
}


void EnsureJobToken(Config& job) {
  if (job.token.empty()) job.token = ps::RandomToken();
}

LaunchOutcome RunCluster(const std::string& self, const Config& given, const LaunchPlan& plan,
                         const LaunchHooks& hooks) {
  Config job = given;
  EnsureJobToken(job);
  LaunchOutcome outcome;
  // Every process gets the address, not a NIC name the others would have to look up again;
  // for a wildcard the scheduler is reached on loopback (all of them run here).
  auto listen = ps::ResolveListenHost(job.bind_host);
  if (!listen.ok()) {
    outcome.failure = listen.status().message();
    return outcome;
  }
  job.bind_host = *listen;
  const std::string scheduler_host = ps::IsWildcardHost(job.bind_host) ? "127.0.0.1" : job.bind_host;
  uint32_t initial = 0;
  for (const WorkerLaunch& w : plan.workers) initial += w.joins() ? 0 : 1;
  // The job configuration travels in the environment, as it would under any launcher.
  Config common = job;
  common.scheduler_host = scheduler_host;
  common.num_servers = plan.servers;
  common.num_workers = initial;
  std::map<std::string, std::string> env = common.ToEnvironment();
  env["DSYNC_PORT"] = "0";

  // Close-on-exec: the programs the launcher runs must not hold (or write to) its signal pipe.
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return outcome;
  CatchStopSignals();

  std::vector<Child> children;
  // A server a signal killed (the launcher did not) in a job with copies of every slice on
  // other servers: the scheduler decides whether the job goes on without it, and ends the job
  // itself when it cannot.
  auto server_killed_with_copies = [&](const Child& c, int status) {
    return !c.is_worker && &c != &children[0] && job.replicas > 1 && WIFSIGNALED(status) &&
           c.stopped.empty();
  };
  // Signals every running child; `why` (the first one) is what the summary says of it.
  auto kill_all = [&](int sig, const std::string& why) {
    for (Child& c : children) {
      if (!c.started || c.exited) continue;
      if (kill(-c.pid, sig) != 0) kill(c.pid, sig);  // its group, else it alone
      if (c.stopped.empty()) c.stopped = why;
    }
  };
  auto finish = [&] {
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    for (Child& c : children) {
      if (c.ready >= 0) close(c.ready);
      if (c.out >= 0) close(c.out);
      // What a running child started (its process group) ends with the job. A reaped
      // child's group was stopped when it was reaped: its id may name another group now.
      if (c.started && c.pid > 0 && !c.exited) kill(-c.pid, SIGKILL);
      outcome.children.push_back({c.name, c.is_worker, c.started, c.status, c.result, c.stopped});
    }
    return outcome;
  };

  // 1. The scheduler, on a free port it reports back.
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return finish();
  {
    Child c;
    c.name = "scheduler";
    auto senv = env;
    senv["DSYNC_READY_FD"] = "3";
    senv["DSYNC_SCHEDULER_PORT"] = "0";
    if (!job.audit_log.empty()) senv["DSYNC_AUDIT_LOG"] = job.audit_log;
    for (const auto& [k, v] : plan.scheduler_env) senv[k] = v;
    c.pid = Spawn(self, {"scheduler"}, senv, ready[1], &c.out);
    c.started = c.pid > 0;
    children.push_back(std::move(c));
  }
  close(ready[1]);
  const int port = children[0].started ? ReadPort(ready[0], kSchedulerStartMs) : -1;
  close(ready[0]);
  if (port <= 0) {
    // Its real exit status for the summary: it has usually exited by itself (refused its
    // configuration); if it hangs, it is killed. Reaped before its output is read to the end.
    Child& sched = children[0];
    if (sched.started) {
      if (!Reap(sched.pid, &sched.status, false)) {
        kill(sched.pid, SIGKILL);
        sched.stopped = fmt::format("it had not reported its port in {} s",
                                    kSchedulerStartMs / 1000);
        Reap(sched.pid, &sched.status, true);
      }
      sched.exited = true;
      Relay(sched, true, hooks);
    }
    outcome.failure = fmt::format("the scheduler did not start ({})",
                                  sched.started ? Describe(sched.status) : "could not run it");
    std::fprintf(stderr, "dsyncps: error: %s; see its output above\n", outcome.failure.c_str());
    return finish();
  }
  env["DSYNC_SCHEDULER_PORT"] = std::to_string(port);
  if (hooks.on_started) hooks.on_started(env);

  // 2. Servers, then workers (joiners later).
  const auto t0 = SteadyClock::now();
  for (uint32_t i = 0; i < plan.servers; ++i) {
    Child c;
    c.name = fmt::format("server {}", i);
    c.argv = {"server"};
    c.env = env;
    if (!job.dump_model.empty()) c.env["DSYNC_DUMP_MODEL"] = job.dump_model;
    children.push_back(std::move(c));
  }
  for (uint32_t i = 0; i < plan.workers.size(); ++i) {
    const WorkerLaunch& w = plan.workers[i];
    Child c;
    c.name = fmt::format("worker {}", i);
    c.is_worker = true;
    c.index = static_cast<int>(i);
    c.env = env;
    if (w.command.empty()) {
      c.program = self;
      c.argv = {"worker"};
      c.argv.insert(c.argv.end(), w.args.begin(), w.args.end());
    } else {
      c.program = w.command.front();
      c.argv.assign(w.command.begin() + 1, w.command.end());
      c.env["DSYNC_ROLE"] = "worker";
      c.env["DSYNC_WORKER_RANK"] = std::to_string(i);
    }
    for (const auto& [k, v] : w.env) c.env[k] = v;
    c.start_at = t0 + std::chrono::milliseconds(w.start_after_ms);
    c.on_demand = w.on_demand;
    children.push_back(std::move(c));
  }

  const auto deadline = plan.timeout_s == 0 ? SteadyClock::time_point::max()
                                            : t0 + std::chrono::seconds(plan.timeout_s);
  // Once every worker has ended the scheduler ends the job within a heartbeat timeout; one
  // still running well after that is stopped, not waited for.
  // (It may wait up to 30 s for observers to read the final model: more than that.)
  const auto grace_after_workers =
      std::chrono::milliseconds(job.heartbeat_timeout_ms) + std::chrono::seconds(45);
  const auto exit_grace = std::chrono::seconds(plan.exit_grace_s);
  std::optional<SteadyClock::time_point> workers_gone;
  std::optional<SteadyClock::time_point> scheduler_gone;
  std::optional<SteadyClock::time_point> terminated;  // when the launcher sent SIGTERM to all
  // A job that writes checkpoints writes one when stopped: its processes get the time for it.
  const std::chrono::seconds grace_after_stop =
      kGraceAfterStop + std::chrono::seconds(job.checkpoint_dir.empty() ? 0 : kStopCheckpointSeconds);
  // Stops the job at once for `why`, unless it is already ending.
  auto stop_job = [&](const std::string& why) {
    if (!outcome.failure.empty() || outcome.interrupted || outcome.timed_out || scheduler_gone) {
      return;
    }
    outcome.failure = why;
    std::fprintf(stderr, "dsyncps: %s; stopping the job\n", why.c_str());
    kill_all(SIGTERM, "the job failed");
    terminated = SteadyClock::now();
  };
  for (;;) {
    const auto now = SteadyClock::now();
    for (Child& c : children) {
      // Nothing new starts once the job is stopping.
      if (c.started || c.exited || now < c.start_at || scheduler_gone || terminated) continue;
      if (c.on_demand && !(hooks.start_worker && hooks.start_worker(c.index))) continue;
      if (c.is_worker) {
        SpawnWorker(c);
      } else {
        c.pid = Spawn(self, c.argv, c.env, -1, &c.out);
      }
      c.started = true;
      if (c.pid < 0) {
        c.exited = true;
        c.status = 127 << 8;
        stop_job(fmt::format("cannot start {}: {}", c.name, std::strerror(errno)));
      }
    }
    std::vector<pollfd> fds;
    std::vector<Child*> owners;
    for (Child& c : children) {
      if (c.out >= 0) {
        fds.push_back({c.out, POLLIN, 0});
        owners.push_back(&c);
      }
    }
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    poll(fds.data(), fds.size(), 50);
    for (size_t i = 0; i < owners.size(); ++i) {
      if (fds[i].revents) Relay(*owners[i], false, hooks);
    }
    if (fds.back().revents) {
      SignalNote note{};
      (void)!read(g_signal_pipe[0], &note, sizeof note);
      const int sig = note.sig;
      if (outcome.interrupted) {
        // Asked again while stopping (a checkpoint may be being written): at once.
        std::fprintf(stderr, "dsyncps: signal %d again; killing the cluster\n", sig);
        kill_all(SIGKILL, fmt::format("the launcher got signal {} twice", sig));
      } else {
        outcome.interrupted = sig;
        std::fprintf(stderr, "dsyncps: signal %d from %s; stopping the cluster\n", sig,
                     DescribeSender(note.sender).c_str());
        kill_all(SIGTERM, fmt::format("the launcher got signal {}", sig));
        if (!terminated) terminated = SteadyClock::now();
      }
    }
    for (Child& c : children) {
      if (!c.started || c.exited) continue;
      int status = 0;
      if (Reap(c.pid, &status, false)) {
        if (c.out >= 0) Relay(c, true, hooks);
        c.exited = true;
        c.status = status;
        if (&c == &children[0]) scheduler_gone = SteadyClock::now();
        if (c.is_worker && hooks.on_worker_exit) {
          hooks.on_worker_exit(c.index, status, !c.stopped.empty());
        }
        // A server that fails while the scheduler runs leaves the job without its slices (or,
        // at start, never able to begin): stop everything rather than wait for the timeout.
        // (Exit 0 is a server told to shut down: the job is ending.)
        const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (server_killed_with_copies(c, status)) {
          std::fprintf(stderr, "dsyncps: %s ended (%s); its slices have other copies\n",
                       c.name.c_str(), Describe(status).c_str());
        } else if (!c.is_worker && &c != &children[0] && !clean) {
          stop_job(fmt::format("{} ended ({}) while the job runs", c.name, Describe(status)));
        }
        // A worker that never joined would be waited for until the timeout (the first
        // workers start round 0 together); one that dies after joining is a scenario the
        // job survives.
        if (c.is_worker && !JoinedBeforeExit(c)) stop_job(FailedBeforeJoining(c));
      }
    }
    if (hooks.on_tick) hooks.on_tick();
    bool workers_done = !plan.workers.empty();
    for (const Child& c : children) workers_done = workers_done && (!c.is_worker || c.exited);
    if (workers_done && !workers_gone) workers_gone = SteadyClock::now();
    if (workers_gone && !scheduler_gone &&
        SteadyClock::now() - *workers_gone > grace_after_workers) {
      stop_job(fmt::format("the scheduler was still running {} s after the last worker ended",
                           std::chrono::duration_cast<std::chrono::seconds>(grace_after_workers)
                               .count()));
    }
    bool all_done = true;
    for (const Child& c : children) all_done = all_done && (c.exited || !c.started);
    if (all_done && (scheduler_gone || outcome.interrupted)) break;
    // The job is over once the scheduler is: give the rest a moment, then stop them (a
    // worker stopped by SIGSTOP, say, would never exit by itself).
    if (scheduler_gone && SteadyClock::now() - *scheduler_gone > exit_grace) {
      kill_all(SIGKILL, fmt::format("still running {} s after the scheduler had ended",
                                    plan.exit_grace_s));
    }
    // A process that does not stop when asked (hung, stopped, its signal not handled yet)
    // is killed after a grace period, not waited for until the job's timeout.
    if (terminated && SteadyClock::now() - *terminated > grace_after_stop) {
      kill_all(SIGKILL, fmt::format("still running {} s after it was asked to stop",
                                    grace_after_stop.count()));
    }
    if (!outcome.timed_out && SteadyClock::now() > deadline) {
      outcome.timed_out = true;
      std::fprintf(stderr, "dsyncps: the job did not finish within %u s; killing it\n",
                   plan.timeout_s);
      kill_all(SIGKILL, fmt::format("the job timed out ({} s)", plan.timeout_s));
    }
    if (outcome.interrupted && SteadyClock::now() > deadline) {
      kill_all(SIGKILL, "the job timed out while stopping");
    }
  }

  // The job succeeded if the scheduler and servers finished cleanly; a worker killed by a
  // signal is a failure the job is built to survive, not a failed job. Workers the launcher
  // stopped itself are not counted as killed: the summary says why it stopped them.
  outcome.ok = !outcome.timed_out && !outcome.interrupted && outcome.failure.empty();
  for (const Child& c : children) {
    if (!c.started) continue;
    const bool clean = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
    if (c.is_worker && WIFSIGNALED(c.status)) {
      if (c.stopped.empty()) ++outcome.workers_killed;
    } else if (server_killed_with_copies(c, c.status)) {
      ++outcome.servers_killed;  // the scheduler, which went on without it, says how it ended
    } else if (!clean) {
      outcome.ok = false;
    }
  }
  return finish();
}

void PrintLaunchSummary(const LaunchOutcome& outcome, const char* who) {
  std::printf("%s: summary\n", who);
  std::map<std::string, std::string> stopped;  // why -> "worker 1, worker 2"
  for (const ChildOutcome& c : outcome.children) {
    if (!c.started) continue;
    std::printf("  %-10s %-22s %s%s\n", c.name.c_str(), Describe(c.status).c_str(),
                c.stopped.empty() ? "" : "(stopped by the launcher) ", c.result.c_str());
    if (!c.stopped.empty()) {
      std::string& names = stopped[c.stopped];
      names += (names.empty() ? "" : ", ") + c.name;
    }
  }
  if (outcome.servers_killed) {
    std::printf("  %d server(s) were killed during the job; their slices' other copies served\n",
                outcome.servers_killed);
  }
  if (outcome.workers_killed) {
    std::printf("  %d worker(s) were killed during the job; it carried on without them\n",
                outcome.workers_killed);
  }
  for (const auto& [why, names] : stopped) {
    std::printf("  the launcher stopped %s: %s\n", names.c_str(), why.c_str());
  }
  if (outcome.ok) {
    std::printf("%s: job finished\n", who);
  } else if (!outcome.failure.empty()) {
    std::printf("%s: job FAILED: %s\n", who, outcome.failure.c_str());
  } else {
    std::printf("%s: job FAILED\n", who);
  }
  std::fflush(stdout);
}

int LaunchExitCode(const LaunchOutcome& outcome) {
  if (outcome.interrupted) return 130;
  return outcome.ok ? 0 : 1;
}

int RunLocal(const std::string& self, const LocalOptions& local, const Config& job,
             const TrainOptions& train) {
  // Joiners and per-worker flags.
  std::map<uint32_t, std::string> join_spec, extra_spec;
  if (!ParseIndexedAll(local.join, local.workers, "--join", "MILLISECONDS", &join_spec) ||
      !ParseIndexedAll(local.worker_extra, local.workers, "--worker-flags", "FLAGS", &extra_spec)) {
    return 2;
  }
  if (join_spec.size() >= local.workers) {
    std::fprintf(stderr, "dsyncps: error: at least one worker must start the job (not join it)\n");
    return 2;
  }
  const std::vector<std::string> train_args = {
      "--model",     train.model,
      "--iters",     std::to_string(train.iters),
      "--batch",     std::to_string(train.batch),
      "--dim",       std::to_string(train.dim),
      "--samples",   std::to_string(train.samples),
      "--tensor-elems", std::to_string(train.tensor_elems),
      "--data-dir",  train.data_dir,
      "--eval-every", std::to_string(train.eval_every),
      "--eval-samples", std::to_string(train.eval_samples),
      "--seed",      std::to_string(train.seed),
      "--compute-ms", fmt::format("{}", train.compute_ms),
      "--log-every", std::to_string(train.log_every),
      "--worker-math", train.worker_math};
  LaunchPlan plan;
  plan.servers = local.servers;
  plan.timeout_s = local.timeout_s;
  for (uint32_t i = 0; i < local.workers; ++i) {
    WorkerLaunch w;
    w.args = train_args;
    if (auto it = extra_spec.find(i); it != extra_spec.end()) {
      for (std::string& word : SplitWords(it->second)) w.args.push_back(std::move(word));
    }
    if (auto it = join_spec.find(i); it != join_spec.end()) {
      w.start_after_ms = std::max<uint32_t>(
          1, static_cast<uint32_t>(std::strtoul(it->second.c_str(), nullptr, 10)));
    }
    plan.workers.push_back(std::move(w));
  }
  LaunchHooks hooks;
  hooks.on_started = [&](const std::map<std::string, std::string>& env) {
    std::printf("dsyncps local: scheduler on %s:%s, %u server(s), %u worker(s), sync %s\n",
                env.at("DSYNC_SCHEDULER_URI").c_str(), env.at("DSYNC_SCHEDULER_PORT").c_str(),
                local.servers,
                local.workers, job.sync.ToString().c_str());
    std::fflush(stdout);
  };
  const LaunchOutcome outcome = RunCluster(self, job, plan, hooks);
  PrintLaunchSummary(outcome, "dsyncps local");
  return LaunchExitCode(outcome);
}

}  // namespace dsync::app
