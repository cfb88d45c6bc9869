// What a gradient s rounds stale is worth next to a fresh one, measured from the servers'
// agreement reports (ps/gradient_agreement.h): dsync:auto's cost of staleness.
//
// Each report pairs every stale gradient's d with the mean d of the same round's fresh
// gradients on the same server; per staleness, the worth is the ratio of the two sums
// (a ratio estimator: the sum of the fresh means is positive and steady where single rounds
// are noisy). Older reports fade (exponential forgetting over `memory` rounds per
// staleness), so the worth follows the job as its learning rate and its landscape change.
// Until a staleness has been reported in `min_rounds` rounds, its worth is the 1 / (1 + s) of
// staleness-aware asynchronous SGD. A gradient is never worth more than a fresher one that
// was measured (the values are noisy; this keeps the noise from crediting staleness) and its
// worth lies in [-1, 1]: a stale gradient may point against where the model now goes, and
// then it costs.
// Pure: the scheduler feeds it the reports, the unit tests synthetic ones.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "dsync/types.h"

namespace dsync::ps {

// Counted in rounds: the servers' reports of one round count 1 together (each 1 / servers).
struct StaleWorthOptions {
  double memory = 200;       // rounds per staleness after which one counts 1/e
  // Rounds per staleness (faded ones counting for less) before its measurement is used; at
  // most half the memory, or it could never be reached.
  double min_rounds = 24;
};

class StaleWorth {
 public:
  // Staleness 1 .. kLevels-1 are measured apart, kLevels and staler together.
  static constexpr uint32_t kLevels = 8;

  explicit StaleWorth(StaleWorthOptions options = {});

  // One server's report of `round`: each member's d where `measured` (member order), counting
  // `weight` of a round (1 / the servers reporting). False when it said nothing: no measured
  // fresh or stale gradient, or values that would make the sums overflow.
  bool Add(const RoundRecord& round, std::span<const double> dots,
           std::span<const uint8_t> measured, double weight = 1.0);

  // The worth of a gradient `s` rounds stale, in [-1, 1]; 1 for s = 0.
  double Worth(uint64_t s) const;
  // Whether Worth(s) is measured rather than 1 / (1 + s).
  bool Measured(uint64_t s) const;
  // "0.61 at staleness 2 (measured over 40 rounds)", for the given staleness levels
  // (a bitmask: bit L for level L) as the policy's log lines show them.
  std::string Describe(uint32_t levels) const;

  static uint32_t Level(uint64_t s) {
    return s >= kLevels ? kLevels : static_cast<uint32_t>(s);
  }

 private:
  struct Sums {
    double stale = 0;   // Σ d of stale gradients at this level
    double fresh = 0;   // Σ mean fresh d of their rounds
    double rounds = 0;  // of reports, faded
  };
  bool Enough(const Sums& sum) const;     // measured enough to be used
  double Estimate(uint32_t level) const;  // measured or prior, before the monotone cap

  StaleWorthOptions opt_;
  std::array<Sums, kLevels + 1> sums_{};  // [0] unused
};

}  // namespace dsync::ps
