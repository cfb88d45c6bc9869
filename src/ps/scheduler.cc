// The scheduler node: admits servers and workers, watches heartbeats, feeds the RoundRule
// and broadcasts its decisions. Every handler runs under one mutex: the scheduler only sees
// small control frames, and Transport::Send never blocks, so one lock keeps the decisions
// simple to reason about without costing throughput.
//
// Trust (docs/contract.md): the cluster token only lets a node ask to join; admitted nodes
// get credentials derived from a job key that only the scheduler and the servers hold, and a
// commit is placed only when the servers' receipts prove its slices are staged
// (commit_proof.h). Liveness: workers and servers heartbeat; a node judges no one silent for
// a time during which it was itself stalled, nor while the peer's frames sit unread.
#include "dsync/scheduler.h"

#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::StartJobPolicies() {
  policy_.reset();
  payoff_.reset();
  growth_.reset();
  damp_from_.reset();
  // Only a job that can apply a stale gradient has one to damp.
  if (cfg_.staleness.damp && cfg_.sync != SyncMode::Bsp()) growth_.emplace();
  if (!cfg_.sync.adaptive) return;
  AutoPolicyOptions o;
  o.max_bound = cfg_.sync.bound;
  policy_.emplace(o);
  payoff_.emplace(DelayPayoffOptions{}, cfg_.staleness.Active(false));
}

SchedulerNode::~SchedulerNode() {
  if (!rendezvous_host_.empty()) RemoveRendezvous(cfg_.rendezvous, rendezvous_host_, port_);
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    flusher_stop_ = true;
    cv_.notify_all();
    flush_cv_.notify_all();
  }
  if (monitor_.joinable()) monitor_.join();
  if (flusher_.joinable()) {
    // A flusher stuck in a write that never returns cannot be joined; the process that
    // stops here exits (the role's main returns).
    if (journal_stuck_) {
      flusher_.detach();
    } else {
      flusher_.join();
    }
  }
  transport_->Shutdown();
}

Status SchedulerNode::Init() {
  // A journal given to --resume: this scheduler continues that job (it was restarted).
  const bool restarted = !cfg_.resume.empty() && IsJournal(cfg_.resume);
  DSYNC_RETURN_IF_ERROR(audit_.Open(cfg_.audit_log, /*append=*/restarted));
  if (restarted) {
    DSYNC_RETURN_IF_ERROR(ResumeJournal());
  } else {
    if (!cfg_.resume.empty()) DSYNC_RETURN_IF_ERROR(Resume());
    if (!cfg_.journal.empty()) DSYNC_RETURN_IF_ERROR(StartJournal());
  }
  // A job resumed past the share (or finishing all of it) runs as bsp from its first round;
  // a restarted scheduler whose journal lost the switch with its torn tail switches now.
  MaybeFinish();
  if (!cfg_.checkpoint_dir.empty()) {
    // Said now rather than when the first checkpoint is due.
    std::error_code ec;
    std::filesystem::create_directories(cfg_.checkpoint_dir, ec);
    if (ec) {
      return Error(StatusCode::kInvalidArgument, "--checkpoint-dir {}: cannot create it: {}",
                   cfg_.checkpoint_dir, ec.message());
    }
  }
  if (cfg_.finish_bsp_percent && *cfg_.finish_bsp_percent > 0 &&
      (!Delays() || cfg_.max_gradients == 0)) {
    spdlog::warn("scheduler: --finish-bsp {} changes nothing in this job: {}",
                 *cfg_.finish_bsp_percent,
                 !Delays() ? fmt::format("{} has no delay to end (only dsync:K[,Q] with K "
                                         "> 0 and dsync:auto finish as bsp)",
                                         cfg_.sync.ToString())
                           : std::string("it has no budget (--max-gradients) to know its end by"));
  }
  if (cfg_.staleness.temper_momentum) WarnIfTemperingIsIdle();
  if (cfg_.token.empty()) {
    spdlog::warn("scheduler: running without a cluster token (--insecure): anyone who can "
                 "reach {}:{} may join this job",
                 cfg_.bind_host, cfg_.scheduler_port);
  }
  {
    // Before the listener: from then on the transport's threads write it (under mu_).
    std::lock_guard lock(mu_);
    last_arrival_ = SteadyClock::now();
  }
  transport_->SetHandler(this);
  DSYNC_ASSIGN_OR_RETURN(const std::string listen_host, ResolveListenHost(cfg_.bind_host));
  DSYNC_ASSIGN_OR_RETURN(port_, transport_->Listen(listen_host, cfg_.scheduler_port));
  if (!cfg_.rendezvous.empty()) {
    DSYNC_ASSIGN_OR_RETURN(rendezvous_host_,
                           AdvertisedHost(listen_host, cfg_.advertise_host, "", 0));
    DSYNC_RETURN_IF_ERROR(WriteRendezvous(cfg_.rendezvous, rendezvous_host_, port_));
    spdlog::info("scheduler: wrote {}:{} to the rendezvous file {}", rendezvous_host_, port_,
                 cfg_.rendezvous);
  }
  monitor_ = std::thread([this] { MonitorHeartbeats(); });
  if (journal_.open()) flusher_ = std::thread([this] { FlushJournal(); });
  spdlog::info("scheduler listening on {}:{} (sync {}, staleness policy {}, {} server(s), {} "
               "initial worker(s))",
               listen_host.empty() ? "0.0.0.0" : listen_host, port_, rule_.mode().ToString(),
               cfg_.staleness.ToString(), cfg_.num_servers, cfg_.num_workers);
  return Status::Ok();
}

Status SchedulerNode::Resume() {
  std::error_code ec;
  const std::string dir = std::filesystem::absolute(cfg_.resume, ec).string();
  if (ec) return Error(StatusCode::kInvalidArgument, "--resume {}: {}", cfg_.resume, ec.message());
  std::vector<SkippedCheckpoint> skipped;
  Result<FoundCheckpoint> found = FindNewestCheckpoint(dir, &skipped);
  for (const SkippedCheckpoint& s : skipped) {
    spdlog::warn("scheduler: --resume: refused a checkpoint: {}", s.why);
  }
  if (!found.ok()) return found.status().WithContext("--resume");
  if (Status st = CheckUtf8(found->path); !st.ok()) return st.WithContext("--resume");
  // The refused ones are newer than the one this job continues from: set aside, so that
  // neither a later --resume nor pruning mistakes them for this job's.
  for (const SkippedCheckpoint& s : skipped) {
    if (!s.damaged) continue;  // a partial one stays for export
    if (Status st = SetAside(s.path); !st.ok()) return st.WithContext("--resume");
    spdlog::warn("scheduler: --resume: moved {} aside", s.path);
  }
  const CheckpointManifest& m = found->manifest;
  if (m.num_servers != cfg_.num_servers) {
    return Error(StatusCode::kInvalidArgument,
                 "--resume: the checkpoint {} was written by {} server(s); start the job with "
                 "{} server(s), each holds the slices of its rank",
                 found->path, m.num_servers, m.num_servers);
  }
  if (m.replicas != cfg_.replicas) {
    return Error(StatusCode::kInvalidArgument,
                 "--resume: the checkpoint {} kept {} cop{} of each slice; start the job with "
                 "--replicas {}, each server holds the copies of its rank",
                 found->path, m.replicas, m.replicas == 1 ? "y" : "ies", m.replicas);
  }
  if (m.slice_bytes != cfg_.slice_bytes) {
    return Error(StatusCode::kInvalidArgument,
                 "--resume: the checkpoint {} cut tensors into slices of {} bytes; start the "
                 "job with --slice-bytes {}",
                 found->path, m.slice_bytes, m.slice_bytes);
  }
  DSYNC_RETURN_IF_ERROR(rule_.StartAt(m.version, m.clock));
  rounds_announced_ = m.version;
  learning_rate_ = m.learning_rate;
  // A job damped before its checkpoint stays damped (a job resumed with another policy
  // than damp has nothing to damp).
  if (m.damp_from && cfg_.staleness.damp) ResumeDamped(*m.damp_from);
  prior_gradients_ = m.gradients_committed;
  checkpoints_ = CheckpointCoordinator(cfg_, m.version);
  spdlog::info("scheduler: resuming from {} (version {}, clock {}, {} gradient(s) applied "
               "before)",
               found->path, m.version, m.clock, m.gradients_committed);
  resumed_ = std::move(found).value();
  return Status::Ok();
}

Status SchedulerNode::Run() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return finished_ || stop_; });
  if ((finished_ && result_.ok()) || stopping_) {
    // Let the last acknowledgements and the shutdown frames leave first.
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return final_frames_in_flight_ == 0; });
  }
  if (finished_ && !result_.ok()) {
    // The nodes still waiting to be admitted are told why (TellFailure).
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return final_frames_in_flight_ == 0; });
  }
  Status result = stop_ && !finished_ ? stop_result_ : result_;
  if (journal_.open() && !journal_failed_) {
    // Nodes of a journaled job wait for a lost scheduler to come back: those still here are
    // told the job is over instead. Servers of a job that ended well are shut down (again:
    // it changes nothing), the others and the workers get the error.
    JournalEnd(result);
    if (!finished_ || !result.ok()) {
      const Status why = result.ok() ? Error(StatusCode::kAborted, "the scheduler was stopped")
                                     : result;
      const FrameHeader about = MakeHeader(MsgType::kShutdown, kSchedulerId);
      for (const auto& [id, w] : workers_) {
        if (!w.away) SendErrorTracked(w.peer, why, about);
      }
      for (const ServerEntry& s : LiveServers()) {
        if (s.away) continue;
        if (result.ok()) {
          SendTracked(s.peer, about);
        } else {
          SendErrorTracked(s.peer, why, about);
        }
      }
    }
    flush_cv_.notify_one();
    cv_.wait_for(lock, std::chrono::seconds(5), [&] {
      return !journal_.pending() && outbox_.empty() && !flushing_ && final_frames_in_flight_ == 0;
    });
  }
  lock.unlock();
  transport_->Shutdown();
  return result;
}

void SchedulerNode::Stop() {
  std::lock_guard lock(mu_);
  if (checkpoints_.enabled() && !finished_ && !stop_) {
    if (stopping_) return;
    stopping_ = true;
    stop_deadline_ = SteadyClock::now() + std::chrono::seconds(kStopCheckpointSeconds);
    spdlog::warn("scheduler: stopping once a checkpoint of where the job is has been written "
                 "(at most {} s)",
                 kStopCheckpointSeconds);
    StopIfCheckpointSettled();
    return;
  }
  stop_ = true;
  cv_.notify_all();
}

SchedulerStats SchedulerNode::stats() const {
  std::lock_guard lock(mu_);
  SchedulerStats s = counters_;
  s.rounds_closed = rule_.stats().rounds_closed;
  s.gradients_committed = rule_.stats().gradients_committed;
  s.max_staleness = rule_.stats().max_staleness;
  s.damped_from = damp_from_;
  if (growth_) {
    s.growth_peak = growth_->peak_ratio();
    s.growth_peak_round = growth_->peak_round();
  }
  s.live_workers = rule_.live_workers();
  return s;
}

std::vector<RoundRecord> SchedulerNode::history() const {
  std::lock_guard lock(mu_);
  return {history_.begin(), history_.end()};
}

void* SchedulerNode::OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte>) {
  if (h.msg_type() != MsgType::kCopy || h.payload_len == 0) return nullptr;
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.kind != PeerKind::kServer ||
      !CopyExpected(it->second.id, h)) {
    return nullptr;
  }
  return new (std::nothrow) std::byte[h.payload_len];
}

void SchedulerNode::OnPayloadLost(PeerId, const FrameHeader&, void* payload) {
  delete[] static_cast<std::byte*>(payload);
}

void SchedulerNode::OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                            void* payload) {
  std::lock_guard lock(mu_);
  if (h.msg_type() == MsgType::kCopy) {  // the one payload the scheduler takes (OnHeader)
    auto it = peers_.find(peer);
    if (!doomed_.contains(peer) && it != peers_.end() && it->second.kind == PeerKind::kServer) {
      RelayCopy(it->second.id, h, meta, static_cast<std::byte*>(payload));
      return;
    }
    delete[] static_cast<std::byte*>(payload);
    if (doomed_.contains(peer)) return;
  }
  if (doomed_.contains(peer)) return;
  if (h.payload_len != 0) {
    Refuse(peer, h, Error(StatusCode::kProtocol, "the scheduler takes no payloads"), true);
    return;
  }
  auto it = peers_.find(peer);
  if (it == peers_.end()) {
    HandleHello(peer, h, meta);
    return;
  }
  const PeerInfo info = it->second;
  if (info.kind == PeerKind::kWorker) {
    HandleWorker(peer, info.id, h, meta);
  } else if (info.kind == PeerKind::kObserver) {
    if (h.msg_type() == MsgType::kLeave) {
      FrameHeader ack = MakeHeader(MsgType::kLeaveAck, kSchedulerId);
      ack.request = h.request;
      SendTracked(peer, ack);
      observers_.erase(info.id);
      CheckFinished();
    } else if (h.msg_type() != MsgType::kHeartbeat) {
      Refuse(peer, h,
             Error(StatusCode::kPermissionDenied,
                   "observer {} is read-only: it pulls from the servers and sends the "
                   "scheduler nothing but heartbeats",
                   info.id),
             false);
    }
  } else {
    HandleServer(peer, info.id, h, meta);
  }
}

void SchedulerNode::OnDisconnected(PeerId peer, const Status& why) {
  std::lock_guard lock(mu_);
  doomed_.erase(peer);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  const PeerInfo info = it->second;
  peers_.erase(it);
  if (finished_ || stop_) return;  // the job is over: servers told so go
  if (info.kind == PeerKind::kObserver) {
    std::erase_if(waiting_observers_, [&](const WaitingObserver& w) { return w.peer == peer; });
    observers_.erase(info.id);
    CheckFinished();
    return;
  }
  if (info.kind == PeerKind::kServer && servers_[ServerRank(info.id)].taking_over) {
    // It holds no slice the job needs yet: whatever the job is doing, it goes on without it.
    LoseServer(info.id, fmt::format("disconnected ({})", why.message()));
    return;
  }
  if (info.kind == PeerKind::kServer && !salvage_.ok()) {
    SalvageWithout(servers_[ServerRank(info.id)],
                   fmt::format("disconnected ({})", why.message()));
    return;
  }
  if (info.kind == PeerKind::kServer && stopping_) {
    EndStopping(Error(StatusCode::kUnavailable, "stopped without a checkpoint of where the job "
                                                "was: server {} went ({})",
                      info.id, why.message()));
    return;
  }
  if (info.kind == PeerKind::kServer) {
    LoseServer(info.id, fmt::format("disconnected ({})", why.message()));
    return;
  }
  std::erase_if(waiting_, [&](const auto& w) { return w.second == peer; });
  if (rule_.is_live(info.id)) {
    RemoveWorker(info.id, /*failed=*/true, fmt::format("connection lost: {}", why.message()));
  }
}

void SchedulerNode::MonitorHeartbeats() {
  const auto timeout = std::chrono::milliseconds(cfg_.heartbeat_timeout_ms);
  const auto interval = std::chrono::milliseconds(cfg_.heartbeat_interval_ms);
  const auto tick = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1),
                                                        interval / 2);
  std::unique_lock lock(mu_);
  auto last_tick = SteadyClock::now();
  auto judge_from = last_tick;
  auto last_told = last_tick;
  while (!stop_ && !finished_) {
    cv_.wait_for(lock, tick);
    const auto now = SteadyClock::now();
    if (now - last_tick > tick + std::max<SteadyClock::duration>(interval, kStallSlack)) {
      // This node was stalled (SIGSTOP, a debugger, a VM steal): what the peers sent
      // meanwhile is still being read. Give the readers an interval before judging.
      spdlog::warn("scheduler: this process was stalled for {} ms; judging heartbeats again "
                   "once what the peers sent meanwhile is read",
                   std::chrono::duration_cast<std::chrono::milliseconds>(now - last_tick)
                       .count());
      judge_from = now + 2 * interval;
      last_arrival_ += now - last_tick;  // nor count that time against the job's start
    }
    last_tick = now;
    if (now - last_told >= interval) {
      last_told = now;
      TellWaiting();
    }
    if (now >= judge_from) {
      if (rejoin_deadline_ && now > *rejoin_deadline_) RejoinGraceOver();
      std::vector<WorkerId> dead;
      for (const auto& [id, w] : workers_) {
        if (w.away) continue;  // the reconnect grace covers it
        if (now - w.last_seen > timeout && !transport_->HasUnreadInput(w.peer)) {
          dead.push_back(id);
        }
      }
      for (WorkerId id : dead) {
        RemoveWorker(id, /*failed=*/true,
                     fmt::format("no heartbeat for {} ms", cfg_.heartbeat_timeout_ms));
      }
      std::vector<NodeId> silent;
      for (const ServerEntry& s : LiveServers()) {
        // A server restoring a checkpoint is busy before it heartbeats; the start timeout
        // covers one that never gets ready.
        if (s.ready && !s.away && now - s.last_seen > timeout &&
            !transport_->HasUnreadInput(s.peer)) {
          silent.push_back(s.id);
        }
      }
      for (NodeId id : silent) {
        if (finished_ || stop_) break;
        LoseServer(id, fmt::format("stopped answering (no heartbeat for {} ms)",
                                   cfg_.heartbeat_timeout_ms));
      }
      const ServerEntry* filling = Filling();
      if (filling && now - takeover_started_ > std::chrono::seconds(kTakeoverSeconds) &&
          !finished_ && !stop_) {
        LoseServer(filling->id, fmt::format("did not get the copies of its rank within {} s",
                                            kTakeoverSeconds));
      }
      const auto quiet = std::chrono::milliseconds(cfg_.start_timeout_ms);
      if (cfg_.start_timeout_ms > 0 && !started_ && !finished_ && now - last_arrival_ > quiet) {
        // A node that never comes (a host that failed to start it, a wrong address or
        // token) would otherwise hold the scheduler and every node that did come forever.
        Finish(Error(StatusCode::kDeadlineExceeded,
                     "the job did not start: {}, and no node arrived for {} ms "
                     "(--start-timeout-ms, DSYNC_START_TIMEOUT_MS); start the missing nodes "
                     "with this scheduler's address and the job's token, or lower "
                     "--num-servers/--num-workers",
                     WaitingFor(), cfg_.start_timeout_ms));
      }
    }
    if (flushing_ && !journal_failed_ &&
        now - flush_started_ > std::chrono::seconds(kJournalStallSeconds)) {
      journal_failed_ = true;
      journal_stuck_ = true;
      final_frames_in_flight_ = 0;  // nothing leaves any more
      Finish(Error(StatusCode::kUnavailable,
                   "writing the journal {} has not finished for {} s: its disk does not "
                   "answer, and every decision waits for it; the job stops (start the "
                   "scheduler again with --resume {} once the disk answers)",
                   cfg_.journal, kJournalStallSeconds, cfg_.journal));
    }
    if (observers_told_) CheckFinished();  // the observers' grace period may be over
    if (stopping_ && !stop_ && now > stop_deadline_) {
      EndStopping(!salvage_.ok()
                      ? Error(salvage_.code(), "{}; no checkpoint of the surviving slices was "
                                               "written within {} s",
                              salvage_.message(), kStopCheckpointSeconds)
                      : Error(StatusCode::kDeadlineExceeded,
                              "stopped without a checkpoint of where the job was: none was "
                              "written within {} s of the stop",
                              kStopCheckpointSeconds));
    }
  }
}

Result<std::unique_ptr<Scheduler>> StartScheduler(const Config& config,
                                                  std::unique_ptr<Transport> transport) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  auto node = std::make_unique<SchedulerNode>(config, std::move(transport));
  DSYNC_RETURN_IF_ERROR(node->Init());
  return std::unique_ptr<Scheduler>(std::move(node));
}

}  // namespace dsync::ps
