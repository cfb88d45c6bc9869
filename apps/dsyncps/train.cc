// The worker role of the dsyncps program: trains a small built-in model through the PS.
//   linreg: least squares on a synthetic data set, every worker sampling its own
//           minibatches; prints progress and the final loss on the whole data set.
//   count:  pushes all-ones gradients (run it with --optimizer sum): the model then holds
//           the number of gradients applied, which tests compare with what workers report.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include <cblas.h>

#include "dsync/worker.h"
#include "mlp_train.h"
#include "worker_io.h"
#include "roles.h"

namespace dsync::app {
namespace {

int Fail(const Status& status) {
  std::fprintf(stderr, "dsyncps: error: %s\n", status.ToString().c_str());
  return 1;
}

// Failure injection for tests: stdout is flushed first so what was reported survives.
[[noreturn]] void KillSelf(const char* why, uint32_t completed) {
  std::printf("injected failure: %s (completed %u)\n", why, completed);
  std::fflush(stdout);
  raise(SIGKILL);
  _exit(137);
}

class LinearProblem {
 public:
  LinearProblem(uint32_t dim, uint32_t samples, uint32_t seed)
      : dim_(dim), x_(size_t{dim} * samples), y_(samples) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> truth(dim);
    for (float& v : truth) v = n(rng) / std::sqrt(static_cast<float>(dim));
    for (uint32_t i = 0; i < samples; ++i) {
      float dot = 0.3f;
      for (uint32_t j = 0; j < dim; ++j) {
        x_[size_t{i} * dim + j] = n(rng);
        dot += x_[size_t{i} * dim + j] * truth[j];
      }
      y_[i] = dot + 0.05f * n(rng);
    }
  }

  // Mean of 0.5 (x.w + b - y)^2 over `rows`; gradients into gw, gb. Returns the loss.
  float Gradient(const std::vector<float>& w, float b, const std::vector<uint32_t>& rows,
                 std::vector<float>& gw, float& gb) const {
    std::fill(gw.begin(), gw.end(), 0.0f);
    gb = 0.0f;
    double loss = 0;
    for (uint32_t i : rows) {
      const float* x = &x_[size_t{i} * dim_];
      float err = b - y_[i];
      for (uint32_t j = 0; j < dim_; ++j) err += x[j] * w[j];
      for (uint32_t j = 0; j < dim_; ++j) gw[j] += err * x[j];
      gb += err;
      loss += 0.5 * err * err;
    }
    const float inv = 1.0f / static_cast<float>(rows.size());
    for (float& g : gw) g *= inv;
    gb *= inv;
    return static_cast<float>(loss / static_cast<double>(rows.size()));
  }

  float Loss(const std::vector<float>& w, float b) const {
    double loss = 0;
    for (uint32_t i = 0; i < y_.size(); ++i) {
      const float* x = &x_[size_t{i} * dim_];
      float err = b - y_[i];
      for (uint32_t j = 0; j < dim_; ++j) err += x[j] * w[j];
      loss += 0.5 * err * err;
    }
    return static_cast<float>(loss / static_cast<double>(y_.size()));
  }

  uint32_t samples() const { return static_cast<uint32_t>(y_.size()); }

 private:
  uint32_t dim_;
  std::vector<float> x_, y_;
};

int TrainLinear(Worker& w, const TrainOptions& t) {
  const WorkerId me = w.job().worker_id;
  const LinearProblem problem(t.dim, t.samples, t.seed);
  std::vector<float> params(t.dim, 0.0f), grad(t.dim);
  float bias = 0.0f, gbias = 0.0f;
  auto tw = w.Register("linear.weight", params);
  if (!tw.ok()) return Fail(tw.status());
  auto tb = w.Register("linear.bias", {&bias, 1});
  if (!tb.ok()) return Fail(tb.status());
  const TensorId linear_ids[] = {*tw, *tb};
  float* const linear_out[] = {params.data(), &bias};
  const float* const linear_grads[] = {grad.data(), &gbias};
  std::mt19937 rng(t.seed * 7919u + me);
  std::uniform_int_distribution<uint32_t> pick(0, problem.samples() - 1);
  std::vector<uint32_t> rows(t.batch);
  const auto start = std::chrono::steady_clock::now();
  Version version = 0;
  uint32_t completed = 0;
  for (uint32_t it = 0; it < t.iters; ++it) {
    if (Status s = train::PullAll(w, linear_ids, linear_out, &version); !s.ok()) {
      return Fail(s);
    }
    if (static_cast<int64_t>(it) == t.hang_at_iter) {
      std::printf("worker %u: injected hang at iteration %u\n", me, it);
      std::fflush(stdout);
      raise(SIGSTOP);
    }
    for (uint32_t& r : rows) r = pick(rng);
    const float loss = problem.Gradient(params, bias, rows, grad, gbias);
    train::SimulateCompute(t.compute_ms * t.slow);
    if (static_cast<int64_t>(it) == t.kill_at_iter && t.kill_point == "mid-push") {
      w.Push(*tw, grad.data());
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      KillSelf("killed between two tensors of a push", completed);
    }
    if (Status s = train::PushAll(w, linear_ids, linear_grads); !s.ok()) return Fail(s);
    ++completed;
    if (static_cast<int64_t>(it) == t.kill_at_iter) KillSelf("killed after a push", completed);
    if (t.log_every && (it % t.log_every == 0 || it + 1 == t.iters)) {
      std::printf("worker %u: iter %u/%u version %llu minibatch loss %.6f\n", me, it + 1,
                  t.iters, static_cast<unsigned long long>(version), static_cast<double>(loss));
      std::fflush(stdout);
    }
  }
  if (Status s = train::PullAll(w, linear_ids, linear_out, &version); !s.ok()) {
    return Fail(s);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("worker %u: final loss %.6f at version %llu after %u iterations (%.2f s, "
              "initial loss %.6f)\n",
              me, static_cast<double>(problem.Loss(params, bias)),
              static_cast<unsigned long long>(version), completed, secs,
              static_cast<double>(problem.Loss(std::vector<float>(t.dim, 0.0f), 0.0f)));
  std::fflush(stdout);
  return 0;
}

int TrainCount(Worker& w, const TrainOptions& t) {
  const WorkerId me = w.job().worker_id;
  std::vector<float> a(t.tensor_elems, 0.0f), b(3, 0.0f);
  const std::vector<float> ones_a(t.tensor_elems, 1.0f), ones_b(3, 1.0f);
  auto ta = w.Register("count.a", a);
  if (!ta.ok()) return Fail(ta.status());
  auto tb = w.Register("count.b", b);
  if (!tb.ok()) return Fail(tb.status());
  const TensorId count_ids[] = {*ta, *tb};
  float* const count_out[] = {a.data(), b.data()};
  const float* const count_grads[] = {ones_a.data(), ones_b.data()};
  uint32_t completed = 0;
  Version version = 0;
  for (uint32_t it = 0; it < t.iters; ++it) {
    if (Status s = train::PullAll(w, count_ids, count_out, &version); !s.ok()) {
      return Fail(s);
    }
    if (static_cast<int64_t>(it) == t.hang_at_iter) {
      std::printf("worker %u: injected hang at iteration %u (completed %u)\n", me, it, completed);
      std::fflush(stdout);
      raise(SIGSTOP);
    }
    train::SimulateCompute(t.compute_ms * t.slow);
    if (static_cast<int64_t>(it) == t.kill_at_iter && t.kill_point == "mid-push") {
      w.Push(*ta, ones_a.data());
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      KillSelf("killed between two tensors of a push", completed);
    }
    if (Status s = train::PushAll(w, count_ids, count_grads); !s.ok()) {
      return Fail(s);
    }
    ++completed;
    if (static_cast<int64_t>(it) == t.kill_at_iter) KillSelf("killed after a push", completed);
  }
  std::printf("worker %u: completed %u (model count %.0f at version %llu)\n", me, completed,
              static_cast<double>(a[0]), static_cast<unsigned long long>(version));
  std::fflush(stdout);
  return 0;
}

struct MlpData {
  train::Dataset train, test;
};

Result<MlpData> LoadMlpData(const std::string& dir) {
  MlpData d;
  DSYNC_ASSIGN_OR_RETURN(d.train, train::LoadFashionMnist(dir, "train"));
  DSYNC_ASSIGN_OR_RETURN(d.test, train::LoadFashionMnist(dir, "t10k"));
  return d;
}

int TrainFashionMnist(Worker& w, const TrainOptions& t, uint32_t initial_workers,
                      const MlpData& data) {
  const WorkerId me = w.job().worker_id;
  train::MlpTrainOptions o;
  o.iterations = t.iters;
  o.batch = t.batch;
  o.seed = t.seed;
  o.shards = t.shards ? t.shards : std::max<uint32_t>(1, initial_workers);
  o.shard = (me - kFirstWorkerId) % o.shards;
  o.eval_every = o.shard == 0 ? t.eval_every : 0;  // one worker watches the test accuracy
  o.eval_samples = t.eval_samples;
  o.compute_ms = t.compute_ms;
  o.slow = t.slow;
  o.final_eval = t.eval_every > 0;  // a launcher's observer evaluates instead
  auto math = train::ParseMlpMath(t.worker_math);
  if (!math.ok()) return Fail(math.status());
  auto resolved = train::ResolveMlpMath(*math);  // auto: what this machine has
  if (!resolved.ok()) return Fail(resolved.status());
  o.math = *resolved;
  if (o.math == train::MlpMathKind::kCuda) {
    std::printf("worker %u: gradients on the GPU (cuBLAS)\n", me);
  }
  o.keep_going = [&](uint32_t iteration, Version v) {
    if (t.kill_at_round >= 0 && v >= static_cast<uint64_t>(t.kill_at_round)) {
      KillSelf(fmt::format("killed at round {}", v).c_str(), iteration);
    }
    if (t.leave_at_round >= 0 && v >= static_cast<uint64_t>(t.leave_at_round)) {
      std::printf("worker %u: leaving at round %llu\n", me, static_cast<unsigned long long>(v));
      return false;
    }
    return true;
  };
  double loss_sum = 0, compute_sum = 0, norm_sum = 0;
  uint32_t since_report = 0;
  // The means of the iterations since the last @progress line.
  auto emit_progress = [&](uint32_t iteration, Version version) {
    std::printf("@progress {\"it\":%u,\"v\":%llu,\"loss\":%.5f,\"compute_ms\":%.3f,"
                "\"gnorm\":%.5g}\n",
                iteration, static_cast<unsigned long long>(version), loss_sum / since_report,
                1000 * compute_sum / since_report, norm_sum / since_report);
    loss_sum = compute_sum = norm_sum = 0;
    since_report = 0;
  };
  uint32_t last_iteration = 0;
  Version last_version = 0;
  auto report = train::TrainMlp(w, data.train, data.test, o, [&](const train::Progress& p) {
    last_iteration = p.iteration;
    last_version = p.version;
    if (t.report_every) {
      loss_sum += p.loss;
      compute_sum += p.compute_seconds;
      norm_sum += p.grad_norm;
      if (++since_report == t.report_every) emit_progress(p.iteration, p.version);
    }
    if (p.eval) {
      std::printf("worker %u: iter %u version %llu test accuracy %.4f (loss %.4f, %u samples, "
                  "%.1f s)\n",
                  me, p.eval->iteration, static_cast<unsigned long long>(p.eval->version),
                  p.eval->eval.accuracy, p.eval->eval.loss, p.eval->eval.samples,
                  p.eval->seconds);
    }
    if (t.log_every && (p.iteration % t.log_every == 0 || p.iteration == t.iters)) {
      std::printf("worker %u: iter %u/%u version %llu minibatch loss %.4f\n", me, p.iteration,
                  t.iters, static_cast<unsigned long long>(p.version),
                  static_cast<double>(p.loss));
    }
    std::fflush(stdout);
  });
  // The iterations since the last line count too: the launcher sums the workers' counts
  // into the job's (a worker that stops at the budget or leaves would otherwise go
  // uncounted for up to report_every - 1 of them).
  if (t.report_every && since_report > 0) emit_progress(last_iteration, last_version);
  if (!report.ok()) return Fail(report.status());
  if (o.final_eval) {
    std::printf("worker %u: final test accuracy %.4f, loss %.4f at version %llu after %u "
                "iterations (%.1f s, shard %u of %u)\n",
                me, report->final_eval.accuracy, report->final_eval.loss,
                static_cast<unsigned long long>(report->final_version), report->iterations,
                report->seconds, o.shard, o.shards);
  } else {
    std::printf("worker %u: completed %u iterations (%.1f s, shard %u of %u)\n", me,
                report->iterations, report->seconds, o.shard, o.shards);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

Status CheckComputeMs(const char* flag, double ms) {
  if (std::isfinite(ms) && ms >= 0 && ms <= kMaxComputeMs) return Status::Ok();
  return Error(StatusCode::kInvalidArgument,
               "{} {} is not a compute time in milliseconds from 0 to {}", flag, ms,
               kMaxComputeMs);
}

namespace {

Status AtLeastOne(const char* flag, uint32_t v, std::string_view why) {
  if (v >= 1) return Status::Ok();
  return Error(StatusCode::kInvalidArgument, "{} must be at least 1{}", flag, why);
}

}  // namespace

Status CheckTrainOptions(const TrainOptions& t) {
  if (t.model != "linreg" && t.model != "count" && t.model != "mlp") {
    return Error(StatusCode::kInvalidArgument, "model '{}' is not one of mlp, linreg, count",
                 t.model);
  }
  if (t.model != "mlp") {
    DSYNC_RETURN_IF_ERROR(AtLeastOne(
        "--iters", t.iters, " (only --model mlp takes 0: train until the job's gradient budget)"));
  }
  DSYNC_RETURN_IF_ERROR(AtLeastOne("--batch", t.batch, " (samples per minibatch)"));
  DSYNC_RETURN_IF_ERROR(AtLeastOne("--dim", t.dim, " (linreg features)"));
  DSYNC_RETURN_IF_ERROR(AtLeastOne("--samples", t.samples, " (linreg data set size)"));
  DSYNC_RETURN_IF_ERROR(AtLeastOne("--tensor-elems", t.tensor_elems, " (count model)"));
  DSYNC_RETURN_IF_ERROR(CheckComputeMs("--compute-ms", t.compute_ms));
  if (!(std::isfinite(t.slow) && t.slow > 0 && t.slow <= kMaxSlowdown)) {
    return Error(StatusCode::kInvalidArgument,
                 "--slow {} is not a factor on the compute time in (0, {}] (3: three times "
                 "slower)",
                 t.slow, kMaxSlowdown);
  }
  if (t.kill_point != "after-push" && t.kill_point != "mid-push") {
    return Error(StatusCode::kInvalidArgument, "--kill-point '{}' is not after-push or mid-push",
                 t.kill_point);
  }
  return CheckWorkerMath(t);
}

Status CheckWorkerMath(const TrainOptions& t) {
  DSYNC_ASSIGN_OR_RETURN(const train::MlpMathKind math, train::ParseMlpMath(t.worker_math));
  if (t.model == "mlp") DSYNC_RETURN_IF_ERROR(train::ResolveMlpMath(math).status());
  return Status::Ok();
}

int RunWorker(const Config& config, const TrainOptions& t) {
  // Several workers share this machine's cores: one BLAS thread each.
  openblas_set_num_threads(1);
  // The data before joining: a worker without it must not take a place in the job.
  MlpData data;
  if (t.model == "mlp") {
    auto loaded = LoadMlpData(t.data_dir);
    if (!loaded.ok()) return Fail(loaded.status());
    data = std::move(*loaded);
  }
  auto worker = Worker::Start(config);
  if (!worker.ok()) return Fail(worker.status());
  Worker& w = **worker;  // Start told the launcher, if any, that it joined
  const int rc = t.model == "mlp"      ? TrainFashionMnist(w, t, config.num_workers, data)
                 : t.model == "linreg" ? TrainLinear(w, t)
                                       : TrainCount(w, t);
  if (rc != 0) return rc;
  if (Status s = w.Leave(); !s.ok()) return Fail(s);
  return 0;
}

}  // namespace dsync::app
