// Data-parallel training of the MLP through the parameter server: one worker's loop.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "dsync/worker.h"
#include "evaluator.h"
#include "fashion_mnist.h"
#include "mlp.h"
#include "mlp_math.h"

namespace dsync::train {

struct MlpTrainOptions {
  std::vector<uint32_t> hidden = {256, 128};
  uint32_t iterations = 300;  // 0: until the scheduler says the job's budget is spent
  uint32_t batch = 64;
  uint32_t seed = 1;          // model initialization: the same on every worker
  uint32_t shard = 0;         // this worker trains on samples i with i % shards == shard
  uint32_t shards = 1;
  uint32_t eval_every = 50;   // iterations between test evaluations (0: only at the end)
  uint32_t eval_samples = 0;  // test samples per evaluation (0: all 10000)
  double compute_ms = 0;      // extra simulated compute per iteration (scaled by slow)
  // A straggler: every iteration takes `slow` times its own compute time (the measured
  // gradient time plus compute_ms); the extra is slept, as a slower device would idle.
  double slow = 1;
  // Called after each pull with the iteration and the version pulled; false stops training
  // (a graceful leave at a given round, for instance).
  std::function<bool(uint32_t iteration, Version version)> keep_going;
  bool final_eval = true;  // pull the final model and evaluate it on the whole test set
  // Gradients (and the final evaluation) on the CPU, on a GPU (an error before training
  // starts when there is none), or on a GPU when one is visible.
  MlpMathKind math = MlpMathKind::kCpu;
};

struct Progress {
  uint32_t iteration = 0;
  Version version = 0;
  float loss = 0;          // minibatch loss
  double compute_seconds = 0;  // gradient computation of this iteration (without slow-down)
  const EvalPoint* eval;   // the newest evaluation finished since the last report, or null
  double grad_norm = 0;    // L2 norm of this iteration's gradient, every tensor together
};

struct MlpTrainReport {
  uint32_t iterations = 0;
  Version final_version = 0;
  Evaluation final_eval;
  std::vector<EvalPoint> evals;
  double seconds = 0;
  MlpMathKind math = MlpMathKind::kCpu;  // what computed the gradients (auto resolved)
};

// input, hidden..., 10 classes.
std::vector<uint32_t> LayerSizes(const Dataset& data, const std::vector<uint32_t>& hidden);

// Registers the model's tensors (initial values from the seed), then trains: pull, gradient
// on the next minibatch of this worker's shard, push. Test accuracy is measured on a
// snapshot of the parameters by a background thread, so evaluation does not stall
// training. `progress` (optional) is called after every iteration.
Result<MlpTrainReport> TrainMlp(Worker& worker, const Dataset& train, const Dataset& test,
                                const MlpTrainOptions& options,
                                const std::function<void(const Progress&)>& progress = {});

}  // namespace dsync::train
