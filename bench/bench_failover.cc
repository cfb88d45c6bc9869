// What losing a server costs a job whose slices have copies (--replicas 2): an in-process
// cluster (TCP on 127.0.0.1) whose workers loop PushPull in bsp; partway through, one server
// is stopped (its sockets close, as a killed process's do). Per run: the median iteration
// before the loss, the time from the stop to the first iteration every worker completes after
// it (the first round after failover), and the median iteration after (one server fewer).
// Several runs; the victim's rank cycles.
//
//   bench_failover [--servers 3] [--replicas 2] [--workers 2] [--size-kib 1024]
//                  [--iters 200] [--stop-at 100] [--runs 5]
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
  int runs = 5;
  int timeout_s = 600;
};

struct Run {
  double before_ms = 0;    // median iteration before the loss
  double failover_ms = 0;  // stop -> every worker's first completed iteration after it
  double after_ms = 0;     // median iteration after
  uint32_t lost = 0;       // servers the scheduler counts as lost
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
        const auto t0 = SteadyClock::now();
        Status st = (*w)->Wait((*w)->PushPull(*t, grad.data(), params.data()));
        const auto t1 = SteadyClock::now();
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
  app.add_option("--runs", o.runs, "runs (the stopped server's rank cycles)");
  app.add_option("--timeout", o.timeout_s, "seconds before the whole run is aborted (a hang)");
  CLI11_PARSE(app, argc, argv);
  if (o.replicas < 2 || o.replicas > o.servers || o.stop_at <= 0 || o.stop_at >= o.iters) {
    fmt::print(stderr, "needs 2 <= --replicas <= --servers and 0 < --stop-at < --iters\n");
    return 2;
  }
  QuietLogs();
  alarm(static_cast<unsigned>(o.timeout_s));
  fmt::print("dsyncps failover: {} servers, {} copies of each slice, {} workers, {} KiB tensor, "
             "bsp, PushPull; a server stopped before iteration {} of {}\n\n",
             o.servers, o.replicas, o.workers, o.size_kib, o.stop_at, o.iters);
  fmt::print("{:>3} {:>6} {:>10} {:>12} {:>10} {:>5}\n", "run", "victim", "before ms",
             "failover ms", "after ms", "lost");
  nlohmann::json rows = nlohmann::json::array();
  std::vector<double> failover, before, after;
  int failed = 0;
  for (int i = 0; i < o.runs; ++i) {
    const uint32_t victim = static_cast<uint32_t>(i) % o.servers;
    const Run r = RunOnce(o, victim);
    fmt::print("{:>3} {:>6} {:>10.2f} {:>12.2f} {:>10.2f} {:>5}{}\n", i, victim, r.before_ms,
               r.failover_ms, r.after_ms, r.lost, r.error.empty() ? "" : "  ERROR: " + r.error);
    std::fflush(stdout);
    nlohmann::json j = {{"run", i},          {"victim", victim},   {"before_ms", r.before_ms},
                        {"failover_ms", r.failover_ms}, {"after_ms", r.after_ms},
                        {"lost", r.lost}};
    if (!r.error.empty()) {
      j["error"] = r.error;
      ++failed;
    } else {
      failover.push_back(r.failover_ms);
      before.push_back(r.before_ms);
      after.push_back(r.after_ms);
    }
    rows.push_back(std::move(j));
  }
  fmt::print("\nmedians over {} run(s): iteration {:.2f} ms before, {:.2f} ms after; stop -> "
             "first round after failover {:.2f} ms (min {:.2f}, max {:.2f})\n",
             failover.size(), Median(before), Median(after), Median(failover), Min(failover),
             Max(failover));
  nlohmann::json result = {{"bench", "failover"},
                           {"servers", o.servers},
                           {"replicas", o.replicas},
                           {"workers", o.workers},
                           {"size_kib", o.size_kib},
                           {"failover_ms_median", Median(failover)},
                           {"before_ms_median", Median(before)},
                           {"after_ms_median", Median(after)},
                           {"runs", rows}};
  fmt::print("\nRESULT {}\n", result.dump());
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
