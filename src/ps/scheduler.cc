// The scheduler node: admits servers and workers, watches heartbeats, feeds the RoundRule
// and broadcasts its decisions. Every handler runs under one mutex: the scheduler only sees
// small control frames, and Transport::Send never blocks, so one lock keeps the decisions
// simple to reason about without costing throughput.
#include "dsync/scheduler.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "ps/auto_policy.h"
#include "ps/backends.h"
#include "ps/handshake.h"
#include "ps/round_rule.h"

namespace dsync {
namespace ps {
namespace {

using SteadyClock = std::chrono::steady_clock;

class SchedulerNode final : public Scheduler, public TransportHandler {
 public:
  SchedulerNode(const Config& config, std::unique_ptr<Transport> transport)
      : cfg_(config), transport_(std::move(transport)), rule_(config.sync) {
    if (config.sync.adaptive) {
      AutoPolicyOptions o;
      o.max_bound = config.sync.bound;
      policy_.emplace(o);
    }
  }

  ~SchedulerNode() override {
    Stop();
    if (monitor_.joinable()) monitor_.join();
    transport_->Shutdown();
    if (audit_) std::fclose(audit_);
  }

  Status Init() {
    if (!cfg_.audit_log.empty()) {
      audit_ = std::fopen(cfg_.audit_log.c_str(), "w");
      if (!audit_) {
        return Error(StatusCode::kInvalidArgument, "cannot write the audit log '{}'",
                     cfg_.audit_log);
      }
    }
    transport_->SetHandler(this);
    DSYNC_ASSIGN_OR_RETURN(port_, transport_->Listen(cfg_.bind_host, cfg_.scheduler_port));
    monitor_ = std::thread([this] { MonitorHeartbeats(); });
    spdlog::info("scheduler listening on {}:{} (sync {}, {} server(s), {} initial worker(s))",
                 cfg_.bind_host, port_, rule_.mode().ToString(), cfg_.num_servers,
                 cfg_.num_workers);
    return Status::Ok();
  }

  uint16_t port() const override { return port_; }

  Status Run() override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_ || stop_; });
    if (finished_ && result_.ok()) {
      // Let the last acknowledgements and the shutdown frames leave first.
      cv_.wait_for(lock, std::chrono::seconds(5), [&] { return final_frames_in_flight_ == 0; });
    }
    Status result = stop_ && !finished_ ? Status::Ok() : result_;
    lock.unlock();
    transport_->Shutdown();
    return result;
  }

  void Stop() override {
    std::lock_guard lock(mu_);
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

  void* OnHeader(PeerId, const FrameHeader&, std::span<const std::byte>) override {
    return nullptr;  // the scheduler never takes payloads
  }

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void*) override {
    std::lock_guard lock(mu_);
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
      HandleWorker(peer, info.id, h);
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
    if (finished_) return;
    if (info.kind == PeerKind::kObserver) {
      std::erase_if(waiting_observers_, [&](const WaitingObserver& w) { return w.peer == peer; });
      observers_.erase(info.id);
      CheckFinished();
      return;
    }
    if (info.kind == PeerKind::kServer) {
      Finish(Error(StatusCode::kUnavailable,
                   "server {} disconnected ({}); the job cannot continue without its slices",
                   info.id, why.message()));
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
  };
  struct WorkerEntry {
    PeerId peer;
    SteadyClock::time_point last_seen;
    Clock begun_clock = ~Clock{0};  // the clock its last begin reported, and when
    SteadyClock::time_point begun_at;
  };

  void Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop) {
    spdlog::warn("scheduler: refusing {} from {}: {}", MsgTypeName(about.msg_type()),
                 transport_->PeerAddress(peer), error.message());
    if (drop) doomed_.insert(peer);  // ignore it until it is gone
    (void)SendError(*transport_, peer, kSchedulerId, error, about, /*close_after=*/drop);
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
    if (hello->role == Role::kServer) {
      if (servers_.size() >= cfg_.num_servers) {
        Refuse(peer, h,
               Error(StatusCode::kAlreadyExists,
                     "all {} servers of this job have registered already", cfg_.num_servers),
               true);
        return;
      }
      const NodeId id = kFirstServerId + static_cast<NodeId>(servers_.size());
      servers_.push_back({id, peer, hello->host, hello->port, 0});
      peers_[peer] = {PeerKind::kServer, id};
      Welcome w = JobWelcome(id);
      FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
      ack.request = h.request;
      (void)transport_->Send(peer, ack, AsBytes(EncodeWelcome(w)), nullptr, 0);
      spdlog::info("scheduler: server {} registered at {}:{} ({}/{})", id, hello->host,
                   hello->port, servers_.size(), cfg_.num_servers);
      AdmitWaiting();
      return;
    }
    if (hello->role != Role::kWorker) {
      Refuse(peer, h, Error(StatusCode::kInvalidArgument, "only servers and workers join"), true);
      return;
    }
    if (hello->observer) {
      const NodeId id = next_observer_id_++;
      peers_[peer] = {PeerKind::kObserver, id};
      waiting_observers_.push_back({id, peer, h.request});
      AdmitWaiting();
      return;
    }
    const WorkerId id = next_worker_id_++;
    peers_[peer] = {PeerKind::kWorker, id};
    waiting_.emplace_back(id, peer);
    waiting_requests_[id] = h.request;
    AdmitWaiting();
  }

  Welcome JobWelcome(NodeId id) const {
    Welcome w;
    w.id = id;
    w.sync = cfg_.sync;
    w.optimizer = cfg_.optimizer;
    w.slice_bytes = cfg_.slice_bytes;
    w.heartbeat_interval_ms = cfg_.heartbeat_interval_ms;
    return w;
  }

  // Workers are admitted once every server is up; the first num_workers together, so that
  // they all count from round 0 (a reproducible start); later ones join the running job.
  void AdmitWaiting() {
    if (servers_.size() < cfg_.num_servers) return;
    // Observers need only the servers: they never count in a round.
    for (const WaitingObserver& o : waiting_observers_) {
      Welcome w = JobWelcome(o.id);
      for (const ServerEntry& s : servers_) w.servers.push_back({s.id, s.host, s.port});
      w.observer = true;
      FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
      ack.request = o.request;
      (void)transport_->Send(o.peer, ack, AsBytes(EncodeWelcome(w)), nullptr, 0);
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
      Welcome w = JobWelcome(id);
      for (const ServerEntry& s : servers_) w.servers.push_back({s.id, s.host, s.port});
      w.join_round = admission->join_round;
      w.start_clock = admission->start_clock;
      w.gate = admission->gate;
      FrameHeader ack = MakeHeader(MsgType::kHelloAck, kSchedulerId);
      ack.request = about.request;
      (void)transport_->Send(peer, ack, AsBytes(EncodeWelcome(w)), nullptr, 0);
      workers_[id] = {peer, SteadyClock::now(), ~Clock{0}, {}};
      if (policy_) policy_->Join(id);
      ++counters_.workers_joined;
      spdlog::info("scheduler: worker {} joined from {} (counts from round {}, live {})", id,
                   transport_->PeerAddress(peer), admission->join_round, rule_.live_workers());
      waiting_requests_.erase(id);
    }
    waiting_.clear();
    Redecide();
    Progress();
  }

  void HandleWorker(PeerId peer, WorkerId id, const FrameHeader& h) {
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
        Status s = rule_.Begin(id, h.round, h.aux);
        if (!s.ok()) {
          Refuse(peer, h, s, false);
          return;
        }
        wit->second.begun_clock = h.round;
        wit->second.begun_at = wit->second.last_seen;
        Progress();
        return;
      }
      case MsgType::kCommit: {
        const bool empty = (h.flags & kFlagEmpty) != 0;
        if (policy_ && !empty && wit->second.begun_clock == h.round) {
          // Begin -> commit: the worker's own compute and push time, without the waits
          // the bound imposed on its pulls. Decided before the commit, so that its gate
          // already follows the new allowance.
          policy_->Observe(id, std::chrono::duration<double>(wit->second.last_seen -
                                                             wit->second.begun_at)
                                   .count());
          Redecide();
        }
        auto r = rule_.Commit(id, h.round, h.aux, empty);
        if (!r.ok()) {
          Refuse(peer, h, r.status(), false);
          return;
        }
        FrameHeader ack = MakeHeader(MsgType::kCommitAck, kSchedulerId);
        ack.request = h.request;
        ack.round = r->round;
        ack.aux = r->gate.value_or(kNoGate);
        if (cfg_.max_gradients && rule_.stats().gradients_committed >= cfg_.max_gradients) {
          if (!budget_spent_) {
            budget_spent_ = true;
            spdlog::info("scheduler: {} gradients committed, the job's budget; telling the "
                         "workers to stop",
                         rule_.stats().gradients_committed);
          }
          ack.flags |= kFlagStop;
        }
        (void)SendControl(*transport_, peer, ack);
        Progress();
        return;
      }
      case MsgType::kLeave: {
        // Acknowledge first: the removal may end the job, and Run() flushes what is queued.
        FrameHeader ack = MakeHeader(MsgType::kLeaveAck, kSchedulerId);
        ack.request = h.request;
        SendTracked(peer, ack);
        RemoveWorker(id, /*failed=*/false, "left");
        return;
      }
      default:
        Refuse(peer, h,
               Error(StatusCode::kProtocol, "a worker may not send {} to the scheduler",
                     MsgTypeName(h.msg_type())),
               true);
    }
  }

  void HandleServer(PeerId peer, NodeId id, const FrameHeader& h,
                    std::span<const std::byte> meta) {
    switch (h.msg_type()) {
      case MsgType::kHeartbeat:
        return;
      case MsgType::kApplied:
        for (ServerEntry& s : servers_) {
          if (s.id == id) s.applied = std::max<Round>(s.applied, h.round + 1);
        }
        CheckFinished();
        return;
      case MsgType::kError:
        Finish(ErrorFromFrame(h, meta).WithContext(fmt::format("server {}", id)));
        return;
      default:
        Refuse(peer, h,
               Error(StatusCode::kProtocol, "a server may not send {} to the scheduler",
                     MsgTypeName(h.msg_type())),
               true);
    }
  }

  void RemoveWorker(WorkerId id, bool failed, const std::string& why) {
    auto next = rule_.Remove(id, failed);
    if (!next.ok()) return;
    if (policy_) {
      policy_->Leave(id);
      Redecide();
    }
    if (failed) {
      ++counters_.workers_failed;
      spdlog::warn("scheduler: worker {} declared dead ({}); its {} committed gradient(s) "
                   "stand, anything later is discarded",
                   id, why, *next);
    } else {
      ++counters_.workers_left;
      spdlog::info("scheduler: worker {} left after {} gradient(s)", id, *next);
    }
    // Servers drop what the worker pushed for clocks it never committed.
    FrameHeader gone = MakeHeader(MsgType::kWorkerGone, kSchedulerId);
    gone.tensor = id;
    gone.round = *next;
    for (const ServerEntry& s : servers_) (void)SendControl(*transport_, s.peer, gone);
    if (auto wit = workers_.find(id); wit != workers_.end()) {
      if (failed) transport_->Close(wit->second.peer);
      workers_.erase(wit);
    }
    Progress();
  }

  // dsync:auto: hands the policy's new decision, if any, to the rule.
  void Redecide() {
    if (!policy_ || !policy_->Decide()) return;
    const AutoDecision& d = policy_->decision();
    for (const auto& [id, allowance] : d.allowance) {
      if (rule_.is_live(id)) (void)rule_.SetAllowance(id, allowance);
    }
    (void)rule_.SetQuorum(d.quorum);
    ++counters_.policy_changes;
    spdlog::info("scheduler: dsync:auto from round {}: {}", rule_.open_round(),
                 policy_->Describe());
    if (audit_) {
      fmt::memory_buffer line;
      fmt::format_to(std::back_inserter(line), "{{\"policy\":{{\"from_round\":{},\"quorum\":{},"
                     "\"allowance\":{{", rule_.open_round(), d.quorum);
      bool first = true;
      for (const auto& [id, allowance] : d.allowance) {
        fmt::format_to(std::back_inserter(line), "{}\"{}\":{}", first ? "" : ",", id, allowance);
        first = false;
      }
      fmt::format_to(std::back_inserter(line), "}}}}}}\n");
      WriteAudit(line);
    }
  }

  // Broadcasts every round that may close now and every ssp gate that opened.
  void Progress() {
    for (RoundRecord& rec : rule_.CloseReady()) {
      EncodeMembers(rec.members, meta_buf_);
      FrameHeader h = MakeHeader(MsgType::kRound, kSchedulerId);
      h.round = rec.round;
      for (const ServerEntry& s : servers_) {
        (void)transport_->Send(s.peer, h, meta_buf_, nullptr, 0);
      }
      Audit(rec);
      history_.push_back(std::move(rec));
      if (history_.size() > kMaxHistory) history_.pop_front();
    }
    for (const GateRelease& g : rule_.TakeGateReleases()) {
      auto wit = workers_.find(g.worker);
      if (wit == workers_.end()) continue;
      FrameHeader h = MakeHeader(MsgType::kGate, kSchedulerId);
      h.round = g.clock;
      h.aux = g.min_version;
      (void)SendControl(*transport_, wit->second.peer, h);
    }
    CheckFinished();
  }

  void Audit(const RoundRecord& rec) {
    if (!audit_) return;
    fmt::memory_buffer line;
    fmt::format_to(std::back_inserter(line), "{{\"round\":{},\"live\":{},\"quorum\":{},\"members\":[",
                   rec.round, rec.live_workers, rec.quorum_needed);
    for (size_t i = 0; i < rec.members.size(); ++i) {
      const RoundMember& m = rec.members[i];
      fmt::format_to(std::back_inserter(line), "{}[{},{},{}]", i ? "," : "", m.worker, m.clock,
                     m.base);
    }
    fmt::format_to(std::back_inserter(line), "]}}\n");
    WriteAudit(line);
  }

  // One JSON line, flushed: the log must hold every decision even if the job dies next.
  void WriteAudit(const fmt::memory_buffer& line) {
    std::fwrite(line.data(), 1, line.size(), audit_);
    std::fflush(audit_);
  }

  // The job ends when every worker that joined is gone and every decided round is applied.
  void CheckFinished() {
    if (finished_ || !started_ || rule_.live_workers() > 0 || rule_.has_queued() ||
        !waiting_.empty()) {
      return;
    }
    for (const ServerEntry& s : servers_) {
      if (s.applied < rule_.open_round()) return;
    }
    // Observers get to read the final model before the servers go: they are told the final
    // version and the job waits (bounded) until they leave.
    if (!observers_.empty()) {
      if (!observers_told_) {
        observers_told_ = true;
        observers_deadline_ = SteadyClock::now() + kObserverGrace;
        FrameHeader done = MakeHeader(MsgType::kShutdown, kSchedulerId);
        done.round = rule_.open_round();
        for (const auto& [id, peer] : observers_) (void)SendControl(*transport_, peer, done);
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
    FrameHeader h = MakeHeader(MsgType::kShutdown, kSchedulerId);
    for (const ServerEntry& s : servers_) SendTracked(s.peer, h);
    Finish(Status::Ok());
  }

  // A frame that must leave before the transport shuts down at the end of the job.
  void SendTracked(PeerId peer, const FrameHeader& h) {
    ++final_frames_in_flight_;
    Status st = transport_->Send(peer, h, {}, nullptr, 0, [this](const Status&) {
      std::lock_guard lock(mu_);
      --final_frames_in_flight_;
      cv_.notify_all();
    });
    if (!st.ok()) --final_frames_in_flight_;
  }

  void Finish(Status result) {
    if (finished_) return;
    if (!result.ok()) spdlog::error("scheduler: {}", result.message());
    finished_ = true;
    result_ = std::move(result);
    cv_.notify_all();
  }

  void MonitorHeartbeats() {
    const auto timeout = std::chrono::milliseconds(cfg_.heartbeat_timeout_ms);
    const auto tick = std::chrono::milliseconds(std::max<uint32_t>(1, cfg_.heartbeat_interval_ms / 2));
    std::unique_lock lock(mu_);
    while (!stop_ && !finished_) {
      cv_.wait_for(lock, tick);
      const auto now = SteadyClock::now();
      std::vector<WorkerId> dead;
      for (const auto& [id, w] : workers_) {
        if (now - w.last_seen > timeout) dead.push_back(id);
      }
      for (WorkerId id : dead) {
        RemoveWorker(id, /*failed=*/true,
                     fmt::format("no heartbeat for {} ms", cfg_.heartbeat_timeout_ms));
      }
      if (observers_told_) CheckFinished();  // the observers' grace period may be over
    }
  }

  Config cfg_;
  std::unique_ptr<Transport> transport_;
  uint16_t port_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  RoundRule rule_;
  std::optional<AutoPolicy> policy_;  // dsync:auto
  std::unordered_map<PeerId, PeerInfo> peers_;
  std::unordered_set<PeerId> doomed_;  // refused, being dropped
  std::vector<ServerEntry> servers_;  // by rank
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
  bool budget_spent_ = false;
  bool started_ = false;
  bool finished_ = false;
  bool stop_ = false;
  int final_frames_in_flight_ = 0;
  Status result_;
  SchedulerStats counters_;
  // The newest decisions, for tests and diagnostics; the audit log keeps all of them.
  static constexpr size_t kMaxHistory = size_t{1} << 16;
  std::deque<RoundRecord> history_;
  std::FILE* audit_ = nullptr;
  std::vector<std::byte> meta_buf_;
  std::thread monitor_;
};

}  // namespace
}  // namespace ps

Result<std::unique_ptr<Scheduler>> Scheduler::Start(const Config& config) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  DSYNC_ASSIGN_OR_RETURN(auto transport, ps::MakeTransport(config));
  auto node = std::make_unique<ps::SchedulerNode>(config, std::move(transport));
  DSYNC_RETURN_IF_ERROR(node->Init());
  return std::unique_ptr<Scheduler>(std::move(node));
}

}  // namespace dsync
