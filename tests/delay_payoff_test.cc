// dsync:auto's payoff check on synthetic round closes: a real straggler's delay is kept, a
// delay that does not make the job progress faster (workers sharing cores) is given up and
// retried ever more rarely, and stale gradients count for less than fresh ones.
#include "ps/delay_payoff.h"

#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <vector>

namespace dsync::ps {
namespace {

// Workers 1000, 1001, ...: nobody delayed (a decision holds the delayed workers only).
AutoDecision Bsp(int /*workers*/) { return AutoDecision{}; }

// Worker 1003 is left out of the quorum, allowed 4 rounds.
AutoDecision DelayLast(int workers) {
  AutoDecision d = Bsp(workers);
  d.quorum = static_cast<uint32_t>(workers - 1);
  d.allowance.Set(1000 + workers - 1, 4);
  return d;
}

// Worker `w` is left out of the quorum, allowed 4 rounds.
AutoDecision DelayWorker(int workers, WorkerId w) {
  AutoDecision d = Bsp(workers);
  d.quorum = static_cast<uint32_t>(workers - 1);
  d.allowance.Set(w, 4);
  return d;
}

// Worker 1003 allowed 4 rounds and worker 1001 3: the quorum is the other two.
AutoDecision DelayLastAnd1001() {
  AutoDecision d = DelayLast(4);
  d.quorum = 2;
  d.allowance.Set(1001, 3);
  return d;
}

bool Delays(const AutoDecision& d) { return d.quorum != SyncMode::kAll; }

// Judged by rounds alone: most tests here close rounds of 5 to 30 ms, whose windows span less
// than the default min_seconds; the time minimum has tests of its own.
DelayPayoffOptions ByRounds() {
  DelayPayoffOptions o;
  o.min_seconds = 0;
  return o;
}

// Closes rounds one after the other, `seconds` apart, each with `fresh` gradients computed on
// the version before it and, every `stale_every` rounds, one more `staleness` rounds old.
// With `Agree(x)`, two servers report every round that has both: each fresh gradient agrees
// 0.5 with the others, each stale one x * 0.5 (worth x of a fresh one).
class Job {
 public:
  explicit Job(DelayPayoff& payoff) : payoff_(payoff) {}
  void Agree(double worth) { worth_ = worth; }
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
      Report(r);
      ++next_;
    }
  }
  uint64_t round() const { return next_; }

 private:
  void Report(const RoundRecord& r) {
    if (!worth_) return;
    std::vector<double> dots;
    std::vector<uint8_t> measured(r.members.size(), 1);
    bool stale = false;
    for (const RoundMember& m : r.members) {
      stale = stale || m.base != r.round;
      dots.push_back(m.base == r.round ? 0.5 : 0.5 * *worth_);
    }
    if (!stale || r.members.size() < 2) return;
    for (int server = 0; server < 2; ++server) payoff_.Measured(r, dots, measured, 0.5);
  }

  DelayPayoff& payoff_;
  std::optional<double> worth_;
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

// The trial of StartTrial (bsp held to 30 ms by the straggler) delays it: rounds of 10 ms,
// and the delay is kept.
void KeepDelay(DelayPayoff& payoff, Job& job, const DelayPayoffOptions& o) {
  StartTrial(payoff, job, 0.030);
  job.Rounds(o.measure_rounds + o.settle_rounds + 1, 0.010, 3);
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
}

TEST(DelayPayoff, WithoutAStragglerNothingIsDelayed) {
  DelayPayoff payoff(ByRounds());
  Job job(payoff);
  for (int i = 0; i < 50; ++i) {
    EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
    job.Rounds(1, 0.01, 4);
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_EQ(payoff.reason(), "");
}

TEST(DelayPayoff, BspsPaceIsMeasuredBeforeTheFirstTrial) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  job.Rounds(3, 0.03, 4);
  const AutoDecision d = payoff.Gate(DelayLast(4));
  EXPECT_FALSE(Delays(d));
  EXPECT_TRUE(d.allowance.empty());  // bsp: nobody delayed
  EXPECT_NE(payoff.reason().find("measuring bsp's pace"), std::string::npos) << payoff.reason();
  // The rounds before the proposal are not the baseline: the first one after it only marks
  // where the measurement starts, then min_baseline_rounds rounds are measured.
  job.Rounds(o.min_baseline_rounds, 0.03, 4);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("(9 of 10 rounds, 0.27 of 0.00 s)"), std::string::npos)
      << payoff.reason();
  job.Rounds(1, 0.03, 4);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial);
  EXPECT_NE(payoff.reason().find("against bsp's 133.3 gradients/s"), std::string::npos)
      << payoff.reason();
}

TEST(DelayPayoff, AStragglersDelayPaysAndIsKept) {
  DelayPayoffOptions o = ByRounds();
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

// The job's budget nearly spent: a kept delay ends for good, whatever the proposal, and a
// join or leave does not bring it back; the decision keeps every worker, none delayed.
TEST(DelayPayoff, TheLastShareOfTheBudgetRunsAsBsp) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  KeepDelay(payoff, job, o);
  EXPECT_FALSE(payoff.finishing());
  payoff.Finish(10, 9375);
  EXPECT_TRUE(payoff.finishing());
  for (int i = 0; i < 3; ++i) {
    const AutoDecision d = payoff.Gate(DelayLast(4));
    EXPECT_EQ(d, Bsp(4));
    EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
    EXPECT_EQ(payoff.reason(),
              "the last 10 % of the job's budget of 9375 gradients runs as bsp, so that the "
              "rounds that step the model last hold every worker's gradient, none stale");
    // A join or leave, then enough bsp rounds to measure its pace: without Finish, the next
    // Gate would start a trial.
    payoff.MembershipChanged();
    job.Rounds(o.measure_rounds * 2, 0.030, 4);
  }
}

// A trial under way ends too; and with nobody proposed for delay it is plain bsp.
TEST(DelayPayoff, FinishingEndsATrial) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.030);
  job.Rounds(5, 0.010, 3);
  payoff.Finish(25, 1000);
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_EQ(payoff.Gate(Bsp(3)), Bsp(3));
  EXPECT_NE(payoff.reason().find("the last 25 %"), std::string::npos) << payoff.reason();
}

TEST(DelayPayoff, ADelayThatDoesNotPayIsGivenUpAndRetriedEverMoreRarely) {
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoff payoff(ByRounds());
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
  DelayPayoff payoff(ByRounds());
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
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(10, 0.005, 3);
  ExpectAJoinMeasuresBspAgainAndTriesAgain(payoff, job, o);
}

TEST(DelayPayoff, AJoinWhileDelayingMeasuresBspAgain) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  KeepDelay(payoff, job, o);
  ExpectAJoinMeasuresBspAgainAndTriesAgain(payoff, job, o);
}

TEST(DelayPayoff, ADelayKeptIsStillCheckedAndGivenUpOnceItNoLongerPays) {
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoffOptions o = ByRounds();
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
  DelayPayoff payoff(ByRounds());
  Job job(payoff);
  StartTrial(payoff, job, 0.030);
  job.Rounds(5, 0.010, 3);
  EXPECT_FALSE(Delays(payoff.Gate(Bsp(4))));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
}

// The time minimum: rounds of 5 ms, 20 of which (0.1 s) would be timed with much noise on
// shared cores, are measured over min_seconds: bsp's pace first, then the trial.
TEST(DelayPayoff, PacesAreMeasuredOverMinSecondsAtLeast) {
  DelayPayoffOptions o;
  ASSERT_EQ(o.min_seconds, 1.0);
  DelayPayoff payoff(o);
  Job job(payoff);
  ASSERT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(199, 0.005, 4);  // 0.99 s of bsp after the round that marks the start
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("(198 of 10 rounds, 0.99 of 1.00 s)"), std::string::npos)
      << payoff.reason();
  job.Rounds(3, 0.005, 4);
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("trying it for 20 rounds and 1.00 s at least against bsp's "
                                 "800 gradients/s"),
            std::string::npos)
      << payoff.reason();
  // Twice the rounds, 3 fresh gradients each: 1.5x. Judged only once a second has passed.
  for (int i = 0; i < 150; ++i) {
    job.Rounds(1, 0.0025, 3);
    ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
    ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kTrial) << "round " << job.round();
  }
  for (int i = 0; i < 300 && payoff.phase() == DelayPayoff::Phase::kTrial; ++i) {
    job.Rounds(1, 0.0025, 3);
    ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  EXPECT_NE(payoff.reason().find("1.50x bsp's 800"), std::string::npos) << payoff.reason();
}

// A trial whose pace comes from a lucky spell: 10 rounds at 1.5x bsp's pace, then 10 at 1.0x,
// 1.2x over the whole. Split by time (at 62.5 of its 125 ms), its halves gain 1.38x and
// 1.00x. Each half must gain on its own: it fails, and says so.
TEST(DelayPayoff, EachHalfOfTheTrialMustGain) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);  // 400 gradients/s
  job.Rounds(o.settle_rounds, 0.005, 3);
  job.Rounds(11, 0.005, 3);  // the first only marks the start: 10 rounds of 600/s
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(10, 0.0075, 3);  // 400/s
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("back to bsp: delaying gave 480 gradients/s (no stale "
                                 "gradients), 1.20x bsp's 400 (1.38x and 1.00x in the trial's "
                                 "halves), under the 1.10x it must gain in each"),
            std::string::npos)
      << payoff.reason();
}

// bsp's pace measured through a slow spell of the machine: 4 rounds at a quarter of its pace
// (128 gradients/s), then 16 at its own (512/s), 320/s over the whole; its halves (by time)
// are the spell and the rest. A trial at 512/s, bsp's own pace, would gain 1.6x against the
// whole in each half; against the faster half of the measurement it gains nothing, and fails.
TEST(DelayPayoff, ASlowSpellInBspsMeasurementPassesNoTrial) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  ASSERT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  job.Rounds(1, 1.0 / 32, 4);  // marks the start
  job.Rounds(4, 1.0 / 32, 4);
  job.Rounds(16, 1.0 / 128, 4);
  ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("against bsp's 512 gradients/s (the faster half of its "
                                 "measurement)"),
            std::string::npos)
      << payoff.reason();
  job.Rounds(o.settle_rounds, 3.0 / 512, 3);
  job.Rounds(21, 3.0 / 512, 3);  // 512/s
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("back to bsp: delaying gave 512 gradients/s (no stale "
                                 "gradients), 1.00x bsp's 512"),
            std::string::npos)
      << payoff.reason();
}

// Proposals that change every 50 rounds of 5 ms, each lasting less than bsp's pace takes to
// measure (1 s), get no trial: the job stays bsp, and says it is measuring.
void ExpectNeverTried(const std::function<AutoDecision(int period)>& proposal) {
  DelayPayoff payoff({});
  Job job(payoff);
  for (int i = 0; i < 2000; ++i) {
    job.Rounds(1, 0.005, 4);
    ASSERT_FALSE(Delays(payoff.Gate(proposal(i / 50)))) << i;
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  (void)payoff.Gate(DelayLast(4));
  EXPECT_NE(payoff.reason().find("measuring bsp's pace"), std::string::npos) << payoff.reason();
}

// A straggler whose slowness comes and goes.
TEST(DelayPayoff, AFlappingStragglerIsNeverTried) {
  ExpectNeverTried([](int period) { return period % 2 ? Bsp(4) : DelayLast(4); });
}

// Workers sharing cores look slow by turns: the proposal delays worker 1003, then 1002,
// then 1003 again. There is no straggler to delay.
TEST(DelayPayoff, AProposalThatKeepsChangingWhomItDelaysIsNeverTried) {
  ExpectNeverTried([](int period) { return DelayWorker(4, period % 2 ? 1002 : 1003); });
}

// A trial measures delaying the workers it started with: once the proposal delays others,
// it ends as failed, says so, and backs off like any failed trial.
TEST(DelayPayoff, ATrialWhoseWorkersChangeIsCutShort) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);
  job.Rounds(5, 0.004, 3);
  EXPECT_TRUE(Delays(payoff.Gate(DelayLast(4))));  // still worker 1003
  const AutoDecision both = DelayLastAnd1001();
  EXPECT_FALSE(Delays(payoff.Gate(both)));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_NE(payoff.reason().find("the workers to delay changed during the trial, from 1003 to "
                                 "1001, 1003, after 2 of 20 rounds: noise, not a straggler; "
                                 "the next trial after round"),
            std::string::npos)
      << payoff.reason();
  job.Rounds(1, 0.010, 4);
  EXPECT_FALSE(Delays(payoff.Gate(both)));
  EXPECT_NE(payoff.reason().find("delaying did not pay in the last trial"), std::string::npos)
      << payoff.reason();
}

// A trial that has run its course is judged, whoever the proposal delays by then: all its
// rounds delayed the workers it started with.
TEST(DelayPayoff, ATrialThatRanItsCourseIsJudgedThoughItsWorkersChange) {
  DelayPayoffOptions o = ByRounds();
  DelayPayoff payoff(o);
  Job job(payoff);
  StartTrial(payoff, job, 0.010);  // 400 gradients/s
  job.Rounds(o.settle_rounds, 0.005, 3);
  job.Rounds(o.measure_rounds + 1, 0.005, 3);  // 600/s
  const AutoDecision both = DelayLastAnd1001();
  EXPECT_TRUE(Delays(payoff.Gate(both)));
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  EXPECT_NE(payoff.reason().find("it pays: 600 gradients/s"), std::string::npos)
      << payoff.reason();
}

// The straggler's gradients agree with the fresh ones as well as fresh ones do (its delay
// costs nothing). Against bsp's 4 gradients per 12.5 ms (320/s), rounds of 9 ms with 3 fresh
// gradients and the straggler's, 3 rounds stale, every third round give 3.33 per 9 ms at its
// measured worth of 1 (1.16x: it pays), 3.08 per 9 ms at 1/(1+s) (1.07x: it would not).
// The trial lasts 90 rounds: 30 with a stale gradient, enough to measure its worth.
TEST(DelayPayoff, AStragglerWhoseGradientsCostNothingPasses) {
  for (const bool measured : {false, true}) {
    DelayPayoffOptions o = ByRounds();
    o.measure_rounds = 90;
    DelayPayoff payoff(o);
    Job job(payoff);
    if (measured) job.Agree(1.0);
    StartTrial(payoff, job, 0.0125);
    for (int i = 0; i < 150 && payoff.phase() == DelayPayoff::Phase::kTrial; ++i) {
      job.Rounds(1, 0.009, 3, 3, 3);
      (void)payoff.Gate(DelayLast(4));
    }
    if (measured) {
      EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying) << payoff.reason();
      EXPECT_NE(payoff.reason().find("gradients/s (stale ones worth 1.00 at staleness 3 "
                                     "(measured over 29 rounds)), 1.16x bsp's 320"),
                std::string::npos)
          << payoff.reason();
      EXPECT_TRUE(payoff.worth().Measured(3));
      EXPECT_DOUBLE_EQ(payoff.worth().Worth(3), 1.0);
    } else {
      EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp) << payoff.reason();
      EXPECT_NE(payoff.reason().find("gradients/s (stale ones worth 0.25 at staleness 3 (not "
                                     "measured yet)), 1.07x bsp's 320"),
                std::string::npos)
          << payoff.reason();
    }
  }
}

// The straggler's gradients point against where the model goes (worth -0.5): a delay that
// the 1/(1+s) discount would keep (2x the rounds, 1.2x bsp's pace with a quarter each) is
// given up, and the reason says what they were measured to be worth.
TEST(DelayPayoff, AStragglerWhoseGradientsCostEverythingFails) {
  for (const bool measured : {false, true}) {
    DelayPayoff payoff(ByRounds());
    Job job(payoff);
    if (measured) job.Agree(-0.5);
    StartTrial(payoff, job, 0.010);
    // 2 fresh per 5 ms and a stale one in every round: 2 x (2 + w) per 10 ms against 4.
    for (int i = 0; i < 60 && payoff.phase() != DelayPayoff::Phase::kBsp; ++i) {
      job.Rounds(1, 0.005, 2, 1, 3);
      (void)payoff.Gate(DelayLast(4));
    }
    if (!measured) {
      EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying) << payoff.reason();
      continue;
    }
    // The trial may end before 24 rounds of reports (then at 1/(1+s), it passes), but the
    // delay is given up once they are in.
    EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
    EXPECT_NE(payoff.reason().find("back to bsp: delaying"), std::string::npos)
        << payoff.reason();
    EXPECT_NE(payoff.reason().find("300 gradients/s (stale ones worth -0.50 at staleness 3 "
                                   "(measured over"),
              std::string::npos)
        << payoff.reason();
  }
}

// A delay kept while the straggler's gradients were worth much is given up once they are
// measured to be worth little: the worth is measured all along, not only in the trial.
TEST(DelayPayoff, ADelayKeptIsGivenUpOnceStaleGradientsStopPaying) {
  DelayPayoff payoff(ByRounds());
  Job job(payoff);
  job.Agree(1.0);
  StartTrial(payoff, job, 0.010);
  // 2 fresh and 1 stale per 5 ms: 600 gradients/s at worth 1, against bsp's 400.
  for (int i = 0; i < 60; ++i) {
    job.Rounds(1, 0.005, 2, 1, 3);
    ASSERT_TRUE(Delays(payoff.Gate(DelayLast(4)))) << payoff.reason();
  }
  ASSERT_EQ(payoff.phase(), DelayPayoff::Phase::kDelaying);
  // The landscape changes (a larger learning rate, say): they are worth -1 from now on. Once
  // the old reports have faded enough, the pace falls under bsp's and the delay ends.
  job.Agree(-1.0);
  int rounds = 0;
  while (Delays(payoff.Gate(DelayLast(4)))) {
    job.Rounds(1, 0.005, 2, 1, 3);
    ASSERT_LE(++rounds, 1000) << payoff.reason();
  }
  EXPECT_EQ(payoff.phase(), DelayPayoff::Phase::kBsp);
  EXPECT_NE(payoff.reason().find("back to bsp: delaying fell to"), std::string::npos)
      << payoff.reason();
  EXPECT_LT(payoff.worth().Worth(3), 0.0);
}

// The staleness policy's weight scales what a stale gradient counts: under inverse, a
// gradient 3 rounds stale is applied at a quarter, so it counts a quarter of its worth.
TEST(DelayPayoff, ThePolicysWeightScalesTheWorth) {
  StalenessPolicy inverse;
  inverse.kind = StalenessKind::kInverse;
  DelayPayoff payoff(ByRounds(), inverse);
  Job job(payoff);
  job.Agree(1.0);
  StartTrial(payoff, job, 0.010);
  for (int i = 0; i < 30; ++i) job.Rounds(1, 0.005, 1, 1, 3);  // 2 x (1 + 1/4) per 10 ms
  EXPECT_FALSE(Delays(payoff.Gate(DelayLast(4))));
  EXPECT_NE(payoff.reason().find("gave 250 gradients/s"), std::string::npos) << payoff.reason();
}

}  // namespace
}  // namespace dsync::ps
