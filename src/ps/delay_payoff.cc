#include "ps/delay_payoff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace dsync::ps {
namespace {

// Whom a proposal delays: the workers it allows any delay, in id order.
std::vector<WorkerId> Slow(const AutoDecision& d) {
  std::vector<WorkerId> slow;
  for (const auto& [w, allowance] : d.allowance) slow.push_back(w);
  return slow;
}

bool SameSlow(const AutoDecision& d, const std::vector<WorkerId>& slow) {
  return d.allowance.size() == slow.size() &&
         std::equal(d.allowance.begin(), d.allowance.end(), slow.begin(),
                    [](const auto& entry, WorkerId w) { return entry.first == w; });
}

std::string Names(const std::vector<WorkerId>& workers) {
  return workers.empty() ? std::string("nobody") : fmt::format("{}", fmt::join(workers, ", "));
}

// bsp: everyone waited for, nobody delayed.
const AutoDecision kBsp{};

}  // namespace

DelayPayoff::DelayPayoff(DelayPayoffOptions options, StalenessPolicy staleness,
                         StaleWorthOptions worth)
    : opt_(options), staleness_(staleness), worth_(worth) {
  opt_.measure_rounds = std::max<uint32_t>(opt_.measure_rounds, 2);
  opt_.backoff_rounds = std::max<uint32_t>(opt_.backoff_rounds, 1);
  opt_.max_backoff_rounds = std::max(opt_.max_backoff_rounds, opt_.backoff_rounds);
  backoff_ = opt_.backoff_rounds;
  opt_.min_baseline_rounds = std::clamp<uint32_t>(opt_.min_baseline_rounds, 2, opt_.measure_rounds);
  if (!(opt_.min_seconds >= 0)) opt_.min_seconds = 0;
  opt_.max_samples = std::max(opt_.max_samples, opt_.measure_rounds + 1);
}

void DelayPayoff::Window::Add(Gradients& to, const Gradients& g, double sign) {
  to.fresh += sign * g.fresh;
  for (uint32_t level = 1; level <= StaleWorth::kLevels; ++level) {
    to.stale[level] += sign * g.stale[level];
    to.stale_count[level] = sign > 0 ? to.stale_count[level] + g.stale_count[level]
                                     : to.stale_count[level] - g.stale_count[level];
  }
}

void DelayPayoff::Window::Push(const Sample& s) {
  if (!samples_.empty()) Add(total_, s.gradients, 1.0);
  samples_.push_back(s);
}

void DelayPayoff::Window::PopFront() {
  if (samples_.size() >= 2) Add(total_, samples_[1].gradients, -1.0);  // the new first
  samples_.pop_front();
  if (samples_.size() < 2) total_ = {};  // and no drift carried on
}

void DelayPayoff::Window::Clear() {
  samples_.clear();
  total_ = {};
}

double DelayPayoff::PerSecond(const Gradients& g, double seconds) const {
  if (!(seconds > 0)) return 0;
  double progress = g.fresh;
  for (uint32_t level = 1; level <= StaleWorth::kLevels; ++level) {
    progress += g.stale[level] * worth_.Worth(level);
  }
  return std::isfinite(progress) ? progress / seconds : 0.0;
}

double DelayPayoff::Pace(const Window& w) const { return PerSecond(w.total(), w.seconds()); }

double DelayPayoff::PaceBetween(const Window& w, size_t from, size_t to) const {
  if (to <= from || to >= w.size()) return 0;
  Gradients sum;
  for (size_t i = from + 1; i <= to; ++i) Window::Add(sum, w[i].gradients, 1.0);
  return PerSecond(sum, w[to].at - w[from].at);
}

std::pair<double, double> DelayPayoff::Halves(const Window& w) const {
  const double whole = Pace(w);
  if (w.size() < 3) return {whole, whole};
  // Split by time, not rounds (rounds may close in bursts): at the first round at or past
  // the middle. Where one long round spans the middle, a half would be a sliver whose pace
  // is mostly noise: then both are the whole.
  const double middle = w[0].at + w.seconds() / 2;
  size_t half = 1;
  while (half + 2 < w.size() && w[half].at < middle) ++half;
  const double share = (w[half].at - w[0].at) / w.seconds();
  if (!(share >= 0.25 && share <= 0.75)) return {whole, whole};
  return {PaceBetween(w, 0, half), PaceBetween(w, half, w.size() - 1)};
}

bool DelayPayoff::Spans(const Window& w, uint32_t rounds) const {
  return w.size() >= rounds + 1u && w.seconds() >= opt_.min_seconds;
}

std::string DelayPayoff::WorthOf(const Window& w) const {
  uint32_t levels = 0;
  for (uint32_t level = 1; level <= StaleWorth::kLevels; ++level) {
    if (w.total().stale_count[level] > 0) levels |= 1u << level;
  }
  return levels == 0 ? "no stale gradients" : "stale ones worth " + worth_.Describe(levels);
}

void DelayPayoff::RoundClosed(double now, const RoundRecord& round) {
  ++rounds_closed_;
  if (settle_ > 0) {
    --settle_;
    return;
  }
  Sample sample;
  sample.at = now;
  for (const RoundMember& m : round.members) {
    const uint64_t s = Staleness(round.round, m.base);
    if (s == 0) {
      sample.gradients.fresh += 1;
    } else {
      sample.gradients.stale[StaleWorth::Level(s)] += staleness_.Weight(s);
      ++sample.gradients.stale_count[StaleWorth::Level(s)];
    }
  }
  // Delaying, the window keeps sliding after the trial: a delay kept is still checked.
  Window& into = delaying_ ? trial_ : bsp_;
  into.Push(sample);
  // The window: the last measure_rounds rounds, or more where they span less than min_seconds.
  while (into.size() > opt_.max_samples || into.Surplus(opt_.measure_rounds, opt_.min_seconds)) {
    into.PopFront();
  }
}

void DelayPayoff::MembershipChanged() {
  bsp_.Clear();
  trial_.Clear();
  settle_ = opt_.settle_rounds;
  // The bsp pace a trial or a kept delay is compared with was measured with other workers:
  // measure bsp again, then try again; what failed with the old workers says nothing of the
  // new ones, so no backoff either.
  phase_ = Phase::kBsp;
  retry_after_ = 0;
  backoff_ = opt_.backoff_rounds;
}

void DelayPayoff::Finish(uint32_t percent, uint64_t budget) {
  finishing_ = true;
  finish_percent_ = percent;
  finish_budget_ = budget;
}

void DelayPayoff::GiveUp() {
  phase_ = Phase::kBsp;
  retry_after_ = rounds_closed_ + backoff_;
  backoff_ = static_cast<uint32_t>(
      std::min<uint64_t>(uint64_t{backoff_} * 2, opt_.max_backoff_rounds));
  trial_.Clear();
}

std::string DelayPayoff::reason() const {
  switch (why_) {
    case Why::kBackoff:
      return fmt::format("delaying did not pay in the last trial; the next one after round {}",
                         retry_after_);
    case Why::kMeasuringBsp:
      return fmt::format("measuring bsp's pace before trying to delay ({} of {} rounds, "
                         "{:.2f} of {:.2f} s)",
                         why_rounds_, opt_.min_baseline_rounds, why_seconds_, opt_.min_seconds);
    case Why::kFinishing:
      return fmt::format("the last {} % of the job's budget of {} gradients runs as bsp, so "
                         "that the rounds that step the model last hold every worker's "
                         "gradient, none stale",
                         finish_percent_, finish_budget_);
    case Why::kSaid:
      break;
  }
  return reason_;
}

const AutoDecision& DelayPayoff::Gate(const AutoDecision& proposal) {
  if (finishing()) {
    why_ = Why::kFinishing;
    phase_ = Phase::kBsp;
    return HandOut(kBsp);
  }
  bool as_bsp = false;  // or the proposal
  why_ = Why::kSaid;
  const bool proposes = proposal.delays();
  // Whether the proposal delays others than those being measured (bsp's pace, then the
  // trial, measure delaying these workers).
  const bool others = proposes && phase_ != Phase::kDelaying && !SameSlow(proposal, tried_);
  std::vector<WorkerId> was;
  if (others) {
    was = std::exchange(tried_, Slow(proposal));
  } else if (!proposes) {
    tried_.clear();
  }
  if (others && phase_ == Phase::kBsp && !delaying_) {
    // Somebody turned slow, or the proposal now delays others: bsp's pace before that is not
    // what delaying them must beat, or a straggler that appears mid-job would fail its first
    // trial against the faster rounds before it. bsp is measured anew, with them. A proposal
    // that keeps changing whom it delays (workers sharing cores, each slow by turns) is thus
    // never tried: there is no straggler to delay.
    bsp_.Clear();
  }
  if (!proposes) {
    if (phase_ == Phase::kTrial && !Spans(trial_, opt_.measure_rounds)) {
      // The slowness did not last the trial: noise, not a straggler. Counted as a failed
      // trial, or flapping proposals would each start one and no backoff would ever apply.
      const size_t measured = trial_.rounds();
      GiveUp();
      reason_ = fmt::format("the slowdown did not last the trial ({} of {} rounds); the next "
                            "trial after round {}",
                            measured, opt_.measure_rounds, retry_after_);
    } else {
      reason_.clear();
    }
    phase_ = Phase::kBsp;
  } else if (others && phase_ == Phase::kTrial && !Spans(trial_, opt_.measure_rounds)) {
    // The trial measures delaying the workers it started with: cut short, it counts as
    // failed, as does a slowdown that does not last. (One that ran its course is judged.)
    const size_t measured = trial_.rounds();
    GiveUp();
    reason_ = fmt::format("the workers to delay changed during the trial, from {} to {}, after "
                          "{} of {} rounds: noise, not a straggler; the next trial after "
                          "round {}",
                          Names(was), Names(tried_), measured, opt_.measure_rounds,
                          retry_after_);
    as_bsp = true;
  } else if (phase_ == Phase::kBsp) {
    if (rounds_closed_ < retry_after_) {
      why_ = Why::kBackoff;
      as_bsp = true;
    } else if (!Spans(bsp_, opt_.min_baseline_rounds) || !(Pace(bsp_) > 0)) {
      why_ = Why::kMeasuringBsp;
      why_rounds_ = bsp_.rounds();
      why_seconds_ = bsp_.seconds();
      as_bsp = true;
    } else {
      // What delaying must beat: bsp's pace over the faster half of its measurement. A
      // measurement that a slow spell of the machine (startup's page faults, an evaluation
      // beside the job) held down passes a trial that gains nothing; the trial's halves
      // must each gain (below) for the same reason on its side.
      const auto [early, late] = Halves(bsp_);
      bsp_pace_ = std::max(early, late);
      bsp_.Clear();
      trial_.Clear();
      phase_ = Phase::kTrial;
      reason_ = fmt::format("trying it for {} rounds and {:.2f} s at least against bsp's "
                            "{:.4g} gradients/s (the faster half of its measurement)",
                            opt_.measure_rounds, opt_.min_seconds, bsp_pace_);
    }
  } else if (phase_ == Phase::kDelaying) {
    const double pace = Spans(trial_, opt_.measure_rounds) ? Pace(trial_) : bsp_pace_;
    if (pace < bsp_pace_) {
      const std::string worth = WorthOf(trial_);
      const size_t rounds = trial_.rounds();
      const double seconds = trial_.seconds();
      GiveUp();  // the backoff starts afresh: it was reset when the delay was kept
      reason_ = fmt::format("back to bsp: delaying fell to {:.4g} gradients/s ({}) over the "
                            "last {} rounds ({:.2f} s), below bsp's {:.4g}; bsp is measured "
                            "again and the next trial is after round {}",
                            pace, worth, rounds, seconds, bsp_pace_, retry_after_);
      as_bsp = true;
    }
  } else if (phase_ == Phase::kTrial && Spans(trial_, opt_.measure_rounds)) {
    const double pace = Pace(trial_);
    const double gain = pace / bsp_pace_;
    // Each half of the trial must gain on its own too: a pace measured over a second of
    // noisy rounds passes 1.10x by chance now and then, both halves far more rarely. Both
    // halves passing implies the whole, their time-weighted mean.
    const auto [early, late] = Halves(trial_);
    const double first = early / bsp_pace_;
    const double second = late / bsp_pace_;
    const std::string worth = WorthOf(trial_);
    if (gain >= opt_.min_gain && first >= opt_.min_gain && second >= opt_.min_gain) {
      phase_ = Phase::kDelaying;
      backoff_ = opt_.backoff_rounds;
      reason_ = fmt::format("it pays: {:.4g} gradients/s ({}), {:.2f}x bsp's {:.4g} ({:.2f}x "
                            "and {:.2f}x in the trial's halves)",
                            pace, worth, gain, bsp_pace_, first, second);
    } else {
      GiveUp();
      reason_ = fmt::format("back to bsp: delaying gave {:.4g} gradients/s ({}), {:.2f}x "
                            "bsp's {:.4g} ({:.2f}x and {:.2f}x in the trial's halves), under "
                            "the {:.2f}x it must gain in each; the next trial after round {}",
                            pace, worth, gain, bsp_pace_, first, second, opt_.min_gain,
                            retry_after_);
      as_bsp = true;
    }
  }
  return HandOut(as_bsp ? kBsp : proposal);
}

const AutoDecision& DelayPayoff::HandOut(const AutoDecision& out) {
  const bool delaying = out.delays();
  if (delaying != delaying_) settle_ = opt_.settle_rounds;
  delaying_ = delaying;
  return out;
}

}  // namespace dsync::ps
