// The scheduler: membership (join, leave, heartbeat failure), and the global round
// decisions (docs/contract.md). It sees small control messages only, never payloads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync {

struct SchedulerStats {
  Round rounds_closed = 0;
  uint64_t gradients_committed = 0;
  uint32_t live_workers = 0;
  uint32_t workers_joined = 0;    // ever
  uint32_t workers_left = 0;
  uint32_t workers_failed = 0;
  uint32_t servers_lost = 0;      // the job went on without them (Config::replicas)
  uint32_t servers_restored = 0;  // new servers that took a lost rank over and hold its copies
  uint32_t max_staleness = 0;     // over every gradient placed in a round
  uint32_t policy_changes = 0;    // dsync:auto decisions that changed quorum or allowances
  // The staleness policy damp: the round from which the job is damped, once it is.
  std::optional<Round> damped_from;
  // Its growth watch: the largest ratio of the gradients' recent size to their level after
  // the warm-up (it damps past GrowthWatchOptions::ratio), and the round of it; 0 without
  // the watch.
  double growth_peak = 0.0;
  Round growth_peak_round = 0;
  // dsync:auto: the servers' reports of how stale gradients agree with fresh ones (the
  // measured worth of staleness), used and refused (malformed, or not fitting their round).
  uint64_t agreements_measured = 0;
  uint64_t agreements_refused = 0;
};

class Scheduler {
 public:
  static Result<std::unique_ptr<Scheduler>> Start(const Config& config);
  virtual ~Scheduler() = default;

  virtual uint16_t port() const = 0;
  // Runs until every worker that joined has left or failed and the servers have applied
  // every decided round; then tells the servers to shut down.
  virtual Status Run() = 0;
  virtual void Stop() = 0;
  virtual SchedulerStats stats() const = 0;
  // The rounds decided so far, in order: the newest 65536 (Config::audit_log keeps all).
  virtual std::vector<RoundRecord> history() const = 0;
};

}  // namespace dsync
