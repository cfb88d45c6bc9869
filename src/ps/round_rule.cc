#include "ps/round_rule.h"

#include <fmt/format.h>

#include <algorithm>

namespace dsync::ps {

uint32_t StagingWindow(const SyncMode& mode) {
  switch (mode.kind) {
    case SyncKind::kRound:
      return static_cast<uint32_t>(std::min<uint64_t>(uint64_t{mode.bound} + 2, UINT32_MAX));
    case SyncKind::kSsp: return 3;
    case SyncKind::kAsp: return kAspBacklog + 2;
  }
  return 2;
}

uint32_t StagingWindow(const SyncMode& mode, uint32_t replicas) {
  const uint64_t w = StagingWindow(mode);
  if (replicas <= 1) return static_cast<uint32_t>(w);
  return static_cast<uint32_t>(std::min<uint64_t>(2 * w + kReplicaLagRounds, UINT32_MAX));
}

RoundRule::RoundRule(SyncMode mode) : mode_(mode) {
  if (mode_.kind == SyncKind::kRound && mode_.bound == 0) mode_.quorum = SyncMode::kAll;
}

uint32_t RoundRule::live_workers() const { return live_; }

bool RoundRule::has_queued() const { return !ready_.empty() || !queued_.empty(); }

uint64_t RoundRule::BlockingKey(const WorkerState& w) {
  // Closing round r without w pushes w's in-progress gradient to round r + 1 at the earliest:
  // allowed while r + 1 - b <= D_w, i.e. b + D_w >= r + 1. Saturating: a version near 2^64 (a
  // checkpoint's) must not wrap to a key that holds every round.
  const Version b = std::max(w.begun.value_or(0), w.floor);
  return b > UINT64_MAX - w.bound ? UINT64_MAX : b + w.bound;
}

void RoundRule::Reindex(WorkerState& w) {
  if (w.blocking_key) {
    auto it = blocking_.find(*w.blocking_key);
    if (--it->second == 0) blocking_.erase(it);
    w.blocking_key.reset();
  }
  if (!RoundMode() || !w.live || !w.queue.empty()) return;
  w.blocking_key = BlockingKey(w);
  ++blocking_[*w.blocking_key];
}

std::string RoundRule::CheckIndex() const {
  uint32_t live = 0, late = 0, contributing = 0;
  std::vector<WorkerId> queued;
  std::map<uint64_t, uint32_t> blocking;
  for (const auto& [id, w] : workers_) {
    if (!w.queue.empty()) queued.push_back(id);
    if (!w.live) continue;
    ++live;
    if (!RoundMode()) continue;
    if (w.join_round > open_round_) {
      ++late;
    } else if (!w.queue.empty()) {
      ++contributing;
    }
    if (w.queue.empty()) ++blocking[BlockingKey(w)];
  }
  std::string out;
  if (live != live_) out += fmt::format("live {} kept {}; ", live, live_);
  if (late != late_joiners_) out += fmt::format("late joiners {} kept {}; ", late, late_joiners_);
  if (contributing != contributing_) {
    out += fmt::format("contributing {} kept {}; ", contributing, contributing_);
  }
  std::vector<WorkerId> kept = queued_;
  std::sort(kept.begin(), kept.end());
  if (queued != kept) out += fmt::format("{} queued, {} kept; ", queued.size(), kept.size());
  if (blocking != blocking_) out += "the blocking bases differ; ";
  return out;
}

bool RoundRule::is_live(WorkerId w) const {
  auto it = workers_.find(w);
  return it != workers_.end() && it->second.live;
}

Status RoundRule::StartAt(Round round, Clock clock) {
  if (!workers_.empty() || stats_.rounds_closed > 0) {
    return Error(StatusCode::kFailedPrecondition, "a job can only start from a checkpoint before "
                                                  "any worker joined");
  }
  open_round_ = round;
  start_round_ = round;
  start_clock_ = clock;
  return Status::Ok();
}

Result<Admission> RoundRule::Join(WorkerId id, bool initial) {
  if (workers_.contains(id)) {
    return Error(StatusCode::kAlreadyExists, "worker {} has already joined", id);
  }
  WorkerState w;
  w.bound = mode_.adaptive || finished_ ? 0 : mode_.bound;
  // A new worker's clocks continue from the slowest live worker, so that ssp gates of the
  // others never wait for clocks it will not produce.
  std::optional<Clock> min_clock;
  for (const auto& [other_id, other] : workers_) {
    if (other.live) min_clock = std::min(min_clock.value_or(other.next_clock), other.next_clock);
  }
  w.next_clock = min_clock.value_or(start_clock_);
  if (RoundMode()) {
    w.join_round = initial ? open_round_ : open_round_ + 1;
    // As if its last gradient had gone to round join_round - 1: the first gradient can then
    // be placed in join_round or earlier within the bound.
    w.floor = initial ? start_round_ : SaturatingSub(w.join_round, w.bound);
  } else {
    w.join_round = open_round_;
    w.floor = mode_.kind == SyncKind::kSsp ? open_round_ : 0;
  }
  Admission a{w.join_round, w.next_clock, w.floor};
  ++live_;
  if (RoundMode() && w.join_round > open_round_) ++late_joiners_;
  Reindex(workers_.emplace(id, std::move(w)).first->second);
  return a;
}

Status RoundRule::Begin(WorkerId id, Clock clock, Version base) {
  auto it = workers_.find(id);
  if (it == workers_.end() || !it->second.live) {
    return Error(StatusCode::kFailedPrecondition, "worker {} is not a live member", id);
  }
  WorkerState& w = it->second;
  if (clock != w.next_clock) return Status::Ok();  // a late report about an older clock
  if (base > open_round_) {
    return Error(StatusCode::kInvalidArgument,
                 "worker {} reports base version {} but only {} rounds have closed", id, base,
                 open_round_);
  }
  w.begun = std::max(base, w.begun.value_or(0));
  Reindex(w);
  return Status::Ok();
}

Result<CommitResult> RoundRule::Commit(WorkerId id, Clock clock, Version base, bool empty) {
  auto it = workers_.find(id);
  if (it == workers_.end() || !it->second.live) {
    return Error(StatusCode::kAborted,
                 "worker {} is not a live member (it left or was declared dead); its gradient "
                 "of clock {} is refused",
                 id, clock);
  }
  WorkerState& w = it->second;
  if (clock != w.next_clock) {
    return Error(StatusCode::kInvalidArgument, "worker {} commits clock {} but its next clock is {}",
                 id, clock, w.next_clock);
  }
  if (empty) {
    base = RoundMode() ? open_round_ + w.queue.size() : open_round_;
  } else if (base > open_round_) {
    return Error(StatusCode::kInvalidArgument,
                 "worker {} commits a gradient on version {} but only {} rounds have closed", id,
                 base, open_round_);
  } else if (base < w.floor) {
    return Error(StatusCode::kFailedPrecondition,
                 "worker {}: gradient of clock {} was computed on version {}, older than the "
                 "delay bound allows (>= {}); pull the model before computing",
                 id, clock, base, w.floor);
  }
  ++stats_.gradients_committed;
  ++w.next_clock;
  w.begun.reset();
  CommitResult result;
  if (RoundMode()) {
    result.round = open_round_ + w.queue.size();
    if (w.queue.empty()) {
      queued_.push_back(id);
      if (w.join_round <= open_round_) ++contributing_;
    }
    w.queue.push_back({clock, base});
    w.floor = SaturatingSub(result.round + 1, w.bound);
    Reindex(w);
    result.gate = w.floor;
    return result;
  }
  // ssp / asp: a round of its own, decided now.
  RoundRecord rec;
  rec.round = open_round_++;
  rec.members.push_back({id, clock, base});
  rec.live_workers = live_;
  rec.quorum_needed = 1;
  rec.live_members = 1;
  stats_.max_staleness =
      std::max<uint32_t>(stats_.max_staleness, static_cast<uint32_t>(rec.round - base));
  ++stats_.rounds_closed;
  ++stats_.gradients_placed;
  ready_.push_back(std::move(rec));
  result.round = open_round_ - 1;
  if (mode_.kind == SyncKind::kAsp) {
    // Pulls wait only when the servers have not applied this worker's gradients of more than
    // kAspBacklog rounds ago: what bounds its staging on a server that falls behind.
    result.gate = SaturatingSub(open_round_, kAspBacklog);
  } else if (SspGateOpen(w.next_clock)) {
    w.floor = open_round_;
    result.gate = w.floor;
  } else {
    w.ssp_wait = w.next_clock;
  }
  ReleaseSspGates();  // this commit may be what others waited for
  return result;
}

Result<Clock> RoundRule::Remove(WorkerId id, bool /*failed*/) {
  auto it = workers_.find(id);
  if (it == workers_.end() || !it->second.live) {
    return Error(StatusCode::kNotFound, "worker {} is not a live member", id);
  }
  WorkerState& w = it->second;
  w.live = false;
  --live_;
  if (RoundMode() && w.join_round > open_round_) --late_joiners_;
  if (RoundMode() && w.join_round <= open_round_ && !w.queue.empty()) --contributing_;
  Reindex(w);
  w.ssp_wait.reset();
  const Clock next = w.next_clock;
  if (w.queue.empty()) workers_.erase(it);
  ReleaseSspGates();
  return next;
}

Status RoundRule::SetAllowance(WorkerId id, uint32_t allowance) {
  if (!mode_.adaptive) {
    return Error(StatusCode::kFailedPrecondition, "per-worker allowances need dsync:auto");
  }
  if (allowance > mode_.bound) {
    return Error(StatusCode::kInvalidArgument, "allowance {} exceeds the maximum bound {}",
                 allowance, mode_.bound);
  }
  auto it = workers_.find(id);
  if (it == workers_.end() || !it->second.live) {
    return Error(StatusCode::kNotFound, "worker {} is not a live member", id);
  }
  if (finished_ && allowance > 0) {
    return Error(StatusCode::kFailedPrecondition,
                 "the job's last share runs as bsp: worker {} cannot get allowance {}", id,
                 allowance);
  }
  it->second.bound = allowance;
  Reindex(it->second);
  return Status::Ok();
}

Status RoundRule::SetQuorum(uint32_t quorum) {
  if (!mode_.adaptive) {
    return Error(StatusCode::kFailedPrecondition, "a changing quorum needs dsync:auto");
  }
  if (finished_ && quorum != SyncMode::kAll) {
    return Error(StatusCode::kFailedPrecondition,
                 "the job's last share runs as bsp: the quorum stays all, not {}", quorum);
  }
  mode_.quorum = quorum;
  return Status::Ok();
}

Status RoundRule::FinishAsBsp() {
  if (!RoundMode()) {
    return Error(StatusCode::kFailedPrecondition,
                 "only round modes finish as bsp: ssp and asp have no rounds to wait in");
  }
  finished_ = true;
  mode_.quorum = SyncMode::kAll;
  // Lowering allowances only makes rounds wait longer (see the header): the bound holds.
  for (auto& [id, w] : workers_) {
    if (!w.live) continue;
    w.bound = 0;
    Reindex(w);
  }
  return Status::Ok();
}

bool RoundRule::MayClose() const {
  const Round r = open_round_;
  // (b): no live worker with an empty queue would be pushed past its allowance.
  if (!blocking_.empty() && blocking_.begin()->first < r + 1) return false;
  // A round holds at least one gradient, except when only workers that count from the next
  // round are left: then it closes empty (the version advances, the model does not change)
  // so that their first pull, waiting for that version, is answered.
  const uint32_t eligible = live_ - late_joiners_;
  if (queued_.empty()) return eligible == 0 && late_joiners_ > 0;
  const uint32_t need =
      mode_.quorum == SyncMode::kAll ? eligible : std::min(mode_.quorum, eligible);
  return contributing_ >= need;
}

RoundRecord RoundRule::CloseOne() {
  RoundRecord rec;
  rec.round = open_round_;
  rec.live_workers = live_ - late_joiners_;
  contributing_ = 0;
  still_queued_.clear();
  // Takes the head of w's queue into the round.
  auto take = [&](WorkerId id, WorkerState& w) {
    const Queued q = w.queue.front();
    w.queue.pop_front();
    rec.members.push_back({id, q.clock, q.base});
    if (w.live) ++rec.live_members;
    stats_.max_staleness =
        std::max<uint32_t>(stats_.max_staleness, static_cast<uint32_t>(rec.round - q.base));
    ++stats_.gradients_placed;
    if (!w.queue.empty()) {
      still_queued_.push_back(id);
      contributing_ += w.live ? 1 : 0;  // every live worker counts in the next round
    } else if (w.live) {
      Reindex(w);
    }
    return w.live || !w.queue.empty();  // false: a gone worker with nothing left, forgotten
  };
  // A round costs what it holds: the workers with a queued gradient, found by id where they
  // are few, by one pass in id order where they are many (bsp: everyone).
  if (queued_.size() * 4 >= workers_.size()) {
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->second.queue.empty() || take(it->first, it->second)) {
        ++it;
      } else {
        it = workers_.erase(it);
      }
    }
  } else {
    std::sort(queued_.begin(), queued_.end());  // members in id order
    for (const WorkerId id : queued_) {
      auto it = workers_.find(id);
      if (!take(id, it->second)) workers_.erase(it);
    }
  }
  queued_.swap(still_queued_);
  late_joiners_ = 0;  // they count from the round that opens now
  rec.quorum_needed = mode_.quorum == SyncMode::kAll ? rec.live_workers
                                                     : std::min(mode_.quorum, rec.live_workers);
  ++open_round_;
  ++stats_.rounds_closed;
  return rec;
}

std::vector<RoundRecord> RoundRule::CloseReady() {
  std::vector<RoundRecord> out;
  if (RoundMode()) {
    while (MayClose()) out.push_back(CloseOne());
  } else {
    while (!ready_.empty()) {
      out.push_back(std::move(ready_.front()));
      ready_.pop_front();
    }
  }
  return out;
}

std::optional<Version> RoundRule::begun(WorkerId w) const {
  auto it = workers_.find(w);
  return it == workers_.end() ? std::nullopt : it->second.begun;
}

std::optional<RoundRecord> RoundRule::CloseNext() {
  if (RoundMode()) {
    if (!MayClose()) return std::nullopt;
    return CloseOne();
  }
  if (ready_.empty()) return std::nullopt;
  RoundRecord r = std::move(ready_.front());
  ready_.pop_front();
  return r;
}

bool RoundRule::SspGateOpen(Clock clock) const {
  // A pull at `clock` must see every live worker's gradients of clocks < clock - K.
  const Clock needed = SaturatingSub(clock, mode_.bound);
  for (const auto& [id, w] : workers_) {
    if (w.live && w.next_clock < needed) return false;
  }
  return true;
}

void RoundRule::ReleaseSspGates() {
  if (mode_.kind != SyncKind::kSsp) return;
  for (auto& [id, w] : workers_) {
    if (!w.live || !w.ssp_wait || !SspGateOpen(*w.ssp_wait)) continue;
    w.floor = open_round_;
    releases_.push_back({id, *w.ssp_wait, open_round_});
    w.ssp_wait.reset();
  }
}

std::vector<GateRelease> RoundRule::TakeGateReleases() {
  std::vector<GateRelease> out;
  out.swap(releases_);
  return out;
}

}  // namespace dsync::ps
