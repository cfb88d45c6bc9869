// The scheduler node's class, whose members are defined across the files named for what
// they hold: scheduler.cc (lifecycle, frames in, heartbeats), scheduler_admission.cc (hellos,
// welcomes, nodes back at a restarted scheduler), scheduler_rounds.cc (commits and the round
// rule, dsync:auto's decisions), scheduler_servers.cc (losing a server, a takeover, copies),
// scheduler_ending.cc (finishing, stopping, checkpoints, the last frames) and
// scheduler_journaling.cc (the journal and its replay). Only those files include it.
#pragma once

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
#include "ps/growth_watch.h"
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

namespace dsync::ps {

class SchedulerNode final : public Scheduler, public TransportHandler {
  using SteadyClock = std::chrono::steady_clock;

 public:
  SchedulerNode(const Config& config, std::unique_ptr<Transport> transport)
      : cfg_(config), transport_(std::move(transport)), job_key_(RandomJobKey()),
        rule_(config.sync), checkpoints_(config, 0) {
    StartJobPolicies();
  }

  // What follows the job as it runs, anew: dsync:auto's policy and payoff check (none in
  // other modes), and the staleness policy damp's growth watch.
  void StartJobPolicies();

  ~SchedulerNode() override;

  Status Init();

  uint16_t port() const override { return port_; }

  // --resume: the job continues from the newest complete, sound checkpoint. Rounds go on from
  // its version, the first workers' clocks too, the gradient budget counts what it holds, and
  // each server loads its file before it takes clients.
  Status Resume();

  Status Run() override;

  // With checkpoints, the job's state is written first (bounded by kStopCheckpointSeconds):
  // a stopped or preempted job resumes from where it stopped.
  void Stop() override;

  SchedulerStats stats() const override;

  std::vector<RoundRecord> history() const override;

  // --- TransportHandler ---------------------------------------------------------------

  // The scheduler takes no payloads but the copies a server sends one taking a lost rank's
  // place, which it passes on (RelayCopy).
  void* OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte>) override;

  void OnPayloadLost(PeerId, const FrameHeader&, void* payload) override;

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override;

  void OnDisconnected(PeerId peer, const Status& why) override;

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

  void Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop);

  void HandleHello(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta);

  Welcome JobWelcome(NodeId id) const;

  // A client's welcome: its credential, and what each server will prove itself with.
  Welcome ClientWelcome(NodeId id, bool observer) const;

  // Nodes whose hello was accepted but whose admission waits hear why, now and every
  // heartbeat interval: a scheduler that answers is not mistaken for a dead port.
  void TellWaiting();

  // What the job's start waits for.
  std::string WaitingFor() const;

  // Workers are admitted once every server is up; the first num_workers together, so that
  // they all count from round 0 (a reproducible start); later ones join the running job.
  bool ServersReady() const;

  void AdmitWaiting();

  void HandleWorker(PeerId peer, WorkerId id, const FrameHeader& h,
                    std::span<const std::byte> meta);

  void HandleCommit(PeerId peer, WorkerId id, WorkerEntry& entry, const FrameHeader& h,
                    std::span<const std::byte> meta);

  // The answer to a commit: its round, the lowest version of the next clock's pulls, and
  // whether the job's budget is spent (every commit from then on tells its worker to stop).
  FrameHeader CommitAck(uint64_t request, const CommitAnswer& answer) const;

  // The new rate applies from the first round no server has been told of yet, so that every
  // server switches at the same round: each hears of it before that round, on the same
  // ordered connection. A bad rate is refused; the worker may go on.
  void HandleSetLearningRate(PeerId peer, WorkerId id, const FrameHeader& h,
                             std::span<const std::byte> meta);

  // A worker whose request the scheduler refuses cannot go on with its clocks: it is told
  // why, dropped, and declared failed at once, so that the servers reclaim what it staged.
  void Expel(PeerId peer, WorkerId id, const FrameHeader& h, const Status& why);

  void HandleServer(PeerId peer, NodeId id, const FrameHeader& h,
                    std::span<const std::byte> meta);

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
  void LoseServer(NodeId id, const std::string& what);

  // --- a new server taking a lost rank's place (docs/design.md, "Recreating lost copies") --

  // The server taking a lost rank over now, if any (one at a time: TakeOver).
  const ServerEntry* Filling() const;

  // A server registering once every rank has: with copies, it takes the lowest lost rank's
  // place. It is sent every round from now on; its slices come as copies from the others.
  void TakeOver(PeerId peer, const FrameHeader& h, const Hello& hello);

  // The new server accepts clients: workers are told to connect to it and say from which
  // clock on they push to it; servers that it is back.
  void AnnounceTakeover(ServerEntry& s);

  void HandleTakeoverAck(PeerId peer, WorkerId w, const WorkerEntry& entry, const FrameHeader& h,
                         std::span<const std::byte> meta);

  // Once no round from now on can name a gradient the new server did not get, the other
  // servers copy its rank's slices to it at the version of the rounds sent so far (each
  // after applying them: the request follows the last on its ordered connection).
  void MaybeCopyOut();

  // Whether a server's copies are for the takeover under way (else it ended: dropped).
  bool CopyExpected(NodeId from, const FrameHeader& h) const;

  // A server's copies for the new one (payload: null when it sends none, only an error, or
  // when there was no memory to take them): passed on as they are, on the new server's
  // ordered connection. Copies for a takeover that ended are dropped: their sender did
  // nothing wrong.
  void RelayCopy(NodeId from, const FrameHeader& h, std::span<const std::byte> meta,
                 std::byte* payload);

  // The new server holds every copy at version `at`: its rank is whole again.
  void CopiesIn(NodeId id, Version at);

  // Server `s` is the next lost one.
  void RecordLoss(ServerEntry& s);

  // Server `s` is out of the job: marked lost, what it sent before is ignored, and the audit
  // says so. (Its connection is closed by the caller, at once or once a last frame has left.)
  void DropServer(ServerEntry& s, const std::string& what);

  // While a lost server's end of the job keeps what the others hold (salvage_): server `s` is
  // gone too; the checkpoint goes on without it, and the job ends once it settles, or at once
  // when no server is left to write it.
  void SalvageWithout(ServerEntry& s, const std::string& what);

  void RemoveWorker(WorkerId id, bool failed, const std::string& why, bool close = true);

  // A server's agreement report of a round it applied (dsync:auto's measured worth of stale
  // gradients). A report that does not fit the round is refused with a warning: it only
  // informs the policy, so the job goes on without it.
  void AgreementIn(NodeId id, Round round, std::span<const std::byte> meta);

  // dsync:auto: the policy proposes from the workers' times, the payoff check decides
  // whether delaying is tried, kept or given up; a change goes to the rule.
  void Redecide();

  // The staleness policy's +momentum where it cannot change anything the job's own settings
  // show: said once at start (tensors registered with optimizers of their own may still be
  // momentum SGD, so it is not refused).
  void WarnIfTemperingIsIdle() const;

  // The gradients the job's budget counts: those of the checkpoint it started from, and those
  // committed since.
  uint64_t JobCommitted() const { return prior_gradients_ + rule_.stats().gradients_committed; }

  // A round mode that delays (dsync:K,Q or dsync:auto) with a budget: its last
  // Config::FinishBspPercent() runs as bsp. True when it begins now.
  bool MaybeFinish();

  // Whether the job's mode may close a round without a worker or with a stale gradient.
  bool Delays() const;

  // Every round from the open one on as bsp's, and dsync:auto's decisions bsp for good.
  Status FinishAsBsp();

  struct PendingCommit {
    Clock clock = 0;
    TensorSet tensors;
    float size = CommitProof::kSizeNotMeasured;  // the gradient's (CommitProof::size)
  };
  // What member m's commit covered (recorded at the commit, oldest first): its tensors, and
  // its size where measured.
  PendingCommit TakeCommit(const RoundMember& m);

  // The staleness policy damp: the job's gradients grow (growth_'s reason), and every
  // server applies the damped policy from round `from` on.
  void StartDamping(Round from);
  // A damping decided before (the journal's, a checkpoint's): from `from` on, told to every
  // server in its welcome.
  void ResumeDamped(Round from);
  // The kDamp frame that tells a server the round damping starts from (damp_from_ is set).
  FrameHeader DampFrame() const;

  // Broadcasts every round that may close now and every ssp gate that opened.
  // With copies, whether a live server trails the rounds announced by kReplicaLagRounds or
  // more: no round closes until it catches up (it bounds what a backup holds staged).
  bool ReplicaLagging() const;

  void Progress();

  // The job ends when every worker that joined is gone and every decided round is applied.
  void CheckFinished();

  // Stopping (Stop with checkpoints): once no checkpoint is in flight, one of where the job is
  // now is begun if there is none yet (a periodic one in flight may be older, or have failed)
  // and time is left; then the servers are told the job is over and the scheduler stops.
  void StopIfCheckpointSettled();

  // The servers are told the job is over (`why`: how it ended), after the journal says so: a
  // scheduler started on the journal again refuses to continue a job whose servers are gone.
  void ShutDownServers(const Status& why);
  void JournalEnd(const Status& why);

  // The servers are told the job is over; the scheduler stops, with `why` as its result.
  void EndStopping(Status why);

  // Every server writes its slices at version rounds_announced_: the frame follows the last
  // round before it on each server's ordered connection, so each writes after applying it.
  void BeginCheckpoint();

  // Where a job resumed from a checkpoint now starts its workers' clocks: the lowest clock a
  // live worker's gradients have reached in the rounds sent (the version, in bsp), so none
  // skips data; with no live worker, the highest.
  Clock ResumeClock() const;

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
  void Send(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta = {});
  void CloseLater(PeerId peer);
  void AuditRound(const RoundRecord& rec);

  // The flusher: writes what was journaled, makes it durable, then sends what waited for it.
  // One fdatasync covers every record added meanwhile (group commit).
  void FlushJournal();

  // The job's settings (those the scheduler hands to every node) and where it started from.
  nlohmann::json JobRecord() const;
  static bool JournaledSetting(const Setting& st);

  Status StartJournal();

  // --resume JOURNAL: this scheduler continues the job of a scheduler that was lost. Every
  // record is replayed through the same rule, which decides the same rounds again (each is
  // checked against the journal); then the job's servers and workers have the reconnect grace
  // to come back, and whoever does not is handled as a node lost then.
  Status ResumeJournal();

  // One journal record, replayed under mu_ as the live handlers did it, sending nothing.
  Status Replay(const nlohmann::json& r, bool first);

  ServerEntry* FindServer(NodeId id);
  Result<ServerEntry*> JournaledServer(NodeId id);

  // The job record: the job's settings replace this scheduler's (a restarted scheduler runs
  // the job it continues, whatever its command line says), and the job's key is the one its
  // nodes hold.
  Status ReplayJob(const nlohmann::json& r);

  // A closed round's bookkeeping, live and in replay: its members' tensors, its metadata
  // (meta_buf_, kept for servers that rejoin having missed it), the counts, the history.
  void PlaceRound(RoundRecord& rec, bool audit);

  // --- nodes coming back to a restarted scheduler ------------------------------------------

  // A node of the job this scheduler continues: it proves who it is (a server with the job
  // key, a worker with its credential), and gets what it missed while no scheduler ran.
  void HandleRejoin(PeerId peer, const FrameHeader& h, const Hello& hello);

  bool Away() const;

  // Everyone came back, or the grace is over: the job goes on with whoever is here.
  void RejoinDone();

  // The grace is over: a server not back is lost (its copies serve, or the job ends), a
  // worker not back failed (its committed gradients stand).
  void RejoinGraceOver();

  // A frame that must leave before the transport shuts down at the end of the job.
  void SendTracked(PeerId peer, const FrameHeader& h);

  void Finish(Status result);

  // An error frame answering `about` that must leave before the transport shuts down.
  void SendErrorTracked(PeerId peer, const Status& why, const FrameHeader& about);

  // A tracked frame that could not be sent: no longer waited for. `locked`: run at once,
  // under mu_ (no journal), rather than from the flusher.
  void Untrack(bool locked);

  // The nodes waiting for their welcome get the job's failure as the answer to their hello
  // (the others see the connection end; their own timeouts and heartbeats cover them).
  void TellFailure(const Status& why);

  // Judges silence: workers past the timeout are declared dead, a server past it stops the
  // job. Never for a time this node itself was stalled (a pause shows as a late tick; the
  // peers' frames of that time are read first), nor while a peer's frames sit unread.
  void MonitorHeartbeats();

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
  // The staleness policy damp: whether the gradients grow (while the job is not damped),
  // the round the job is damped from (journaled; every server's welcome carries it), and
  // the sizes of a closed round's members.
  std::optional<GrowthWatch> growth_;
  std::optional<Round> damp_from_;
  std::vector<float> round_sizes_;
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
  std::unordered_map<WorkerId, std::deque<PendingCommit>> pending_tensors_;
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

}  // namespace dsync::ps
