// Peak resident memory of a server and of a worker training a 256 MiB model.
//
// Every role runs in its own process so that each peak (VmHWM) is that role's alone: this
// binary re-executes itself with --role scheduler|server|worker, and the parent orchestrates
// (scheduler first on port 0, which it reports back on its stdout, then the server, then the
// workers) and collects one line of results from each child. Children die with the parent
// (PR_SET_PDEATHSIG) and after --timeout seconds (alarm); the parent kills every child on
// any failure, so no process is left behind.
//
//   bench_memory [--optimizers sgd,adam] [--workers 1] [--model-mib 256] [--tensors 8]
//                [--iters 5] [--slice-mib 4] [--timeout 120]
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "ps/optimizer.h"

namespace dsync::bench {
namespace {

struct Options {
  // Parent.
  std::vector<std::string> optimizers{"sgd", "adam"};
  std::vector<uint32_t> workers{1};
  int timeout_s = 120;
  // Shared with the children.
  uint64_t model_mib = 256;
  uint32_t tensors = 8;
  uint32_t iters = 5;
  uint64_t slice_mib = 4;
  // Child.
  std::string role;
  std::string optimizer = "sgd";
  uint32_t num_workers = 1;
  uint16_t port = 0;
};

// kB from a "Name:   123 kB" line of /proc/self/status; 0 when absent.
uint64_t StatusKb(const char* name) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(name) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(prefix, 0) == 0) return std::strtoull(line.c_str() + prefix.size(), nullptr, 10);
  }
  return 0;
}

// Children print results as one line "RESULT-CHILD {json}" on stdout (the parent's pipe).
void Report(nlohmann::json j) {
  j["peak_kb"] = StatusKb("VmHWM");
  j["rss_kb"] = StatusKb("VmRSS");
  std::printf("CHILD %s\n", j.dump().c_str());
  std::fflush(stdout);
}

Config ChildConfig(const Options& o) {
  Config c = BenchConfig(1, o.num_workers);
  c.scheduler_port = o.port;
  c.slice_bytes = o.slice_mib * kMiB;
  c.optimizer.kind = ParseOptimizer(o.optimizer).value();
  c.optimizer.lr = 1e-3f;
  c.connect_timeout_ms = 30000;
  return c;
}

int RunScheduler(const Options& o) {
  Config c = ChildConfig(o);
  c.role = Role::kScheduler;
  c.scheduler_port = 0;
  auto s = Scheduler::Start(c);
  if (!s.ok()) {
    std::fprintf(stderr, "scheduler: %s\n", s.status().ToString().c_str());
    return 1;
  }
  std::printf("PORT %u\n", static_cast<unsigned>((*s)->port()));
  std::fflush(stdout);
  Status st = (*s)->Run();
  const SchedulerStats stats = (*s)->stats();
  Report({{"role", "scheduler"},
          {"ok", st.ok()},
          {"error", st.ok() ? "" : st.ToString()},
          {"rounds", stats.rounds_closed}});
  return st.ok() ? 0 : 1;
}

int RunServer(const Options& o) {
  Config c = ChildConfig(o);
  c.role = Role::kServer;
  auto s = Server::Start(c);
  if (!s.ok()) {
    std::fprintf(stderr, "server: %s\n", s.status().ToString().c_str());
    return 1;
  }
  Status st = (*s)->Run();
  const ServerStats stats = (*s)->stats();
  Report({{"role", "server"},
          {"ok", st.ok()},
          {"error", st.ok() ? "" : st.ToString()},
          {"rounds", stats.rounds_applied},
          {"slices", stats.slices},
          {"staging_buffers", stats.staging_buffers}});
  return st.ok() ? 0 : 1;
}

int RunWorker(const Options& o) {
  Config c = ChildConfig(o);
  c.role = Role::kWorker;
  const uint64_t tensor_elems = o.model_mib * kMiB / sizeof(float) / o.tensors;
  // The worker's own copies: parameters (pulled into) and gradients (pushed from).
  std::vector<FloatBuffer> params, grads;
  for (uint32_t t = 0; t < o.tensors; ++t) {
    params.emplace_back(tensor_elems);
    grads.emplace_back(tensor_elems);
    FillPattern(params.back().data(), tensor_elems, 1.0f, t);
    FillPattern(grads.back().data(), tensor_elems, 1e-3f, 100 + t);
  }
  const uint64_t after_alloc_kb = StatusKb("VmRSS");
  auto w_or = Worker::Start(c);
  if (!w_or.ok()) {
    std::fprintf(stderr, "worker: %s\n", w_or.status().ToString().c_str());
    return 1;
  }
  Worker& w = **w_or;
  Status st;
  std::vector<TensorId> ids;
  for (uint32_t t = 0; t < o.tensors && st.ok(); ++t) {
    auto id = w.Register(fmt::format("t{}", t), {params[t].data(), tensor_elems});
    if (id.ok()) {
      ids.push_back(*id);
    } else {
      st = id.status();
    }
  }
  const auto t0 = SteadyClock::now();
  std::vector<Handle> handles;
  for (uint32_t it = 0; it < o.iters && st.ok(); ++it) {
    handles.clear();
    for (uint32_t t = 0; t < ids.size(); ++t) {
      handles.push_back(w.PushPull(ids[t], grads[t].data(), params[t].data()));
    }
    for (Handle h : handles) {
      Status s = w.Wait(h);
      if (st.ok() && !s.ok()) st = s;
    }
  }
  const double train_s = Seconds(t0, SteadyClock::now());
  if (st.ok()) {
    st = w.Leave();
  } else {
    w.Abandon();
  }
  Report({{"role", "worker"},
          {"ok", st.ok()},
          {"error", st.ok() ? "" : st.ToString()},
          {"rss_after_alloc_kb", after_alloc_kb},
          {"train_s", train_s}});
  return st.ok() ? 0 : 1;
}

// --- parent ---------------------------------------------------------------------------

struct Child {
  std::string role;
  pid_t pid = -1;
  int out_fd = -1;  // its stdout
  std::string buffer;
  std::vector<std::string> lines;
  bool exited = false;
  int status = 0;
};

Result<Child> Spawn(const std::string& self, const std::string& role,
                    const std::vector<std::string>& args) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return Error(StatusCode::kUnavailable, "pipe: {}", std::strerror(errno));
  }
  std::vector<std::string> argv_s = {self, "--role", role};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return Error(StatusCode::kUnavailable, "fork: {}", std::strerror(errno));
  }
  if (pid == 0) {
    // Child: die with the parent; stdout is the pipe.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    execv(self.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  Child c;
  c.role = role;
  c.pid = pid;
  c.out_fd = fds[0];
  return c;
}

void KillAll(std::vector<Child>& children) {
  for (Child& c : children) {
    if (!c.exited && c.pid > 0) kill(c.pid, SIGKILL);
  }
  for (Child& c : children) {
    if (!c.exited && c.pid > 0) {
      waitpid(c.pid, &c.status, 0);
      c.exited = true;
    }
    if (c.out_fd >= 0) close(c.out_fd);
    c.out_fd = -1;
  }
}

// Reads what the children print and reaps those that exit, until `done` says so or the
// deadline passes (false).
template <typename Done>
bool Pump(std::vector<Child>& children, SteadyClock::time_point deadline, Done&& done) {
  while (!done()) {
    const auto now = SteadyClock::now();
    if (now >= deadline) return false;
    std::vector<pollfd> pfds;
    std::vector<Child*> owners;
    for (Child& c : children) {
      if (c.out_fd >= 0) {
        pfds.push_back({c.out_fd, POLLIN, 0});
        owners.push_back(&c);
      }
    }
    const int wait_ms = static_cast<int>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count(), 1, 100));
    if (pfds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    } else if (poll(pfds.data(), pfds.size(), wait_ms) > 0) {
      for (size_t i = 0; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        Child& c = *owners[i];
        char buf[4096];
        const ssize_t k = read(c.out_fd, buf, sizeof(buf));
        if (k > 0) {
          c.buffer.append(buf, static_cast<size_t>(k));
          for (size_t nl; (nl = c.buffer.find('\n')) != std::string::npos;) {
            c.lines.push_back(c.buffer.substr(0, nl));
            c.buffer.erase(0, nl + 1);
          }
        } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
          close(c.out_fd);
          c.out_fd = -1;
        }
      }
    }
    for (Child& c : children) {
      if (!c.exited && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.exited = true;
    }
  }
  return true;
}

std::optional<nlohmann::json> ChildResult(const Child& c) {
  for (const std::string& line : c.lines) {
    if (line.rfind("CHILD ", 0) == 0) {
      auto j = nlohmann::json::parse(line.substr(6), nullptr, false);
      if (!j.is_discarded()) return j;
    }
  }
  return std::nullopt;
}

struct Run {
  std::string optimizer;
  uint32_t workers = 0;
  std::string error;
  std::optional<nlohmann::json> scheduler, server;
  std::vector<nlohmann::json> worker;
  double seconds = 0;
};

Run RunJob(const Options& o, const std::string& self, const std::string& optimizer,
           uint32_t workers) {
  Run run;
  run.optimizer = optimizer;
  run.workers = workers;
  const auto t0 = SteadyClock::now();
  const auto deadline = t0 + std::chrono::seconds(o.timeout_s);
  const std::vector<std::string> common = {
      "--optimizer", optimizer, "--num-workers", std::to_string(workers),
      "--model-mib", std::to_string(o.model_mib), "--tensors", std::to_string(o.tensors),
      "--iters", std::to_string(o.iters), "--slice-mib", std::to_string(o.slice_mib),
      "--timeout", std::to_string(o.timeout_s)};
  std::vector<Child> children;
  children.reserve(2 + workers);
  auto fail = [&](std::string why) {
    KillAll(children);
    run.error = std::move(why);
    run.seconds = Seconds(t0, SteadyClock::now());
    return run;
  };

  auto sched = Spawn(self, "scheduler", common);
  if (!sched.ok()) return fail(sched.status().ToString());
  children.push_back(std::move(sched).value());
  uint16_t port = 0;
  const bool got_port = Pump(children, deadline, [&] {
    for (const std::string& l : children[0].lines) {
      if (l.rfind("PORT ", 0) == 0) port = static_cast<uint16_t>(std::stoul(l.substr(5)));
    }
    return port != 0 || children[0].exited;
  });
  if (!got_port || port == 0) return fail("the scheduler did not report its port");

  std::vector<std::string> args = common;
  args.insert(args.end(), {"--port", std::to_string(port)});
  auto server = Spawn(self, "server", args);
  if (!server.ok()) return fail(server.status().ToString());
  children.push_back(std::move(server).value());
  for (uint32_t i = 0; i < workers; ++i) {
    auto w = Spawn(self, "worker", args);
    if (!w.ok()) return fail(w.status().ToString());
    children.push_back(std::move(w).value());
  }
  const bool finished = Pump(children, deadline, [&] {
    for (const Child& c : children) {
      if (!c.exited || c.out_fd >= 0) {
        // A child that failed ends the job early; the rest is killed below.
        if (c.exited && (!WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0)) return true;
        return false;
      }
    }
    return true;
  });
  for (Child& c : children) {
    if (c.exited && (!WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0)) {
      auto r = ChildResult(c);
      return fail(fmt::format("{} (pid {}) failed: {}", c.role, c.pid,
                              r ? (*r)["error"].get<std::string>()
                                : WIFSIGNALED(c.status)
                                    ? fmt::format("signal {}", WTERMSIG(c.status))
                                    : fmt::format("exit {}", WEXITSTATUS(c.status))));
    }
  }
  if (!finished) return fail(fmt::format("the job did not finish within {} s", o.timeout_s));
  KillAll(children);  // all exited: closes the pipes
  run.scheduler = ChildResult(children[0]);
  run.server = ChildResult(children[1]);
  for (size_t i = 2; i < children.size(); ++i) {
    if (auto r = ChildResult(children[i])) run.worker.push_back(*r);
  }
  if (!run.scheduler || !run.server || run.worker.size() != workers) {
    run.error = "a child exited without reporting";
  }
  run.seconds = Seconds(t0, SteadyClock::now());
  return run;
}

double MiBOf(uint64_t kb) { return static_cast<double>(kb) / 1024.0; }

int Parent(const Options& o) {
  const std::string self = [] {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }();
  if (self.empty()) {
    fmt::print(stderr, "cannot find this executable (/proc/self/exe)\n");
    return 1;
  }
  signal(SIGPIPE, SIG_IGN);

  const double model = static_cast<double>(o.model_mib);
  const double slice = static_cast<double>(o.slice_mib);
  fmt::print("dsyncps peak resident memory (VmHWM) per role, each role its own process\n");
  fmt::print("model {} MiB = {} tensors of {} MiB, slices {} MiB, {} iterations of PushPull on "
             "every tensor, sync bsp, 1 server\n",
             o.model_mib, o.tensors, static_cast<double>(o.model_mib) / o.tensors, o.slice_mib,
             o.iters);
  fmt::print("expected server = model x (1 + state slots: sgd 0, momentum 1, adam 2) + one "
             "receive slice per worker in flight + one pull-reply slice per worker in flight\n");
  fmt::print("bound (the design) = model x (1 + slots) + whole gradient of every worker staged "
             "until its round is decided (workers x model)\n");
  fmt::print("expected worker = its own params + gradients (2 x model); overhead = peak - that\n\n");
  fmt::print("{:>9} {:>3} {:>9} {:>10} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8}\n", "optimizer",
             "wkr", "role", "peak MiB", "expected", "x expect", "bound", "x bound", "staging",
             "time s");

  nlohmann::json rows = nlohmann::json::array();
  bool all_ok = true;
  for (const std::string& opt : o.optimizers) {
    auto kind = ParseOptimizer(opt);
    if (!kind.ok()) {
      fmt::print(stderr, "{}\n", kind.status().ToString());
      return 2;
    }
    const double slots = ps::OptimizerStateSlots(*kind);
    for (uint32_t wk : o.workers) {
      Run r = RunJob(o, self, opt, wk);
      if (!r.error.empty()) {
        all_ok = false;
        fmt::print("{:>9} {:>3}  ERROR: {}\n", opt, wk, r.error);
        rows.push_back({{"optimizer", opt}, {"workers", wk}, {"error", r.error}});
        continue;
      }
      const double w = wk;
      const double server_expected = model * (1 + slots) + 2 * w * slice;
      const double server_bound = model * (1 + slots) + w * model;
      const double worker_expected = 2 * model;
      auto row = [&](const std::string& role, const nlohmann::json& j, double expected,
                     double bound) {
        const double peak = MiBOf(j["peak_kb"].get<uint64_t>());
        const std::string staging =
            j.contains("staging_buffers")
                ? fmt::format("{}", j["staging_buffers"].get<uint64_t>())
                : std::string("-");
        fmt::print("{:>9} {:>3} {:>9} {:>10.1f} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8.1f}\n", opt,
                   wk, role, peak, expected > 0 ? fmt::format("{:.0f}", expected) : "-",
                   expected > 0 ? fmt::format("{:.2f}", peak / expected) : "-",
                   bound > 0 ? fmt::format("{:.0f}", bound) : "-",
                   bound > 0 ? fmt::format("{:.2f}", peak / bound) : "-", staging, r.seconds);
        nlohmann::json out = j;
        out["optimizer"] = opt;
        out["workers"] = wk;
        out["peak_mib"] = peak;
        if (expected > 0) {
          out["expected_mib"] = expected;
          out["ratio_to_expected"] = peak / expected;
        }
        if (bound > 0) {
          out["bound_mib"] = bound;
          out["ratio_to_bound"] = peak / bound;
        }
        rows.push_back(out);
      };
      row("server", *r.server, server_expected, server_bound);
      for (size_t i = 0; i < r.worker.size(); ++i) {
        row(fmt::format("worker{}", i), r.worker[i], worker_expected, worker_expected);
      }
      row("scheduler", *r.scheduler, 0, 0);
      std::fflush(stdout);
    }
  }
  nlohmann::json result = {{"bench", "memory"},
                           {"model_mib", o.model_mib},
                           {"tensors", o.tensors},
                           {"slice_mib", o.slice_mib},
                           {"iters", o.iters},
                           {"rows", rows}};
  fmt::print("\nRESULT {}\n", result.dump());
  return all_ok ? 0 : 1;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps peak resident memory per role"};
  app.add_option("--optimizers", o.optimizers, "optimizers, one job each")->delimiter(',');
  app.add_option("--workers", o.workers, "worker counts, one job each")->delimiter(',');
  app.add_option("--timeout", o.timeout_s, "seconds a job may take before it is killed");
  app.add_option("--model-mib", o.model_mib, "model size in MiB");
  app.add_option("--tensors", o.tensors, "tensors the model is cut into");
  app.add_option("--iters", o.iters, "PushPull iterations");
  app.add_option("--slice-mib", o.slice_mib, "slice size in MiB");
  // Internal: how the parent starts the roles.
  app.add_option("--role", o.role, "(internal) scheduler, server or worker");
  app.add_option("--optimizer", o.optimizer, "(internal) the job's optimizer");
  app.add_option("--num-workers", o.num_workers, "(internal) workers in the job");
  app.add_option("--port", o.port, "(internal) the scheduler's port");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();
  if (o.tensors == 0 || o.model_mib == 0) {
    fmt::print(stderr, "--tensors and --model-mib must be positive\n");
    return 2;
  }
  if (o.role.empty()) return Parent(o);
  alarm(static_cast<unsigned>(o.timeout_s));  // a child never outlives its bound
  if (!ParseOptimizer(o.optimizer).ok()) return 2;
  if (o.role == "scheduler") return RunScheduler(o);
  if (o.role == "server") return RunServer(o);
  if (o.role == "worker") return RunWorker(o);
  fmt::print(stderr, "unknown role '{}'\n", o.role);
  return 2;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
