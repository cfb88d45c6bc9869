// dsync:auto: the policy alone on synthetic iteration times (the bounds it chooses respect
// the maximum and follow changes in the deployment), then the policy driving the round rule
// through a simulated job in which one worker slows down and recovers.
#include "ps/auto_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "ps/round_rule.h"

namespace dsync::ps {
namespace {

// Feeds `rounds` iterations per worker at the given times (seconds), then decides.
bool Feed(AutoPolicy& p, const std::map<WorkerId, double>& times, int rounds = 5) {
  for (int i = 0; i < rounds; ++i) {
    for (const auto& [w, t] : times) p.Observe(w, t);
  }
  return p.Decide();
}

AutoPolicy Policy(uint32_t max_bound = 4) {
  AutoPolicyOptions o;
  o.max_bound = max_bound;
  return AutoPolicy(o);
}

TEST(AutoPolicy, BalancedWorkersAreBulkSynchronous) {
  AutoPolicy p = Policy();
  for (WorkerId w = 1000; w < 1004; ++w) p.Join(w);
  Feed(p, {{1000, 0.010}, {1001, 0.011}, {1002, 0.0095}, {1003, 0.0105}});
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  EXPECT_TRUE(p.decision().allowance.empty());  // nobody delayed
  for (WorkerId w = 1000; w < 1004; ++w) EXPECT_EQ(p.decision().allowance.at(w), 0u) << w;
  EXPECT_NE(p.Describe().find("as bsp"), std::string::npos) << p.Describe();
}

TEST(AutoPolicy, UnmeasuredWorkersAreWaitedFor) {
  AutoPolicy p = Policy();
  p.Join(1000);
  p.Join(1001);
  p.Observe(1001, 0.5);  // one sample is not enough to call anyone slow
  p.Decide();
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  EXPECT_EQ(p.decision().allowance.at(1001), 0u);
}

TEST(AutoPolicy, AStragglerLeavesTheQuorumWithAnAllowanceForItsRatio) {
  AutoPolicy p = Policy(8);
  for (WorkerId w = 1000; w < 1004; ++w) p.Join(w);
  EXPECT_TRUE(Feed(p, {{1000, 0.010}, {1001, 0.010}, {1002, 0.010}, {1003, 0.030}}));
  EXPECT_EQ(p.decision().quorum, 3u);
  EXPECT_EQ(p.decision().allowance.at(1003), 4u);  // ceil(3.0) + 1 round of margin
  for (WorkerId w = 1000; w < 1003; ++w) EXPECT_EQ(p.decision().allowance.at(w), 0u);
  EXPECT_DOUBLE_EQ(p.reference(), 0.010);
  EXPECT_NE(p.Describe().find("worker 1003 allowed 4"), std::string::npos) << p.Describe();
}

TEST(AutoPolicy, AllowancesNeverExceedTheMaximum) {
  for (uint32_t max : {1u, 2u, 4u}) {
    AutoPolicy p = Policy(max);
    for (WorkerId w = 1000; w < 1005; ++w) p.Join(w);
    Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, 0.05}, {1004, 1.0}});
    EXPECT_EQ(p.decision().quorum, 3u);
    for (const auto& [w, allow] : p.decision().allowance) EXPECT_LE(allow, max) << w;
    EXPECT_EQ(p.decision().allowance.at(1004), max);
  }
}

TEST(AutoPolicy, ReactsToASlowdownAndToTheRecovery) {
  AutoPolicy p = Policy();
  for (WorkerId w = 1000; w < 1004; ++w) p.Join(w);
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, 0.01}});
  ASSERT_EQ(p.decision().quorum, SyncMode::kAll);
  // Worker 1002 becomes 3x slower: within a few of its iterations it is a straggler.
  int iterations = 0;
  while (p.decision().quorum == SyncMode::kAll && iterations < 10) {
    Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.03}, {1003, 0.01}}, 1);
    ++iterations;
  }
  EXPECT_LE(iterations, 4);
  EXPECT_EQ(p.decision().quorum, 3u);
  EXPECT_GT(p.decision().allowance.at(1002), 0u);
  // It recovers: fast again, and the job goes back to bsp.
  iterations = 0;
  while (p.decision().quorum != SyncMode::kAll && iterations < 20) {
    Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, 0.01}}, 1);
    ++iterations;
  }
  EXPECT_LE(iterations, 8);
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  EXPECT_EQ(p.decision().allowance.at(1002), 0u);
}

TEST(AutoPolicy, HysteresisKeepsANoisyWorkerFromFlapping) {
  AutoPolicy p = Policy();
  for (WorkerId w = 1000; w < 1003; ++w) p.Join(w);
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.02}});
  ASSERT_EQ(p.decision().quorum, 2u);
  // 1.3-1.45x: below the straggler threshold but above the recovery one: no change.
  int changes = 0;
  for (int i = 0; i < 40; ++i) {
    const double t = i % 2 ? 0.0130 : 0.0145;
    changes += Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, t}}, 1) ? 1 : 0;
  }
  EXPECT_EQ(p.decision().quorum, 2u);
  EXPECT_LE(changes, 1);  // at most the allowance settling from 3 to 2 rounds
}

TEST(AutoPolicy, OneSlowIterationChangesNothingAndAllowancesDoNotFlap) {
  AutoPolicy p = Policy(8);
  for (WorkerId w = 1000; w < 1004; ++w) p.Join(w);
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, 0.01}}, 7);
  ASSERT_EQ(p.decision().quorum, SyncMode::kAll);
  // A page-fault storm: one iteration 10x slower. The median of the window ignores it.
  p.Observe(1001, 0.1);
  EXPECT_FALSE(p.Decide());
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  // A real straggler whose ratio wanders between 2.9 and 3.1: the allowance rises with it
  // but does not step down by a single round.
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, 0.031}}, 7);
  ASSERT_EQ(p.decision().quorum, 3u);
  const uint32_t allowed = p.decision().allowance.at(1003);
  EXPECT_EQ(allowed, 5u);  // ceil(3.1) + 1
  int changes = 0;
  for (int i = 0; i < 30; ++i) {
    changes += Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.01}, {1003, i % 2 ? 0.029 : 0.031}},
                    1)
                   ? 1
                   : 0;
  }
  EXPECT_EQ(changes, 0);
  EXPECT_EQ(p.decision().allowance.at(1003), allowed);
}

TEST(AutoPolicy, MembershipChangesAreReDecided) {
  AutoPolicy p = Policy();
  for (WorkerId w = 1000; w < 1003; ++w) p.Join(w);
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1002, 0.04}});
  ASSERT_EQ(p.decision().quorum, 2u);
  // The straggler leaves: everyone left is fast.
  p.Leave(1002);
  EXPECT_TRUE(p.Decide());
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  EXPECT_FALSE(p.decision().allowance.contains(1002));
  // A joiner is waited for until it has been measured, then judged like everyone else. Its
  // joining changes no decision: nobody is delayed, and the rule waits for every live worker.
  p.Join(1003);
  EXPECT_FALSE(p.Decide());
  EXPECT_EQ(p.decision().allowance.at(1003), 0u);
  Feed(p, {{1000, 0.01}, {1001, 0.01}, {1003, 0.025}});
  EXPECT_EQ(p.decision().quorum, 2u);
  EXPECT_EQ(p.decision().allowance.at(1003), 4u);  // ceil(2.5) + 1
  // One leaves and another joins between two decisions: as many workers, other ones, and
  // the same decision (the quorum counts workers, whichever they are).
  p.Leave(1001);
  p.Join(1004);
  EXPECT_FALSE(p.Decide());
  Allowances expected;
  expected.Set(1003, 4);
  EXPECT_EQ(p.decision().allowance, expected);
  EXPECT_EQ(p.decision().quorum, 2u);
  EXPECT_FALSE(p.Decide());  // nothing new: no change
  // A worker leaving beside a straggler: one fewer in the quorum.
  p.Leave(1004);
  EXPECT_TRUE(p.Decide());
  EXPECT_EQ(p.decision().quorum, 1u);
  // A lone worker is never anyone's straggler.
  p.Leave(1000);
  EXPECT_TRUE(p.Decide());
  EXPECT_EQ(p.decision().quorum, SyncMode::kAll);
  EXPECT_EQ(p.decision().allowance.at(1003), 0u);
  EXPECT_TRUE(p.decision().allowance.empty());
}

// The rule as plainly as it can be written: every worker judged at every decision against
// the lower median of the measured workers' medians. AutoPolicy keeps the same decisions
// by judging only what changed; this is what it must agree with.
class PlainPolicy {
 public:
  explicit PlainPolicy(AutoPolicyOptions o) : opt_(o) {}
  void Join(WorkerId w) { workers_.try_emplace(w); }
  void Leave(WorkerId w) { workers_.erase(w); }
  void Observe(WorkerId w, double seconds) {
    auto it = workers_.find(w);
    if (it == workers_.end() || !(seconds >= 0)) return;
    Track& t = it->second;
    if (t.recent.size() < opt_.window) {
      t.recent.push_back(seconds);
    } else {
      t.recent[t.samples % opt_.window] = seconds;
    }
    ++t.samples;
    std::vector<double> sorted = t.recent;
    std::sort(sorted.begin(), sorted.end());
    t.estimate = sorted[sorted.size() / 2];
  }
  // Every known worker's allowance (0 when not delayed), and the quorum.
  std::pair<uint32_t, std::map<WorkerId, uint32_t>> Decide() {
    std::vector<double> measured;
    for (const auto& [id, t] : workers_) {
      if (t.samples >= opt_.min_samples) measured.push_back(t.estimate);
    }
    std::sort(measured.begin(), measured.end());
    const double ref = measured.empty() ? 0 : measured[(measured.size() - 1) / 2];
    std::map<WorkerId, uint32_t> allowance;
    uint32_t fast = 0;
    for (auto& [id, t] : workers_) {
      uint32_t allow = 0;
      if (ref > 0 && t.samples >= opt_.min_samples && workers_.size() > 1) {
        const double ratio = t.estimate / ref;
        const bool was = t.straggler;
        t.straggler = t.straggler ? ratio >= opt_.recover_ratio : ratio > opt_.slow_ratio;
        if (t.straggler) {
          allow = static_cast<uint32_t>(
              std::min<double>(opt_.max_bound, std::ceil(ratio - 1e-6) + opt_.margin));
          if (was && allow < t.allowance && allow + 2 > t.allowance) allow = t.allowance;
        }
      } else {
        t.straggler = false;
      }
      t.allowance = allow;
      allowance[id] = allow;
      fast += allow == 0 ? 1 : 0;
    }
    const uint32_t quorum = fast == workers_.size() ? SyncMode::kAll : std::max<uint32_t>(fast, 1);
    return {quorum, allowance};
  }

 private:
  struct Track {
    std::vector<double> recent;
    uint32_t samples = 0;
    double estimate = 0;
    bool straggler = false;
    uint32_t allowance = 0;
  };
  AutoPolicyOptions opt_;
  std::map<WorkerId, Track> workers_;
};

// Random jobs: workers of a few paces (some near the thresholds and the allowance's steps,
// where rounding decides, some far past the largest allowance, now and then a time of 0 or
// infinity), paces that change, a little noise, joins and leaves, maximum bounds from 1 to
// 1024; after one event or several both decide, and they must agree on every worker's
// allowance and the quorum.
TEST(AutoPolicy, DecidesAsThePlainRuleOnRandomJobs) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    std::mt19937 rng(seed);
    AutoPolicyOptions o;
    const uint32_t bounds[] = {1, 2, 3, 4, 5, 7, 9, 64, 1024};
    o.max_bound = bounds[std::uniform_int_distribution<size_t>(0, 8)(rng)];
    o.margin = seed % 3 == 0 ? 0 : 1;
    AutoPolicy fast(o);
    PlainPolicy plain(o);
    std::map<WorkerId, double> pace;
    WorkerId next = 1000;
    const double paces[] = {1.0, 1.0,    1.0, 1.1, 1.3,  1.5,  1.6,  2.0,
                            2.5, 3.0, 3.0001, 4.7, 9.0, 63.5, 100, 1500};
    auto pick = [&] { return paces[std::uniform_int_distribution<size_t>(0, 15)(rng)]; };
    const int initial = std::uniform_int_distribution<int>(1, 24)(rng);
    for (int i = 0; i < initial; ++i) {
      pace[next] = pick();
      fast.Join(next);
      plain.Join(next++);
    }
    std::uniform_real_distribution<double> unit(0, 1);
    for (int step = 0; step < 3000; ++step) {
      const double event = unit(rng);
      if (event < 0.01) {
        pace[next] = pick();
        fast.Join(next);
        plain.Join(next++);
      } else if (event < 0.02 && pace.size() > 1) {
        auto it = std::next(pace.begin(), std::uniform_int_distribution<ptrdiff_t>(
                                              0, static_cast<ptrdiff_t>(pace.size()) - 1)(rng));
        fast.Leave(it->first);
        plain.Leave(it->first);
        pace.erase(it);
      } else if (event < 0.04 && !pace.empty()) {
        std::next(pace.begin(), std::uniform_int_distribution<ptrdiff_t>(
                                    0, static_cast<ptrdiff_t>(pace.size()) - 1)(rng))
            ->second = pick();
      } else if (!pace.empty()) {
        auto it = std::next(pace.begin(), std::uniform_int_distribution<ptrdiff_t>(
                                              0, static_cast<ptrdiff_t>(pace.size()) - 1)(rng));
        // Mostly exact paces (ties, and ratios on a step), sometimes noisy ones, rarely 0 or
        // infinity (a clock that did not move; an iteration that never ended).
        const double odd = unit(rng);
        const double noise = unit(rng) < 0.3 ? 1.0 + 0.2 * (unit(rng) - 0.5) : 1.0;
        const double t = odd < 0.002   ? 0.0
                         : odd < 0.004 ? std::numeric_limits<double>::infinity()
                                       : 0.01 * it->second * noise;
        fast.Observe(it->first, t);
        plain.Observe(it->first, t);
      }
      if (unit(rng) < 0.4) continue;  // several events between two decisions
      fast.Decide();
      const auto [quorum, allowance] = plain.Decide();
      ASSERT_EQ(fast.decision().quorum, quorum) << "seed " << seed << " step " << step;
      size_t delayed = 0;
      for (const auto& [w, allow] : allowance) {
        ASSERT_EQ(fast.decision().allowance.at(w), allow)
            << "seed " << seed << " step " << step << " worker " << w;
        delayed += allow > 0 ? 1 : 0;
      }
      ASSERT_EQ(fast.decision().allowance.size(), delayed) << "seed " << seed << " step " << step;
    }
  }
}

// --- the rule under the policy ----------------------------------------------------------

TEST(RoundRuleAuto, StartsAsBspAndRefusesAllowancesAboveTheMaximum) {
  RoundRule rule(SyncMode::Auto(2));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  auto c = rule.Commit(1000, 0, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->gate, 1u);  // allowance 0: like bsp, the next pull waits for round 0
  EXPECT_TRUE(rule.CloseReady().empty());
  EXPECT_EQ(rule.SetAllowance(1001, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rule.SetAllowance(1999, 1).code(), StatusCode::kNotFound);
  RoundRule fixed(SyncMode::Dsync(2, 1));
  ASSERT_TRUE(fixed.Join(1000, true).ok());
  EXPECT_EQ(fixed.SetAllowance(1000, 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(fixed.SetQuorum(1).code(), StatusCode::kFailedPrecondition);
}

// Three fast workers and one that is 3x slower for a while, then recovers, with the
// policy re-deciding after every commit from simulated times, as the scheduler does.
TEST(RoundRuleAuto, PolicyLetsFastWorkersRunWhileTheStragglerIsSlowAndBoundsStaleness) {
  const uint32_t kMax = 4;
  RoundRule rule(SyncMode::Auto(kMax));
  AutoPolicy policy = Policy(kMax);
  const std::vector<WorkerId> ids = {1000, 1001, 1002, 1003};
  for (WorkerId w : ids) {
    ASSERT_TRUE(rule.Join(w, true).ok());
    policy.Join(w);
  }
  // Discrete-time simulation: worker w needs `period` ticks per gradient.
  struct W {
    int left = 0;
    Clock clock = 0;
    Version base = 0;
    Version gate = 0;
    bool computing = false;
  };
  std::map<WorkerId, W> ws;
  Version applied = 0;
  AutoDecision followed;  // what the rule follows
  uint32_t max_staleness = 0;
  uint64_t straggler_rounds_missed = 0;
  auto period = [](WorkerId w, int tick) { return w == 1003 && tick < 3000 ? 30 : 10; };
  for (int tick = 0; tick < 4000; ++tick) {
    for (WorkerId w : ids) {
      W& s = ws[w];
      if (!s.computing) {
        if (applied < s.gate) continue;  // pull gate
        s.base = applied;
        ASSERT_TRUE(rule.Begin(w, s.clock, s.base).ok());
        s.left = period(w, tick);
        s.computing = true;
        continue;
      }
      if (--s.left > 0) continue;
      policy.Observe(w, period(w, tick) * 1e-3);
      if (policy.Decide()) {
        ASSERT_TRUE(ApplyDecision(rule, followed, policy.decision()).ok());
        followed = policy.decision();
      }
      auto c = rule.Commit(w, s.clock, s.base);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      s.gate = c->gate.value();
      ++s.clock;
      s.computing = false;
    }
    for (const RoundRecord& r : rule.CloseReady()) {
      bool has_straggler = false;
      for (const RoundMember& m : r.members) {
        max_staleness = std::max<uint32_t>(max_staleness, static_cast<uint32_t>(r.round - m.base));
        has_straggler = has_straggler || m.worker == 1003;
      }
      straggler_rounds_missed += has_straggler ? 0 : 1;
      EXPECT_GE(r.live_members, r.quorum_needed);
    }
    applied = rule.open_round();  // servers apply at once
  }
  EXPECT_LE(max_staleness, kMax);
  EXPECT_GT(max_staleness, 0u);
  // While the straggler is slow the fast workers keep their pace (~1 round / 10 ticks, not
  // 1 / 30), and its gradients are delayed, not lost: it completed about 3000/30 of them.
  EXPECT_GT(straggler_rounds_missed, 100u);
  EXPECT_GT(ws[1003].clock, 90u);
  EXPECT_GT(rule.open_round(), 330u);
  EXPECT_LE(rule.stats().gradients_committed - rule.stats().gradients_placed, 4u * (kMax + 1));
  // After the recovery the policy is back to bsp, and so is the rule: the straggler it
  // delayed is waited for again.
  EXPECT_EQ(policy.decision().quorum, SyncMode::kAll);
  EXPECT_TRUE(followed.allowance.empty());
}

}  // namespace
}  // namespace dsync::ps
