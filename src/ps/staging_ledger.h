// What each worker has staged on one server, kept for two reasons (docs/contract.md, "Trust"):
// - a quota: a worker may hold at most `window` distinct clocks here (what its delay bound
//   lets an honest worker have in flight, RoundRule's StagingWindow), so a buggy or hostile
//   client cannot make a server hold more than its share;
// - receipts: when every slice this server holds of a tensor is staged for (worker, clock),
//   the push that completed it is acknowledged with a receipt the scheduler can check.
//
// Tensors are placed with the slice planner's rule: slice s of tensor t has its primary on
// server rank (first_rank_t + s) mod S and its copy j on the j-th rank after that (j < R, the
// job's replicas). A server learns first_rank_t from the first slice of t it holds (its index
// and copy number) and refuses slices that contradict it, so the placement a receipt attests
// is the one every slice of it follows.
//
// Thread-safe; small vectors scanned linearly (entries exist only for clocks in flight) and
// reused, so the push path allocates nothing in steady state.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/keys.h"

namespace dsync::ps {

class StagingLedger {
 public:
  StagingLedger() = default;
  // Known once the scheduler admitted this server.
  void Configure(const JobKey& key, NodeId server, uint32_t num_servers, uint32_t window,
                 uint32_t replicas = 1);

  // Copy `replica` of slice `slice` of tensor t (`slices` in all) is created here: records (or
  // checks against) the tensor's placement. InvalidArgument when it cannot be this server's.
  Status Place(TensorId tensor, uint32_t slices, uint32_t slice, uint32_t replica = 0);

  // Before a push's payload is read: may worker w stage a slice of `clock` here?
  // ResourceExhausted past the quota; FailedPrecondition for a clock already applied.
  Status Admit(WorkerId w, Clock clock) const;
  // A slice of tensor t is being staged for (w, clock): counts it, and sets *receipt when it
  // completes the tensor on this server. Refuses (and counts nothing) what Admit would.
  Status Staged(WorkerId w, Clock clock, TensorId tensor, std::optional<Tag>* receipt);
  // A round applied (w, clock) and released all its slices here; later pushes for clocks up
  // to `clock` are refused.
  void Applied(WorkerId w, Clock clock);
  // w is gone and its slices of clocks from `next_clock` on were released.
  void Gone(WorkerId w, Clock next_clock);

  uint32_t window() const { return window_; }
  // A new quota (a server taking a lost rank over stages more until its copies are in).
  void set_window(uint32_t window);

 private:
  struct Placement {
    uint32_t slices = 0;
    uint32_t first_rank = 0;
    uint32_t here = 0;  // slices of it placed on this server (all exist before any push)
  };
  struct Progress {  // slices of one tensor staged for (worker, clock), not yet all of them
    WorkerId worker;
    Clock clock;
    TensorId tensor;
    uint32_t staged;
  };
  struct ClockSlices {
    Clock clock;
    uint32_t slices;  // staged and not yet released
  };
  struct WorkerLedger {
    std::vector<ClockSlices> clocks;
    Clock applied_below = 0;  // clocks below this were applied here
  };
  Status AdmitLocked(WorkerId w, const WorkerLedger* ledger, Clock clock) const;

  mutable std::mutex mu_;
  JobKey key_{};
  NodeId server_ = 0;
  uint32_t rank_ = 0;
  uint32_t num_servers_ = 1;
  uint32_t replicas_ = 1;
  uint32_t window_ = 2;
  std::unordered_map<TensorId, Placement> placement_;
  std::vector<Progress> progress_;
  std::unordered_map<WorkerId, WorkerLedger> workers_;
};

}  // namespace dsync::ps
