// The scheduler node: nodes asking to join (hellos, welcomes, the job forming) and nodes
// coming back to a restarted scheduler. The class: ps/scheduler_internal.h.
#include "ps/scheduler_internal.h"

namespace dsync::ps {

void SchedulerNode::Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop) {
  spdlog::warn("scheduler: refusing {} from {}: {}", MsgTypeName(about.msg_type()),
               transport_->PeerAddress(peer), error.message());
  if (drop) doomed_.insert(peer);  // ignore it until it is gone
  Out([this, peer, error, about, drop] {
    (void)SendError(*transport_, peer, kSchedulerId, error, about, /*close_after=*/drop);
  });
}

void SchedulerNode::HandleHello(PeerId peer, const FrameHeader& h,
                                std::span<const std::byte> meta) {
  if (h.msg_type() != MsgType::kHello) {
    Refuse(peer, h, Error(StatusCode::kPermissionDenied, "the first frame must be a hello"),
           true);
    return;
  }
  auto hello = AcceptHello(meta, cfg_.token);
  if (!hello.ok()) {
    Refuse(peer, h, hello.status(), true);
    return;
  }
  if (hello->role != Role::kServer && hello->role != Role::kWorker) {
    Refuse(peer, h, Error(StatusCode::kInvalidArgument, "only servers and workers join"), true);
    return;
  }
  // The token is what lets a node ask; from here on it is no stranger to the transport.
  transport_->Trust(peer);
  if (hello->rejoin) {
    HandleRejoin(peer, h, *hello);
    return;
  }
  if (hello->role == Role::kServer) {
    if (servers_.size() >= cfg_.num_servers) {
      TakeOver(peer, h, *hello);
      return;
    }
    const NodeId id = kFirstServerId + static_cast<NodeId>(servers_.size());
    servers_.push_back({id, peer, hello->host, hello->port, rule_.open_round(),
                        SteadyClock::now(), false});
    if (journal_.open()) {
      journal_.Add({{"k", "server"}, {"id", id}, {"host", hello->host}, {"port", hello->port}});
    }
    peers_[peer] = {PeerKind::kServer, id};
    Welcome w = JobWelcome(id);
    w.job_key = job_key_;
    w.checkpoints = checkpoints_.enabled();
    if (resumed_) {
      const CheckpointManifest& m = resumed_->manifest;
      const auto path = [&](const CheckpointFile& f) {
        return (std::filesystem::path(resumed_->path) / f.name).string();
      };
      Welcome::Restore r;
      r.version = m.version;
      auto own = std::find_if(m.files.begin(), m.files.end(),
                              [&](const CheckpointFile& f) { return f.rank == ServerRank(id); });
      if (own != m.files.end()) {
        r.file = path(*own);
        r.crc32 = own->crc32;
      } else {  // a rank lost before the checkpoint: its slices from their copies
        for (const CheckpointFile& f : m.files) r.copies.push_back({path(f), f.crc32});
      }
      w.restore = std::move(r);
    }
    FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
    ack.request = h.request;
    Send(peer, ack, AsBytes(EncodeWelcome(w)));
    last_arrival_ = SteadyClock::now();
    spdlog::info("scheduler: server {} registered at {}:{} ({}/{})", id, hello->host,
                 hello->port, servers_.size(), cfg_.num_servers);
    audit_.Member("registered", "server", id, fmt::format("{}:{}", hello->host, hello->port));
    return;
  }
  if (hello->observer) {
    const NodeId id = next_observer_id_++;
    peers_[peer] = {PeerKind::kObserver, id};
    waiting_observers_.push_back({id, peer, h.request});
    AdmitWaiting();
    TellWaiting();
    return;
  }
  const WorkerId id = next_worker_id_++;
  last_arrival_ = SteadyClock::now();
  peers_[peer] = {PeerKind::kWorker, id};
  waiting_.emplace_back(id, peer);
  waiting_requests_[id] = h.request;
  AdmitWaiting();
  TellWaiting();
}

Welcome SchedulerNode::JobWelcome(NodeId id) const {
  Welcome w;
  w.id = id;
  w.sync = cfg_.sync;
  w.optimizer = cfg_.optimizer;
  w.staleness = cfg_.staleness;
  w.slice_bytes = cfg_.slice_bytes;
  w.heartbeat_interval_ms = cfg_.heartbeat_interval_ms;
  w.num_servers = cfg_.num_servers;
  w.replicas = cfg_.replicas;
  w.learning_rate = learning_rate_;
  w.damp_from = damp_from_;
  w.reconnect_grace_ms = cfg_.journal.empty() ? 0 : cfg_.reconnect_grace_ms;
  return w;
}

Welcome SchedulerNode::ClientWelcome(NodeId id, bool observer) const {
  Welcome w = JobWelcome(id);
  w.observer = observer;
  if (observer) w.reconnect_grace_ms = 0;  // observers do not rejoin: they join again
  w.credential = ClientCredential(job_key_, id, observer);
  w.servers_lost = server_events_.losses();
  w.servers_back = server_events_.takeovers();
  if (const ServerEntry* filling = Filling()) w.servers_filling.push_back(filling->id);
  for (const ServerEntry& s : servers_) {
    w.servers.push_back({s.id, s.host, s.port, ServerProof(job_key_, s.id, id)});
  }
  return w;
}

void SchedulerNode::TellWaiting() {
  if (waiting_.empty() && waiting_observers_.empty()) return;
  const std::string why = WaitingFor();
  FrameHeader h = MakeHeader(MsgType::kPending, kSchedulerId);
  for (const auto& [id, peer] : waiting_) Send(peer, h, AsBytes(why));
  for (const WaitingObserver& o : waiting_observers_) Send(o.peer, h, AsBytes(why));
}

std::string SchedulerNode::WaitingFor() const {
  if (servers_.size() < cfg_.num_servers) {
    return fmt::format("waiting for {} more server(s) to register ({} of {})",
                       cfg_.num_servers - servers_.size(), servers_.size(), cfg_.num_servers);
  }
  if (rejoin_deadline_) return "waiting for the job's nodes to come back to its restarted scheduler";
  if (!ServersReady()) return "waiting for the servers to take their slices";
  return fmt::format("waiting for {} more of the job's {} initial worker(s)",
                     cfg_.num_workers - std::min<size_t>(cfg_.num_workers, waiting_.size()),
                     cfg_.num_workers);
}

bool SchedulerNode::ServersReady() const {
  return servers_.size() == cfg_.num_servers && !rejoin_deadline_ &&
         std::all_of(servers_.begin(), servers_.end(),
                     // A rank lost, or being taken over, does not hold joiners back.
                     [](const ServerEntry& s) { return s.ready || s.lost || s.taking_over; });
}

void SchedulerNode::AdmitWaiting() {
  if (!ServersReady() || stopping_ || stop_) return;  // nobody joins a job that is stopping
  // Observers need only the servers: they never count in a round.
  for (const WaitingObserver& o : waiting_observers_) {
    Welcome w = ClientWelcome(o.id, /*observer=*/true);
    FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
    ack.request = o.request;
    Send(o.peer, ack, AsBytes(EncodeWelcome(w)));
    observers_[o.id] = o.peer;
    spdlog::info("scheduler: observer {} connected from {}", o.id,
                 transport_->PeerAddress(o.peer));
  }
  waiting_observers_.clear();
  if (waiting_.empty()) return;
  bool initial = false;
  if (!started_) {
    if (waiting_.size() < cfg_.num_workers) return;
    started_ = true;
    initial = true;
  }
  for (const auto& [id, peer] : waiting_) {
    auto admission = rule_.Join(id, initial);
    FrameHeader about = MakeHeader(MsgType::kHello, id);
    about.request = waiting_requests_[id];
    if (!admission.ok()) {
      Refuse(peer, about, admission.status(), true);
      continue;
    }
    Welcome w = ClientWelcome(id, /*observer=*/false);
    w.join_round = admission->join_round;
    w.start_clock = admission->start_clock;
    w.gate = admission->gate;
    FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
    ack.request = about.request;
    WorkerEntry& entry = workers_[id];
    entry.peer = peer;
    entry.last_seen = SteadyClock::now();
    entry.address = transport_->PeerAddress(peer);
    if (journal_.open()) {
      journal_.Add({{"k", "join"}, {"w", id}, {"initial", initial},
                    {"address", workers_[id].address}});
    }
    Send(peer, ack, AsBytes(EncodeWelcome(w)));
    placed_next_clock_[id] = admission->start_clock;
    entry.next_commit = admission->start_clock;
    if (policy_) {
      policy_->Join(id);
      payoff_->MembershipChanged();
    }
    ++counters_.workers_joined;
    spdlog::info("scheduler: worker {} joined from {} (counts from round {}, live {})", id,
                 transport_->PeerAddress(peer), admission->join_round, rule_.live_workers());
    audit_.Member("joined", "worker", id, workers_[id].address, {}, admission->join_round);
    waiting_requests_.erase(id);
  }
  waiting_.clear();
  Redecide();
  Progress();
}

void SchedulerNode::Expel(PeerId peer, WorkerId id, const FrameHeader& h, const Status& why) {
  Refuse(peer, h, why, /*drop=*/true);
  if (rule_.is_live(id)) {
    RemoveWorker(id, /*failed=*/true,
                 fmt::format("its {} was refused: {}", MsgTypeName(h.msg_type()),
                             why.message()),
                 /*close=*/false);
  }
}

void SchedulerNode::HandleRejoin(PeerId peer, const FrameHeader& h, const Hello& hello) {
  const auto refuse = [&](const std::string& why) {
    Refuse(peer, h, Error(StatusCode::kFailedPrecondition, "node {} cannot rejoin: {}", hello.node, why), true);
  };
  if (!hello.credential) return refuse("its hello carries no proof of who it is");
  FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
  ack.request = h.request;
  if (hello.role == Role::kServer) {
    ServerEntry* s = FindServer(hello.node);
    if (s == nullptr || !TagsEqual(*hello.credential, ServerProof(job_key_, hello.node, kSchedulerId))) {
      return refuse("it is no server of this job");
    }
    if (s->lost) return refuse("the job went on without it (it was declared lost)");
    if (!s->away) return refuse("that server is connected already");
    const Round from = hello.rounds_received;
    if (from > rounds_announced_ ||
        (from < rounds_announced_ &&
         (recent_rounds_.empty() || recent_rounds_.front().first > from))) {
      // Rounds a server received are journaled; an older one no longer kept cannot be sent.
      return refuse(fmt::format("it has {} round(s) and this scheduler can send it rounds {} "
                                "to {} only", from,
                                recent_rounds_.empty() ? rounds_announced_ : recent_rounds_.front().first,
                                rounds_announced_));
    }
    s->away = false;
    s->ready = true;  // it has its slices (its kReady may not have been journaled)
    s->peer = peer;
    s->last_seen = SteadyClock::now();
    s->applied = hello.rounds_applied;
    peers_[peer] = {PeerKind::kServer, s->id};
    Welcome w = JobWelcome(s->id);
    w.scheduler_proof = SchedulerProof(job_key_, s->id, hello.nonce);
    Send(peer, ack, AsBytes(EncodeWelcome(w)));
    // What it missed, in order: the learning rate, the rounds, the workers gone (it drops
    // what they staged for clocks they never committed; a second time changes nothing).
    // Each change goes before the round it starts from: one from a round the server has
    // was sent with it; the later ones it may have missed.
    for (const auto& [lr_from, rate] : lr_changes_) {
      if (lr_from < from) continue;
      FrameHeader lr = MakeHeader(MsgType::kLearningRate, kSchedulerId);
      lr.set_round(lr_from);
      std::vector<std::byte> meta;
      EncodeLearningRate(rate, meta);
      Send(peer, lr, meta);
    }
    if (damp_from_ && *damp_from_ >= from) Send(peer, DampFrame());
    uint64_t resent = 0;
    for (const auto& [round, meta] : recent_rounds_) {
      if (round < from) continue;
      FrameHeader rh = MakeHeader(MsgType::kRound, kSchedulerId);
      rh.set_round(round);
      Send(peer, rh, meta);
      ++resent;
    }
    for (const auto& [gone_id, next] : gone_workers_) {
      FrameHeader gone = MakeHeader(MsgType::kWorkerGone, kSchedulerId);
      gone.set_gone_worker(gone_id);
      gone.set_next_clock(next);
      Send(peer, gone);
    }
    spdlog::info("scheduler: server {} is back from {} ({} round(s) sent again)", s->id,
                 transport_->PeerAddress(peer), resent);
    RejoinDone();
    return;
  }
  auto wit = workers_.find(hello.node);
  if (hello.observer || wit == workers_.end() ||
      !TagsEqual(*hello.credential, ClientCredential(job_key_, hello.node, false))) {
    return refuse("it is no live worker of this job (observers join again as new ones)");
  }
  WorkerEntry& w = wit->second;
  if (!w.away) return refuse("that worker is connected already");
  w.away = false;
  w.peer = peer;
  w.last_seen = SteadyClock::now();
  w.address = transport_->PeerAddress(peer);
  peers_[peer] = {PeerKind::kWorker, hello.node};
  Welcome welcome = ClientWelcome(hello.node, false);
  // A worker holds no job key: its credential is the secret the two share.
  welcome.scheduler_proof =
      SchedulerProof(ClientCredential(job_key_, hello.node, false), hello.node, hello.nonce);
  Send(peer, ack, AsBytes(EncodeWelcome(welcome)));
  if (auto g = last_gate_.find(hello.node); g != last_gate_.end()) {
    FrameHeader gh = MakeHeader(MsgType::kGate, kSchedulerId);
    gh.set_clock(g->second.clock);
    gh.set_min_version(g->second.min_version);
    Send(peer, gh);
  }
  spdlog::info("scheduler: worker {} is back from {} ({} gradient(s) committed)", hello.node,
               w.address, w.committed);
  RejoinDone();
}

bool SchedulerNode::Away() const {
  return std::any_of(servers_.begin(), servers_.end(), [](const ServerEntry& s) { return s.away && !s.lost; }) ||
         std::any_of(workers_.begin(), workers_.end(), [](const auto& w) { return w.second.away; });
}

void SchedulerNode::RejoinDone() {
  if (!rejoin_deadline_) return;
  if (Away()) return;
  rejoin_deadline_.reset();
  spdlog::info("scheduler: every node of the job is back; it goes on from round {}", rounds_announced_);
  AdmitWaiting();
  Progress();
}

void SchedulerNode::RejoinGraceOver() {
  const std::string what = fmt::format("did not come back within the reconnect grace of {} s "
                                       "(--reconnect-grace) after the scheduler was restarted",
                                       cfg_.reconnect_grace_ms / 1000);
  rejoin_deadline_.reset();
  std::vector<WorkerId> workers;
  for (const auto& [id, w] : workers_) {
    if (w.away) workers.push_back(id);
  }
  for (WorkerId id : workers) RemoveWorker(id, /*failed=*/true, what);
  for (ServerEntry& s : servers_) {
    if (!s.away || s.lost) continue;
    s.away = false;
    if (!finished_ && !stop_) LoseServer(s.id, what);
  }
  AdmitWaiting();
  Progress();
}

}  // namespace dsync::ps
