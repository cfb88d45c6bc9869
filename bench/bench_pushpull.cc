// Push+pull throughput of an in-process cluster over the real TCP transport on 127.0.0.1,
// beside this machine's plain loopback socket bandwidth.
//
// One iteration of a worker = push its gradient of one tensor, then pull the parameters of
// the next clock (PushPull, or Push/Wait then Pull/Wait with --ops split) and wait. The
// figure per worker is 2 * tensor bytes / median iteration time (push + pull), in GB/s.
//
//   bench_pushpull [--sizes 4,64] [--workers 1,2] [--servers 1] [--replicas 1] [--iters N]
//                  [--warmup 3]
//                  [--ops pushpull,split] [--slice-mib 4] [--optimizer sgd]
//                  [--loopback-chunks-mib 64,4] [--loopback-total-mib 256] [--loopback-reps 3]
//   bench_pushpull --join --sizes 64 [--iters N]   one worker of a job started elsewhere
//                  (its DSYNC_* environment): bench/netns_pushpull.sh runs it across hosts
#include <barrier>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

namespace dsync::bench {
namespace {

struct Options {
  std::vector<uint64_t> sizes_mib{4, 64};
  std::vector<uint32_t> workers{1, 2};
  std::vector<uint32_t> servers{1};
  std::vector<uint32_t> replicas{1};  // copies of each slice; rows of one setting interleave
  std::vector<std::string> ops{"pushpull"};
  int iters = 0;  // 0: by size
  int warmup = 3;
  uint64_t slice_mib = 4;
  std::vector<uint64_t> loopback_chunks_mib{64, 4};  // the first is the reference
  uint64_t loopback_total_mib = 256;  // per repetition, before every configuration
  int loopback_reps = 3;
  std::string optimizer = "sgd";
  int timeout_s = 600;
  bool join = false;  // one worker of a job started elsewhere (bench/netns_pushpull.sh)
};

struct WorkerResult {
  std::vector<double> iter_s;  // per timed iteration
  std::vector<double> push_s;  // split mode: push + commit
  std::vector<double> pull_s;  // split mode: pull after the commit
  std::string error;
};

struct Row {
  uint32_t servers = 0;
  uint32_t replicas = 1;
  uint32_t workers = 0;
  uint64_t tensor_bytes = 0;
  std::string op;
  int iters = 0;
  double iter_ms = 0;        // median over workers of each worker's median
  double iter_min_ms = 0;    // fastest iteration of any worker
  double iter_max_ms = 0;    // slowest
  double push_ms = 0;        // split mode only
  double pull_ms = 0;
  double gbps_worker = 0;    // median over workers of 2 * bytes / median iteration
  double gbps_total = 0;     // sum over workers
  uint64_t staging_before = 0;
  uint64_t staging_after = 0;
  std::string error;
};

int ItersFor(const Options& o, uint64_t bytes) {
  if (o.iters > 0) return o.iters;
  // About 4 GiB moved per worker and configuration, at least 10 iterations.
  const uint64_t n = (4096 * kMiB) / (2 * bytes);
  return static_cast<int>(std::clamp<uint64_t>(n, 10, 200));
}

// One worker's run: joins with `wcfg`, registers one tensor of `bytes`, warms up, calls
// `sync` (every worker together), times `iters` iterations, calls `sync` again, leaves.
WorkerResult RunWorker(const Config& wcfg, const Options& o, uint64_t bytes, const std::string& op,
                       int iters, uint32_t r, const std::function<void()>& sync) {
  const size_t n = bytes / sizeof(float);
  WorkerResult res;
  FloatBuffer params(n, 0.0f), grad(n);
  FillPattern(params.data(), n, 1.0f, 1);
  FillPattern(grad.data(), n, 1e-3f, 100 + r);
  std::unique_ptr<Worker> w;
  TensorId tensor = 0;
  auto fail = [&](const Status& st, const char* what) {
    if (res.error.empty()) res.error = fmt::format("worker {}: {}: {}", r, what, st.ToString());
    if (w) w->Abandon();  // lets the scheduler drop this worker instead of waiting for it
    w.reset();
  };
  {
    auto started = Worker::Start(wcfg);
    if (!started.ok()) {
      fail(started.status(), "start");
    } else {
      w = std::move(started).value();
      auto t = w->Register("bench", {params.data(), n});
      if (!t.ok()) {
        fail(t.status(), "register");
      } else {
        tensor = *t;
      }
    }
  }
  // One iteration; returns false (after recording the error) on failure.
  auto iterate = [&](double* push_s, double* pull_s) -> bool {
    if (!w) return false;
    const auto t0 = SteadyClock::now();
    if (op == "pushpull") {
      Status st = w->Wait(w->PushPull(tensor, grad.data(), params.data()));
      if (!st.ok()) {
        fail(st, "pushpull");
        return false;
      }
      *push_s = 0;
      *pull_s = 0;
      return true;
    }
    Status st = w->Wait(w->Push(tensor, grad.data()));
    const auto t1 = SteadyClock::now();
    if (st.ok()) st = w->Wait(w->Pull(tensor, params.data()));
    if (!st.ok()) {
      fail(st, "push/pull");
      return false;
    }
    *push_s = Seconds(t0, t1);
    *pull_s = Seconds(t1, SteadyClock::now());
    return true;
  };
  double push_s = 0, pull_s = 0;
  for (int i = 0; i < o.warmup; ++i) iterate(&push_s, &pull_s);
  sync();
  for (int i = 0; i < iters && w; ++i) {
    const auto t0 = SteadyClock::now();
    if (!iterate(&push_s, &pull_s)) break;
    res.iter_s.push_back(Seconds(t0, SteadyClock::now()));
    res.push_s.push_back(push_s);
    res.pull_s.push_back(pull_s);
  }
  sync();
  if (w) {
    Status st = w->Leave();
    if (!st.ok()) fail(st, "leave");
  }
  return res;
}

Row RunConfig(const Options& o, uint32_t servers, uint32_t replicas, uint32_t workers,
              uint64_t bytes, const std::string& op) {
  Row row;
  row.servers = servers;
  row.replicas = replicas;
  row.workers = workers;
  row.tensor_bytes = bytes;
  row.op = op;
  row.iters = ItersFor(o, bytes);

  Config cfg = BenchConfig(servers, workers);
  cfg.replicas = replicas;
  cfg.slice_bytes = o.slice_mib * kMiB;
  cfg.optimizer.kind = ParseOptimizer(o.optimizer).value();
  cfg.optimizer.lr = 1e-3f;
  auto cluster_or = InProcessCluster::Start(cfg);
  if (!cluster_or.ok()) {
    row.error = cluster_or.status().ToString();
    return row;
  }
  InProcessCluster& cluster = **cluster_or;
  const Config wcfg = cluster.WorkerConfig();

  // Phase boundaries: after warm-up and after the timed section, all workers together; the
  // last one to arrive reads the servers' pool counters.
  int phase = 0;
  auto on_phase = [&]() noexcept {
    if (phase++ == 0) {
      row.staging_before = StagingBuffers(cluster);
    } else {
      row.staging_after = StagingBuffers(cluster);
    }
  };
  std::barrier sync(static_cast<std::ptrdiff_t>(workers), on_phase);

  std::vector<WorkerResult> results(workers);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      results[r] = RunWorker(wcfg, o, bytes, op, row.iters, r, [&] { sync.arrive_and_wait(); });
    });
  }
  for (auto& t : threads) t.join();
  Status finished = cluster.WaitFinished(std::chrono::seconds(30));
  if (!finished.ok()) row.error = "cluster: " + finished.ToString();

  std::vector<double> med_iter, med_push, med_pull, gbps;
  for (const WorkerResult& res : results) {
    if (!res.error.empty() && row.error.empty()) row.error = res.error;
    if (res.iter_s.empty()) continue;
    const double m = Median(res.iter_s);
    med_iter.push_back(m);
    med_push.push_back(Median(res.push_s));
    med_pull.push_back(Median(res.pull_s));
    gbps.push_back(2.0 * static_cast<double>(bytes) / m / kGB);
    row.iter_min_ms = row.iter_min_ms == 0 ? Min(res.iter_s) * 1e3
                                           : std::min(row.iter_min_ms, Min(res.iter_s) * 1e3);
    row.iter_max_ms = std::max(row.iter_max_ms, Max(res.iter_s) * 1e3);
  }
  row.iter_ms = Median(med_iter) * 1e3;
  row.push_ms = Median(med_push) * 1e3;
  row.pull_ms = Median(med_pull) * 1e3;
  row.gbps_worker = Median(gbps);
  for (double g : gbps) row.gbps_total += g;
  return row;
}

// --join: this process is one worker of a job that runs elsewhere (its DSYNC_* environment
// says where, as `dsyncps launch` or `join` set it): the row of the first --sizes entry.
int JoinedWorker(const Options& o) {
  auto cfg = Config::FromProcessEnvironment();
  if (!cfg.ok()) {
    fmt::print(stderr, "bench_pushpull --join: {}\n", cfg.status().ToString());
    return 1;
  }
  cfg->role = Role::kWorker;
  const uint64_t bytes = o.sizes_mib.front() * kMiB;
  const int iters = ItersFor(o, bytes);
  const WorkerResult res = RunWorker(*cfg, o, bytes, o.ops.front(), iters, 0, [] {});
  if (!res.error.empty() || res.iter_s.empty()) {
    fmt::print(stderr, "bench_pushpull --join: {}\n", res.error.empty() ? "no iteration" : res.error);
    return 1;
  }
  const double median = Median(res.iter_s);
  const double gbps = 2.0 * static_cast<double>(bytes) / median / kGB;
  fmt::print("{:>8} {:>8} {:>5} {:>9} {:>9} {:>9} {:>9}\n", "tensor", "op", "iters", "iter ms",
             "min ms", "max ms", "GB/s");
  fmt::print("{:>4} MiB {:>8} {:>5} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.3f}\n", o.sizes_mib.front(),
             o.ops.front(), iters, median * 1e3, Min(res.iter_s) * 1e3, Max(res.iter_s) * 1e3,
             gbps);
  const nlohmann::json result = {{"bench", "pushpull_join"},   {"tensor_mib", o.sizes_mib.front()},
                                 {"op", o.ops.front()},        {"iters", iters},
                                 {"iter_ms_median", median * 1e3}, {"gbps_per_worker", gbps},
                                 {"scheduler", cfg->scheduler_host}};
  fmt::print("RESULT {}\n", result.dump());
  return 0;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps push+pull throughput over TCP loopback"};
  app.add_option("--sizes", o.sizes_mib, "tensor sizes in MiB")->delimiter(',');
  app.add_option("--workers", o.workers, "worker counts (one thread each)")->delimiter(',');
  app.add_option("--servers", o.servers, "server counts")->delimiter(',');
  app.add_option("--replicas", o.replicas, "copies of each slice (each at most the servers)")
      ->delimiter(',');
  app.add_option("--ops", o.ops, "pushpull (PushPull + Wait) and/or split (Push, Wait, Pull, Wait)")
      ->delimiter(',');
  app.add_option("--iters", o.iters, "timed iterations per configuration (0: by size)");
  app.add_option("--warmup", o.warmup, "untimed iterations first (buffer pools fill)");
  app.add_option("--slice-mib", o.slice_mib, "slice size in MiB");
  app.add_option("--optimizer", o.optimizer, "sgd, momentum, adam, adamw, sum");
  app.add_option("--loopback-chunks-mib", o.loopback_chunks_mib,
                 "send() sizes of the baseline; ratios use the first")
      ->delimiter(',');
  app.add_option("--loopback-total-mib", o.loopback_total_mib, "bytes per baseline repetition");
  app.add_option("--loopback-reps", o.loopback_reps, "baseline repetitions");
  app.add_option("--timeout", o.timeout_s, "seconds before the whole run is aborted (a hang)");
  app.add_flag("--join", o.join,
               "be one worker of a job started elsewhere (DSYNC_* environment): time the first "
               "--sizes entry with the first --ops entry");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();
  alarm(static_cast<unsigned>(o.timeout_s));  // SIGALRM ends the process: a stuck cluster
  for (const auto& op : o.ops) {
    if (op != "pushpull" && op != "split") {
      fmt::print(stderr, "unknown --ops entry '{}' (pushpull, split)\n", op);
      return 2;
    }
  }
  if (!ParseOptimizer(o.optimizer).ok()) {
    fmt::print(stderr, "unknown optimizer '{}'\n", o.optimizer);
    return 2;
  }
  if (o.sizes_mib.empty() || o.ops.empty()) {
    fmt::print(stderr, "--sizes and --ops need at least one entry\n");
    return 2;
  }
  if (o.join) return JoinedWorker(o);

  // Baseline: plain TCP on 127.0.0.1, one sender thread, one receiver thread. The machine's
  // loopback speed drifts (other tenants), so it is measured right before every PS
  // configuration and each row is compared with its own adjacent baseline; the summary
  // below the table pools every repetition.
  if (o.loopback_chunks_mib.empty()) o.loopback_chunks_mib = {64};
  struct Baseline {
    uint64_t chunk_mib = 0;
    std::vector<double> gbps;  // every repetition of the run
  };
  std::vector<Baseline> baselines;
  for (uint64_t chunk_mib : o.loopback_chunks_mib) baselines.push_back({chunk_mib, {}});
  // Returns the median GB/s of each chunk size now (0 where it failed).
  auto measure_loopback = [&]() {
    std::vector<double> now;
    for (Baseline& b : baselines) {
      const uint64_t chunk = b.chunk_mib * kMiB;
      const uint64_t total = std::max(o.loopback_total_mib * kMiB, chunk) / chunk * chunk;
      auto lb = MeasureLoopback(chunk, total, o.loopback_reps);
      if (!lb.ok()) {
        fmt::print(stderr, "loopback baseline failed: {}\n", lb.status().ToString());
        now.push_back(0);
        continue;
      }
      std::vector<double> g;
      for (double t : *lb) g.push_back(static_cast<double>(total) / t / kGB);
      b.gbps.insert(b.gbps.end(), g.begin(), g.end());
      now.push_back(Median(g));
    }
    return now;
  };

  fmt::print("dsyncps push+pull over TCP loopback: sync bsp, optimizer {}, slices {} MiB, "
             "{} hardware threads\n",
             o.optimizer, o.slice_mib, std::thread::hardware_concurrency());
  fmt::print("for scale, ps-lite on this machine kind (1 server, 1 worker): 4 MiB push+pull "
             "1.0-1.35 GB/s; 64 MiB 0.06-0.09 GB/s\n");
  fmt::print("GB/s per worker = 2 x tensor bytes / median iteration (push + pull); loN = plain "
             "TCP loopback GB/s (1 sender thread, 1 receiver thread, N MiB send() calls, "
             "{} MiB x {} reps) measured just before the row; x loN = GB/s per worker / loN; "
             "staging = server pool buffers ever created, before -> after the timed section\n\n",
             o.loopback_total_mib, o.loopback_reps);
  std::string lo_heads, ratio_heads;
  for (const Baseline& b : baselines) {
    lo_heads += fmt::format(" {:>6}", fmt::format("lo{}", b.chunk_mib));
    ratio_heads += fmt::format(" {:>7}", fmt::format("x lo{}", b.chunk_mib));
  }
  fmt::print("{:>3} {:>2} {:>3} {:>8} {:>8} {:>5} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}{}{} {:>11}\n",
             "srv", "cp", "wrk", "tensor", "op", "iters", "iter ms", "min ms", "max ms", "push ms",
             "pull ms", "GB/s/wkr", "GB/s tot", lo_heads, ratio_heads, "staging");

  nlohmann::json rows = nlohmann::json::array();
  for (uint32_t s : o.servers) {
    for (uint64_t size : o.sizes_mib) {
      for (uint32_t wk : o.workers) {
        for (const std::string& op : o.ops) {
          for (uint32_t cp : o.replicas) {
            if (cp > s) continue;
            const std::vector<double> lo = measure_loopback();
            Row r = RunConfig(o, s, cp, wk, size * kMiB, op);
            const bool split = op == "split";
            std::string lo_cols, ratios;
            nlohmann::json lo_json = nlohmann::json::object(), ratio_json = nlohmann::json::object();
            for (size_t k = 0; k < baselines.size(); ++k) {
              const double x = lo[k] > 0 ? r.gbps_worker / lo[k] : 0.0;
              lo_cols += fmt::format(" {:>6.2f}", lo[k]);
              ratios += fmt::format(" {:>7.2f}", x);
              lo_json[fmt::format("{}mib", baselines[k].chunk_mib)] = lo[k];
              ratio_json[fmt::format("{}mib", baselines[k].chunk_mib)] = x;
            }
            const double ratio = lo[0] > 0 ? r.gbps_worker / lo[0] : 0.0;
            fmt::print("{:>3} {:>2} {:>3} {:>5} MiB {:>8} {:>5} {:>9.2f} {:>9.2f} {:>9.2f} {:>8} {:>8} "
                       "{:>9.3f} {:>9.3f}{}{} {:>5} -> {:<3}{}\n",
                       s, cp, wk, size, op, r.iters, r.iter_ms, r.iter_min_ms, r.iter_max_ms,
                       split ? fmt::format("{:.2f}", r.push_ms) : "-",
                       split ? fmt::format("{:.2f}", r.pull_ms) : "-", r.gbps_worker,
                       r.gbps_total, lo_cols, ratios, r.staging_before, r.staging_after,
                       r.error.empty() ? "" : "  ERROR: " + r.error);
            std::fflush(stdout);
            nlohmann::json j = {{"servers", s},
                                {"replicas", cp},
                                {"workers", wk},
                                {"tensor_mib", size},
                                {"op", op},
                                {"iters", r.iters},
                                {"iter_ms_median", r.iter_ms},
                                {"iter_ms_min", r.iter_min_ms},
                                {"iter_ms_max", r.iter_max_ms},
                                {"gbps_per_worker", r.gbps_worker},
                                {"gbps_total", r.gbps_total},
                                {"loopback_gbps", lo[0]},
                                {"ratio_to_loopback", ratio},
                                {"loopback_gbps_by_chunk", lo_json},
                                {"ratio_to_loopback_by_chunk", ratio_json},
                                {"staging_before", r.staging_before},
                                {"staging_after", r.staging_after}};
            if (split) {
              j["push_ms_median"] = r.push_ms;
              j["pull_ms_median"] = r.pull_ms;
            }
            if (!r.error.empty()) j["error"] = r.error;
            rows.push_back(std::move(j));
          }
        }
      }
    }
  }
  fmt::print("\n");
  nlohmann::json loopback_json = nlohmann::json::array();
  for (const Baseline& b : baselines) {
    fmt::print("loopback TCP baseline, {} MiB send() calls, all {} reps of the run: median "
               "{:.2f} GB/s (min {:.2f}, max {:.2f})\n",
               b.chunk_mib, b.gbps.size(), Median(b.gbps), Min(b.gbps), Max(b.gbps));
    loopback_json.push_back({{"chunk_mib", b.chunk_mib}, {"gbps_median", Median(b.gbps)},
                             {"gbps_min", Min(b.gbps)}, {"gbps_max", Max(b.gbps)}});
  }
  nlohmann::json result = {{"bench", "pushpull"},
                           {"sync", "bsp"},
                           {"optimizer", o.optimizer},
                           {"slice_mib", o.slice_mib},
                           {"loopback_gbps", Median(baselines.front().gbps)},
                           {"loopback_chunk_mib", baselines.front().chunk_mib},
                           {"loopback", loopback_json},
                           {"rows", rows}};
  fmt::print("\nRESULT {}\n", result.dump());
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
