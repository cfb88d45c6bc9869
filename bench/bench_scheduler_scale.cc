// The scheduler's decisions at scale, without sockets: the round rule (and, under dsync:auto,
// the policy and the payoff check the scheduler runs beside it) driven by thousands of
// simulated workers in one thread. What it costs the scheduler per commit, per round and
// per membership change, as the workers grow.
//
//   bench_scheduler_scale [--workers 1000,10000] [--modes "bsp;dsync:2;dsync:auto"]
//                         [--commits 200000] [--max-seconds 10] [--changes 200] [--reps 3]
//                         [--jitter 0] [--no-payoff]
//
// Simulated workers commit in turns, in one random order (not by id: the rule's checks may
// stop at the first worker that holds a round up; joiners come last), each on the newest
// version once its pull gate allows (the servers apply every round at once); one worker of
// ten is three times slower and commits on one turn of three. The iteration times dsync:auto's
// policy observes are 10 ms and, for those, 30 ms, each times a factor drawn uniformly from
// [1 - J, 1 + J] with --jitter J: with J = 0 the paces never move once measured, with J > 0
// the reference moves at nearly every commit and the stragglers' ratios with it.
//
// Per commit: what the scheduler does with one (RoundRule::Commit, then CloseReady; under
// dsync:auto first AutoPolicy::Observe and the decision: Decide, DelayPayoff::Gate and the
// allowances that changed; RoundClosed for each round), over the whole run divided by the
// commits. Per round: CloseReady's calls that closed one, timed alone. Per membership
// change: a worker joins and the longest-joined one leaves, each with the policy's
// Join/Leave and a decision. A run stops after --commits or --max-seconds; the runs of one
// size are interleaved over the modes. Under dsync:auto the payoff check measures paces in
// real seconds, so what it does by the end of a run (its phase) depends on how fast the run
// went; the table says it. With --no-payoff the policy's proposals are applied as they come,
// as if every trial passed: the cost of a job that delays its stragglers.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "ps/auto_policy.h"
#include "ps/delay_payoff.h"
#include "ps/round_rule.h"

namespace dsync::bench {
namespace {

struct Options {
  std::vector<uint32_t> workers{1000, 10000};
  std::vector<std::string> modes{"bsp", "dsync:2", "dsync:auto"};
  uint64_t commits = 200000;
  double max_seconds = 10;  // a run stops earlier, after this long
  uint32_t membership_changes = 200;
  int reps = 3;
  double jitter = 0;  // of the observed iteration times, relative
  bool no_payoff = false;  // dsync:auto applies the policy's proposals as they come
};

struct Costs {
  double per_commit_us = 0;
  double per_round_us = 0;
  double per_change_us = 0;
  uint64_t commits = 0;
  uint64_t rounds = 0;
  std::string phase;  // dsync:auto's at the end
};

double Now() {
  return std::chrono::duration<double>(SteadyClock::now().time_since_epoch()).count();
}

// One simulated job: the rule, and under dsync:auto what the scheduler decides with.
class Job {
 public:
  Job(const SyncMode& mode, uint32_t workers, double jitter, bool gate)
      : rule_(mode), gate_(gate), jitter_(jitter) {
    if (mode.adaptive) {
      ps::AutoPolicyOptions o;
      o.max_bound = mode.bound;
      policy_.emplace(o);
      payoff_.emplace(ps::DelayPayoffOptions{});
    }
    for (uint32_t i = 0; i < workers; ++i) (void)Join(/*initial=*/true);
    // Workers do not commit in id order, and the rule's checks may stop at the first worker
    // that holds a round up: one random order, kept.
    std::mt19937 rng(1);
    std::shuffle(order_.begin(), order_.end(), rng);
  }

  Status Join(bool initial) {
    const WorkerId id = next_id_++;
    DSYNC_ASSIGN_OR_RETURN(ps::Admission a, rule_.Join(id, initial));
    sims_.push_back(Sim{a.start_clock, a.gate, (id % 10) == 9, true});
    order_.push_back(id);  // the initial workers are shuffled once they have all joined
    if (policy_) {
      policy_->Join(id);
      payoff_->MembershipChanged();
      Decide();
    }
    return Status::Ok();
  }

  // The longest-joined live worker leaves (the order of commits keeps its place, skipped).
  Status LeaveOldest() {
    while (!sims_[oldest_].live) ++oldest_;
    const WorkerId id = static_cast<WorkerId>(kFirstWorkerId + oldest_);
    DSYNC_RETURN_IF_ERROR(rule_.Remove(id, false).status());
    sims_[oldest_].live = false;
    if (policy_) {
      policy_->Leave(id);
      payoff_->MembershipChanged();
      Decide();
    }
    CloseReady();
    return Status::Ok();
  }

  // The next `attempts` workers in the order of commits (from where the last call stopped;
  // a new turn begins at the order's start) commit if their gate is open, a straggler on
  // one turn of three only, until `most` have. Returns how many committed.
  Result<uint64_t> Step(uint64_t attempts, uint64_t most) {
    uint64_t made = 0;
    for (uint64_t i = 0; i < attempts && made < most; ++i) {
      if (cursor_ >= order_.size()) {
        cursor_ = 0;
        ++turn_;
      }
      const WorkerId id = order_[cursor_++];
      Sim& s = sims_[id - kFirstWorkerId];
      if (!s.live || (s.straggler && turn_ % 3 != 0)) continue;
      if (s.gate > rule_.open_round()) continue;  // its pull still waits
      const Version base = rule_.open_round();
      if (policy_) {
        // Iteration time as the scheduler measures it (begin -> commit): a straggler's is 3x.
        const double noise = jitter_ > 0 ? jitter_ * (2.0 * unit_(jitter_rng_) - 1.0) : 0.0;
        policy_->Observe(id, (s.straggler ? 0.03 : 0.01) * (1.0 + noise));
        Decide();
      }
      DSYNC_ASSIGN_OR_RETURN(ps::CommitResult c, rule_.Commit(id, s.clock, base));
      ++s.clock;
      s.gate = c.gate.value_or(0);
      ++made;
      CloseReady();
    }
    return made;
  }

  size_t size() const { return order_.size(); }  // attempts per turn
  // dsync:auto: what it does at the end of the run ("" in other modes).
  std::string phase() const {
    if (!payoff_) return "";
    if (!gate_) return "no payoff check";
    switch (payoff_->phase()) {
      case ps::DelayPayoff::Phase::kBsp: return "bsp";
      case ps::DelayPayoff::Phase::kTrial: return "trial";
      case ps::DelayPayoff::Phase::kDelaying: return "delaying";
    }
    return "";
  }
  double round_seconds() const { return round_seconds_; }
  uint64_t rounds() const { return rounds_; }

 private:
  struct Sim {
    Clock clock = 0;
    Version gate = 0;
    bool straggler = false;
    bool live = false;
  };

  // As the scheduler's Redecide: the policy proposes, the payoff check gates, a change goes
  // to the rule.
  void Decide() {
    policy_->Decide();
    const ps::AutoDecision& d =
        gate_ ? payoff_->Gate(policy_->decision()) : policy_->decision();
    if (d == applied_) return;
    (void)ps::ApplyDecision(rule_, applied_, d);
    applied_ = d;
  }

  void CloseReady() {
    const auto t0 = SteadyClock::now();
    std::vector<RoundRecord> closed = rule_.CloseReady();
    if (!closed.empty()) {
      round_seconds_ += Seconds(t0, SteadyClock::now());
      rounds_ += closed.size();
    }
    if (payoff_) {
      for (const RoundRecord& r : closed) payoff_->RoundClosed(Now(), r);
    }
  }

  ps::RoundRule rule_;
  std::optional<ps::AutoPolicy> policy_;
  std::optional<ps::DelayPayoff> payoff_;
  ps::AutoDecision applied_;
  bool gate_;  // the payoff check gates the proposals (else applied as they come)
  double jitter_;
  std::uniform_real_distribution<double> unit_{0.0, 1.0};
  std::mt19937 jitter_rng_{2};
  std::vector<Sim> sims_;        // by id - kFirstWorkerId
  std::vector<WorkerId> order_;  // every worker that joined, in the order they commit in
  size_t oldest_ = 0;            // index in sims_ of the longest-joined live worker, or less
  WorkerId next_id_ = kFirstWorkerId;
  uint64_t turn_ = 0;
  size_t cursor_ = 0;
  double round_seconds_ = 0;
  uint64_t rounds_ = 0;
};

Result<Costs> Measure(const SyncMode& mode, uint32_t workers, const Options& o) {
  Job job(mode, workers, o.jitter, !o.no_payoff);
  Costs c;
  const auto t0 = SteadyClock::now();
  // Whole turns without a commit: nobody's gate can open any more.
  uint64_t idle = 0;
  while (c.commits < o.commits && Seconds(t0, SteadyClock::now()) < o.max_seconds) {
    DSYNC_ASSIGN_OR_RETURN(uint64_t made, job.Step(256, o.commits - c.commits));
    idle = made == 0 ? idle + 256 : 0;
    if (idle > 3 * job.size() + 256) {
      return Error(StatusCode::kInternal, "{} with {} workers: no worker could commit",
                   mode.ToString(), workers);
    }
    c.commits += made;
  }
  c.per_commit_us = Seconds(t0, SteadyClock::now()) * 1e6 / static_cast<double>(c.commits);
  c.rounds = job.rounds();
  c.phase = job.phase();
  c.per_round_us = c.rounds ? job.round_seconds() * 1e6 / static_cast<double>(c.rounds) : 0;
  const auto t1 = SteadyClock::now();
  for (uint32_t i = 0; i < o.membership_changes; ++i) {
    DSYNC_RETURN_IF_ERROR(job.Join(/*initial=*/false));
    DSYNC_RETURN_IF_ERROR(job.LeaveOldest());
  }
  c.per_change_us = Seconds(t1, SteadyClock::now()) * 1e6 / (2.0 * o.membership_changes);
  return c;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps scheduler decisions at scale (round rule, dsync:auto's policy), no sockets"};
  app.add_option("--workers", o.workers, "simulated workers")->delimiter(',');
  app.add_option("--modes", o.modes, "round modes: bsp, dsync:K[,Q], dsync:auto[:KMAX]")
      ->delimiter(';');
  app.add_option("--commits", o.commits, "commits per run, at most");
  app.add_option("--max-seconds", o.max_seconds, "a run stops after this long");
  app.add_option("--changes", o.membership_changes, "joins (each with a leave) per run");
  app.add_option("--reps", o.reps, "runs per row, interleaved over the modes");
  app.add_option("--jitter", o.jitter, "relative noise of dsync:auto's observed times")
      ->check(CLI::Range(0.0, 0.9));
  app.add_flag("--no-payoff", o.no_payoff,
               "dsync:auto applies the policy's proposals without the payoff check: a job "
               "that delays its stragglers from their first measurement on");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();
  std::vector<SyncMode> modes;
  for (const std::string& m : o.modes) {
    auto mode = SyncMode::Parse(m);
    if (!mode.ok() || mode->kind != SyncKind::kRound) {
      std::fprintf(stderr, "--modes: '%s' is not a round mode (bsp, dsync:K[,Q], dsync:auto)\n",
                   m.c_str());
      return 2;
    }
    modes.push_back(*mode);
  }
  std::printf("%8s %-12s %9s %8s %-28s %9s %14s  %s\n", "workers", "mode", "commits", "rounds",
              "us/commit (min..max)", "us/round", "us/join|leave", "auto's phase at the end");
  nlohmann::json rows = nlohmann::json::array();
  for (uint32_t w : o.workers) {
    std::vector<std::vector<Costs>> runs(modes.size());
    for (int rep = 0; rep < o.reps; ++rep) {
      for (size_t k = 0; k < modes.size(); ++k) {
        auto c = Measure(modes[k], w, o);
        if (!c.ok()) {
          std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
          return 1;
        }
        runs[k].push_back(*c);
      }
    }
    for (size_t k = 0; k < modes.size(); ++k) {
      std::vector<double> commit, round, change;
      for (const Costs& c : runs[k]) {
        commit.push_back(c.per_commit_us);
        round.push_back(c.per_round_us);
        change.push_back(c.per_change_us);
      }
      const Costs& last = runs[k].back();
      const std::string spread = fmt::format("{:.3f} ({:.3f}..{:.3f})", Median(commit),
                                             Min(commit), Max(commit));
      std::printf("%8u %-12s %9lu %8lu %-28s %9.2f %14.1f  %s\n", w, modes[k].ToString().c_str(),
                  static_cast<unsigned long>(last.commits),
                  static_cast<unsigned long>(last.rounds), spread.c_str(), Median(round),
                  Median(change), last.phase.c_str());
      rows.push_back({{"workers", w}, {"mode", modes[k].ToString()}, {"jitter", o.jitter},
                      {"commits", last.commits},
                      {"rounds", last.rounds}, {"us_per_commit", Median(commit)},
                      {"us_per_commit_min", Min(commit)}, {"us_per_commit_max", Max(commit)},
                      {"us_per_round", Median(round)}, {"us_per_membership_change", Median(change)},
                      {"auto_phase", last.phase}});
    }
  }
  std::printf("RESULT %s\n",
              nlohmann::json{{"bench", "scheduler_scale"}, {"rows", rows}}.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
