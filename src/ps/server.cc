// The server node. Pushed slices are staged per (worker, clock) in pooled buffers the
// transport reads straight into; nothing is applied until the scheduler names the round's
// members, so a partial push (a worker that died between slices) is applied on no slice
// and a committed one is applied on every slice alike (invariant 5, docs/contract.md).
//
// Trust: a client connects with the credential the scheduler gave it; the server answers
// with its own proof. When a push completes a tensor here, its acknowledgement carries a
// receipt the worker relays in its commit, so the scheduler only places gradients the
// servers hold; a round naming a slice this server never staged stops the job. Each
// worker's staging is capped by its delay bound (StagingLedger).
//
// Threads: the transport's reader threads validate and stage pushes, answer pulls; one
// apply thread applies rounds in order; one thread heartbeats to the scheduler. A slice's
// mutex orders staging, reading and applying of that slice.
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

namespace dsync {
namespace ps {
namespace {

class ServerNode final : public Server, public TransportHandler {
 public:
  ServerNode(const Config& config, std::unique_ptr<Transport> transport,
             std::unique_ptr<ParamStore> store)
      : cfg_(config), store_(std::move(store)), transport_(std::move(transport)),
        pool_(store_.get(), transport_.get()),
        device_pool_(store_.get(), transport_.get(), BufferPool::Memory::kDevice) {}

  ~ServerNode() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    transport_->Shutdown();
    if (apply_thread_.joinable()) apply_thread_.join();
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    if (rejoin_thread_.joinable()) rejoin_thread_.join();
    ReleaseAllStaged();
  }

  Status Init() {
    transport_->SetHandler(this);
    DSYNC_RETURN_IF_ERROR(SetUpDeviceMemory());
    DSYNC_ASSIGN_OR_RETURN(const std::string listen_host, ResolveListenHost(cfg_.bind_host));
    DSYNC_ASSIGN_OR_RETURN(advertised_, AdvertisedHost(listen_host, cfg_.advertise_host,
                                                       cfg_.scheduler_host, cfg_.scheduler_port));
    DSYNC_ASSIGN_OR_RETURN(port_, transport_->Listen(listen_host, cfg_.port));
    DSYNC_ASSIGN_OR_RETURN(scheduler_, transport_->Connect(cfg_.scheduler_host,
                                                           cfg_.scheduler_port,
                                                           cfg_.connect_timeout_ms));
    Hello hello;
    hello.role = Role::kServer;
    hello.token = cfg_.token;
    hello.host = advertised_;
    hello.port = port_;
    DSYNC_RETURN_IF_ERROR(transport_->Send(scheduler_, MakeHeader(MsgType::kHello, 0),
                                           AsBytes(EncodeHello(hello)), nullptr, 0));
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::milliseconds(cfg_.connect_timeout_ms),
                      [&] { return welcomed_ || !result_.ok(); })) {
      return Error(StatusCode::kDeadlineExceeded,
                   "the scheduler at {}:{} did not answer the server's registration",
                   cfg_.scheduler_host, cfg_.scheduler_port);
    }
    if (!result_.ok()) return result_;
    apply_thread_ = std::thread([this] { ApplyLoop(); });
    heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
    spdlog::info("server {} listening on {}:{}{} (optimizer {}, lr {}, staleness policy {})",
                 id_.load(), listen_host, port_,
                 advertised_ == listen_host ? std::string()
                                            : fmt::format(", reached at {}:{}", advertised_, port_),
                 OptimizerName(job_.optimizer.kind), job_.optimizer.lr,
                 job_.staleness.ToString());
    return Status::Ok();
  }

  // Frames to the scheduler from a thread of its own, so that a busy apply thread or reader
  // never looks like a hung server; a stopped process stops them all, which is the point.
  void HeartbeatLoop() {
    const auto period = std::chrono::milliseconds(job_.heartbeat_interval_ms);
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, period, [&] { return stop_ || shutdown_; })) {
      (void)SendControl(*transport_, scheduler_, MakeHeader(MsgType::kHeartbeat, id_));
    }
  }

  // GPUDirect RDMA: with a store that has device memory and a transport that can reach it,
  // large payloads (pushed gradients, initial values, pull replies) go between the NIC and
  // GPU memory directly instead of through a pinned host buffer and a copy.
  Status SetUpDeviceMemory() {
    if (cfg_.gpudirect == GpuDirectMode::kOff) return Status::Ok();
    const DeviceMemory* memory = store_->device_memory();
    std::string why;
    if (!memory) {
      why = fmt::format("the {} store keeps parameters in host memory", store_->name());
    } else {
      Result<uint64_t> min_bytes = transport_->EnableDeviceMemory(memory);
      if (min_bytes.ok()) {
        device_memory_ = memory;
        direct_min_bytes_ = *min_bytes;
        device_direct_.store(true);
        spdlog::info("server: GPUDirect RDMA on: payloads of {} bytes or more go between the "
                     "NIC and GPU memory directly",
                     direct_min_bytes_);
        return Status::Ok();
      }
      why = min_bytes.status().message();
    }
    if (cfg_.gpudirect == GpuDirectMode::kOn) {
      return Error(StatusCode::kUnavailable,
                   "--gpudirect on, but GPUDirect RDMA is not possible here: {} (--gpudirect "
                   "auto stages payloads through pinned host memory instead)",
                   why);
    }
    if (memory) {
      spdlog::info("server: GPUDirect RDMA off ({}); payloads are staged through pinned host "
                   "memory",
                   why);
    }
    return Status::Ok();
  }

  // Payload buffers: GPU memory where GPUDirect RDMA is on and the payload is large enough,
  // host memory otherwise (also when the GPU's pool cannot grow).
  void* AcquireBuffer(size_t bytes) {
    if (device_direct_.load(std::memory_order_relaxed) && bytes >= direct_min_bytes_) {
      Status why;
      if (void* p = device_pool_.Acquire(bytes, &why)) return p;
      // The NIC may pass the start-up probe and still fail to map GPU memory (IOMMU, PCIe
      // topology): stop trying at once rather than pay a failed registration per message.
      if (!why.ok() && device_direct_.exchange(false)) {
        spdlog::warn("server {}: GPUDirect RDMA off from now on ({}); payloads are staged "
                     "through pinned host memory",
                     id_.load(), why.message());
      }
    }
    return pool_.Acquire(bytes);
  }
  void ReleaseBuffer(void* buffer, size_t bytes) {
    if (buffer && device_memory_ && device_memory_->Contains(buffer, bytes)) {
      device_pool_.Release(buffer, bytes);
    } else {
      pool_.Release(buffer, bytes);
    }
  }

  NodeId id() const override { return id_; }
  uint16_t port() const override { return port_; }

  Status Run() override {
    std::unique_lock lock(mu_);
    while (!shutdown_ && !stop_ && result_.ok()) {
      if (!draining_) {
        cv_.wait(lock);
      } else if (cv_.wait_until(lock, drain_deadline_) == std::cv_status::timeout) {
        spdlog::warn("server {}: the scheduler did not end the job within {} s of the stop; "
                     "stopping",
                     id_.load(), kStopCheckpointSeconds + kDrainMarginSeconds);
        break;
      }
    }
    if (!result_.ok() && error_sent_ && !shutdown_ && !stop_) {
      const bool answered = cv_.wait_for(lock, std::chrono::seconds(kErrorLingerSeconds), [&] {
        return shutdown_ || stop_ || scheduler_gone_ || !error_sent_;
      });
      if (!answered) {
        spdlog::warn("server {}: the scheduler did not end the job within {} s of this server's "
                     "error; stopping",
                     id_.load(), kErrorLingerSeconds);
      }
    }
    Status result = result_;
    stop_ = true;
    cv_.notify_all();
    lock.unlock();
    transport_->Shutdown();
    if (apply_thread_.joinable()) apply_thread_.join();
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    if (rejoin_thread_.joinable()) rejoin_thread_.join();
    spdlog::info("server {} stopped after {} round(s)", id_.load(), stats_.rounds_applied.load());
    // An evicted server's copies are stale, and one that never got its copies holds none:
    // its summary would not be the job's model.
    if (result.ok() && awaiting_copies_.load()) {
      spdlog::warn("server {}: the job ended before this server held the copies of its rank",
                   id_.load());
    } else if (result.ok() && !evicted_ && !cfg_.dump_model.empty()) {
      result = DumpModel();
    }
    return result;
  }

  // In a job that writes checkpoints, the scheduler writes one when it is stopped: a server
  // asked to stop too (a signal to every task, as Slurm sends) keeps serving it until the
  // scheduler ends the job or goes, bounded.
  void Stop() override {
    std::lock_guard lock(mu_);
    // Asked again while draining (a second Ctrl-C): at once.
    if (welcomed_ && job_.checkpoints && !stop_ && !shutdown_ && !draining_) {
      draining_ = true;
      drain_deadline_ = std::chrono::steady_clock::now() +
                        std::chrono::seconds(kStopCheckpointSeconds + kDrainMarginSeconds);
      spdlog::warn("server {}: stopping once the scheduler has its checkpoint (at most {} s; "
                   "asked again, at once)",
                   id_.load(), kStopCheckpointSeconds + kDrainMarginSeconds);
      cv_.notify_all();
      return;
    }
    stop_ = true;
    cv_.notify_all();
  }

  ServerStats stats() const override {
    ServerStats s;
    s.rounds_applied = stats_.rounds_applied;
    s.gradients_applied = stats_.gradients_applied;
    s.pushes_received = stats_.pushes_received;
    s.pulls_answered = stats_.pulls_answered;
    s.requests_refused = stats_.requests_refused;
    s.connections_dropped = stats_.connections_dropped;
    s.staged_slices = stats_.staged_now;
    {
      std::shared_lock lock(slices_mu_);
      s.slices = slice_list_.size();
    }
    s.staging_buffers = pool_.created() + device_pool_.created();
    s.device_buffers = device_pool_.created();
    return s;
  }

  // --- TransportHandler ---------------------------------------------------------------

  void OnConnected(PeerId peer, bool inbound) override {
    if (inbound) clients_.Connected(peer);
  }

  void OnDisconnected(PeerId peer, const Status& why) override {
    if (peer == rejoin_.peer) {
      std::lock_guard lock(mu_);
      if (rejoin_.answer == RejoinState::Answer::kNone) rejoin_.answer = RejoinState::Answer::kCut;
      cv_.notify_all();
      return;
    }
    if (peer == scheduler_) {
      std::lock_guard lock(mu_);
      scheduler_gone_ = true;
      if (draining_) {
        stop_ = true;  // stopping anyway: the scheduler stopped first
      } else if (!shutdown_ && !stop_ && !evicted_ && result_.ok() && welcomed_ &&
                 job_.reconnect_grace_ms > 0) {
        // The job journals its scheduler: it may be restarted, and this server goes on
        // serving its clients meanwhile.
        spdlog::warn("server {}: lost the scheduler ({}); waiting up to {} s for it to be "
                     "restarted from its journal",
                     id_.load(), why.message(), job_.reconnect_grace_ms / 1000);
        if (rejoin_.Lost(why.message())) {
          if (rejoin_thread_.joinable()) rejoin_thread_.join();  // the previous one, done
          rejoin_thread_ = std::thread([this] { RejoinLoop(); });
        }
      } else if (!shutdown_ && !stop_ && !evicted_ && result_.ok()) {
        result_ = Error(StatusCode::kUnavailable, "lost the scheduler: {}", why.message());
        spdlog::error("server {}: {}", id_.load(), result_.message());
      }
      cv_.notify_all();
      return;
    }
    clients_.Disconnected(peer);
  }

  void* OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) override {
    if (peer == scheduler_ && h.msg_type() == MsgType::kCopy && h.payload_len > 0 &&
        awaiting_copies_.load()) {
      return new (std::nothrow) std::byte[h.payload_len];  // a copy: rare, and held briefly
    }
    if (peer == scheduler_ || peer == rejoin_.peer) return nullptr;
    Client* ps = clients_.Find(peer);
    if (!ps || ps->doomed) return nullptr;
    ps->verdict = Status::Ok();
    ps->init_exists = false;
    ps->drop_quietly = false;
    if (!ps->id) {
      if (h.msg_type() != MsgType::kHello) {
        ps->verdict = Error(StatusCode::kPermissionDenied, "the first frame must be a hello");
      }
      return nullptr;
    }
    switch (h.msg_type()) {
      case MsgType::kPush: {
        SliceState* s = nullptr;
        ps->verdict = CheckPushFrom(*ps, h, &s);
        if (ps->verdict.code() == StatusCode::kResourceExhausted && awaiting_copies_.load()) {
          // Over even the quota of a server taking a rank over: its copies' version is too far
          // off. The worker is honest; this server gives up instead of refusing it (the
          // scheduler goes on without it, and the worker stops waiting for this push then).
          ps->drop_quietly = true;
          std::lock_guard lock(mu_);
          FailTakeover(ps->verdict.WithContext("its staging quota ran out before its copies' "
                                               "version was decided"));
          return nullptr;
        }
        if (!ps->verdict.ok()) return nullptr;
        void* buf = AcquireBuffer(h.payload_len);
        if (!buf) ps->verdict = Error(StatusCode::kUnavailable, "server out of memory");
        return buf;
      }
      case MsgType::kInit: {
        ps->verdict = CheckInit(h, meta, ps->observer, &ps->init_exists);
        if (!ps->verdict.ok() || ps->init_exists || h.payload_len == 0) return nullptr;
        void* buf = AcquireBuffer(h.payload_len);
        if (!buf) ps->verdict = Error(StatusCode::kUnavailable, "server out of memory");
        return buf;
      }
      default:
        if (h.payload_len != 0) {
          ps->verdict = Error(StatusCode::kProtocol, "{} frames carry no payload",
                              MsgTypeName(h.msg_type()));
        }
        return nullptr;
    }
  }

  void OnPayloadLost(PeerId peer, const FrameHeader& h, void* payload) override {
    if (peer == scheduler_ && h.msg_type() == MsgType::kCopy) {
      delete[] static_cast<std::byte*>(payload);
      return;
    }
    ReleaseBuffer(payload, h.payload_len);  // a truncated push stages nothing
  }

  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override {
    if (peer == scheduler_) {
      if (h.msg_type() == MsgType::kCopy) {
        TakeCopies(h, static_cast<std::byte*>(payload));
        return;
      }
      HandleScheduler(h, meta);
      return;
    }
    if (peer == rejoin_.peer) {
      OnRejoinAnswer(peer, h, meta);
      return;
    }
    Client* ps = clients_.Find(peer);
    if (!ps || ps->doomed || ps->drop_quietly) {
      ReleaseBuffer(payload, h.payload_len);
      return;
    }
    if (!ps->verdict.ok()) {
      ReleaseBuffer(payload, h.payload_len);
      Refuse(peer, h, ps->verdict, /*drop=*/!ps->id || h.msg_type() == MsgType::kHello);
      return;
    }
    switch (h.msg_type()) {
      case MsgType::kHello: HandleHello(peer, h, meta); return;
      case MsgType::kPush: StagePush(peer, ps->id, h, payload); return;
      case MsgType::kPull: HandlePull(peer, h); return;
      case MsgType::kInit: HandleInit(peer, h, meta, payload, ps->init_exists); return;
      case MsgType::kHeartbeat: return;
      default:
        Refuse(peer, h,
               Error(StatusCode::kProtocol, "a worker may not send {} to a server",
                     MsgTypeName(h.msg_type())),
               true);
    }
  }

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
    // Not a round: write a checkpoint of version `round` (every round before it applied)
    // into this directory.
    std::string checkpoint_dir;
    // Not a round: send the copies the server of this rank's id holds of this server's
    // slices, at version `round`, where this server is the first live copy (`live`, by rank).
    std::optional<NodeId> copy_for;
    std::vector<bool> live;
    uint32_t takeover = 0;  // the takeover's number (kCopyOut's backs()), named in the copies
  };

  SliceState* FindSlice(uint32_t tensor, uint32_t slice) {
    std::shared_lock lock(slices_mu_);
    auto it = slices_.find(MakeSliceKey(tensor, slice));
    return it == slices_.end() ? nullptr : it->second.get();
  }

  void Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop) {
    ++stats_.requests_refused;
    spdlog::warn("server {}: refused {} from {}: {}", id_.load(), MsgTypeName(about.msg_type()),
                 transport_->PeerAddress(peer), error.message());
    if (drop) {
      ++stats_.connections_dropped;
      if (Client* ps = clients_.Find(peer)) ps->doomed = true;  // ignore it until it is gone
    }
    (void)SendError(*transport_, peer, id_, error, about, /*close_after=*/drop);
  }

  // A push or pull names a slice this server holds, with the right dtype and length.
  Status CheckData(const FrameHeader& h, SliceState** out) {
    SliceState* s = FindSlice(h.tensor(), h.slice());
    if (!s) {
      return Error(StatusCode::kNotFound,
                   "tensor {} slice {} is not on server {}; register the tensor first",
                   h.tensor(), h.slice(), id_.load());
    }
    if (h.msg_type() == MsgType::kPush) {
      if (h.dtype != static_cast<uint8_t>(DType::kFloat32)) {
        return Error(StatusCode::kInvalidArgument,
                     "push to tensor {} slice {}: dtype {} is not supported (the model is float32)",
                     h.tensor(), h.slice(), DTypeName(static_cast<DType>(h.dtype)));
      }
      if (h.payload_len != s->elements * sizeof(float)) {
        return Error(StatusCode::kInvalidArgument,
                     "push to tensor {} slice {}: {} bytes, expected {} ({} float32)", h.tensor(),
                     h.slice(), h.payload_len, s->elements * sizeof(float), s->elements);
      }
    }
    *out = s;
    return Status::Ok();
  }

  // Everything about a push that can be judged before its payload is read: nothing is
  // received, let alone staged, for a push that would be refused.
  Status CheckPushFrom(const Client& c, const FrameHeader& h, SliceState** s) {
    if (c.observer) {
      return Error(StatusCode::kPermissionDenied, "observer {} is read-only: it cannot push",
                   c.id);
    }
    DSYNC_RETURN_IF_ERROR(CheckData(h, s));
    DSYNC_RETURN_IF_ERROR(clients_.CheckNotGone(c.id, h.clock()));
    return ledger_.Admit(c.id, h.clock());
  }

  // Slices of the job's size: tensor elements per slice (SlicePlanner's rule).
  uint64_t SliceElements() const {
    return std::max<uint64_t>(1, job_.slice_bytes / sizeof(float));
  }

  // The elements a kInit creates: its values', or a layout init's (none sent) the slice's.
  uint64_t InitElements(const FrameHeader& h, const InitMeta& im) const {
    if (!(h.flags & kFlagLayout)) return h.payload_len / sizeof(float);
    return im.slice_offset < im.tensor_elements
               ? std::min(SliceElements(), im.tensor_elements - im.slice_offset)
               : 0;
  }

  // `observer`: an observer that names no optimizer reads the tensor whatever it runs.
  Status CheckInit(const FrameHeader& h, std::span<const std::byte> meta, bool observer,
                   bool* exists) {
    InitMeta im;
    DSYNC_RETURN_IF_ERROR(DecodeInit(meta, im));
    if (h.dtype != static_cast<uint8_t>(DType::kFloat32)) {
      return Error(StatusCode::kInvalidArgument, "tensor '{}': dtype {} is not supported (float32)",
                   im.name, DTypeName(static_cast<DType>(h.dtype)));
    }
    // A slice is exactly where the job's slice size puts it: then a tensor's slice count,
    // which receipts attest, is the same for every server and every worker.
    const uint64_t per = SliceElements();
    const bool layout = (h.flags & kFlagLayout) != 0;
    if (layout && (observer || !awaiting_copies_.load() || h.payload_len != 0)) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor '{}' slice {}: an init without values is only for a server taking a "
                   "lost one's place, from a worker, before its copies are in",
                   im.name, h.slice());
    }
    const uint64_t bytes = layout ? InitElements(h, im) * sizeof(float) : h.payload_len;
    if (bytes == 0 || bytes % sizeof(float) != 0 ||
        im.slice_offset + bytes / sizeof(float) > im.tensor_elements ||
        im.slice_offset != uint64_t{h.slice()} * per ||
        bytes / sizeof(float) != std::min(per, im.tensor_elements - im.slice_offset)) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor '{}' slice {}: {} bytes at element {} are not slice {} of a tensor "
                   "of {} elements cut into slices of {} elements",
                   im.name, h.slice(), bytes, im.slice_offset, h.slice(),
                   im.tensor_elements, per);
    }
    std::shared_lock lock(slices_mu_);
    if (auto t = tensors_.find(h.tensor()); t != tensors_.end()) {
      if (t->second.name == im.name && !t->second.shape.empty() && !im.shape.empty() &&
          t->second.shape != im.shape) {
        return Error(StatusCode::kInvalidArgument,
                     "tensor {} '{}' has shape {} on server {}, but this worker registers shape "
                     "{}: every worker must build the same model",
                     h.tensor(), im.name, ShapeText(t->second.shape), id_.load(),
                     ShapeText(im.shape));
      }
      if (t->second.name != im.name || t->second.elements != im.tensor_elements) {
        return Error(StatusCode::kInvalidArgument,
                     "tensor {} is '{}' ({} elements) on server {}, but this worker registers "
                     "'{}' ({} elements): every worker must register the same tensors in the "
                     "same order",
                     h.tensor(), t->second.name, t->second.elements, id_.load(), im.name,
                     im.tensor_elements);
      }
      const OptimizerConfig asked = im.optimizer.value_or(job_.optimizer);
      if (!(observer && !im.optimizer) && !SameBesidesLearningRate(asked, t->second.optimizer)) {
        return Error(StatusCode::kInvalidArgument,
                     "tensor {} '{}' runs {} on server {}, but this worker registers it with {}: "
                     "every worker must register a tensor with the same optimizer (only the "
                     "learning rate may differ)",
                     h.tensor(), im.name, DescribeOptimizer(t->second.optimizer), id_.load(),
                     DescribeOptimizer(asked));
      }
    }
    if (auto it = slices_.find(MakeSliceKey(h.tensor(), h.slice())); it != slices_.end()) {
      if (it->second->elements * sizeof(float) != bytes) {
        return Error(StatusCode::kInvalidArgument,
                     "tensor '{}' slice {} holds {} elements here, not {}: is the slice size the "
                     "same on every worker?",
                     im.name, h.slice(), it->second->elements, bytes / sizeof(float));
      }
      *exists = true;
    }
    return Status::Ok();
  }

  void HandleHello(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
    auto hello = AcceptHello(meta, cfg_.token);
    Result<Tag> proof = hello.ok() ? clients_.Admit(peer, *hello) : Result<Tag>(hello.status());
    if (!proof.ok()) {
      Refuse(peer, h, proof.status(), true);
      return;
    }
    transport_->Trust(peer);
    FrameHeader ack = MakeHeader(MsgType::kHelloAck, id_);
    ack.request = h.request;
    (void)transport_->Send(peer, ack, {reinterpret_cast<const std::byte*>(proof->data()),
                                       proof->size()},
                           nullptr, 0);
  }

  void HandleInit(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                  void* payload, bool exists) {
    InitMeta im;
    (void)DecodeInit(meta, im);  // validated in OnHeader
    SliceState* slice = nullptr;
    if (!exists) {
      const uint64_t per = SliceElements();
      const bool layout = (h.flags & kFlagLayout) != 0;
      const uint64_t n = InitElements(h, im);
      std::unique_lock lock(slices_mu_);
      const SliceKey key = MakeSliceKey(h.tensor(), h.slice());
      // Checked again under the lock that ends the wait for copies (FinishCopies).
      const bool awaiting = awaiting_copies_.load();
      Status st = layout && !awaiting
                      ? Error(StatusCode::kFailedPrecondition,
                              "tensor '{}' slice {}: the copies are in already; a layout init "
                              "came too late",
                              im.name, h.slice())
                      : Status::Ok();
      if (!st.ok()) {
        lock.unlock();
        Refuse(peer, h, st, false);
        return;
      }
      if (!slices_.contains(key)) {  // else another worker's init won the race
        st = ledger_.Place(h.tensor(),
                           static_cast<uint32_t>((im.tensor_elements + per - 1) / per),
                           h.slice(), h.replica());
        // A server taking a lost rank's place creates the slice in the store once the copies
        // are in (FinishCopies): from a copy, or from these values.
        if (st.ok() && !awaiting) {
          st = store_->InitSlice(key, {static_cast<const float*>(payload), n});
        }
        if (!st.ok()) {
          lock.unlock();
          if (payload) ReleaseBuffer(payload, h.payload_len);
          Refuse(peer, h, st, false);
          return;
        }
        auto s = std::make_unique<SliceState>();
        s->key = key;
        s->tensor = h.tensor();
        s->index = h.slice();
        s->replica = h.replica();
        s->elements = n;
        s->version = stats_.rounds_applied;  // it exists from the current model version on
        s->awaiting_copy = awaiting;
        s->layout_only = layout;
        if (awaiting && !layout) {
          s->init_values.assign(static_cast<const float*>(payload),
                                static_cast<const float*>(payload) + n);
        }
        // A tensor's slices here share the optimizer of its first registration.
        auto t = tensors_.try_emplace(h.tensor(),
                                      TensorMeta{im.name, im.tensor_elements,
                                                 im.optimizer.value_or(job_.optimizer),
                                                 im.shape});
        s->optimizer = t.first->second.optimizer;
        slice_list_.push_back(s.get());
        slices_.emplace(key, std::move(s));
      }
      lock.unlock();
      if (payload) ReleaseBuffer(payload, h.payload_len);
    }
    slice = FindSlice(h.tensor(), h.slice());
    FrameHeader ack = MakeHeader(MsgType::kInitAck, id_);
    ack.request = h.request;
    ack.set_tensor(h.tensor());
    ack.set_slice(h.slice());
    {
      std::lock_guard lock(slice->mu);
      ack.set_slice_version(slice->version);
    }
    (void)SendControl(*transport_, peer, ack);
  }

  void StagePush(PeerId peer, WorkerId worker, const FrameHeader& h, void* payload) {
    trace::Scoped range(trace::Range::kServerPush);
    SliceState* s = FindSlice(h.tensor(), h.slice());
    Status error;
    std::optional<Tag> receipt;
    {
      std::lock_guard lock(s->mu);
      error = clients_.CheckNotGone(worker, h.clock());
      for (const Staged& st : s->staged) {
        if (error.ok() && st.worker == worker && st.clock == h.clock()) {
          error = Error(StatusCode::kAlreadyExists,
                        "worker {} pushed tensor {} slice {} twice for clock {}", worker,
                        h.tensor(), h.slice(), h.clock());
        }
      }
      if (error.ok()) error = ledger_.Staged(worker, h.clock(), h.tensor(), &receipt);
      if (error.ok()) {
        s->staged.push_back({worker, h.clock(), static_cast<float*>(payload)});
        ++stats_.staged_now;
      }
    }
    if (!error.ok()) {
      ReleaseBuffer(payload, h.payload_len);
      Refuse(peer, h, error, false);
      return;
    }
    ++stats_.pushes_received;
    FrameHeader ack = MakeHeader(MsgType::kPushAck, id_);
    ack.request = h.request;
    ack.set_tensor(h.tensor());
    ack.set_slice(h.slice());
    ack.set_clock(h.clock());
    std::span<const std::byte> meta;
    if (receipt) meta = {reinterpret_cast<const std::byte*>(receipt->data()), receipt->size()};
    (void)transport_->Send(peer, ack, meta, nullptr, 0);
  }

  void HandlePull(PeerId peer, const FrameHeader& h) {
    SliceState* s = nullptr;
    Status st = CheckData(h, &s);
    if (!st.ok()) {
      Refuse(peer, h, st, false);
      return;
    }
    std::lock_guard lock(s->mu);
    if (!s->awaiting_copy && s->version >= h.min_version()) {
      ReplyPull(*s, peer, h.request);
    } else {
      s->waiting.push_back({peer, h.request, h.min_version()});
    }
  }

  // Snapshot the slice into a pooled buffer (the apply thread may update the slice while the
  // reply is on the wire) and send it; the buffer returns to the pool when sent.
  void ReplyPull(SliceState& s, PeerId peer, uint64_t request) {
    trace::Scoped range(trace::Range::kServerPull);
    const size_t bytes = s.elements * sizeof(float);
    void* buf = AcquireBuffer(bytes);
    if (!buf) return;
    Status st = store_->Read(s.key, {static_cast<float*>(buf), s.elements});
    FrameHeader h = MakeHeader(MsgType::kPullReply, id_);
    h.request = request;
    h.set_tensor(s.tensor);
    h.set_slice(s.index);
    h.set_slice_version(s.version);
    h.dtype = static_cast<uint8_t>(DType::kFloat32);
    if (st.ok()) {
      st = transport_->Send(peer, h, {}, buf, bytes,
                            [this, buf, bytes](const Status&) { ReleaseBuffer(buf, bytes); });
    }
    if (!st.ok()) {
      ReleaseBuffer(buf, bytes);
      return;
    }
    ++stats_.pulls_answered;
  }

  // The scheduler was lost: until the reconnect grace is over, this server tries to reach it
  // again (restarted from its journal, at the same address) and rejoins it, proving who it is
  // with the job key and saying which rounds it has, so that it is sent the rest. Clients
  // are served meanwhile; nothing is applied that the scheduler did not decide.
  void RejoinLoop() {
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

  // The restarted scheduler's answer to the rejoin: from its welcome on, frames on this
  // connection are the scheduler's (the rounds this server missed follow at once).
  void OnRejoinAnswer(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
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

  void HandleScheduler(const FrameHeader& h, std::span<const std::byte> meta) {
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
        PendingRound r{h.round(), {}, std::nullopt, {}, {}, {}, 0};
        Status st = DecodeRound(meta, r.members);
        std::lock_guard lock(mu_);
        if (!st.ok()) {
          result_ = st.WithContext("round from the scheduler");
        } else if (r.round < next_round_in_) {
          return;  // sent again by a restarted scheduler: this server has it already
        } else {
          next_round_in_ = r.round + 1;
          r.lr = LearningRateOf(r.round);
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
        PendingRound copy{h.round(), {}, std::nullopt, {}, h.gone_server(), {}, h.backs()};
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
              PendingRound{h.round(), {}, std::nullopt, std::string(AsText(meta)), {}, {}, 0});
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

  // The newest learning rate set for a round <= `round`, if any. Rounds arrive in order, so
  // older entries are dropped once a newer one applies. Under mu_.
  std::optional<float> LearningRateOf(Round round) {
    auto it = lr_schedule_.upper_bound(round);
    if (it == lr_schedule_.begin()) return std::nullopt;
    --it;
    lr_schedule_.erase(lr_schedule_.begin(), it);
    return it->second;
  }

  // The worker is gone: what it pushed for clocks >= next_clock was never committed.
  void DiscardUncommitted(WorkerId w, Clock next_clock) {
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
  bool NextRoundReady() const {
    if (rounds_.empty()) return false;
    if (copy_at_ && rounds_.front().round < *copy_at_) return true;
    return !awaiting_copies_.load();
  }

  void ApplyLoop() {
    RoundScratch scratch;
    while (true) {
      PendingRound r;
      bool release_only = false;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || NextRoundReady(); });
        if (stop_) return;
        r = std::move(rounds_.front());
        rounds_.pop_front();
        // By number: the copies may be in before every round below their version is released.
        release_only = copy_at_ && r.round < *copy_at_;
      }
      if (!r.checkpoint_dir.empty()) {
        ReportCheckpoint(r.round, WriteCheckpoint(r.round, r.checkpoint_dir));
        continue;
      }
      if (r.copy_for) {
        SendCopies(r.round, r.takeover, *r.copy_for, r.live);
        continue;
      }
      Status st = r.round != stats_.rounds_applied
                      ? Error(StatusCode::kProtocol, "round {} arrived but the next round is {}",
                              r.round, stats_.rounds_applied.load())
                  : release_only ? ReleaseRound(r)
                                 : ApplyRound(r, scratch);
      if (!st.ok()) {
        // Never skip: a round this server cannot apply as decided would leave its slices
        // different from everyone else's. Stop the job and say which gradient it was. The
        // scheduler names the sender itself: the error sent does not.
        const Status here = st.WithContext(fmt::format("server {}", id_.load()));
        spdlog::error("{}", here.message());
        FrameHeader about = MakeHeader(MsgType::kRound, id_);
        about.set_round(r.round);
        {
          // First: the disconnect the error leads to must not replace it, and Run waits for
          // the scheduler's answer while it is being sent.
          std::lock_guard lock(mu_);
          result_ = here;
          error_sent_ = true;
        }
        const bool sent = SendError(*transport_, scheduler_, id_, st, about).ok();
        std::lock_guard lock(mu_);
        error_sent_ = sent;
        cv_.notify_all();
        return;
      }
      ++stats_.rounds_applied;
      if (!release_only) stats_.gradients_applied += r.members.size();
      FrameHeader done = MakeHeader(MsgType::kApplied, id_);
      done.set_round(r.round);
      scratch.meta.clear();
      if (!release_only && AgreementToSend(scratch)) {
        EncodeAgreement(scratch.agreement, scratch.meta);
      }
      (void)transport_->Send(scheduler_, done, scratch.meta, nullptr, 0);
    }
  }

  // Every slice here of every tensor a member's gradient covers must be staged: the
  // scheduler placed it on the servers' receipts. A gap is a protocol error, never skipped.
  Status CheckRoundStaged(const PendingRound& r) {
    std::shared_lock lock(slices_mu_);
    for (SliceState* s : slice_list_) {
      std::lock_guard slock(s->mu);
      for (const RoundEntry& e : r.members) {
        if (!Contains(e.tensors, s->tensor)) continue;
        const bool held = std::any_of(s->staged.begin(), s->staged.end(), [&](const Staged& st) {
          return st.worker == e.member.worker && st.clock == e.member.clock;
        });
        if (!held) {
          return Error(StatusCode::kProtocol,
                       "round {} names worker {}'s gradient of clock {} for tensor {} slice {}, "
                       "which this server never staged",
                       r.round, e.member.worker, e.member.clock, s->tensor, s->index);
        }
      }
    }
    return Status::Ok();
  }

  // The staleness policy's weight of each member's gradient; empty when every one weighs 1
  // (then the stores sum as they always have), as under `none` always.
  void MemberWeights(const PendingRound& r, std::vector<float>& member_weights) const {
    member_weights.clear();
    if (job_.staleness.kind == StalenessKind::kNone) return;
    bool all_one = true;
    for (const RoundEntry& e : r.members) {
      member_weights.push_back(job_.staleness.Weight(Staleness(r.round, e.member.base)));
      all_one = all_one && member_weights.back() == 1.0f;
    }
    if (all_one) member_weights.clear();
  }

  // The mean staleness of the slice's gradients in this round (scratch.member_of), each
  // counted with its weight as the sum counts it; 0 for a round of fresh gradients only. Where
  // every weight rounded to 0 (exp:C far past its bound), the plain mean: those rounds are the
  // stalest, not fresh.
  double MeanStaleness(const PendingRound& r, const RoundScratch& scratch) const {
    double weighed = 0.0;
    double weights = 0.0;
    double plain = 0.0;
    for (size_t m : scratch.member_of) {
      const double w = scratch.member_weights.empty() ? 1.0 : scratch.member_weights[m];
      const auto s = static_cast<double>(Staleness(r.round, r.members[m].member.base));
      weighed += w * s;
      weights += w;
      plain += s;
    }
    if (weights > 0.0) return weighed / weights;
    return scratch.member_of.empty() ? 0.0 : plain / static_cast<double>(scratch.member_of.size());
  }

  // dsync:auto weighs what a stale gradient is worth (ps/stale_worth.h): a round that has
  // both fresh and stale gradients is measured, one that has not says nothing. Notes which
  // members are fresh (`fresh_member`) and readies the round's agreement; false when the round
  // is not measured.
  bool StartAgreement(const PendingRound& r, RoundScratch& scratch) const {
    scratch.fresh_member.clear();
    bool fresh = false;
    bool stale = false;
    for (size_t m = 0; job_.sync.adaptive && m < r.members.size(); ++m) {
      const bool is_fresh = Staleness(r.round, r.members[m].member.base) == 0;
      scratch.fresh_member.push_back(is_fresh ? 1 : 0);
      (is_fresh ? fresh : stale) = true;
    }
    const bool measure = fresh && stale;
    scratch.agreement.dots.assign(measure ? r.members.size() : 0, 0.0);
    scratch.agreement.measured.assign(measure ? r.members.size() : 0, 0);
    return measure;
  }

  // Adds this slice's share of each member's agreement. Only a slice that every member's
  // gradient covers, in host memory, with two fresh gradients at least, is measured: then
  // every member is measured on the same coordinates, so that stale and fresh are compared on
  // like terms. Gradients in GPU memory (GPUDirect RDMA) are not read back for this.
  void MeasureAgreement(const PendingRound& r, const SliceState& s, RoundScratch& scratch) {
    if (scratch.grads.size() != r.members.size()) return;
    scratch.host_fresh.clear();
    size_t fresh = 0;
    for (size_t j = 0; j < scratch.grads.size(); ++j) {
      if (device_memory_ &&
          device_memory_->Contains(scratch.grads[j], s.elements * sizeof(float))) {
        return;
      }
      scratch.host_fresh.push_back(scratch.fresh_member[scratch.member_of[j]]);
      fresh += scratch.host_fresh.back();
    }
    if (fresh < 2) return;
    scratch.host_dots.assign(scratch.grads.size(), 0.0);
    scratch.host_measured.assign(scratch.grads.size(), 0);
    AddAgreement(scratch.grads, scratch.host_fresh, s.elements, r.round,
                 scratch.agreement_scratch, scratch.host_dots, scratch.host_measured);
    for (size_t j = 0; j < scratch.grads.size(); ++j) {
      if (!scratch.host_measured[j]) continue;
      scratch.agreement.dots[scratch.member_of[j]] += scratch.host_dots[j];
      scratch.agreement.measured[scratch.member_of[j]] = 1;
    }
  }

  // The agreement goes to the scheduler where it says something: a stale and a fresh member
  // measured, every value finite (a gradient holding inf or NaN measures nothing).
  bool AgreementToSend(RoundScratch& scratch) const {
    bool fresh = false;
    bool stale = false;
    for (size_t m = 0; m < scratch.agreement.dots.size(); ++m) {
      if (!std::isfinite(scratch.agreement.dots[m])) return false;
      if (!scratch.agreement.measured[m]) continue;
      (scratch.fresh_member[m] ? fresh : stale) = true;
    }
    return fresh && stale;
  }

  Status ApplyRound(const PendingRound& r, RoundScratch& scratch) {
    DSYNC_RETURN_IF_ERROR(CheckRoundStaged(r));
    std::vector<const float*>& grads = scratch.grads;
    std::vector<float>& weights = scratch.weights;
    std::vector<uint64_t>& bases = scratch.bases;
    std::vector<size_t>& used = scratch.used;
    // Delay compensation: every slice keeps the same versions on every server (a job's depth
    // is fixed, and snapshots carry what was kept), so copies stay alike.
    Compensation comp;
    comp.depth = job_.staleness.CompensationDepth(job_.sync);
    comp.lambda = comp.depth > 0 ? job_.staleness.compensation : 0.0f;  // bsp: never stale
    comp.adaptive = job_.staleness.adaptive;
    comp.round = r.round;
    const std::vector<float>& member_weights = scratch.member_weights;
    MemberWeights(r, scratch.member_weights);
    // Payload: the round's number, shown on the timeline (0 is shown as no payload).
    trace::Scoped range(trace::Range::kServerRound, r.round);
    std::shared_lock lock(slices_mu_);
    uint64_t strays = 0;
    Status failed = Status::Ok();
    const bool measure = StartAgreement(r, scratch);
    for (SliceState* s : slice_list_) {
      std::lock_guard slock(s->mu);
      grads.clear();
      weights.clear();
      bases.clear();
      used.clear();
      scratch.member_of.clear();
      for (size_t m = 0; m < r.members.size(); ++m) {  // worker-id order: deterministic sums
        const RoundEntry& e = r.members[m];
        const bool applies = Contains(e.tensors, s->tensor);
        for (size_t i = 0; i < s->staged.size(); ++i) {
          if (s->staged[i].worker == e.member.worker && s->staged[i].clock == e.member.clock) {
            // Staged for a tensor the commit did not name: pushed, never committed; dropped.
            if (applies) {
              scratch.member_of.push_back(m);
              grads.push_back(s->staged[i].data);
              if (!member_weights.empty()) weights.push_back(member_weights[m]);
              if (comp.depth > 0) bases.push_back(e.member.base);
            }
            strays += applies ? 0 : 1;
            used.push_back(i);
            break;
          }
        }
      }
      OptimizerConfig opt = s->optimizer;
      if (r.lr) opt.lr = *r.lr;
      if (opt.kind == OptimizerKind::kMomentum && job_.staleness.temper_momentum) {
        opt.momentum = job_.staleness.RoundMomentum(opt.momentum, MeanStaleness(r, scratch));
      }
      comp.bases = bases;
      if (measure) MeasureAgreement(r, *s, scratch);
      Status st = store_->ApplyRound(s->key, grads, weights, comp, opt);
      if (!st.ok()) {
        // The slice would fall behind its copies and every later round: the round fails
        // (ApplyLoop stops the job, naming the first) once the rest are released as usual.
        // The slice keeps its version, so no pull is answered with a model it does not hold.
        st = st.WithContext(fmt::format("applying round {} to tensor {} slice {}", r.round,
                                        s->tensor, s->index));
        if (failed.ok()) {
          failed = st;
        } else {
          spdlog::error("server {}: {}", id_.load(), st.message());
        }
      }
      std::sort(used.begin(), used.end());
      for (size_t k = used.size(); k-- > 0;) {
        ReleaseBuffer(s->staged[used[k]].data, s->elements * sizeof(float));
        s->staged.erase(s->staged.begin() + static_cast<std::ptrdiff_t>(used[k]));
        --stats_.staged_now;
      }
      if (!st.ok()) continue;
      s->version = r.round + 1;
      std::erase_if(s->waiting, [&](const WaitingPull& p) {
        if (p.min_version > s->version) return false;
        ReplyPull(*s, p.peer, p.request);
        return true;
      });
    }
    for (const RoundEntry& e : r.members) ledger_.Applied(e.member.worker, e.member.clock);
    if (strays) {
      spdlog::warn("server {}: round {} dropped {} staged slice(s) of tensors its members "
                   "pushed but did not commit",
                   id_.load(), r.round, strays);
    }
    return failed;
  }

  // Every slice here, with its optimizer state, at `version` (the apply thread's: no round
  // runs meanwhile; pushes may still be staged, which changes no slice).
  Result<CheckpointFile> WriteCheckpoint(Version version, const std::string& dir) {
    if (version != stats_.rounds_applied) {
      return Error(StatusCode::kProtocol, "asked to write version {} after applying {} round(s)",
                   version, stats_.rounds_applied.load());
    }
    ServerCheckpoint c;
    c.rank = ServerRank(id_);
    c.num_servers = job_.num_servers;
    c.version = version;
    c.slice_bytes = job_.slice_bytes;
    {
      std::shared_lock lock(slices_mu_);
      c.slices.reserve(slice_list_.size());
      for (SliceState* s : slice_list_) {
        CheckpointSlice cs;
        DSYNC_RETURN_IF_ERROR(SnapshotSlice(*s, cs));
        c.slices.push_back(std::move(cs));
      }
    }
    return WriteServerCheckpoint(dir, c);
  }

  // A slice as checkpoints and copies hold it: the tensor's metadata, values and optimizer
  // state. Under slices_mu_.
  Status SnapshotSlice(SliceState& s, CheckpointSlice& cs) {
    const TensorMeta& t = tensors_.at(s.tensor);
    cs.tensor = s.tensor;
    cs.slice = s.index;
    cs.replica = s.replica;
    cs.meta = InitMeta{t.name, t.elements, uint64_t{s.index} * SliceElements(), t.optimizer,
                       t.shape};
    std::lock_guard slock(s.mu);
    return store_->Snapshot(s.key, cs.snapshot);
  }

  // --- a new server taking a lost rank's place (docs/design.md, "Recreating lost copies") --

  // A round before the copies' version on the new server: the copies hold what it applied;
  // what it named that was staged here is released.
  Status ReleaseRound(const PendingRound& r) {
    std::shared_lock lock(slices_mu_);
    for (SliceState* s : slice_list_) {
      std::lock_guard slock(s->mu);
      std::erase_if(s->staged, [&](const Staged& st) {
        const bool named = std::any_of(r.members.begin(), r.members.end(), [&](const RoundEntry& e) {
          return e.member.worker == st.worker && e.member.clock == st.clock;
        });
        if (named) {
          ReleaseBuffer(st.data, s->elements * sizeof(float));
          --stats_.staged_now;
        }
        return named;
      });
    }
    for (const RoundEntry& e : r.members) ledger_.Applied(e.member.worker, e.member.clock);
    return Status::Ok();
  }

  // This server applied every round before `version`: for takeover number `takeover`, it
  // sends the server of `for_id`'s rank
  // the copies that rank holds of the slices here whose first live copy (besides that rank)
  // this server is, in frames of about kCopyChunkBytes, the last flagged.
  void SendCopies(Version version, uint32_t takeover, NodeId for_id,
                  const std::vector<bool>& live) {
    const uint32_t n = job_.num_servers;
    const uint32_t me = ServerRank(id_);
    const uint32_t target = ServerRank(for_id);
    const auto header = [&](bool last) {
      FrameHeader h = MakeHeader(MsgType::kCopy, id_);
      h.set_round(version);
      h.set_backs(takeover);
      if (last) h.flags |= kFlagLast;
      return h;
    };
    const auto send = [&](ServerCheckpoint& chunk, bool last) -> Status {
      auto bytes = std::make_unique<std::vector<std::byte>>(SerializeServerCheckpoint(chunk));
      chunk.slices.clear();
      if (bytes->size() > kMaxPayloadBytes) {
        return Error(StatusCode::kOutOfRange, "a slice's copy of {} bytes is more than a frame "
                                              "carries ({} bytes); lower --slice-bytes",
                     bytes->size(), kMaxPayloadBytes);
      }
      std::vector<std::byte>* raw = bytes.get();
      DSYNC_RETURN_IF_ERROR(transport_->Send(scheduler_, header(last), {}, raw->data(),
                                             raw->size(), [raw](const Status&) { delete raw; }));
      (void)bytes.release();
      return Status::Ok();
    };
    Status st = version == stats_.rounds_applied
                    ? Status::Ok()
                    : Error(StatusCode::kProtocol, "asked for copies of version {} after applying "
                                                   "{} round(s)",
                            version, stats_.rounds_applied.load());
    ServerCheckpoint chunk{me, n, version, job_.slice_bytes, {}};
    uint64_t chunk_bytes = 0, sent = 0;
    if (st.ok()) {
      std::shared_lock lock(slices_mu_);
      for (SliceState* s : slice_list_) {
        const uint32_t primary = PrimaryRank(me, s->replica, n);
        if (CopyNumber(target, primary, n) >= job_.replicas) continue;
        uint32_t donor = n;
        for (uint32_t j = 0; j < job_.replicas && donor == n; ++j) {
          const uint32_t rank = ReplicaRank(primary, j, n);
          if (rank != target && rank < live.size() && live[rank]) donor = rank;
        }
        if (donor != me) continue;
        CheckpointSlice cs;
        st = SnapshotSlice(*s, cs);
        if (!st.ok()) break;
        chunk_bytes += (cs.snapshot.params.size() *
                            (1 + cs.snapshot.state.size() + cs.snapshot.kept.size()) +
                        cs.snapshot.mean_square.size()) *
                       sizeof(float);
        chunk.slices.push_back(std::move(cs));
        ++sent;
        if (chunk_bytes >= kCopyChunkBytes) {
          st = send(chunk, false);
          chunk_bytes = 0;
          if (!st.ok()) break;
        }
      }
    }
    if (st.ok()) st = send(chunk, true);
    if (!st.ok()) {
      spdlog::error("server {}: cannot send the copies server {} needs: {}", id_.load(), for_id,
                    st.message());
      FrameHeader h = header(/*last=*/true);
      h.status = static_cast<uint16_t>(st.code());
      (void)transport_->Send(scheduler_, h, AsBytes(st.message()), nullptr, 0);
      return;
    }
    spdlog::info("server {}: sent server {} the copies of {} slice(s) at version {}", id_.load(),
                 for_id, sent, version);
  }

  // Copies relayed by the scheduler, from one of the other servers (payload: its file's
  // bytes; null for none).
  void TakeCopies(const FrameHeader& h, std::byte* payload) {
    std::unique_ptr<std::byte[]> hold(payload);
    std::optional<Version> at;
    uint32_t number = 0;
    {
      std::lock_guard lock(mu_);
      at = copy_at_;
      number = takeover_number_;
    }
    Status st = awaiting_copies_.load() && at && *at == h.round() && h.backs() == number
                    ? Status::Ok()
                    : Error(StatusCode::kProtocol, "copies of version {} came unasked", h.round());
    if (st.ok() && !payload && h.payload_len > 0) {
      st = Error(StatusCode::kResourceExhausted,
                 "no memory for the {} bytes of copies from server {}", h.payload_len, h.sender);
    }
    if (st.ok() && payload) {
      const std::string what = fmt::format("the copies from server {}", h.sender);
      Result<ServerCheckpoint> c =
          ParseServerCheckpoint({payload, h.payload_len}, what, std::nullopt);
      st = c.status();
      if (st.ok() && (c->num_servers != job_.num_servers || c->version != *at ||
                      c->slice_bytes != job_.slice_bytes || c->rank >= job_.num_servers)) {
        st = Error(StatusCode::kDataLoss, "{} are of rank {} of {} at version {} with slices of "
                                          "{} bytes, not of this job at version {}",
                   what, c->rank, c->num_servers, c->version, c->slice_bytes, *at);
      }
      for (size_t i = 0; st.ok() && i < c->slices.size(); ++i) {
        st = InstallCopy(what, c->rank, *at, c->slices[i]);
      }
    }
    hold.reset();
    std::lock_guard lock(mu_);
    if (!st.ok()) {
      FailTakeover(st);
      return;
    }
    if (h.flags & kFlagLast) ++copies_done_;
    if (copies_done_ == copies_expected_ && awaiting_copies_.load()) FinishCopies();
  }

  Status InstallCopy(const std::string& what, uint32_t from_rank, Version at, CheckpointSlice& cs) {
    const uint32_t n = job_.num_servers;
    const uint32_t mine = CopyNumber(ServerRank(id_), PrimaryRank(from_rank, cs.replica, n), n);
    if (cs.replica >= job_.replicas || mine >= job_.replicas) {
      return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} is no copy this rank holds",
                   what, cs.meta.name, cs.slice);
    }
    cs.replica = mine;
    const SliceKey key = MakeSliceKey(cs.tensor, cs.slice);
    {
      std::shared_lock lock(slices_mu_);
      if (auto it = slices_.find(key); it != slices_.end()) {
        SliceState& s = *it->second;
        std::lock_guard slock(s.mu);
        if (s.copied || !s.awaiting_copy || s.elements != cs.snapshot.params.size()) {
          return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} came twice or does not "
                                              "fit the slice here",
                       what, cs.meta.name, cs.slice);
        }
        DSYNC_RETURN_IF_ERROR(store_->Restore(key, cs.snapshot).WithContext(what));
        s.copied = true;
        std::vector<float>().swap(s.init_values);
        return Status::Ok();
      }
    }
    DSYNC_RETURN_IF_ERROR(RestoreSlice(what, at, cs));
    SliceState* s = FindSlice(cs.tensor, cs.slice);
    std::lock_guard slock(s->mu);
    s->awaiting_copy = true;  // FinishCopies lets its pulls through with every other's
    s->copied = true;
    return Status::Ok();
  }

  // Every copy is in: slices no copy filled take their own init's values (a tensor none of
  // the others had at that version), pulls waiting are answered, rounds from the copies'
  // version on are applied from now on. Under mu_.
  void FinishCopies() {
    Status st;
    {
      std::unique_lock lock(slices_mu_);
      for (SliceState* s : slice_list_) {
        if (!s->awaiting_copy || s->copied) continue;
        if (s->layout_only) {
          st = Error(StatusCode::kDataLoss, "no server sent the copy of tensor {} slice {} "
                                            "that this rank holds",
                     s->tensor, s->index);
          break;
        }
        st = store_->InitSlice(s->key, s->init_values);
        if (!st.ok()) break;
      }
      if (st.ok()) {
        for (SliceState* s : slice_list_) {
          std::lock_guard slock(s->mu);
          if (!s->awaiting_copy) continue;
          s->awaiting_copy = false;
          s->version = *copy_at_;
          std::vector<float>().swap(s->init_values);
          std::erase_if(s->waiting, [&](const WaitingPull& p) {
            if (p.min_version > s->version) return false;
            ReplyPull(*s, p.peer, p.request);
            return true;
          });
        }
        awaiting_copies_ = false;
        ledger_.set_window(ledger_.window() / kTakeoverStagingFactor);
      }
    }
    if (!st.ok()) {
      FailTakeover(st);
      return;
    }
    FrameHeader done = MakeHeader(MsgType::kCopied, id_);
    done.set_round(*copy_at_);
    (void)SendControl(*transport_, scheduler_, done);
    spdlog::info("server {}: holds the copies of rank {} at version {}; it applies the rounds "
                 "from there",
                 id_.load(), ServerRank(id_), *copy_at_);
    cv_.notify_all();
  }

  // Taking the rank over failed: the scheduler goes on without this server. Under mu_.
  void FailTakeover(const Status& why) {
    if (!result_.ok()) return;
    // The scheduler names the sender itself: the error sent does not.
    const Status sent = why.WithContext(fmt::format("taking over rank {}", ServerRank(id_)));
    result_ = sent.WithContext(fmt::format("server {}", id_.load()));
    spdlog::error("{}", result_.message());
    FrameHeader about = MakeHeader(MsgType::kCopy, id_);
    error_sent_ = SendError(*transport_, scheduler_, id_, sent, about).ok();
    cv_.notify_all();
  }

  void ReportCheckpoint(Version version, const Result<CheckpointFile>& file) {
    FrameHeader h = MakeHeader(MsgType::kCheckpointDone, id_);
    h.set_round(version);
    if (!file.ok()) {
      spdlog::error("server {}: checkpoint of version {} failed: {}", id_.load(), version,
                    file.status().message());
      h.status = static_cast<uint16_t>(file.status().code());
      (void)transport_->Send(scheduler_, h, AsBytes(file.status().message()), nullptr, 0);
      return;
    }
    std::vector<std::byte> meta;
    EncodeCheckpointDone({file->name, file->bytes, file->crc32}, meta);
    (void)transport_->Send(scheduler_, h, meta, nullptr, 0);
  }

  // A resumed job: this server's slices as the checkpoint holds them, before any client.
  // The slices of this server's rank at the checkpoint's version: from its own file, or, for
  // a rank lost before the checkpoint (it has no file), from the copies the other ranks' files
  // hold of them (Config::replicas).
  Status RestoreCheckpoint(const Welcome::Restore& from) {
    const uint32_t rank = ServerRank(id_);
    const bool own = from.copies.empty();
    std::vector<std::pair<std::string, uint32_t>> sources;
    if (own) {
      sources.emplace_back(from.file, from.crc32);
    } else {
      for (const Welcome::Restore::Source& src : from.copies) sources.emplace_back(src.file, src.crc32);
    }
    uint64_t restored = 0;
    for (const auto& [file, crc] : sources) {
      DSYNC_ASSIGN_OR_RETURN(ServerCheckpoint c, ReadServerCheckpoint(file, crc));
      if ((own && c.rank != rank) || c.rank >= job_.num_servers ||
          c.num_servers != job_.num_servers || c.version != from.version ||
          c.slice_bytes != job_.slice_bytes) {
        return Error(StatusCode::kDataLoss,
                     "checkpoint file '{}' holds rank {} of {} at version {} with slices of {} "
                     "bytes, not {} of {} at version {} with slices of {} bytes",
                     file, c.rank, c.num_servers, c.version, c.slice_bytes,
                     own ? fmt::format("rank {}", rank) : std::string("a rank"), job_.num_servers,
                     from.version, job_.slice_bytes);
      }
      for (CheckpointSlice& cs : c.slices) {
        if (!own) {
          // Copy j of a slice on rank r: its primary is r - j, and this rank holds copy
          // (rank - primary) mod S if that is below the job's copies.
          const uint32_t n = job_.num_servers;
          const uint32_t mine = CopyNumber(rank, PrimaryRank(c.rank, cs.replica, n), n);
          if (cs.replica >= job_.replicas) {
            return Error(StatusCode::kDataLoss,
                         "checkpoint file '{}': tensor '{}' slice {} is copy {}, but the job "
                         "keeps {} cop{}",
                         file, cs.meta.name, cs.slice, cs.replica, job_.replicas,
                         job_.replicas == 1 ? "y" : "ies");
          }
          if (mine >= job_.replicas) continue;  // not a slice this rank holds
          cs.replica = mine;
          std::shared_lock lock(slices_mu_);
          if (slices_.contains(MakeSliceKey(cs.tensor, cs.slice))) continue;  // another copy
        }
        DSYNC_RETURN_IF_ERROR(RestoreSlice(fmt::format("checkpoint file '{}'", file), c.version, cs));
        ++restored;
      }
    }
    stats_.rounds_applied = from.version;
    spdlog::info("server {}: restored {} slice(s) at version {} from {}", id_.load(), restored,
                 from.version,
                 own ? from.file
                     : fmt::format("the copies in {} other file(s) (this rank had no file)",
                                   sources.size()));
    return Status::Ok();
  }

  Status RestoreSlice(const std::string& what, Version version, CheckpointSlice& cs) {
    const uint64_t per = SliceElements();
    std::unique_lock lock(slices_mu_);
    const SliceKey key = MakeSliceKey(cs.tensor, cs.slice);
    const uint64_t n = cs.snapshot.params.size();
    if (cs.meta.tensor_elements == 0 || (cs.meta.tensor_elements - 1) / per >= UINT32_MAX ||
        cs.meta.slice_offset != uint64_t{cs.slice} * per ||
        n != std::min(per, cs.meta.tensor_elements - std::min(cs.meta.tensor_elements,
                                                              cs.meta.slice_offset))) {
      return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} does not fit the job's "
                                          "slicing",
                   what, cs.meta.name, cs.slice);
    }
    DSYNC_RETURN_IF_ERROR(ledger_.Place(
        cs.tensor, static_cast<uint32_t>((cs.meta.tensor_elements - 1) / per + 1), cs.slice,
        cs.replica));
    DSYNC_RETURN_IF_ERROR(store_->Restore(key, cs.snapshot)
                              .WithContext(fmt::format("restoring {}", what)));
    auto t = tensors_.try_emplace(cs.tensor,
                                  TensorMeta{cs.meta.name, cs.meta.tensor_elements,
                                             cs.meta.optimizer.value_or(job_.optimizer),
                                             cs.meta.shape});
    auto s = std::make_unique<SliceState>();
    s->key = key;
    s->tensor = cs.tensor;
    s->index = cs.slice;
    s->replica = cs.replica;
    s->elements = n;
    s->version = version;
    s->optimizer = t.first->second.optimizer;
    slice_list_.push_back(s.get());
    slices_.emplace(key, std::move(s));
    return Status::Ok();
  }

  // One JSON object per slice: enough to check a final model without shipping it.
  Status DumpModel() {
    const std::string path = fmt::format("{}/server-{}.json", cfg_.dump_model, id_);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return Error(StatusCode::kInvalidArgument, "cannot write the model dump '{}'", path);
    std::shared_lock lock(slices_mu_);
    std::vector<float> values;
    std::fprintf(f, "{\"server\":%u,\"rounds\":%llu,\"slices\":[", id_.load(),
                 static_cast<unsigned long long>(stats_.rounds_applied.load()));
    for (size_t i = 0; i < slice_list_.size(); ++i) {
      const SliceState& s = *slice_list_[i];
      values.resize(s.elements);
      (void)store_->Read(s.key, values);
      double sum = 0;
      float lo = values[0], hi = values[0];
      for (float v : values) {
        sum += v;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      // The CRC-32 of the values' bytes: copies of a slice on other servers compare by it.
      const auto crc = static_cast<unsigned long>(
          crc32(crc32(0, nullptr, 0), reinterpret_cast<const Bytef*>(values.data()),
                static_cast<uInt>(values.size() * sizeof(float))));
      std::fprintf(f,
                   "%s\n{\"tensor\":%u,\"slice\":%u,\"replica\":%u,\"version\":%llu,"
                   "\"elements\":%llu,\"min\":%.9g,\"max\":%.9g,\"sum\":%.17g,\"crc32\":%lu}",
                   i ? "," : "", s.tensor, s.index, s.replica,
                   static_cast<unsigned long long>(s.version),
                   static_cast<unsigned long long>(s.elements), static_cast<double>(lo),
                   static_cast<double>(hi), sum, crc);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
    return Status::Ok();
  }

  void ReleaseAllStaged() {
    std::shared_lock lock(slices_mu_);
    for (SliceState* s : slice_list_) {
      for (const Staged& st : s->staged) ReleaseBuffer(st.data, s->elements * sizeof(float));
      s->staged.clear();
    }
  }

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

}  // namespace
}  // namespace ps

namespace ps {

Result<std::unique_ptr<Server>> StartServer(const Config& config,
                                            std::unique_ptr<Transport> transport,
                                            std::unique_ptr<ParamStore> store) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  auto node = std::make_unique<ServerNode>(config, std::move(transport), std::move(store));
  DSYNC_RETURN_IF_ERROR(node->Init());
  return std::unique_ptr<Server>(std::move(node));
}

}  // namespace ps

}  // namespace dsync
