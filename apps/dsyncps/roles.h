// Entry points of the dsyncps program's subcommands.
#pragma once

#include <signal.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dsync/config.h"

namespace dsync::app {

// Turns SIGINT/SIGTERM into a call of a stop function on a thread of its own, so a node shuts
// down cleanly (and a launcher can stop its children) instead of dying mid-frame. The thread
// is joined when the watcher is destroyed: nothing it does (logging included) can overlap the
// process's exit; later stop signals are ignored. One watcher at a time, created and destroyed
// on the same thread, just before the process exits.
class StopSignalWatcher {
 public:
  // Blocks the signals in the calling thread, so threads it starts later (a node's transport)
  // never see them, and catches them for the watcher's thread.
  StopSignalWatcher();
  ~StopSignalWatcher();
  StopSignalWatcher(const StopSignalWatcher&) = delete;
  StopSignalWatcher& operator=(const StopSignalWatcher&) = delete;

  // From now on a signal calls `stop` (once); a signal that came before calls it now. `stop`
  // must stay callable until the watcher is destroyed.
  void Arm(std::function<void()> stop);

 private:
  void Loop();

  int pipe_[2] = {-1, -1};
  sigset_t old_mask_;
  std::mutex mu_;
  std::function<void()> stop_;
  int signal_ = 0;  // the first signal received, 0 if none
  std::thread thread_;
};

// Prints why the command cannot run; exit code 2 for a mistake in the command line, else 1.
int Refuse(const Status& status);

int RunScheduler(const Config& config);
int RunServer(const Config& config);

struct TrainOptions {
  std::string model = "linreg";  // mlp (Fashion-MNIST) | linreg | count
  uint32_t iters = 100;          // mlp: 0 trains until the job's gradient budget is spent
  uint32_t batch = 32;
  uint32_t dim = 256;
  uint32_t samples = 8192;
  uint32_t tensor_elems = 1 << 16;  // count model
  std::string data_dir = "/usr/share/datasets/fashion-mnist";  // mlp
  uint32_t eval_every = 50;         // mlp: test accuracy every N iterations (worker of shard 0)
  uint32_t eval_samples = 2000;     // mlp: test samples per periodic evaluation (0: all)
  uint32_t shards = 0;              // mlp: data shards (0: the job's initial worker count)
  uint32_t seed = 1;
  double compute_ms = 0;     // extra simulated compute time per iteration
  double slow = 1;           // straggler: compute time multiplied by this
  uint32_t log_every = 10;
  // Failure injection (tests, demos).
  int64_t kill_at_iter = -1;
  std::string kill_point = "after-push";  // after-push | mid-push
  int64_t hang_at_iter = -1;              // SIGSTOP itself: stops heartbeating
  // Scenarios by model version (mlp): leave gracefully / SIGKILL itself once it pulls a
  // model of at least this version.
  int64_t leave_at_round = -1;
  int64_t kill_at_round = -1;
  // mlp: every N iterations print a machine-readable progress line for a launcher:
  //   @progress {"it":N,"v":VERSION,"loss":MEAN,"compute_ms":MEAN,"gnorm":MEAN}
  // (gnorm: the L2 norm of the worker's gradients)
  uint32_t report_every = 0;
  std::string worker_math = "cpu";  // mlp: gradients on cpu | cuda | auto (cuda given a GPU)
};
// Simulated compute per iteration (--compute-ms) is at most this: beyond, a typo, not a model.
inline constexpr double kMaxComputeMs = 60000;
// --slow (and train's --straggler factor) is at most this: beyond, a typo, not a straggler.
inline constexpr double kMaxSlowdown = 1000;
// `flag`'s value is a simulated compute time in [0, kMaxComputeMs] milliseconds.
Status CheckComputeMs(const char* flag, double ms);
// Training options a worker cannot run with (an unknown model, no iterations, an empty
// minibatch, a compute time that is not a number ...), refused before anything starts.
Status CheckTrainOptions(const TrainOptions& train);
int RunWorker(const Config& config, const TrainOptions& train);
// mlp: whether --worker-math names a math this process can run (no GPU for cuda, a build
// without CUDA: an error saying so), checked before a job is joined or launched.
Status CheckWorkerMath(const TrainOptions& train);

struct LocalOptions {
  uint32_t servers = 2;
  uint32_t workers = 4;
  uint32_t timeout_s = 600;
  // "I=MS": worker I starts MS milliseconds after the others and joins the running job.
  std::vector<std::string> join;
  // "I=FLAGS": extra flags for worker I only, e.g. "3=--slow 3" or "2=--kill-at-iter 5".
  std::vector<std::string> worker_extra;
};
// Runs a whole cluster on this machine as separate processes of this program (`self`):
// the job configuration travels to them in DSYNC_* variables, the training flags in argv.
int RunLocal(const std::string& self, const LocalOptions& local, const Config& job,
             const TrainOptions& train);

}  // namespace dsync::app
