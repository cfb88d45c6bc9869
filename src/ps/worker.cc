// The worker library. Operations are records in a reused table; each slice request carries
// the record's index and generation as its request id, so replies find their destination
// (a pull reply is read straight into the caller's tensor) without a lookup structure that
// allocates. One mutex guards the state; the transport never blocks in Send, so frames are
// sent under it.
#include "ps/worker_node.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "ps/growth_watch.h"
#include "ps/launcher_pipe.h"
#include "ps/handshake.h"
#include "ps/rejoin.h"
#include "ps/slicing.h"
#include "ps/trace.h"

namespace dsync {
namespace ps {
namespace {

constexpr uint32_t kNoOp = std::numeric_limits<uint32_t>::max();
constexpr Clock kNever = std::numeric_limits<Clock>::max();
constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
// Op::asked: the reply's payload is being written into the caller's tensor.
constexpr uint32_t kIncoming = 1u << 31;
using SteadyClock = std::chrono::steady_clock;

class WorkerNode final : public Worker, public TransportHandler {
 public:
  WorkerNode(const Config& config, std::unique_ptr<Transport> transport)
      : cfg_(config), transport_(std::move(transport)) {
    ops_.reserve(64);
  }

  ~WorkerNode() override { Abandon(); }

  Status Init() {
    transport_->SetHandler(this);
    spdlog::info("{}: connecting to the scheduler at {}:{} (for up to {} s)",
                 cfg_.observer ? "observer" : "worker", cfg_.scheduler_host, cfg_.scheduler_port,
                 cfg_.connect_timeout_ms / 1000.0);
    DSYNC_ASSIGN_OR_RETURN(PeerId sched, transport_->Connect(cfg_.scheduler_host,
                                                             cfg_.scheduler_port,
                                                             cfg_.connect_timeout_ms));
    {
      // The transport's threads read what Init writes (under mu_) as soon as frames arrive.
      std::lock_guard lock(mu_);
      scheduler_ = sched;
    }
    Hello hello;
    hello.role = Role::kWorker;
    hello.token = cfg_.token;
    hello.observer = cfg_.observer;
    DSYNC_ASSIGN_OR_RETURN(std::string welcome_meta, Handshake(sched, hello, "the scheduler"));
    DSYNC_ASSIGN_OR_RETURN(Welcome w, DecodeWelcome(AsBytes(welcome_meta)));
    if (cfg_.observer != w.observer) {
      return Error(StatusCode::kProtocol, "the scheduler admitted this node as {}",
                   w.observer ? "an observer" : "a worker");
    }
    if (w.servers.empty()) return Error(StatusCode::kProtocol, "the job has no servers");
    {
      std::lock_guard lock(mu_);
      job_.worker_id = w.id;
      job_.sync = w.sync;
      job_.optimizer = w.optimizer;
      job_.staleness = w.staleness;
      job_.slice_bytes = w.slice_bytes;
      job_.num_servers = static_cast<uint32_t>(w.servers.size());
      job_.join_round = w.join_round;
      job_.start_clock = w.start_clock;
      job_.observer = w.observer;
      planner_.emplace(w.slice_bytes, static_cast<uint32_t>(sizeof(float)), job_.num_servers);
      replicas_ = std::clamp<uint32_t>(w.replicas, 1, job_.num_servers);
      server_lost_ = LostNow(w.servers_lost, w.servers_back, job_.num_servers);
      server_cut_.assign(job_.num_servers, std::nullopt);
      rank_losses_.assign(job_.num_servers, 0);
      push_from_.assign(job_.num_servers, 0);
      serving_.assign(job_.num_servers, true);
      for (NodeId s : w.servers_filling) serving_[ServerRank(s)] = false;
      losses_ = static_cast<uint32_t>(w.servers_lost.size());
      // Losses and takeovers announced after the welcome, before it was read here.
      for (const auto& [h, meta] : std::exchange(early_news_, {})) ServerNews(h, AsBytes(meta));
      clock_ = w.start_clock;
      gate_clock_ = w.start_clock;
      gate_ = w.gate;
      reconnect_grace_ms_ = w.reconnect_grace_ms;
      credential_ = w.credential;
    }
    hello.node = w.id;
    hello.credential = w.credential;
    for (const ServerAddress& s : w.servers) {
      if (ServerRank(s.id) != servers_.size()) {
        return Error(StatusCode::kProtocol, "the scheduler listed server {} out of rank order", s.id);
      }
      // A server lost before (or while) this worker joins is skipped: its copies serve.
      const auto lost = [&] {
        std::lock_guard lock(mu_);
        return server_lost_[ServerRank(s.id)];
      };
      const auto skip = [&] {
        std::lock_guard lock(mu_);
        if (servers_.size() == ServerRank(s.id)) servers_.push_back(kNoPeer);
      };
      if (lost()) {
        skip();
        continue;
      }
      Result<PeerId> connected = transport_->Connect(s.host, s.port, cfg_.connect_timeout_ms);
      if (!connected.ok() && lost()) {
        skip();
        continue;
      }
      DSYNC_ASSIGN_OR_RETURN(PeerId peer, std::move(connected));
      {
        std::lock_guard lock(mu_);
        servers_.push_back(peer);
        server_ids_[peer] = s.id;
      }
      Result<std::string> answer = Handshake(peer, hello, fmt::format("server {}", s.id));
      if (!answer.ok() && lost()) continue;
      DSYNC_ASSIGN_OR_RETURN(std::string proof, std::move(answer));
      // The server proves it is the one the scheduler named (ps/keys.h): a node that merely
      // listens at that address learns nothing and gets no gradients.
      Tag got{};
      if (proof.size() != got.size()) {
        return Error(StatusCode::kPermissionDenied,
                     "{}:{} answered without proving it is server {} of this job", s.host,
                     s.port, s.id);
      }
      std::memcpy(got.data(), proof.data(), got.size());
      if (!TagsEqual(got, s.proof)) {
        return Error(StatusCode::kPermissionDenied,
                     "{}:{} is not server {} of this job (its proof does not match what the "
                     "scheduler said)",
                     s.host, s.port, s.id);
      }
    }
    heartbeat_ = std::thread([this, interval = w.heartbeat_interval_ms] { Heartbeat(interval); });
    {
      std::lock_guard lock(mu_);
      servers_connected_ = true;  // takeovers announced meanwhile are taken from now on
      cv_.notify_all();
    }
    const std::string copies =
        replicas_ > 1 ? fmt::format(", {} copies of each slice", replicas_) : std::string();
    if (job_.observer) {
      spdlog::info("observer {} connected (sync {}, {} server(s){})", job_.worker_id,
                   job_.sync.ToString(), job_.num_servers, copies);
    } else {
      spdlog::info("worker {} joined (sync {}, {} server(s){}, counts from round {}, clock {})",
                   job_.worker_id, job_.sync.ToString(), job_.num_servers, copies,
                   job_.join_round, clock_);
    }
    return Status::Ok();
  }

  const JobInfo& job() const override { return job_; }

  // Sends tensor `id`'s init to the primary (the first live copy) of each slice, or to every
  // other live copy, and waits for their answers.
  Status InitCopies(std::unique_lock<std::mutex>& lock, TensorId id, std::span<const float> values,
                    const TensorOptions& options, bool primaries) {
    const Tensor& tensor = tensors_[id];
    const uint32_t op = NewOp(OpKind::kInit, id);
    ops_[op].version = std::numeric_limits<Version>::max();
    ops_[op].at_server.assign(job_.num_servers, 0);
    std::vector<std::byte> meta;
    for (const SliceRef& s : tensor.layout.slices) {
      EncodeInit({tensor.name, values.size(), s.offset, options.optimizer, options.shape}, meta);
      const std::optional<uint32_t> primary = PrimaryOf(s);
      if (!primary) {
        if (!primaries) continue;  // nothing to create
        FinishOp(op, Error(StatusCode::kUnavailable, "every copy of tensor '{}' slice {} is lost",
                           tensor.name, s.index));
        break;
      }
      for (uint32_t j = 0; j < replicas_; ++j) {  // every live copy, on its own server
        const uint32_t rank = ReplicaRank(s.server, j, job_.num_servers);
        if (server_lost_[rank] || (rank == *primary) != primaries) continue;
        FrameHeader h = SliceHeader(MsgType::kInit, op, id, s);
        h.set_replica(j);
        ++ops_[op].outstanding;
        ++ops_[op].at_server[rank];
        Status st = SendPayload(servers_[rank], h, meta, values.data() + s.offset,
                                s.elements * sizeof(float));
        if (!st.ok() && !ToleratedSendFailure(rank, st)) {
          FinishOp(op, st);
          break;
        }
      }
      if (ops_[op].done) break;
    }
    if (ops_[op].outstanding == 0 && !ops_[op].done) FinishOp(op, Status::Ok());
    return WaitLocked(lock, op, nullptr);
  }

  using Worker::Register;
  Result<TensorId> Register(std::string_view name, std::span<const float> init,
                            const TensorOptions& options) override {
    if (options.optimizer) {
      if (Status st = ValidateOptimizer(*options.optimizer); !st.ok()) {
        return st.WithContext(fmt::format("register tensor '{}'", name));
      }
    }
    if (!options.shape.empty()) {
      uint64_t product = 1;
      for (uint64_t d : options.shape) product *= d;
      if (options.shape.size() > TensorOptions::kMaxTensorDims || product != init.size()) {
        return Error(StatusCode::kInvalidArgument,
                     "register tensor '{}': shape {} does not hold its {} elements (or has more "
                     "than {} dimensions)",
                     name, ShapeText(options.shape), init.size(), TensorOptions::kMaxTensorDims);
      }
    }
    std::unique_lock lock(mu_);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].name == name) {
        return Error(StatusCode::kInvalidArgument,
                     "register tensor '{}': this worker registered that name already (tensor {}); "
                     "every tensor needs a name of its own", name, i);
      }
    }
    DSYNC_RETURN_IF_ERROR(broken_);
    if (clock_ != job_.start_clock || !clocks_.empty()) {
      return Error(StatusCode::kFailedPrecondition,
                   "register tensor '{}' before the first push (every worker registers the same "
                   "tensors, in the same order, before training)",
                   name);
    }
    // Registration waits with the lock released; a second thread registering meanwhile would
    // take the same id and placement slot, so registrations run one at a time.
    if (registering_) {
      return Error(StatusCode::kFailedPrecondition,
                   "register tensor '{}': another thread of this worker is registering a tensor "
                   "(register from one thread, in the same order on every worker)",
                   name);
    }
    const auto id = static_cast<TensorId>(tensors_.size());
    DSYNC_ASSIGN_OR_RETURN(TensorLayout layout, planner_->Plan(id, init.size()));
    registering_ = true;
    Tensor t;
    t.name = std::string(name);
    t.layout = std::move(layout);
    t.options = options;
    t.slice_version.assign(t.layout.slices.size(), 0);
    tensors_.push_back(std::move(t));
    // The primaries first: the first registration of a slice sets its values there. With
    // copies, the others are then created from what the primary holds (read back), not from
    // this worker's values: workers may register different initial values, and the copies of
    // a slice must be identical.
    Status st = InitCopies(lock, id, init, options, /*primaries=*/true);
    if (st.ok() && replicas_ > 1) {
      std::vector<float> model(init.size());
      // No clock's pull: it goes out now and tells the scheduler nothing.
      st = WaitLocked(lock, OpOf(PullLocked(id, model.data(), kNever)), nullptr);
      if (st.ok()) st = InitCopies(lock, id, model, options, /*primaries=*/false);
    }
    registering_ = false;
    cv_.notify_all();  // a takeover waits for registrations to end (TakeoverLoop)
    if (!st.ok()) {
      planner_->Unplan(tensors_.back().layout);
      tensors_.pop_back();
      return st.WithContext(fmt::format("register tensor '{}'", name));
    }
    RecomputeBase();
    return id;
  }

  Handle Push(TensorId tensor, const float* grad) override {
    std::lock_guard lock(mu_);
    return PushLocked(tensor, grad, /*detached=*/false);
  }

  Handle Pull(TensorId tensor, float* out) override {
    std::lock_guard lock(mu_);
    return PullLocked(tensor, out, clock_);
  }

  Handle PushPull(TensorId tensor, const float* grad, float* out) override {
    std::lock_guard lock(mu_);
    const Clock push_clock = clock_;
    if (Status st = CheckPush(tensor); !st.ok()) {
      const uint32_t op = NewOp(OpKind::kPull, tensor);
      FinishOp(op, st);
      return HandleOf(op);
    }
    PushLocked(tensor, grad, /*detached=*/true);
    // The pull belongs to the next clock: it is gated on this clock's commit.
    const Handle pull = PullLocked(tensor, out, push_clock + 1);
    ops_[OpOf(pull)].holds_payload = true;
    return pull;
  }

  Handle Advance() override {
    std::lock_guard lock(mu_);
    const uint32_t op = NewOp(OpKind::kAdvance, 0);
    if (!broken_.ok() || job_.observer) {
      FinishOp(op, job_.observer ? Error(StatusCode::kPermissionDenied,
                                         "observer {} is read-only: it has no clock to advance",
                                         job_.worker_id)
                                 : broken_);
      return HandleOf(op);
    }
    ClockState& cs = CurrentClockState();
    cs.advance_op = op;
    ops_[op].clock = clock_;
    CompleteClock();
    return HandleOf(op);
  }

  Status Wait(Handle handle, Version* version) override {
    std::unique_lock lock(mu_);
    const uint32_t op = OpOf(handle);
    if (op == kNoOp) return Error(StatusCode::kInvalidArgument, "unknown handle {}", handle);
    return WaitLocked(lock, op, version);
  }

  Status WaitAll() override {
    std::unique_lock lock(mu_);
    Status first;
    for (uint32_t i = 0; i < ops_.size(); ++i) {
      if (!ops_[i].in_use || ops_[i].detached) continue;
      Status st = WaitLocked(lock, i, nullptr);
      if (first.ok()) first = st;
    }
    return first;
  }

  Clock clock() const override {
    std::lock_guard lock(mu_);
    return clock_;
  }

  Version base_version() const override {
    std::lock_guard lock(mu_);
    return base_;
  }

  bool stop_requested() const override {
    std::lock_guard lock(mu_);
    return stop_requested_;
  }

  std::optional<Version> final_version() const override {
    std::lock_guard lock(mu_);
    return final_version_;
  }

  Result<Round> SetLearningRate(float lr) override {
    if (!std::isfinite(lr) || lr < 0.0f) {
      return Error(StatusCode::kInvalidArgument,
                   "learning rate {} must be a finite number >= 0", lr);
    }
    std::unique_lock lock(mu_);
    if (job_.observer) {
      return Error(StatusCode::kPermissionDenied,
                   "observer {} is read-only: it cannot set the learning rate", job_.worker_id);
    }
    // One change at a time: the answer is matched to the request it belongs to.
    cv_.wait(lock, [&] { return (!lr_request_ && !away_) || !broken_.ok(); });
    DSYNC_RETURN_IF_ERROR(broken_);
    const uint64_t request = ++lr_requests_;
    lr_request_ = request;
    lr_answer_.reset();
    FrameHeader h = MakeHeader(MsgType::kSetLearningRate, job_.worker_id);
    h.request = request;
    std::vector<std::byte> meta;
    EncodeLearningRate(lr, meta);
    if (Status st = transport_->Send(scheduler_, h, meta, nullptr, 0); !st.ok()) {
      lr_request_.reset();
      cv_.notify_all();
      return st.WithContext("setting the learning rate");
    }
    const auto limit = std::chrono::milliseconds(cfg_.connect_timeout_ms);
    const bool answered =
        cv_.wait_for(lock, limit, [&] { return lr_answer_.has_value() || !broken_.ok(); });
    lr_request_.reset();
    cv_.notify_all();
    if (!answered) {
      return Error(StatusCode::kDeadlineExceeded,
                   "the scheduler did not answer the change of the learning rate to {} within "
                   "{} ms",
                   lr, cfg_.connect_timeout_ms);
    }
    if (!lr_answer_) return broken_.WithContext("setting the learning rate");
    Result<Round> answer = std::move(*lr_answer_);
    lr_answer_.reset();
    return answer;
  }

  Status Leave() override {
    std::unique_lock lock(mu_);
    if (left_) return Status::Ok();
    if (pushed_count_ > 0) CompleteClock();  // commit what was pushed: never lost
    cv_.wait(lock, [&] { return (clocks_.empty() && !away_) || !broken_.ok(); });
    DSYNC_RETURN_IF_ERROR(broken_);
    leaving_ = true;
    if (Status st = SendControl(*transport_, scheduler_, MakeHeader(MsgType::kLeave, job_.worker_id));
        !st.ok()) {
      if (reconnect_grace_ms_ == 0) return st;
      // The scheduler's connection is ending. Every commit was answered, so nothing of this
      // worker's is lost: a restarted scheduler finds it gone.
      spdlog::warn("worker {}: leaving without the scheduler's acknowledgement ({}); every "
                   "commit was answered",
                   job_.worker_id, st.message());
      left_ = true;
    }
    cv_.wait(lock, [&] { return left_ || !broken_.ok(); });
    Status result = left_ ? Status::Ok() : broken_;
    lock.unlock();
    StopThreads();
    spdlog::info("worker {} left the job", job_.worker_id);
    return result;
  }

  Status RegisterBuffer(const void* ptr, size_t bytes) override {
    return transport_->RegisterMemory(ptr, bytes);
  }
  void UnregisterBuffer(const void* ptr, size_t bytes) override {
    transport_->ForgetMemory(ptr, bytes);
  }

  void Abandon() override {
    {
      std::lock_guard lock(mu_);
      leaving_ = true;
    }
    StopThreads();
  }

  // --- TransportHandler ---------------------------------------------------------------

  void* OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte>) override {
    if (h.msg_type() != MsgType::kPullReply) return nullptr;
    std::lock_guard lock(mu_);
    const uint32_t op = OpOf(h.request);
    if (op == kNoOp || ops_[op].kind != OpKind::kPull || ops_[op].tensor != h.tensor()) {
      return nullptr;
    }
    const auto& slices = tensors_[h.tensor()].layout.slices;
    if (h.slice() >= slices.size() ||
        h.payload_len != slices[h.slice()].elements * sizeof(float)) {
      return nullptr;
    }
    // Only the copy this slice was asked of writes into the caller's tensor, once: a lost
    // server's late answer (the pull went to another copy meanwhile) is dropped. While its
    // payload is being written the slice is not asked again elsewhere (OnServerLost).
    const uint32_t rank = RankOf(peer);
    if (rank == kNoRank || h.slice() >= ops_[op].asked.size() ||
        ops_[op].asked[h.slice()] != rank) {
      return nullptr;
    }
    ops_[op].asked[h.slice()] |= kIncoming;
    ++ops_[op].receiving;  // Wait() must not return while the transport writes here
    return ops_[op].out + slices[h.slice()].offset;  // straight into the caller's tensor
  }

  void OnPayloadLost(PeerId peer, const FrameHeader& h, void*) override {
    std::lock_guard lock(mu_);
    const uint32_t op = OpOf(h.request);
    if (op != kNoOp && ops_[op].receiving > 0) --ops_[op].receiving;
    if (op != kNoOp && ops_[op].kind == OpKind::kPull && h.slice() < ops_[op].asked.size() &&
        (ops_[op].asked[h.slice()] & kIncoming)) {
      // Cut off mid-payload: asked again of the next copy once the server is known lost (now,
      // if it is already; else OnServerLost does it).
      ops_[op].asked[h.slice()] &= ~kIncoming;
      const uint32_t rank = RankOf(peer);
      const bool gone = (rank != kNoRank && server_lost_[rank]) || retired_peers_.contains(peer);
      if (gone && !ops_[op].done && broken_.ok()) {
        (void)SendPull(op, tensors_[ops_[op].tensor].layout.slices[h.slice()]);
      }
    }
    cv_.notify_all();
  }

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override {
    std::lock_guard lock(mu_);
    // A lost server's, replaced since; but for a pull reply whose payload was being written
    // (below).
    if (retired_peers_.contains(peer) && !(h.msg_type() == MsgType::kPullReply && payload)) {
      return;
    }
    // Frames a lost server sent before its loss was heard of here are dropped, but for a pull
    // reply whose payload was already being written (it is whole, and of a version the job
    // applied: it is taken).
    if (losses_ > 0 && peer != scheduler_ && IsLost(peer) &&
        !(h.msg_type() == MsgType::kPullReply && payload != nullptr)) {
      return;
    }
    if (peer == rejoin_.peer) {
      OnRejoinAnswer(peer, h, meta);
      cv_.notify_all();
      return;
    }
    switch (h.msg_type()) {
      case MsgType::kHelloAck:
        handshake_reply_ = std::string(AsText(meta));
        handshake_done_ = true;
        break;
      case MsgType::kPending:
        handshake_heard_ = SteadyClock::now();
        if (std::string why(AsText(meta)); why != pending_why_) {
          spdlog::info("{}: the scheduler accepted the hello; {}",
                       cfg_.observer ? "observer" : "worker", why);
          pending_why_ = std::move(why);
        }
        break;
      case MsgType::kError:
        OnError(peer, h, meta);
        break;
      case MsgType::kInitAck:
      case MsgType::kPushAck:
        OnSliceAck(peer, h, meta);
        break;
      case MsgType::kPullReply:
        OnPullReply(h, payload);
        break;
      case MsgType::kCommitAck:
        OnCommitAck(h);
        break;
      case MsgType::kGate:
        OpenGate(h.clock(), h.min_version());
        break;
      case MsgType::kLeaveAck:
        left_ = true;
        break;
      case MsgType::kSetLearningRateAck:
        if (peer == scheduler_ && lr_request_ && h.request == *lr_request_) {
          lr_answer_ = Result<Round>(h.round());
        }
        break;
      case MsgType::kShutdown:
        if (job_.observer && peer == scheduler_) final_version_ = h.final_version();
        break;
      case MsgType::kServerGone:
      case MsgType::kServerBack:
      case MsgType::kServerServes:
        if (peer != scheduler_) break;
        if (server_lost_.empty()) {  // before Init took the welcome: applied then
          early_news_.emplace_back(h, std::string(AsText(meta)));
        } else {
          ServerNews(h, meta);
        }
        break;
      default:
        spdlog::warn("worker {}: unexpected {} frame", job_.worker_id, MsgTypeName(h.msg_type()));
    }
    cv_.notify_all();
  }

  void OnDisconnected(PeerId peer, const Status& why) override {
    std::lock_guard lock(mu_);
    if (peer == rejoin_.peer) {
      if (rejoin_.answer == RejoinState::Answer::kNone) rejoin_.answer = RejoinState::Answer::kCut;
      cv_.notify_all();
      return;
    }
    if (leaving_ && peer == scheduler_) {
      // Every commit was acknowledged before the leave was sent: nothing is lost if the
      // acknowledgement of the leave itself did not make it (the job may have just ended).
      left_ = true;
      cv_.notify_all();
      return;
    }
    if (leaving_ || left_) return;
    if (peer != scheduler_ && IsLost(peer)) return;  // closed here once the scheduler said so
    if (peer == handshake_peer_ && servers_connected_ && RankOf(peer) == kNoRank) {
      // A server taking a lost rank over went during the handshake (TakeoverLoop).
      if (!handshake_done_) {
        handshake_error_ = Error(StatusCode::kUnavailable, "it closed the connection ({})",
                                 why.message());
        handshake_done_ = true;
      }
      return;
    }
    if (peer == scheduler_ && reconnect_grace_ms_ > 0 && broken_.ok() && !stop_) {
      // The job journals its scheduler: it may be restarted. Pushes and pulls go on; commits
      // wait for it.
      away_ = true;
      spdlog::warn("worker {}: lost the scheduler ({}); waiting up to {} s for it to be "
                   "restarted from its journal",
                   job_.worker_id, why.message(), reconnect_grace_ms_ / 1000);
      if (rejoin_.Lost(why.message())) {
        if (rejoin_thread_.joinable()) rejoin_thread_.join();  // the previous one, done
        rejoin_thread_ = std::thread([this] { RejoinLoop(); });
      }
      return;
    }
    const std::string who = peer == scheduler_ ? std::string("the scheduler")
                                               : PeerName(peer);
    if (away_ && peer != scheduler_ && RankOf(peer) == kNoRank) {
      return;  // a rejoin's connection, closed before its attempt named it: its send fails
    }
    if (peer != scheduler_ && away_ && replicas_ <= 1) {
      // Servers wait for a lost scheduler as long as workers do: this one stopped waiting.
      Break(Error(StatusCode::kUnavailable,
                  "lost the connection to {} ({}) while the scheduler was lost: the job's nodes "
                  "wait for it the reconnect grace of {} s (--reconnect-grace)",
                  who, why.message(), reconnect_grace_ms_ / 1000));
      return;
    }
    if (peer != scheduler_ && replicas_ > 1) {
      // Its slices have other copies: the scheduler, which hears of the loss too, says when
      // to stop waiting for it (kServerGone). Until then nothing it owed is given up.
      CutFromServer(RankOf(peer), why);
      return;
    }
    Break(Error(StatusCode::kUnavailable, "lost the connection to {}: {}", who, why.message()));
  }

 private:
  enum class OpKind : uint8_t { kInit, kPush, kPull, kAdvance };
  struct Op {
    OpKind kind = OpKind::kPull;
    bool in_use = false;
    bool done = false;
    bool detached = false;  // nobody waits: free on completion
    bool sent = false;      // pulls: requests are out
    // Wait() returns only once the transport let go of the caller's payloads: pushes, inits,
    // and the pull of a PushPull (the one handle its caller waits on).
    bool holds_payload = false;
    uint32_t gen = 0;
    uint32_t outstanding = 0;
    uint32_t receiving = 0; // pull payloads being written into `out` right now
    TensorId tensor = 0;
    Clock clock = 0;
    float* out = nullptr;
    Version version = 0;    // pulls: lowest slice version read
    Version min_version = 0;  // pulls: the version the servers were asked to wait for
    uint64_t trace = 0;     // pulls: the open "worker: pull" range
    Status status;
    // Kept across reuse of the record (capacity only), so that steady state allocates nothing:
    std::vector<uint32_t> at_server;  // inits: answers still owed, by server rank
    std::vector<uint32_t> asked;      // pulls: the rank each slice was asked of (kNoRank: read)
  };
  struct Tensor {
    std::string name;
    TensorLayout layout;
    TensorOptions options;  // as registered (a server taking a lost rank over is told them)
    std::vector<Version> slice_version;  // newest version read per slice
    Version version = 0;                 // lowest of them
    Clock pushed_clock = kNever;
    Clock pulled_clock = kNever;
  };
  // A clock whose gradient is being pushed or committed.
  struct ClockState {
    Clock clock = 0;
    Version base = 0;
    uint32_t acks_outstanding = 0;
    bool complete = false;     // every tensor pushed, or Advance()
    bool commit_sent = false;
    uint32_t advance_op = kNoOp;
    CommitProof proof;         // tensors pushed (none: an empty commit); receipts: below
    double size_squares = 0.0;  // damp: the gradient's sum of squares and element count
    uint64_t size_elements = 0;
    // By server rank: acknowledgements still owed and the receipts got, so that a lost
    // server's share can be taken out of the commit (its receipts are left out, losses()).
    std::vector<uint32_t> acks_at;
    std::vector<Tag> receipts_at;
  };

  // The scheduler was lost: until the reconnect grace is over, try to reach it again
  // (restarted from its journal, at the same address) and rejoin with this worker's
  // credential. The commit that was not answered goes again once it is back.
  void RejoinLoop() {
    std::unique_lock lock(mu_);
    Status st = RunRejoin(lock, cv_, *transport_, cfg_, reconnect_grace_ms_, job_.worker_id, rejoin_,
                          [&] { return stop_ || leaving_ || !broken_.ok(); },
                          [&] {
                            Hello hello;
                            hello.role = Role::kWorker;
                            hello.token = cfg_.token;
                            hello.node = job_.worker_id;
                            hello.rejoin = true;
                            hello.credential = credential_;
                            return hello;
                          });
    if (!st.ok()) Break(st);
  }

  // The restarted scheduler's answer: from its welcome on, this connection is the
  // scheduler's. Losses of servers it announced meanwhile are taken, and the commit it never
  // answered goes again (it answers a commit it has as the lost one did).
  void OnRejoinAnswer(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
    const std::optional<Welcome> w = rejoin_.TakeAnswer(h, meta, credential_, job_.worker_id);
    if (!w) return;
    scheduler_ = peer;
    away_ = false;
    spdlog::info("worker {}: back with the restarted scheduler", job_.worker_id);
    for (uint32_t i = 0; i < w->servers_lost.size(); ++i) OnServerLost(w->servers_lost[i], i + 1);
    if (!clocks_.empty()) clocks_.front().commit_sent = false;
    TryCommit();
  }

  // Sends the hello and waits for the answer. The scheduler may hold a worker until every
  // server and the job's first workers are up, but it says so every heartbeat interval
  // (kPending); a peer silent for the connect timeout is not a dsyncps node that works.
  // `stoppable`: a stop or leave ends the wait (a takeover's, which runs beside training).
  Result<std::string> Handshake(PeerId peer, const Hello& hello, const std::string& who,
                                bool stoppable = false) {
    std::unique_lock lock(mu_);
    const auto stopped = [&] { return stoppable && (stop_ || leaving_); };
    handshake_done_ = false;
    handshake_reply_.clear();
    handshake_peer_ = peer;
    handshake_error_ = Status::Ok();
    handshake_heard_ = SteadyClock::now();
    DSYNC_RETURN_IF_ERROR(transport_->Send(peer, MakeHeader(MsgType::kHello, hello.node),
                                           AsBytes(EncodeHello(hello)), nullptr, 0));
    const auto silence = std::chrono::milliseconds(cfg_.connect_timeout_ms);
    while (!handshake_done_ && broken_.ok() && !stopped()) {
      if (cv_.wait_until(lock, handshake_heard_ + silence) == std::cv_status::timeout &&
          SteadyClock::now() >= handshake_heard_ + silence && !handshake_done_) {
        return Error(StatusCode::kDeadlineExceeded,
                     "{} at {} accepted the connection but did not answer the hello within {} "
                     "ms; is that address and port a dsyncps node of this job?",
                     who, transport_->PeerAddress(peer), cfg_.connect_timeout_ms);
      }
    }
    if (!broken_.ok()) return broken_.WithContext(fmt::format("joining via {}", who));
    if (stopped()) return Error(StatusCode::kAborted, "this node is stopping");
    if (!handshake_error_.ok()) return handshake_error_.WithContext(who);
    return handshake_reply_;
  }

  // --- operations ---------------------------------------------------------------------

  uint32_t NewOp(OpKind kind, TensorId tensor) {
    uint32_t i;
    if (!free_ops_.empty()) {
      i = free_ops_.back();
      free_ops_.pop_back();
    } else {
      i = static_cast<uint32_t>(ops_.size());
      ops_.emplace_back();
    }
    Op& op = ops_[i];
    const uint32_t gen = op.gen + 1;
    std::vector<uint32_t> at_server = std::move(op.at_server);
    std::vector<uint32_t> asked = std::move(op.asked);
    op = Op{};
    op.gen = gen;
    op.at_server = std::move(at_server);
    op.at_server.clear();
    op.asked = std::move(asked);
    op.asked.clear();
    op.kind = kind;
    op.in_use = true;
    op.tensor = tensor;
    op.holds_payload = kind == OpKind::kPush || kind == OpKind::kInit;
    return i;
  }

  Handle HandleOf(uint32_t op) const { return (static_cast<uint64_t>(ops_[op].gen) << 32) | op; }

  uint32_t OpOf(uint64_t handle) const {
    const auto i = static_cast<uint32_t>(handle & 0xffffffffu);
    const auto gen = static_cast<uint32_t>(handle >> 32);
    if (i >= ops_.size() || !ops_[i].in_use || ops_[i].gen != gen) return kNoOp;
    return i;
  }

  void FreeOp(uint32_t op) {
    ops_[op].in_use = false;
    ops_[op].out = nullptr;
    free_ops_.push_back(op);
  }

  void FinishOp(uint32_t op, const Status& st) {
    Op& o = ops_[op];
    if (o.done) return;
    o.done = true;
    o.status = st;
    trace::End(std::exchange(o.trace, 0));
    if (o.detached) FreeOp(op);
    cv_.notify_all();
  }

  Status WaitLocked(std::unique_lock<std::mutex>& lock, uint32_t op, Version* version) {
    const Op& o = ops_[op];
    if (!o.done && o.kind == OpKind::kPush && o.clock == clock_) {
      return Error(StatusCode::kFailedPrecondition,
                   "the push of tensor {} completes when clock {} is committed: push every "
                   "registered tensor (or call Advance()) before waiting for it",
                   o.tensor, o.clock);
    }
    const uint32_t gen = o.gen;
    std::optional<trace::Scoped> waiting;
    if (!o.done) {
      // A pull waits for the bound while it is held back here or asks for a version newer
      // than any this worker has seen (the server holds it until that round is applied).
      const bool bound = o.kind == OpKind::kPull &&
                         (!o.sent || o.min_version > tensors_[o.tensor].version);
      waiting.emplace(o.kind != OpKind::kPull ? trace::Range::kWorkerWaitForPush
                      : bound                 ? trace::Range::kWorkerWaitForBound
                                              : trace::Range::kWorkerWaitForPull);
    }
    cv_.wait(lock, [&] {
      return ops_[op].gen != gen || (ops_[op].done && ops_[op].receiving == 0);
    });
    Status st = ops_[op].status;
    if (!st.ok() || ops_[op].holds_payload) {
      // The caller may free its buffers next. On success the payloads left long ago (the
      // servers acknowledged them) and this hardly ever waits; after a failure the transport
      // may still be reading some.
      ++payload_waiters_;
      cv_.wait(lock, [&] { return payload_sends_ == 0; });
      --payload_waiters_;
    }
    if (version) *version = ops_[op].version;
    FreeOp(op);
    return st;
  }

  // Sends a frame whose payload is the caller's memory (a gradient, initial values), counted
  // until the transport lets go of it.
  Status SendPayload(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                     const float* data, size_t bytes) {
    ++payload_sends_;
    Status st = transport_->Send(peer, h, meta, data, bytes, [this](const Status&) {
      std::lock_guard lock(mu_);
      // Only an error path waits for this: waking every waiter per frame would cost a
      // context switch per push.
      if (--payload_sends_ == 0 && payload_waiters_ > 0) cv_.notify_all();
    });
    if (!st.ok()) --payload_sends_;
    return st;
  }

  FrameHeader SliceHeader(MsgType type, uint32_t op, TensorId tensor, const SliceRef& s) const {
    FrameHeader h = MakeHeader(type, job_.worker_id);
    h.request = HandleOf(op);
    h.set_tensor(tensor);
    h.set_slice(s.index);
    h.dtype = static_cast<uint8_t>(DType::kFloat32);
    return h;
  }

  Status CheckTensor(TensorId tensor) const {
    DSYNC_RETURN_IF_ERROR(broken_);
    if (tensor >= tensors_.size()) {
      return Error(StatusCode::kNotFound, "tensor {} is not registered ({} tensors are)", tensor,
                   tensors_.size());
    }
    return Status::Ok();
  }

  Status CheckPush(TensorId tensor) const {
    DSYNC_RETURN_IF_ERROR(CheckTensor(tensor));
    if (job_.observer) {
      return Error(StatusCode::kPermissionDenied,
                   "observer {} is read-only: it cannot push tensor {}", job_.worker_id, tensor);
    }
    if (tensors_[tensor].pushed_clock == clock_) {
      return Error(StatusCode::kFailedPrecondition,
                   "tensor {} ('{}') was already pushed in clock {}", tensor,
                   tensors_[tensor].name, clock_);
    }
    return Status::Ok();
  }

  Handle PushLocked(TensorId tensor, const float* grad, bool detached) {
    trace::Scoped range(trace::Range::kWorkerPush);
    const uint32_t op = NewOp(OpKind::kPush, tensor);
    ops_[op].clock = clock_;
    Status st = CheckPush(tensor);
    if (!st.ok()) {
      FinishOp(op, st);
      return HandleOf(op);
    }
    ops_[op].detached = detached;
    Tensor& t = tensors_[tensor];
    ClockState& cs = CurrentClockState();
    // What the commit will claim, kept in ascending tensor order (CommitProof).
    const CommittedTensor claim{tensor, static_cast<uint32_t>(t.layout.slices.size()),
                                t.layout.slices.front().server};
    auto& claims = cs.proof.tensors;
    claims.insert(std::upper_bound(claims.begin(), claims.end(), claim,
                                   [](const CommittedTensor& a, const CommittedTensor& b) {
                                     return a.tensor < b.tensor;
                                   }),
                  claim);
    for (const SliceRef& s : t.layout.slices) {
      FrameHeader h = SliceHeader(MsgType::kPush, op, tensor, s);
      h.set_clock(clock_);
      h.set_base(cs.base);
      for (uint32_t j = 0; j < replicas_; ++j) {  // every live copy stages it
        const uint32_t rank = ReplicaRank(s.server, j, job_.num_servers);
        // A server that took a lost rank over gets the clocks from the one this worker told
        // the scheduler on (TakeoverLoop).
        if (server_lost_[rank] || clock_ < push_from_[rank]) continue;
        ++ops_[op].outstanding;
        ++cs.acks_outstanding;
        ++cs.acks_at[rank];
        st = SendPayload(servers_[rank], h, {}, grad + s.offset, s.elements * sizeof(float));
        if (!st.ok() && !ToleratedSendFailure(rank, st)) {
          Break(st.WithContext(fmt::format("push tensor {}", tensor)));
          return HandleOf(op);
        }
      }
    }
    if (job_.staleness.damp && job_.sync != SyncMode::Bsp()) {
      // The gradient's size, which the scheduler watches to damp the job (GrowthWatch; bsp
      // has no stale gradient to damp).
      for (const SliceRef& s : t.layout.slices) {
        cs.size_squares += SumOfSquares(std::span(grad + s.offset, s.elements));
        cs.size_elements += s.elements;
      }
    }
    t.pushed_clock = clock_;
    if (++pushed_count_ == tensors_.size()) CompleteClock();
    return HandleOf(op);
  }

  Handle PullLocked(TensorId tensor, float* out, Clock clock) {
    const uint32_t op = NewOp(OpKind::kPull, tensor);
    Op& o = ops_[op];
    o.clock = clock;
    o.out = out;
    o.version = std::numeric_limits<Version>::max();
    o.trace = trace::Start(trace::Range::kWorkerPull);
    Status st = CheckTensor(tensor);
    if (!st.ok()) {
      FinishOp(op, st);
      return HandleOf(op);
    }
    o.outstanding = static_cast<uint32_t>(tensors_[tensor].layout.slices.size());
    if (clock == kNever || gate_clock_ >= clock) {  // kNever: no clock's (Register's read-back)
      SendPulls(op);
    } else {
      deferred_pulls_.push_back(op);  // waits for the gate of its clock
    }
    return HandleOf(op);
  }

  void SendPulls(uint32_t op) {
    Op& o = ops_[op];
    o.sent = true;
    o.min_version = gate_;
    o.asked.assign(tensors_[o.tensor].layout.slices.size(), kNoRank);
    for (const SliceRef& s : tensors_[o.tensor].layout.slices) {
      if (!SendPull(op, s)) return;
    }
  }

  // The rank of the first live copy of slice `s` (its primary now), if any is left. A server
  // taking a lost rank over serves once it holds its copies: a pull it held meanwhile would
  // hold the clocks whose rounds decide when it gets them.
  std::optional<uint32_t> PrimaryOf(const SliceRef& s) const {
    for (uint32_t j = 0; j < replicas_; ++j) {
      const uint32_t r = ReplicaRank(s.server, j, job_.num_servers);
      if (!server_lost_[r] && serving_[r]) return r;
    }
    return std::nullopt;
  }

  // Asks the first live copy of slice `s` for the pull `op`; false once the worker broke.
  bool SendPull(uint32_t op, const SliceRef& s) {
    Op& o = ops_[op];
    const std::optional<uint32_t> rank = PrimaryOf(s);
    if (!rank) {
      Break(Error(StatusCode::kUnavailable, "every copy of tensor {} slice {} is lost", o.tensor,
                  s.index));
      return false;
    }
    o.asked[s.index] = *rank;
    FrameHeader h = SliceHeader(MsgType::kPull, op, o.tensor, s);
    // The server answers once the slice has at least this version: the gate, and never older
    // than what this worker read of it already (another copy may trail the one read before).
    h.set_min_version(std::max(o.min_version, tensors_[o.tensor].slice_version[s.index]));
    Status st = SendControl(*transport_, servers_[*rank], h);
    if (!st.ok() && !ToleratedSendFailure(*rank, st)) {
      Break(st.WithContext(fmt::format("pull tensor {}", o.tensor)));
      return false;
    }
    return true;
  }

  // A server's peer for messages: its id, or what it is while a takeover connects to it.
  std::string PeerName(PeerId peer) const {
    auto it = server_ids_.find(peer);
    if (it != server_ids_.end()) return fmt::format("server {}", it->second);
    if (peer == handshake_peer_) return "the new server of a lost rank";
    return fmt::format("the replaced server at {}", transport_->PeerAddress(peer));
  }

  uint32_t RankOf(PeerId peer) const {
    auto it = server_ids_.find(peer);
    return it == server_ids_.end() ? kNoRank : ServerRank(it->second);
  }

  bool IsLost(PeerId peer) const {
    const uint32_t rank = RankOf(peer);
    return rank != kNoRank && server_lost_[rank];
  }

  // A frame that cannot go to a server whose slices have other copies: its loss, which the
  // scheduler announces, releases what is owed (OnServerLost). With one copy it is fatal.
  bool ToleratedSendFailure(uint32_t rank, const Status& why) {
    if (replicas_ <= 1) return false;
    CutFromServer(rank, why);
    return true;
  }

  void CutFromServer(uint32_t rank, const Status& why) {
    if (rank == kNoRank || server_lost_[rank] || server_cut_[rank]) return;
    server_cut_[rank] = SteadyClock::now();
    spdlog::warn("worker {}: lost the connection to server {} ({}); waiting up to {} ms for the "
                 "scheduler to confirm its loss, its slices' other copies then serve",
                 job_.worker_id, kFirstServerId + rank, why.message(), cfg_.connect_timeout_ms);
  }

  // Records the scheduler's word that `server` is lost (the `losses`-th loss); false for news
  // already known or a rank that is not the job's.
  bool MarkLost(NodeId server, uint32_t losses) {
    const uint32_t rank = ServerRank(server);
    if (rank >= server_lost_.size() || losses <= losses_) return false;
    losses_ = losses;
    ++rank_losses_[rank];  // a takeover of it announced before is void
    if (server_lost_[rank]) return false;
    server_lost_[rank] = true;
    return true;
  }

  // The scheduler lost a server: what it owed is given up, its share of every commit's
  // receipts taken out, and pulls it was asked go to the next copy of each slice.
  void OnServerLost(NodeId server, uint32_t losses) {
    if (!MarkLost(server, losses)) return;
    const uint32_t rank = ServerRank(server);
    spdlog::warn("worker {}: server {} was lost; its slices' other copies serve from now on",
                 job_.worker_id, server);
    if (rank < servers_.size() && servers_[rank] != kNoPeer) transport_->Close(servers_[rank]);
    for (ClockState& cs : clocks_) {
      cs.acks_outstanding -= std::min(cs.acks_outstanding, cs.acks_at[rank]);
      cs.acks_at[rank] = 0;
      cs.receipts_at[rank] = kZeroTag;
    }
    for (uint32_t i = 0; i < ops_.size() && broken_.ok(); ++i) {
      Op& o = ops_[i];
      if (!o.in_use || o.done) continue;
      if (o.kind == OpKind::kInit && rank < o.at_server.size() && o.at_server[rank] > 0) {
        o.outstanding -= std::min(o.outstanding, o.at_server[rank]);
        o.at_server[rank] = 0;
        if (o.outstanding == 0) FinishOp(i, Status::Ok());
      } else if (o.kind == OpKind::kPull && o.sent) {
        for (const SliceRef& s : tensors_[o.tensor].layout.slices) {
          if (o.asked[s.index] == rank && !SendPull(i, s)) break;
        }
      }
    }
    TryCommit();
  }

  // A new server took a lost rank's place: this worker connects to it (TakeoverLoop), in
  // the order such news came. Observers read from the other copies and never connect.
  // The scheduler's news of the job's servers, in the order it sent them.
  void ServerNews(const FrameHeader& h, std::span<const std::byte> meta) {
    const NodeId id = h.gone_server();
    if (id < kFirstServerId || ServerRank(id) >= server_lost_.size()) {
      Break(Error(StatusCode::kProtocol, "the scheduler named server {}, which is not one of the "
                                         "job's {}",
                  id, server_lost_.size()));
      return;
    }
    switch (h.msg_type()) {
      case MsgType::kServerGone:
        OnServerLost(id, h.losses());
        return;
      case MsgType::kServerBack:
        OnServerBack(h, meta);
        return;
      default:
        serving_[ServerRank(id)] = true;  // kServerServes
    }
  }

  void OnServerBack(const FrameHeader& h, std::span<const std::byte> meta) {
    if (stop_ || leaving_) return;
    Result<ServerAddress> address = DecodeServerAddress(meta);
    if (!address.ok() || address->id != h.gone_server()) {
      Break(Error(StatusCode::kProtocol, "the scheduler's news of a new server is unreadable{}",
                  address.ok() ? "" : ": " + address.status().message()));
      return;
    }
    const uint32_t rank = ServerRank(address->id);
    serving_[rank] = false;  // until it holds its copies (kServerServes)
    takeovers_.push_back({h.backs(), std::move(address).value(), rank_losses_[rank]});
    if (takeover_running_) return;
    if (takeover_thread_.joinable()) takeover_thread_.join();  // the previous one, done
    takeover_running_ = true;
    takeover_thread_ = std::thread([this] { TakeoverLoop(); });
  }

  void TakeoverLoop() {
    std::unique_lock lock(mu_);
    const auto quit = [&] { return stop_ || leaving_ || !broken_.ok(); };
    while (true) {
      cv_.wait(lock, [&] { return quit() || servers_connected_; });
      if (quit() || takeovers_.empty()) break;
      TakeoverNews news = std::move(takeovers_.front());
      takeovers_.pop_front();
      const ServerAddress& a = news.address;
      const uint32_t rank = ServerRank(a.id);
      if (rank_losses_[rank] != news.rank_losses) continue;  // lost again since: not tried
      lock.unlock();
      // It listened before it registered: a refused connection means it is gone already.
      Result<PeerId> peer =
          transport_->Connect(a.host, a.port, std::min(cfg_.connect_timeout_ms, kRejoinAttemptMs));
      Status st = peer.status();
      if (st.ok()) {
        Hello hello;
        hello.role = Role::kWorker;
        hello.token = cfg_.token;
        hello.node = job_.worker_id;
        hello.observer = job_.observer;
        hello.credential = credential_;
        Result<std::string> proof =
            Handshake(*peer, hello, fmt::format("server {}", a.id), /*stoppable=*/true);
        st = proof.status();
        if (st.ok() && (proof->size() != a.proof.size() ||
                        std::memcmp(proof->data(), a.proof.data(), a.proof.size()) != 0)) {
          st = Error(StatusCode::kPermissionDenied,
                     "{}:{} is not server {} of this job (its proof does not match what the "
                     "scheduler said)",
                     a.host, a.port, a.id);
        }
      }
      lock.lock();
      // Registrations read the set of live copies while they wait: take the server in
      // between two of them.
      cv_.wait(lock, [&] { return quit() || !registering_; });
      const bool void_now = rank_losses_[rank] != news.rank_losses || quit();
      if (!st.ok() || void_now) {
        if (peer.ok()) transport_->Close(*peer);
        if (!void_now) {
          spdlog::warn("{} {}: cannot reach server {}, which takes a lost rank's place: {}",
                       job_.observer ? "observer" : "worker", job_.worker_id, a.id, st.message());
        }
        if (!void_now && !job_.observer) {
          FrameHeader ack = MakeHeader(MsgType::kServerBackAck, job_.worker_id);
          ack.set_backs(news.backs);
          ack.status = static_cast<uint16_t>(st.code());
          (void)transport_->Send(scheduler_, ack, AsBytes(st.message()), nullptr, 0);
        }
        continue;
      }
      if (servers_[rank] != kNoPeer) {
        retired_peers_.insert(servers_[rank]);
        server_ids_.erase(servers_[rank]);
      }
      servers_[rank] = *peer;
      server_ids_[*peer] = a.id;
      server_lost_[rank] = false;
      server_cut_[rank] = std::nullopt;
      // The clock in progress keeps the copies it started with; the next ones go there too.
      const Clock from = !clocks_.empty() && clocks_.back().clock == clock_ ? clock_ + 1 : clock_;
      push_from_[rank] = from;
      if (job_.observer) {  // reads only: it pulls from it once it holds its copies
        spdlog::info("observer {}: server {} took the place of the lost server of rank {}",
                     job_.worker_id, a.id, rank);
        continue;
      }
      SendLayouts(rank);
      FrameHeader ack = MakeHeader(MsgType::kServerBackAck, job_.worker_id);
      ack.set_backs(news.backs);
      ack.set_next_clock(from);
      if (Status sent = SendControl(*transport_, scheduler_, ack); !sent.ok()) Break(sent);
      spdlog::info("worker {}: server {} took the place of the lost server of rank {}; this "
                   "worker pushes to it from clock {}",
                   job_.worker_id, a.id, rank, from);
    }
    takeover_running_ = false;
  }

  // The slices the server of `rank` holds, without values: it creates them, and the other
  // servers' copies fill them.
  void SendLayouts(uint32_t rank) {
    std::vector<std::byte> meta;
    for (uint32_t id = 0; id < tensors_.size(); ++id) {
      const Tensor& t = tensors_[id];
      for (const SliceRef& s : t.layout.slices) {
        for (uint32_t j = 0; j < replicas_; ++j) {
          if (ReplicaRank(s.server, j, job_.num_servers) != rank) continue;
          EncodeInit({t.name, t.layout.elements, s.offset, t.options.optimizer, t.options.shape},
                     meta);
          FrameHeader h = MakeHeader(MsgType::kInit, job_.worker_id);
          h.set_tensor(id);
          h.set_slice(s.index);
          h.set_replica(j);
          h.dtype = static_cast<uint8_t>(DType::kFloat32);
          h.flags = kFlagLayout;
          (void)transport_->Send(servers_[rank], h, meta, nullptr, 0);  // answered, not awaited
        }
      }
    }
  }

  ClockState& CurrentClockState() {
    if (clocks_.empty() || clocks_.back().clock != clock_) {
      ClockState cs;
      cs.clock = clock_;
      cs.base = base_;  // what the gradient was computed on: the pulls done before pushing
      cs.proof.tensors = std::move(spare_claims_);  // capacity from a committed clock
      cs.proof.tensors.clear();
      cs.acks_at = std::move(spare_acks_);
      cs.acks_at.assign(job_.num_servers, 0);
      cs.receipts_at = std::move(spare_receipts_);
      cs.receipts_at.assign(job_.num_servers, kZeroTag);
      clocks_.push_back(std::move(cs));
    }
    return clocks_.back();
  }

  // The current clock's gradient is whole: advance, and commit once the servers have it.
  void CompleteClock() {
    CurrentClockState().complete = true;
    ++clock_;
    pushed_count_ = 0;
    pulled_count_ = 0;
    TryCommit();
  }

  // Commits go out one at a time, in clock order, each once all its slices are acknowledged.
  void TryCommit() {
    if (clocks_.empty() || !broken_.ok() || away_) return;
    ClockState& cs = clocks_.front();
    if (cs.commit_sent || !cs.complete || cs.acks_outstanding > 0) return;
    const bool empty = cs.proof.tensors.empty();
    if (!empty && gate_clock_ >= cs.clock && cs.base < gate_) {
      Break(Error(StatusCode::kFailedPrecondition,
                  "the gradient of clock {} was computed on version {}, but the delay bound "
                  "needs version >= {}: pull every tensor after the previous push completes",
                  cs.clock, cs.base, gate_));
      return;
    }
    FrameHeader h = MakeHeader(MsgType::kCommit, job_.worker_id);
    h.set_clock(cs.clock);
    h.set_base(cs.base);
    h.set_losses(losses_);
    h.flags = empty ? kFlagEmpty : 0;
    cs.proof.receipts = kZeroTag;
    for (uint32_t r = 0; r < cs.receipts_at.size(); ++r) {
      if (!server_lost_[r]) XorInto(cs.proof.receipts, cs.receipts_at[r]);
    }
    cs.proof.size = cs.size_elements == 0
                        ? CommitProof::kSizeNotMeasured
                        : static_cast<float>(std::sqrt(cs.size_squares /
                                                       static_cast<double>(cs.size_elements)));
    EncodeCommit(cs.proof, commit_meta_);
    Status st = transport_->Send(scheduler_, h, commit_meta_, nullptr, 0);
    if (!st.ok()) {
      // The scheduler's connection is ending: with a journal, it may be restarted, and the
      // commit goes again once this worker is back with it (OnDisconnected starts that).
      if (reconnect_grace_ms_ == 0) Break(st.WithContext("commit"));
      return;
    }
    cs.commit_sent = true;
  }

  void OnSliceAck(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
    const uint32_t op = OpOf(h.request);
    if (op == kNoOp) return;
    Op& o = ops_[op];
    const uint32_t rank = RankOf(peer);
    if (rank == kNoRank) return;
    if (o.kind == OpKind::kInit) {
      if (o.done || rank >= o.at_server.size() || o.at_server[rank] == 0) return;
      --o.at_server[rank];
      o.version = std::min(o.version, h.slice_version());
      if (h.tensor() < tensors_.size() &&
          h.slice() < tensors_[h.tensor()].slice_version.size()) {
        // The slice's version now; our own init values are that version only if we created it.
        tensors_[h.tensor()].slice_version[h.slice()] = 0;
      }
      if (--o.outstanding == 0) FinishOp(op, Status::Ok());
      return;
    }
    if (o.kind != OpKind::kPush) return;
    for (ClockState& cs : clocks_) {
      if (cs.clock != o.clock || cs.acks_at[rank] == 0) continue;
      --cs.acks_at[rank];
      --cs.acks_outstanding;
      // The server staged every slice of the tensor it holds: its receipt, for the commit.
      if (meta.size() == kZeroTag.size()) {
        Tag receipt;
        std::memcpy(receipt.data(), meta.data(), receipt.size());
        XorInto(cs.receipts_at[rank], receipt);
      }
    }
    if (o.outstanding > 0) --o.outstanding;
    // A push completes with its clock's commit (OnCommitAck), not here.
    TryCommit();
  }

  void OnCommitAck(const FrameHeader& h) {
    if (clocks_.empty() || !clocks_.front().commit_sent) {
      spdlog::warn("worker {}: commit acknowledgement without a commit", job_.worker_id);
      return;
    }
    ClockState cs = std::move(clocks_.front());
    clocks_.erase(clocks_.begin());
    spare_claims_ = std::move(cs.proof.tensors);
    spare_acks_ = std::move(cs.acks_at);
    spare_receipts_ = std::move(cs.receipts_at);
    if (h.flags & kFlagStop) stop_requested_ = true;
    for (uint32_t i = 0; i < ops_.size(); ++i) {
      Op& o = ops_[i];
      if (o.in_use && !o.done && o.kind == OpKind::kPush && o.clock == cs.clock) {
        FinishOp(i, Status::Ok());
      }
    }
    if (cs.advance_op != kNoOp) FinishOp(cs.advance_op, Status::Ok());
    if (h.min_version() != kNoGate) OpenGate(cs.clock + 1, h.min_version());
    TryCommit();
  }

  void OpenGate(Clock clock, Version min_version) {
    if (clock < gate_clock_) return;
    gate_clock_ = clock;
    gate_ = std::max(gate_, min_version);
    for (size_t i = 0; i < deferred_pulls_.size();) {
      const uint32_t op = deferred_pulls_[i];
      if (ops_[op].clock <= gate_clock_) {
        deferred_pulls_[i] = deferred_pulls_.back();
        deferred_pulls_.pop_back();
        if (!ops_[op].done) SendPulls(op);
      } else {
        ++i;
      }
    }
  }

  void OnPullReply(const FrameHeader& h, void* payload) {
    const uint32_t op = OpOf(h.request);
    if (op == kNoOp || payload == nullptr) return;
    Op& o = ops_[op];
    if (o.receiving > 0) --o.receiving;
    if (o.done) return;  // failed meanwhile (Break); the waiter only needed receiving == 0
    o.asked[h.slice()] = kNoRank;  // read (OnHeader checked the slice and who answered)
    Tensor& t = tensors_[o.tensor];
    const Version v = h.slice_version();
    if (v < t.slice_version[h.slice()]) {
      // Freshness (invariant 3) says this cannot happen; make it loud if it does.
      spdlog::error("worker {}: tensor {} slice {} went back from version {} to {}",
                    job_.worker_id, o.tensor, h.slice(), t.slice_version[h.slice()], v);
    }
    t.slice_version[h.slice()] = std::max(t.slice_version[h.slice()], v);
    o.version = std::min(o.version, v);
    if (--o.outstanding > 0) return;
    t.version = *std::min_element(t.slice_version.begin(), t.slice_version.end());
    RecomputeBase();
    if (o.clock == clock_ && t.pulled_clock != clock_) {
      t.pulled_clock = clock_;
      // Every tensor pulled: tell the scheduler what this clock's gradient is computed on,
      // so rounds need not wait for this worker more than the bound requires.
      if (++pulled_count_ == tensors_.size() && !job_.observer) {
        FrameHeader b = MakeHeader(MsgType::kBegin, job_.worker_id);
        b.set_clock(clock_);
        b.set_base(base_);
        (void)SendControl(*transport_, scheduler_, b);
      }
    }
    FinishOp(op, Status::Ok());
  }

  void OnError(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
    Status st = ErrorFromFrame(h, meta);
    const MsgType about = h.refused();
    spdlog::warn("worker {}: {} refused by {}: {}", job_.worker_id, MsgTypeName(about),
                 peer == scheduler_ ? std::string("the scheduler")
                                    : PeerName(peer),
                 st.ToString());
    if (about == MsgType::kHello && peer != scheduler_ && peer == handshake_peer_ &&
        servers_connected_) {
      // A server taking a lost rank over refused this worker: the takeover fails, the worker
      // goes on without it (TakeoverLoop tells the scheduler).
      handshake_error_ = st;
      handshake_done_ = true;
      return;
    }
    if (about == MsgType::kHello) {
      Break(st);
      return;
    }
    if (about == MsgType::kShutdown && peer == scheduler_) {  // the job ended without it
      Break(st.WithContext("the scheduler ended the job"));
      return;
    }
    if (about == MsgType::kSetLearningRate) {
      if (lr_request_ && h.request == *lr_request_) lr_answer_ = Result<Round>(st);
      return;
    }
    if (about == MsgType::kPush || about == MsgType::kCommit || about == MsgType::kBegin) {
      // The clock sequence cannot continue past a refused gradient.
      Break(st);
      return;
    }
    const uint32_t op = OpOf(h.request);
    if (op != kNoOp) FinishOp(op, st);
  }

  // A failure the worker cannot continue past: every pending operation fails with it.
  void Break(const Status& st) {
    if (!broken_.ok()) return;
    broken_ = st;
    spdlog::error("worker {}: {}", job_.worker_id, st.message());
    for (uint32_t i = 0; i < ops_.size(); ++i) {
      if (ops_[i].in_use && !ops_[i].done) FinishOp(i, st);
    }
    deferred_pulls_.clear();
    clocks_.clear();
    cv_.notify_all();
  }

  void RecomputeBase() {
    Version b = std::numeric_limits<Version>::max();
    for (const Tensor& t : tensors_) b = std::min(b, t.version);
    base_ = tensors_.empty() ? 0 : b;
  }

  void Heartbeat(uint32_t interval_ms) {
    std::unique_lock lock(mu_);
    while (!heartbeat_cv_.wait_for(lock, std::chrono::milliseconds(interval_ms),
                                   [&] { return stop_ || leaving_; })) {
      (void)SendControl(*transport_, scheduler_, MakeHeader(MsgType::kHeartbeat, job_.worker_id));
      const auto limit = std::chrono::milliseconds(cfg_.connect_timeout_ms);
      for (uint32_t r = 0; r < server_cut_.size() && broken_.ok(); ++r) {
        if (server_cut_[r] && !server_lost_[r] && SteadyClock::now() - *server_cut_[r] > limit) {
          // The scheduler still counts it: the network between this worker and it failed.
          Break(Error(StatusCode::kUnavailable,
                      "lost the connection to server {} and the scheduler did not report it "
                      "lost within {} ms: the network between this worker and it is cut",
                      kFirstServerId + r, cfg_.connect_timeout_ms));
        }
      }
    }
  }

  void StopThreads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      cv_.notify_all();
      heartbeat_cv_.notify_all();
    }
    if (heartbeat_.joinable()) heartbeat_.join();
    if (rejoin_thread_.joinable()) rejoin_thread_.join();
    if (takeover_thread_.joinable()) takeover_thread_.join();
    transport_->Shutdown();
  }

  Config cfg_;
  std::unique_ptr<Transport> transport_;
  JobInfo job_;
  std::optional<SlicePlanner> planner_;
  std::atomic<PeerId> scheduler_{kNoPeer};
  // A lost scheduler of a journaled job (Welcome::reconnect_grace_ms): while away_, commits
  // wait; the rejoin thread reaches the restarted scheduler (rejoin_).
  uint32_t reconnect_grace_ms_ = 0;
  Tag credential_{};
  bool away_ = false;
  RejoinState rejoin_;
  std::thread rejoin_thread_;
  std::vector<PeerId> servers_;  // by rank
  std::unordered_map<PeerId, NodeId> server_ids_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable heartbeat_cv_;  // its own: cv_ wakes on every frame
  Status broken_;
  bool registering_ = false;  // a Register is waiting for the servers' answers
  bool handshake_done_ = false;
  std::string handshake_reply_;
  PeerId handshake_peer_ = kNoPeer;  // the peer the handshake under way is with
  Status handshake_error_;           // that peer refused the hello
  SteadyClock::time_point handshake_heard_;  // the peer's last word during the handshake
  std::string pending_why_;                  // what the scheduler said admission waits for
  uint32_t payload_sends_ = 0;               // sends still reading the caller's memory
  uint32_t payload_waiters_ = 0;             // Wait() calls waiting for them to end
  std::vector<std::byte> commit_meta_;       // reused for every commit
  std::vector<CommittedTensor> spare_claims_;  // reused by the next clock
  std::vector<uint32_t> spare_acks_;           // likewise
  std::vector<Tag> spare_receipts_;
  uint32_t replicas_ = 1;                     // copies of every slice
  std::vector<bool> server_lost_;             // by rank: the scheduler said it is lost
  // By rank: when this worker's connection to the server ended before the scheduler said it
  // was lost (a server that dies is lost for the scheduler too; this bounds the wait).
  std::vector<std::optional<SteadyClock::time_point>> server_cut_;
  uint32_t losses_ = 0;                       // servers lost so far, as the scheduler counts
  std::vector<uint32_t> rank_losses_;         // by rank: losses of it heard of
  // Servers that took a lost rank's place (kServerBack), connected to by takeover_thread_ in
  // order; by rank, the first clock pushed to the server there (a new one: from the clock
  // this worker told the scheduler); the connections of the servers they replaced.
  struct TakeoverNews {
    uint32_t backs = 0;
    ServerAddress address;
    uint32_t rank_losses = 0;  // rank_losses_ when announced: a later loss voids it
  };
  std::deque<TakeoverNews> takeovers_;
  std::thread takeover_thread_;
  bool takeover_running_ = false;
  bool servers_connected_ = false;  // Init connected to the servers of its welcome
  std::vector<Clock> push_from_;
  std::vector<bool> serving_;  // by rank: pulls may go there (false: taking over, no copies)
  std::unordered_set<PeerId> retired_peers_;
  // News of the servers (kServerGone, kServerBack, kServerServes) before the welcome was read.
  std::vector<std::pair<FrameHeader, std::string>> early_news_;
  bool leaving_ = false;
  bool left_ = false;
  // SetLearningRate: the request waiting for the scheduler's answer, and the answer.
  uint64_t lr_requests_ = 0;
  std::optional<uint64_t> lr_request_;
  std::optional<Result<Round>> lr_answer_;
  bool stop_ = false;

  std::vector<Tensor> tensors_;
  std::vector<Op> ops_;
  std::vector<uint32_t> free_ops_;
  std::vector<uint32_t> deferred_pulls_;
  std::vector<ClockState> clocks_;  // oldest first; rarely more than two
  Clock clock_ = 0;
  bool stop_requested_ = false;
  std::optional<Version> final_version_;  // observers: training ended at this version
  Clock gate_clock_ = 0;   // pulls at clocks up to this one may go out...
  Version gate_ = 0;       // ...asking for at least this version
  Version base_ = 0;
  uint32_t pushed_count_ = 0;
  uint32_t pulled_count_ = 0;
  std::thread heartbeat_;
};

}  // namespace

Result<std::unique_ptr<Worker>> StartWorker(const Config& config,
                                            std::unique_ptr<Transport> transport) {
  auto node = std::make_unique<WorkerNode>(config, std::move(transport));
  DSYNC_RETURN_IF_ERROR(node->Init());
  if (!config.observer) TellLauncher(std::to_string(node->job().worker_id));
  return std::unique_ptr<Worker>(std::move(node));
}

}  // namespace ps

}  // namespace dsync
