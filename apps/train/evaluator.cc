#include "evaluator.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

namespace dsync::train {

SnapshotEvaluator::SnapshotEvaluator(const Dataset& test, std::vector<uint32_t> sizes,
                                     uint32_t samples, Policy policy, bool low_priority,
                                     size_t max_backlog)
    : test_(test), model_(std::move(sizes), 500), samples_(samples), policy_(policy),
      max_backlog_(max_backlog) {
  thread_ = std::thread([this, low_priority] { Loop(low_priority); });
}

SnapshotEvaluator::~SnapshotEvaluator() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool SnapshotEvaluator::Offer(std::span<const std::span<const float>> params, uint32_t iteration,
                              Version v, double seconds, bool force) {
  std::lock_guard lock(mu_);
  if (!force && policy_ == Policy::kSkipWhenBusy && (busy_ || !queue_.empty())) return false;
  if (!force && max_backlog_ > 0 && queue_.size() >= max_backlog_) return false;
  Snapshot s;
  if (!spare_.empty()) {
    s = std::move(spare_.back());
    spare_.pop_back();
  }
  s.params.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) s.params[i].assign(params[i].begin(), params[i].end());
  s.point = {iteration, v, seconds, {}};
  queue_.push_back(std::move(s));
  cv_.notify_all();
  return true;
}

std::vector<EvalPoint> SnapshotEvaluator::Take() {
  std::lock_guard lock(mu_);
  std::vector<EvalPoint> out;
  out.swap(done_);
  return out;
}

void SnapshotEvaluator::Drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void SnapshotEvaluator::Loop(bool low_priority) {
  // Linux schedules threads individually: lowering this thread's nice value leaves the
  // training processes the CPU first (setpriority(2) with a thread id, see its NOTES).
  if (low_priority) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
  std::vector<const float*> ptrs;
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    Snapshot s = std::move(queue_.back());
    queue_.pop_back();
    busy_ = true;
    lock.unlock();
    ptrs.clear();
    for (const auto& p : s.params) ptrs.push_back(p.data());
    s.point.eval = model_.Evaluate(ptrs, test_, samples_);
    lock.lock();
    done_.push_back(s.point);
    spare_.push_back(std::move(s));
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace dsync::train
