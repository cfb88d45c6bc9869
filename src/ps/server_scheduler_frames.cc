// The server node: the scheduler's frames (rounds, losses, checkpoints, takeovers) and rejoining
// a restarted scheduler. The class: ps/server_internal.h.
#include "ps/server_internal.h"

namespace dsync::ps {

void ServerNode::RejoinLoop() {
  std::unique_lock lock(mu_);
  Status st = RunRejoin(
      lock, cv_, *transport_, cfg_, job_.reconnect_grace_ms, id_, rejoin_,
      [&] { return stop_ || shutdown_ || !result_.ok(); },
      [&] {
        Hello hello;
        hello.role = Role::kServer;
        hello.token = cfg_.token;
        hello.node = id_;
        hello.host = advertised_;
        hello.port = port_;
        hello.rejoin = true;
        hello.credential = ServerProof(*job_.job_key, id_, kSchedulerId);
        hello.rounds_received = next_round_in_;
        hello.rounds_applied = stats_.rounds_applied;
        return hello;
      });
  if (!st.ok() && result_.ok()) {
    result_ = std::move(st);
    spdlog::error("server {}: {}", id_.load(), result_.message());
    cv_.notify_all();
  }
}

void ServerNode::OnRejoinAnswer(PeerId peer, const FrameHeader& h,
                                std::span<const std::byte> meta) {
  std::lock_guard lock(mu_);
  if (rejoin_.TakeAnswer(h, meta, *job_.job_key, id_)) {
    scheduler_ = peer;
    spdlog::info("server {}: back with the restarted scheduler; it goes on from round {}",
                 id_.load(), next_round_in_);
    // Rounds applied since the hello was written were reported to the lost scheduler.
    if (const Round applied = stats_.rounds_applied; applied > 0) {
      FrameHeader done = MakeHeader(MsgType::kApplied, id_);
      done.set_round(applied - 1);
      (void)SendControl(*transport_, peer, done);
    }
  }
  cv_.notify_all();
}

void ServerNode::HandleScheduler(const FrameHeader& h, std::span<const std::byte> meta) {
  switch (h.msg_type()) {
    case MsgType::kHelloAck: {
      auto w = DecodeWelcome(meta);
      std::lock_guard lock(mu_);
      if (!w.ok()) {
        result_ = w.status().WithContext("scheduler's answer");
      } else if (!w->job_key) {
        result_ = Error(StatusCode::kProtocol, "the scheduler's answer carries no job key");
      } else {
        job_ = std::move(w).value();
        id_ = job_.id;
        // A change of the learning rate made before this server joined.
        if (job_.learning_rate) lr_schedule_[job_.learning_rate->first] = job_.learning_rate->second;
        if (job_.damp_from) damp_from_ = job_.damp_from;  // damped before this server joined
        clients_.Configure(*job_.job_key, job_.id);
        ledger_.Configure(*job_.job_key, job_.id, job_.num_servers,
                          StagingWindow(job_.sync, job_.replicas), job_.replicas);
        if (job_.restore) result_ = RestoreCheckpoint(*job_.restore);
        if (job_.takeover_from) {
          // The lost server's rank: rounds from here on; its slices as copies (kCopyOut).
          stats_.rounds_applied = *job_.takeover_from;
          awaiting_copies_ = true;
          ledger_.set_window(ledger_.window() * kTakeoverStagingFactor);
          spdlog::info("server {}: takes the place of the lost server of rank {} from round "
                       "{}; its slices come as copies from the other servers",
                       job_.id, ServerRank(job_.id), *job_.takeover_from);
        }
        if (!result_.ok()) {
          spdlog::error("server {}: {}", id_.load(), result_.message());
          cv_.notify_all();
          return;
        }
        welcomed_ = true;
        next_round_in_ = stats_.rounds_applied;
        // Workers are admitted only once every server said so: none is turned away by a
        // server that has not taken its welcome yet.
        (void)SendControl(*transport_, scheduler_, MakeHeader(MsgType::kReady, id_));
      }
      cv_.notify_all();
      return;
    }
    case MsgType::kError: {
      std::lock_guard lock(mu_);
      result_ = ErrorFromFrame(h, meta).WithContext(welcomed_ ? "the scheduler ended the job"
                                                              : "the scheduler refused this server");
      cv_.notify_all();
      return;
    }
    case MsgType::kRound: {
      PendingRound r{h.round(), {}, std::nullopt, false, {}, {}, {}, 0};
      Status st = DecodeRound(meta, r.members);
      std::lock_guard lock(mu_);
      if (!st.ok()) {
        result_ = st.WithContext("round from the scheduler");
      } else if (r.round < next_round_in_) {
        return;  // sent again by a restarted scheduler: this server has it already
      } else {
        next_round_in_ = r.round + 1;
        r.lr = LearningRateOf(r.round);
        r.damped = damp_from_ && r.round >= *damp_from_;
        rounds_.push_back(std::move(r));
      }
      cv_.notify_all();
      return;
    }
    case MsgType::kLearningRate: {
      // Sent before the round it starts from, on this same ordered connection: every
      // server applies the change from the same round.
      auto lr = DecodeLearningRate(meta);
      std::lock_guard lock(mu_);
      if (!lr.ok()) {
        result_ = lr.status().WithContext("learning rate from the scheduler");
      } else {
        lr_schedule_[h.round()] = *lr;
        spdlog::info("server {}: learning rate {} from round {}", id_.load(), *lr, h.round());
      }
      cv_.notify_all();
      return;
    }
    case MsgType::kDamp: {
      // Sent before the round it starts from, on this same ordered connection: every
      // server damps from the same round. The first word holds (a restarted scheduler
      // sends it again).
      std::lock_guard lock(mu_);
      if (!damp_from_) {
        damp_from_ = h.round();
        spdlog::info("server {}: staleness policy {} from round {}", id_.load(),
                     job_.staleness.Active(true).ToString(), h.round());
      }
      return;
    }
    case MsgType::kWorkerGone:
      DiscardUncommitted(h.gone_worker(), h.next_clock());
      return;
    case MsgType::kServerGone: {
      std::lock_guard lock(mu_);
      if (h.gone_server() == id_ && awaiting_copies_.load()) {
        // Taking a rank over failed (the scheduler's log says why): a failure of this
        // server, which the job does without.
        if (result_.ok()) {
          result_ = Error(StatusCode::kUnavailable,
                          "the scheduler went on without this server before it held the "
                          "copies of rank {} (its log says why); start a new server to try "
                          "again",
                          ServerRank(id_));
          spdlog::error("server {}: {}", id_.load(), result_.message());
        }
        stop_ = true;
        cv_.notify_all();
        return;
      }
      if (h.gone_server() == id_) {
        // Declared lost (it stopped answering for the heartbeat timeout): the job goes on
        // without this server, and its copies are stale from now on. It stops, and not as
        // a failure: nothing it held is missed.
        spdlog::warn("server {}: the scheduler declared this server lost and goes on without "
                     "it (its slices have other copies); stopping",
                     id_.load());
        evicted_ = true;
        stop_ = true;
        cv_.notify_all();
        return;
      }
      // Its slices' other copies (some here) carry on; nothing changes on this server: it
      // applies the same rounds to what it holds, and workers pull from the next copy.
      spdlog::warn("server {}: the scheduler lost server {} ({} server(s) lost so far)",
                   id_.load(), h.gone_server(), h.losses());
      return;
    }
    case MsgType::kServerBack:
      spdlog::info("server {}: a new server took the place of server {}", id_.load(),
                   h.gone_server());
      return;
    case MsgType::kCopyOut: {
      std::lock_guard lock(mu_);
      if (awaiting_copies_.load()) {  // this server is the one the copies are for
        copy_at_ = h.round();
        copies_expected_ = h.senders();
        takeover_number_ = h.backs();
        spdlog::info("server {}: {} server(s) send the copies of this rank at version {}",
                     id_.load(), copies_expected_, h.round());
        if (copies_expected_ == 0) FinishCopies();
        cv_.notify_all();
        return;
      }
      // Queued behind the rounds before it: the apply thread sends them in order.
      PendingRound copy{h.round(), {}, std::nullopt, false, {}, h.gone_server(), {}, h.backs()};
      Status st = DecodeLiveRanks(meta, job_.num_servers, copy.live);
      if (!st.ok()) {
        result_ = st.WithContext("copy request from the scheduler");
      } else {
        rounds_.push_back(std::move(copy));
      }
      cv_.notify_all();
      return;
    }
    case MsgType::kCheckpoint: {
      // Queued behind the rounds before it: the apply thread writes it in order.
      std::lock_guard lock(mu_);
      if (meta.empty()) {
        result_ = Error(StatusCode::kProtocol, "a checkpoint request names no directory");
      } else {
        rounds_.push_back(
            PendingRound{h.round(), {}, std::nullopt, false, std::string(AsText(meta)), {}, {}, 0});
      }
      cv_.notify_all();
      return;
    }
    case MsgType::kShutdown: {
      std::lock_guard lock(mu_);
      shutdown_ = true;
      cv_.notify_all();
      return;
    }
    default:
      spdlog::warn("server {}: ignoring {} from the scheduler", id_.load(),
                   MsgTypeName(h.msg_type()));
  }
}

std::optional<float> ServerNode::LearningRateOf(Round round) {
  auto it = lr_schedule_.upper_bound(round);
  if (it == lr_schedule_.begin()) return std::nullopt;
  --it;
  lr_schedule_.erase(lr_schedule_.begin(), it);
  return it->second;
}

void ServerNode::DiscardUncommitted(WorkerId w, Clock next_clock) {
  // No longer a member: nothing it sends is taken any more.
  if (const PeerId peer = clients_.MarkGone(w, next_clock); peer != kNoPeer) {
    transport_->Close(peer);
  }
  std::shared_lock lock(slices_mu_);
  size_t dropped = 0;
  for (SliceState* s : slice_list_) {
    std::lock_guard slock(s->mu);
    std::erase_if(s->staged, [&](const Staged& st) {
      if (st.worker != w || st.clock < next_clock) return false;
      ReleaseBuffer(st.data, s->elements * sizeof(float));
      ++dropped;
      --stats_.staged_now;
      return true;
    });
  }
  ledger_.Gone(w, next_clock);
  if (dropped) {
    spdlog::info("server {}: discarded {} uncommitted slice(s) of worker {}", id_.load(),
                 dropped, w);
  }
}

}  // namespace dsync::ps
