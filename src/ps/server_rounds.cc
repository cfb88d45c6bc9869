// The server node: rounds applied in order, each member's gradient weighed as the staleness
// policy says, the agreement dsync:auto measures. The class: ps/server_internal.h.
#include "ps/server_internal.h"

namespace dsync::ps {

bool ServerNode::NextRoundReady() const {
  if (rounds_.empty()) return false;
  if (copy_at_ && rounds_.front().round < *copy_at_) return true;
  return !awaiting_copies_.load();
}

void ServerNode::ApplyLoop() {
  RoundScratch scratch;
  while (true) {
    PendingRound r;
    bool release_only = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || NextRoundReady(); });
      if (stop_) return;
      r = std::move(rounds_.front());
      rounds_.pop_front();
      // By number: the copies may be in before every round below their version is released.
      release_only = copy_at_ && r.round < *copy_at_;
    }
    if (!r.checkpoint_dir.empty()) {
      ReportCheckpoint(r.round, WriteCheckpoint(r.round, r.checkpoint_dir));
      continue;
    }
    if (r.copy_for) {
      SendCopies(r.round, r.takeover, *r.copy_for, r.live);
      continue;
    }
    Status st = r.round != stats_.rounds_applied
                    ? Error(StatusCode::kProtocol, "round {} arrived but the next round is {}",
                            r.round, stats_.rounds_applied.load())
                : release_only ? ReleaseRound(r)
                               : ApplyRound(r, scratch);
    if (!st.ok()) {
      // Never skip: a round this server cannot apply as decided would leave its slices
      // different from everyone else's. Stop the job and say which gradient it was. The
      // scheduler names the sender itself: the error sent does not.
      const Status here = st.WithContext(fmt::format("server {}", id_.load()));
      spdlog::error("{}", here.message());
      FrameHeader about = MakeHeader(MsgType::kRound, id_);
      about.set_round(r.round);
      {
        // First: the disconnect the error leads to must not replace it, and Run waits for
        // the scheduler's answer while it is being sent.
        std::lock_guard lock(mu_);
        result_ = here;
        error_sent_ = true;
      }
      const bool sent = SendError(*transport_, scheduler_, id_, st, about).ok();
      std::lock_guard lock(mu_);
      error_sent_ = sent;
      cv_.notify_all();
      return;
    }
    ++stats_.rounds_applied;
    if (!release_only) stats_.gradients_applied += r.members.size();
    FrameHeader done = MakeHeader(MsgType::kApplied, id_);
    done.set_round(r.round);
    scratch.meta.clear();
    if (!release_only && AgreementToSend(scratch)) {
      EncodeAgreement(scratch.agreement, scratch.meta);
    }
    (void)transport_->Send(scheduler_, done, scratch.meta, nullptr, 0);
  }
}

Status ServerNode::CheckRoundStaged(const PendingRound& r) {
  std::shared_lock lock(slices_mu_);
  for (SliceState* s : slice_list_) {
    std::lock_guard slock(s->mu);
    for (const RoundEntry& e : r.members) {
      if (!Contains(e.tensors, s->tensor)) continue;
      const bool held = std::any_of(s->staged.begin(), s->staged.end(), [&](const Staged& st) {
        return st.worker == e.member.worker && st.clock == e.member.clock;
      });
      if (!held) {
        return Error(StatusCode::kProtocol,
                     "round {} names worker {}'s gradient of clock {} for tensor {} slice {}, "
                     "which this server never staged",
                     r.round, e.member.worker, e.member.clock, s->tensor, s->index);
      }
    }
  }
  return Status::Ok();
}

void ServerNode::MemberWeights(const PendingRound& r, const StalenessPolicy& policy,
                               std::vector<float>& member_weights) const {
  member_weights.clear();
  if (policy.kind == StalenessKind::kNone) return;
  bool all_one = true;
  for (const RoundEntry& e : r.members) {
    member_weights.push_back(policy.Weight(Staleness(r.round, e.member.base)));
    all_one = all_one && member_weights.back() == 1.0f;
  }
  if (all_one) member_weights.clear();
}

double ServerNode::MeanStaleness(const PendingRound& r, const RoundScratch& scratch) const {
  double weighed = 0.0;
  double weights = 0.0;
  double plain = 0.0;
  for (size_t m : scratch.member_of) {
    const double w = scratch.member_weights.empty() ? 1.0 : scratch.member_weights[m];
    const auto s = static_cast<double>(Staleness(r.round, r.members[m].member.base));
    weighed += w * s;
    weights += w;
    plain += s;
  }
  if (weights > 0.0) return weighed / weights;
  return scratch.member_of.empty() ? 0.0 : plain / static_cast<double>(scratch.member_of.size());
}

bool ServerNode::StartAgreement(const PendingRound& r, RoundScratch& scratch) const {
  scratch.fresh_member.clear();
  bool fresh = false;
  bool stale = false;
  for (size_t m = 0; job_.sync.adaptive && m < r.members.size(); ++m) {
    const bool is_fresh = Staleness(r.round, r.members[m].member.base) == 0;
    scratch.fresh_member.push_back(is_fresh ? 1 : 0);
    (is_fresh ? fresh : stale) = true;
  }
  const bool measure = fresh && stale;
  scratch.agreement.dots.assign(measure ? r.members.size() : 0, 0.0);
  scratch.agreement.measured.assign(measure ? r.members.size() : 0, 0);
  return measure;
}

void ServerNode::MeasureAgreement(const PendingRound& r, const SliceState& s,
                                  RoundScratch& scratch) {
  if (scratch.grads.size() != r.members.size()) return;
  scratch.host_fresh.clear();
  size_t fresh = 0;
  for (size_t j = 0; j < scratch.grads.size(); ++j) {
    if (device_memory_ &&
        device_memory_->Contains(scratch.grads[j], s.elements * sizeof(float))) {
      return;
    }
    scratch.host_fresh.push_back(scratch.fresh_member[scratch.member_of[j]]);
    fresh += scratch.host_fresh.back();
  }
  if (fresh < 2) return;
  scratch.host_dots.assign(scratch.grads.size(), 0.0);
  scratch.host_measured.assign(scratch.grads.size(), 0);
  AddAgreement(scratch.grads, scratch.host_fresh, s.elements, r.round,
               scratch.agreement_scratch, scratch.host_dots, scratch.host_measured);
  for (size_t j = 0; j < scratch.grads.size(); ++j) {
    if (!scratch.host_measured[j]) continue;
    scratch.agreement.dots[scratch.member_of[j]] += scratch.host_dots[j];
    scratch.agreement.measured[scratch.member_of[j]] = 1;
  }
}

bool ServerNode::AgreementToSend(RoundScratch& scratch) const {
  bool fresh = false;
  bool stale = false;
  for (size_t m = 0; m < scratch.agreement.dots.size(); ++m) {
    if (!std::isfinite(scratch.agreement.dots[m])) return false;
    if (!scratch.agreement.measured[m]) continue;
    (scratch.fresh_member[m] ? fresh : stale) = true;
  }
  return fresh && stale;
}

Status ServerNode::ApplyRound(const PendingRound& r, RoundScratch& scratch) {
  DSYNC_RETURN_IF_ERROR(CheckRoundStaged(r));
  std::vector<const float*>& grads = scratch.grads;
  std::vector<float>& weights = scratch.weights;
  std::vector<uint64_t>& bases = scratch.bases;
  std::vector<size_t>& used = scratch.used;
  // Delay compensation: every slice keeps the same versions on every server (a job's depth
  // is fixed, and snapshots carry what was kept), so copies stay alike.
  // With damp, the versions are kept from the start and used once damped (lambda 0 before).
  const StalenessPolicy policy = job_.staleness.Active(r.damped);
  Compensation comp;
  comp.depth = job_.staleness.CompensationDepth(job_.sync);
  comp.lambda = comp.depth > 0 ? policy.compensation : 0.0f;  // bsp: never stale
  comp.adaptive = job_.staleness.adaptive;
  comp.round = r.round;
  const std::vector<float>& member_weights = scratch.member_weights;
  MemberWeights(r, policy, scratch.member_weights);
  // Payload: the round's number, shown on the timeline (0 is shown as no payload).
  trace::Scoped range(trace::Range::kServerRound, r.round);
  std::shared_lock lock(slices_mu_);
  uint64_t strays = 0;
  Status failed = Status::Ok();
  const bool measure = StartAgreement(r, scratch);
  for (SliceState* s : slice_list_) {
    std::lock_guard slock(s->mu);
    grads.clear();
    weights.clear();
    bases.clear();
    used.clear();
    scratch.member_of.clear();
    for (size_t m = 0; m < r.members.size(); ++m) {  // worker-id order: deterministic sums
      const RoundEntry& e = r.members[m];
      const bool applies = Contains(e.tensors, s->tensor);
      for (size_t i = 0; i < s->staged.size(); ++i) {
        if (s->staged[i].worker == e.member.worker && s->staged[i].clock == e.member.clock) {
          // Staged for a tensor the commit did not name: pushed, never committed; dropped.
          if (applies) {
            scratch.member_of.push_back(m);
            grads.push_back(s->staged[i].data);
            if (!member_weights.empty()) weights.push_back(member_weights[m]);
            if (comp.depth > 0) bases.push_back(e.member.base);
          }
          strays += applies ? 0 : 1;
          used.push_back(i);
          break;
        }
      }
    }
    OptimizerConfig opt = s->optimizer;
    if (r.lr) opt.lr = *r.lr;
    if (opt.kind == OptimizerKind::kMomentum && policy.temper_momentum) {
      opt.momentum = policy.RoundMomentum(opt.momentum, MeanStaleness(r, scratch));
    }
    comp.bases = bases;
    if (measure) MeasureAgreement(r, *s, scratch);
    Status st = store_->ApplyRound(s->key, grads, weights, comp, opt);
    if (!st.ok()) {
      // The slice would fall behind its copies and every later round: the round fails
      // (ApplyLoop stops the job, naming the first) once the rest are released as usual.
      // The slice keeps its version, so no pull is answered with a model it does not hold.
      st = st.WithContext(fmt::format("applying round {} to tensor {} slice {}", r.round,
                                      s->tensor, s->index));
      if (failed.ok()) {
        failed = st;
      } else {
        spdlog::error("server {}: {}", id_.load(), st.message());
      }
    }
    std::sort(used.begin(), used.end());
    for (size_t k = used.size(); k-- > 0;) {
      ReleaseBuffer(s->staged[used[k]].data, s->elements * sizeof(float));
      s->staged.erase(s->staged.begin() + static_cast<std::ptrdiff_t>(used[k]));
      --stats_.staged_now;
    }
    if (!st.ok()) continue;
    s->version = r.round + 1;
    std::erase_if(s->waiting, [&](const WaitingPull& p) {
      if (p.min_version > s->version) return false;
      ReplyPull(*s, p.peer, p.request);
      return true;
    });
  }
  for (const RoundEntry& e : r.members) ledger_.Applied(e.member.worker, e.member.clock);
  if (strays) {
    spdlog::warn("server {}: round {} dropped {} staged slice(s) of tensors its members "
                 "pushed but did not commit",
                 id_.load(), r.round, strays);
  }
  return failed;
}

Status ServerNode::ReleaseRound(const PendingRound& r) {
  std::shared_lock lock(slices_mu_);
  for (SliceState* s : slice_list_) {
    std::lock_guard slock(s->mu);
    std::erase_if(s->staged, [&](const Staged& st) {
      const bool named = std::any_of(r.members.begin(), r.members.end(), [&](const RoundEntry& e) {
        return e.member.worker == st.worker && e.member.clock == st.clock;
      });
      if (named) {
        ReleaseBuffer(st.data, s->elements * sizeof(float));
        --stats_.staged_now;
      }
      return named;
    });
  }
  for (const RoundEntry& e : r.members) ledger_.Applied(e.member.worker, e.member.clock);
  return Status::Ok();
}

void ServerNode::ReleaseAllStaged() {
  std::shared_lock lock(slices_mu_);
  for (SliceState* s : slice_list_) {
    for (const Staged& st : s->staged) ReleaseBuffer(st.data, s->elements * sizeof(float));
    s->staged.clear();
  }
}

}  // namespace dsync::ps
