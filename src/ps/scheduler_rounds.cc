// The scheduler node: workers' commits, the round rule fed and its decisions broadcast,
// dsync:auto's policy and payoff check. The class: ps/scheduler_internal.h.
#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::HandleWorker(PeerId peer, WorkerId id, const FrameHeader& h,
                                 std::span<const std::byte> meta) {
  auto wit = workers_.find(id);
  if (wit == workers_.end()) {
    // Still waiting for admission, or already removed (declared dead, left).
    if (h.msg_type() != MsgType::kHeartbeat) {
      Refuse(peer, h,
             Error(StatusCode::kFailedPrecondition,
                   "worker {} is not a member of the job now (not admitted yet, left, or "
                   "declared dead)",
                   id),
             false);
    }
    return;
  }
  wit->second.last_seen = SteadyClock::now();
  switch (h.msg_type()) {
    case MsgType::kHeartbeat:
      return;
    case MsgType::kBegin: {
      const std::optional<Version> before = rule_.begun(id);
      Status s = rule_.Begin(id, h.clock(), h.base());
      if (!s.ok()) {
        Expel(peer, id, h, s);
        return;
      }
      wit->second.begun_clock = h.clock();
      wit->second.begun_at = wit->second.last_seen;
      if (journal_.open() && rule_.begun(id) != before) {  // what changed nothing, twice
        journal_.Add({{"k", "begin"}, {"w", id}, {"c", h.clock()}, {"b", h.base()}});
      }
      Progress();
      return;
    }
    case MsgType::kCommit:
      HandleCommit(peer, id, wit->second, h, meta);
      return;
    case MsgType::kSetLearningRate:
      HandleSetLearningRate(peer, id, h, meta);
      return;
    case MsgType::kServerBackAck:
      HandleTakeoverAck(peer, id, wit->second, h, meta);
      return;
    case MsgType::kLeave: {
      // Acknowledge first: the removal may end the job, and Run() flushes what is queued.
      FrameHeader ack = MakeHeader(MsgType::kLeaveAck, kSchedulerId);
      ack.request = h.request;
      SendTracked(peer, ack);
      RemoveWorker(id, /*failed=*/false, "left");
      return;
    }
    default:
      Expel(peer, id, h,
            Error(StatusCode::kProtocol, "a worker may not send {} to the scheduler",
                  MsgTypeName(h.msg_type())));
  }
}

void SchedulerNode::HandleCommit(PeerId peer, WorkerId id, WorkerEntry& entry, const FrameHeader& h,
                                 std::span<const std::byte> meta) {
  const bool empty = (h.flags & kFlagEmpty) != 0;
  if (restarted_ && entry.last_ack && entry.last_ack->clock == h.clock()) {
    // Sent again by a worker that lost the scheduler before the answer came: the restarted
    // scheduler has it from the journal, and answers as the lost one did.
    Send(peer, CommitAck(h.request, *entry.last_ack));
    spdlog::info("scheduler: worker {} sent its commit of clock {} again (the lost "
                 "scheduler's answer did not reach it); answered as before",
                 id, h.clock());
    return;
  }
  CommitProof& proof = commit_scratch_;
  Status proved = DecodeCommit(meta, proof);
  if (proved.ok() && h.losses() > server_events_.losses().size()) {
    proved = Error(StatusCode::kInvalidArgument,
                   "worker {}: the commit of clock {} leaves out {} lost server(s); {} are lost",
                   id, h.clock(), h.losses(), server_events_.losses().size());
  }
  if (proved.ok()) {
    // The receipts of the servers lost before the worker committed are left out: it heard
    // of those losses (in order) and gave up what they owed it. A rank a new server took
    // over counts again for the clocks the worker pushed to that server.
    server_events_.LeftOut(h.losses(), id, h.clock(), left_out_scratch_);
    proved = VerifyCommit(job_key_,
                          Holders(static_cast<uint32_t>(servers_.size()), cfg_.replicas,
                                  &left_out_scratch_),
                          id, h.clock(), empty, proof);
  }
  if (!proved.ok()) {
    Expel(peer, id, h, proved);
    return;
  }
  if (policy_ && !empty && entry.begun_clock == h.clock()) {
    // Begin -> commit: the worker's own compute and push time, without the waits the
    // bound imposed on its pulls. Decided before the commit, so that its gate already
    // follows the new allowance.
    policy_->Observe(
        id, std::chrono::duration<double>(entry.last_seen - entry.begun_at).count());
    Redecide();
  }
  auto r = rule_.Commit(id, h.clock(), h.base(), empty);
  if (!r.ok()) {
    Expel(peer, id, h, r.status());
    return;
  }
  ++entry.committed;
  entry.next_commit = h.clock() + 1;
  entry.last_ack = CommitAnswer{h.clock(), r->round, r->gate.value_or(kNoGate)};
  // Commits are placed in clock order and rounds take each worker's oldest: a FIFO per
  // worker pairs every round member with its tensors.
  pending_tensors_[id].push_back({h.clock(), TensorsOf(proof), empty ? CommitProof::kSizeNotMeasured : proof.size});
  if (journal_.open()) {
    nlohmann::json runs = nlohmann::json::array();
    for (const TensorRange& t : pending_tensors_[id].back().tensors) runs.push_back({t.first, t.count});
    journal_.Add({{"k", "commit"}, {"w", id}, {"c", h.clock()}, {"b", h.base()},
                  {"e", empty}, {"t", std::move(runs)}});
  }
  if (cfg_.max_gradients && !budget_spent_ && JobCommitted() >= cfg_.max_gradients) {
    budget_spent_ = true;
    spdlog::info("scheduler: {} gradients committed, the job's budget; telling the "
                 "workers to stop",
                 rule_.stats().gradients_committed);
  }
  // The commit that reaches the budget's last share ends any delay at once, whichever
  // commits follow (Redecide runs only at commits it can time, joins and leaves).
  if (MaybeFinish()) Redecide();
  Send(peer, CommitAck(h.request, *entry.last_ack));
  Progress();
}

FrameHeader SchedulerNode::CommitAck(uint64_t request, const CommitAnswer& answer) const {
  FrameHeader ack = MakeHeader(MsgType::kCommitAck, kSchedulerId);
  ack.request = request;
  ack.set_round(answer.round);
  ack.set_min_version(answer.gate);
  if (budget_spent_) ack.flags |= kFlagStop;
  return ack;
}

void SchedulerNode::HandleSetLearningRate(PeerId peer, WorkerId id, const FrameHeader& h,
                                          std::span<const std::byte> meta) {
  auto lr = DecodeLearningRate(meta);
  if (!lr.ok()) {
    Refuse(peer, h, lr.status(), /*drop=*/lr.status().code() == StatusCode::kProtocol);
    return;
  }
  const Round from = rounds_announced_;
  FrameHeader to_server = MakeHeader(MsgType::kLearningRate, kSchedulerId);
  to_server.set_round(from);
  EncodeLearningRate(*lr, meta_buf_);
  if (journal_.open()) journal_.Add({{"k", "lr"}, {"from", from}, {"rate", *lr}});
  if (!cfg_.journal.empty()) lr_changes_[from] = *lr;
  for (const ServerEntry& s : LiveServers()) Send(s.peer, to_server, meta_buf_);
  learning_rate_ = std::make_pair(from, *lr);
  audit_.LearningRate(from, *lr, id);
  spdlog::info("scheduler: worker {} set the learning rate to {} from round {}", id, *lr,
               from);
  FrameHeader ack = MakeHeader(MsgType::kSetLearningRateAck, kSchedulerId);
  ack.request = h.request;
  ack.set_round(from);
  Send(peer, ack);
}

void SchedulerNode::ResumeDamped(Round from) {
  damp_from_ = from;
  if (payoff_) payoff_->SetStaleness(cfg_.staleness.Active(true));
}

void SchedulerNode::StartDamping(Round from) {
  ResumeDamped(from);
  const std::string damped = cfg_.staleness.Active(true).ToString();
  auto tell = [this, from, damped, why = growth_->reason()] {
    audit_.Damp(from, damped, why);
    spdlog::info("scheduler: staleness policy {} from round {}: {}", damped, from, why);
  };
  if (journal_.open()) {
    journal_.Add({{"k", "damp"}, {"from", from}});
    Out(std::move(tell));  // never a decision the journal may not hold, as AuditRound
  } else {
    tell();
  }
  for (const ServerEntry& s : LiveServers()) Send(s.peer, DampFrame());
}

FrameHeader SchedulerNode::DampFrame() const {
  FrameHeader h = MakeHeader(MsgType::kDamp, kSchedulerId);
  h.set_round(damp_from_.value_or(0));
  return h;
}

void SchedulerNode::RemoveWorker(WorkerId id, bool failed, const std::string& why, bool close) {
  auto next = rule_.Remove(id, failed);
  if (!next.ok()) return;
  if (journal_.open()) journal_.Add({{"k", "leave"}, {"w", id}, {"failed", failed}});
  gone_workers_[id] = *next;
  last_gate_.erase(id);
  if (takeover_) takeover_->Gone(id, *next);
  uint64_t committed = 0;
  std::string address;
  if (auto wit = workers_.find(id); wit != workers_.end()) {
    committed = wit->second.committed;
    address = wit->second.address;
  }
  audit_.Member(failed ? "failed" : "left", "worker", id, address, failed ? why : "");
  if (policy_) {
    policy_->Leave(id);
    payoff_->MembershipChanged();
    Redecide();
  }
  if (failed) {
    ++counters_.workers_failed;
    spdlog::warn("scheduler: worker {} declared dead ({}); its {} committed gradient(s) "
                 "stand, anything later is discarded",
                 id, why, committed);
  } else {
    ++counters_.workers_left;
    spdlog::info("scheduler: worker {} left after {} gradient(s)", id, committed);
  }
  // Servers drop what the worker pushed for clocks it never committed.
  FrameHeader gone = MakeHeader(MsgType::kWorkerGone, kSchedulerId);
  gone.set_gone_worker(id);
  gone.set_next_clock(*next);
  for (const ServerEntry& s : LiveServers()) Send(s.peer, gone);
  if (auto wit = workers_.find(id); wit != workers_.end()) {
    if (failed && close) CloseLater(wit->second.peer);
    workers_.erase(wit);
  }
  Progress();
}

void SchedulerNode::AgreementIn(NodeId id, Round round, std::span<const std::byte> meta) {
  if (!payoff_) return;
  Status st = DecodeAgreement(meta, agreement_);
  const RoundRecord* rec = nullptr;
  if (st.ok() && !history_.empty() && round >= history_.front().round &&
      round - history_.front().round < history_.size()) {
    rec = &history_[round - history_.front().round];
  }
  if (st.ok() && (!rec || rec->round != round)) {
    st = Error(StatusCode::kProtocol, "no record of round {}", round);
  } else if (st.ok() && agreement_.dots.size() != rec->members.size()) {
    st = Error(StatusCode::kProtocol, "{} value(s) for the {} member(s) of round {}",
               agreement_.dots.size(), rec->members.size(), round);
  }
  if (!st.ok()) {
    // Said the first few times and then every 1000th: a server that keeps sending them
    // would otherwise fill the log at the pace of the rounds.
    if (counters_.agreements_refused++ % 1000 < 5) {
      spdlog::warn("scheduler: agreement report of server {} refused ({} so far): {}", id,
                   counters_.agreements_refused, st.message());
    }
    return;
  }
  // The servers' reports of a round count one round together.
  const double weight = 1.0 / static_cast<double>(std::max<size_t>(LiveServers().size(), 1));
  if (payoff_->Measured(*rec, agreement_.dots, agreement_.measured, weight)) {
    ++counters_.agreements_measured;
  }
}

void SchedulerNode::Redecide() {
  if (!policy_) return;
  MaybeFinish();
  const bool proposal_changed = policy_->Decide();
  const auto phase = payoff_->phase();
  const AutoDecision& d = payoff_->Gate(policy_->decision());
  // Logged also when only the proposal or the phase changed: a straggler held at bsp while
  // bsp's pace is measured, or during a backoff, is said so, and so is a trial's verdict.
  // But where workers share cores, a proposal comes and goes every few rounds (1,500 such
  // lines in an 18 s job of 4 workers on 2 cores, none of which delayed anybody): lines of
  // a proposal alone, which change nothing applied, at most once per kQuietPolicyLog.
  const bool nothing_applied_changed = d == applied_ && phase == payoff_->phase();
  if (nothing_applied_changed && !proposal_changed) return;
  const auto now = SteadyClock::now();
  if (nothing_applied_changed && quiet_logged_ && now - *quiet_logged_ < kQuietPolicyLog) {
    ++quiet_skipped_;
    return;
  }
  const std::string why = payoff_->reason();
  spdlog::info("scheduler: dsync:auto from round {}: {}{}{}{}", rule_.open_round(),
               policy_->Describe(d), why.empty() ? "" : ": ", why,
               quiet_skipped_ == 0
                   ? std::string()
                   : fmt::format(" ({} proposals not logged before this line)",
                                 quiet_skipped_));
  quiet_skipped_ = 0;
  if (nothing_applied_changed) quiet_logged_ = now;
  if (d == applied_) return;
  // Refused only past the job's finish as bsp (RoundRule::FinishAsBsp), which this follows.
  (void)ApplyDecision(rule_, applied_, d);
  applied_ = d;
  if (journal_.open()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& [id, allowance] : applied_.allowance) a.push_back({id, allowance});
    journal_.Add({{"k", "auto"}, {"q", applied_.quorum}, {"a", std::move(a)}});
  }
  ++counters_.policy_changes;
  audit_.Policy(rule_.open_round(), applied_.quorum, applied_.allowance);
}

void SchedulerNode::WarnIfTemperingIsIdle() const {
  const OptimizerConfig& o = cfg_.optimizer;
  std::string why;
  if (cfg_.sync == SyncMode::Bsp()) {
    why = "bsp applies no stale gradient";
  } else if (o.kind != OptimizerKind::kMomentum) {
    why = fmt::format("the job's optimizer is {}, and only momentum SGD has a momentum to "
                      "temper (tensors registered with momentum SGD of their own still are)",
                      OptimizerName(o.kind));
  } else if (!(o.momentum > 0.0f && o.momentum < 1.0f)) {
    why = fmt::format("the job's momentum {} is not between 0 and 1, where it decays",
                      o.momentum);
  }
  if (!why.empty()) {
    spdlog::warn("scheduler: the staleness policy's +momentum changes nothing in this job: {}",
                 why);
  }
}

bool SchedulerNode::MaybeFinish() {
  const uint64_t budget = cfg_.max_gradients;
  const uint64_t percent = cfg_.FinishBspPercent();
  if (rule_.finished_as_bsp() || budget == 0 || percent == 0 || !Delays()) return false;
  // budget * percent / 100 rounded up, without overflow; at most the budget (percent <= 100).
  const uint64_t tail = budget / 100 * percent + (budget % 100 * percent + 99) / 100;
  const uint64_t committed = JobCommitted();
  if (committed < budget - tail) return false;
  if (Status s = FinishAsBsp(); !s.ok()) {
    spdlog::error("scheduler: the last {} % of the budget cannot run as bsp: {}", percent,
                  s.message());
    return false;
  }
  if (journal_.open()) journal_.Add({{"k", "finish"}});
  if (!payoff_) {
    // dsync:auto's decision that follows is audited as every other; a fixed mode's here.
    audit_.Policy(rule_.open_round(), SyncMode::kAll, Allowances{});
  }
  spdlog::info("scheduler: {} from round {}: {} of the job's {} gradients committed; the "
               "last {} % runs as bsp",
               cfg_.sync.ToString(), rule_.open_round(), committed, budget, percent);
  return true;
}

bool SchedulerNode::Delays() const {
  return cfg_.sync.kind == SyncKind::kRound && (cfg_.sync.adaptive || cfg_.sync.bound > 0);
}

Status SchedulerNode::FinishAsBsp() {
  DSYNC_RETURN_IF_ERROR(rule_.FinishAsBsp());
  if (payoff_) payoff_->Finish(cfg_.FinishBspPercent(), cfg_.max_gradients);
  return Status::Ok();
}

SchedulerNode::PendingCommit SchedulerNode::TakeCommit(const RoundMember& m) {
  auto it = pending_tensors_.find(m.worker);
  if (it == pending_tensors_.end() || it->second.empty() ||
      it->second.front().clock != m.clock) {
    // The rule places commits in the order they came: this cannot happen. Say it loudly;
    // the servers then apply nothing of it, and stop the job if they hold it.
    spdlog::error("scheduler: no record of the tensors of worker {}'s clock {}", m.worker,
                  m.clock);
    return {};
  }
  PendingCommit commit = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty() && !rule_.is_live(m.worker)) pending_tensors_.erase(it);
  return commit;
}

bool SchedulerNode::ReplicaLagging() const {
  if (cfg_.replicas <= 1) return false;
  for (const ServerEntry& s : LiveServers()) {
    // A server taking a rank over holds back the rounds from its copies' version on only
    // once that version is decided (deciding it needs rounds to close).
    if (s.taking_over && !(takeover_ && takeover_->copy_at)) continue;
    if (s.ready && s.applied + kReplicaLagRounds <= rounds_announced_) return true;
  }
  return false;
}

void SchedulerNode::Progress() {
  if (finished_ || stop_) return;  // the job ended: nothing more goes out
  for (RoundRecord& rec :
       ReplicaLagging() ? std::vector<RoundRecord>{} : rule_.CloseReady()) {
    if (journal_.open()) {
      nlohmann::json m = nlohmann::json::array();
      for (const RoundMember& x : rec.members) m.push_back({x.worker, x.clock});
      journal_.Add({{"k", "round"}, {"r", rec.round}, {"m", std::move(m)}});
      if (cfg_.test_crash_after_round == rec.round) crash_after_write_ = true;
    }
    PlaceRound(rec, /*audit=*/true);
    // Damped from this round on: its kDamp goes before its kRound.
    if (growth_ && !damp_from_ && growth_->RoundClosed(rec.round, round_sizes_)) {
      StartDamping(rec.round);
    }
    FrameHeader h = MakeHeader(MsgType::kRound, kSchedulerId);
    h.set_round(rec.round);
    for (const ServerEntry& s : LiveServers()) Send(s.peer, h, meta_buf_);
    if (payoff_) {
      payoff_->RoundClosed(
          std::chrono::duration<double>(SteadyClock::now().time_since_epoch()).count(), rec);
    }
    history_.push_back(std::move(rec));
    if (history_.size() > kMaxHistory) history_.pop_front();
    if (!stopping_ && checkpoints_.Due(rounds_announced_, SteadyClock::now())) BeginCheckpoint();
  }
  for (const GateRelease& g : rule_.TakeGateReleases()) {
    auto wit = workers_.find(g.worker);
    if (wit == workers_.end()) continue;
    FrameHeader h = MakeHeader(MsgType::kGate, kSchedulerId);
    h.set_clock(g.clock);
    h.set_min_version(g.min_version);
    last_gate_[g.worker] = g;
    Send(wit->second.peer, h);
  }
  MaybeCopyOut();
  CheckFinished();
}

}  // namespace dsync::ps
