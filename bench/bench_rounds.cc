// Rounds per second the scheduler closes when gradients are tiny: what per-message costs
// (handshakes excluded) allow. W workers on threads of one process push a 16-float tensor
// and pull the next clock's model (PushPull) for R bsp rounds; every round holds W
// gradients, each committed through the scheduler (with its proof) and applied by the
// servers. Only the public API is used, so the same file measures other releases too
// (bench/proof_cost.sh builds it against the release before proved commits).
//
//   bench_rounds [--workers 4,16] [--servers 1] [--replicas 1] [--journal 0,1] [--rounds 300]
//                [--elems 16] [--reps 3]
// --journal 1 runs the job with a scheduler journal (--journal, in the temporary directory):
// every decision written and fdatasync'd before it is sent.
#include <unistd.h>

#include <barrier>
#include <filesystem>
#include <cstdio>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

namespace dsync::bench {
namespace {

struct Options {
  std::vector<uint32_t> workers{4, 16};
  uint32_t servers = 1;
  std::vector<uint32_t> replicas{1};  // copies of each slice; a job of each per repetition
  std::vector<int> journal{0};        // 1: the scheduler journals its decisions
  int rounds = 300;
  uint32_t elems = 16;
  int reps = 3;
};

// Rounds per second of one job, timed from the first worker's first PushPull to the last
// worker's last completion.
// Releases before replicated slices have no Config::replicas (and keep one copy).
template <typename C>
void SetReplicas(C& c, uint32_t replicas) {
  if constexpr (requires { c.replicas; }) c.replicas = replicas;
}
// Releases before the journal run without one.
template <typename C>
void SetJournal(C& c, const std::string& path) {
  if constexpr (requires { c.journal; }) c.journal = path;
}

Result<double> RoundsPerSecond(const Options& o, uint32_t workers, uint32_t replicas,
                               bool journal) {
  Config cfg = BenchConfig(o.servers, workers);
  SetReplicas(cfg, replicas);
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / fmt::format("bench-rounds-{}.journal", getpid());
  std::filesystem::remove(file);
  if (journal) SetJournal(cfg, file.string());
  cfg.optimizer.kind = OptimizerKind::kSum;
  DSYNC_ASSIGN_OR_RETURN(auto cluster, InProcessCluster::Start(cfg));
  std::vector<std::future<Result<std::unique_ptr<Worker>>>> starting;
  for (uint32_t i = 0; i < workers; ++i) {
    starting.push_back(std::async(std::launch::async,
                                  [c = cluster->WorkerConfig()] { return Worker::Start(c); }));
  }
  std::vector<std::unique_ptr<Worker>> ws;
  for (auto& f : starting) {
    DSYNC_ASSIGN_OR_RETURN(auto w, f.get());
    ws.push_back(std::move(w));
  }
  std::barrier sync(static_cast<std::ptrdiff_t>(workers));
  std::vector<std::string> errors(workers);
  std::vector<SteadyClock::time_point> start(workers), end(workers);
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < workers; ++i) {
    threads.emplace_back([&, i] {
      Worker& w = *ws[i];
      std::vector<float> params(o.elems, 0.0f), grad(o.elems, 1.0f);
      auto t = w.Register("t", params);
      if (!t.ok()) {
        errors[i] = t.status().ToString();
        sync.arrive_and_drop();
        return;
      }
      Status st = w.Wait(w.Pull(*t, params.data()));
      sync.arrive_and_wait();
      start[i] = SteadyClock::now();
      for (int r = 0; r < o.rounds && st.ok(); ++r) {
        st = w.Wait(w.PushPull(*t, grad.data(), params.data()));
      }
      end[i] = SteadyClock::now();
      if (!st.ok()) errors[i] = st.ToString();
      st = w.Leave();
      if (!st.ok() && errors[i].empty()) errors[i] = st.ToString();
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    if (!e.empty()) return Error(StatusCode::kInternal, "{}", e);
  }
  DSYNC_RETURN_IF_ERROR(cluster->WaitFinished(std::chrono::seconds(60)));
  cluster.reset();
  std::filesystem::remove(file);
  const auto first = *std::min_element(start.begin(), start.end());
  const auto last = *std::max_element(end.begin(), end.end());
  return o.rounds / Seconds(first, last);
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"rounds per second with tiny gradients (bsp, in-process cluster over TCP)"};
  app.add_option("--workers", o.workers, "worker counts")->delimiter(',');
  app.add_option("--servers", o.servers, "servers");
  app.add_option("--replicas", o.replicas, "copies of each slice (jobs alternate)")->delimiter(',');
  app.add_option("--journal", o.journal, "0: no scheduler journal, 1: with one (jobs alternate)")
      ->delimiter(',');
  app.add_option("--rounds", o.rounds, "rounds per job");
  app.add_option("--elems", o.elems, "floats in the one tensor");
  app.add_option("--reps", o.reps, "jobs per worker count (the median is reported)");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%8s %6s %8s %8s %12s %12s %14s\n", "workers", "copies", "journal", "rounds",
              "rounds/s", "min..max", "gradients/s");
  // Every (copies, journal) pair, a job of each per repetition.
  std::vector<std::pair<uint32_t, int>> variants;
  for (uint32_t r : o.replicas) {
    for (int j : o.journal) variants.emplace_back(r, j);
  }
  for (uint32_t w : o.workers) {
    std::vector<std::vector<double>> rates(variants.size());
    for (int rep = 0; rep < o.reps; ++rep) {
      for (size_t k = 0; k < variants.size(); ++k) {  // interleaved: drift hits all alike
        auto r = RoundsPerSecond(o, w, variants[k].first, variants[k].second != 0);
        if (!r.ok()) {
          std::fprintf(stderr, "bench_rounds: %u workers: %s\n", w, r.status().ToString().c_str());
          return 1;
        }
        rates[k].push_back(*r);
      }
    }
    for (size_t k = 0; k < variants.size(); ++k) {
      const double median = Median(rates[k]);
      std::printf("%8u %6u %8s %8d %12.0f %5.0f..%-6.0f %14.0f\n", w, variants[k].first,
                  variants[k].second ? "yes" : "no", o.rounds, median, Min(rates[k]),
                  Max(rates[k]), median * w);
      rows.push_back({{"workers", w}, {"replicas", variants[k].first},
                      {"journal", variants[k].second != 0}, {"rounds", o.rounds},
                      {"rounds_per_s", median}, {"min", Min(rates[k])}, {"max", Max(rates[k])},
                      {"gradients_per_s", median * w}});
    }
  }
  std::printf("RESULT %s\n", nlohmann::json{{"bench", "rounds"}, {"rows", rows}}.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
