#include "ps/stale_worth.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace dsync::ps {

StaleWorth::StaleWorth(StaleWorthOptions options) : opt_(options) {
  opt_.memory = std::max(opt_.memory, 1.0);
  opt_.min_rounds = std::clamp(opt_.min_rounds, 1e-3, opt_.memory / 2);
}

bool StaleWorth::Add(const RoundRecord& round, std::span<const double> dots,
                     std::span<const uint8_t> measured, double weight) {
  if (!(weight > 0) || !std::isfinite(weight)) return false;
  const size_t n = std::min({round.members.size(), dots.size(), measured.size()});
  double fresh = 0;
  size_t fresh_count = 0;
  for (size_t m = 0; m < n; ++m) {
    if (measured[m] && std::isfinite(dots[m]) &&
        Staleness(round.round, round.members[m].base) == 0) {
      fresh += dots[m];
      ++fresh_count;
    }
  }
  if (fresh_count == 0) return false;
  const double fresh_mean = fresh / static_cast<double>(fresh_count);
  if (!std::isfinite(fresh_mean)) return false;
  const double keep = std::pow(1.0 - 1.0 / opt_.memory, weight);
  bool used = false;
  for (size_t m = 0; m < n; ++m) {
    const uint64_t s = Staleness(round.round, round.members[m].base);
    if (s == 0 || !measured[m] || !std::isfinite(dots[m])) continue;
    Sums next = sums_[Level(s)];
    next.stale = next.stale * keep + weight * dots[m];
    next.fresh = next.fresh * keep + weight * fresh_mean;
    next.rounds = next.rounds * keep + weight;
    // Values near the largest double would overflow the sums and leave the worth NaN for good.
    if (!std::isfinite(next.stale) || !std::isfinite(next.fresh)) continue;
    sums_[Level(s)] = next;
    used = true;
  }
  return used;
}

bool StaleWorth::Enough(const Sums& sum) const {
  // The tolerance: n rounds faded with a memory far longer than n count n, but for rounding.
  return sum.rounds >= opt_.min_rounds - 1e-6 && sum.fresh > 0;
}

double StaleWorth::Estimate(uint32_t level) const {
  const Sums& sum = sums_[level];
  if (Enough(sum)) {
    return std::clamp(sum.stale / sum.fresh, -1.0, 1.0);
  }
  return 1.0 / (1.0 + static_cast<double>(level));
}

bool StaleWorth::Measured(uint64_t s) const {
  if (s == 0) return true;
  return Enough(sums_[Level(s)]);
}

double StaleWorth::Worth(uint64_t s) const {
  if (s == 0) return 1.0;
  // Capped by what fresher gradients were measured to be worth (not by their prior: a level
  // nobody measured says nothing of the levels that were).
  double worth = Estimate(Level(s));
  for (uint32_t level = 1; level < Level(s); ++level) {
    if (Measured(level)) worth = std::min(worth, Estimate(level));
  }
  return worth;
}

std::string StaleWorth::Describe(uint32_t levels) const {
  std::string out;
  for (uint32_t level = 1; level <= kLevels; ++level) {
    if (!(levels & (1u << level))) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{:.2f} at staleness {}{}", Worth(level), level,
                       level == kLevels ? "+" : "");
    if (Measured(level)) {
      out += fmt::format(" (measured over {:.0f} rounds)", sums_[level].rounds);
    } else {
      out += " (not measured yet)";
    }
  }
  return out;
}

}  // namespace dsync::ps
