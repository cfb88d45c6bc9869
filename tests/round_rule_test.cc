// The round-closing rule alone: hand-written scenarios, then property tests that drive it
// with simulated workers acting in random orders (random per-worker speeds, servers that
// lag behind the decisions, joins, graceful leaves and failures) and check docs/contract.md's
// invariants on every decision.
#include "ps/round_rule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

namespace dsync::ps {
namespace {

SyncMode Mode(const char* text) { return SyncMode::Parse(text).value(); }

// --- hand-written scenarios -------------------------------------------------------------

TEST(RoundRule, BspClosesOnlyWithEveryWorker) {
  RoundRule rule(SyncMode::Bsp());
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  auto c = rule.Commit(1000, 0, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->round, 0u);
  EXPECT_EQ(c->gate, 1u);  // next pull waits for round 0 to be applied
  EXPECT_TRUE(rule.CloseReady().empty());
  ASSERT_TRUE(rule.Commit(1001, 0, 0).ok());
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].round, 0u);
  EXPECT_EQ(rounds[0].members, (std::vector<RoundMember>{{1000, 0, 0}, {1001, 0, 0}}));
  EXPECT_EQ(rounds[0].quorum_needed, 2u);
  EXPECT_EQ(rule.open_round(), 1u);
}

TEST(RoundRule, BspRefusesAGradientOnAnOldModel) {
  RoundRule rule(SyncMode::Bsp());
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  ASSERT_EQ(rule.CloseReady().size(), 1u);
  auto c = rule.Commit(1000, 1, 0);  // computed on version 0 again: staleness 1 > 0
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("pull the model"), std::string::npos);
}

TEST(RoundRule, DsyncLetsFastWorkersRunAheadByTheBound) {
  RoundRule rule(Mode("dsync:2"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  // Worker 1000 commits three gradients on version 0; quorum is all, nothing closes.
  auto c0 = rule.Commit(1000, 0, 0);
  auto c1 = rule.Commit(1000, 1, 0);
  ASSERT_TRUE(c0.ok() && c1.ok());
  EXPECT_EQ(c0->round, 0u);
  EXPECT_EQ(c1->round, 1u);
  EXPECT_EQ(c0->gate, 0u);  // round 0 + 1 - 2 clamps to 0
  EXPECT_EQ(c1->gate, 0u);
  auto c2 = rule.Commit(1000, 2, 0);
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->round, 2u);
  EXPECT_EQ(c2->gate, 1u);  // its next gradient lands in round 3 at the earliest
  EXPECT_TRUE(rule.CloseReady().empty());
  // The slow worker's gradient closes round 0 only; round 1 waits for its next one.
  ASSERT_TRUE(rule.Commit(1001, 0, 0).ok());
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].members.size(), 2u);
}

TEST(RoundRule, QuorumClosesWithoutTheStragglerWithinTheBound) {
  RoundRule rule(Mode("dsync:2,3"));
  for (WorkerId w = 1000; w < 1004; ++w) ASSERT_TRUE(rule.Join(w, true).ok());
  ASSERT_TRUE(rule.Begin(1003, 0, 0).ok());  // the straggler computes on version 0
  // Rounds 0 and 1 close with the three fast workers; round 2 would make the straggler's
  // gradient (base 0) land in round 3 with staleness 3 > 2, so it waits.
  for (Clock c = 0; c < 3; ++c) {
    for (WorkerId w = 1000; w < 1003; ++w) ASSERT_TRUE(rule.Commit(w, c, c).ok()) << c;
    auto rounds = rule.CloseReady();
    if (c < 2) {
      ASSERT_EQ(rounds.size(), 1u) << c;
      EXPECT_EQ(rounds[0].members.size(), 3u);
      EXPECT_EQ(rounds[0].quorum_needed, 3u);
    } else {
      EXPECT_TRUE(rounds.empty());
    }
  }
  auto late = rule.Commit(1003, 0, 0);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->round, 2u);  // staleness exactly 2
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].members.size(), 4u);
  EXPECT_EQ(rounds[0].members[3], (RoundMember{1003, 0, 0}));
}

TEST(RoundRule, UnreportedBaseIsTakenAsTheLowestThePullGateAllows) {
  RoundRule rule(Mode("dsync:1,1"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  // 1001 never reports its base: it may be computing on version 0 (its gate), so round 1
  // may not close without it (1 + 1 - 0 > 1) but round 0 may.
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  EXPECT_EQ(rule.CloseReady().size(), 1u);
  ASSERT_TRUE(rule.Commit(1000, 1, 1).ok());
  EXPECT_TRUE(rule.CloseReady().empty());
  ASSERT_TRUE(rule.Begin(1001, 0, 1).ok());  // now it says: version 1
  EXPECT_EQ(rule.CloseReady().size(), 1u);
}

TEST(RoundRule, JoinerCountsFromTheNextRoundAndStartsWithinTheBound) {
  RoundRule rule(SyncMode::Bsp());
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  ASSERT_EQ(rule.CloseReady().size(), 1u);  // open round is 1
  auto a = rule.Join(1001, false);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->join_round, 2u);
  EXPECT_EQ(a->gate, 2u);  // bsp: it starts from the model round 1 produces
  // Round 1 closes without the joiner...
  ASSERT_TRUE(rule.Commit(1000, 1, 1).ok());
  auto r1 = rule.CloseReady();
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].live_workers, 1u);
  // ...and round 2 needs it.
  ASSERT_TRUE(rule.Commit(1000, 2, 2).ok());
  EXPECT_TRUE(rule.CloseReady().empty());
  ASSERT_TRUE(rule.Commit(1001, a->start_clock, 2).ok());
  auto r2 = rule.CloseReady();
  ASSERT_EQ(r2.size(), 1u);
  EXPECT_EQ(r2[0].members.size(), 2u);
  EXPECT_EQ(r2[0].live_workers, 2u);
}

TEST(RoundRule, FailedWorkersQueuedGradientsAreAppliedNotWaitedFor) {
  RoundRule rule(Mode("dsync:3"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  ASSERT_TRUE(rule.Commit(1001, 0, 0).ok());
  ASSERT_TRUE(rule.Commit(1001, 1, 0).ok());
  auto next = rule.Remove(1001, /*failed=*/true);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 2u);  // clocks 0 and 1 stand, anything later is discarded
  EXPECT_EQ(rule.live_workers(), 1u);
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].members.size(), 2u);
  // The dead worker's second gradient rides in the next round.
  ASSERT_TRUE(rule.Commit(1000, 1, 0).ok());
  rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].members, (std::vector<RoundMember>{{1000, 1, 0}, {1001, 1, 0}}));
  EXPECT_FALSE(rule.has_queued());
  // A commit from the dead worker is refused.
  EXPECT_EQ(rule.Commit(1001, 2, 1).status().code(), StatusCode::kAborted);
}

TEST(RoundRule, DepartedWorkersGradientsDrainWhenNobodyIsLeft) {
  RoundRule rule(Mode("dsync:2"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  ASSERT_TRUE(rule.Commit(1000, 1, 0).ok());
  ASSERT_TRUE(rule.Remove(1000, false).ok());
  auto rounds = rule.CloseReady();  // round 0 closed on commit; round 1 drains now
  size_t placed = 0;
  for (auto& r : rounds) placed += r.members.size();
  EXPECT_GE(placed, 1u);
  EXPECT_FALSE(rule.has_queued());
  EXPECT_EQ(rule.open_round(), 2u);
}

TEST(RoundRule, AspPlacesEveryGradientInARoundOfItsOwn) {
  RoundRule rule(SyncMode::Asp());
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  auto a = rule.Commit(1000, 0, 0);
  auto b = rule.Commit(1001, 0, 0);
  auto c = rule.Commit(1000, 1, 0);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->gate, 0u);
  EXPECT_EQ(c->round, 2u);
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 3u);
  for (auto& r : rounds) EXPECT_EQ(r.members.size(), 1u);
  EXPECT_EQ(rounds[2].members[0], (RoundMember{1000, 1, 0}));
}

TEST(RoundRule, SspGateWaitsForTheSlowestClock) {
  RoundRule rule(Mode("ssp:1"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  // 1000 at clock 1 needs clocks < 0 of everyone: open.
  auto c0 = rule.Commit(1000, 0, 0);
  ASSERT_TRUE(c0.ok());
  EXPECT_TRUE(c0->gate.has_value());
  // At clock 2 it needs 1001's clock 0.
  auto c1 = rule.Commit(1000, 1, 1);
  ASSERT_TRUE(c1.ok());
  EXPECT_FALSE(c1->gate.has_value());
  EXPECT_TRUE(rule.TakeGateReleases().empty());
  ASSERT_TRUE(rule.Commit(1001, 0, 0).ok());
  auto rel = rule.TakeGateReleases();
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0].worker, 1000u);
  EXPECT_EQ(rel[0].clock, 2u);
  EXPECT_EQ(rel[0].min_version, 3u);  // all three gradients decided
}

TEST(RoundRule, SspGateOpensWhenTheSlowWorkerDies) {
  RoundRule rule(Mode("ssp:0"));
  ASSERT_TRUE(rule.Join(1000, true).ok());
  ASSERT_TRUE(rule.Join(1001, true).ok());
  auto c = rule.Commit(1000, 0, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->gate.has_value());
  ASSERT_TRUE(rule.Remove(1001, true).ok());
  auto rel = rule.TakeGateReleases();
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0].clock, 1u);
}

TEST(RoundRule, RejectsMalformedEvents) {
  RoundRule rule(SyncMode::Bsp());
  ASSERT_TRUE(rule.Join(1000, true).ok());
  EXPECT_EQ(rule.Join(1000, true).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(rule.Commit(1000, 5, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rule.Commit(1000, 0, 7).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rule.Commit(2000, 0, 0).status().code(), StatusCode::kAborted);
  EXPECT_EQ(rule.Remove(2000, true).status().code(), StatusCode::kNotFound);
}

TEST(RoundRule, FinishAsBspWaitsForEveryWorkerFromThenOn) {
  RoundRule rule(Mode("dsync:2,2"));
  for (WorkerId w = 1000; w < 1003; ++w) ASSERT_TRUE(rule.Join(w, true).ok());
  // Before: rounds close with two of three workers; 1002 computes on version 0.
  ASSERT_TRUE(rule.Begin(1002, 0, 0).ok());
  ASSERT_TRUE(rule.Commit(1000, 0, 0).ok());
  ASSERT_TRUE(rule.Commit(1001, 0, 0).ok());
  ASSERT_EQ(rule.CloseReady().size(), 1u);
  ASSERT_TRUE(rule.FinishAsBsp().ok());
  EXPECT_TRUE(rule.finished_as_bsp());
  // Round 1 now waits for 1002 too, though 1002's gradient of version 0 would stay within
  // the bound in round 2.
  auto c0 = rule.Commit(1000, 1, 1);
  ASSERT_TRUE(c0.ok());
  EXPECT_EQ(c0->gate, 2u);  // no allowance: the next pull waits for round 1 itself
  ASSERT_TRUE(rule.Commit(1001, 1, 1).ok());
  EXPECT_TRUE(rule.CloseReady().empty());
  // A joiner gets no allowance either: its first pull waits for the round it counts from.
  auto a = rule.Join(1003, false);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->join_round, 2u);
  EXPECT_EQ(a->gate, 2u);
  // 1002's gradient, granted under the old bound, lands with the staleness it was granted.
  auto late = rule.Commit(1002, 0, 0);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->round, 1u);
  EXPECT_EQ(late->gate, 2u);
  auto rounds = rule.CloseReady();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].members.size(), 3u);
  EXPECT_EQ(rounds[0].quorum_needed, 3u);
  EXPECT_EQ(rounds[0].members[2], (RoundMember{1002, 0, 0}));
}

TEST(RoundRule, FinishAsBspHoldsAndNeedsRounds) {
  RoundRule autorule(Mode("dsync:auto:3"));
  ASSERT_TRUE(autorule.Join(1000, true).ok());
  ASSERT_TRUE(autorule.SetAllowance(1000, 2).ok());
  ASSERT_TRUE(autorule.SetQuorum(1).ok());
  ASSERT_TRUE(autorule.FinishAsBsp().ok());
  // dsync:auto's decisions after it may only restate bsp.
  EXPECT_TRUE(autorule.SetAllowance(1000, 0).ok());
  EXPECT_TRUE(autorule.SetQuorum(SyncMode::kAll).ok());
  Status raise = autorule.SetAllowance(1000, 1);
  EXPECT_EQ(raise.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(raise.message().find("runs as bsp"), std::string::npos) << raise.ToString();
  EXPECT_EQ(autorule.SetQuorum(1).code(), StatusCode::kFailedPrecondition);
  for (const char* mode : {"asp", "ssp:2"}) {
    RoundRule rule(Mode(mode));
    Status s = rule.FinishAsBsp();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << mode;
    EXPECT_NE(s.message().find("only round modes"), std::string::npos) << s.ToString();
    EXPECT_FALSE(rule.finished_as_bsp());
  }
}

// --- property tests -----------------------------------------------------------------------

// Simulated cluster around one RoundRule. Workers cycle pull -> compute -> commit; a pull
// returns the servers' applied version once it meets the gate; the servers apply decided
// rounds with a random lag.
class Simulation {
 public:
  Simulation(SyncMode mode, uint32_t seed, bool finish = false)
      : mode_(mode), rule_(mode), rng_(seed), quorum_(mode.quorum), may_finish_(finish) {}

  void JoinWorker(bool initial) {
    const WorkerId id = next_id_++;
    auto a = rule_.Join(id, initial);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    Sim& w = workers_[id];
    w.clock = a->start_clock;
    w.start_clock = a->start_clock;
    w.gate = a->gate;
    w.gate_known = true;
    if (finished_) fresh_from_[id] = a->start_clock;
    EXPECT_EQ(rule_.CheckIndex(), "") << "after a join";
    // Straggler-ish speeds: a few workers are much slower.
    std::uniform_int_distribution<int> speed(1, 10);
    w.weight = speed(rng_) <= 2 ? 1 : 8;
  }

  // One random event. Returns false if nothing could happen (a deadlock if work remains).
  bool Step(bool allow_membership) {
    std::vector<WorkerId> ready;
    std::vector<int> weights;
    for (auto& [id, w] : workers_) {
      if (CanAct(w)) {
        ready.push_back(id);
        weights.push_back(w.weight);
      }
    }
    const bool can_apply = applied_ < rule_.open_round();
    std::uniform_int_distribution<int> coin(0, 99);
    if (allow_membership) {
      const int c = coin(rng_);
      if (c < 2) {
        JoinWorker(false);
        return true;
      }
      if (c < 4 && workers_.size() > 1) {
        RemoveRandom(/*failed=*/c == 2);
        return true;
      }
    }
    if (mode_.adaptive && coin(rng_) < 3) {
      RandomPolicy();
      return true;
    }
    if (may_finish_ && !finished_ && std::uniform_int_distribution<int>(0, 999)(rng_) == 0) {
      Finish();
      return true;
    }
    if (ready.empty() && !can_apply) return false;
    if (can_apply && (ready.empty() || coin(rng_) < 30)) {
      applied_ += 1 + (coin(rng_) < 20 ? rule_.open_round() - applied_ - 1 : 0);
      return true;
    }
    std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
    Act(ready[pick(rng_)]);
    return true;
  }

  void Run(int steps, bool membership) {
    for (int i = 0; i < steps && !::testing::Test::HasFatalFailure(); ++i) {
      if (!Step(membership)) {
        FAIL() << "deadlock: no worker can act and no round can close (" << DebugState() << ")";
      }
    }
  }

  // Every worker leaves; everything committed must be placed and nothing may hang.
  void Drain() {
    while (!workers_.empty()) {
      const WorkerId id = workers_.begin()->first;
      ASSERT_TRUE(rule_.Remove(id, false).ok());
      workers_.erase(workers_.begin());
      Collect();
    }
    Collect();
    EXPECT_FALSE(rule_.has_queued());
    for (const auto& [key, round] : placed_) EXPECT_LT(round, rule_.open_round());
    EXPECT_EQ(placed_.size(), committed_.size()) << "a committed gradient was never placed";
  }

  uint64_t rounds() const { return rule_.open_round(); }
  bool finished() const { return finished_; }
  uint64_t fresh_checked() const { return fresh_checked_; }
  uint64_t gradients() const { return committed_.size(); }
  uint32_t max_staleness() const { return rule_.stats().max_staleness; }

 private:
  struct Sim {
    enum Phase { kPull, kCompute } phase = kPull;
    Clock clock = 0;
    Clock start_clock = 0;
    Version gate = 0;
    bool gate_known = true;
    Version base = 0;
    Version last_seen = 0;
    int weight = 8;
  };

  bool CanAct(const Sim& w) const {
    if (w.phase == Sim::kCompute) return true;
    return w.gate_known && applied_ >= w.gate;
  }

  void Act(WorkerId id) {
    Sim& w = workers_[id];
    if (w.phase == Sim::kPull) {
      // A pull answers with the newest applied version (freshness: never older than seen).
      ASSERT_GE(applied_, w.last_seen);
      w.base = applied_;
      w.last_seen = applied_;
      CheckSspPull(id, w);
      std::uniform_int_distribution<int> coin(0, 3);
      if (coin(rng_) != 0) {
        ASSERT_TRUE(rule_.Begin(id, w.clock, w.base).ok());
        EXPECT_EQ(rule_.CheckIndex(), "") << "after a begin: " << DebugState();
      }
      w.phase = Sim::kCompute;
      return;
    }
    auto c = rule_.Commit(id, w.clock, w.base);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    committed_[{id, w.clock}] = w.base;
    expected_round_[{id, w.clock}] = c->round;
    ++w.clock;
    w.phase = Sim::kPull;
    w.gate_known = c->gate.has_value();
    if (c->gate) w.gate = *c->gate;
    Collect();
  }

  // The job's last share as bsp: every gradient a worker computes after the one it was
  // pulling or computing for must be fresh, and every round needs every worker.
  void Finish() {
    ASSERT_TRUE(rule_.FinishAsBsp().ok());
    finished_ = true;
    quorum_ = SyncMode::kAll;
    for (const auto& [id, w] : workers_) fresh_from_[id] = w.clock + 1;
    Collect();
  }

  // dsync:auto: the policy may hand out any allowance up to the maximum and any quorum at
  // any moment; the invariants must not depend on what it decides (after the finish, only
  // bsp's).
  void RandomPolicy() {
    std::uniform_int_distribution<uint32_t> allow(0, finished_ ? 0 : mode_.bound);
    for (const auto& [id, w] : workers_) ASSERT_TRUE(rule_.SetAllowance(id, allow(rng_)).ok());
    std::uniform_int_distribution<uint32_t> q(0, finished_ ? 0 : static_cast<uint32_t>(workers_.size()));
    quorum_ = q(rng_);  // 0 is SyncMode::kAll
    ASSERT_TRUE(rule_.SetQuorum(quorum_).ok());
    Collect();
  }

  void RemoveRandom(bool failed) {
    std::uniform_int_distribution<size_t> pick(0, workers_.size() - 1);
    auto it = workers_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(pick(rng_)));
    auto next = rule_.Remove(it->first, failed);
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(*next, it->second.clock);
    workers_.erase(it);
    Collect();
  }

  // In ssp:K a pull at clock c must see every live worker's gradients of clocks < c - K.
  void CheckSspPull(WorkerId id, const Sim& w) {
    if (mode_.kind != SyncKind::kSsp) return;
    const Clock needed = w.clock > mode_.bound ? w.clock - mode_.bound : 0;
    for (const auto& [other, ow] : workers_) {
      EXPECT_GE(ow.clock, needed) << "worker " << id << " pulled at clock " << w.clock
                                  << " before worker " << other << " reached clock " << needed;
      const Clock first = std::max(ow.start_clock, ow.clock > 64 ? ow.clock - 64 : 0);
      for (Clock c = first; c < needed && c < ow.clock; ++c) {
        auto it = placed_.find({other, c});
        ASSERT_NE(it, placed_.end()) << "worker " << id << " pulled at clock " << w.clock
                                     << " without worker " << other << "'s clock " << c;
        EXPECT_LT(it->second, applied_ + 0) << "pull missed a gradient it must hold";
      }
    }
  }

  void Collect() {
    EXPECT_EQ(rule_.CheckIndex(), "") << DebugState();
    for (const RoundRecord& r : rule_.CloseReady()) {
      EXPECT_EQ(r.round, next_round_++);
      if (r.members.empty()) {
        // Only allowed to let a joiner's first pull through when nobody else counts.
        EXPECT_EQ(r.live_workers, 0u) << "empty round " << r.round;
      }
      std::set<WorkerId> seen;
      for (size_t i = 0; i < r.members.size(); ++i) {
        const RoundMember& m = r.members[i];
        if (i > 0) {
          EXPECT_LT(r.members[i - 1].worker, m.worker) << "not in worker-id order";
        }
        EXPECT_TRUE(seen.insert(m.worker).second) << "two gradients of one worker in a round";
        auto key = std::make_pair(m.worker, m.clock);
        ASSERT_TRUE(committed_.contains(key)) << "placed a gradient never committed";
        EXPECT_EQ(committed_[key], m.base);
        EXPECT_TRUE(placed_.emplace(key, r.round).second) << "placed twice";
        EXPECT_EQ(expected_round_[key], r.round) << "landed in another round than announced";
        // Invariant 1 (bound).
        if (mode_.kind == SyncKind::kRound) {
          EXPECT_LE(r.round - m.base, mode_.bound)
              << "worker " << m.worker << " clock " << m.clock << " in round " << r.round;
        }
        if (auto f = fresh_from_.find(m.worker); f != fresh_from_.end() && m.clock >= f->second) {
          ++fresh_checked_;
          EXPECT_EQ(m.base, r.round) << "worker " << m.worker << " clock " << m.clock
                                     << ": stale after the finish as bsp";
        }
        // Per-worker order.
        auto [it, fresh] = last_clock_.try_emplace(m.worker, m.clock);
        if (!fresh) {
          EXPECT_GT(m.clock, it->second);
          it->second = m.clock;
        }
      }
      // Invariant 2 (quorum).
      EXPECT_GE(r.live_members, r.quorum_needed) << "round " << r.round << " under quorum";
      const uint32_t q = mode_.kind != SyncKind::kRound ? 1
                         : quorum_ == SyncMode::kAll      ? r.live_workers
                                                          : std::min(quorum_, r.live_workers);
      EXPECT_EQ(r.quorum_needed, q);
    }
    EXPECT_EQ(rule_.CheckIndex(), "") << "after closing: " << DebugState();
    for (const GateRelease& g : rule_.TakeGateReleases()) {
      auto it = workers_.find(g.worker);
      ASSERT_NE(it, workers_.end());
      EXPECT_EQ(g.clock, it->second.clock);
      it->second.gate = g.min_version;
      it->second.gate_known = true;
    }
  }

  std::string DebugState() const {
    std::string s = "open round " + std::to_string(rule_.open_round()) + ", applied " +
                    std::to_string(applied_);
    for (const auto& [id, w] : workers_) {
      s += "; w" + std::to_string(id) + " phase " + std::to_string(w.phase) + " clock " +
           std::to_string(w.clock) + " gate " + (w.gate_known ? std::to_string(w.gate) : "?");
    }
    return s;
  }

  SyncMode mode_;
  RoundRule rule_;
  std::mt19937 rng_;
  WorkerId next_id_ = 1000;
  std::map<WorkerId, Sim> workers_;
  Version applied_ = 0;
  Round next_round_ = 0;
  std::map<std::pair<WorkerId, Clock>, Version> committed_;
  std::map<std::pair<WorkerId, Clock>, Round> expected_round_;
  std::map<std::pair<WorkerId, Clock>, Round> placed_;
  std::map<WorkerId, Clock> last_clock_;
  uint32_t quorum_;  // the quorum in force (dsync:auto changes it)
  bool may_finish_;
  bool finished_ = false;
  std::map<WorkerId, Clock> fresh_from_;  // after the finish: clocks from which fresh
  uint64_t fresh_checked_ = 0;
};

struct PropertyCase {
  const char* mode;
  uint32_t workers;
  bool membership;
  bool finish = false;  // the last share as bsp, at a random moment
};

void PrintTo(const PropertyCase& c, std::ostream* os) {
  *os << c.mode << " with " << c.workers << " workers" << (c.membership ? " and churn" : "")
      << (c.finish ? ", finishing as bsp" : "");
}

class RoundRuleProperty : public ::testing::TestWithParam<PropertyCase> {};

TEST_P(RoundRuleProperty, InvariantsHoldOverRandomArrivalOrders) {
  const PropertyCase& pc = GetParam();
  uint64_t rounds = 0;
  uint32_t max_staleness = 0;
  uint32_t finished = 0;
  uint64_t fresh_checked = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Simulation sim(Mode(pc.mode), seed, pc.finish);
    for (uint32_t i = 0; i < pc.workers; ++i) sim.JoinWorker(true);
    sim.Run(3000, pc.membership);
    if (HasFatalFailure()) return;
    finished += sim.finished() ? 1 : 0;
    fresh_checked += sim.fresh_checked();
    sim.Drain();
    rounds += sim.rounds();
    max_staleness = std::max(max_staleness, sim.max_staleness());
  }
  EXPECT_GT(rounds, 40u * 50u) << "the simulation made too little progress to mean much";
  if (pc.finish) {
    // Most seeds finish (1 in 1000 steps) and then check many gradients for freshness.
    EXPECT_GE(finished, 20u);
    EXPECT_GT(fresh_checked, 40u * 100u);
  }
  const SyncMode mode = Mode(pc.mode);
  if (mode.kind == SyncKind::kRound && mode.bound > 0 &&
      (mode.quorum != SyncMode::kAll || mode.adaptive)) {
    // With stragglers and a quorum the bound is actually used, not just respected.
    EXPECT_GT(max_staleness, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, RoundRuleProperty,
    ::testing::Values(PropertyCase{"bsp", 4, false}, PropertyCase{"bsp", 3, true},
                      PropertyCase{"dsync:1", 4, false}, PropertyCase{"dsync:3", 5, true},
                      PropertyCase{"dsync:2,3", 4, false}, PropertyCase{"dsync:2,3", 4, true},
                      PropertyCase{"dsync:4,1", 6, true}, PropertyCase{"ssp:2", 4, false},
                      PropertyCase{"ssp:0", 3, true}, PropertyCase{"asp", 4, true},
                      PropertyCase{"dsync:auto", 4, false}, PropertyCase{"dsync:auto:2", 5, true},
                      PropertyCase{"dsync:3,2", 20, true},  // rounds of few among many
                      PropertyCase{"dsync:2,3", 4, false, true},
                      PropertyCase{"dsync:4,1", 6, true, true},
                      PropertyCase{"dsync:auto:3", 5, true, true}),
    [](const auto& param_info) {
      const PropertyCase& p = param_info.param;
      std::string name = p.mode;
      for (char& ch : name) {
        if (ch == ':' || ch == ',') ch = '_';
      }
      return name + "_w" + std::to_string(p.workers) + (p.membership ? "_churn" : "") +
             (p.finish ? "_finish" : "");
    });

}  // namespace
}  // namespace dsync::ps
