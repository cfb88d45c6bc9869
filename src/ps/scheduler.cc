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

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "ps/audit_log.h"
#include "ps/checkpoint.h"
#include "ps/checkpoint_coordinator.h"
#include "ps/auto_policy.h"
#include "ps/delay_payoff.h"
#include "ps/net_address.h"
#include "ps/rendezvous.h"
#include "ps/commit_proof.h"
#include "ps/handshake.h"
#include "ps/keys.h"
#include "ps/round_rule.h"
#include "ps/scheduler_journal.h"
#include "ps/settings.h"
#include "ps/scheduler_node.h"
#include "ps/slicing.h"
#include "ps/takeover.h"

namespace dsync {
namespace ps {
namespace {

using SteadyClock = std::chrono::steady_clock;

class SchedulerNode final : public Scheduler, public TransportHandler {
 public:
  SchedulerNode(const Config& config, std::unique_ptr<Transport> transport)
      : cfg_(config), transport_(std::move(transport)), job_key_(RandomJobKey()),
        rule_(config.sync), checkpoints_(config, 0) {
    StartAuto();
  }

  // dsync:auto's policy and payoff check, anew (none in other modes).
  void StartAuto() {
    policy_.reset();
    payoff_.reset();
    if (!cfg_.sync.adaptive) return;
    AutoPolicyOptions o;
    o.max_bound = cfg_.sync.bound;
    policy_.emplace(o);
    payoff_.emplace(DelayPayoffOptions{}, cfg_.staleness);
  }

  ~SchedulerNode() override {
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

  Status Init() {
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

  uint16_t port() const override { return port_; }

  // --resume: the job continues from the newest complete, sound checkpoint. Rounds go on from
  // its version, the first workers' clocks too, the gradient budget counts what it holds, and
  // each server loads its file before it takes clients.
  Status Resume() {
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
    prior_gradients_ = m.gradients_committed;
    checkpoints_ = CheckpointCoordinator(cfg_, m.version);
    spdlog::info("scheduler: resuming from {} (version {}, clock {}, {} gradient(s) applied "
                 "before)",
                 found->path, m.version, m.clock, m.gradients_committed);
    resumed_ = std::move(found).value();
    return Status::Ok();
  }

  Status Run() override {
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

  // With checkpoints, the job's state is written first (bounded by kStopCheckpointSeconds):
  // a stopped or preempted job resumes from where it stopped.
  void Stop() override {
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

  SchedulerStats stats() const override {
    std::lock_guard lock(mu_);
    SchedulerStats s = counters_;
    s.rounds_closed = rule_.stats().rounds_closed;
    s.gradients_committed = rule_.stats().gradients_committed;
    s.max_staleness = rule_.stats().max_staleness;
    s.live_workers = rule_.live_workers();
    return s;
  }

  std::vector<RoundRecord> history() const override {
    std::lock_guard lock(mu_);
    return {history_.begin(), history_.end()};
  }

  // --- TransportHandler ---------------------------------------------------------------

  // The scheduler takes no payloads but the copies a server sends one taking a lost rank's
  // place, which it passes on (RelayCopy).
  void* OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte>) override {
    if (h.msg_type() != MsgType::kCopy || h.payload_len == 0) return nullptr;
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second.kind != PeerKind::kServer ||
        !CopyExpected(it->second.id, h)) {
      return nullptr;
    }
    return new (std::nothrow) std::byte[h.payload_len];
  }

  void OnPayloadLost(PeerId, const FrameHeader&, void* payload) override {
    delete[] static_cast<std::byte*>(payload);
  }

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override {
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

  void OnDisconnected(PeerId peer, const Status& why) override {
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

 private:
  enum class PeerKind { kServer, kWorker, kObserver };
  struct PeerInfo {
    PeerKind kind;
    NodeId id;
  };
  struct ServerEntry {
    NodeId id;
    PeerId peer;
    std::string host;
    uint16_t port;
    Round applied = 0;  // rounds applied (its version)
    SteadyClock::time_point last_seen;
    bool ready = false;  // it took its welcome and accepts clients
    bool lost = false;   // gone; its slices' other copies serve (Config::replicas)
    bool away = false;   // a restarted scheduler waits for it to come back (peer: none yet)
    // A new server taking this lost rank's place: live, sent every round, but its slices are
    // not whole until the copies are in (kCopied); checkpoints and the lag rule pass it by.
    bool taking_over = false;
  };
  // The answer to a worker's newest commit: sent again if the worker, which lost the
  // scheduler before it came, sends that commit again.
  struct CommitAnswer {
    Clock clock = 0;
    Round round = 0;
    Version gate = 0;
  };
  struct WorkerEntry {
    PeerId peer;
    SteadyClock::time_point last_seen;
    Clock begun_clock = ~Clock{0};  // the clock its last begin reported, and when
    SteadyClock::time_point begun_at;
    uint64_t committed = 0;  // gradients it committed (empty commits included)
    std::string address;     // it connected from (the audit log)
    bool away = false;       // a restarted scheduler waits for it to come back
    std::optional<CommitAnswer> last_ack;
    Clock next_commit = 0;   // the clock of its next commit
  };

  void Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop) {
    spdlog::warn("scheduler: refusing {} from {}: {}", MsgTypeName(about.msg_type()),
                 transport_->PeerAddress(peer), error.message());
    if (drop) doomed_.insert(peer);  // ignore it until it is gone
    Out([this, peer, error, about, drop] {
      (void)SendError(*transport_, peer, kSchedulerId, error, about, /*close_after=*/drop);
    });
  }

  void HandleHello(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
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

  Welcome JobWelcome(NodeId id) const {
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
    w.reconnect_grace_ms = cfg_.journal.empty() ? 0 : cfg_.reconnect_grace_ms;
    return w;
  }

  // A client's welcome: its credential, and what each server will prove itself with.
  Welcome ClientWelcome(NodeId id, bool observer) const {
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

  // Nodes whose hello was accepted but whose admission waits hear why, now and every
  // heartbeat interval: a scheduler that answers is not mistaken for a dead port.
  void TellWaiting() {
    if (waiting_.empty() && waiting_observers_.empty()) return;
    const std::string why = WaitingFor();
    FrameHeader h = MakeHeader(MsgType::kPending, kSchedulerId);
    for (const auto& [id, peer] : waiting_) Send(peer, h, AsBytes(why));
    for (const WaitingObserver& o : waiting_observers_) Send(o.peer, h, AsBytes(why));
  }

  // What the job's start waits for.
  std::string WaitingFor() const {
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

  // Workers are admitted once every server is up; the first num_workers together, so that
  // they all count from round 0 (a reproducible start); later ones join the running job.
  bool ServersReady() const {
    return servers_.size() == cfg_.num_servers && !rejoin_deadline_ &&
           std::all_of(servers_.begin(), servers_.end(),
                       // A rank lost, or being taken over, does not hold joiners back.
                       [](const ServerEntry& s) { return s.ready || s.lost || s.taking_over; });
  }

  void AdmitWaiting() {
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

  void HandleWorker(PeerId peer, WorkerId id, const FrameHeader& h,
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

  void HandleCommit(PeerId peer, WorkerId id, WorkerEntry& entry, const FrameHeader& h,
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
    pending_tensors_[id].push_back({h.clock(), TensorsOf(proof)});
    if (journal_.open()) {
      nlohmann::json runs = nlohmann::json::array();
      for (const TensorRange& t : pending_tensors_[id].back().second) runs.push_back({t.first, t.count});
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

  // The answer to a commit: its round, the lowest version of the next clock's pulls, and
  // whether the job's budget is spent (every commit from then on tells its worker to stop).
  FrameHeader CommitAck(uint64_t request, const CommitAnswer& answer) const {
    FrameHeader ack = MakeHeader(MsgType::kCommitAck, kSchedulerId);
    ack.request = request;
    ack.set_round(answer.round);
    ack.set_min_version(answer.gate);
    if (budget_spent_) ack.flags |= kFlagStop;
    return ack;
  }

  // The new rate applies from the first round no server has been told of yet, so that every
  // server switches at the same round: each hears of it before that round, on the same
  // ordered connection. A bad rate is refused; the worker may go on.
  void HandleSetLearningRate(PeerId peer, WorkerId id, const FrameHeader& h,
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

  // A worker whose request the scheduler refuses cannot go on with its clocks: it is told
  // why, dropped, and declared failed at once, so that the servers reclaim what it staged.
  void Expel(PeerId peer, WorkerId id, const FrameHeader& h, const Status& why) {
    Refuse(peer, h, why, /*drop=*/true);
    if (rule_.is_live(id)) {
      RemoveWorker(id, /*failed=*/true,
                   fmt::format("its {} was refused: {}", MsgTypeName(h.msg_type()),
                               why.message()),
                   /*close=*/false);
    }
  }

  void HandleServer(PeerId peer, NodeId id, const FrameHeader& h,
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

  // The servers still in the job: servers_ without the lost ones, for range-for. (Written out:
  // clang 14, which the sanitizer builds use, cannot compile libstdc++ 12's views::filter.)
  class LiveView {
   public:
    class Iterator {
     public:
      Iterator(const ServerEntry* at, const ServerEntry* end) : at_(at), end_(end) { Skip(); }
      const ServerEntry& operator*() const { return *at_; }
      Iterator& operator++() {
        ++at_;
        Skip();
        return *this;
      }
      bool operator!=(const Iterator& other) const { return at_ != other.at_; }

     private:
      void Skip() {
        while (at_ != end_ && at_->lost) ++at_;
      }
      const ServerEntry* at_;
      const ServerEntry* end_;
    };
    explicit LiveView(const std::vector<ServerEntry>& all) : all_(all) {}
    Iterator begin() const { return {all_.data(), all_.data() + all_.size()}; }
    Iterator end() const { return {all_.data() + all_.size(), all_.data() + all_.size()}; }
    size_t size() const {
      size_t n = 0;
      for (Iterator it = begin(); it != end(); ++it) ++n;
      return n;
    }

   private:
    const std::vector<ServerEntry>& all_;
  };
  LiveView LiveServers() const { return LiveView(servers_); }

  // A server died, was stopped past the heartbeat timeout, or its connection ended. With one
  // copy of each slice (or when every copy of some slice is gone now) the job cannot go on.
  // Otherwise it goes on: every node hears of the loss (kServerGone), workers give up what
  // the lost server owed them and pull from the next copy; a commit's receipts leave out the
  // servers lost before it (the worker says how many it knew of), and every gradient already
  // committed is staged on every live copy (its commit proved it), so nothing committed is
  // lost and nothing is applied on some copies only.
  void LoseServer(NodeId id, const std::string& what) {
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

  // --- a new server taking a lost rank's place (docs/design.md, "Recreating lost copies") --

  // The server taking a lost rank over now, if any (one at a time: TakeOver).
  const ServerEntry* Filling() const {
    for (const ServerEntry& s : servers_) {
      if (s.taking_over) return &s;
    }
    return nullptr;
  }

  // A server registering once every rank has: with copies, it takes the lowest lost rank's
  // place. It is sent every round from now on; its slices come as copies from the others.
  void TakeOver(PeerId peer, const FrameHeader& h, const Hello& hello) {
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

  // The new server accepts clients: workers are told to connect to it and say from which
  // clock on they push to it; servers that it is back.
  void AnnounceTakeover(ServerEntry& s) {
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

  void HandleTakeoverAck(PeerId peer, WorkerId w, const WorkerEntry& entry, const FrameHeader& h,
                         std::span<const std::byte> meta) {
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

  // Once no round from now on can name a gradient the new server did not get, the other
  // servers copy its rank's slices to it at the version of the rounds sent so far (each
  // after applying them: the request follows the last on its ordered connection).
  void MaybeCopyOut() {
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

  // Whether a server's copies are for the takeover under way (else it ended: dropped).
  bool CopyExpected(NodeId from, const FrameHeader& h) const {
    return takeover_ && takeover_->copy_at == h.round() && h.backs() == takeover_->index() + 1 &&
           from != takeover_->server() && !servers_[ServerRank(from)].lost;
  }

  // A server's copies for the new one (payload: null when it sends none, only an error, or
  // when there was no memory to take them): passed on as they are, on the new server's
  // ordered connection. Copies for a takeover that ended are dropped: their sender did
  // nothing wrong.
  void RelayCopy(NodeId from, const FrameHeader& h, std::span<const std::byte> meta,
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

  // The new server holds every copy at version `at`: its rank is whole again.
  void CopiesIn(NodeId id, Version at) {
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

  // Server `s` is the next lost one.
  void RecordLoss(ServerEntry& s) {
    s.lost = true;
    s.taking_over = false;
    server_events_.Lost(s.id);
    ++counters_.servers_lost;
  }

  // Server `s` is out of the job: marked lost, what it sent before is ignored, and the audit
  // says so. (Its connection is closed by the caller, at once or once a last frame has left.)
  void DropServer(ServerEntry& s, const std::string& what) {
    s.lost = true;
    peers_.erase(s.peer);
    doomed_.insert(s.peer);
    audit_.Member("lost", "server", s.id, fmt::format("{}:{}", s.host, s.port), what);
  }

  // While a lost server's end of the job keeps what the others hold (salvage_): server `s` is
  // gone too; the checkpoint goes on without it, and the job ends once it settles, or at once
  // when no server is left to write it.
  void SalvageWithout(ServerEntry& s, const std::string& what) {
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

  void RemoveWorker(WorkerId id, bool failed, const std::string& why, bool close = true) {
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

  // A server's agreement report of a round it applied (dsync:auto's measured worth of stale
  // gradients). A report that does not fit the round is refused with a warning: it only
  // informs the policy, so the job goes on without it.
  void AgreementIn(NodeId id, Round round, std::span<const std::byte> meta) {
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

  // dsync:auto: the policy proposes from the workers' times, the payoff check decides
  // whether delaying is tried, kept or given up; a change goes to the rule.
  void Redecide() {
    if (!policy_) return;
    MaybeFinish();
    const bool proposal_changed = policy_->Decide();
    const auto phase = payoff_->phase();
    AutoDecision d = payoff_->Gate(policy_->decision());
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
    applied_ = std::move(d);
    for (const auto& [id, allowance] : applied_.allowance) {
      if (rule_.is_live(id)) (void)rule_.SetAllowance(id, allowance);
    }
    (void)rule_.SetQuorum(applied_.quorum);
    if (journal_.open()) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& [id, allowance] : applied_.allowance) a.push_back({id, allowance});
      journal_.Add({{"k", "auto"}, {"q", applied_.quorum}, {"a", std::move(a)}});
    }
    ++counters_.policy_changes;
    audit_.Policy(rule_.open_round(), applied_.quorum, applied_.allowance);
  }

  // The staleness policy's +momentum where it cannot change anything the job's own settings
  // show: said once at start (tensors registered with optimizers of their own may still be
  // momentum SGD, so it is not refused).
  void WarnIfTemperingIsIdle() const {
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

  // The gradients the job's budget counts: those of the checkpoint it started from, and those
  // committed since.
  uint64_t JobCommitted() const { return prior_gradients_ + rule_.stats().gradients_committed; }

  // A round mode that delays (dsync:K,Q or dsync:auto) with a budget: its last
  // Config::FinishBspPercent() runs as bsp. True when it begins now.
  bool MaybeFinish() {
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
      std::map<WorkerId, uint32_t> none;
      for (const auto& [id, w] : workers_) {
        if (rule_.is_live(id)) none[id] = 0;
      }
      audit_.Policy(rule_.open_round(), SyncMode::kAll, none);
    }
    spdlog::info("scheduler: {} from round {}: {} of the job's {} gradients committed; the "
                 "last {} % runs as bsp",
                 cfg_.sync.ToString(), rule_.open_round(), committed, budget, percent);
    return true;
  }

  // Whether the job's mode may close a round without a worker or with a stale gradient.
  bool Delays() const {
    return cfg_.sync.kind == SyncKind::kRound && (cfg_.sync.adaptive || cfg_.sync.bound > 0);
  }

  // Every round from the open one on as bsp's, and dsync:auto's decisions bsp for good.
  Status FinishAsBsp() {
    DSYNC_RETURN_IF_ERROR(rule_.FinishAsBsp());
    if (payoff_) payoff_->Finish(cfg_.FinishBspPercent(), cfg_.max_gradients);
    return Status::Ok();
  }

  // The tensors member m's commit covered (recorded at the commit, oldest first).
  TensorSet TakeTensors(const RoundMember& m) {
    auto it = pending_tensors_.find(m.worker);
    if (it == pending_tensors_.end() || it->second.empty() ||
        it->second.front().first != m.clock) {
      // The rule places commits in the order they came: this cannot happen. Say it loudly;
      // the servers then apply nothing of it, and stop the job if they hold it.
      spdlog::error("scheduler: no record of the tensors of worker {}'s clock {}", m.worker,
                    m.clock);
      return {};
    }
    TensorSet set = std::move(it->second.front().second);
    it->second.pop_front();
    if (it->second.empty() && !rule_.is_live(m.worker)) pending_tensors_.erase(it);
    return set;
  }

  // Broadcasts every round that may close now and every ssp gate that opened.
  // With copies, whether a live server trails the rounds announced by kReplicaLagRounds or
  // more: no round closes until it catches up (it bounds what a backup holds staged).
  bool ReplicaLagging() const {
    if (cfg_.replicas <= 1) return false;
    for (const ServerEntry& s : LiveServers()) {
      // A server taking a rank over holds back the rounds from its copies' version on only
      // once that version is decided (deciding it needs rounds to close).
      if (s.taking_over && !(takeover_ && takeover_->copy_at)) continue;
      if (s.ready && s.applied + kReplicaLagRounds <= rounds_announced_) return true;
    }
    return false;
  }

  void Progress() {
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

  // The job ends when every worker that joined is gone and every decided round is applied.
  void CheckFinished() {
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

  // Stopping (Stop with checkpoints): once no checkpoint is in flight, one of where the job is
  // now is begun if there is none yet (a periodic one in flight may be older, or have failed)
  // and time is left; then the servers are told the job is over and the scheduler stops.
  void StopIfCheckpointSettled() {
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

  // The servers are told the job is over (`why`: how it ended), after the journal says so: a
  // scheduler started on the journal again refuses to continue a job whose servers are gone.
  void ShutDownServers(const Status& why) {
    JournalEnd(why);
    FrameHeader h = MakeHeader(MsgType::kShutdown, kSchedulerId);
    for (const ServerEntry& s : LiveServers()) SendTracked(s.peer, h);
  }
  void JournalEnd(const Status& why) {
    if (!journal_.open() || end_journaled_) return;
    end_journaled_ = true;
    journal_.Add({{"k", "end"}, {"why", why.ok() ? std::string("finished") : why.message()}});
  }

  // The servers are told the job is over; the scheduler stops, with `why` as its result.
  void EndStopping(Status why) {
    if (!why.ok()) {
      spdlog::error("scheduler: {}", why.message());
      TellFailure(why);
    }
    stop_result_ = std::move(why);
    ShutDownServers(stop_result_);
    stop_ = true;
    cv_.notify_all();
  }

  // Every server writes its slices at version rounds_announced_: the frame follows the last
  // round before it on each server's ordered connection, so each writes after applying it.
  void BeginCheckpoint() {
    CheckpointManifest m;
    m.version = rounds_announced_;
    m.num_servers = cfg_.num_servers;
    m.replicas = cfg_.replicas;
    m.slice_bytes = cfg_.slice_bytes;
    m.sync = cfg_.sync.ToString();  // the job's, not the quorum dsync:auto or a finish set
    m.gradients_committed = prior_gradients_ + gradients_in_rounds_;
    m.clock = ResumeClock();
    m.learning_rate = learning_rate_;
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

  // Where a job resumed from a checkpoint now starts its workers' clocks: the lowest clock a
  // live worker's gradients have reached in the rounds sent (the version, in bsp), so none
  // skips data; with no live worker, the highest.
  Clock ResumeClock() const {
    std::optional<Clock> low, high;
    for (const auto& [w, next] : placed_next_clock_) {
      high = std::max(high.value_or(next), next);
      if (rule_.is_live(w)) low = std::min(low.value_or(next), next);
    }
    return low.value_or(high.value_or(rounds_announced_));
  }

  // --- the journal (Config::journal, ps/scheduler_journal.h) ----------------------------

  // Runs `send` now, or, with a journal, on the flusher thread once every record added before
  // it is written and fdatasync'd: no node hears of a decision that a restarted scheduler
  // would not know. Sends keep their order either way.
  template <typename F>
  void Out(F&& send) {
    if (!journal_.open()) {
      send();
      return;
    }
    outbox_.emplace_back(std::forward<F>(send));
    flush_cv_.notify_one();
  }
  void Send(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta = {}) {
    if (!journal_.open()) {
      (void)transport_->Send(peer, h, meta, nullptr, 0);
      return;
    }
    Out([this, peer, h, copy = std::vector<std::byte>(meta.begin(), meta.end())] {
      (void)transport_->Send(peer, h, copy, nullptr, 0);
    });
  }
  void CloseLater(PeerId peer) {
    Out([this, peer] { transport_->Close(peer); });
  }
  void AuditRound(const RoundRecord& rec) {
    if (!journal_.open()) {
      audit_.Round(rec);
      return;
    }
    Out([this, rec] { audit_.Round(rec); });  // never a round the journal may not hold
  }

  // The flusher: writes what was journaled, makes it durable, then sends what waited for it.
  // One fdatasync covers every record added meanwhile (group commit).
  void FlushJournal() {
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

  // The job's settings (those the scheduler hands to every node) and where it started from.
  nlohmann::json JobRecord() const {
    nlohmann::json settings = nlohmann::json::object();
    for (const Setting& st : Settings()) {
      if (JournaledSetting(st)) settings[std::string(st.env)] = st.get(cfg_);
    }
    nlohmann::json j = {{"k", "job"},
                        {"format", 1},
                        {"key", ToHex(job_key_)},
                        {"settings", settings},
                        {"start_version", rounds_announced_},
                        {"start_clock", resumed_ ? resumed_->manifest.clock : Clock{0}},
                        {"prior_gradients", prior_gradients_}};
    if (learning_rate_) j["lr"] = {learning_rate_->first, learning_rate_->second};
    if (resumed_) j["resumed_from"] = resumed_->path;
    return j;
  }
  static bool JournaledSetting(const Setting& st) {
    if (st.scope != SettingScope::kJob && st.scope != SettingScope::kCluster) return false;
    // The grace is the job's: its nodes count with the value their welcome gave them.
    return st.env != "DSYNC_RESUME" && st.env != "DSYNC_JOURNAL" &&
           st.env != "DSYNC_AUDIT_LOG" && st.env != "DSYNC_TEST_CRASH_AFTER_ROUND";
  }

  Status StartJournal() {
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

  // --resume JOURNAL: this scheduler continues the job of a scheduler that was lost. Every
  // record is replayed through the same rule, which decides the same rounds again (each is
  // checked against the journal); then the job's servers and workers have the reconnect grace
  // to come back, and whoever does not is handled as a node lost then.
  Status ResumeJournal() {
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

  // One journal record, replayed under mu_ as the live handlers did it, sending nothing.
  Status Replay(const nlohmann::json& r, bool first) {
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
      pending_tensors_[id].push_back({clock, std::move(tensors)});
      ++wit->second.committed;
      wit->second.last_ack = CommitAnswer{clock, res.round, res.gate.value_or(kNoGate)};
      return Status::Ok();
    }
    if (kind == "finish") return FinishAsBsp();
    if (kind == "auto") {
      AutoDecision d;
      d.quorum = r.at("q").get<uint32_t>();
      for (const auto& a : r.at("a")) d.allowance[a.at(0).get<WorkerId>()] = a.at(1).get<uint32_t>();
      applied_ = d;
      for (const auto& [id, allowance] : applied_.allowance) {
        if (rule_.is_live(id)) DSYNC_RETURN_IF_ERROR(rule_.SetAllowance(id, allowance));
      }
      return rule_.SetQuorum(applied_.quorum);
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
    if (kind == "restarted") return Status::Ok();
    if (kind == "end") {
      return Error(StatusCode::kFailedPrecondition,
                   "the job of this journal is over ({}): there is nothing to resume; resume "
                   "from its checkpoints (--resume DIR) to train on",
                   r.at("why").get<std::string>());
    }
    return Error(StatusCode::kDataLoss, "unknown record '{}'", kind);
  }

  ServerEntry* FindServer(NodeId id) {
    const uint32_t rank = ServerRank(id);
    return rank < servers_.size() ? &servers_[rank] : nullptr;
  }
  Result<ServerEntry*> JournaledServer(NodeId id) {
    ServerEntry* s = FindServer(id);
    if (s == nullptr) return Error(StatusCode::kDataLoss, "server {} never registered", id);
    return s;
  }

  // The job record: the job's settings replace this scheduler's (a restarted scheduler runs
  // the job it continues, whatever its command line says), and the job's key is the one its
  // nodes hold.
  Status ReplayJob(const nlohmann::json& r) {
    if (r.at("format").get<int>() != 1) {
      return Error(StatusCode::kDataLoss, "journal format {} is not this build's (1)",
                   r.at("format").get<int>());
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
    StartAuto();
    server_events_ = ServerEvents(cfg_.num_servers);  // the journal's server count
    const Round start = r.at("start_version").get<Round>();
    if (start > 0) DSYNC_RETURN_IF_ERROR(rule_.StartAt(start, r.at("start_clock").get<Clock>()));
    rounds_announced_ = start;
    prior_gradients_ = r.at("prior_gradients").get<uint64_t>();
    if (r.contains("lr")) {
      learning_rate_ = std::make_pair(r["lr"].at(0).get<Round>(), r["lr"].at(1).get<float>());
      lr_changes_[learning_rate_->first] = learning_rate_->second;
    }
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

  // A closed round's bookkeeping, live and in replay: its members' tensors, its metadata
  // (meta_buf_, kept for servers that rejoin having missed it), the counts, the history.
  void PlaceRound(RoundRecord& rec, bool audit) {
    round_entries_.clear();
    for (const RoundMember& m : rec.members) round_entries_.push_back({m, TakeTensors(m)});
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

  // --- nodes coming back to a restarted scheduler ------------------------------------------

  // A node of the job this scheduler continues: it proves who it is (a server with the job
  // key, a worker with its credential), and gets what it missed while no scheduler ran.
  void HandleRejoin(PeerId peer, const FrameHeader& h, const Hello& hello) {
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

  bool Away() const {
    return std::any_of(servers_.begin(), servers_.end(), [](const ServerEntry& s) { return s.away && !s.lost; }) ||
           std::any_of(workers_.begin(), workers_.end(), [](const auto& w) { return w.second.away; });
  }

  // Everyone came back, or the grace is over: the job goes on with whoever is here.
  void RejoinDone() {
    if (!rejoin_deadline_) return;
    if (Away()) return;
    rejoin_deadline_.reset();
    spdlog::info("scheduler: every node of the job is back; it goes on from round {}", rounds_announced_);
    AdmitWaiting();
    Progress();
  }

  // The grace is over: a server not back is lost (its copies serve, or the job ends), a
  // worker not back failed (its committed gradients stand).
  void RejoinGraceOver() {
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

  // A frame that must leave before the transport shuts down at the end of the job.
  void SendTracked(PeerId peer, const FrameHeader& h) {
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

  void Finish(Status result) {
    if (finished_) return;
    if (!result.ok()) {
      spdlog::error("scheduler: {}", result.message());
      TellFailure(result);
    }
    finished_ = true;
    result_ = std::move(result);
    cv_.notify_all();
  }

  // An error frame answering `about` that must leave before the transport shuts down.
  void SendErrorTracked(PeerId peer, const Status& why, const FrameHeader& about) {
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

  // A tracked frame that could not be sent: no longer waited for. `locked`: run at once,
  // under mu_ (no journal), rather than from the flusher.
  void Untrack(bool locked) {
    if (locked) {
      --final_frames_in_flight_;
      return;
    }
    std::lock_guard lock(mu_);
    --final_frames_in_flight_;
    cv_.notify_all();
  }

  // The nodes waiting for their welcome get the job's failure as the answer to their hello
  // (the others see the connection end; their own timeouts and heartbeats cover them).
  void TellFailure(const Status& why) {
    auto tell = [&](PeerId peer, uint64_t request) {
      FrameHeader about = MakeHeader(MsgType::kHello, kSchedulerId);
      about.request = request;
      SendErrorTracked(peer, why, about);
    };
    for (const auto& [id, peer] : waiting_) tell(peer, waiting_requests_[id]);
    for (const WaitingObserver& o : waiting_observers_) tell(o.peer, o.request);
  }

  // Judges silence: workers past the timeout are declared dead, a server past it stops the
  // job. Never for a time this node itself was stalled (a pause shows as a late tick; the
  // peers' frames of that time are read first), nor while a peer's frames sit unread.
  void MonitorHeartbeats() {
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

  // A tick later than this beyond its period means this process did not run meanwhile.
  static constexpr std::chrono::milliseconds kStallSlack{250};

  Config cfg_;
  std::unique_ptr<Transport> transport_;
  JobKey job_key_;  // credentials and receipts; shared with the servers only (a journal's
                    // when restarted)
  uint16_t port_ = 0;
  std::string rendezvous_host_;  // what this scheduler wrote to the rendezvous file

  mutable std::mutex mu_;
  std::condition_variable cv_;
  RoundRule rule_;
  std::optional<AutoPolicy> policy_;  // dsync:auto: who is slow
  std::optional<DelayPayoff> payoff_;  // dsync:auto: whether delaying them pays
  // dsync:auto's lines that change nothing applied: when the last was logged, how many since.
  static constexpr std::chrono::seconds kQuietPolicyLog{5};
  std::optional<SteadyClock::time_point> quiet_logged_;
  uint64_t quiet_skipped_ = 0;
  AutoDecision applied_;               // dsync:auto: what the rule follows now
  std::unordered_map<PeerId, PeerInfo> peers_;
  std::unordered_set<PeerId> doomed_;  // refused, being dropped
  std::vector<ServerEntry> servers_;  // by rank
  // The servers lost and the ranks a new server took over, in order (a commit's receipts).
  ServerEvents server_events_{cfg_.num_servers};
  // By rank, the servers a commit leaves out (ServerEvents::LeftOut), reused by every commit.
  std::vector<bool> left_out_scratch_;
  // A new server taking a lost rank's place, from its welcome until it holds the copies.
  std::optional<Takeover> takeover_;
  SteadyClock::time_point takeover_started_;  // the new server's registration
  std::map<WorkerId, WorkerEntry> workers_;
  std::vector<std::pair<WorkerId, PeerId>> waiting_;
  std::map<WorkerId, uint64_t> waiting_requests_;
  WorkerId next_worker_id_ = kFirstWorkerId;
  NodeId next_observer_id_ = kFirstObserverId;
  struct WaitingObserver {
    NodeId id;
    PeerId peer;
    uint64_t request;  // of its hello
  };
  std::vector<WaitingObserver> waiting_observers_;
  std::map<NodeId, PeerId> observers_;  // admitted
  bool observers_told_ = false;         // training is over; they read the final model
  static constexpr std::chrono::seconds kObserverGrace{30};
  SteadyClock::time_point observers_deadline_;
  SteadyClock::time_point last_arrival_;  // of the last node while the job forms
  bool budget_spent_ = false;
  bool started_ = false;
  bool finished_ = false;
  bool stop_ = false;
  int final_frames_in_flight_ = 0;
  Status result_;
  SchedulerStats counters_;
  // The newest decisions, for tests and diagnostics; the audit log keeps all of them.
  static constexpr size_t kMaxHistory = size_t{1} << 16;
  // Rounds a restarted scheduler can send again: a server misses those that were on their way
  // when the scheduler was lost (a server further behind is lost at its rejoin).
  static constexpr size_t kMaxResendRounds = 4096;
  std::deque<RoundRecord> history_;
  Agreement agreement_;  // the last agreement report decoded, reused
  AuditLog audit_;
  std::vector<std::byte> meta_buf_;
  // Rounds sent to the servers so far: the next one is the first a new learning rate can
  // apply to everywhere.
  Round rounds_announced_ = 0;
  // The newest change of the learning rate: its first round and the rate (server welcomes).
  std::optional<std::pair<Round, float>> learning_rate_;
  CheckpointCoordinator checkpoints_;
  std::optional<FoundCheckpoint> resumed_;  // --resume: what the job started from
  uint64_t prior_gradients_ = 0;            // applied before that checkpoint
  uint64_t gradients_in_rounds_ = 0;        // of this job, in the rounds sent so far
  bool stopping_ = false;                   // Stop() waits for a checkpoint
  Status stop_result_;                      // what Run returns after a Stop
  Status salvage_;  // a lost server ended the job; the others' slices are written first
  SteadyClock::time_point stop_deadline_;
  // Per worker, the clock after its newest gradient in a round sent so far (checkpoints).
  std::map<WorkerId, Clock> placed_next_clock_;
  // The tensors each committed gradient covers, per worker in clock order, until its round
  // goes out.
  std::unordered_map<WorkerId, std::deque<std::pair<Clock, TensorSet>>> pending_tensors_;
  std::vector<RoundEntry> round_entries_;
  CommitProof commit_scratch_;  // reused by every commit
  std::thread monitor_;
  // The journal (Config::journal): records added under mu_, written by the flusher, which
  // then sends what waited for them (outbox_).
  JournalFile journal_;
  std::vector<std::function<void()>> outbox_;
  std::condition_variable flush_cv_;
  bool flusher_stop_ = false;
  bool flushing_ = false;        // the flusher is writing or sending a batch
  bool journal_failed_ = false;  // a write failed: the job ended
  bool crash_after_write_ = false;  // Config::test_crash_after_round is in the batch
  SteadyClock::time_point flush_started_;  // of the batch being written
  bool journal_stuck_ = false;             // its write did not return: kJournalStallSeconds
  std::thread flusher_;
  // Restarted from a journal: nodes not back yet (away) have until this deadline.
  bool restarted_ = false;
  std::optional<SteadyClock::time_point> rejoin_deadline_;
  // The newest rounds' metadata, for a server that comes back having missed some.
  std::deque<std::pair<Round, std::vector<std::byte>>> recent_rounds_;
  std::map<WorkerId, Clock> gone_workers_;     // removed workers: their next clock
  std::map<WorkerId, GateRelease> last_gate_;  // ssp: the newest gate released per worker
  std::map<Round, float> lr_changes_;          // every change of the learning rate, by round
  Status resume_unreadable_;  // the checkpoint the journal's job started from, if unreadable
  bool end_journaled_ = false;
};

}  // namespace
}  // namespace ps

namespace ps {

Result<std::unique_ptr<Scheduler>> StartScheduler(const Config& config,
                                                  std::unique_ptr<Transport> transport) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  auto node = std::make_unique<SchedulerNode>(config, std::move(transport));
  DSYNC_RETURN_IF_ERROR(node->Init());
  return std::unique_ptr<Scheduler>(std::move(node));
}

}  // namespace ps

}  // namespace dsync
