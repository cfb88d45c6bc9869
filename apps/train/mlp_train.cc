#include "mlp_train.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>

#include "evaluator.h"
#include "worker_io.h"

namespace dsync::train {

using SteadyClock = std::chrono::steady_clock;

std::vector<uint32_t> LayerSizes(const Dataset& data, const std::vector<uint32_t>& hidden) {
  std::vector<uint32_t> sizes = {data.features()};
  sizes.insert(sizes.end(), hidden.begin(), hidden.end());
  sizes.push_back(10);
  return sizes;
}

Result<MlpTrainReport> TrainMlp(Worker& worker, const Dataset& train, const Dataset& test,
                                const MlpTrainOptions& o,
                                const std::function<void(const Progress&)>& progress) {
  if (o.batch == 0 || o.shards == 0 || o.shard >= o.shards) {
    return Error(StatusCode::kInvalidArgument, "batch {} / shard {} of {} is not a valid setup",
                 o.batch, o.shard, o.shards);
  }
  // Before registering anything: a missing GPU fails here, not halfway into the job.
  DSYNC_ASSIGN_OR_RETURN(const MlpMathKind math, ResolveMlpMath(o.math));
  const std::vector<uint32_t> sizes = LayerSizes(train, o.hidden);
  Mlp model(sizes, o.batch);  // the model's tensors and initial values; the CPU math
  std::unique_ptr<MlpMath> device;
  if (math == MlpMathKind::kCuda) {
    DSYNC_ASSIGN_OR_RETURN(device, MakeCudaMlp(sizes, o.batch));
  }
  MlpMath& compute = device ? *device : static_cast<MlpMath&>(model);
  std::vector<std::vector<float>> params = model.Initialize(o.seed);
  std::vector<std::vector<float>> grads;
  std::vector<TensorId> ids;
  for (size_t i = 0; i < model.params().size(); ++i) {
    DSYNC_ASSIGN_OR_RETURN(TensorId id, worker.Register(model.params()[i].name, params[i]));
    ids.push_back(id);
    grads.emplace_back(params[i].size());
  }
  std::vector<const float*> pptr, gconst;
  std::vector<float*> pmut, gptr;
  for (size_t i = 0; i < params.size(); ++i) {
    pptr.push_back(params[i].data());
    pmut.push_back(params[i].data());
    gptr.push_back(grads[i].data());
    gconst.push_back(grads[i].data());
  }
  // Pulled into and pushed from every iteration: registered once (RDMA; nothing over TCP),
  // and unregistered before the vectors are freed, on every way out.
  struct Registered {
    Worker& w;
    std::vector<std::span<const float>> bufs;
    ~Registered() {
      for (auto b : bufs) w.UnregisterBuffer(b.data(), b.size_bytes());
    }
  } registered{worker, {}};
  for (size_t i = 0; i < params.size(); ++i) {
    for (const std::vector<float>* v : {&params[i], &grads[i]}) {
      if (worker.RegisterBuffer(v->data(), v->size() * sizeof(float)).ok()) {
        registered.bufs.emplace_back(v->data(), v->size());
      }
    }
  }

  // This worker's shard, visited in a shuffled order that changes every epoch.
  std::vector<uint32_t> shard;
  for (uint32_t i = o.shard; i < train.count; i += o.shards) shard.push_back(i);
  std::mt19937 rng(o.seed * 1000003u + o.shard);
  std::shuffle(shard.begin(), shard.end(), rng);
  size_t cursor = 0;
  std::vector<uint32_t> batch_idx(o.batch);
  std::vector<float> x(size_t{o.batch} * train.features());
  std::vector<uint8_t> labels(o.batch);

  const auto start = SteadyClock::now();
  SnapshotEvaluator evaluator(test, sizes, o.eval_samples,
                              SnapshotEvaluator::Policy::kSkipWhenBusy);
  std::vector<std::span<const float>> views(params.begin(), params.end());
  MlpTrainReport report;
  report.math = math;
  for (uint32_t it = 0; o.iterations == 0 || it < o.iterations; ++it) {
    if (worker.stop_requested()) break;
    Version version = 0;
    DSYNC_RETURN_IF_ERROR(PullAll(worker, ids, pmut, &version));
    if (o.keep_going && !o.keep_going(it, version)) break;
    if (o.eval_every && it % o.eval_every == 0) {
      evaluator.Offer(views, it, version,
                      std::chrono::duration<double>(SteadyClock::now() - start).count());
    }
    for (uint32_t r = 0; r < o.batch; ++r) {
      if (cursor == shard.size()) {
        std::shuffle(shard.begin(), shard.end(), rng);
        cursor = 0;
      }
      batch_idx[r] = shard[cursor++];
    }
    const auto compute_start = SteadyClock::now();
    Mlp::Gather(train, batch_idx.data(), o.batch, x.data(), labels.data());
    const float loss = compute.Gradient(pptr, x.data(), labels.data(), o.batch, gptr);
    DSYNC_RETURN_IF_ERROR(compute.status());  // a failed device's NaNs are never pushed
    const double compute_ms =
        std::chrono::duration<double, std::milli>(SteadyClock::now() - compute_start).count();
    SimulateCompute(o.compute_ms * o.slow + (o.slow - 1) * compute_ms);
    DSYNC_RETURN_IF_ERROR(PushAll(worker, ids, gconst));
    report.iterations = it + 1;
    std::vector<EvalPoint> fresh = evaluator.Take();
    report.evals.insert(report.evals.end(), fresh.begin(), fresh.end());
    if (progress) {
      progress({it + 1, version, loss, compute_ms / 1000,
                fresh.empty() ? nullptr : &report.evals.back(), compute.last_gradient_norm()});
    }
  }
  // The final model, evaluated in full.
  if (o.final_eval) {
    DSYNC_RETURN_IF_ERROR(PullAll(worker, ids, pmut, &report.final_version));
    report.final_eval = compute.Evaluate(pptr, test);
    DSYNC_RETURN_IF_ERROR(compute.status());
  }
  report.seconds = std::chrono::duration<double>(SteadyClock::now() - start).count();
  return report;
}

}  // namespace dsync::train
