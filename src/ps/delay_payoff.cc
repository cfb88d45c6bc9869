#include "ps/delay_payoff.h"

#include <fmt/format.h>

#include <algorithm>

namespace dsync::ps {
namespace {

bool Delays(const AutoDecision& d) {
  if (d.quorum != SyncMode::kAll) return true;
  return std::any_of(d.allowance.begin(), d.allowance.end(),
                     [](const auto& entry) { return entry.second > 0; });
}

AutoDecision AsBsp(const AutoDecision& d) {
  AutoDecision bsp;
  for (const auto& [w, allowance] : d.allowance) bsp.allowance[w] = 0;
  return bsp;
}

}  // namespace

DelayPayoff::DelayPayoff(DelayPayoffOptions options)
    : opt_(options) {
  opt_.measure_rounds = std::max<uint32_t>(opt_.measure_rounds, 2);
  opt_.backoff_rounds = std::max<uint32_t>(opt_.backoff_rounds, 1);
  opt_.max_backoff_rounds = std::max(opt_.max_backoff_rounds, opt_.backoff_rounds);
  backoff_ = opt_.backoff_rounds;
  opt_.min_baseline_rounds = std::clamp<uint32_t>(opt_.min_baseline_rounds, 2, opt_.measure_rounds);
}

double DelayPayoff::Pace(const std::deque<Sample>& samples) {
  if (samples.size() < 2) return 0;
  const double seconds = samples.back().at - samples.front().at;
  if (!(seconds > 0)) return 0;
  double progress = 0;
  for (size_t i = 1; i < samples.size(); ++i) progress += samples[i].progress;
  return progress / seconds;
}

void DelayPayoff::RoundClosed(double now, const RoundRecord& round) {
  ++rounds_closed_;
  if (settle_ > 0) {
    --settle_;
    return;
  }
  double progress = 0;
  for (const RoundMember& m : round.members) {
    progress += 1.0 / (1.0 + static_cast<double>(Staleness(round.round, m.base)));
  }
  // Delaying, the window keeps sliding after the trial: a delay kept is still checked.
  std::deque<Sample>* into = delaying_ ? &trial_ : &bsp_;
  into->push_back({now, progress});
  if (into->size() > opt_.measure_rounds + 1) into->pop_front();
}

void DelayPayoff::MembershipChanged() {
  bsp_.clear();
  trial_.clear();
  settle_ = opt_.settle_rounds;
  // The bsp pace a trial or a kept delay is compared with was measured with other workers:
  // measure bsp again, then try again; what failed with the old workers says nothing of the
  // new ones, so no backoff either.
  phase_ = Phase::kBsp;
  retry_after_ = 0;
  backoff_ = opt_.backoff_rounds;
}

void DelayPayoff::GiveUp() {
  phase_ = Phase::kBsp;
  retry_after_ = rounds_closed_ + backoff_;
  backoff_ = static_cast<uint32_t>(
      std::min<uint64_t>(uint64_t{backoff_} * 2, opt_.max_backoff_rounds));
  trial_.clear();
}

AutoDecision DelayPayoff::Gate(const AutoDecision& proposal) {
  AutoDecision out = proposal;
  const bool proposes = Delays(proposal);
  if (proposes && !proposing_ && phase_ == Phase::kBsp && !delaying_) {
    // Somebody turned slow: bsp's pace before that is not what delaying must beat, or a
    // straggler that appears mid-job would fail its first trial against the faster rounds
    // before it. bsp is measured anew, with the straggler.
    bsp_.clear();
  }
  proposing_ = proposes;
  if (!proposes) {
    if (phase_ == Phase::kTrial && trial_.size() < opt_.measure_rounds + 1u) {
      // The slowness did not last the trial: noise, not a straggler. Counted as a failed
      // trial, or flapping proposals would each start one and no backoff would ever apply.
      const size_t measured = trial_.empty() ? 0 : trial_.size() - 1;
      GiveUp();
      reason_ = fmt::format("the slowdown did not last the trial ({} of {} rounds); the next "
                            "trial after round {}",
                            measured, opt_.measure_rounds, retry_after_);
    } else {
      reason_.clear();
    }
    phase_ = Phase::kBsp;
  } else if (phase_ == Phase::kBsp) {
    const double pace = Pace(bsp_);
    if (rounds_closed_ < retry_after_) {
      reason_ = fmt::format("delaying did not pay in the last trial; the next one after round {}",
                            retry_after_);
      out = AsBsp(proposal);
    } else if (bsp_.size() < opt_.min_baseline_rounds + 1u || !(pace > 0)) {
      reason_ = fmt::format("measuring bsp's pace before trying to delay ({} of {} rounds)",
                            bsp_.size() > 0 ? bsp_.size() - 1 : 0, opt_.min_baseline_rounds);
      out = AsBsp(proposal);
    } else {
      bsp_pace_ = pace;
      bsp_.clear();
      trial_.clear();
      phase_ = Phase::kTrial;
      reason_ = fmt::format("trying it for {} rounds against bsp's {:.4g} gradients/s",
                            opt_.measure_rounds, bsp_pace_);
    }
  } else if (phase_ == Phase::kDelaying) {
    const double pace = trial_.size() >= opt_.measure_rounds + 1u ? Pace(trial_) : bsp_pace_;
    if (pace < bsp_pace_) {
      GiveUp();  // the backoff starts afresh: it was reset when the delay was kept
      reason_ = fmt::format("back to bsp: delaying fell to {:.4g} gradients/s (stale ones "
                            "discounted) over the last {} rounds, below bsp's {:.4g}; bsp is "
                            "measured again and the next trial is after round {}",
                            pace, opt_.measure_rounds, bsp_pace_, retry_after_);
      out = AsBsp(proposal);
    }
  } else if (phase_ == Phase::kTrial && trial_.size() >= opt_.measure_rounds + 1u) {
    const double pace = Pace(trial_);
    const double gain = pace / bsp_pace_;
    if (gain >= opt_.min_gain) {
      phase_ = Phase::kDelaying;
      backoff_ = opt_.backoff_rounds;
      reason_ = fmt::format("it pays: {:.4g} gradients/s (stale ones discounted), {:.2f}x "
                            "bsp's {:.4g}",
                            pace, gain, bsp_pace_);
      trial_.pop_front();  // the window slides on: the delay kept stays checked
    } else {
      GiveUp();
      reason_ = fmt::format("back to bsp: delaying gave {:.4g} gradients/s (stale ones "
                            "discounted), {:.2f}x bsp's {:.4g}, under the {:.2f}x it must "
                            "gain; the next trial after round {}",
                            pace, gain, bsp_pace_, opt_.min_gain, retry_after_);
      out = AsBsp(proposal);
    }
  }
  const bool delaying = Delays(out);
  if (delaying != delaying_) settle_ = opt_.settle_rounds;
  delaying_ = delaying;
  return out;
}

}  // namespace dsync::ps
