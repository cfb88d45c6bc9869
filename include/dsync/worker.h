// The worker side of the parameter server: register tensors, push gradients, pull the model.
//
// One iteration of a worker is one *clock*: it pulls the model (version v), computes a
// gradient on it, pushes that gradient tensor by tensor. When every registered tensor has
// been pushed the clock is committed to the scheduler automatically (or earlier, by
// Advance(), for an iteration that pushes only some tensors) and the clock advances. The
// base version of the gradient is the lowest version among the slices last pulled.
//
// A push is *complete* when every slice was received by its server and the scheduler
// acknowledged the commit; from then on the gradient is applied exactly once, even if this
// process dies. Pulls wait only as long as the delay bound requires.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync {

using Handle = uint64_t;

// Job-wide settings a worker received from the scheduler when it joined.
struct JobInfo {
  WorkerId worker_id = 0;
  SyncMode sync;
  OptimizerConfig optimizer;
  StalenessPolicy staleness;  // how the servers weigh this job's stale gradients
  uint64_t slice_bytes = 0;
  uint32_t num_servers = 0;
  Round join_round = 0;    // first round this worker counts toward quorum in
  Clock start_clock = 0;   // clock of this worker's first gradient
  bool observer = false;   // joined read-only (Config::observer): pulls only
};

// How the servers treat one tensor (Worker::Register).
struct TensorOptions {
  // A constructor, not an aggregate: TensorOptions{adam} stays free of missing-initializer
  // warnings as fields are added.
  TensorOptions(std::optional<OptimizerConfig> optimizer_ = std::nullopt,  // NOLINT: implicit
                std::vector<uint64_t> shape_ = {})
      : optimizer(std::move(optimizer_)), shape(std::move(shape_)) {}
  // The optimizer the servers run for this tensor; empty: the job's (JobInfo::optimizer).
  // The first registration of a tensor sets it; a later one with another kind or other
  // hyperparameters (the learning rate aside) is refused.
  std::optional<OptimizerConfig> optimizer;
  // The tensor's shape as the framework sees it (at most kMaxTensorDims dimensions whose
  // product is its element count); empty: none. The servers keep the first registration's and
  // refuse a later one with another shape, naming both (a model built differently).
  std::vector<uint64_t> shape;
  static constexpr size_t kMaxTensorDims = 16;
};

class Worker {
 public:
  // Connects to the scheduler and every server and joins the job. Blocks until admitted
  // (the scheduler admits workers once all servers are up). With Config::observer it joins
  // read-only: Register and Pull work (pulls return the newest model at once), Push fails.
  static Result<std::unique_ptr<Worker>> Start(const Config& config);
  virtual ~Worker() = default;

  virtual const JobInfo& job() const = 0;

  // Registers a dense float32 tensor of init.size() elements. Every worker registers the
  // same tensors in the same order; the first registration's values (and optimizer) become
  // the model's.
  virtual Result<TensorId> Register(std::string_view name, std::span<const float> init,
                                    const TensorOptions& options) = 0;
  // The job's optimizer for this tensor.
  Result<TensorId> Register(std::string_view name, std::span<const float> init) {
    return Register(name, init, TensorOptions{});
  }

  // Asynchronous operations; buffers must stay valid until Wait() returns. Errors (unknown
  // tensor, a server's refusal, a lost peer) are reported by Wait().
  virtual Handle Push(TensorId tensor, const float* grad) = 0;
  virtual Handle Pull(TensorId tensor, float* out) = 0;
  // Push, then pull the model of the next clock once this clock is committed.
  virtual Handle PushPull(TensorId tensor, const float* grad, float* out) = 0;
  // Commits the current clock with whatever was pushed (auto when all tensors are pushed).
  virtual Handle Advance() = 0;

  // For a pull, *version receives the lowest version among the slices it read.
  virtual Status Wait(Handle handle, Version* version = nullptr) = 0;
  virtual Status WaitAll() = 0;

  // The scheduler said the job's gradient budget is spent (Config::max_gradients): finish
  // the iteration in hand and Leave(). Seen with the acknowledgement of a push.
  virtual bool stop_requested() const = 0;

  // Observers: training is over and the model's final version is this; the job waits
  // (up to 30 s) for its observers to pull it and Leave() before the servers stop.
  virtual std::optional<Version> final_version() const = 0;

  virtual Clock clock() const = 0;            // clock of the gradient being computed now
  virtual Version base_version() const = 0;   // lowest version among the latest pulls

  // Sets the learning rate of every tensor's optimizer (replacing each tensor's own) from a
  // round the scheduler picks: the first round no server has been told of yet, the same on
  // every server. Returns that round: version r + 1 is the first model the new rate shaped.
  // lr must be finite and >= 0; observers may not set it.
  virtual Result<Round> SetLearningRate(float lr) = 0;

  // Leaves the job gracefully: waits for outstanding work, then tells the scheduler.
  virtual Status Leave() = 0;
  // Drops every connection without telling anyone, as a crash would (for tests).
  virtual void Abandon() = 0;

  // Optional, for speed over RDMA: memory this worker pushes from or pulls into every
  // iteration (its parameter and gradient buffers). The RDMA transport then registers it
  // with the device once instead of for every operation. Call UnregisterBuffer before the
  // memory is freed. Over TCP both do nothing.
  virtual Status RegisterBuffer(const void* ptr, size_t bytes) = 0;
  virtual void UnregisterBuffer(const void* ptr, size_t bytes) = 0;
};

}  // namespace dsync
