// The scheduler node: servers' frames, a lost server, a new one taking its rank, the copies it
// gathers. The class: ps/scheduler_internal.h.
#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::HandleServer(PeerId peer, NodeId id, const FrameHeader& h,
                                 std::span<const std::byte> meta) {
  for (ServerEntry& s : servers_) {
    if (s.id == id) s.last_seen = SteadyClock::now();
  }
  switch (h.msg_type()) {
    case MsgType::kHeartbeat:
      return;
    case MsgType::kReady:
      for (ServerEntry& s : servers_) {
        if (s.id == id) s.ready = true;
      }
      if (journal_.open()) journal_.Add({{"k", "ready"}, {"id", id}});
      if (servers_[ServerRank(id)].taking_over) {
        AnnounceTakeover(servers_[ServerRank(id)]);
        return;
      }
      last_arrival_ = SteadyClock::now();
      AdmitWaiting();
      return;
    case MsgType::kApplied:
      for (ServerEntry& s : servers_) {
        if (s.id == id) s.applied = std::max<Round>(s.applied, h.round() + 1);
      }
      if (!meta.empty()) AgreementIn(id, h.round(), meta);
      if (cfg_.replicas > 1) {
        Progress();  // rounds held back for a trailing copy may close now
      } else {
        CheckFinished();
      }
      return;
    case MsgType::kCheckpointDone: {
      Result<CheckpointFile> file = Error(StatusCode::kInternal, "not decoded");
      if (h.status != 0) {
        file = ErrorFromFrame(h, meta);
      } else {
        CheckpointDone done;
        Status st = DecodeCheckpointDone(meta, done);
        if (st.ok() && done.file != ServerFileName(ServerRank(id))) {
          st = Error(StatusCode::kProtocol, "server {} reported the file '{}', not '{}'", id,
                     done.file, ServerFileName(ServerRank(id)));
        }
        if (st.ok()) {
          file = CheckpointFile{ServerRank(id), done.file, done.bytes, done.crc32};
        } else {
          file = st;
        }
      }
      if (checkpoints_.Reported(ServerRank(id), h.round(), file)) {
        StopIfCheckpointSettled();
        CheckFinished();
      }
      return;
    }
    case MsgType::kCopy:
      RelayCopy(id, h, meta, nullptr);
      return;
    case MsgType::kCopied:
      CopiesIn(id, h.round());
      return;
    case MsgType::kError:
      if (servers_[ServerRank(id)].taking_over) {  // its failure costs no slice
        LoseServer(id, fmt::format("failed: {}", ErrorFromFrame(h, meta).message()));
        return;
      }
      Finish(ErrorFromFrame(h, meta).WithContext(fmt::format("server {}", id)));
      return;
    default:
      Refuse(peer, h,
             Error(StatusCode::kProtocol, "a server may not send {} to the scheduler",
                   MsgTypeName(h.msg_type())),
             true);
  }
}

void SchedulerNode::LoseServer(NodeId id, const std::string& what) {
  const uint32_t rank = ServerRank(id);
  if (rank >= servers_.size() || servers_[rank].lost || finished_ || stop_) return;
  ServerEntry& s = servers_[rank];
  // Which slices still have a whole copy: a server taking a lost rank over has none yet.
  std::vector<bool> missing(servers_.size());
  for (const ServerEntry& o : servers_) missing[ServerRank(o.id)] = o.lost || o.taking_over;
  missing[rank] = true;
  const bool taking_over = s.taking_over;
  if (!taking_over &&
      (cfg_.replicas <= 1 || !s.ready || !EverySliceHasACopy(missing, cfg_.replicas))) {
    Status why = Error(StatusCode::kUnavailable,
                       "server {} {}; the job cannot continue without its slices{}", id, what,
                       cfg_.replicas <= 1 ? ""
                       : s.ready          ? " (every copy of some slices is lost now)"
                                          : " (it was lost before it was ready)");
    const bool others = std::any_of(servers_.begin(), servers_.end(), [&](const auto& o) {
      return &o != &s && !o.lost && o.ready;
    });
    if (!salvage_.ok()) {  // another loss while the first one's checkpoint is written
      SalvageWithout(s, what);
      return;
    }
    if (!checkpoints_.enabled() || !s.ready || stopping_ || !others) {
      Finish(std::move(why));
      return;
    }
    // What the other servers hold is kept first: a partial checkpoint of where the job
    // was (export reads it), then the job ends with the loss as its error.
    spdlog::error("scheduler: {}; writing a checkpoint of the surviving slices first (at "
                  "most {} s)",
                  why.message(), kStopCheckpointSeconds);
    salvage_ = std::move(why);
    stopping_ = true;
    stop_deadline_ = SteadyClock::now() + std::chrono::seconds(kStopCheckpointSeconds);
    SalvageWithout(s, what);
    return;
  }
  DropServer(s, what);
  RecordLoss(s);
  if (journal_.open()) journal_.Add({{"k", "lost"}, {"id", id}});
  FrameHeader gone = MakeHeader(MsgType::kServerGone, kSchedulerId);
  gone.set_gone_server(id);
  gone.set_losses(static_cast<uint32_t>(server_events_.losses().size()));
  // Told too (a stopped process reads it when it runs again, and stops without an error),
  // then dropped once the frame has left.
  const PeerId peer = s.peer;
  Out([this, peer, gone] {
    if (!transport_->Send(peer, gone, {}, nullptr, 0,
                          [this, peer](const Status&) { transport_->Close(peer); })
             .ok()) {
      transport_->Close(peer);
    }
  });
  const auto live = std::count(missing.begin(), missing.end(), false);
  if (taking_over) {
    spdlog::warn("scheduler: server {}, which was taking over a lost rank, {}; the job goes on "
                 "without it, with {} of {} server(s)",
                 id, what, live, servers_.size());
  } else {
    spdlog::warn("scheduler: server {} {}; every slice it held has another copy, the job goes "
                 "on with {} of {} server(s)",
                 id, what, live, servers_.size());
  }
  for (const auto& [w, entry] : workers_) Send(entry.peer, gone);
  for (const auto& [o, client] : observers_) Send(client, gone);
  for (const ServerEntry& other : LiveServers()) Send(other.peer, gone);
  // A checkpoint in flight goes on without its file: the other servers write copies of
  // every slice it held (they apply the same rounds).
  if (checkpoints_.Lost(rank)) StopIfCheckpointSettled();
  if (taking_over) takeover_.reset();
  if (const ServerEntry* filling = Filling(); filling && !taking_over) {
    // The copies the new server waits for may have been the lost one's to send: it
    // starts again once a new server comes.
    LoseServer(filling->id, fmt::format("had not got every copy when server {} was lost", id));
    return;
  }
  Progress();
}

const SchedulerNode::ServerEntry* SchedulerNode::Filling() const {
  for (const ServerEntry& s : servers_) {
    if (s.taking_over) return &s;
  }
  return nullptr;
}

void SchedulerNode::TakeOver(PeerId peer, const FrameHeader& h, const Hello& hello) {
  const auto refuse = [&](StatusCode code, const std::string& why) {
    Refuse(peer, h, Error(code, "all {} servers of this job have registered already{}",
                          cfg_.num_servers, why),
           true);
  };
  auto lost = std::find_if(servers_.begin(), servers_.end(),
                           [](const ServerEntry& s) { return s.lost; });
  if (cfg_.replicas <= 1 || lost == servers_.end()) {
    return refuse(StatusCode::kAlreadyExists,
                  cfg_.replicas <= 1 ? "" : ", and none of them is lost");
  }
  if (!cfg_.journal.empty()) {
    return refuse(StatusCode::kUnimplemented,
                  "; a new server cannot take a lost one's place in a job whose scheduler "
                  "journals (--journal) yet");
  }
  if (Filling()) {
    return refuse(StatusCode::kUnavailable,
                  "; another new server is taking a lost rank over now: start this one again "
                  "once it holds its copies");
  }
  if (stopping_ || !salvage_.ok() || !started_) {
    return refuse(StatusCode::kFailedPrecondition,
                  started_ ? "; the job is stopping" : "; the job has not started");
  }
  ServerEntry& s = *lost;
  s.peer = peer;
  s.host = hello.host;
  s.port = hello.port;
  s.applied = rounds_announced_;
  s.last_seen = SteadyClock::now();
  s.ready = false;
  s.lost = false;
  s.taking_over = true;
  doomed_.erase(peer);
  peers_[peer] = {PeerKind::kServer, s.id};
  takeover_started_ = SteadyClock::now();
  Welcome w = JobWelcome(s.id);
  w.job_key = job_key_;
  w.checkpoints = checkpoints_.enabled();
  w.takeover_from = rounds_announced_;
  FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
  ack.request = h.request;
  Send(peer, ack, AsBytes(EncodeWelcome(w)));
  // What it stages of a worker that is gone is void, as on every other server.
  for (const auto& [worker, next] : gone_workers_) {
    FrameHeader gone = MakeHeader(MsgType::kWorkerGone, kSchedulerId);
    gone.set_gone_worker(worker);
    gone.set_next_clock(next);
    Send(peer, gone);
  }
  spdlog::info("scheduler: server {} registered at {}:{} to take the place of the lost one "
               "(rank {}); it gets the rounds from round {} on",
               s.id, hello.host, hello.port, ServerRank(s.id), rounds_announced_);
  audit_.Member("registered", "server", s.id, fmt::format("{}:{}", hello.host, hello.port),
                "takes the place of the lost server of its rank");
}

void SchedulerNode::AnnounceTakeover(ServerEntry& s) {
  std::vector<WorkerId> live;
  for (const auto& [w, entry] : workers_) live.push_back(w);
  const auto index = static_cast<uint32_t>(server_events_.takeovers().size());
  server_events_.TakenOver(s.id, live);
  takeover_.emplace(s.id, index, rounds_announced_, live);
  // A worker gone already may have commits no round has placed yet: they missed the new
  // server too.
  for (const auto& [w, void_from] : gone_workers_) {
    auto placed = placed_next_clock_.find(w);
    if (placed != placed_next_clock_.end() && placed->second < void_from) {
      takeover_->Gone(w, void_from);
    }
  }
  FrameHeader back = MakeHeader(MsgType::kServerBack, kSchedulerId);
  back.set_gone_server(s.id);
  back.set_backs(index + 1);
  for (const auto& [w, entry] : workers_) {
    Send(entry.peer, back,
         AsBytes(EncodeServerAddress({s.id, s.host, s.port, ServerProof(job_key_, s.id, w)})));
  }
  // Observers connect too (they read from it once it holds its copies), and answer nothing.
  for (const auto& [o, peer] : observers_) {
    Send(peer, back,
         AsBytes(EncodeServerAddress({s.id, s.host, s.port, ServerProof(job_key_, s.id, o)})));
  }
  spdlog::info("scheduler: server {} is ready; {} worker(s) connect to it", s.id, live.size());
  AdmitWaiting();
  Progress();  // with no worker, the copies can be taken at once
}

void SchedulerNode::HandleTakeoverAck(PeerId peer, WorkerId w, const WorkerEntry& entry,
                                      const FrameHeader& h, std::span<const std::byte> meta) {
  const std::vector<NodeId>& takeovers = server_events_.takeovers();
  if (h.backs() == 0 || h.backs() > takeovers.size()) {
    Expel(peer, w, h, Error(StatusCode::kInvalidArgument, "worker {} answered takeover {} of {}",
                            w, h.backs(), takeovers.size()));
    return;
  }
  const uint32_t index = h.backs() - 1;
  const bool current = takeover_ && takeover_->index() == index;
  if (h.status != 0) {
    if (current) {
      LoseServer(takeover_->server(), fmt::format("cannot be reached by worker {}: {}", w,
                                                  ErrorFromFrame(h, meta).message()));
    }
    return;
  }
  if (h.next_clock() < entry.next_commit) {
    // Clocks it committed without this server's receipts would reach rounds the new server
    // must apply.
    Expel(peer, w, h,
          Error(StatusCode::kInvalidArgument,
                "worker {} says it pushes to server {} from clock {}, but it committed "
                "clock {} already",
                w, takeovers[index], h.next_clock(), entry.next_commit - 1));
    return;
  }
  // Kept also for a takeover that ended (its server lost again): the worker's commits until
  // it hears of that carry the receipts of the clocks it pushed there.
  server_events_.Pushes(index, w, h.next_clock());
  if (current) {
    takeover_->Pushes(w, h.next_clock());
    MaybeCopyOut();
  }
}

void SchedulerNode::MaybeCopyOut() {
  if (!takeover_ || takeover_->copy_at || finished_ || stop_) return;
  const bool ready = takeover_->Ready([&](WorkerId w) {
    auto it = placed_next_clock_.find(w);
    return it == placed_next_clock_.end() ? Clock{0} : it->second;
  });
  if (!ready) return;
  const Version at = rounds_announced_;
  takeover_->copy_at = at;
  std::vector<bool> live;
  for (const ServerEntry& o : servers_) live.push_back(!o.lost && !o.taking_over);
  const std::string live_text = EncodeLiveRanks(live);
  FrameHeader out = MakeHeader(MsgType::kCopyOut, kSchedulerId);
  out.set_round(at);
  out.set_gone_server(takeover_->server());
  out.set_backs(takeover_->index() + 1);
  uint32_t senders = 0;
  for (const ServerEntry& o : LiveServers()) {
    if (o.taking_over) continue;
    Send(o.peer, out, AsBytes(live_text));
    ++senders;
  }
  takeover_->copies_expected = senders;
  FrameHeader to_new = out;
  to_new.set_senders(senders);
  Send(servers_[ServerRank(takeover_->server())].peer, to_new);
  spdlog::info("scheduler: the {} other server(s) copy rank {}'s slices to server {} at "
               "version {}",
               senders, ServerRank(takeover_->server()), takeover_->server(), at);
}

bool SchedulerNode::CopyExpected(NodeId from, const FrameHeader& h) const {
  return takeover_ && takeover_->copy_at == h.round() && h.backs() == takeover_->index() + 1 &&
         from != takeover_->server() && !servers_[ServerRank(from)].lost;
}

void SchedulerNode::RelayCopy(NodeId from, const FrameHeader& h, std::span<const std::byte> meta,
                              std::byte* payload) {
  if (!CopyExpected(from, h)) {
    delete[] payload;
    spdlog::info("scheduler: dropped copies of version {} from server {}: no server waits "
                 "for them now",
                 h.round(), from);
    return;
  }
  if (payload == nullptr && h.payload_len > 0 && h.status == 0) {
    LoseServer(takeover_->server(),
               fmt::format("cannot get its copies: no memory here for the {} bytes from "
                           "server {}",
                           h.payload_len, from));
    return;
  }
  if (h.status != 0) {
    delete[] payload;
    LoseServer(takeover_->server(), fmt::format("cannot get its copies from server {}: {}", from,
                                                ErrorFromFrame(h, meta).message()));
    return;
  }
  if (h.flags & kFlagLast) ++takeover_->copies_relayed;
  const PeerId to = servers_[ServerRank(takeover_->server())].peer;
  Status st = transport_->Send(to, h, {}, payload, h.payload_len,
                               [payload](const Status&) { delete[] payload; });
  if (!st.ok()) delete[] payload;  // its connection ends: the loss follows
}

void SchedulerNode::CopiesIn(NodeId id, Version at) {
  ServerEntry& s = servers_[ServerRank(id)];
  if (!takeover_ || takeover_->server() != id || takeover_->copy_at != at ||
      takeover_->copies_relayed != takeover_->copies_expected) {
    const std::string what =
        fmt::format("said it holds copies of version {}, which it was not sent", at);
    if (s.taking_over) {
      LoseServer(id, what);  // it holds nothing the job needs yet
    } else {
      spdlog::warn("scheduler: server {} {}; ignored", id, what);
    }
    return;
  }
  s.taking_over = false;
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      SteadyClock::now() - takeover_started_);
  spdlog::info("scheduler: server {} holds the copies of rank {} again (version {}, {} ms "
               "after it registered); every slice has its {} copies where live servers allow",
               id, ServerRank(id), at, took.count(), cfg_.replicas);
  audit_.Member("restored", "server", id, fmt::format("{}:{}", s.host, s.port),
                fmt::format("holds its rank's copies from version {}", at));
  ++counters_.servers_restored;
  takeover_.reset();
  FrameHeader serves = MakeHeader(MsgType::kServerServes, kSchedulerId);
  serves.set_gone_server(id);
  for (const auto& [w, entry] : workers_) Send(entry.peer, serves);
  for (const auto& [o, peer] : observers_) Send(peer, serves);
  Progress();
}

void SchedulerNode::RecordLoss(ServerEntry& s) {
  s.lost = true;
  s.taking_over = false;
  server_events_.Lost(s.id);
  ++counters_.servers_lost;
}

void SchedulerNode::DropServer(ServerEntry& s, const std::string& what) {
  s.lost = true;
  peers_.erase(s.peer);
  doomed_.insert(s.peer);
  audit_.Member("lost", "server", s.id, fmt::format("{}:{}", s.host, s.port), what);
}

void SchedulerNode::SalvageWithout(ServerEntry& s, const std::string& what) {
  DropServer(s, what);
  CloseLater(s.peer);
  if (std::none_of(servers_.begin(), servers_.end(),
                   [](const ServerEntry& o) { return !o.lost && o.ready; })) {
    EndStopping(Error(salvage_.code(), "{}; no checkpoint of the surviving slices: server {} {}, "
                                       "and no server is left",
                      salvage_.message(), s.id, what));
    return;
  }
  (void)checkpoints_.Lost(ServerRank(s.id));  // one in flight goes on without this rank
  StopIfCheckpointSettled();
}

}  // namespace dsync::ps
