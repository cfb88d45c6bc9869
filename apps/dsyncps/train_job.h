// `dsyncps train` and `dsyncps compare`: the main job. A local cluster (scheduler, servers,
// workers as processes) trains the Fashion-MNIST MLP under a sync mode and a scenario
// (stragglers, joins, leaves, kills, link latency), while this process watches as an
// observer: it pulls model snapshots without ever holding a round, evaluates them on the
// test set at low priority, and draws live progress.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "run_metrics.h"

namespace dsync::app {

struct Scenario {
  std::map<uint32_t, double> slow;          // worker -> factor on its own compute time
  std::map<uint32_t, uint64_t> join_round;  // worker starts once the model reaches a round
  std::map<uint32_t, uint64_t> leave_round; // worker leaves gracefully at a round
  std::map<uint32_t, uint64_t> kill_round;  // worker is SIGKILLed at a round
  std::map<uint32_t, double> latency_ms;    // added latency on the worker's link
  std::string Describe() const;             // "worker 3 3x slower; ..." or "balanced"
};

struct TrainSpec {
  Config job;                 // sync, optimizer and the rest of the job's configuration
  uint32_t servers = 2;
  uint32_t workers = 4;
  uint32_t batch = 64;
  double epochs = 10;         // budget: epochs x 60000 / batch gradients, over all workers
  uint32_t seed = 1;
  std::string data_dir;
  double compute_ms = 0;      // extra simulated compute per iteration, every worker
  double eval_interval_s = 0.5;
  double target = 0.85;
  uint32_t timeout_s = 1200;
  Scenario scenario;
  std::string out_dir;        // metrics.csv and summary.json here ("" : none)
  std::string label;          // shown in progress lines (compare: the mode)
  bool verbose = false;       // relay every line of every process
  std::string worker_math = "cpu";  // workers' gradients: cpu | cuda | auto
};

// Parses the repeated "I=VALUE" scenario flags into `s` (workers < `workers`).
Status ParseScenario(const std::vector<std::string>& straggler, const std::vector<std::string>& join,
                     const std::vector<std::string>& leave, const std::vector<std::string>& kill,
                     const std::vector<std::string>& latency, uint32_t workers, Scenario* s);

// mkdir -p, with an error a user can act on.
Status MakeDirectories(const std::string& dir);

// Runs one job; returns its metrics (ok = false if the job failed; an error if it could not
// run at all, e.g. the dataset is missing).
Result<train::RunMetrics> RunTrainJob(const std::string& self, const TrainSpec& spec);

void PrintRunSummary(const train::RunMetrics& m);

}  // namespace dsync::app

namespace dsync::app {

// `dsyncps train`: one job, its summary; exit code.
int RunTrainCommand(const std::string& self, const TrainSpec& spec);
// `dsyncps compare`: one job per sync mode in `modes` ("bsp,dsync:4,3,..."), then a table,
// compare.csv/compare.json and the plots in spec.out_dir; exit code.
// `dsyncps compare --runs A,B,...`: the table and plots of finished runs (folders with a
// summary.json, or the files), e.g. of examples/pytorch/fmnist_cnn.py --out; `target`
// overrides each run's own.
int RunCompareFiles(const std::vector<std::string>& paths, const std::string& out_dir,
                    const std::string& title, std::optional<double> target);
// Prints the table and writes compare.csv, compare.json and the plots into `dir`.
int ReportComparison(const std::vector<train::RunMetrics>& runs, const std::string& dir,
                     const std::string& title);
int RunCompareCommand(const std::string& self, TrainSpec spec, const std::string& modes,
                      const std::string& title);

}  // namespace dsync::app
