// Whole clusters in one process over real TCP on 127.0.0.1: the synchronization contract
// of docs/contract.md checked end to end (values, versions, round records), and membership
// changes while training runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "cluster_harness.h"
#include "ps/optimizer.h"
#include "ps/optimizer_math.h"

namespace dsync::testing {
namespace {

using namespace std::chrono_literals;

// --- Invariant 4: BSP equals sequential SGD bit for bit ---------------------------------

TEST(Cluster, BspWithFourWorkersEqualsSequentialSgdBitForBit) {
  constexpr uint32_t kWorkers = 4, kDim = 37, kBatch = 8, kSteps = 25;
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.05f;
  cfg.slice_bytes = 64;  // 16 floats: w is cut into 3 slices spread over both servers
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  const LinearData data(kDim, 1024, 7);

  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), kWorkers);
  std::vector<std::vector<float>> final_w(kWorkers);
  std::vector<float> final_b(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> params(kDim, 0.0f), grad(kDim);
      float b = 0.0f, gb = 0.0f;
      auto tw = w.Register("w", params);
      auto tb = w.Register("b", {&b, 1});
      ASSERT_TRUE(tw.ok() && tb.ok());
      for (uint32_t step = 0; step < kSteps; ++step) {
        ASSERT_TRUE(w.Wait(w.Pull(*tw, params.data())).ok());
        ASSERT_TRUE(w.Wait(w.Pull(*tb, &b)).ok());
        // Minibatch of step `step`, chunk `rank`: the concatenated batch is kWorkers chunks.
        data.Gradient(params.data(), b, (step * kWorkers + rank) * kBatch, kBatch, grad.data(), &gb);
        w.Push(*tw, grad.data());
        w.Push(*tb, &gb);
        ASSERT_TRUE(w.WaitAll().ok());
      }
      ASSERT_TRUE(w.Wait(w.Pull(*tw, params.data())).ok());
      ASSERT_TRUE(w.Wait(w.Pull(*tb, &b)).ok());
      final_w[rank] = params;
      final_b[rank] = b;
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());

  // Sequential SGD over the concatenated minibatches, with the same summation order and
  // the same optimizer math the server runs.
  std::vector<float> w(kDim, 0.0f), gw(kDim), sum_w(kDim);
  float b = 0.0f;
  for (uint32_t step = 0; step < kSteps; ++step) {
    float sum_b = 0.0f;
    for (uint32_t chunk = 0; chunk < kWorkers; ++chunk) {
      float gb = 0.0f;
      data.Gradient(w.data(), b, (step * kWorkers + chunk) * kBatch, kBatch, gw.data(), &gb);
      for (uint32_t j = 0; j < kDim; ++j) sum_w[j] = chunk == 0 ? gw[j] : sum_w[j] + gw[j];
      sum_b = chunk == 0 ? gb : sum_b + gb;
    }
    const auto sc = ps::MakeOptimizerScalars(cfg.optimizer, step + 1, kWorkers);
    for (uint32_t j = 0; j < kDim; ++j) ps::SgdStep(w[j], sum_w[j], sc);
    ps::SgdStep(b, sum_b, sc);
  }
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    ASSERT_EQ(final_w[rank].size(), kDim);
    EXPECT_EQ(0, std::memcmp(final_w[rank].data(), w.data(), kDim * sizeof(float)))
        << "worker " << rank << " w[0] " << final_w[rank][0] << " vs " << w[0];
    EXPECT_EQ(0, std::memcmp(&final_b[rank], &b, sizeof(float)));
  }
  EXPECT_LT(data.Loss(w.data(), b), data.Loss(std::vector<float>(kDim, 0.0f).data(), 0.0f) / 4)
      << "the reference itself should have learned something";
  const auto history = cluster.scheduler().history();
  ASSERT_EQ(history.size(), kSteps);
  for (const RoundRecord& r : history) EXPECT_EQ(r.members.size(), kWorkers);
  EXPECT_EQ(cluster.server(0).stats().rounds_applied, kSteps);
  EXPECT_EQ(cluster.server(1).stats().rounds_applied, kSteps);
}

// --- Invariants 1-3 and 5 in every mode, with random per-worker delays ----------------

// A worker that pushes all-ones gradients: with the `sum` optimizer the model then holds,
// on every element, the number of gradients applied.
class SumWorker {
 public:
  static constexpr size_t kBig = 1000;  // 4 slices of 1 KiB over both servers

  explicit SumWorker(Worker& w) : w_(w), a_(kBig, 0.0f), b_(3, 0.0f) {
    auto ta = w_.Register("a", a_);
    auto tb = w_.Register("b", b_);
    EXPECT_TRUE(ta.ok() && tb.ok()) << ta.status().ToString();
    ta_ = ta.ok() ? *ta : 0;
    tb_ = tb.ok() ? *tb : 1;
  }

  // Every element of the gradient of clock c is value(c) (GrowingValue), not 1.
  void Grow(std::function<float(Clock)> value) { value_ = std::move(value); }

  // Pull both tensors, "compute" for `compute`, push both and wait for the commit.
  bool Iterate(std::chrono::microseconds compute) {
    if (!Pull()) return false;
    std::this_thread::sleep_for(compute);
    const float* ga = ones_a_.data();
    const float* gb = ones_b_.data();
    if (value_) {
      grad_a_.assign(kBig, value_(w_.clock()));
      grad_b_.assign(3, value_(w_.clock()));
      ga = grad_a_.data();
      gb = grad_b_.data();
    }
    auto h1 = w_.Push(ta_, ga);
    auto h2 = w_.Push(tb_, gb);
    Status s1 = w_.Wait(h1), s2 = w_.Wait(h2);
    EXPECT_TRUE(s1.ok() && s2.ok()) << s1.ToString() << " " << s2.ToString();
    if (!s1.ok() || !s2.ok()) return false;
    ++completed;
    return true;
  }

  bool Pull() {
    const Clock c = w_.clock();
    Version va = 0, vb = 0;
    Status s1 = w_.Wait(w_.Pull(ta_, a_.data()), &va);
    Status s2 = w_.Wait(w_.Pull(tb_, b_.data()), &vb);
    EXPECT_TRUE(s1.ok() && s2.ok()) << s1.ToString() << " " << s2.ToString();
    const Version v = std::min(va, vb);
    EXPECT_GE(v, last_) << "invariant 3: versions seen by a worker never go backwards";
    last_ = v;
    pulls.emplace_back(c, v);
    return s1.ok() && s2.ok();
  }

  // Only the first tensor: a gradient that never becomes whole.
  void PushOnlyA() { partial_ = w_.Push(ta_, ones_a_.data()); }

  // The model at the newest decided round, read once every queued gradient is applied.
  // `w_` must be the only live worker: its empty commits close the rounds still holding
  // gradients of workers that left or died.
  void ReadFinal(LocalCluster& cluster, uint64_t* empty_commits) {
    auto members = [&] {
      uint64_t n = 0;
      for (const RoundRecord& r : cluster.scheduler().history()) n += r.members.size();
      return n;
    };
    for (int i = 0; i < 100 && members() < cluster.scheduler().stats().gradients_committed; ++i) {
      ASSERT_TRUE(w_.Wait(w_.Advance()).ok());
      ++*empty_commits;
    }
    const Version newest = cluster.scheduler().history().size();
    for (int tries = 0; tries < 500 && last_ < newest; ++tries) {
      ASSERT_TRUE(Pull());
      if (last_ < newest) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(last_, newest);
  }

  const std::vector<float>& a() const { return a_; }
  const std::vector<float>& b() const { return b_; }

  std::vector<std::pair<Clock, Version>> pulls;  // (clock, version) of each pull
  uint64_t completed = 0;                        // pushes whose Wait returned OK

 private:
  Worker& w_;
  std::vector<float> a_, b_;
  const std::vector<float> ones_a_ = std::vector<float>(kBig, 1.0f);
  const std::vector<float> ones_b_ = std::vector<float>(3, 1.0f);
  std::function<float(Clock)> value_;
  std::vector<float> grad_a_, grad_b_;
  TensorId ta_ = 0, tb_ = 1;
  Version last_ = 0;
  Handle partial_ = 0;
};

// Worker 0 of a test stays to read the final model; until the other workers are done it
// keeps contributing (empty commits), as a live worker that stopped pushing would otherwise
// hold up rounds that need its quorum share.
void ContributeUntil(Worker& w, const std::atomic<int>& done, int expected, uint64_t* empty) {
  while (done < expected) {
    EXPECT_TRUE(w.Wait(w.Advance()).ok());
    ++*empty;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ExpectModelCounts(const SumWorker& probe, uint64_t count) {
  for (float x : probe.a()) ASSERT_EQ(x, static_cast<float>(count));
  for (float x : probe.b()) ASSERT_EQ(x, static_cast<float>(count));
}

uint64_t CountMembers(const std::vector<RoundRecord>& history,
                      std::map<std::pair<WorkerId, Clock>, Round>* placed = nullptr) {
  uint64_t n = 0;
  for (const RoundRecord& r : history) {
    for (const RoundMember& m : r.members) {
      if (placed) {
        EXPECT_TRUE(placed->emplace(std::make_pair(m.worker, m.clock), r.round).second)
            << "worker " << m.worker << " clock " << m.clock << " placed twice";
      }
      ++n;
    }
  }
  return n;
}

// With a staleness policy the model is no longer a count: on every element it is what the
// scheduler's rounds give when each gradient of ones is corrected (delay compensation: toward
// the model before the first kept round at or after its base, of the last D rounds that
// changed the slice) and weighed as the policy says, summed in member order as the stores
// sum, then stepped by `optimizer` (sum, or momentum SGD with the round's momentum tempered by
// the weighed mean staleness under +momentum). Worker 0's clocks from `first_empty` on were
// empty commits. Returns how many gradients weighed less than 1 or were corrected, plus the
// rounds whose momentum was tempered. A damp policy applies none before `damped_from` and the
// damped policy from it on; `value` gives each gradient's elements (1 where empty).
uint64_t ExpectModelWeighed(const SumWorker& probe, const std::vector<RoundRecord>& history,
                            const StalenessPolicy& policy, const SyncMode& mode,
                            const OptimizerConfig& optimizer, WorkerId probe_id,
                            Clock first_empty, std::optional<Round> damped_from = {},
                            const std::function<float(Clock)>& value = {}) {
  float model = 0.0f;
  float momentum_buf = 0.0f;
  uint64_t steps = 0;
  uint64_t changed = 0;
  const size_t depth = policy.CompensationDepth(mode);
  std::deque<std::pair<Round, float>> kept;  // (round, the model before it), oldest first
  float mean_square = 0.0f;                  // adaptive: every element's running mean of g * g
  for (const RoundRecord& r : history) {
    const StalenessPolicy active = policy.Active(damped_from && r.round >= *damped_from);
    float sum = 0.0f;
    bool first = true;
    uint32_t count = 0;
    double weighed_staleness = 0.0;
    double weights = 0.0;
    double staleness = 0.0;  // unweighed: the mean where every weight is 0
    for (const RoundMember& m : r.members) {
      if (m.worker == probe_id && m.clock >= first_empty) continue;
      const float weight = active.Weight(Staleness(r.round, m.base));
      ++count;
      weighed_staleness += weight * static_cast<double>(Staleness(r.round, m.base));
      weights += weight;
      staleness += static_cast<double>(Staleness(r.round, m.base));
      float g = value ? value(m.clock) : 1.0f;
      float lambda = active.compensation;
      if (policy.adaptive && depth > 0) {
        mean_square = ps::MeanSquareStep(mean_square, g);  // kept before damping too
        lambda = ps::AdaptiveLambda(lambda, mean_square);
      }
      const auto toward = std::find_if(kept.begin(), kept.end(),
                                       [&](const auto& k) { return k.first >= m.base; });
      const float plain = g;
      if (depth > 0 && toward != kept.end() && lambda != 0.0f) {
        g = ps::Compensate(g, model, toward->second, lambda);
      }
      changed += weight < 1.0f || g != plain ? 1 : 0;
      sum = first ? ps::WeighFirst(g, weight) : ps::AddWeighed(sum, g, weight);
      first = false;
    }
    if (first) continue;  // no gradient: the slices neither change nor keep anything
    if (depth > 0) {
      kept.emplace_back(r.round, model);
      if (kept.size() > depth) kept.pop_front();
    }
    if (optimizer.kind == OptimizerKind::kSum) {
      ps::SumStep(model, sum);
      continue;
    }
    ps::OptimizerScalars scalars = ps::MakeOptimizerScalars(optimizer, ++steps, count);
    const double mean = weights > 0.0 ? weighed_staleness / weights : staleness / count;
    scalars.momentum = active.RoundMomentum(optimizer.momentum, mean);
    changed += scalars.momentum != optimizer.momentum ? 1 : 0;
    ps::MomentumStep(model, momentum_buf, sum, scalars);
  }
  EXPECT_TRUE(std::isfinite(model)) << "a model that is not finite proves nothing";
  auto differs = [&](float x) { return std::bit_cast<uint32_t>(x) != std::bit_cast<uint32_t>(model); };
  EXPECT_EQ(std::count_if(probe.a().begin(), probe.a().end(), differs), 0)
      << "the audit's rounds, weighed, give " << model << "; element 0 is " << probe.a()[0];
  EXPECT_EQ(std::count_if(probe.b().begin(), probe.b().end(), differs), 0)
      << "the audit's rounds, weighed, give " << model << "; element 0 is " << probe.b()[0];
  return changed;
}

// "MODE" or "MODE/STALENESS-POLICY", optionally "+R": R copies of every slice.
class ModeTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ModeTest, BoundQuorumFreshnessAndExactlyOnceUnderRandomDelays) {
  constexpr int kWorkers = 4;
  constexpr uint32_t kIters = 30;
  std::string param = GetParam();
  uint32_t copies = 1;
  // "+R" last: a policy may hold a '+' of its own (inverse+dc:L).
  if (const size_t plus = param.rfind('+');
      plus != std::string::npos && param.find_first_not_of("0123456789", plus + 1) == std::string::npos) {
    copies = static_cast<uint32_t>(std::stoul(param.substr(plus + 1)));
    param.resize(plus);
  }
  const size_t slash = param.find('/');
  Config cfg = TestConfig(param.substr(0, slash).c_str(), 2, kWorkers);
  cfg.replicas = copies;
  if (slash != std::string::npos) {
    cfg.staleness = StalenessPolicy::Parse(param.substr(slash + 1)).value();
  }
  // +momentum tempers momentum SGD, so it runs with that; the model is then no count.
  cfg.optimizer.kind = cfg.staleness.temper_momentum ? OptimizerKind::kMomentum : OptimizerKind::kSum;
  cfg.optimizer.lr = 0.01f;
  cfg.optimizer.momentum = 0.9f;
  cfg.slice_bytes = 1024;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  std::vector<std::unique_ptr<SumWorker>> sums;
  for (auto& w : workers) sums.push_back(std::make_unique<SumWorker>(*w));
  // A damp policy damps a job whose gradients grow: from clock 10 on they double each clock,
  // up to 8 (larger ones make the compensation's g * g * (w - w_base) blow the model up).
  const std::function<float(Clock)> growing = [](Clock c) {
    return c < 10 ? 1.0f : std::ldexp(1.0f, static_cast<int>(std::min<Clock>(c - 9, 3)));
  };
  if (cfg.staleness.damp) {
    for (auto& sw : sums) sw->Grow(growing);
  }
  std::atomic<int> others_done{0};
  uint64_t empty_commits = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      // Random compute times; the last worker is 3x slower.
      std::mt19937 rng(100 + r);
      std::uniform_int_distribution<int> us(1000, 6000);
      const int slow = r == kWorkers - 1 ? 3 : 1;
      for (uint32_t i = 0; i < kIters; ++i) {
        if (!sums[r]->Iterate(std::chrono::microseconds(us(rng) * slow))) return;
      }
      if (r > 0) {
        EXPECT_TRUE(workers[r]->Leave().ok());  // its committed gradients still apply
        ++others_done;
      } else {
        ContributeUntil(*workers[0], others_done, kWorkers - 1, &empty_commits);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (HasFatalFailure()) return;

  uint64_t total = 0;
  for (auto& sw : sums) total += sw->completed;
  ASSERT_EQ(total, kWorkers * kIters);
  // Invariant 5: every completed push applied exactly once, on every slice alike.
  sums[0]->ReadFinal(cluster, &empty_commits);
  if (HasFatalFailure()) return;
  // Every worker was told the job's policy in its welcome.
  for (const auto& w : workers) EXPECT_EQ(w->job().staleness, cfg.staleness);
  const std::optional<Round> damped_from = cluster.scheduler().stats().damped_from;
  if (cfg.staleness.damp && cfg.sync != SyncMode::Bsp()) {
    // Damped once the doubling showed (in the rounds of clocks 10 to 29), after the rounds
    // of ones set the level.
    ASSERT_TRUE(damped_from.has_value());
    EXPECT_GT(*damped_from, 5u);
  } else {
    EXPECT_FALSE(damped_from.has_value());
  }
  if (cfg.staleness == StalenessPolicy{}) {
    ExpectModelCounts(*sums[0], total);
  } else {
    // Each gradient applied once, weighed and corrected by the staleness the audit names; and
    // some were stale, or this proves nothing about the policy. Under bsp none is: the policy
    // changes nothing.
    const uint64_t changed = ExpectModelWeighed(*sums[0], cluster.scheduler().history(),
                                                cfg.staleness, cfg.sync, cfg.optimizer,
                                                workers[0]->job().worker_id, kIters, damped_from,
                                                cfg.staleness.damp ? growing : nullptr);
    bool stale = false;
    for (const RoundRecord& r : cluster.scheduler().history()) {
      for (const RoundMember& m : r.members) stale = stale || m.base < r.round;
    }
    if (cfg.sync == SyncMode::Bsp()) {
      EXPECT_EQ(changed, 0u);
      if (cfg.optimizer.kind == OptimizerKind::kSum) ExpectModelCounts(*sums[0], total);
    } else if (stale || !cfg.sync.adaptive) {
      EXPECT_GT(changed, 0u);
    }
    // dsync:auto delays nobody before it has measured bsp's pace and a trial, a second each:
    // a job this short may well end first, every gradient fresh.
  }
  ASSERT_TRUE(workers[0]->Leave().ok());
  ASSERT_TRUE(cluster.WaitFinished().ok());

  const SyncMode mode = cfg.sync;
  const auto history = cluster.scheduler().history();
  ExpectRoundInvariants(history, mode);
  std::map<std::pair<WorkerId, Clock>, Round> placed;
  const uint64_t gradients = CountMembers(history, &placed);
  EXPECT_EQ(gradients, total + empty_commits);
  for (size_t i = 0; i < cluster.num_servers(); ++i) {
    EXPECT_EQ(cluster.server(i).stats().rounds_applied, history.size());
    EXPECT_EQ(cluster.server(i).stats().gradients_applied, gradients);
  }
  // ssp:K: a pull at clock c held every worker's gradients of clocks < c - K.
  if (mode.kind == SyncKind::kSsp) {
    for (const auto& sw : sums) {
      for (const auto& [clock, version] : sw->pulls) {
        const Clock needed = clock > mode.bound ? clock - mode.bound : 0;
        for (const auto& w : workers) {
          for (Clock c = 0; c < needed && c < kIters; ++c) {
            auto it = placed.find({w->job().worker_id, c});
            ASSERT_NE(it, placed.end());
            EXPECT_LT(it->second, version) << "a pull at clock " << clock << " missed worker "
                                           << w->job().worker_id << "'s clock " << c;
          }
        }
      }
    }
  }
  EXPECT_EQ(cluster.scheduler().stats().workers_left, static_cast<uint32_t>(kWorkers));
}

// --- A 3x straggler: dsync:2,3 keeps the fast workers' pace, bsp does not ----------------

struct PaceResult {
  uint64_t slow_completed = 0;
  double fast_seconds = 0;
  std::vector<RoundRecord> history;
  WorkerId slow_id = 0;
  SchedulerStats stats;
};

// `budget` (with `finish_percent`): the job's budget of gradients instead of fast_iters, every
// worker iterating until told to stop.
PaceResult RunWithStraggler(const char* sync, uint32_t fast_iters = 30, uint64_t budget = 0,
                            uint32_t finish_percent = 0) {
  constexpr int kWorkers = 4;
  constexpr auto kCompute = std::chrono::milliseconds(6);
  Config cfg = TestConfig(sync, 1, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.slice_bytes = 1024;
  cfg.max_gradients = budget;
  cfg.finish_bsp_percent = finish_percent;
  LocalCluster cluster(cfg);
  PaceResult result;
  if (!cluster.ok()) return result;
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  if (workers.size() != kWorkers) return result;
  std::vector<std::unique_ptr<SumWorker>> sums;
  for (auto& w : workers) sums.push_back(std::make_unique<SumWorker>(*w));
  std::atomic<int> fast_done{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      if (budget > 0) {
        while (!workers[r]->stop_requested() &&
               sums[r]->Iterate(r == kWorkers - 1 ? 3 * kCompute : kCompute)) {
        }
      } else if (r == kWorkers - 1) {
        // The straggler: 3x the compute time, until the others finish.
        while (fast_done < kWorkers - 1 && sums[r]->Iterate(3 * kCompute)) {
        }
      } else {
        for (uint32_t i = 0; i < fast_iters && sums[r]->Iterate(kCompute); ++i) {
        }
        if (++fast_done == kWorkers - 1) {
          result.fast_seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
      }
      EXPECT_TRUE(workers[r]->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(cluster.WaitFinished().ok());
  result.slow_completed = sums[kWorkers - 1]->completed;
  result.slow_id = workers[kWorkers - 1]->job().worker_id;
  result.history = cluster.scheduler().history();
  result.stats = cluster.scheduler().stats();
  ExpectRoundInvariants(result.history, cfg.sync);
  return result;
}

// How the straggler's gradients were used: all applied, how stale, how many rounds went on
// without it.
struct StragglerUse {
  uint64_t applied = 0;
  uint64_t max_staleness = 0;
  uint64_t rounds_without = 0;
};

StragglerUse Inspect(const PaceResult& run) {
  StragglerUse u;
  for (const RoundRecord& r : run.history) {
    bool has = false;
    for (const RoundMember& m : r.members) {
      if (m.worker != run.slow_id) continue;
      has = true;
      ++u.applied;
      u.max_staleness = std::max<uint64_t>(u.max_staleness, r.round - m.base);
    }
    u.rounds_without += has ? 0 : 1;
  }
  return u;
}

void PrintPace(const char* mode, const PaceResult& bsp, const PaceResult& other) {
  std::printf("fast workers: bsp %.3f s (straggler %llu), %s %.3f s (straggler %llu)\n",
              bsp.fast_seconds, static_cast<unsigned long long>(bsp.slow_completed), mode,
              other.fast_seconds, static_cast<unsigned long long>(other.slow_completed));
}

// Under dsync:2,3 the quorum keeps the fast workers' pace; dsync:auto finds the straggler by
// itself (after measuring bsp's pace, then a trial, a second each at least) and does the
// same. In both, every straggler gradient is applied, within the bound, and the bound is
// actually used. Under dsync:auto the servers measured what the stale gradients were worth.
TEST(Cluster, QuorumAndAutoKeepTheFastWorkersPaceAndApplyEveryStragglerGradient) {
  const PaceResult bsp = RunWithStraggler("bsp");
  const PaceResult dsync = RunWithStraggler("dsync:2,3");
  // More iterations: the policy first measures bsp's pace for a second (55 rounds held by the
  // straggler's 18 ms), then tries delaying for a second; the steady state must dominate.
  constexpr uint32_t kAutoIters = 500;
  const PaceResult adaptive = RunWithStraggler("dsync:auto", kAutoIters);
  ASSERT_FALSE(HasFailure());
  PrintPace("dsync:2,3", bsp, dsync);
  PrintPace("dsync:auto", bsp, adaptive);
  // In bsp every round waits for the straggler: it completes as many gradients as the fast
  // workers (30). Otherwise the fast workers do not wait: the straggler (3x slower)
  // completes about a third as many while they run. Under dsync:auto the fast workers still
  // wait for their own rounds (allowance 0), so on a loaded machine their per-iteration
  // overhead narrows the gap; the straggler must still fall clearly behind (bsp: all of them).
  EXPECT_GE(bsp.slow_completed, 29u);
  EXPECT_LE(dsync.slow_completed, 20u);
  EXPECT_LE(adaptive.slow_completed, kAutoIters * 4 / 5);
  EXPECT_GT(adaptive.stats.agreements_measured, 0u);
  EXPECT_EQ(adaptive.stats.agreements_refused, 0u);
  EXPECT_EQ(dsync.stats.agreements_measured, 0u);  // only dsync:auto measures
  for (const auto& [run, bound] : {std::pair{&dsync, 2u}, {&adaptive, SyncMode::kDefaultAutoMax}}) {
    EXPECT_GE(run->slow_completed, 3u);
    const StragglerUse u = Inspect(*run);
    EXPECT_EQ(u.applied, run->slow_completed);  // delayed, never lost
    EXPECT_GE(u.rounds_without, 8u);
    EXPECT_GE(u.max_staleness, 1u);
    EXPECT_LE(u.max_staleness, bound);  // also checked on every round by ExpectRoundInvariants
  }
}

// dsync:auto with a budget runs its last share as bsp: the straggler was delayed shortly
// before that share began; once it has (and the gradients already under way have landed),
// every round holds every worker's gradient, computed on the version before it, up to the
// budget's last rounds.
// Runs `sync` with a 3x straggler, a budget of `budget` gradients and its last `percent` as
// bsp; checks that the delay was in use in the last rounds before that share (the finish,
// not something else, ended it) and that after `transition` rounds every round up to the
// budget holds all 4 workers, each gradient computed on the version before it.
void ExpectTheLastShareRunsAsBsp(const char* sync, uint64_t budget, uint32_t percent,
                                 uint32_t transition_rounds) {
  SCOPED_TRACE(sync);
  const uint64_t bsp_from = budget - budget * percent / 100;
  constexpr size_t kLate = 100;  // rounds before the share in which the delay must be in use
  const PaceResult run = RunWithStraggler(sync, 0, budget, percent);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_FALSE(run.history.empty());
  uint64_t gradients = 0;
  std::deque<bool> late;  // the last kLate rounds before the share: each without the straggler?
  size_t transition = 0;  // rounds after it began that may still hold a stale gradient
  uint64_t bsp_rounds = 0;
  for (const RoundRecord& r : run.history) {
    const bool has_slow = std::any_of(r.members.begin(), r.members.end(), [&](const RoundMember& m) {
      return m.worker == run.slow_id;
    });
    if (gradients < bsp_from) {
      late.push_back(!has_slow);
      if (late.size() > kLate) late.pop_front();
    } else if (gradients + r.members.size() <= budget && ++transition > transition_rounds) {
      // The switch comes at a commit: gradients computed under the delay (each within its
      // allowance) may still land in the first rounds after it.
      ++bsp_rounds;
      EXPECT_EQ(r.members.size(), 4u) << "round " << r.round;
      EXPECT_TRUE(has_slow) << "round " << r.round;
      for (const RoundMember& m : r.members) {
        EXPECT_EQ(m.base, r.round) << "round " << r.round << " worker " << m.worker;
      }
    }
    gradients += r.members.size();
  }
  EXPECT_GE(std::count(late.begin(), late.end(), true), 8);
  // (budget - bsp_from) / 4 rounds, less the transition and the budget's end.
  EXPECT_GE(bsp_rounds, (budget - bsp_from) / 4 - transition_rounds - 10);
  EXPECT_GE(gradients, budget);
}

TEST(Cluster, DsyncAutoRunsTheLastShareOfItsBudgetAsBsp) {
  // The policy needs about 500 gradients (bsp's pace, then a trial; 2 s) before it delays;
  // then about 700 delayed, and the last 25 % in bsp (100 rounds of the straggler's 18 ms).
  ExpectTheLastShareRunsAsBsp("dsync:auto", 1600, 25, SyncMode::kDefaultAutoMax);
}

TEST(Cluster, AFixedModeRunsTheLastShareOfItsBudgetAsBspWhenAsked) {
  // dsync:2,3 delays the straggler from the first round; the last 25 % of 800 in bsp.
  ExpectTheLastShareRunsAsBsp("dsync:2,3", 800, 25, 2);
}

// --- Observers and the job's gradient budget ---------------------------------------------

// A read-only client of the cluster's job.
Result<std::unique_ptr<Worker>> StartObserver(const LocalCluster& cluster) {
  Config c = cluster.WorkerConfig();
  c.observer = true;
  return Worker::Start(c);
}

TEST(Cluster, ObserverReadsTheNewestModelWithoutHoldingRounds) {
  constexpr int kWorkers = 2;
  constexpr uint32_t kIters = 25;
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.slice_bytes = 1024;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  // The observer connects first: it must not take a worker's place or id.
  auto observer = StartObserver(cluster);
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  Worker& obs = **observer;
  EXPECT_TRUE(obs.job().observer);
  EXPECT_GE(obs.job().worker_id, kFirstObserverId);
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  EXPECT_EQ(workers[0]->job().worker_id, kFirstWorkerId);
  SumWorker probe(obs);  // registers the same tensors
  std::vector<std::unique_ptr<SumWorker>> sums;
  for (auto& w : workers) sums.push_back(std::make_unique<SumWorker>(*w));

  std::vector<float> ones(SumWorker::kBig, 1.0f);
  Status refused = obs.Wait(obs.Push(0, ones.data()));
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied) << refused.ToString();
  EXPECT_EQ(obs.Wait(obs.Advance()).code(), StatusCode::kPermissionDenied);

  std::atomic<bool> done{false};
  // The reader's newest version, for this thread: `probe` is the reader's until it is joined.
  std::atomic<Version> newest{0};
  std::thread reader([&] {
    while (!done) {
      ASSERT_TRUE(probe.Pull());
      // Each bsp round adds one per worker: slice values are 2 x their version, and the
      // lowest version among the slices bounds every value from below.
      const Version v = probe.pulls.back().second;
      for (float x : probe.b()) EXPECT_GE(x, static_cast<float>(kWorkers * v));
      newest = v;
      std::this_thread::sleep_for(1ms);
    }
  });
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      for (uint32_t i = 0; i < kIters && sums[r]->Iterate(500us); ++i) {
      }
    });
  }
  for (auto& t : threads) t.join();
  // The newest model, as soon as it is applied: the observer never waits for a gate.
  for (int i = 0; i < 500 && newest < kIters; ++i) std::this_thread::sleep_for(2ms);
  done = true;
  reader.join();
  EXPECT_GT(probe.pulls.size(), 3u);
  EXPECT_EQ(probe.pulls.back().second, kIters);
  ExpectModelCounts(probe, kWorkers * kIters);
  EXPECT_FALSE(obs.final_version().has_value());
  for (auto& w : workers) ASSERT_TRUE(w->Leave().ok());
  // Training is over when the workers are gone: the observer is told the final version and
  // the servers wait for it to read the final model and leave.
  for (int i = 0; i < 1000 && !obs.final_version(); ++i) std::this_thread::sleep_for(2ms);
  ASSERT_TRUE(obs.final_version().has_value());
  EXPECT_EQ(*obs.final_version(), kIters);
  ASSERT_TRUE(probe.Pull());
  EXPECT_EQ(probe.pulls.back().second, kIters);
  ASSERT_TRUE(obs.Leave().ok());
  ASSERT_TRUE(cluster.WaitFinished(std::chrono::seconds(10)).ok());
  const auto history = cluster.scheduler().history();
  ASSERT_EQ(history.size(), kIters);
  for (const RoundRecord& r : history) EXPECT_EQ(r.live_workers, static_cast<uint32_t>(kWorkers));
  EXPECT_EQ(cluster.scheduler().stats().workers_joined, static_cast<uint32_t>(kWorkers));
}

// --- Per-tensor optimizers ----------------------------------------------------------------

// The gradient worker `rank` pushes for element i of tensor `t` at step `step`: deterministic,
// of both signs, never zero.
float TensorGradient(uint32_t t, uint32_t rank, uint32_t step, uint32_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + step * 3 + rank * 5 + t) % 11) - 5) * 0.1f +
         0.05f;
}

// One tensor as the servers should update it: its optimizer's math (ps/optimizer_math.h) over
// the round's sum in worker-id order, as the CPU store computes it.
struct TensorReference {
  OptimizerConfig opt;
  std::vector<float> w, s0, s1;
  void Step(uint32_t t, uint32_t step, uint32_t workers) {
    const auto sc = ps::MakeOptimizerScalars(opt, step + 1, workers);
    for (uint32_t i = 0; i < w.size(); ++i) {
      float sum = TensorGradient(t, 0, step, i);
      for (uint32_t r = 1; r < workers; ++r) sum += TensorGradient(t, r, step, i);
      switch (opt.kind) {
        case OptimizerKind::kSgd: ps::SgdStep(w[i], sum, sc); break;
        case OptimizerKind::kMomentum: ps::MomentumStep(w[i], s0[i], sum, sc); break;
        case OptimizerKind::kAdam: ps::AdamStep(w[i], s0[i], s1[i], sum, sc); break;
        case OptimizerKind::kAdamW: ps::AdamWStep(w[i], s0[i], s1[i], sum, sc); break;
        case OptimizerKind::kSum: ps::SumStep(w[i], sum); break;
      }
    }
  }
};

// Three tensors in one job, each cut into slices over both servers: one with adam, one with
// the job's sgd, one with nesterov momentum; each ends bit for bit where its own optimizer
// takes it. A later registration asking another optimizer for a tensor is refused, naming
// the tensor and both settings, and the job carries on; one differing in lr only is taken.
TEST(Cluster, EachTensorRunsTheOptimizerItWasRegisteredWith) {
  constexpr uint32_t kWorkers = 2, kSteps = 6;
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.1f;
  cfg.slice_bytes = 64;  // 16 floats a slice
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());

  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.lr = 0.01f;
  adam.weight_decay = 0.01f;
  OptimizerConfig nesterov;
  nesterov.kind = OptimizerKind::kMomentum;
  nesterov.lr = 0.05f;
  nesterov.momentum = 0.8f;
  nesterov.nesterov = true;
  const std::vector<std::string> names = {"a", "b", "c"};
  const std::vector<TensorOptions> options = {{adam}, {}, {nesterov}};
  const std::vector<size_t> sizes = {40, 30, 20};
  std::vector<TensorReference> ref;
  for (size_t t = 0; t < 3; ++t) {
    std::vector<float> init(sizes[t]);
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f + 0.01f * static_cast<float>(i + t);
    ref.push_back({options[t].optimizer.value_or(cfg.optimizer), init,
                   std::vector<float>(init.size()), std::vector<float>(init.size())});
  }

  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), kWorkers);
  std::vector<std::vector<std::vector<float>>> params(kWorkers);
  std::vector<std::vector<TensorId>> ids(kWorkers);
  auto train = [&](uint32_t from, uint32_t to) {
    std::vector<std::thread> threads;
    for (uint32_t rank = 0; rank < kWorkers; ++rank) {
      threads.emplace_back([&, rank] {
        Worker& w = *workers[rank];
        if (from == 0) {
          for (size_t t = 0; t < 3; ++t) {
            params[rank].push_back(ref[t].w);
            auto id = w.Register(names[t], params[rank][t], options[t]);
            ASSERT_TRUE(id.ok()) << id.status().ToString();
            ids[rank].push_back(*id);
          }
        }
        std::vector<std::vector<float>> grads(3);
        for (uint32_t step = from; step < to; ++step) {
          for (size_t t = 0; t < 3; ++t) {
            ASSERT_TRUE(w.Wait(w.Pull(ids[rank][t], params[rank][t].data())).ok());
          }
          for (uint32_t t = 0; t < 3; ++t) {
            grads[t].resize(sizes[t]);
            for (uint32_t i = 0; i < sizes[t]; ++i) grads[t][i] = TensorGradient(t, rank, step, i);
            w.Push(ids[rank][t], grads[t].data());
          }
          const Status pushed = w.WaitAll();
          ASSERT_TRUE(pushed.ok()) << pushed.ToString();
        }
      });
    }
    for (auto& th : threads) th.join();
  };
  train(0, kSteps / 2);

  // An observer registering 'a' with sgd: refused on the servers holding its slices.
  auto observer = StartObserver(cluster);
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  std::vector<float> probe(sizes[0]);
  OptimizerConfig other = cfg.optimizer;
  auto refused = (*observer)->Register("a", probe, {other});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  const std::string& why = refused.status().message();
  EXPECT_NE(why.find("tensor 0 'a' runs adam(lr 0.01, beta1 0.9, beta2 0.999, eps 1e-08, "
                     "weight_decay 0.01)"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("registers it with sgd(lr 0.1, weight_decay 0)"), std::string::npos) << why;
  // An observer that names no optimizer reads the tensor whatever it runs; the refusal before
  // left nothing behind (the same id, slices placed as on every worker).
  auto implicit = (*observer)->Register("a", probe);
  ASSERT_TRUE(implicit.ok()) << implicit.status().ToString();
  EXPECT_EQ(*implicit, 0u);
  // The learning rate may differ.
  auto second = StartObserver(cluster);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  OptimizerConfig faster = adam;
  faster.lr = 0.5f;
  auto taken = (*second)->Register("a", probe, {faster});
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_EQ(*taken, 0u);

  train(kSteps / 2, kSteps);
  for (uint32_t step = 0; step < kSteps; ++step) {
    for (uint32_t t = 0; t < 3; ++t) ref[t].Step(t, step, kWorkers);
  }
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    Worker& w = *workers[rank];
    for (size_t t = 0; t < 3; ++t) {
      SCOPED_TRACE(fmt::format("worker {} tensor {}", rank, names[t]));
      Version version = 0;
      ASSERT_TRUE(w.Wait(w.Pull(ids[rank][t], params[rank][t].data()), &version).ok());
      EXPECT_EQ(version, kSteps);
      for (size_t i = 0; i < sizes[t]; ++i) {
        ASSERT_EQ(params[rank][t][i], ref[t].w[i]) << "element " << i;
      }
    }
  }
  // Different optimizers really were at work: the same gradients took them apart.
  EXPECT_NE(ref[0].w[0], ref[1].w[0]);
  // The observer reads what the workers read.
  ASSERT_TRUE((*observer)->Wait((*observer)->Pull(0, probe.data())).ok());
  for (size_t i = 0; i < sizes[0]; ++i) ASSERT_EQ(probe[i], ref[0].w[i]) << "element " << i;
  ASSERT_TRUE((*observer)->Leave().ok());
  ASSERT_TRUE((*second)->Leave().ok());
  for (auto& w : workers) ASSERT_TRUE(w->Leave().ok());
  ASSERT_TRUE(cluster.WaitFinished(std::chrono::seconds(10)).ok());
  EXPECT_EQ(cluster.scheduler().history().size(), kSteps);
}

// A worker that names no optimizer asks for the job's: refused like one naming it when the
// tensor runs another, and its refused registration leaves nothing behind, so the same name
// with an optimizer that differs in lr only then takes the same id and placement; the job
// trains on.
TEST(Cluster, AWorkerAskingForTheJobsOptimizerImplicitlyIsCheckedLikeOneNamingIt) {
  Config cfg = TestConfig("bsp", 2, 2);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.1f;
  cfg.slice_bytes = 64;  // 16 floats a slice: the tensors span both servers
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 2);
  ASSERT_EQ(workers.size(), 2u);
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.lr = 0.01f;
  std::vector<float> x(40, 1.0f), y(20, 2.0f);
  ASSERT_TRUE(workers[0]->Register("x", x, {adam}).ok());
  ASSERT_TRUE(workers[0]->Register("y", y).ok());

  Worker& late = *workers[1];
  auto implicit = late.Register("x", x);
  ASSERT_FALSE(implicit.ok());
  EXPECT_EQ(implicit.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(implicit.status().message().find("registers it with sgd(lr 0.1"), std::string::npos)
      << implicit.status().ToString();
  OptimizerConfig faster = adam;
  faster.lr = 0.02f;
  auto x_id = late.Register("x", x, {faster});
  ASSERT_TRUE(x_id.ok()) << x_id.status().ToString();
  EXPECT_EQ(*x_id, 0u);
  auto y_id = late.Register("y", y);
  ASSERT_TRUE(y_id.ok()) << y_id.status().ToString();
  EXPECT_EQ(*y_id, 1u);

  std::vector<float> gx(x.size(), 0.5f), gy(y.size(), 1.0f);
  std::vector<std::thread> threads;
  for (auto& w : workers) {
    threads.emplace_back([&, wp = w.get()] {
      wp->Push(0, gx.data());
      wp->Push(1, gy.data());
      EXPECT_TRUE(wp->WaitAll().ok());
    });
  }
  for (auto& t : threads) t.join();
  // sgd at 0.1 on y, over the mean of the round's gradients: 2 - 0.1 * (1 + 1) / 2.
  std::vector<float> out(y.size());
  Version version = 0;
  ASSERT_TRUE(late.Wait(late.Pull(1, out.data()), &version).ok());
  EXPECT_EQ(version, 1u);
  for (float v : out) EXPECT_FLOAT_EQ(v, 1.9f);
  for (auto& w : workers) ASSERT_TRUE(w->Leave().ok());
  ASSERT_TRUE(cluster.WaitFinished(std::chrono::seconds(10)).ok());
}

// --- Learning-rate changes ----------------------------------------------------------------

// Two workers change the learning rate between iterations of a bsp job whose tensors span
// both servers (one with the job's sgd, one with its own momentum): every element of the
// model is what the new rate gives from exactly the round SetLearningRate returned, so every
// server switched at that round; the audit log records each change.
TEST(Cluster, LearningRateChangesApplyFromTheRoundTheSchedulerPicksOnEveryServer) {
  constexpr uint32_t kWorkers = 2, kSteps = 9;
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.1f;
  cfg.slice_bytes = 64;  // 16 floats a slice: both tensors span both servers
  const std::string audit = ::testing::TempDir() + "/lr_audit.jsonl";
  std::remove(audit.c_str());
  cfg.audit_log = audit;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());

  OptimizerConfig momentum;
  momentum.kind = OptimizerKind::kMomentum;
  momentum.lr = 0.3f;
  momentum.momentum = 0.5f;
  const std::vector<TensorOptions> options = {{}, {momentum}};
  const std::vector<size_t> sizes = {50, 33};
  std::vector<TensorReference> ref;
  for (size_t t = 0; t < 2; ++t) {
    std::vector<float> init(sizes[t]);
    for (size_t i = 0; i < init.size(); ++i) init[i] = 1.0f - 0.02f * static_cast<float>(i);
    ref.push_back({options[t].optimizer.value_or(cfg.optimizer), init,
                   std::vector<float>(init.size()), std::vector<float>(init.size())});
  }
  // Worker r changes the rate to kRates[r] before its iteration kAt[r].
  const float kRates[kWorkers] = {0.02f, 0.005f};
  const uint32_t kAt[kWorkers] = {3, 6};
  Round changed_at[kWorkers] = {0, 0};

  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), kWorkers);
  std::vector<std::vector<std::vector<float>>> params(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<TensorId> ids;
      for (size_t t = 0; t < 2; ++t) {
        params[rank].push_back(ref[t].w);
        auto id = w.Register(t == 0 ? "w" : "v", params[rank][t], options[t]);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        ids.push_back(*id);
      }
      std::vector<std::vector<float>> grads(2);
      for (uint32_t step = 0; step < kSteps; ++step) {
        if (step == kAt[rank]) {
          auto r = w.SetLearningRate(kRates[rank]);
          ASSERT_TRUE(r.ok()) << r.status().ToString();
          changed_at[rank] = *r;
        }
        for (size_t t = 0; t < 2; ++t) {
          ASSERT_TRUE(w.Wait(w.Pull(ids[t], params[rank][t].data())).ok());
        }
        for (uint32_t t = 0; t < 2; ++t) {
          grads[t].resize(sizes[t]);
          for (uint32_t i = 0; i < sizes[t]; ++i) grads[t][i] = TensorGradient(t, rank, step, i);
          w.Push(ids[t], grads[t].data());
        }
        const Status pushed = w.WaitAll();
        ASSERT_TRUE(pushed.ok()) << pushed.ToString();
      }
      for (size_t t = 0; t < 2; ++t) {
        Version v = 0;
        ASSERT_TRUE(w.Wait(w.Pull(ids[t], params[rank][t].data()), &v).ok());
        EXPECT_EQ(v, kSteps);
      }
    });
  }
  for (auto& th : threads) th.join();
  // Worker r had committed its gradient of step kAt[r] - 1 (round kAt[r] - 1) when it asked:
  // that round, if not yet announced (the other worker's gradient missing), else the next.
  for (uint32_t r = 0; r < kWorkers; ++r) {
    EXPECT_GE(changed_at[r], kAt[r] - 1) << "worker " << r;
    EXPECT_LE(changed_at[r], kAt[r]) << "worker " << r;
  }

  for (uint32_t step = 0; step < kSteps; ++step) {
    for (uint32_t t = 0; t < 2; ++t) {
      TensorReference& tr = ref[t];
      for (uint32_t r = 0; r < kWorkers; ++r) {
        if (step >= changed_at[r]) tr.opt.lr = kRates[r];  // changes in the order made
      }
      tr.Step(t, step, kWorkers);
    }
  }
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    for (size_t t = 0; t < 2; ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        ASSERT_EQ(params[rank][t][i], ref[t].w[i])
            << "worker " << rank << " tensor " << t << " element " << i;
      }
    }
  }
  for (auto& w : workers) ASSERT_TRUE(w->Leave().ok());
  ASSERT_TRUE(cluster.WaitFinished(std::chrono::seconds(10)).ok());

  std::ifstream log(audit);
  std::string line, lr_lines;
  while (std::getline(log, line)) {
    if (line.starts_with("{\"lr\":")) lr_lines += line + "\n";
  }
  EXPECT_EQ(lr_lines,
            fmt::format("{{\"lr\":{{\"from_round\":{},\"value\":0.02,\"worker\":{}}}}}\n"
                        "{{\"lr\":{{\"from_round\":{},\"value\":0.005,\"worker\":{}}}}}\n",
                        changed_at[0], workers[0]->job().worker_id, changed_at[1],
                        workers[1]->job().worker_id));
}

TEST(Cluster, AnObserverThatVanishesDoesNotHoldTheJob) {
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.optimizer.kind = OptimizerKind::kSum;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto observer = StartObserver(cluster);
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  SumWorker sum(*workers[0]);
  ASSERT_TRUE(sum.Iterate(0us));
  (*observer)->Abandon();  // a crash: the job must not wait out the grace period for it
  ASSERT_TRUE(workers[0]->Leave().ok());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(cluster.WaitFinished(std::chrono::seconds(20)).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(Cluster, GradientBudgetStopsEveryWorker) {
  constexpr int kWorkers = 3;
  constexpr uint64_t kBudget = 40;
  Config cfg = TestConfig("dsync:2,2", 1, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.slice_bytes = 1024;
  cfg.max_gradients = kBudget;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), static_cast<size_t>(kWorkers));
  std::vector<std::unique_ptr<SumWorker>> sums;
  for (auto& w : workers) sums.push_back(std::make_unique<SumWorker>(*w));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      // No iteration limit of their own: only the budget stops them (the test's timeout
      // catches a worker that is never told).
      while (!workers[r]->stop_requested() && sums[r]->Iterate(std::chrono::microseconds(500 * (r + 1)))) {
      }
      EXPECT_TRUE(workers[r]->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());
  uint64_t total = 0;
  for (auto& s : sums) {
    EXPECT_GE(s->completed, 1u);
    total += s->completed;
  }
  // Commits in flight when the budget ran out still count (exactly once): at most one more
  // per worker.
  EXPECT_GE(total, kBudget);
  EXPECT_LE(total, kBudget + kWorkers - 1);
  EXPECT_EQ(cluster.scheduler().stats().gradients_committed, total);
}

// Wait() is the caller's sign that it may reuse or free the gradient, also when it returns an
// error: a large push still on its way to the server when the scheduler's link breaks must
// not be read after that. The transport only reads freed memory here, so this fails under the
// sanitizers (scripts/sanitize.sh), not in a plain build: always under ThreadSanitizer
// (nothing orders the transport's reads before Wait's return), under AddressSanitizer when
// the writer calls sendmsg again after the free (most runs).
TEST(Cluster, AGradientMayBeFreedOnceItsPushFailed) {
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.slice_bytes = 1ull << 30;  // one slice: the payload goes out in one long send
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  Worker& w = *workers[0];
  constexpr size_t kFloats = 32u << 20;  // 128 MiB: still being sent when the error comes
  std::vector<float> params(kFloats, 0.5f);
  auto t = w.Register("big", params);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(w.Wait(w.Pull(*t, params.data())).ok());
  auto grad = std::make_unique<std::vector<float>>(kFloats, 0.01f);
  const Handle push = w.Push(*t, grad->data());
  cluster.scheduler().Stop();  // the worker loses the scheduler: every pending operation fails
  EXPECT_FALSE(w.Wait(push).ok());
  grad.reset();
  std::this_thread::sleep_for(200ms);  // the transport would go on sending it meanwhile
  w.Abandon();
}

INSTANTIATE_TEST_SUITE_P(Modes, ModeTest,
                         ::testing::Values("bsp", "dsync:2", "dsync:2,3", "ssp:2", "asp",
                                           "dsync:auto", "dsync:2,3/inverse", "ssp:2/inverse",
                                           "asp/exp:0.5", "dsync:2,3/dc:0.01", "bsp/inverse+dc:0.5",
                                           "dsync:2,3/dca:0.002", "dsync:2,3/inverse+momentum",
                                           "ssp:2/momentum", "bsp/momentum", "asp/momentum",
                                           "dsync:2,3/exp:0.5+dc:0.01+momentum",
                                           "dsync:2,3/inverse+momentum+2", "dsync:auto/momentum",
                                           "asp/inverse+dc:0.01,3", "dsync:auto/dc:0.01+2", "bsp+2", "dsync:2,3+2", "ssp:2+2",
                                           "asp+2", "dsync:auto+2", "dsync:2,3/damp",
                                           "ssp:2/damp:inverse+dc:0.01",
                                           "dsync:2,3/damp:exp:0.5+2", "bsp/damp"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (char& ch : n) {
                             if (ch == ':' || ch == ',' || ch == '/' || ch == '.') ch = '_';
                             if (ch == '+') ch = 'x';
                           }
                           return n;
                         });

}  // namespace
}  // namespace dsync::testing
