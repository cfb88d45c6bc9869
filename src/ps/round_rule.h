// The round-closing rule of docs/contract.md, as a pure state machine: no I/O, no clocks, no
// threads. The scheduler feeds it membership and commit events and sends out what it
// decides; the property tests feed it random event orders and check the invariants.
//
// Round modes (bsp, dsync:K[,Q]). Each live worker w has a queue of committed gradients not
// yet placed in a round. The open round R closes when
//   (a) it holds the queue heads of at least min(Q, |E|) workers of E, the live workers
//       counted toward quorum in R (those that joined at or before R), and
//   (b) for every live worker w with an empty queue, computing on base b_w, R + 1 - b_w <= D
//       (b_w as reported by Begin, else the lowest base w's pull gate allows), and
//   (c) it holds at least one gradient, unless no live worker counts in R and a worker
//       that joined during R waits for it (it then closes empty: a version, no update).
// Closing takes the head of every worker's queue (live or gone: queued gradients are never
// lost). So the k-th queued gradient of w lands in round R + k, which is known at commit
// time; a worker's pull at its next clock is gated on version >= (that round) + 1 - D.
//
// dsync:auto. As the round modes, but each worker has an allowance D_w <= D (the maximum)
// used in (b) and in its pull gate, and the quorum changes at run time: the scheduler sets
// both from AutoPolicy's decisions. Everybody starts at D_w = 0, Q = all (bsp). Lowering
// D_w can only make rounds wait longer, raising it only lets them close earlier: staleness
// stays <= the allowance in force when the gradient's base was granted, so <= D.
//
// The finish (FinishAsBsp, either kind of round mode): from then on every D_w = 0 and Q =
// all, for good, joiners included; by the same argument the bound holds across it.
//
// ssp:K and asp. Every commit is placed in a round of its own at once ("applied on
// arrival"). asp pulls never wait; an ssp pull at clock c waits until every live worker has
// committed its gradients of clocks < c - K (and they are in decided rounds).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::ps {

// The most clocks of one worker a server may hold staged (pushed, not yet applied) when the
// worker follows its pull gates: in round modes its queued gradients (at most D + 1 by the
// gate) plus the clock it is pushing; in ssp its gate includes its own last round; in asp
// the gate holds a pull back once the servers trail the worker's commits by
// kAspBacklog rounds. Servers refuse pushes beyond it.
uint32_t StagingWindow(const SyncMode& mode);
// The same on a server of a job with `replicas` copies of each slice (kReplicaLagRounds).
uint32_t StagingWindow(const SyncMode& mode, uint32_t replicas);
constexpr uint32_t kAspBacklog = 6;

struct Admission {
  Round join_round = 0;   // first round w counts toward quorum in
  Clock start_clock = 0;  // clock of w's first gradient
  Version gate = 0;       // lowest version w's first pull may return
};

struct CommitResult {
  Round round = 0;                // the round the gradient is (or will be) applied in
  std::optional<Version> gate;    // min version for pulls at the next clock; empty: comes
                                  // later through TakeGateReleases() (ssp)
};

struct GateRelease {
  WorkerId worker = 0;
  Clock clock = 0;        // the clock whose pulls this gate is for
  Version min_version = 0;
};

struct RuleStats {
  Round rounds_closed = 0;
  uint64_t gradients_committed = 0;
  uint64_t gradients_placed = 0;
  uint32_t max_staleness = 0;
};

class RoundRule {
 public:
  explicit RoundRule(SyncMode mode);

  // A job resumed from a checkpoint of version `round`: rounds continue from it and the
  // first workers' clocks from `clock`. Only before any worker joined.
  Status StartAt(Round round, Clock clock);

  // Admits a worker. `initial` workers joined before anything was committed and count from
  // the open round; a worker joining a running job counts from the next round and its first
  // pull waits so that its first gradient meets the bound there.
  Result<Admission> Join(WorkerId w, bool initial);
  // w now computes its gradient of `clock` on `base` (sent after its pulls finish).
  Status Begin(WorkerId w, Clock clock, Version base);
  // w's gradient of `clock`, computed on `base`, reached every server. An `empty` commit
  // (w pushed nothing this clock but counts in the round) has no staleness: its base is
  // taken as the round it lands in.
  Result<CommitResult> Commit(WorkerId w, Clock clock, Version base, bool empty = false);
  // Graceful leave (failed = false) or declared dead: never waited for again; its queued
  // gradients are still applied. Returns w's next clock: every clock below it was
  // committed, anything pushed for it or later is to be discarded.
  Result<Clock> Remove(WorkerId w, bool failed);

  // dsync:auto only: w's delay allowance (<= the mode's maximum bound) and the quorum
  // (SyncMode::kAll or a count). FailedPrecondition in any other mode.
  // After FinishAsBsp only 0 and kAll: the finish holds to the end.
  Status SetAllowance(WorkerId w, uint32_t allowance);
  Status SetQuorum(uint32_t quorum);
  // Round modes (fixed or dsync:auto): from the open round on, every live worker is waited
  // for and none has an allowance, joiners included: rounds close as bsp's to the end of the
  // job. Gradients whose bases were granted under the old allowances keep their staleness
  // (<= D) and land in the first rounds after it. FailedPrecondition in ssp and asp.
  Status FinishAsBsp();
  bool finished_as_bsp() const { return finished_; }

  // Closes every round that may close now, oldest first.
  std::vector<RoundRecord> CloseReady();
  // Closes the oldest round that may close now, if any: CloseReady one round at a time, for a
  // scheduler replaying its journal, which recorded the rounds one by one.
  std::optional<RoundRecord> CloseNext();
  // ssp gates that opened since the last call.
  std::vector<GateRelease> TakeGateReleases();

  const SyncMode& mode() const { return mode_; }
  Round open_round() const { return open_round_; }
  uint32_t live_workers() const;
  bool has_queued() const;
  bool is_live(WorkerId w) const;
  // The base w reported for the gradient it computes now (Begin), if any.
  std::optional<Version> begun(WorkerId w) const;
  const RuleStats& stats() const { return stats_; }
  // For tests: whether the counts and sets kept to decide a round in O(log n) (below) agree
  // with a count over every worker; "" when they do, else what differs.
  std::string CheckIndex() const;

 private:
  struct Queued {
    Clock clock;
    Version base;
  };
  struct WorkerState {
    bool live = true;
    Round join_round = 0;
    uint32_t bound = 0;             // its delay allowance: the mode's D, or set by dsync:auto
    Clock next_clock = 0;           // clock of its next commit
    std::deque<Queued> queue;       // committed, not yet placed
    Version floor = 0;              // its pull gate: lowest base its next gradient may have
    std::optional<Version> begun;   // base of the in-progress gradient, when reported
    std::optional<Clock> ssp_wait;  // clock whose ssp gate is still closed
    // Live with an empty queue (round modes): its base plus allowance, in blocking_.
    std::optional<uint64_t> blocking_key;
  };

  bool RoundMode() const { return mode_.kind == SyncKind::kRound; }
  Version SaturatingSub(uint64_t a, uint64_t b) const { return a > b ? a - b : 0; }
  bool MayClose() const;
  RoundRecord CloseOne();
  // Puts w's key in blocking_, or takes it out, after anything it depends on changed.
  void Reindex(WorkerState& w);
  // b_w + D_w, w's key in blocking_.
  static uint64_t BlockingKey(const WorkerState& w);
  bool SspGateOpen(Clock clock) const;
  void ReleaseSspGates();

  SyncMode mode_;
  bool finished_ = false;  // FinishAsBsp was called
  Round open_round_ = 0;
  Round start_round_ = 0;  // StartAt: the version the job started from
  Clock start_clock_ = 0;  // StartAt: the first workers' first clock
  std::map<WorkerId, WorkerState> workers_;  // ordered: rounds sum in worker-id order
  // What MayClose needs, kept as workers change, so that a commit costs O(log n) with n
  // workers, not a pass over all of them (round modes):
  uint32_t live_ = 0;          // live workers
  uint32_t late_joiners_ = 0;  // live workers that count from the next round only
  uint32_t contributing_ = 0;  // live, counting in the open round, with a queued gradient
  std::vector<WorkerId> queued_;  // workers (live or gone) with a queued gradient, any order
  // For each live worker with an empty queue, b_w + D_w (b_w: the lowest base it may compute
  // on), counted by value (a few distinct ones near the open round): the open round R may
  // close without them only if the least is >= R + 1.
  std::map<uint64_t, uint32_t> blocking_;
  std::vector<WorkerId> still_queued_;  // CloseOne's scratch
  std::deque<RoundRecord> ready_;            // ssp/asp: rounds decided on commit
  std::vector<GateRelease> releases_;
  RuleStats stats_;
};

}  // namespace dsync::ps
