// `dsyncps local`: a whole cluster as separate processes on this machine. The scheduler is
// started first and reports its port through a pipe (DSYNC_READY_FD), then the servers and
// workers; every child's output is relayed line by line with a prefix naming it. Children
// die with the launcher (PR_SET_PDEATHSIG) and are killed when the job ends or times out.
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
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "roles.h"

namespace dsync::app {
namespace {

using SteadyClock = std::chrono::steady_clock;

struct Child {
  std::string name;
  bool is_worker = false;
  pid_t pid = -1;
  int out = -1;            // its stdout+stderr
  std::string partial;     // an unfinished output line
  bool exited = false;
  int status = 0;
  std::vector<std::string> argv;
  SteadyClock::time_point start_at;  // joiners start late
  bool started = false;
  std::string result;  // a worker's "final loss ..." / "completed ..." line
};

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const char c = static_cast<char>(sig);
  (void)!write(g_signal_pipe[1], &c, 1);
}

std::string RandomToken() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

std::vector<std::string> SplitWords(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// "I=VALUE" -> (I, VALUE)
bool ParseIndexed(const std::string& spec, uint32_t limit, uint32_t* index, std::string* value) {
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

// fork + exec of `self` with the given arguments and extra environment; the child's stdout
// and stderr go to a pipe returned in *out. `ready_fd` (or -1) is passed on as fd 3.
pid_t Spawn(const std::string& self, const std::vector<std::string>& args,
            const std::map<std::string, std::string>& env, int ready_fd, int* out) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(p[0]);
    close(p[1]);
    return -1;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != parent) _exit(1);
    dup2(p[1], STDOUT_FILENO);
    dup2(p[1], STDERR_FILENO);
    if (ready_fd >= 0) {
      if (ready_fd != 3) dup2(ready_fd, 3);  // dup2 clears close-on-exec on the copy
      fcntl(3, F_SETFD, 0);
    }
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(self.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    execv(self.c_str(), argv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", self.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(p[1]);
  *out = p[0];
  return pid;
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

void Relay(Child& c, bool flush) {
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
    const std::string_view line(c.partial.data() + start, nl - start);
    std::printf("[%s] %.*s\n", c.name.c_str(), static_cast<int>(line.size()), line.data());
    if (c.is_worker && (line.find("final ") != std::string_view::npos ||
                        line.find("completed") != std::string_view::npos)) {
      c.result = std::string(line);
    }
  }
  c.partial.erase(0, start);
  if (flush && !c.partial.empty()) {
    std::printf("[%s] %s\n", c.name.c_str(), c.partial.c_str());
    c.partial.clear();
  }
  std::fflush(stdout);
}

std::string Describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return "unknown status";
}

}  // namespace

int RunLocal(const std::string& self, const LocalOptions& local, const Config& job,
             const TrainOptions& train) {
  // Joiners and per-worker flags.
  std::map<uint32_t, std::string> join_spec, extra_spec;
  if (!ParseIndexedAll(local.join, local.workers, "--join", "MILLISECONDS", &join_spec) ||
      !ParseIndexedAll(local.worker_extra, local.workers, "--worker-flags", "FLAGS", &extra_spec)) {
    return 2;
  }
  std::map<uint32_t, uint32_t> join_ms;
  for (const auto& [i, v] : join_spec) {
    join_ms[i] = static_cast<uint32_t>(std::strtoul(v.c_str(), nullptr, 10));
  }
  std::map<uint32_t, std::vector<std::string>> extra;
  for (const auto& [i, v] : extra_spec) extra[i] = SplitWords(v);
  if (join_ms.size() >= local.workers) {
    std::fprintf(stderr, "dsyncps: error: at least one worker must start the job (not join it)\n");
    return 2;
  }

  // The job configuration travels in the environment, as it would under any launcher.
  std::map<std::string, std::string> env = {
      {"DSYNC_SCHEDULER_URI", job.bind_host},
      {"DSYNC_INTERFACE", job.bind_host},
      {"DSYNC_TOKEN", job.token.empty() ? RandomToken() : job.token},
      {"DSYNC_NUM_SERVERS", std::to_string(local.servers)},
      {"DSYNC_NUM_WORKERS", std::to_string(local.workers - join_ms.size())},
      {"DSYNC_SYNC", job.sync.ToString()},
      {"DSYNC_OPTIMIZER", std::string(OptimizerName(job.optimizer.kind))},
      {"DSYNC_LR", fmt::format("{}", job.optimizer.lr)},
      {"DSYNC_MOMENTUM", fmt::format("{}", job.optimizer.momentum)},
      {"DSYNC_BETA1", fmt::format("{}", job.optimizer.beta1)},
      {"DSYNC_BETA2", fmt::format("{}", job.optimizer.beta2)},
      {"DSYNC_EPS", fmt::format("{}", job.optimizer.eps)},
      {"DSYNC_WEIGHT_DECAY", fmt::format("{}", job.optimizer.weight_decay)},
      {"DSYNC_SLICE_BYTES", std::to_string(job.slice_bytes)},
      {"DSYNC_HEARTBEAT_MS", std::to_string(job.heartbeat_interval_ms)},
      {"DSYNC_HEARTBEAT_TIMEOUT_MS", std::to_string(job.heartbeat_timeout_ms)},
      {"DSYNC_CONNECT_TIMEOUT_MS", std::to_string(job.connect_timeout_ms)},
      {"DSYNC_TRANSPORT", job.transport},
      {"DSYNC_STORE", job.store},
      {"DSYNC_PORT", "0"},
  };
  std::vector<std::string> train_args = {
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
      "--log-every", std::to_string(train.log_every)};

  if (pipe(g_signal_pipe) != 0) return 1;
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);

  std::vector<Child> children;
  auto kill_all = [&](int sig) {
    for (Child& c : children) {
      if (c.started && !c.exited) kill(c.pid, sig);
    }
  };

  // 1. The scheduler, on a free port it reports back.
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return 1;
  {
    Child c;
    c.name = "scheduler";
    auto senv = env;
    senv["DSYNC_READY_FD"] = "3";
    senv["DSYNC_SCHEDULER_PORT"] = "0";
    if (!job.audit_log.empty()) senv["DSYNC_AUDIT_LOG"] = job.audit_log;
    c.pid = Spawn(self, {"scheduler"}, senv, ready[1], &c.out);
    c.started = c.pid > 0;
    children.push_back(std::move(c));
  }
  close(ready[1]);
  const int port = children[0].started ? ReadPort(ready[0], 15000) : -1;
  close(ready[0]);
  if (port <= 0) {
    Relay(children[0], true);
    std::fprintf(stderr, "dsyncps: error: the scheduler did not start (see its output above)\n");
    kill_all(SIGKILL);
    return 1;
  }
  env["DSYNC_SCHEDULER_PORT"] = std::to_string(port);
  std::printf("dsyncps local: scheduler on %s:%d, %u server(s), %u worker(s), sync %s\n",
              job.bind_host.c_str(), port, local.servers, local.workers,
              job.sync.ToString().c_str());
  std::fflush(stdout);

  // 2. Servers, then workers (joiners later).
  const auto t0 = SteadyClock::now();
  for (uint32_t i = 0; i < local.servers; ++i) {
    Child c;
    c.name = fmt::format("server {}", i);
    c.argv = {"server"};
    children.push_back(std::move(c));
  }
  for (uint32_t i = 0; i < local.workers; ++i) {
    Child c;
    c.name = fmt::format("worker {}", i);
    c.is_worker = true;
    c.argv = {"worker"};
    c.argv.insert(c.argv.end(), train_args.begin(), train_args.end());
    c.argv.insert(c.argv.end(), extra[i].begin(), extra[i].end());
    c.start_at = t0 + std::chrono::milliseconds(join_ms.contains(i) ? join_ms[i] : 0);
    children.push_back(std::move(c));
  }
  auto server_env = env;
  if (!job.dump_model.empty()) server_env["DSYNC_DUMP_MODEL"] = job.dump_model;

  const auto deadline = t0 + std::chrono::seconds(local.timeout_s);
  std::optional<SteadyClock::time_point> scheduler_gone;
  int interrupted = 0;
  bool timed_out = false;
  for (;;) {
    const auto now = SteadyClock::now();
    for (Child& c : children) {
      if (c.started || c.exited || now < c.start_at || scheduler_gone) continue;
      c.pid = Spawn(self, c.argv, c.is_worker ? env : server_env, -1, &c.out);
      c.started = true;
      if (c.pid < 0) {
        c.exited = true;
        c.status = 127 << 8;
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
      if (fds[i].revents) Relay(*owners[i], false);
    }
    if (fds.back().revents) {
      char sig = 0;
      (void)!read(g_signal_pipe[0], &sig, 1);
      interrupted = sig;
      std::fprintf(stderr, "dsyncps local: signal %d; stopping the cluster\n", sig);
      kill_all(SIGTERM);
    }
    for (Child& c : children) {
      if (!c.started || c.exited) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        if (c.out >= 0) Relay(c, true);
        c.exited = true;
        c.status = status;
        if (&c == &children[0]) scheduler_gone = SteadyClock::now();
      }
    }
    bool all_done = true;
    for (const Child& c : children) all_done = all_done && (c.exited || !c.started);
    if (all_done && (scheduler_gone || interrupted)) break;
    // The job is over once the scheduler is: give the rest a moment, then stop them (a
    // worker stopped by SIGSTOP, say, would never exit by itself).
    if (scheduler_gone && SteadyClock::now() - *scheduler_gone > std::chrono::seconds(2)) {
      kill_all(SIGKILL);
    }
    if (!timed_out && SteadyClock::now() > deadline) {
      timed_out = true;
      std::fprintf(stderr, "dsyncps local: the job did not finish within %u s; killing it\n",
                   local.timeout_s);
      kill_all(SIGKILL);
    }
    if (interrupted && SteadyClock::now() > deadline) kill_all(SIGKILL);
  }

  // Summary: the job succeeded if the scheduler and servers finished cleanly; a worker
  // killed by a signal is a failure the job is built to survive, not a failed job.
  bool ok = !timed_out && !interrupted;
  int killed = 0;
  std::printf("dsyncps local: summary\n");
  for (const Child& c : children) {
    if (!c.started) continue;
    const bool clean = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
    if (c.is_worker && WIFSIGNALED(c.status)) {
      ++killed;
    } else if (!clean) {
      ok = false;
    }
    std::printf("  %-10s %-22s %s\n", c.name.c_str(), Describe(c.status).c_str(),
                c.result.c_str());
  }
  if (killed) std::printf("  %d worker(s) were killed during the job; it carried on without them\n", killed);
  std::printf("dsyncps local: %s\n", ok ? "job finished" : "job FAILED");
  std::fflush(stdout);
  if (interrupted) return 130;
  return ok ? 0 : 1;
}

}  // namespace dsync::app
