// A worker program of your own, run by `dsyncps launch` (or `srun/mpirun dsyncps launch`, or
// `dsyncps join` for a worker that joins later):
//
//   dsyncps launch --workers 4 --servers 2 --sync dsync:2 -- ./linear_worker 200
//
// Arguments: iterations (default 100), and milliseconds of pretend compute per iteration
// (default 0; a bigger model).
// It reads everything it needs from the DSYNC_* variables the launcher sets (the scheduler's
// address, the token, DSYNC_WORKER_RANK), fits a linear model y = w.x to data of its own
// shard by minibatch SGD through the parameter server, and prints its loss. Only the public
// headers in include/dsync are used.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"

namespace {

constexpr int kDim = 64;
constexpr int kBatch = 32;

// The same true weights on every worker; each worker's own samples (its rank seeds them).
struct Shard {
  std::vector<float> x, y;  // samples x kDim, samples
  explicit Shard(unsigned rank, int samples = 2048) : x(size_t(samples) * kDim), y(samples) {
    std::mt19937 truth(42), rng(1000 + rank);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> w(kDim);
    for (float& v : w) v = n(truth);
    for (int s = 0; s < samples; ++s) {
      float dot = 0.0f;
      for (int d = 0; d < kDim; ++d) dot += (x[size_t(s) * kDim + d] = n(rng)) * w[d];
      y[s] = dot;
    }
  }
  int samples() const { return static_cast<int>(y.size()); }
  // Mean squared error over the rows given (all if empty), and its gradient into `grad`.
  float Step(const std::vector<float>& w, const std::vector<int>& rows, std::vector<float>* grad) const {
    if (grad) grad->assign(kDim, 0.0f);
    const float n = static_cast<float>(rows.size());
    double loss = 0.0;
    for (int r : rows) {
      float err = -y[r];
      for (int d = 0; d < kDim; ++d) err += x[size_t(r) * kDim + d] * w[d];
      loss += double(err) * err;
      if (grad) {
        for (int d = 0; d < kDim; ++d) (*grad)[d] += 2.0f * err * x[size_t(r) * kDim + d] / n;
      }
    }
    return static_cast<float>(loss / static_cast<double>(n));
  }
};

int Fail(const char* what, const dsync::Status& s) {
  std::fprintf(stderr, "linear_worker: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 100;
  const int compute_ms = argc > 2 ? std::atoi(argv[2]) : 0;
  const char* rank_text = std::getenv("DSYNC_WORKER_RANK");
  const unsigned rank = rank_text ? static_cast<unsigned>(std::atoi(rank_text)) : 0;

  auto config = dsync::Config::FromProcessEnvironment();
  if (!config.ok()) return Fail("configuration", config.status());
  auto started = dsync::Worker::Start(*config);  // joins the job; blocks until admitted
  if (!started.ok()) return Fail("joining the job", started.status());
  dsync::Worker& worker = **started;

  const Shard shard(rank);
  std::vector<float> w(kDim, 0.0f), grad(kDim);
  auto tensor = worker.Register("linear.weight", w);  // the first registration is the model
  if (!tensor.ok()) return Fail("registering", tensor.status());
  std::vector<int> all(shard.samples()), batch(kBatch);
  for (int i = 0; i < shard.samples(); ++i) all[i] = i;
  const float initial = shard.Step(w, all, nullptr);

  std::mt19937 rng(rank);
  std::uniform_int_distribution<int> pick(0, shard.samples() - 1);
  dsync::Version version = 0;
  for (int it = 0; it < iters && !worker.stop_requested(); ++it) {
    if (auto s = worker.Wait(worker.Pull(*tensor, w.data()), &version); !s.ok()) {
      return Fail("pulling", s);
    }
    for (int& r : batch) r = pick(rng);
    shard.Step(w, batch, &grad);
    std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
    // One tensor: the push commits this iteration's gradient.
    if (auto s = worker.Wait(worker.Push(*tensor, grad.data())); !s.ok()) return Fail("pushing", s);
  }
  if (auto s = worker.Wait(worker.Pull(*tensor, w.data()), &version); !s.ok()) {
    return Fail("pulling", s);
  }
  const float final_loss = shard.Step(w, all, nullptr);
  std::printf("linear_worker rank %u (worker %u): loss %.6g -> %.6g after %d iterations, model "
              "version %llu\n",
              rank, worker.job().worker_id, initial, final_loss, iters,
              static_cast<unsigned long long>(version));
  std::fflush(stdout);
  if (auto s = worker.Leave(); !s.ok()) return Fail("leaving", s);
  return std::isfinite(final_loss) ? 0 : 1;
}
