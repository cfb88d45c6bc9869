#include "ps/auto_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "ps/round_rule.h"

namespace dsync::ps {

std::vector<Allowances::Entry>::const_iterator Allowances::Find(WorkerId w) const {
  return std::lower_bound(entries_.begin(), entries_.end(), w,
                          [](const Entry& e, WorkerId id) { return e.first < id; });
}

uint32_t Allowances::at(WorkerId w) const {
  auto it = Find(w);
  return it != entries_.end() && it->first == w ? it->second : 0;
}

void Allowances::Set(WorkerId w, uint32_t allowance) {
  auto it = entries_.begin() + (Find(w) - entries_.cbegin());
  const bool here = it != entries_.end() && it->first == w;
  if (allowance == 0) {
    if (here) entries_.erase(it);
  } else if (here) {
    it->second = allowance;
  } else {
    entries_.insert(it, {w, allowance});
  }
}

Status ApplyDecision(RoundRule& rule, const AutoDecision& from, const AutoDecision& to) {
  Status first = Status::Ok();
  auto keep = [&](Status st) {
    if (first.ok() && !st.ok()) first = std::move(st);
  };
  for (const auto& [id, allowance] : from.allowance) {
    if (!to.allowance.contains(id) && rule.is_live(id)) keep(rule.SetAllowance(id, 0));
  }
  for (const auto& [id, allowance] : to.allowance) {
    if (rule.is_live(id)) keep(rule.SetAllowance(id, allowance));
  }
  keep(rule.SetQuorum(to.quorum));
  return first;
}

AutoPolicy::AutoPolicy(AutoPolicyOptions options) : opt_(options) {
  // A straggler recovers below the threshold that made it one (hysteresis); a recovery
  // threshold above it would flap, and would break Decide's single pass over each end.
  opt_.recover_ratio = std::min(opt_.recover_ratio, opt_.slow_ratio);
}

void AutoPolicy::Join(WorkerId w) { workers_.try_emplace(w); }

void AutoPolicy::Leave(WorkerId w) {
  auto it = workers_.find(w);
  if (it == workers_.end()) return;
  Track& t = it->second;
  if (t.measured) {
    const Key key{t.estimate, w};
    Unplace(key);
    (t.straggler ? slow_ : fast_).erase(key);
  }
  if (t.allowance > 0) {
    decision_.allowance.Set(w, 0);
    left_delayed_ = true;
  }
  workers_.erase(it);
}

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
  const double before = t.estimate;
  t.estimate = *mid;
  if (!t.measured) {
    if (t.samples < opt_.min_samples) return;
    // Measured from now on: in the orders (its nodes are allocated here, once).
    t.measured = true;
    Place({t.estimate, w});
    fast_.insert({t.estimate, w});
    return;
  }
  if (before == t.estimate) return;
  Order::node_type node = Unplace({before, w});
  node.value().first = t.estimate;
  PlaceNode(std::move(node));
  Rekey(t.straggler ? slow_ : fast_, {before, w}, {t.estimate, w});
  if (t.straggler && !t.dirty) {
    t.dirty = true;
    dirty_.push_back(w);
  }
}

void AutoPolicy::Place(Key key) {
  Order fresh;  // a node of its own (the one allocation), placed as any other
  fresh.insert(key);
  PlaceNode(fresh.extract(fresh.begin()));
}

void AutoPolicy::PlaceNode(Order::node_type node) {
  if (low_.empty() || node.value() <= *low_.rbegin()) {
    low_.insert(std::move(node));
  } else {
    high_.insert(std::move(node));
  }
  Balance();
}

AutoPolicy::Order::node_type AutoPolicy::Unplace(Key key) {
  auto it = low_.find(key);
  Order::node_type node = it != low_.end() ? low_.extract(it) : high_.extract(key);
  Balance();
  return node;
}

void AutoPolicy::Balance() {
  while (low_.size() > high_.size() + 1) high_.insert(low_.extract(std::prev(low_.end())));
  while (low_.size() < high_.size()) low_.insert(high_.extract(high_.begin()));
}

void AutoPolicy::Rekey(Order& order, Key from, Key to) {
  Order::node_type node = order.extract(from);
  node.value() = to;
  order.insert(std::move(node));
}

bool AutoPolicy::JudgeAllowance(WorkerId w, Track& t, bool was) {
  const double ratio = t.estimate / reference_;
  // ceil, forgiving rounding noise: exactly 3x needs 3 rounds, not 4.
  const double want = std::ceil(ratio - kStepSlack) + opt_.margin;
  uint32_t allow = static_cast<uint32_t>(std::min<double>(opt_.max_bound, want));
  if (was && allow < t.allowance && allow + 2 > t.allowance) allow = t.allowance;
  t.dirty = false;
  if (allow == t.allowance) return false;
  t.allowance = allow;
  decision_.allowance.Set(w, allow);
  return true;
}

bool AutoPolicy::Unstraggle(WorkerId w, Track& t) {
  const Key key{t.estimate, w};
  fast_.insert(slow_.extract(key));
  t.straggler = false;
  t.dirty = false;
  if (t.allowance == 0) return false;
  t.allowance = 0;
  decision_.allowance.Set(w, 0);
  return true;
}

void AutoPolicy::MarkCrossings(double before) {
  if (slow_.empty() || !(before > 0) || opt_.max_bound <= opt_.margin) return;
  // A straggler's allowance is min(max_bound, ceil(x - slack) + margin), x its estimate over
  // the reference: it steps where x = j + slack, and above j = max_bound - margin - 1 the cap
  // holds it. x crossed such a step, as the reference went from `before` to reference_,
  // exactly where its estimate lies between the step times each of the two references.
  // Widened by a relative 1e-9 against rounding: judging a straggler again whose step did
  // not change gives the allowance it has.
  const double lo_ref = std::min(before, reference_);
  const double hi_ref = std::max(before, reference_);
  const double top = static_cast<double>(opt_.max_bound - opt_.margin) - 1.0;
  const double first = std::max(0.0, std::floor(slow_.begin()->first / hi_ref) - 1.0);
  const double last = std::min(top, std::ceil(slow_.rbegin()->first / lo_ref) + 1.0);
  for (double j = first; j <= last;) {
    const double step = j + kStepSlack;
    const double from = step * lo_ref * (1.0 - 1e-9);
    const double to = step * hi_ref * (1.0 + 1e-9);
    auto it = slow_.lower_bound({from, 0});
    for (; it != slow_.end() && it->first <= to; ++it) {
      Track& t = workers_.at(it->second);
      if (!t.dirty) {
        t.dirty = true;
        dirty_.push_back(it->second);
      }
    }
    if (it == slow_.end()) break;
    // The next straggler's ratio lies past step j: on to the first step it may cross (one
    // below, against rounding), skipping the steps no straggler is near.
    j = std::max(j + 1.0, std::floor(it->first / hi_ref) - 1.0);
  }
}

bool AutoPolicy::Decide() {
  // Runs at every commit the scheduler can time: its cost is that of what changed (see the
  // header).
  const double before = reference_;
  reference_ = low_.empty() ? 0 : low_.rbegin()->first;  // the lower median
  bool changed = std::exchange(left_delayed_, false);
  if (!(reference_ > 0) || workers_.size() <= 1) {
    // Nobody measured against anything: every worker is waited for, as in bsp.
    while (!slow_.empty()) {
      const WorkerId w = slow_.begin()->second;
      changed = Unstraggle(w, workers_.at(w)) || changed;
    }
  } else {
    // Fast workers past the straggler threshold, the slowest first.
    while (!fast_.empty() && fast_.rbegin()->first / reference_ > opt_.slow_ratio) {
      const Key key = *fast_.rbegin();
      slow_.insert(fast_.extract(key));
      Track& t = workers_.at(key.second);
      t.straggler = true;
      changed = JudgeAllowance(key.second, t, /*was=*/false) || changed;
    }
    // Stragglers back under the recovery threshold, the fastest first.
    while (!slow_.empty() && !(slow_.begin()->first / reference_ >= opt_.recover_ratio)) {
      const WorkerId w = slow_.begin()->second;
      changed = Unstraggle(w, workers_.at(w)) || changed;
    }
    if (before != reference_) MarkCrossings(before);
    for (WorkerId w : dirty_) {
      auto it = workers_.find(w);
      if (it == workers_.end() || !it->second.dirty || !it->second.straggler) continue;
      changed = JudgeAllowance(w, it->second, /*was=*/true) || changed;
    }
  }
  dirty_.clear();
  const size_t delayed = decision_.allowance.size();
  const uint32_t quorum =
      delayed == 0 ? SyncMode::kAll
                   : static_cast<uint32_t>(std::max<size_t>(workers_.size() - delayed, 1));
  changed = changed || quorum != decision_.quorum;
  decision_.quorum = quorum;
  return changed;
}

std::string AutoPolicy::Describe(const AutoDecision& applied) const {
  std::string out = applied.quorum == SyncMode::kAll
                        ? fmt::format("quorum all {}", workers_.size())
                        : fmt::format("quorum {} of {}", applied.quorum, workers_.size());
  for (const auto& [id, allow] : applied.allowance) {
    auto it = workers_.find(id);
    out += fmt::format("; worker {} allowed {} round(s) ({:.1f}x)", id, allow,
                       reference_ > 0 && it != workers_.end() ? it->second.estimate / reference_
                                                              : 0.0);
  }
  if (applied.quorum == SyncMode::kAll) {
    out += " (every worker waited for, as bsp)";
    // In id order, as the allowances are (a log line: the copy costs nothing that matters).
    std::vector<Key> slow(slow_.begin(), slow_.end());
    std::sort(slow.begin(), slow.end(),
              [](const Key& a, const Key& b) { return a.second < b.second; });
    for (const auto& [estimate, id] : slow) {
      if (reference_ > 0) {
        out += fmt::format("; worker {} is {:.1f}x slower", id, estimate / reference_);
      }
    }
  }
  return out;
}

}  // namespace dsync::ps
