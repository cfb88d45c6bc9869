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
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync::ps {

class RoundRule;

struct AutoPolicyOptions {
  uint32_t max_bound = SyncMode::kDefaultAutoMax;
  uint32_t window = 7;          // a worker's time: median of its last `window` iterations
  uint32_t min_samples = 3;     // samples before a worker can be called a straggler
  double slow_ratio = 1.5;      // above this × reference: a straggler
  double recover_ratio = 1.25;  // a straggler below this × reference is fast again
  uint32_t margin = 1;          // rounds of allowance beyond the measured ratio (jitter)
};

// The workers a decision delays, each with its allowance (> 0), in id order; every other
// worker's allowance is 0. Only the delayed ones are held, so that a decision costs what the
// stragglers cost, not what the job's size does: it is compared and handed on at every commit.
class Allowances {
 public:
  using Entry = std::pair<WorkerId, uint32_t>;
  // 0 for a worker not delayed.
  uint32_t at(WorkerId w) const;
  bool contains(WorkerId w) const { return at(w) > 0; }
  // Sets w's allowance; 0 takes it out.
  void Set(WorkerId w, uint32_t allowance);
  void clear() { entries_.clear(); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
  std::vector<Entry>::const_iterator end() const { return entries_.end(); }
  bool operator==(const Allowances&) const = default;

 private:
  std::vector<Entry>::const_iterator Find(WorkerId w) const;  // the first entry >= w
  std::vector<Entry> entries_;
};

struct AutoDecision {
  uint32_t quorum = SyncMode::kAll;  // kAll, or the number of fast workers
  Allowances allowance;              // the delayed workers (the others: 0)
  bool delays() const { return quorum != SyncMode::kAll || !allowance.empty(); }
  bool operator==(const AutoDecision&) const = default;
};

// Moves `rule` from the decision it follows, `from`, to `to`: the workers `from` delayed and
// `to` does not go back to 0, the others get theirs, then the quorum. Workers no longer live
// are passed by. The first error the rule gives, after trying the rest.
Status ApplyDecision(RoundRule& rule, const AutoDecision& from, const AutoDecision& to);

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
  // A measured worker's place in the orders below: its estimate, then its id (unique).
  using Key = std::pair<double, WorkerId>;
  using Order = std::set<Key>;

  struct Track {
    std::vector<double> recent;  // ring of the last `window` samples
    uint32_t samples = 0;
    double estimate = 0;         // median of `recent`
    bool measured = false;       // samples >= min_samples: in the orders below
    bool straggler = false;
    bool dirty = false;          // its estimate changed since it was last judged
    uint32_t allowance = 0;
  };

  // Decide's cost is kept to what changed, so that it does not grow with the job's size (it
  // runs at every commit): the reference is the lower median kept by two ordered halves
  // (low_'s largest is it), each measured worker sits in fast_ or slow_ by its estimate, so
  // the workers crossing a threshold are those at an end of one of them, and a straggler's
  // allowance, a step function of estimate / reference, is judged again only where its own
  // estimate changed or the reference moved it across a step (a range of slow_ per step).
  // Nodes move between the sets by extract and insert, so the orders allocate only when a
  // worker is first measured; the decision's vector and dirty_ reuse their capacity.
  void Place(Key key);                   // a new node (allocates), then PlaceNode
  void PlaceNode(Order::node_type node);  // into low_ or high_, then balanced
  Order::node_type Unplace(Key key);      // out of low_ or high_, then balanced
  void Balance();
  static void Rekey(Order& order, Key from, Key to);
  // Judges straggler w's allowance against the reference (as the header says, its
  // hysteresis included; `was`: a straggler before this decision) and updates the decision;
  // true when it changed.
  bool JudgeAllowance(WorkerId w, Track& t, bool was);
  bool Unstraggle(WorkerId w, Track& t);  // back to fast; true when the decision changed
  // Stragglers whose estimate / reference may have crossed a step of the allowance when the
  // reference moved from `before` to reference_: marked dirty.
  void MarkCrossings(double before);

  // ceil(ratio - kStepSlack): a ratio a rounding error above a whole number counts as it.
  static constexpr double kStepSlack = 1e-6;

  AutoPolicyOptions opt_;
  std::map<WorkerId, Track> workers_;
  AutoDecision decision_;
  bool left_delayed_ = false;  // a delayed worker left since the last Decide
  double reference_ = 0;
  Order low_, high_;   // measured estimates: low_ holds the lower (n + 1) / 2
  Order fast_, slow_;  // measured workers by estimate: not stragglers / stragglers
  std::vector<WorkerId> dirty_;  // stragglers to judge again (Track::dirty), reused
  std::vector<double> scratch_;  // for a worker's median, reused
};

}  // namespace dsync::ps
