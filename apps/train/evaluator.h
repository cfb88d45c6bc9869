// Test-set evaluation of model snapshots on a thread of its own, so that measuring accuracy
// never stalls training. Two policies: a worker that watches its own progress skips a
// snapshot offered while the previous one is still being evaluated; a monitor that records
// an accuracy curve queues every snapshot (its timestamp and version are taken when it is
// offered, so a slow evaluation never shifts the curve) and can lower the thread's priority
// so that evaluating competes as little as possible with the training it measures.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "dsync/types.h"
#include "fashion_mnist.h"
#include "mlp.h"

namespace dsync::train {

struct EvalPoint {
  uint32_t iteration = 0;  // the caller's counter (iteration, round, ...)
  Version version = 0;
  double seconds = 0;      // when the snapshot was taken, from the caller's start
  Evaluation eval;
};

class SnapshotEvaluator {
 public:
  // kQueueAll evaluates the newest snapshot first (a live display stays current under load);
  // Take() may then return points out of order.
  enum class Policy { kSkipWhenBusy, kQueueAll };

  // kQueueAll keeps at most `max_backlog` snapshots waiting (0: no limit): on a machine too
  // busy to keep up, the curve gets coarser instead of the evaluation falling behind.
  SnapshotEvaluator(const Dataset& test, std::vector<uint32_t> sizes, uint32_t samples,
                    Policy policy, bool low_priority = false, size_t max_backlog = 0);
  ~SnapshotEvaluator();
  SnapshotEvaluator(const SnapshotEvaluator&) = delete;
  SnapshotEvaluator& operator=(const SnapshotEvaluator&) = delete;

  // Copies the parameters (one span per tensor). Returns false if it was skipped; `force`
  // queues it regardless of the policy (a final model).
  bool Offer(std::span<const std::span<const float>> params, uint32_t iteration, Version v,
             double seconds, bool force = false);
  // Evaluations finished since the last call.
  std::vector<EvalPoint> Take();
  // Waits until every queued snapshot is evaluated.
  void Drain();

 private:
  struct Snapshot {
    EvalPoint point;
    std::vector<std::vector<float>> params;
  };
  void Loop(bool low_priority);

  const Dataset& test_;
  Mlp model_;
  const uint32_t samples_;
  const Policy policy_;
  const size_t max_backlog_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool busy_ = false;
  std::deque<Snapshot> queue_;
  std::vector<Snapshot> spare_;  // evaluated snapshots, reused: no allocation per offer
  std::vector<EvalPoint> done_;
  std::thread thread_;
};

}  // namespace dsync::train
