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
  // Runs at every commit the scheduler can time: no allocation once the workers are known,
  // and the reference by selection, not a sort.
  scratch_.clear();
  for (const auto& [id, t] : workers_) {
    if (t.samples >= opt_.min_samples) scratch_.push_back(t.estimate);
  }
  reference_ = 0;
  if (!scratch_.empty()) {
    auto mid = scratch_.begin() + static_cast<std::ptrdiff_t>((scratch_.size() - 1) / 2);
    std::nth_element(scratch_.begin(), mid, scratch_.end());
    reference_ = *mid;  // lower median
  }
  // The decision holds every known worker: rebuilt only when workers joined or left since.
  bool changed = decision_.allowance.size() != workers_.size() ||
                 !std::equal(workers_.begin(), workers_.end(), decision_.allowance.begin(),
                             [](const auto& a, const auto& b) { return a.first == b.first; });
  if (changed) {
    decision_.allowance.clear();
    for (const auto& [id, t] : workers_) {
      decision_.allowance.emplace_hint(decision_.allowance.end(), id, 0);
    }
  }
  uint32_t fast = 0;
  auto out = decision_.allowance.begin();
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
    changed = changed || out->second != allow;
    out->second = allow;
    ++out;
    fast += allow == 0 ? 1 : 0;
  }
  const uint32_t quorum =
      fast == workers_.size() ? SyncMode::kAll : std::max<uint32_t>(fast, 1);
  changed = changed || quorum != decision_.quorum;
  decision_.quorum = quorum;
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
