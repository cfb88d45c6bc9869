// The scheduler's side of checkpoints: when one is due, which servers have written their part,
// and the manifest once every one has. One checkpoint is in flight at a time; a failed one
// (a server could not write) leaves the newest complete one standing and the job running.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/checkpoint.h"

namespace dsync::ps {

// Complete checkpoints kept under the directory; older ones are deleted.
constexpr size_t kCheckpointsKept = 3;

class CheckpointCoordinator {
 public:
  using Clock = std::chrono::steady_clock;

  // `start`: the version the job starts from (a resumed job's), never checkpointed again.
  CheckpointCoordinator(const Config& config, Version start);

  bool enabled() const { return !dir_.empty(); }
  bool in_flight() const { return pending_.has_value(); }
  // Whether a periodic checkpoint at `version` (every round before it decided) is due now.
  bool Due(Version version, Clock::time_point now) const;
  // Whether the job, ending at `version`, still needs its final checkpoint.
  bool FinalNeeded(Version version) const;

  // Starts a checkpoint; `manifest` holds the job's part (version, servers, slice size,
  // sync, gradients, learning rate). Returns the directory the servers write into.
  std::string Begin(CheckpointManifest manifest, Clock::time_point now);
  // A server's report for the checkpoint in flight (others are ignored). Returns true when
  // it settled the checkpoint: written complete, or failed.
  bool Reported(uint32_t rank, Version version, const Result<CheckpointFile>& file);
  // The server of `rank` was lost while the checkpoint was in flight: its slices' copies are
  // in the other files (Config::replicas), so it writes none. Returns true as Reported does.
  bool Lost(uint32_t rank);
  // How the newest settled checkpoint ended: OK when it is complete.
  const Status& last_result() const { return last_result_; }
  // Whether any checkpoint of this job completed (resuming from this directory would work).
  bool complete_any() const { return complete_any_; }
  // The newest checkpoint this job wrote (complete, or partial: lost servers' slices
  // missing), if any.
  struct Written {
    Version version = 0;
    std::string path;
    bool partial = false;
  };
  const std::optional<Written>& last_written() const { return last_written_; }

 private:
  std::string dir_;
  uint64_t every_;
  bool every_seconds_;
  Version start_;
  Version last_begun_;
  Clock::time_point last_begun_at_;
  struct Pending {
    CheckpointManifest manifest;
    std::vector<std::optional<CheckpointFile>> files;  // by rank
    Clock::time_point began;
  };
  std::optional<Pending> pending_;
  bool Settle();  // writes the manifest once every rank not lost has reported
  Status last_result_;
  bool complete_any_ = false;
  std::optional<Written> last_written_;
};

}  // namespace dsync::ps
