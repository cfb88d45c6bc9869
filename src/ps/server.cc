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

#include "ps/server_internal.h"

namespace dsync::ps {

ServerNode::~ServerNode() {
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

Status ServerNode::Init() {
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

void ServerNode::HeartbeatLoop() {
  const auto period = std::chrono::milliseconds(job_.heartbeat_interval_ms);
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, period, [&] { return stop_ || shutdown_; })) {
    (void)SendControl(*transport_, scheduler_, MakeHeader(MsgType::kHeartbeat, id_));
  }
}

Status ServerNode::SetUpDeviceMemory() {
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

void* ServerNode::AcquireBuffer(size_t bytes) {
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

void ServerNode::ReleaseBuffer(void* buffer, size_t bytes) {
  if (buffer && device_memory_ && device_memory_->Contains(buffer, bytes)) {
    device_pool_.Release(buffer, bytes);
  } else {
    pool_.Release(buffer, bytes);
  }
}

Status ServerNode::Run() {
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

void ServerNode::Stop() {
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

ServerStats ServerNode::stats() const {
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

void ServerNode::OnConnected(PeerId peer, bool inbound) {
  if (inbound) clients_.Connected(peer);
}

void ServerNode::OnDisconnected(PeerId peer, const Status& why) {
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

void* ServerNode::OnHeader(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
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

void ServerNode::OnPayloadLost(PeerId peer, const FrameHeader& h, void* payload) {
  if (peer == scheduler_ && h.msg_type() == MsgType::kCopy) {
    delete[] static_cast<std::byte*>(payload);
    return;
  }
  ReleaseBuffer(payload, h.payload_len);  // a truncated push stages nothing
}

void ServerNode::OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                         void* payload) {
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

Result<std::unique_ptr<Server>> StartServer(const Config& config,
                                            std::unique_ptr<Transport> transport,
                                            std::unique_ptr<ParamStore> store) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  auto node = std::make_unique<ServerNode>(config, std::move(transport), std::move(store));
  DSYNC_RETURN_IF_ERROR(node->Init());
  return std::unique_ptr<Server>(std::move(node));
}

}  // namespace dsync::ps
