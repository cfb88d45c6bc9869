#include "ps/auto_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dsync::ps {

AutoPolicy::AutoPolicy(AutoPolicyOptions options) : opt_(options) {}

void AutoPolicy::Join(WorkerId w) { workers_.try_emplace(w); }

void AutoPolicy::Leave(WorkerId w) { workers_.erase(w); }

void AutoPolicy::Observe(WorkerId w, double seconds) {
  auto it = workers_.find(w);
  if (it == workers_.end() || !(seconds >= 0)) return;
  Track& t = it->second;
  const size_t window = std::max<uint32_t>(1, opt_.window);
  if (t.recent.size() < window) {
    t.recent.push_back(seconds);
  } else {
    t.recent[t.samples % window] = seconds;
  }
  ++t.samples;
  scratch_ = t.recent;
  auto mid = scratch_.begin() + static_cast<std::ptrdiff_t>(scratch_.size() / 2);
  std::nth_element(scratch_.begin(), mid, scratch_.end());
  t.estimate = *mid;
}

bool AutoPolicy::Decide() {
  std::vector<double> measured;
  for (const auto& [id, t] : workers_) {
    if (t.samples >= opt_.min_samples) measured.push_back(t.estimate);
  }
  AutoDecision next;
  reference_ = 0;
  if (!measured.empty()) {
    std::sort(measured.begin(), measured.end());
    reference_ = measured[(measured.size() - 1) / 2];  // lower median
  }
  uint32_t fast = 0;
  for (auto& [id, t] : workers_) {
    uint32_t allow = 0;
    if (reference_ > 0 && t.samples >= opt_.min_samples && workers_.size() > 1) {
      const double ratio = t.estimate / reference_;
      const bool was = t.straggler;
      t.straggler = t.straggler ? ratio >= opt_.recover_ratio : ratio > opt_.slow_ratio;
      if (t.straggler) {
        // ceil, forgiving rounding noise: exactly 3x needs 3 rounds, not 4.
        const double want = std::ceil(ratio - 1e-6) + opt_.margin;
        allow = static_cast<uint32_t>(std::min<double>(opt_.max_bound, want));
        if (was && allow < t.allowance && allow + 2 > t.allowance) allow = t.allowance;
      }
    } else {
      t.straggler = false;  // not measured yet: waited for, as in bsp
    }
    t.allowance = allow;
    next.allowance[id] = allow;
    fast += allow == 0 ? 1 : 0;
  }
  next.quorum = fast == workers_.size() ? SyncMode::kAll : std::max<uint32_t>(fast, 1);
  const bool changed = next != decision_;
  decision_ = std::move(next);
  return changed;
}

std::string AutoPolicy::Describe(const AutoDecision& applied) const {
  std::string out = applied.quorum == SyncMode::kAll
                        ? fmt::format("quorum all {}", workers_.size())
                        : fmt::format("quorum {} of {}", applied.quorum, workers_.size());
  for (const auto& [id, allow] : applied.allowance) {
    if (allow == 0) continue;
    auto it = workers_.find(id);
    out += fmt::format("; worker {} allowed {} round(s) ({:.1f}x)", id, allow,
                       reference_ > 0 && it != workers_.end() ? it->second.estimate / reference_
                                                              : 0.0);
  }
  if (applied.quorum == SyncMode::kAll) {
    out += " (every worker waited for, as bsp)";
    for (const auto& [id, t] : workers_) {
      if (t.straggler && reference_ > 0) {
        out += fmt::format("; worker {} is {:.1f}x slower", id, t.estimate / reference_);
      }
    }
  }
  return out;
}

}  // namespace dsync::ps
