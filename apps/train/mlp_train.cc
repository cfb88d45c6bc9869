#include "mlp_train.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "worker_io.h"

namespace dsync::train {
namespace {

using SteadyClock = std::chrono::steady_clock;

std::vector<uint32_t> LayerSizes(const Dataset& data, const std::vector<uint32_t>& hidden) {
  std::vector<uint32_t> sizes = {data.features()};
  sizes.insert(sizes.end(), hidden.begin(), hidden.end());
  sizes.push_back(10);
  return sizes;
}

// Evaluates snapshots of the parameters on a thread of its own; a snapshot offered while
// the previous one is still being evaluated is skipped rather than waited for.
class BackgroundEvaluator {
 public:
  BackgroundEvaluator(const Dataset& test, std::vector<uint32_t> sizes, uint32_t samples,
                      const std::vector<ParamSpec>& specs, SteadyClock::time_point start)
      : test_(test), model_(std::move(sizes), 500), samples_(samples), start_(start) {
    for (const ParamSpec& s : specs) snapshot_.emplace_back(s.size);
    thread_ = std::thread([this] { Loop(); });
  }
  ~BackgroundEvaluator() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Offer(const std::vector<std::vector<float>>& params, uint32_t iteration, Version v) {
    std::lock_guard lock(mu_);
    if (busy_) return;
    for (size_t i = 0; i < params.size(); ++i) snapshot_[i] = params[i];
    pending_ = {iteration, v, std::chrono::duration<double>(SteadyClock::now() - start_).count(),
                {}};
    busy_ = true;
    cv_.notify_all();
  }

  // Evaluations finished since the last call.
  std::vector<EvalPoint> Take() {
    std::lock_guard lock(mu_);
    std::vector<EvalPoint> out;
    out.swap(done_);
    return out;
  }

 private:
  void Loop() {
    std::vector<const float*> ptrs;
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (stop_) return;
      EvalPoint p = pending_;
      ptrs.clear();
      for (const auto& s : snapshot_) ptrs.push_back(s.data());
      lock.unlock();
      p.eval = model_.Evaluate(ptrs, test_, samples_);
      lock.lock();
      done_.push_back(p);
      busy_ = false;
    }
  }

  const Dataset& test_;
  Mlp model_;
  uint32_t samples_;
  SteadyClock::time_point start_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false;
  bool stop_ = false;
  std::vector<std::vector<float>> snapshot_;
  EvalPoint pending_;
  std::vector<EvalPoint> done_;
  std::thread thread_;
};

}  // namespace

Result<MlpTrainReport> TrainMlp(Worker& worker, const Dataset& train, const Dataset& test,
                                const MlpTrainOptions& o,
                                const std::function<void(const Progress&)>& progress) {
  if (o.batch == 0 || o.shards == 0 || o.shard >= o.shards) {
    return Error(StatusCode::kInvalidArgument, "batch {} / shard {} of {} is not a valid setup",
                 o.batch, o.shard, o.shards);
  }
  const std::vector<uint32_t> sizes = LayerSizes(train, o.hidden);
  Mlp model(sizes, o.batch);
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
  BackgroundEvaluator evaluator(test, sizes, o.eval_samples, model.params(), start);
  MlpTrainReport report;
  for (uint32_t it = 0; it < o.iterations; ++it) {
    Version version = 0;
    DSYNC_RETURN_IF_ERROR(PullAll(worker, ids, pmut, &version));
    if (o.eval_every && it % o.eval_every == 0) evaluator.Offer(params, it, version);
    for (uint32_t r = 0; r < o.batch; ++r) {
      if (cursor == shard.size()) {
        std::shuffle(shard.begin(), shard.end(), rng);
        cursor = 0;
      }
      batch_idx[r] = shard[cursor++];
    }
    Mlp::Gather(train, batch_idx.data(), o.batch, x.data(), labels.data());
    const float loss = model.Gradient(pptr, x.data(), labels.data(), o.batch, gptr);
    SimulateCompute(o.compute_ms * o.slow);
    DSYNC_RETURN_IF_ERROR(PushAll(worker, ids, gconst));
    report.iterations = it + 1;
    std::vector<EvalPoint> fresh = evaluator.Take();
    report.evals.insert(report.evals.end(), fresh.begin(), fresh.end());
    if (progress) progress({it + 1, version, loss, fresh.empty() ? nullptr : &report.evals.back()});
  }
  // The final model, evaluated in full.
  DSYNC_RETURN_IF_ERROR(PullAll(worker, ids, pmut, &report.final_version));
  report.final_eval = model.Evaluate(pptr, test);
  report.seconds = std::chrono::duration<double>(SteadyClock::now() - start).count();
  return report;
}

}  // namespace dsync::train
