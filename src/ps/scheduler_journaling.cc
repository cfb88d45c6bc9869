// The scheduler node: the journal (Config::journal, ps/scheduler_journal.h), written by the
// flusher, and its replay by a restarted scheduler. The class: ps/scheduler_internal.h.
#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::Send(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
  if (!journal_.open()) {
    (void)transport_->Send(peer, h, meta, nullptr, 0);
    return;
  }
  Out([this, peer, h, copy = std::vector<std::byte>(meta.begin(), meta.end())] {
    (void)transport_->Send(peer, h, copy, nullptr, 0);
  });
}

void SchedulerNode::CloseLater(PeerId peer) {
  Out([this, peer] { transport_->Close(peer); });
}

void SchedulerNode::AuditRound(const RoundRecord& rec) {
  if (!journal_.open()) {
    audit_.Round(rec);
    return;
  }
  Out([this, rec] { audit_.Round(rec); });  // never a round the journal may not hold
}

void SchedulerNode::FlushJournal() {
  std::vector<char> bytes;
  std::vector<std::function<void()>> sends;
  std::unique_lock lock(mu_);
  for (;;) {
    flush_cv_.wait(lock, [&] { return flusher_stop_ || journal_.pending() || !outbox_.empty(); });
    if (!journal_.pending() && outbox_.empty()) return;  // stopping, and nothing is left
    journal_.Take(bytes);
    sends.swap(outbox_);
    flushing_ = true;
    flush_started_ = SteadyClock::now();
    const bool write = !journal_failed_;
    const bool crash = std::exchange(crash_after_write_, false);
    lock.unlock();
    const Status st = write ? journal_.WriteDurably(bytes) : Status::Ok();
    if (!write) sends.clear();  // decided after the journal failed: never sent
    if (crash && st.ok()) {
      spdlog::warn("scheduler: round {} is journaled; ending this process before anything "
                   "decided with it is sent (DSYNC_TEST_CRASH_AFTER_ROUND)",
                   *cfg_.test_crash_after_round);
      spdlog::default_logger()->flush();
      std::_Exit(137);
    }
    if (st.ok()) {
      for (auto& send : sends) send();
    }
    sends.clear();
    lock.lock();
    flushing_ = false;
    if (!st.ok()) {
      // What was not written is never sent, nor anything decided after: the journal stays
      // what the nodes were told, so a scheduler started on it can still continue the job.
      journal_failed_ = true;
      Finish(st.WithContext("the job stops: its scheduler cannot keep the journal it would "
                            "be restarted from (start it again with --resume once the disk "
                            "is writable)"));
    }
    if (journal_failed_) final_frames_in_flight_ = 0;  // nothing more leaves
    cv_.notify_all();
  }
}

nlohmann::json SchedulerNode::JobRecord() const {
  nlohmann::json settings = nlohmann::json::object();
  for (const Setting& st : Settings()) {
    if (JournaledSetting(st)) settings[std::string(st.env)] = st.get(cfg_);
  }
  nlohmann::json j = {{"k", "job"},
                      {"format", kJournalFormat},
                      {"key", ToHex(job_key_)},
                      {"settings", settings},
                      {"start_version", rounds_announced_},
                      {"start_clock", resumed_ ? resumed_->manifest.clock : Clock{0}},
                      {"prior_gradients", prior_gradients_}};
  if (learning_rate_) j["lr"] = {learning_rate_->first, learning_rate_->second};
  if (damp_from_) j["damp_from"] = *damp_from_;
  if (resumed_) j["resumed_from"] = resumed_->path;
  return j;
}

bool SchedulerNode::JournaledSetting(const Setting& st) {
  if (st.scope != SettingScope::kJob && st.scope != SettingScope::kCluster) return false;
  // The grace is the job's: its nodes count with the value their welcome gave them.
  return st.env != "DSYNC_RESUME" && st.env != "DSYNC_JOURNAL" &&
         st.env != "DSYNC_AUDIT_LOG" && st.env != "DSYNC_TEST_CRASH_AFTER_ROUND";
}

Status SchedulerNode::StartJournal() {
  DSYNC_ASSIGN_OR_RETURN(journal_, JournalFile::Create(cfg_.journal));
  journal_.Add(JobRecord());
  std::vector<char> bytes;
  journal_.Take(bytes);
  DSYNC_RETURN_IF_ERROR(journal_.WriteDurably(bytes));
  spdlog::info("scheduler: journaling every decision to {}; if this scheduler is lost, start "
               "it again with --resume {}: the nodes wait {} s for it",
               cfg_.journal, cfg_.journal, cfg_.reconnect_grace_ms / 1000);
  return Status::Ok();
}

Status SchedulerNode::ResumeJournal() {
  if (!cfg_.journal.empty() && cfg_.journal != cfg_.resume) {
    return Error(StatusCode::kInvalidArgument,
                 "--journal {} with --resume {}: a restarted scheduler goes on writing the "
                 "journal it resumes from; leave --journal out",
                 cfg_.journal, cfg_.resume);
  }
  DSYNC_ASSIGN_OR_RETURN(JournalContents read, ReadJournal(cfg_.resume));
  cfg_.journal = cfg_.resume;  // replayed rounds are kept for servers that missed them
  if (read.torn_bytes > 0) {
    spdlog::warn("scheduler: --resume {}: cut off the last {} byte(s), a record the lost "
                 "scheduler was writing when it stopped (nothing it sent depended on it)",
                 cfg_.resume, read.torn_bytes);
  }
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < read.records.size(); ++i) {
    Status st;
    try {
      st = Replay(read.records[i], i == 0);
    } catch (const nlohmann::json::exception& e) {
      st = Error(StatusCode::kDataLoss, "a field is missing or malformed: {}", e.what());
    }
    if (!st.ok()) {
      return st.WithContext(fmt::format("--resume {}: record {}", cfg_.resume, i));
    }
  }
  if (read.records.empty()) {
    return Error(StatusCode::kDataLoss, "--resume {}: the journal holds no job", cfg_.resume);
  }
  for (const GateRelease& g : rule_.TakeGateReleases()) last_gate_[g.worker] = g;
  if (servers_.size() < cfg_.num_servers && !resume_unreadable_.ok()) {
    return resume_unreadable_.WithContext(fmt::format(
        "--resume {}: servers still to register load the checkpoint the job started from",
        cfg_.resume));
  }
  budget_spent_ = cfg_.max_gradients != 0 && JobCommitted() >= cfg_.max_gradients;
  DSYNC_ASSIGN_OR_RETURN(journal_, JournalFile::Continue(cfg_.resume, read));
  journal_.Add({{"k", "restarted"}, {"round", rounds_announced_}});
  restarted_ = true;
  const auto now = SteadyClock::now();
  rejoin_deadline_ = now + std::chrono::milliseconds(cfg_.reconnect_grace_ms);
  size_t servers = 0;
  for (ServerEntry& s : servers_) {
    s.last_seen = now;
    if (!s.lost) {
      s.away = true;
      ++servers;
    }
  }
  for (auto& [id, w] : workers_) {
    w.away = true;
    w.last_seen = now;
  }
  checkpoints_ = CheckpointCoordinator(cfg_, rounds_announced_);
  last_arrival_ = now;
  if (!Away()) rejoin_deadline_.reset();  // nobody to wait for (the job had not formed)
  spdlog::info("scheduler: continuing the job of {} at round {} ({} gradient(s) in its "
               "rounds); waiting up to {} s for its {} server(s) and {} worker(s) to come back",
               cfg_.resume, rounds_announced_, prior_gradients_ + gradients_in_rounds_,
               cfg_.reconnect_grace_ms / 1000, servers, workers_.size());
  return Status::Ok();
}

Status SchedulerNode::Replay(const nlohmann::json& r, bool first) {
  const std::string kind = r.at("k").get<std::string>();
  if (first != (kind == "job")) {
    return Error(StatusCode::kDataLoss, "a journal starts with its job record, and only there");
  }
  const auto now = SteadyClock::now();
  if (kind == "job") return ReplayJob(r);
  if (kind == "server") {
    const NodeId id = r.at("id").get<NodeId>();
    if (id != kFirstServerId + servers_.size() || servers_.size() >= cfg_.num_servers) {
      return Error(StatusCode::kDataLoss, "server {} registered out of order", id);
    }
    servers_.push_back({id, kNoPeer, r.at("host").get<std::string>(),
                        r.at("port").get<uint16_t>(), rule_.open_round(), now, false});
    return Status::Ok();
  }
  if (kind == "ready") {
    DSYNC_ASSIGN_OR_RETURN(ServerEntry * s, JournaledServer(r.at("id").get<NodeId>()));
    s->ready = true;
    return Status::Ok();
  }
  if (kind == "join") {
    const WorkerId id = r.at("w").get<WorkerId>();
    const bool initial = r.at("initial").get<bool>();
    DSYNC_ASSIGN_OR_RETURN(Admission a, rule_.Join(id, initial));
    started_ = true;
    next_worker_id_ = std::max(next_worker_id_, id + 1);
    WorkerEntry& w = workers_[id];
    w.peer = kNoPeer;
    w.last_seen = now;
    w.address = r.value("address", std::string());
    placed_next_clock_[id] = a.start_clock;
    if (policy_) {
      policy_->Join(id);
      payoff_->MembershipChanged();
    }
    ++counters_.workers_joined;
    return Status::Ok();
  }
  if (kind == "begin") {
    return rule_.Begin(r.at("w").get<WorkerId>(), r.at("c").get<Clock>(), r.at("b").get<Version>());
  }
  if (kind == "commit") {
    const WorkerId id = r.at("w").get<WorkerId>();
    const Clock clock = r.at("c").get<Clock>();
    auto wit = workers_.find(id);
    if (wit == workers_.end()) return Error(StatusCode::kDataLoss, "a commit of unknown worker {}", id);
    DSYNC_ASSIGN_OR_RETURN(CommitResult res, rule_.Commit(id, clock, r.at("b").get<Version>(),
                                                          r.at("e").get<bool>()));
    TensorSet tensors;
    for (const auto& run : r.at("t")) tensors.push_back({run.at(0).get<TensorId>(), run.at(1).get<uint32_t>()});
    pending_tensors_[id].push_back({clock, std::move(tensors)});  // its size: not journaled
    ++wit->second.committed;
    wit->second.last_ack = CommitAnswer{clock, res.round, res.gate.value_or(kNoGate)};
    return Status::Ok();
  }
  if (kind == "finish") return FinishAsBsp();
  if (kind == "auto") {
    // The delayed workers (format 1 lists the others too, at 0: the same decision).
    AutoDecision d;
    d.quorum = r.at("q").get<uint32_t>();
    for (const auto& a : r.at("a")) d.allowance.Set(a.at(0).get<WorkerId>(), a.at(1).get<uint32_t>());
    const Status applied = ApplyDecision(rule_, applied_, d);
    applied_ = std::move(d);
    return applied;
  }
  if (kind == "round") {
    std::optional<RoundRecord> rec = rule_.CloseNext();
    std::vector<std::pair<WorkerId, Clock>> replayed, journaled;
    if (rec) {
      for (const RoundMember& m : rec->members) replayed.emplace_back(m.worker, m.clock);
    }
    for (const auto& m : r.at("m")) journaled.emplace_back(m.at(0).get<WorkerId>(), m.at(1).get<Clock>());
    if (!rec || rec->round != r.at("r").get<Round>() || replayed != journaled) {
      return Error(StatusCode::kDataLoss,
                   "round {} replays as {} where the journal has it with {} member(s): the "
                   "journal is not this build's, or damaged",
                   r.at("r").get<Round>(), rec ? fmt::format("round {} with {} member(s)", rec->round, replayed.size()) : "no round",
                   journaled.size());
    }
    const bool audit = !audit_.last_round() || rec->round > *audit_.last_round();
    PlaceRound(*rec, audit);
    return Status::Ok();
  }
  if (kind == "leave") {
    const WorkerId id = r.at("w").get<WorkerId>();
    DSYNC_ASSIGN_OR_RETURN(Clock next, rule_.Remove(id, r.at("failed").get<bool>()));
    gone_workers_[id] = next;
    workers_.erase(id);
    last_gate_.erase(id);
    if (policy_) {
      policy_->Leave(id);
      payoff_->MembershipChanged();
    }
    ++(r.at("failed").get<bool>() ? counters_.workers_failed : counters_.workers_left);
    return Status::Ok();
  }
  if (kind == "lost") {
    DSYNC_ASSIGN_OR_RETURN(ServerEntry * s, JournaledServer(r.at("id").get<NodeId>()));
    RecordLoss(*s);
    return Status::Ok();
  }
  if (kind == "lr") {
    learning_rate_ = std::make_pair(r.at("from").get<Round>(), r.at("rate").get<float>());
    lr_changes_[learning_rate_->first] = learning_rate_->second;
    return Status::Ok();
  }
  if (kind == "damp") {
    ResumeDamped(r.at("from").get<Round>());
    return Status::Ok();
  }
  if (kind == "restarted") return Status::Ok();
  if (kind == "end") {
    return Error(StatusCode::kFailedPrecondition,
                 "the job of this journal is over ({}): there is nothing to resume; resume "
                 "from its checkpoints (--resume DIR) to train on",
                 r.at("why").get<std::string>());
  }
  return Error(StatusCode::kDataLoss, "unknown record '{}'", kind);
}

SchedulerNode::ServerEntry* SchedulerNode::FindServer(NodeId id) {
  const uint32_t rank = ServerRank(id);
  return rank < servers_.size() ? &servers_[rank] : nullptr;
}

Result<SchedulerNode::ServerEntry*> SchedulerNode::JournaledServer(NodeId id) {
  ServerEntry* s = FindServer(id);
  if (s == nullptr) return Error(StatusCode::kDataLoss, "server {} never registered", id);
  return s;
}

Status SchedulerNode::ReplayJob(const nlohmann::json& r) {
  const int format = r.at("format").get<int>();
  if (format < kOldestJournalFormat || format > kJournalFormat) {
    return Error(StatusCode::kDataLoss,
                 "journal format {} is not one this build reads ({} to {}): {}", format,
                 kOldestJournalFormat, kJournalFormat,
                 format > kJournalFormat ? "a newer build wrote it; resume with that build"
                                         : "damaged");
  }
  auto key = JobKeyFromHex(r.at("key").get<std::string>());
  if (!key) return Error(StatusCode::kDataLoss, "the job key is malformed");
  job_key_ = *key;
  const nlohmann::json& settings = r.at("settings");
  const Config defaults;
  for (const Setting& st : Settings()) {
    if (!JournaledSetting(st)) continue;
    // Not in the record: the job ran with the default (an older journal's, or unset).
    const std::string text = settings.value(std::string(st.env), st.get(defaults));
    if (st.get(cfg_) == text) continue;
    if (st.get(cfg_) != st.get(defaults)) {
      spdlog::warn("scheduler: {} {} is not the job's: the job of the journal runs with '{}'",
                   st.flags, st.get(cfg_), text);
    }
    DSYNC_RETURN_IF_ERROR(ApplySetting(st, cfg_, text, st.env));
  }
  DSYNC_RETURN_IF_ERROR(cfg_.Validate());
  rule_ = RoundRule(cfg_.sync);
  StartJobPolicies();
  server_events_ = ServerEvents(cfg_.num_servers);  // the journal's server count
  const Round start = r.at("start_version").get<Round>();
  if (start > 0) DSYNC_RETURN_IF_ERROR(rule_.StartAt(start, r.at("start_clock").get<Clock>()));
  rounds_announced_ = start;
  prior_gradients_ = r.at("prior_gradients").get<uint64_t>();
  if (r.contains("lr")) {
    learning_rate_ = std::make_pair(r["lr"].at(0).get<Round>(), r["lr"].at(1).get<float>());
    lr_changes_[learning_rate_->first] = learning_rate_->second;
  }
  if (r.contains("damp_from")) ResumeDamped(r["damp_from"].get<Round>());
  if (r.contains("resumed_from")) {
    // Servers that register after the restart load their slices from it.
    const std::string path = r["resumed_from"].get<std::string>();
    auto m = ReadCheckpoint(path);
    if (m.ok()) {
      resumed_ = FoundCheckpoint{path, std::move(m).value()};
    } else {
      resume_unreadable_ = m.status();
    }
  }
  return Status::Ok();
}

void SchedulerNode::PlaceRound(RoundRecord& rec, bool audit) {
  round_entries_.clear();
  round_sizes_.clear();
  for (const RoundMember& m : rec.members) {
    PendingCommit c = TakeCommit(m);
    round_entries_.push_back({m, std::move(c.tensors)});
    round_sizes_.push_back(c.size);
  }
  EncodeRound(round_entries_, meta_buf_);
  if (!cfg_.journal.empty()) {
    recent_rounds_.emplace_back(rec.round, meta_buf_);
    if (recent_rounds_.size() > kMaxResendRounds) recent_rounds_.pop_front();
  }
  if (audit) AuditRound(rec);
  gradients_in_rounds_ += rec.members.size();
  for (const RoundMember& m : rec.members) {
    Clock& next = placed_next_clock_[m.worker];
    next = std::max(next, m.clock + 1);
  }
  rounds_announced_ = rec.round + 1;
}

}  // namespace dsync::ps
