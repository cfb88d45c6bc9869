// dsync:auto's check that delaying pays (docs/contract.md). AutoPolicy says who is slow from
// the workers' iteration times; that a worker is slower does not mean that rounds closing
// without it make the job progress faster. Where the workers share the machine's cores (or
// a link), a worker delayed hands its share of the cores to the others, the rounds close
// sooner but carry fewer fresh gradients, and the job's progress per second stays where it
// was, now with stale gradients that cost accuracy. So a proposal to delay is tried, and kept
// only if it pays:
//   - once the policy proposes to delay somebody, the job, still bsp, measures the pace of
//     its progress with the slow worker: at least `min_baseline_rounds` rounds and
//     `min_seconds` (rounds of a few milliseconds on shared cores are timed with much noise),
//     at most the last `measure_rounds` rounds beyond that; progress = the gradients applied;
//   - a proposal to delay starts a trial of `measure_rounds` rounds and `min_seconds` at least
//     (after `settle_rounds` for the queues to settle), in which a gradient applied s rounds
//     after the version it was computed on counts what a stale gradient is worth next to a
//     fresh one, as the servers measure it in this job (ps/stale_worth.h: how well such
//     gradients agree with the fresh ones of their rounds), times the staleness policy's
//     weight of it; until that is measured, 1 / (1 + s) (the discount of staleness-aware
//     asynchronous SGD). A gradient that points against where the model goes counts less
//     than nothing. Progress is counted when the trial is judged, with the worth measured by
//     then, as the servers' reports trail the rounds;
//   - the trial's progress per second must be at least `min_gain` times bsp's, over the whole
//     trial and over each of its halves (a second of noisy rounds passes by chance now and
//     then; both halves far more rarely), where bsp's is its pace over the faster half of its
//     measurement (a slow spell there would let a trial that gains nothing pass; the faster
//     of two noisy halves errs high, which only makes trials fail); if it is not,
//     the job goes back to bsp and tries again only after `backoff_rounds` rounds, doubled
//     after each failed trial (up to `max_backoff_rounds`), so that a deployment where delay
//     never pays settles into bsp. A trial cut short because the proposal went back to bsp
//     (the slowness did not last) or came to delay other workers counts as failed: flapping
//     from noise backs off alike. (Before a trial, bsp is measured anew whenever the
//     proposal changes whom it delays: workers that look slow by turns are never tried.);
//   - a delay kept is still measured, over the last `measure_rounds` rounds and `min_seconds`,
//     with the worth measured as it goes on: once its pace
//     falls below the bsp pace it beat (that faster half: the trial beat it by min_gain, a
//     margin for noise), the job goes back to bsp, measures bsp again and
//     tries again after `backoff_rounds`;
//   - a join or leave makes the paces measured before incomparable: bsp again, measured anew;
//   - the last share of a job's gradient budget runs as bsp for good (Finish; the scheduler
//     says when): at a constant learning rate, the model a job ends with still carries the
//     noise of the rounds that stepped it last, and delayed rounds, short of a worker and
//     holding stale gradients, leave more of it (docs/design.md).
// A real straggler passes at once (a 3x slower worker holds every bsp round; without it the
// rounds close about 3x as often); noise from shared cores does not. Pure: the scheduler
// feeds it round closes with their times; the unit tests feed synthetic ones.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsync/config.h"
#include "dsync/types.h"
#include "ps/auto_policy.h"
#include "ps/stale_worth.h"

namespace dsync::ps {

struct DelayPayoffOptions {
  uint32_t measure_rounds = 20;        // rounds a trial and bsp's pace are measured over
  uint32_t min_baseline_rounds = 10;   // bsp rounds measured before the first trial
  uint32_t settle_rounds = 2;          // rounds after a switch that are not measured
  // A measurement (bsp's or a trial's) spans this much time at least. On the 2-core VM, paces
  // over 20 rounds of 5 ms (0.1 s) swung by 30 % from trial to trial in a job where delaying
  // gained nothing (lr 0.1, no added compute), and such trials passed.
  double min_seconds = 1.0;
  uint32_t max_samples = 1u << 14;     // rounds a window holds at most, however short
  // A trial must progress this much faster than bsp, over each of its halves. On the 2-core
  // VM (fmnist_cnn.py, 4 workers) trials in balanced jobs gave 0.95-0.98x, with a 3x
  // straggler 1.11-2.18x over the whole trial (measured before the halves had to pass each:
  // a true gain near 1.1x now fails more often than not).
  double min_gain = 1.10;
  uint32_t backoff_rounds = 50;        // bsp after a failed trial, doubled per failure
  uint32_t max_backoff_rounds = 1600;
};

class DelayPayoff {
 public:
  enum class Phase { kBsp, kTrial, kDelaying };

  // `staleness`: the job's policy, whose weight of a stale gradient scales what it is worth.
  explicit DelayPayoff(DelayPayoffOptions options, StalenessPolicy staleness = {},
                       StaleWorthOptions worth = {});
  // The policy the servers now apply (the staleness policy damp changes it once).
  void SetStaleness(const StalenessPolicy& staleness) { staleness_ = staleness; }

  // What to apply, given the policy's proposal: the proposal itself (the reference returned
  // is `proposal`), or bsp. Nothing is copied: it runs at every commit.
  const AutoDecision& Gate(const AutoDecision& proposal);
  // A round closed at `now` (seconds, any fixed origin).
  void RoundClosed(double now, const RoundRecord& round);
  // Workers joined or left: paces measured before are not comparable with those after.
  void MembershipChanged();
  // The job's budget of `budget` gradients is down to its last `percent`: from now on every
  // decision is bsp, whatever the proposal or the phase (a trial or a kept delay ends), so
  // that the rounds that step the model last hold every worker's gradient, none stale. For
  // good: a join or leave does not undo it.
  void Finish(uint32_t percent, uint64_t budget);
  bool finishing() const { return finishing_; }
  // A server's agreement report of a closed round (ps/gradient_agreement.h), counting
  // `weight` of a round (StaleWorth::Add); false when it said nothing.
  bool Measured(const RoundRecord& round, std::span<const double> dots,
                std::span<const uint8_t> measured, double weight = 1.0) {
    return worth_.Add(round, dots, measured, weight);
  }
  const StaleWorth& worth() const { return worth_; }

  Phase phase() const { return phase_; }
  // Why the last Gate decided as it did, for the policy's log line ("" while plain bsp before
  // Finish).
  // Formatted when asked: Gate runs at every commit, and while bsp's pace is measured or a
  // backoff runs, its reason changes with every round.
  std::string reason() const;

 private:
  // Gradients of closed rounds: fresh ones, and per staleness level the policy's weights of
  // the stale ones and how many (their worth is applied when a pace is computed).
  struct Gradients {
    double fresh = 0;
    std::array<double, StaleWorth::kLevels + 1> stale{};
    std::array<uint64_t, StaleWorth::kLevels + 1> stale_count{};
  };
  struct Sample {
    double at = 0;  // when the round closed
    Gradients gradients;
  };
  // Rounds closed in one phase, and the totals of all but the first (which only marks where
  // the window starts): a pace costs the same however many rounds the window holds.
  class Window {
   public:
    void Push(const Sample& s);
    void PopFront();
    void Clear();
    size_t size() const { return samples_.size(); }
    // Rounds measured: all but the first, which only marks where the window starts.
    size_t rounds() const { return samples_.empty() ? 0 : samples_.size() - 1; }
    double seconds() const {
      return samples_.size() < 2 ? 0.0 : samples_.back().at - samples_.front().at;
    }
    // Whether the window holds more than `rounds` rounds beyond its first and would still
    // span `seconds` without it.
    bool Surplus(uint32_t rounds, double seconds) const {
      return samples_.size() > rounds + 1u && samples_.back().at - samples_[1].at >= seconds;
    }
    const Gradients& total() const { return total_; }
    const Sample& operator[](size_t i) const { return samples_[i]; }
    static void Add(Gradients& to, const Gradients& g, double sign);

   private:
    std::deque<Sample> samples_;
    Gradients total_;
  };
  // A trial failed: bsp, and the next trial only after the backoff, which doubles.
  void GiveUp();
  // Hands `out` out: whether it delays, and the settling that a switch starts.
  const AutoDecision& HandOut(const AutoDecision& out);
  // What the gradients are worth (fresh ones 1, stale ones their measured worth times the
  // policy's weight), per second of `seconds`.
  double PerSecond(const Gradients& g, double seconds) const;
  // Progress per second over the window (the first round only marks the start).
  double Pace(const Window& w) const;
  // The same between rounds `from` and `to` of the window (from only marks the start); it
  // walks the rounds, for the halves, checked once per trial.
  double PaceBetween(const Window& w, size_t from, size_t to) const;
  // The paces over the window's two halves, split by time.
  std::pair<double, double> Halves(const Window& w) const;
  // Whether the window spans `rounds` rounds and min_seconds.
  bool Spans(const Window& w, uint32_t rounds) const;
  // The worth of the stale gradients in the window, for the reasons.
  std::string WorthOf(const Window& w) const;

  DelayPayoffOptions opt_;
  StalenessPolicy staleness_;
  StaleWorth worth_;
  Phase phase_ = Phase::kBsp;
  bool delaying_ = false;      // the last decision handed out delays somebody
  // Whom the proposal being measured (bsp's pace, then the trial) delays.
  std::vector<WorkerId> tried_;
  uint32_t settle_ = 0;        // rounds still to skip after a switch
  Window bsp_;                 // the last rounds closed under bsp
  Window trial_;               // the last rounds closed delaying (the trial, then the delay)
  double bsp_pace_ = 0;        // bsp's faster half when the trial started: what delay must beat
  uint64_t rounds_closed_ = 0;
  uint64_t retry_after_ = 0;   // no trial before this many rounds have closed
  uint32_t backoff_ = 0;
  bool finishing_ = false;       // Finish was called: bsp to the end
  uint32_t finish_percent_ = 0;  // its share of the budget, and the budget, for the reason
  uint64_t finish_budget_ = 0;
  // The reason: one of the three that Gate gives at every commit (their figures, formatted by
  // reason()), or `reason_`, formatted once when a trial starts or ends.
  enum class Why { kSaid, kBackoff, kMeasuringBsp, kFinishing };
  Why why_ = Why::kSaid;
  size_t why_rounds_ = 0;
  double why_seconds_ = 0;
  std::string reason_;
};

}  // namespace dsync::ps
