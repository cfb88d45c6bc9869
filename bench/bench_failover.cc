// What losing a server costs a job whose slices have copies (--replicas 2): an in-process
// cluster (TCP on 127.0.0.1) whose workers loop PushPull in bsp; partway through, one server
// is stopped (its sockets close, as a killed process's do). Per run: the median iteration
// before the loss, the time from the stop to the first iteration every worker completes after
// it (the first round after failover), and the median iteration after (one server fewer).
// Several runs; the victim's rank cycles. With --takeover-at N, a new server starts before
// iteration N and takes the lost rank's place: the time from its start until it holds the
// rank's copies, and the slowest iteration meanwhile.
//
//   bench_failover [--servers 3] [--replicas 2] [--workers 2] [--size-kib 1024]
//                  [--iters 200] [--stop-at 100] [--takeover-at 0] [--runs 5]
#include <atomic>
#include <cstdio>
#include <mutex>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

namespace dsync::bench {
namespace {

struct Options {
  uint32_t servers = 3;
  uint32_t replicas = 2;
  uint32_t workers = 2;
  uint64_t size_kib = 1024;
  int iters = 200;
  int stop_at = 100;
  int takeover_at = 0;  // 0: no new server
  int runs = 5;
  int timeout_s = 600;
};

struct Run {
  double before_ms = 0;    // median iteration before the loss
  double failover_ms = 0;  // stop -> every worker's first completed iteration after it
  double after_ms = 0;     // median iteration after
  uint32_t lost = 0;       // servers the scheduler counts as lost
  double takeover_ms = 0;  // a new server's start -> it holds the lost rank's copies
  double during_ms = 0;    // the slowest iteration of worker 0 meanwhile
  std::string error;
};

Run RunOnce(const Options& o, uint32_t victim) {
  Run run;
  Config cfg = BenchConfig(o.servers, o.workers);
  cfg.replicas = o.replicas;
  cfg.slice_bytes = 256 * 1024;  // several slices per server, so every server holds some
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 1e-3f;
  auto cluster_or = InProcessCluster::Start(cfg);
  if (!cluster_or.ok()) {
    run.error = cluster_or.status().ToString();
    return run;
  }
  InProcessCluster& cluster = **cluster_or;
  const Config wcfg = cluster.WorkerConfig();
  const size_t n = o.size_kib * 1024 / sizeof(float);
  std::atomic<int64_t> stopped_at_ns{0};
  std::mutex mu;
  // The new server (--takeover-at): started by worker 0, run on a thread of its own; when it
  // started and when the scheduler counted it restored (watched from another thread).
  std::unique_ptr<Server> fresh;
  std::thread fresh_run, watch;
  std::atomic<int64_t> fresh_at_ns{0}, restored_at_ns{0};
  std::atomic<bool> done{false};
  std::vector<std::pair<int64_t, int64_t>> spans;  // worker 0's iterations once it started
  std::vector<double> before, after, first_after;
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < o.workers; ++r) {
    threads.emplace_back([&, r] {
      FloatBuffer params(n, 0.0f), grad(n);
      FillPattern(grad.data(), n, 1e-3f, 100 + r);
      auto w = Worker::Start(wcfg);
      if (!w.ok()) {
        std::lock_guard lock(mu);
        run.error = w.status().ToString();
        return;
      }
      auto t = (*w)->Register("bench", {params.data(), n});
      if (!t.ok()) {
        std::lock_guard lock(mu);
        run.error = t.status().ToString();
        (*w)->Abandon();
        return;
      }
      std::vector<double> mine_before, mine_after;
      double mine_first = -1;
      for (int i = 0; i < o.iters; ++i) {
        if (r == 0 && i == o.stop_at) {
          stopped_at_ns = SteadyClock::now().time_since_epoch().count();
          cluster.server(victim).Stop();
        }
        if (r == 0 && o.takeover_at > 0 && i == o.takeover_at) {
          Config sc = wcfg;
          sc.role = Role::kServer;
          sc.port = 0;
          fresh_at_ns = SteadyClock::now().time_since_epoch().count();
          auto s = Server::Start(sc);
          if (!s.ok()) {
            std::lock_guard lock(mu);
            run.error = "the new server: " + s.status().ToString();
          } else {
            fresh = std::move(s).value();
            fresh_run = std::thread([&] { (void)fresh->Run(); });
            watch = std::thread([&] {
              while (!done && cluster.scheduler().stats().servers_restored == 0) {
                std::this_thread::sleep_for(std::chrono::microseconds(200));
              }
              if (!done) restored_at_ns = SteadyClock::now().time_since_epoch().count();
            });
          }
        }
        const auto t0 = SteadyClock::now();
        Status st = (*w)->Wait((*w)->PushPull(*t, grad.data(), params.data()));
        const auto t1 = SteadyClock::now();
        if (r == 0 && fresh_at_ns.load() != 0) {
          spans.emplace_back(t0.time_since_epoch().count(), t1.time_since_epoch().count());
        }
        if (!st.ok()) {
          std::lock_guard lock(mu);
          run.error = fmt::format("worker {} iteration {}: {}", r, i, st.ToString());
          (*w)->Abandon();
          return;
        }
        const int64_t stop = stopped_at_ns.load();
        if (stop == 0) {
          mine_before.push_back(Seconds(t0, t1));
        } else if (mine_first < 0) {
          if (t1.time_since_epoch().count() > stop) {
            mine_first = static_cast<double>(t1.time_since_epoch().count() - stop) / 1e9;
          }
        } else {
          mine_after.push_back(Seconds(t0, t1));
        }
      }
      (void)(*w)->Leave();
      std::lock_guard lock(mu);
      before.insert(before.end(), mine_before.begin(), mine_before.end());
      after.insert(after.end(), mine_after.begin(), mine_after.end());
      first_after.push_back(mine_first);
    });
  }
  for (auto& th : threads) th.join();
  const Status finished = cluster.WaitFinished(std::chrono::seconds(60));
  done = true;
  if (watch.joinable()) watch.join();
  if (fresh_run.joinable()) fresh_run.join();
  if (o.takeover_at > 0 && run.error.empty()) {
    if (restored_at_ns == 0) {
      run.error = "the new server never held the lost rank's copies";
    } else {
      run.takeover_ms = static_cast<double>(restored_at_ns - fresh_at_ns) / 1e6;
      for (const auto& [a, b] : spans) {
        if (a < restored_at_ns) run.during_ms = std::max(run.during_ms, static_cast<double>(b - a) / 1e6);
      }
    }
  }
  if (!finished.ok() && run.error.empty()) run.error = finished.ToString();
  run.lost = cluster.scheduler().stats().servers_lost;
  run.before_ms = Median(before) * 1e3;
  run.after_ms = Median(after) * 1e3;
  run.failover_ms = first_after.empty() ? 0 : Max(first_after) * 1e3;
  return run;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps: what losing a server costs a job with copies of every slice"};
  app.add_option("--servers", o.servers, "servers");
  app.add_option("--replicas", o.replicas, "copies of each slice (2 or more)");
  app.add_option("--workers", o.workers, "workers (one thread each)");
  app.add_option("--size-kib", o.size_kib, "the tensor's size in KiB");
  app.add_option("--iters", o.iters, "iterations per worker and run");
  app.add_option("--stop-at", o.stop_at, "worker 0 stops a server before this iteration");
  app.add_option("--takeover-at", o.takeover_at,
                 "a new server takes the lost one's place before this iteration (0: none)");
  app.add_option("--runs", o.runs, "runs (the stopped server's rank cycles)");
  app.add_option("--timeout", o.timeout_s, "seconds before the whole run is aborted (a hang)");
  CLI11_PARSE(app, argc, argv);
  if (o.replicas < 2 || o.replicas > o.servers || o.stop_at <= 0 || o.stop_at >= o.iters ||
      (o.takeover_at != 0 && (o.takeover_at <= o.stop_at || o.takeover_at >= o.iters))) {
    fmt::print(stderr, "needs 2 <= --replicas <= --servers, 0 < --stop-at < --iters and "
                       "--takeover-at 0 or between them\n");
    return 2;
  }
  QuietLogs();
  alarm(static_cast<unsigned>(o.timeout_s));
  fmt::print("dsyncps failover: {} servers, {} copies of each slice, {} workers, {} KiB tensor, "
             "bsp, PushPull; a server stopped before iteration {} of {}\n\n",
             o.servers, o.replicas, o.workers, o.size_kib, o.stop_at, o.iters);
  fmt::print("{:>3} {:>6} {:>10} {:>12} {:>10} {:>5} {:>12} {:>10}\n", "run", "victim",
             "before ms", "failover ms", "after ms", "lost", "takeover ms", "during ms");
  nlohmann::json rows = nlohmann::json::array();
  std::vector<double> failover, before, after, takeover, during;
  int failed = 0;
  for (int i = 0; i < o.runs; ++i) {
    const uint32_t victim = static_cast<uint32_t>(i) % o.servers;
    const Run r = RunOnce(o, victim);
    fmt::print("{:>3} {:>6} {:>10.2f} {:>12.2f} {:>10.2f} {:>5} {:>12.2f} {:>10.2f}{}\n", i,
               victim, r.before_ms, r.failover_ms, r.after_ms, r.lost, r.takeover_ms,
               r.during_ms, r.error.empty() ? "" : "  ERROR: " + r.error);
    std::fflush(stdout);
    nlohmann::json j = {{"run", i},          {"victim", victim},   {"before_ms", r.before_ms},
                        {"failover_ms", r.failover_ms}, {"after_ms", r.after_ms},
                        {"lost", r.lost}, {"takeover_ms", r.takeover_ms},
                        {"during_ms", r.during_ms}};
    if (!r.error.empty()) {
      j["error"] = r.error;
      ++failed;
    } else {
      failover.push_back(r.failover_ms);
      before.push_back(r.before_ms);
      after.push_back(r.after_ms);
      if (o.takeover_at > 0) {
        takeover.push_back(r.takeover_ms);
        during.push_back(r.during_ms);
      }
    }
    rows.push_back(std::move(j));
  }
  fmt::print("\nmedians over {} run(s): iteration {:.2f} ms before, {:.2f} ms after; stop -> "
             "first round after failover {:.2f} ms (min {:.2f}, max {:.2f})\n",
             failover.size(), Median(before), Median(after), Median(failover), Min(failover),
             Max(failover));
  if (o.takeover_at > 0) {
    fmt::print("a new server's start -> it holds the lost rank's copies {:.2f} ms (min {:.2f}, "
               "max {:.2f}); slowest iteration meanwhile {:.2f} ms\n",
               Median(takeover), Min(takeover), Max(takeover), Median(during));
  }
  nlohmann::json result = {{"bench", "failover"},
                           {"servers", o.servers},
                           {"replicas", o.replicas},
                           {"workers", o.workers},
                           {"size_kib", o.size_kib},
                           {"failover_ms_median", Median(failover)},
                           {"before_ms_median", Median(before)},
                           {"after_ms_median", Median(after)},
                           {"takeover_at", o.takeover_at},
                           {"takeover_ms_median", Median(takeover)},
                           {"during_ms_median", Median(during)},
                           {"runs", rows}};
  fmt::print("\nRESULT {}\n", result.dump());
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
