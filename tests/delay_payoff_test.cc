// dsync:auto's payoff check on synthetic round closes: a real straggler's delay is kept, a
// delay that does not make the job progress faster (workers sharing cores) is given up and
// retried ever more rarely, and stale gradients count for less than fresh ones.
#include "ps/delay_payoff.h"

#include <gtest/gtest.h>

#include <vector>

namespace dsync::ps {
namespace {

AutoDecision Bsp(int workers) {
  AutoDecision d;
  for (int i = 0; i < workers; ++i) d.allowance[1000 + i] = 0;
  return d;
}

// Worker 1003 is left out of the quorum, allowed 4 rounds.
AutoDecision DelayLast(int workers) {
  AutoDecision d = Bsp(workers);
  d.quorum = static_cast<uint32_t>(workers - 1);
  d.allowance[1000 + workers - 1] = 4;
  return d;
}

bool Delays(const AutoDecision& d) { return d.quorum != SyncMode::kAll; }

// Closes rounds one after the other, `seconds` apart, each with `fresh` gradients computed on
// the version before it and, every `stale_every` rounds, one more `staleness` rounds old.
class Job {
 public:
  explicit Job(DelayPayoff& payoff) : payoff_(payoff) {}
  void Rounds(int n, double seconds, int fresh, int stale_every = 0, uint32_t staleness = 0) {
    for (int i = 0; i < n; ++i) {
      RoundRecord r;
      r.round = next_;
      for (int k = 0; k < fresh; ++k) r.members.push_back({WorkerId(1000 + k), 0, next_});
      if (stale_every > 0 && next_ % stale_every == 0 && next_ >= staleness) {
        r.members.push_back({1003, 0, next_ - staleness});
      }
      now_ += seconds;
      payoff_.RoundClosed(now_, r);
      ++next_;
    }
  }
  uint64_t round() const { return next_; }

 private:
  DelayPayoff& payoff_;
  Round next_ = 0;
  double now_ = 100.0;
};

// Worker 1003 is proposed for delay; 20 rounds of bsp, one per `seconds` with 4 fresh
// gradients, measure bsp's pace; then the trial starts.
void StartTrial(DelayPayoff& payoff, Job& job, double seconds) {
  ASSERT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(20, seconds, 4);
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

TEST(DelayPayoff, WithoutAStragglerNothingIsDelayed) {
  DelayPayoff payoff({});
  Job job(payoff);
  for (int i = 0; i < 50; ++i) {
    EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
    job.Rounds(1, 0.01, 4);
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_EQ(payoff.reason(), "");
}

TEST(DelayPayoff, BspsPaceIsMeasuredBeforeTheFirstTrial) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  job.Rounds(3, 0.03, 4);
  const AutoDecision d = payoff.Gate(DelayLast(4));
  EXPECT_FALSE(Delays(d));
  EXPECT_EQ(d.allowance.size(), 4u);
  EXPECT_NE(payoff.reason().find("measuring bsp's pace"), std::string::npos) << payoff.reason();
  // The rounds before the proposal are not the baseline: the first one after it only marks
  // where the measurement starts, then min_baseline_rounds rounds are measured.
  job.Rounds(o.min_baseline_rounds, 0.03, 4);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("(9 of 10 rounds)"), std::string::npos) << payoff.reason();
  job.Rounds(1, 0.03, 4);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
  EXPECT_NE(payoff.reason().find("against bsp's 133.3 gradients/s"), std::string::npos)
      << payoff.reason();
}

TEST(DelayPayoff, AStragglersDelayPaysAndIsKept) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  // bsp: every round waits for the 3x slower worker, 30 ms.
  StartTrial(payoff, job, 0.030);
  // Delayed: a round per 10 ms from the three others, the straggler's gradient in one round of
  // three, 3 rounds stale (worth a quarter).
  for (int i = 0; i < 40; ++i) {
    job.Rounds(1, 0.010, 3, 3, 3);
    EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4)))) << "round " << job.round();
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  EXPECT_NE(payoff.reason().find("it pays"), std::string::npos) << payoff.reason();
  EXPECT_NE(payoff.reason().find("2.3"), std::string::npos) << payoff.reason();  // 9.25 per 30 ms
}

TEST(DelayPayoff, ADelayThatDoesNotPayIsGivenUpAndRetriedEverMoreRarely) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  ASSERT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(20, 0.010, 4);  // bsp: 400 gradients/s
  // Shared cores: without the "slow" worker rounds close 25 % sooner with 3 gradients, and
  // its gradients come late: no faster progress.
  std::vector<uint64_t> trials;
  bool was = false;
  for (int i = 0; i < 400; ++i) {
    const bool delays = Delays(payoff.Gate(DelayLast(4)));
    if (delays && !was) trials.push_back(job.round());
    was = delays;
    if (delays) {
      job.Rounds(1, 0.0075, 3, 4, 2);
    } else {
      job.Rounds(1, 0.010, 4);
    }
  }
  // Trials: at once, then after 50 bsp rounds, then 100, then 200 (each plus the trial and
  // its settling rounds).
  ASSERT_GE(trials.size(), 3u);
  ASSERT_LE(trials.size(), 4u);
  EXPECT_EQ(trials[0], 20u);
  const uint64_t gap1 = trials[1] - trials[0];
  const uint64_t gap2 = trials[2] - trials[1];
  EXPECT_GE(gap1, 50u + o.measure_rounds);
  EXPECT_LE(gap1, 50u + o.measure_rounds + 2 * o.settle_rounds + 2);
  EXPECT_GE(gap2, 100u + o.measure_rounds);
  EXPECT_LE(gap2, 100u + o.measure_rounds + 2 * o.settle_rounds + 2);
  // Most rounds ran as bsp.
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_NE(payoff.reason().find("next one after round"), std::string::npos) << payoff.reason();
}

TEST(DelayPayoff, AFailedTrialSaysWhatItMeasured) {
  DelayPayoff payoff({});
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(30, 0.0075, 3);  // 400 gradients/s: 1.00x
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("back to bsp: delaying gave 400 gradients/s"), std::string::npos)
      << payoff.reason();
  EXPECT_NE(payoff.reason().find("1.00x bsp's 400"), std::string::npos) << payoff.reason();
  EXPECT_NE(payoff.reason().find("under the 1.10x"), std::string::npos) << payoff.reason();
}

TEST(DelayPayoff, StaleGradientsCountForLess) {
  DelayPayoff payoff({});
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  // Twice the rounds per second, but every round carries one fresh gradient and one 3 rounds
  // stale: 2 x (1 + 1/4) = 2.5 fresh-gradient equivalents per 10 ms against bsp's 4.
  for (int i = 0; i < 30; ++i) job.Rounds(1, 0.005, 1, 1, 3);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("gave 250 gradients/s"), std::string::npos) << payoff.reason();
}

// A fifth worker joins: the paces measured with four are not comparable any more; bsp is
// measured again first, then a new trial decides.
void ExpectAJoinMeasuresBspAgainAndTriesAgain(DelayPayoff& payoff, Job& job,
                                              const DelayPayoffOptions& o) {
  payoff.MembershipChanged();
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(5))));
  EXPECT_NE(payoff.reason().find("measuring bsp's pace"), std::string::npos) << payoff.reason();
  job.Rounds(o.settle_rounds + o.min_baseline_rounds + 1, 0.030, 5);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(5))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

TEST(DelayPayoff, AJoinDuringATrialMeasuresBspAgain) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(10, 0.005, 3);
  ExpectAJoinMeasuresBspAgainAndTriesAgain(payoff, job, o);
}

TEST(DelayPayoff, AJoinWhileDelayingMeasuresBspAgain) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.030);
  job.Rounds(o.measure_rounds + o.settle_rounds + 1, 0.010, 3);
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  ExpectAJoinMeasuresBspAgainAndTriesAgain(payoff, job, o);
}

TEST(DelayPayoff, ADelayKeptIsStillCheckedAndGivenUpOnceItNoLongerPays) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.030);  // bsp held by the straggler: 133 gradients/s
  // The trial pays (3 fresh per 10 ms), and goes on paying for a long while.
  for (int i = 0; i < 200; ++i) {
    job.Rounds(1, 0.010, 3);
    ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4)))) << "round " << job.round();
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  // Then the rounds slow down (the machine got busier): 3 per 40 ms, 75 gradients/s, below
  // the 133 of bsp. Within a window's worth of rounds the job is back to bsp.
  int rounds = 0;
  while (Delays(payoff.Gate(DelayLast(4)))) {
    job.Rounds(1, 0.040, 3);
    ASSERT_LE(++rounds, static_cast<int>(o.measure_rounds) + 1) << payoff.reason();
  }
  EXPECT_GE(rounds, 5);  // a few slow rounds in a window of fast ones are not enough
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_NE(payoff.reason().find("back to bsp: delaying fell to"), std::string::npos)
      << payoff.reason();
  EXPECT_NE(payoff.reason().find("below bsp's 133.3"), std::string::npos) << payoff.reason();
  // bsp is measured anew before the next trial, which comes after the backoff.
  job.Rounds(o.backoff_rounds - 1, 0.030, 4);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(2, 0.030, 4);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

TEST(DelayPayoff, ATrialCutShortByNoiseCountsAsFailed) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(o.settle_rounds + 5, 0.008, 3);
  // The "straggler" is fast again before the trial could tell: noise.
  EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
  EXPECT_NE(payoff.reason().find("did not last the trial (4 of 20 rounds)"), std::string::npos)
      << payoff.reason();
  // Flapping back at once starts no new trial before the backoff, nor while it goes on.
  for (uint32_t i = 0; i < 2 * o.backoff_rounds; ++i) {
    job.Rounds(1, 0.010, 4);
    ASSERT_FALSE(Delays(payoff.Gate(i % 2 ? Bsp(4) : DelayLast(4)))) << i;
  }
  // A slowdown that lasts: bsp measured with it, then a trial.
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("measuring bsp's pace"), std::string::npos) << payoff.reason();
  job.Rounds(o.min_baseline_rounds + 1, 0.010, 4);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

TEST(DelayPayoff, ATrialThatRanItsCourseIsNotCountedAsCutShort) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(o.settle_rounds + o.measure_rounds + 1, 0.008, 3);
  // The trial is complete when the straggler recovers: no backoff.
  EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
  EXPECT_EQ(payoff.reason(), "");
  job.Rounds(o.settle_rounds + o.min_baseline_rounds + 1, 0.010, 4);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));  // a new slowdown: bsp measured with it
  job.Rounds(o.min_baseline_rounds + 1, 0.030, 4);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

// A worker turns 3x slower in the middle of a job: its first trial is measured against bsp
// with it (30 ms rounds), not against the 10 ms rounds before, and passes.
TEST(DelayPayoff, AStragglerThatAppearsMidJobPassesItsFirstTrial) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  for (int i = 0; i < 100; ++i) {
    job.Rounds(1, 0.010, 4);
    ASSERT_FALSE(Delays(payoff.Gate(Bsp(4))));
  }
  job.Rounds(4, 0.030, 4);  // the policy needs a few slow iterations to see it
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  for (uint32_t i = 0; i <= o.min_baseline_rounds; ++i) {
    job.Rounds(1, 0.030, 4);
    (void)payoff.Gate(DelayLast(4));
  }
  ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial) << payoff.reason();
  EXPECT_NE(payoff.reason().find("against bsp's 133.3"), std::string::npos) << payoff.reason();
  // Delayed: 3 fresh per 10 ms and the straggler's a quarter every third round.
  for (uint32_t i = 0; i < o.settle_rounds + o.measure_rounds + 1; ++i) {
    job.Rounds(1, 0.010, 3, 3, 3);
    ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4)))) << payoff.reason();
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
}

TEST(DelayPayoff, AMembershipChangeForgetsTheBackoff) {
  DelayPayoffOptions o;
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(o.settle_rounds + o.measure_rounds + 1, 0.0075, 3);  // 1.00x: fails
  ASSERT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  ASSERT_NE(payoff.reason().find("next trial after round"), std::string::npos);
  // A slow worker joins: what failed with the old workers says nothing of the new ones.
  payoff.MembershipChanged();
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(5))));
  job.Rounds(o.settle_rounds + o.min_baseline_rounds + 1, 0.030, 5);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(5))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
}

TEST(DelayPayoff, AStragglerThatRecoversEndsTheDelayAtOnce) {
  DelayPayoff payoff({});
  Job job(payoff);
  StartTrial(payoff, job, 0.030);
  job.Rounds(5, 0.010, 3);
  EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
}

}  // namespace
}  // namespace dsync::ps
