// The adaptive policy of `dsync:auto` (docs/contract.md): from each worker's measured iteration
// time it decides the round quorum and the delay each worker is allowed, within the
// configured maximum. Pure (no clocks, no I/O): the scheduler feeds it times and membership
// events, the unit tests feed it synthetic ones.
//
// The reasoning. A round closes at the pace of the slowest worker it must wait for. A worker
// whose iterations take f times the reference time (the typical worker's) can contribute to
// only one round in f; if its allowance D_w < f, the bound check holds rounds for it and
// everybody runs at its pace (BSP's problem). So:
//   - workers near the reference pace ("fast") get D_w = 0 and form the quorum: they are
//     waited for, every round holds their gradients, exactly as in BSP;
//   - a worker slower than `slow_ratio` × reference is a straggler: it leaves the quorum and
//     gets D_w = min(max_bound, ceil(f) + margin), so its gradient lands, delayed but never
//     lost, in the round that is open when it arrives, and no round waits for it;
//   - it is fast again once its time falls below `recover_ratio` × reference (hysteresis:
//     noise does not flap the decision).
// With no straggler the decision is Q = all, D_w = 0 for everyone: bsp. The reference is
// the lower median of the measured times, so one straggler cannot drag it up, and half the
// workers slowing down together reads as "these are slower", not "the others are faster".
// A worker's time is the median of its last `window` iterations: one slow iteration (a page
// fault storm, a busy core) moves nothing, a lasting change shows after window/2 of them. A
// straggler's allowance goes up at once but down only by two or more rounds, so a ratio
// hovering at a boundary does not re-decide every round.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/types.h"

namespace dsync::ps {

struct AutoPolicyOptions {
  uint32_t max_bound = SyncMode::kDefaultAutoMax;
  uint32_t window = 7;          // a worker's time: median of its last `window` iterations
  uint32_t min_samples = 3;     // samples before a worker can be called a straggler
  double slow_ratio = 1.5;      // above this × reference: a straggler
  double recover_ratio = 1.25;  // a straggler below this × reference is fast again
  uint32_t margin = 1;          // rounds of allowance beyond the measured ratio (jitter)
};

struct AutoDecision {
  uint32_t quorum = SyncMode::kAll;        // kAll, or the number of fast workers
  std::map<WorkerId, uint32_t> allowance;  // every known live worker
  bool operator==(const AutoDecision&) const = default;
};

class AutoPolicy {
 public:
  explicit AutoPolicy(AutoPolicyOptions options);

  void Join(WorkerId w);
  void Leave(WorkerId w);
  // One iteration of w took `seconds` of its own work: computing and pushing, not waiting
  // for the bound (the scheduler measures begin -> commit).
  void Observe(WorkerId w, double seconds);

  // Re-decides from what was observed; true when the decision changed.
  bool Decide();
  const AutoDecision& decision() const { return decision_; }
  // "quorum 3 of 4; worker 1003 allowed 4 (3.1x)" for logs: of the decision, or of
  // `applied` (what the scheduler applies instead, DelayPayoff's bsp) with the ratios measured.
  std::string Describe() const { return Describe(decision_); }
  std::string Describe(const AutoDecision& applied) const;

  // The reference iteration time (0 until some worker has enough samples).
  double reference() const { return reference_; }

 private:
  struct Track {
    std::vector<double> recent;  // ring of the last `window` samples
    uint32_t samples = 0;
    double estimate = 0;         // median of `recent`
    bool straggler = false;
    uint32_t allowance = 0;
  };

  AutoPolicyOptions opt_;
  std::map<WorkerId, Track> workers_;
  AutoDecision decision_;
  double reference_ = 0;
  std::vector<double> scratch_;  // for medians, reused
};

}  // namespace dsync::ps
