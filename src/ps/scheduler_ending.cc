// The scheduler node: the job finishing or stopping, checkpoints, and the frames that must
// leave before the transport shuts down. The class: ps/scheduler_internal.h.
#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::CheckFinished() {
  // A stopping job ends through StopIfCheckpointSettled.
  if (finished_ || stop_ || stopping_ || !started_ || rule_.live_workers() > 0 ||
      rule_.has_queued() || !waiting_.empty()) {
    return;
  }
  for (const ServerEntry& s : LiveServers()) {
    // A server taking a rank over ends the job holding its copies (or lost, within
    // kTakeoverSeconds).
    if (s.applied < rule_.open_round() || s.taking_over) return;
  }
  // The final checkpoint, before anyone is told the job is over; this runs again when it
  // has settled (written or failed).
  if (checkpoints_.in_flight()) return;
  if (checkpoints_.FinalNeeded(rule_.open_round())) {
    BeginCheckpoint();
    return;
  }
  // The newest settled checkpoint is at this version now (the final one, or a periodic
  // one that fell on it).
  if (checkpoints_.enabled() && !checkpoints_.last_result().ok()) {
    // Training is done, but what the user asked to keep of it is not: say so loudly.
    const Status why = checkpoints_.last_result().WithContext("the job's final checkpoint");
    ShutDownServers(why);
    Finish(why);
    return;
  }
  // Observers get to read the final model before the servers go: they are told the final
  // version and the job waits (bounded) until they leave.
  if (!observers_.empty()) {
    if (!observers_told_) {
      observers_told_ = true;
      observers_deadline_ = SteadyClock::now() + kObserverGrace;
      FrameHeader done = MakeHeader(MsgType::kShutdown, kSchedulerId);
      done.set_final_version(rule_.open_round());
      for (const auto& [id, peer] : observers_) Send(peer, done);
      spdlog::info("scheduler: training is over at version {}; waiting for {} observer(s) to "
                   "read the final model",
                   rule_.open_round(), observers_.size());
    }
    if (SteadyClock::now() < observers_deadline_) return;
    spdlog::warn("scheduler: {} observer(s) did not leave within {} s; ending the job anyway",
                 observers_.size(), kObserverGrace.count());
  }
  spdlog::info("scheduler: every worker is gone and all {} round(s) are applied; ending the job",
               rule_.open_round());
  ShutDownServers(Status::Ok());
  Finish(Status::Ok());
}

void SchedulerNode::StopIfCheckpointSettled() {
  if (!stopping_ || stop_ || checkpoints_.in_flight()) return;
  if (checkpoints_.FinalNeeded(rounds_announced_) && SteadyClock::now() < stop_deadline_) {
    BeginCheckpoint();
    // Settled at once (every frame failed): go on from here rather than at the deadline.
    if (!checkpoints_.in_flight()) StopIfCheckpointSettled();
    return;
  }
  if (!salvage_.ok()) {  // a lost server ended the job: it fails, saying what was kept
    const auto& written = checkpoints_.last_written();
    if (!checkpoints_.last_result().ok()) {
      EndStopping(Error(salvage_.code(), "{}; no checkpoint of the surviving slices could be "
                                         "written: {}",
                        salvage_.message(), checkpoints_.last_result().message()));
    } else if (written && written->version == rounds_announced_) {
      EndStopping(Error(salvage_.code(), "{}; the surviving slices are in {} ({}: `dsyncps "
                                         "checkpoint export` reads it)",
                        salvage_.message(), written->path,
                        written->partial ? "a partial checkpoint, which --resume passes over"
                                         : "a complete checkpoint"));
    } else {
      EndStopping(Error(salvage_.code(), "{}; nothing to checkpoint: no round was applied "
                                         "since the job {}",
                        salvage_.message(), resumed_ ? "resumed" : "started"));
    }
    return;
  }
  if (!checkpoints_.last_result().ok()) {
    EndStopping(checkpoints_.last_result().WithContext("stopped without a checkpoint of "
                                                       "where the job was"));
    return;
  }
  if (checkpoints_.complete_any()) {
    spdlog::info("scheduler: stopped; resume the job with --resume {}", cfg_.checkpoint_dir);
  }
  EndStopping(Status::Ok());
}

void SchedulerNode::ShutDownServers(const Status& why) {
  JournalEnd(why);
  FrameHeader h = MakeHeader(MsgType::kShutdown, kSchedulerId);
  for (const ServerEntry& s : LiveServers()) SendTracked(s.peer, h);
}

void SchedulerNode::JournalEnd(const Status& why) {
  if (!journal_.open() || end_journaled_) return;
  end_journaled_ = true;
  journal_.Add({{"k", "end"}, {"why", why.ok() ? std::string("finished") : why.message()}});
}

void SchedulerNode::EndStopping(Status why) {
  if (!why.ok()) {
    spdlog::error("scheduler: {}", why.message());
    TellFailure(why);
  }
  stop_result_ = std::move(why);
  ShutDownServers(stop_result_);
  stop_ = true;
  cv_.notify_all();
}

void SchedulerNode::BeginCheckpoint() {
  CheckpointManifest m;
  m.version = rounds_announced_;
  m.num_servers = cfg_.num_servers;
  m.replicas = cfg_.replicas;
  m.slice_bytes = cfg_.slice_bytes;
  m.sync = cfg_.sync.ToString();  // the job's, not the quorum dsync:auto or a finish set
  m.gradients_committed = prior_gradients_ + gradients_in_rounds_;
  m.clock = ResumeClock();
  m.learning_rate = learning_rate_;
  m.damp_from = damp_from_;
  const Version version = m.version;
  const std::string dir = checkpoints_.Begin(std::move(m), SteadyClock::now());
  FrameHeader h = MakeHeader(MsgType::kCheckpoint, kSchedulerId);
  h.set_round(version);
  for (const ServerEntry& s : servers_) {
    if (s.lost || s.taking_over) {
      (void)checkpoints_.Lost(ServerRank(s.id));  // its slices' copies are in the others
      continue;
    }
    if (s.away) {
      (void)checkpoints_.Reported(ServerRank(s.id), version,
                                  Error(StatusCode::kUnavailable, "server {} is not back yet", s.id));
      continue;
    }
    if (journal_.open()) {
      Send(s.peer, h, AsBytes(dir));  // a send that fails ends the connection: reported then
      continue;
    }
    Status st = transport_->Send(s.peer, h, AsBytes(dir), nullptr, 0);
    if (!st.ok()) (void)checkpoints_.Reported(ServerRank(s.id), version, st);
  }
}

Clock SchedulerNode::ResumeClock() const {
  std::optional<Clock> low, high;
  for (const auto& [w, next] : placed_next_clock_) {
    high = std::max(high.value_or(next), next);
    if (rule_.is_live(w)) low = std::min(low.value_or(next), next);
  }
  return low.value_or(high.value_or(rounds_announced_));
}

void SchedulerNode::SendTracked(PeerId peer, const FrameHeader& h) {
  ++final_frames_in_flight_;
  Out([this, peer, h, locked = !journal_.open()] {
    Status st = transport_->Send(peer, h, {}, nullptr, 0, [this](const Status&) {
      std::lock_guard lock(mu_);
      --final_frames_in_flight_;
      cv_.notify_all();
    });
    if (!st.ok()) Untrack(locked);
  });
}

void SchedulerNode::Finish(Status result) {
  if (finished_) return;
  if (!result.ok()) {
    spdlog::error("scheduler: {}", result.message());
    TellFailure(result);
  }
  finished_ = true;
  result_ = std::move(result);
  cv_.notify_all();
}

void SchedulerNode::SendErrorTracked(PeerId peer, const Status& why, const FrameHeader& about) {
  ++final_frames_in_flight_;
  Out([this, peer, why, about, locked = !journal_.open()] {
    const Status st = SendError(*transport_, peer, kSchedulerId, why, about,
                                /*close_after=*/false, [this](const Status&) {
                                  std::lock_guard lock(mu_);
                                  --final_frames_in_flight_;
                                  cv_.notify_all();
                                });
    if (!st.ok()) Untrack(locked);
  });
}

void SchedulerNode::Untrack(bool locked) {
  if (locked) {
    --final_frames_in_flight_;
    return;
  }
  std::lock_guard lock(mu_);
  --final_frames_in_flight_;
  cv_.notify_all();
}

void SchedulerNode::TellFailure(const Status& why) {
  auto tell = [&](PeerId peer, uint64_t request) {
    FrameHeader about = MakeHeader(MsgType::kHello, kSchedulerId);
    about.request = request;
    SendErrorTracked(peer, why, about);
  };
  for (const auto& [id, peer] : waiting_) tell(peer, waiting_requests_[id]);
  for (const WaitingObserver& o : waiting_observers_) tell(o.peer, o.request);
}

}  // namespace dsync::ps
