// The server node's class, whose members are defined across the files named for what they
// hold: server.cc (lifecycle, frames in, heartbeats, buffers), server_requests.cc (workers'
// hellos, inits, pushes and pulls), server_scheduler_frames.cc (the scheduler's frames, rejoining
// a restarted one), server_rounds.cc (applying rounds) and server_state.cc (checkpoints,
// copies for a takeover, dumps). Only those files include it.
#pragma once

#include "dsync/server.h"

#include <spdlog/spdlog.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "ps/buffer_pool.h"
#include "ps/checkpoint.h"
#include "ps/client_registry.h"
#include "ps/gradient_agreement.h"
#include "ps/handshake.h"
#include "ps/rejoin.h"
#include "ps/net_address.h"
#include "ps/optimizer.h"
#include "ps/round_rule.h"
#include "ps/server_node.h"
#include "ps/slicing.h"
#include "ps/staging_ledger.h"
#include "ps/trace.h"

namespace dsync::ps {

class ServerNode final : public Server, public TransportHandler {
 public:
  ServerNode(const Config& config, std::unique_ptr<Transport> transport,
             std::unique_ptr<ParamStore> store)
      : cfg_(config), store_(std::move(store)), transport_(std::move(transport)),
        pool_(store_.get(), transport_.get()),
        device_pool_(store_.get(), transport_.get(), BufferPool::Memory::kDevice) {}

  ~ServerNode() override;

  Status Init();

  // Frames to the scheduler from a thread of its own, so that a busy apply thread or reader
  // never looks like a hung server; a stopped process stops them all, which is the point.
  void HeartbeatLoop();

  // GPUDirect RDMA: with a store that has device memory and a transport that can reach it,
  // large payloads (pushed gradients, initial values, pull replies) go between the NIC and
  // GPU memory directly instead of through a pinned host buffer and a copy.
  Status SetUpDeviceMemory();

  // Payload buffers: GPU memory where GPUDirect RDMA is on and the payload is large enough,
  // host memory otherwise (also when the GPU's pool cannot grow).
  void* AcquireBuffer(size_t bytes);
  void ReleaseBuffer(void* buffer, size_t bytes);

  NodeId id() const override { return id_; }
  uint16_t port() const override { return port_; }

  Status Run() override;

  // In a job that writes checkpoints, the scheduler writes one when it is stopped: a server
  // asked to stop too (a signal to every task, as Slurm sends) keeps serving it until the
  // scheduler ends the job or goes, bounded.
  void Stop() override;

  ServerStats stats() const override;

  // --- TransportHandler ---------------------------------------------------------------

  void OnConnected(PeerId peer, bool inbound) override;

  void OnDisconnected(PeerId peer, const Status& why) override;

  void* OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) override;

  void OnPayloadLost(PeerId peer, const FrameHeader& h, void* payload) override;

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override;

 private:
  using Client = ClientRegistry::Client;
  struct Staged {
    WorkerId worker;
    Clock clock;
    float* data;
  };
  struct WaitingPull {
    PeerId peer;
    uint64_t request;
    Version min_version;
  };
  struct SliceState {
    SliceKey key = 0;
    uint32_t tensor = 0;
    uint32_t index = 0;
    uint32_t replica = 0;  // which copy of the slice this server holds (0: the primary)
    uint64_t elements = 0;
    std::mutex mu;
    Version version = 0;
    OptimizerConfig optimizer;  // the tensor's, from its first registration
    std::vector<Staged> staged;
    std::vector<WaitingPull> waiting;
    // On a server taking a lost rank's place, until the copies are in: the slice is not in
    // the store yet, pulls wait, and its values come from a copy, or else from the init that
    // created it (a tensor no server had at the copies' version).
    bool awaiting_copy = false;
    bool layout_only = false;  // created by a kFlagLayout init: only a copy can fill it
    bool copied = false;
    std::vector<float> init_values;
  };
  struct TensorMeta {
    std::string name;
    uint64_t elements = 0;
    OptimizerConfig optimizer;
    std::vector<uint64_t> shape;  // of the first registration that gave one
  };
  struct PendingRound {
    Round round;
    std::vector<RoundEntry> members;
    // The learning rate every tensor's optimizer runs with in this round, where the job
    // changed it (Worker::SetLearningRate); else each tensor's own.
    std::optional<float> lr;
    // The staleness policy damp: whether the job is damped in this round (kDamp).
    bool damped = false;
    // Not a round: write a checkpoint of version `round` (every round before it applied)
    // into this directory.
    std::string checkpoint_dir;
    // Not a round: send the copies the server of this rank's id holds of this server's
    // slices, at version `round`, where this server is the first live copy (`live`, by rank).
    std::optional<NodeId> copy_for;
    std::vector<bool> live;
    uint32_t takeover = 0;  // the takeover's number (kCopyOut's backs()), named in the copies
  };

  SliceState* FindSlice(uint32_t tensor, uint32_t slice);

  void Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop);

  // A push or pull names a slice this server holds, with the right dtype and length.
  Status CheckData(const FrameHeader& h, SliceState** out);

  // Everything about a push that can be judged before its payload is read: nothing is
  // received, let alone staged, for a push that would be refused.
  Status CheckPushFrom(const Client& c, const FrameHeader& h, SliceState** s);

  // Slices of the job's size: tensor elements per slice (SlicePlanner's rule).
  uint64_t SliceElements() const;

  // The elements a kInit creates: its values', or a layout init's (none sent) the slice's.
  uint64_t InitElements(const FrameHeader& h, const InitMeta& im) const;

  // `observer`: an observer that names no optimizer reads the tensor whatever it runs.
  Status CheckInit(const FrameHeader& h, std::span<const std::byte> meta, bool observer,
                   bool* exists);

  void HandleHello(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta);

  void HandleInit(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                  void* payload, bool exists);

  void StagePush(PeerId peer, WorkerId worker, const FrameHeader& h, void* payload);

  void HandlePull(PeerId peer, const FrameHeader& h);

  // Snapshot the slice into a pooled buffer (the apply thread may update the slice while the
  // reply is on the wire) and send it; the buffer returns to the pool when sent.
  void ReplyPull(SliceState& s, PeerId peer, uint64_t request);

  // The scheduler was lost: until the reconnect grace is over, this server tries to reach it
  // again (restarted from its journal, at the same address) and rejoins it, proving who it is
  // with the job key and saying which rounds it has, so that it is sent the rest. Clients
  // are served meanwhile; nothing is applied that the scheduler did not decide.
  void RejoinLoop();

  // The restarted scheduler's answer to the rejoin: from its welcome on, frames on this
  // connection are the scheduler's (the rounds this server missed follow at once).
  void OnRejoinAnswer(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta);

  void HandleScheduler(const FrameHeader& h, std::span<const std::byte> meta);

  // The newest learning rate set for a round <= `round`, if any. Rounds arrive in order, so
  // older entries are dropped once a newer one applies. Under mu_.
  std::optional<float> LearningRateOf(Round round);

  // The worker is gone: what it pushed for clocks >= next_clock was never committed.
  void DiscardUncommitted(WorkerId w, Clock next_clock);

  // What applying a round needs besides the round, reused from round to round.
  struct RoundScratch {
    std::vector<const float*> grads;  // one slice's gradients, in member order
    std::vector<float> weights;       // their weights (empty: all 1)
    std::vector<uint64_t> bases;      // their base versions (delay compensation only)
    std::vector<float> member_weights;
    std::vector<size_t> used;         // staged entries the round consumed
    // dsync:auto's agreement of the round's gradients (ps/gradient_agreement.h): per member
    // over every slice, and per gradient of one slice (those in host memory).
    Agreement agreement;
    std::vector<size_t> member_of;    // per gradient of the slice: its member
    std::vector<uint8_t> fresh_member;  // per member
    std::vector<uint8_t> host_fresh;    // per gradient of the slice
    std::vector<double> host_dots;
    std::vector<uint8_t> host_measured;
    std::vector<double> agreement_scratch;
    std::vector<std::byte> meta;
  };

  // On a server taking a lost rank's place, a round before the copies' version only
  // releases what it staged (the copies hold its effect); a later one waits for the copies.
  bool NextRoundReady() const;

  void ApplyLoop();

  // Every slice here of every tensor a member's gradient covers must be staged: the
  // scheduler placed it on the servers' receipts. A gap is a protocol error, never skipped.
  Status CheckRoundStaged(const PendingRound& r);

  // `policy`'s weight (the round's active one) of each member's gradient; empty when every
  // one weighs 1 (then the stores sum as they always have), as under `none` always.
  void MemberWeights(const PendingRound& r, const StalenessPolicy& policy,
                     std::vector<float>& member_weights) const;

  // The mean staleness of the slice's gradients in this round (scratch.member_of), each
  // counted with its weight as the sum counts it; 0 for a round of fresh gradients only. Where
  // every weight rounded to 0 (exp:C far past its bound), the plain mean: those rounds are the
  // stalest, not fresh.
  double MeanStaleness(const PendingRound& r, const RoundScratch& scratch) const;

  // dsync:auto weighs what a stale gradient is worth (ps/stale_worth.h): a round that has
  // both fresh and stale gradients is measured, one that has not says nothing. Notes which
  // members are fresh (`fresh_member`) and readies the round's agreement; false when the round
  // is not measured.
  bool StartAgreement(const PendingRound& r, RoundScratch& scratch) const;

  // Adds this slice's share of each member's agreement. Only a slice that every member's
  // gradient covers, in host memory, with two fresh gradients at least, is measured: then
  // every member is measured on the same coordinates, so that stale and fresh are compared on
  // like terms. Gradients in GPU memory (GPUDirect RDMA) are not read back for this.
  void MeasureAgreement(const PendingRound& r, const SliceState& s, RoundScratch& scratch);

  // The agreement goes to the scheduler where it says something: a stale and a fresh member
  // measured, every value finite (a gradient holding inf or NaN measures nothing).
  bool AgreementToSend(RoundScratch& scratch) const;

  Status ApplyRound(const PendingRound& r, RoundScratch& scratch);

  // Every slice here, with its optimizer state, at `version` (the apply thread's: no round
  // runs meanwhile; pushes may still be staged, which changes no slice).
  Result<CheckpointFile> WriteCheckpoint(Version version, const std::string& dir);

  // A slice as checkpoints and copies hold it: the tensor's metadata, values and optimizer
  // state. Under slices_mu_.
  Status SnapshotSlice(SliceState& s, CheckpointSlice& cs);

  // --- a new server taking a lost rank's place (docs/design.md, "Recreating lost copies") --

  // A round before the copies' version on the new server: the copies hold what it applied;
  // what it named that was staged here is released.
  Status ReleaseRound(const PendingRound& r);

  // This server applied every round before `version`: for takeover number `takeover`, it
  // sends the server of `for_id`'s rank
  // the copies that rank holds of the slices here whose first live copy (besides that rank)
  // this server is, in frames of about kCopyChunkBytes, the last flagged.
  void SendCopies(Version version, uint32_t takeover, NodeId for_id,
                  const std::vector<bool>& live);

  // Copies relayed by the scheduler, from one of the other servers (payload: its file's
  // bytes; null for none).
  void TakeCopies(const FrameHeader& h, std::byte* payload);

  Status InstallCopy(const std::string& what, uint32_t from_rank, Version at, CheckpointSlice& cs);

  // Every copy is in: slices no copy filled take their own init's values (a tensor none of
  // the others had at that version), pulls waiting are answered, rounds from the copies'
  // version on are applied from now on. Under mu_.
  void FinishCopies();

  // Taking the rank over failed: the scheduler goes on without this server. Under mu_.
  void FailTakeover(const Status& why);

  void ReportCheckpoint(Version version, const Result<CheckpointFile>& file);

  // A resumed job: this server's slices as the checkpoint holds them, before any client.
  // The slices of this server's rank at the checkpoint's version: from its own file, or, for
  // a rank lost before the checkpoint (it has no file), from the copies the other ranks' files
  // hold of them (Config::replicas).
  Status RestoreCheckpoint(const Welcome::Restore& from);

  Status RestoreSlice(const std::string& what, Version version, CheckpointSlice& cs);

  // One JSON object per slice: enough to check a final model without shipping it.
  Status DumpModel();

  void ReleaseAllStaged();

  Config cfg_;
  // The store outlives the transport: the transport's registrations of the store's device
  // memory must go before that memory is freed.
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<Transport> transport_;
  BufferPool pool_;
  BufferPool device_pool_;                       // GPUDirect RDMA only
  const DeviceMemory* device_memory_ = nullptr;  // set when GPUDirect RDMA is on
  std::atomic<bool> device_direct_{false};       // new payloads go to device memory
  uint64_t direct_min_bytes_ = 0;
  // Read by every transport thread; a scheduler restarted from its journal replaces it.
  std::atomic<PeerId> scheduler_{kNoPeer};
  uint16_t port_ = 0;
  std::string advertised_;  // the host the scheduler tells workers to reach this server at
  // Written when the scheduler's welcome arrives, read by every transport thread.
  std::atomic<NodeId> id_{0};
  Welcome job_;
  ClientRegistry clients_;
  StagingLedger ledger_;

  std::mutex mu_;  // lifecycle, rounds_
  std::condition_variable cv_;
  bool welcomed_ = false;
  bool shutdown_ = false;
  bool stop_ = false;
  bool draining_ = false;  // asked to stop; the scheduler may still want a checkpoint
  bool evicted_ = false;   // the scheduler declared this server lost: the job goes on without it
  bool error_sent_ = false;      // result_ went to the scheduler as an error frame
  bool scheduler_gone_ = false;  // its connection closed
  // A server stopping on an error it sent waits this long for the scheduler to end the job
  // (or drop it) before closing: closing at once can reach the scheduler as a plain
  // disconnect ahead of the error, which then names no cause.
  static constexpr uint32_t kErrorLingerSeconds = 5;
  std::chrono::steady_clock::time_point drain_deadline_;
  // Beyond the scheduler's wait: its shutdown frame has time to arrive.
  static constexpr uint32_t kDrainMarginSeconds = 5;
  Status result_;
  std::deque<PendingRound> rounds_;
  std::map<Round, float> lr_schedule_;  // round -> the job's learning rate from it on
  std::optional<Round> damp_from_;       // the staleness policy damp: damped from this round
  std::thread apply_thread_;
  std::thread heartbeat_thread_;
  // A lost scheduler of a journaled job (Welcome::reconnect_grace_ms): the thread that waits
  // for it to be restarted and rejoins it, and how the newest attempt ended.
  std::thread rejoin_thread_;
  RejoinState rejoin_;
  Round next_round_in_ = 0;  // the next round the scheduler has not sent yet
  // Taking a lost rank's place (Welcome::takeover_from): until every copy is in (written
  // under slices_mu_, exclusively), slices wait for copies; the copies' version and how many
  // servers send them (under mu_).
  std::atomic<bool> awaiting_copies_{false};
  std::optional<Version> copy_at_;
  uint32_t takeover_number_ = 0;  // kCopyOut's backs(): the copies must name it
  uint32_t copies_expected_ = 0;
  uint32_t copies_done_ = 0;

  mutable std::shared_mutex slices_mu_;  // the maps below; exclusive only to add a slice
  std::unordered_map<SliceKey, std::unique_ptr<SliceState>> slices_;
  std::vector<SliceState*> slice_list_;
  std::map<uint32_t, TensorMeta> tensors_;

  struct Counters {
    std::atomic<uint64_t> rounds_applied{0};
    std::atomic<uint64_t> gradients_applied{0};
    std::atomic<uint64_t> pushes_received{0};
    std::atomic<uint64_t> pulls_answered{0};
    std::atomic<uint64_t> requests_refused{0};
    std::atomic<uint64_t> connections_dropped{0};
    std::atomic<uint64_t> staged_now{0};
  } stats_;
};

}  // namespace dsync::ps
