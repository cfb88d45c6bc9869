// When a job's stale gradients make it unstable: the round from which the size of the
// gradients its workers commit grows fast. The scheduler feeds it each closed round's
// gradient sizes and, the round it fires, damps the job (StalenessPolicy "damp").
//
// Why the size: a bounded job whose step is too large for stale gradients diverges within a
// few dozen rounds, and its gradients grow before its accuracy falls (docs/benchmarks.md,
// "Why the bound's stable step is so small"); a job that is stable keeps their size level
// or shrinking. Two running means of the round's size tell the two apart: a slow one (the
// job's level) and a fast one (where it is going now); growth is the fast one past `ratio`
// times the slow one. Once fired it stays fired: damping is for the rest of the job.
// Pure: the scheduler feeds it the sizes, the unit tests synthetic ones.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "dsync/types.h"

namespace dsync::ps {

struct GrowthWatchOptions {
  // Per round, how much of each running mean the newest round replaces: the slow mean
  // remembers about 50 rounds, the fast one about 5.
  double slow = 0.02;
  double fast = 0.2;
  // The fast mean above `ratio` times the slow one is growth. Diverging jobs of the sweep
  // reached 2.1-2.6 within 20 rounds, stable ones peaked at 1.2-1.6 over 10 epochs; with 2
  // some diverging jobs were damped only after 200 rounds, with 1.75 all by round 12 and
  // no stable one (docs/benchmarks.md, "The staleness policy damp").
  double ratio = 1.75;
  // Rounds measured before growth is judged: the first rounds set the job's level.
  uint32_t warmup = 5;
};

// The sum of the squares of `values`, for a worker's gradient size (CommitProof::size):
// float lanes the compiler vectorizes, summed in double per block (no BLAS in the core
// library for one reduction).
double SumOfSquares(std::span<const float> values);

class GrowthWatch {
 public:
  explicit GrowthWatch(GrowthWatchOptions options = {});

  // One closed round: the sizes (root mean square of the elements) of its members'
  // gradients; a size of 0 or less is not measured (an empty commit, a commit replayed from
  // a journal, a gradient of zeros). The round's size is their lower median: one worker's report cannot move it
  // where three or more were measured. A size that is not a finite number counts as
  // infinitely large and fires at once. `sizes` is reordered. True at the round it fires,
  // and never again.
  bool RoundClosed(Round round, std::span<float> sizes);

  std::optional<Round> fired_at() const { return fired_at_; }
  uint64_t rounds_measured() const { return measured_; }
  double slow_mean() const { return slow_; }
  double fast_mean() const { return fast_; }
  // The largest fast / slow ratio after the warm-up, and its round: how close a job that
  // was never damped came to it.
  double peak_ratio() const { return peak_ratio_; }
  Round peak_round() const { return peak_round_; }
  // Why it fired, for the scheduler's log and audit lines ("" before).
  const std::string& reason() const { return reason_; }

 private:
  GrowthWatchOptions opt_;
  uint64_t measured_ = 0;
  double slow_ = 0.0;
  double fast_ = 0.0;
  double peak_ratio_ = 0.0;
  Round peak_round_ = 0;
  std::optional<Round> fired_at_;
  std::string reason_;
};

}  // namespace dsync::ps
