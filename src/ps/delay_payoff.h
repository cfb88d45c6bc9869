// dsync:auto's check that delaying pays (docs/contract.md). AutoPolicy says who is slow from
// the workers' iteration times; that a worker is slower does not mean that rounds closing
// without it make the job progress faster. Where the workers share the machine's cores (or
// a link), a worker delayed hands its share of the cores to the others, the rounds close
// sooner but carry fewer fresh gradients, and the job's progress per second stays where it
// was, now with stale gradients that cost accuracy. So a proposal to delay is tried, and kept
// only if it pays:
//   - once the policy proposes to delay somebody, the job, still bsp, measures the pace of
//     its progress with the slow worker: at least `min_baseline_rounds` rounds (at most the
//     last `measure_rounds`), progress = the gradients they applied;
//   - a proposal to delay starts a trial of `measure_rounds` rounds (after `settle_rounds`
//     for the queues to settle), in which a gradient applied s rounds after the version it
//     was computed on counts 1 / (1 + s) of a fresh one (the discount of staleness-aware
//     asynchronous SGD: a stale gradient is worth less, the staler the less);
//   - the trial's progress per second must be at least `min_gain` times bsp's; if it is not,
//     the job goes back to bsp and tries again only after `backoff_rounds` rounds, doubled
//     after each failed trial (up to `max_backoff_rounds`), so that a deployment where delay
//     never pays settles into bsp. A trial cut short because the proposal went back to bsp
//     (the slowness did not last) counts as failed: flapping from noise backs off alike;
//   - a delay kept is still measured, over the last `measure_rounds` rounds: once its pace
//     falls below the bsp pace it beat, the job goes back to bsp, measures bsp again and
//     tries again after `backoff_rounds`;
//   - a join or leave makes the paces measured before incomparable: bsp again, measured anew.
// A real straggler passes at once (a 3x slower worker holds every bsp round; without it the
// rounds close about 3x as often); noise from shared cores does not. Pure: the scheduler
// feeds it round closes with their times; the unit tests feed synthetic ones.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "dsync/types.h"
#include "ps/auto_policy.h"

namespace dsync::ps {

struct DelayPayoffOptions {
  uint32_t measure_rounds = 20;        // rounds a trial and bsp's pace are measured over
  uint32_t min_baseline_rounds = 10;   // bsp rounds measured before the first trial
  uint32_t settle_rounds = 2;          // rounds after a switch that are not measured
  // A trial must progress this much faster than bsp. On the 2-core VM (fmnist_cnn.py, 4
  // workers) trials in balanced jobs gave 0.95-0.98x, with a 3x straggler 1.11-2.18x.
  double min_gain = 1.10;
  uint32_t backoff_rounds = 50;        // bsp after a failed trial, doubled per failure
  uint32_t max_backoff_rounds = 1600;
};

class DelayPayoff {
 public:
  enum class Phase { kBsp, kTrial, kDelaying };

  explicit DelayPayoff(DelayPayoffOptions options);

  // What to apply, given the policy's proposal: the proposal, or bsp for the same workers.
  AutoDecision Gate(const AutoDecision& proposal);
  // A round closed at `now` (seconds, any fixed origin).
  void RoundClosed(double now, const RoundRecord& round);
  // Workers joined or left: paces measured before are not comparable with those after.
  void MembershipChanged();

  Phase phase() const { return phase_; }
  // Why the last Gate decided as it did, for the policy's log line ("" while plain bsp).
  const std::string& reason() const { return reason_; }

 private:
  struct Sample {
    double at;
    double progress;
  };
  // A trial failed: bsp, and the next trial only after the backoff, which doubles.
  void GiveUp();
  // Progress per second over the samples (the first one only marks the start).
  static double Pace(const std::deque<Sample>& samples);

  DelayPayoffOptions opt_;
  Phase phase_ = Phase::kBsp;
  bool delaying_ = false;      // the last decision handed out delays somebody
  bool proposing_ = false;     // the last proposal delayed somebody
  uint32_t settle_ = 0;        // rounds still to skip after a switch
  std::deque<Sample> bsp_;     // the last rounds closed under bsp
  std::deque<Sample> trial_;   // the last rounds closed delaying (the trial, then the delay)
  double bsp_pace_ = 0;        // bsp's pace when the trial started: what delay must beat
  uint64_t rounds_closed_ = 0;
  uint64_t retry_after_ = 0;   // no trial before this many rounds have closed
  uint32_t backoff_ = 0;
  std::string reason_;
};

}  // namespace dsync::ps
