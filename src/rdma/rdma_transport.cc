#include "rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ps/inbound_counter.h"
#include "rdma/mr_cache.h"

namespace dsync::rdma {
namespace {

using ps::FrameHeader;
using ps::PeerId;
using ps::SendDone;
using SteadyClock = std::chrono::steady_clock;

// Immediate data: 2 bits of kind, 30 bits of value. Every WRITE WITH IMMEDIATE consumes one
// receive WR on the peer and raises one completion there; plain writes raise none.
enum ImmKind : uint32_t { kImmSlot = 0, kImmCredit = 1, kImmCts = 2, kImmData = 3 };
constexpr uint32_t kImmValueMask = (1u << 30) - 1;
uint32_t MakeImm(ImmKind kind, uint32_t value) { return (kind << 30) | (value & kImmValueMask); }

// Send work-request ids: kind in the top byte, value below.
enum WrKind : uint64_t { kWrSlot = 1, kWrCts = 2, kWrCredit = 3, kWrData = 4 };
uint64_t MakeWr(WrKind kind, uint64_t value) { return (uint64_t{kind} << 56) | value; }

constexpr uint32_t kSlotMagic = 0x4d534452;  // "RDSM"
enum SlotKind : uint16_t { kSlotFrame = 1, kSlotRts = 2 };

// At the start of a message's first slot. A message spans `fragments` consecutive slots of
// the ring (only frames with large metadata need more than one).
struct SlotHeader {
  uint32_t magic = kSlotMagic;
  uint16_t kind = 0;
  uint16_t fragments = 1;
  uint32_t length = 0;  // bytes after this header: frame header, metadata, eager payload
  uint32_t rts_id = 0;  // kSlotRts: index of the sender's CTS FIFO entry to answer in
};
static_assert(sizeof(SlotHeader) == 16);

// Written by a receiver into the sender's CTS FIFO (NCCL's "clear to send"): where the
// payload goes, or that the handler discards it.
struct Cts {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t token = 0;
  uint32_t discard = 0;
  uint32_t pad = 0;
};
static_assert(sizeof(Cts) == 24);

// Exchanged as rdma_cm private data (at most 56 bytes in a connect request).
struct Hello {
  uint32_t magic = kSlotMagic;
  uint16_t version = 1;
  uint16_t slots = 0;
  uint32_t slot_bytes = 0;
  uint32_t ring_rkey = 0;
  uint64_t ring_addr = 0;
  uint64_t cts_addr = 0;
  uint32_t cts_rkey = 0;
  uint16_t fifo = 0;
  uint16_t pad = 0;
};
static_assert(sizeof(Hello) == 40);

std::string AddrText(const sockaddr* sa) {
  if (!sa || sa->sa_family != AF_INET) return "?";
  const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
  return fmt::format("{}:{}", buf, ntohs(in->sin_port));
}

Result<sockaddr_in> ParseAddr(const std::string& host, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (host.empty() || host == "0.0.0.0" || host == "*") {
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    return a;
  }
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1) return a;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) {
    return Error(StatusCode::kInvalidArgument, "cannot resolve host '{}'", host);
  }
  a.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return a;
}

bool IsLoopback(const sockaddr_in& a) { return (ntohl(a.sin_addr.s_addr) >> 24) == 127; }

// Per device context: rdma_cm picks the device from the address, so there may be several.
struct DeviceRes {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  std::unique_ptr<MrCache> cache;
};

struct Outgoing {
  FrameHeader header;
  std::vector<std::byte> meta;  // capacity kept: entries are reused
  const void* payload = nullptr;
  uint64_t payload_len = 0;
  bool rendezvous = false;
  MrCache::Ref ref;  // rendezvous: the payload's registration
  SendDone done;
};

struct RdvOut {
  bool used = false;
  const void* payload = nullptr;
  uint64_t len = 0;
  MrCache::Ref ref;
  SendDone done;
};

enum class ConnState { kConnecting, kOpen, kClosed };

struct Conn {
  PeerId id = ps::kNoPeer;
  bool inbound = false;
  // Inbound peers are strangers until the handler calls Trust(): one small hello at most,
  // within the handshake timeout (ps/transport.h).
  std::atomic<bool> trusted{true};
  bool pending = false;  // counted in the pending caps (under the transport's mu_)
  std::string source;    // inbound: the peer's address without the port
  std::chrono::steady_clock::time_point accepted_at;
  std::atomic<bool> unread{false};  // arrived messages not yet delivered (progress thread)
  rdma_cm_id* cm = nullptr;
  DeviceRes* dev = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  std::string address;
  uint32_t slots = 0, slot_bytes = 0, fifo = 0, sq_depth = 0, rq_depth = 0;

  // One registered block: receive ring | staging ring | CTS FIFO (written by the peer) |
  // outgoing CTS entries (sources of our CTS writes).
  std::byte* mem = nullptr;
  size_t mem_bytes = 0;
  ibv_mr* mr = nullptr;
  std::byte* ring() const { return mem; }
  std::byte* stage() const { return mem + size_t{slots} * slot_bytes; }
  Cts* cts_in() const { return reinterpret_cast<Cts*>(mem + 2 * size_t{slots} * slot_bytes); }
  Cts* cts_out() const { return cts_in() + fifo; }

  Hello remote;  // the peer's ring and FIFO

  std::atomic<ConnState> state{ConnState::kConnecting};
  std::atomic<bool> closing{false};  // Close() asked: deliver nothing more
  bool graceful = false;             // Close(): let what was sent before it leave first
  bool notified = false;             // OnConnected ran (so OnDisconnected must)
  Status why;

  // Send side, under mu (any thread).
  std::mutex mu;
  uint32_t credits = 0;
  uint64_t send_seq = 0;
  std::vector<uint8_t> stage_busy;
  std::vector<SendDone> stage_done;  // by the message's last slot
  std::vector<uint32_t> stage_frags;  // by the message's last slot: slots it spans
  std::deque<Outgoing*> queue;
  std::vector<Outgoing*> spare;
  std::vector<RdvOut> rdv;
  uint32_t rdv_used = 0;
  uint32_t next_rts = 0;
  uint64_t credit_stalls = 0;

  // Receive side, progress thread only.
  uint64_t recv_seq = 0;     // next slot to process
  uint64_t arrived = 0;      // slots that have arrived
  uint32_t unreported = 0;   // consumed slots not yet returned as credits
  bool credit_in_flight = false;
  uint32_t next_token = 1;
  struct {
    bool active = false;
    FrameHeader header;
    std::vector<std::byte> meta;
    void* dest = nullptr;
    MrCache::Ref ref;
    uint32_t token = 0;
  } rin;
  std::vector<std::byte> reassembly;

  // Connect(): the caller waits for the progress thread's verdict.
  std::mutex wait_mu;
  std::condition_variable wait_cv;
  bool decided = false;
  Status outcome;
  bool refused = false;  // retry-able: no listener yet, or not reachable yet
};

class Rdma final : public RdmaTransport {
 public:
  Rdma(RdmaOptions options, DeviceChoice choice)
      : options_(std::move(options)), choice_(std::move(choice)) {}

  ~Rdma() override {
    Shutdown();
    if (progress_.joinable()) progress_.join();
    for (auto& d : devices_) {
      d->cache.reset();
      if (d->pd) ibv_dealloc_pd(d->pd);
      if (d->channel) ibv_destroy_comp_channel(d->channel);
    }
    if (cm_) rdma_destroy_event_channel(cm_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  Status Init() {
    cm_ = rdma_create_event_channel();
    if (!cm_) {
      return Error(StatusCode::kUnavailable, "rdma_create_event_channel: {} ({})",
                   std::strerror(errno), "is the rdma_ucm kernel module loaded?");
    }
    if (fcntl(cm_->fd, F_SETFL, fcntl(cm_->fd, F_GETFL) | O_NONBLOCK) != 0) {
      return Error(StatusCode::kInternal, "fcntl: {}", std::strerror(errno));
    }
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Error(StatusCode::kInternal, "eventfd: {}", std::strerror(errno));
    const uint64_t limit = MemlockLimit();
    const uint64_t per_conn = 2ull * options_.slots * options_.slot_bytes;
    if (limit < 64 * per_conn) {
      spdlog::warn(
          "RDMA: the locked-memory limit is {} KiB; each connection registers {} KiB and "
          "every payload in flight is registered too: raise it (ulimit -l unlimited; systemd: "
          "LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)",
          limit / 1024, per_conn / 1024);
    }
    progress_ = std::thread([this] { ProgressLoop(); });
    return Status::Ok();
  }

  std::string_view name() const override { return "rdma"; }
  const DeviceChoice& device() const override { return choice_; }

  void SetHandler(ps::TransportHandler* handler) override { handler_.store(handler); }

  Result<uint16_t> Listen(const std::string& host, uint16_t port) override {
    DSYNC_ASSIGN_OR_RETURN(sockaddr_in addr, ParseAddr(host, port));
    if (IsLoopback(addr)) {
      return Error(StatusCode::kInvalidArgument,
                   "RDMA cannot listen on {} (loopback has no RDMA device); listen on the IP of "
                   "an RDMA netdev ({} on {} here: --interface {})",
                   host, choice_.ipv4, choice_.netdev, choice_.ipv4);
    }
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(cm_, &id, nullptr, RDMA_PS_TCP) != 0) {
      return Error(StatusCode::kUnavailable, "rdma_create_id: {}", std::strerror(errno));
    }
    if (rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&addr)) != 0) {
      const int err = errno;
      rdma_destroy_id(id);
      return Error(err == EADDRINUSE ? StatusCode::kAlreadyExists : StatusCode::kUnavailable,
                   "RDMA listen on {}:{}: {}{}", host, port, std::strerror(err),
                   err == EADDRNOTAVAIL ? " (no RDMA device has that address)" : "");
    }
    if (rdma_listen(id, 128) != 0) {
      const int err = errno;
      rdma_destroy_id(id);
      return Error(StatusCode::kUnavailable, "rdma_listen on {}:{}: {}", host, port,
                   std::strerror(err));
    }
    const uint16_t bound = ntohs(rdma_get_src_port(id));
    std::lock_guard lock(mu_);
    listeners_.push_back(id);
    return bound;
  }

  Result<PeerId> Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) override {
    DSYNC_ASSIGN_OR_RETURN(sockaddr_in dst, ParseAddr(host, port));
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
    Status last;
    while (true) {
      if (stopping_.load()) return Error(StatusCode::kUnavailable, "transport shut down");
      auto conn = std::make_shared<Conn>();
      conn->id = next_peer_++;
      conn->address = fmt::format("{}:{}", host, port);
      rdma_cm_id* id = nullptr;
      if (rdma_create_id(cm_, &id, conn.get(), RDMA_PS_TCP) != 0) {
        return Error(StatusCode::kUnavailable, "rdma_create_id: {}", std::strerror(errno));
      }
      conn->cm = id;
      {
        std::lock_guard lock(mu_);
        conns_[conn->id] = conn;
        by_cm_[id] = conn;
      }
      sockaddr_in src{};
      sockaddr* srcp = nullptr;
      if (!options_.device.device.empty() || options_.device.gid_index >= 0) {
        src.sin_family = AF_INET;
        inet_pton(AF_INET, choice_.ipv4.c_str(), &src.sin_addr);
        srcp = reinterpret_cast<sockaddr*>(&src);
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - SteadyClock::now());
      const int resolve_ms = static_cast<int>(std::clamp<int64_t>(left.count(), 100, 2000));
      if (rdma_resolve_addr(id, srcp, reinterpret_cast<sockaddr*>(&dst), resolve_ms) != 0) {
        last = Error(StatusCode::kUnavailable, "rdma_resolve_addr {}: {}", conn->address,
                     std::strerror(errno));
        Forget(conn);
        rdma_destroy_id(id);
        return last;
      }
      {
        std::unique_lock lock(conn->wait_mu);
        conn->wait_cv.wait_until(lock, deadline + std::chrono::seconds(5),
                                 [&] { return conn->decided; });
        if (!conn->decided) {
          conn->decided = true;
          conn->outcome = Error(StatusCode::kDeadlineExceeded, "no answer from {} over RDMA",
                                conn->address);
        }
      }
      if (conn->outcome.ok()) return conn->id;
      last = conn->outcome;
      RequestClose(conn);  // the progress thread frees what the attempt created
      if (!conn->refused || SteadyClock::now() + std::chrono::milliseconds(50) >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return Error(last.code() == StatusCode::kOk ? StatusCode::kUnavailable : last.code(),
                 "cannot connect to {}:{} over RDMA within {} ms: {}", host, port, timeout_ms,
                 last.message());
  }

  Status Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
              const void* payload, uint64_t payload_len, SendDone done) override {
    std::shared_ptr<Conn> c = Find(peer);
    if (!c || c->state.load() != ConnState::kOpen || c->closing.load()) {
      return Error(StatusCode::kUnavailable, "peer {} is not connected", peer);
    }
    if (meta.size() > ps::kMaxMetaBytes || payload_len > ps::kMaxPayloadBytes) {
      return Error(StatusCode::kInvalidArgument,
                   "frame too large: {} bytes of metadata, {} of payload", meta.size(),
                   payload_len);
    }
    header.meta_len = static_cast<uint32_t>(meta.size());
    header.payload_len = payload_len;
    const uint64_t eager_bytes = sizeof(SlotHeader) + sizeof(FrameHeader) + meta.size() + payload_len;
    const bool rendezvous = payload_len > 0 && eager_bytes > c->slot_bytes;
    const uint64_t msg_bytes =
        sizeof(SlotHeader) + sizeof(FrameHeader) + meta.size() + (rendezvous ? 0 : payload_len);
    if (msg_bytes > uint64_t{c->slots} * c->slot_bytes / 2) {
      return Error(StatusCode::kInvalidArgument,
                   "{} bytes of metadata do not fit the RDMA transport's slots", meta.size());
    }
    if (!rendezvous && payload_len > 0 && InDeviceMemory(payload, payload_len)) {
      return Error(StatusCode::kInvalidArgument,
                   "a {}-byte payload in GPU memory is below the {} bytes the RDMA transport "
                   "can send from GPU memory",
                   payload_len, c->slot_bytes);
    }
    MrCache::Ref ref;
    if (rendezvous) {
      auto r = c->dev->cache->Acquire(payload, payload_len);
      if (!r.ok()) return r.status();
      ref = *r;
    }
    std::unique_lock lock(c->mu);
    if (c->state.load() != ConnState::kOpen || c->closing.load()) {
      lock.unlock();
      if (ref) c->dev->cache->Release(ref);
      return Error(StatusCode::kUnavailable, "peer {} is not connected", peer);
    }
    Outgoing* o;
    if (!c->spare.empty()) {
      o = c->spare.back();
      c->spare.pop_back();
    } else {
      o = new Outgoing;
    }
    o->header = header;
    o->meta.assign(meta.begin(), meta.end());
    o->payload = payload;
    o->payload_len = payload_len;
    o->rendezvous = rendezvous;
    o->ref = ref;
    o->done = std::move(done);
    c->queue.push_back(o);
    if (Status st = PostQueuedLocked(*c); !st.ok()) {
      lock.unlock();
      RequestClose(c, st);
    }
    return Status::Ok();
  }

  void Close(PeerId peer) override {
    if (auto c = Find(peer)) {
      RequestClose(c, Error(StatusCode::kAborted, "closed locally"), /*graceful=*/true);
    }
  }

  void Shutdown() override {
    std::lock_guard sl(shutdown_mu_);
    stopping_.store(true);
    Wake();
    if (std::this_thread::get_id() == progress_id_) return;  // the loop finishes after us
    if (progress_.joinable()) progress_.join();
  }

  void Trust(PeerId peer) override {
    std::shared_ptr<Conn> c = Find(peer);
    if (!c || c->trusted.exchange(true)) return;
    std::lock_guard lock(mu_);
    ReleasePendingLocked(*c);
  }

  bool HasUnreadInput(PeerId peer) const override {
    std::shared_ptr<Conn> c = Find(peer);
    return c && c->unread.load();
  }

  std::string PeerAddress(PeerId peer) const override {
    auto c = Find(peer);
    return c ? c->address : fmt::format("peer {}", peer);
  }

  Status RegisterMemory(const void* ptr, size_t bytes) override {
    std::lock_guard lock(mu_);
    pinned_.emplace_back(ptr, bytes);
    Status first;
    for (auto& d : devices_) {
      Status st = d->cache->Pin(ptr, bytes);
      if (first.ok()) first = st;
    }
    return first;
  }

  void ForgetMemory(const void* ptr, size_t bytes) override {
    std::lock_guard lock(mu_);
    std::erase_if(pinned_, [&](const auto& p) { return p.first == ptr; });
    for (auto& d : devices_) d->cache->Invalidate(ptr, bytes);
  }

  // GPUDirect RDMA. Only rendezvous payloads may be device memory: they are written by the
  // NIC from and into registered memory, while eager frames are copied by the CPU through
  // the slots. Every payload of at least slot_bytes goes by rendezvous (it cannot fit a slot
  // with its headers), so that is the threshold.
  Result<uint64_t> EnableDeviceMemory(const ps::DeviceMemory* memory) override {
    if (!memory) return Error(StatusCode::kInvalidArgument, "no device memory given");
    if (std::string why = memory->DmaBufUnsupported(); !why.empty()) {
      return Error(StatusCode::kUnimplemented, "{}", why);
    }
    DSYNC_RETURN_IF_ERROR(DmaBufSupport(choice_.device));
    std::lock_guard lock(mu_);
    device_memory_.store(memory, std::memory_order_release);
    for (auto& d : devices_) d->cache->SetDeviceMemory(memory);
    return uint64_t{options_.slot_bytes};
  }

  RdmaStats stats() const override {
    RdmaStats s;
    s.eager_frames = eager_.load();
    s.rendezvous_frames = rendezvous_.load();
    s.sleeps = sleeps_.load();
    std::lock_guard lock(mu_);
    for (const auto& d : devices_) {
      const MrCache::Stats cs = d->cache->stats();
      s.registrations += cs.registrations;
      s.registration_hits += cs.hits;
      s.device_registrations += cs.device_registrations;
    }
    for (const auto& [id, c] : conns_) {
      std::lock_guard cl(c->mu);
      s.credit_stalls += c->credit_stalls;
    }
    return s;
  }

 private:
  bool InDeviceMemory(const void* p, uint64_t bytes) const {
    const ps::DeviceMemory* m = device_memory_.load(std::memory_order_acquire);
    return m && m->Contains(p, bytes);
  }

  std::shared_ptr<Conn> Find(PeerId peer) const {
    std::lock_guard lock(mu_);
    auto it = conns_.find(peer);
    return it == conns_.end() ? nullptr : it->second;
  }

  void Forget(const std::shared_ptr<Conn>& c) {
    std::lock_guard lock(mu_);
    ReleasePendingLocked(*c);
    if (c->inbound && by_cm_.contains(c->cm)) inbound_.Closed();
    conns_.erase(c->id);
    by_cm_.erase(c->cm);
  }

  void ReleasePendingLocked(Conn& c) {
    if (!c.pending) return;
    c.pending = false;
    inbound_.NoLongerPending(c.source);
  }

  // Strangers past the handshake timeout are dropped (progress thread).
  void ExpireStrangers() {
    const auto now = SteadyClock::now();
    if (now - last_expiry_check_ < std::chrono::milliseconds(50)) return;
    last_expiry_check_ = now;
    std::vector<std::shared_ptr<Conn>> late;
    {
      std::lock_guard lock(mu_);
      for (auto& [id, c] : conns_) {
        if (c->pending && now - c->accepted_at > options_.admission.handshake_timeout) {
          late.push_back(c);
        }
      }
    }
    for (auto& c : late) {
      Teardown(c, Error(StatusCode::kDeadlineExceeded,
                        "{} did not authenticate within the handshake timeout of {} ms",
                        c->address, options_.admission.handshake_timeout.count()));
    }
  }

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // Close requests are carried out by the progress thread, which owns the teardown.
  void RequestClose(const std::shared_ptr<Conn>& c, Status why = {}, bool graceful = false) {
    c->closing.store(true);
    {
      std::lock_guard lock(mu_);
      if (c->why.ok() && !why.ok()) c->why = why;
      if (graceful) c->graceful = true;
      close_requests_.push_back(c);
    }
    Wake();
  }

  Result<DeviceRes*> DeviceFor(ibv_context* ctx) {
    std::lock_guard lock(mu_);
    for (auto& d : devices_) {
      if (d->ctx == ctx) return d.get();
    }
    auto d = std::make_unique<DeviceRes>();
    d->ctx = ctx;
    d->pd = ibv_alloc_pd(ctx);
    if (!d->pd) return Error(StatusCode::kUnavailable, "ibv_alloc_pd: {}", std::strerror(errno));
    d->channel = ibv_create_comp_channel(ctx);
    if (!d->channel) {
      ibv_dealloc_pd(d->pd);
      return Error(StatusCode::kUnavailable, "ibv_create_comp_channel: {}", std::strerror(errno));
    }
    fcntl(d->channel->fd, F_SETFL, fcntl(d->channel->fd, F_GETFL) | O_NONBLOCK);
    d->cache = std::make_unique<MrCache>(d->pd, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (const ps::DeviceMemory* m = device_memory_.load()) d->cache->SetDeviceMemory(m);
    for (const auto& [ptr, bytes] : pinned_) (void)d->cache->Pin(ptr, bytes);  // registered earlier
    devices_.push_back(std::move(d));
    return devices_.back().get();
  }

  // Queue pair, completion queue, rings: everything a connection needs once its device is
  // known (after address resolution, or on a connect request).
  Status SetUp(Conn& c) {
    DSYNC_ASSIGN_OR_RETURN(c.dev, DeviceFor(c.cm->verbs));
    c.slots = options_.slots;
    c.slot_bytes = options_.slot_bytes;
    c.fifo = options_.max_rendezvous;
    // Send queue: every staging slot, a data write per FIFO entry, CTS answers to the peer's
    // rendezvous (its FIFO, twice over: an entry can be reused before our CTS write's
    // completion is polled), one credit return.
    c.sq_depth = c.slots + 3 * c.fifo + 8;
    // Receive queue: one WR per immediate the peer can have in flight, same budget.
    c.rq_depth = c.slots + 3 * c.fifo + 8;
    c.cq = ibv_create_cq(c.cm->verbs, static_cast<int>(c.sq_depth + c.rq_depth), &c, c.dev->channel, 0);
    if (!c.cq) return Error(StatusCode::kUnavailable, "ibv_create_cq: {}", std::strerror(errno));
    ibv_qp_init_attr qa{};
    qa.send_cq = c.cq;
    qa.recv_cq = c.cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = c.sq_depth;
    qa.cap.max_recv_wr = c.rq_depth;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    qa.sq_sig_all = 0;
    if (rdma_create_qp(c.cm, c.dev->pd, &qa) != 0) {
      return Error(StatusCode::kUnavailable, "rdma_create_qp: {}", std::strerror(errno));
    }
    c.qp = c.cm->qp;
    c.mem_bytes = 2 * size_t{c.slots} * c.slot_bytes + 2 * size_t{c.fifo} * sizeof(Cts);
    c.mem = static_cast<std::byte*>(std::aligned_alloc(4096, (c.mem_bytes + 4095) & ~size_t{4095}));
    if (!c.mem) return Error(StatusCode::kUnavailable, "out of memory for RDMA rings");
    std::memset(c.mem, 0, c.mem_bytes);
    c.mr = ibv_reg_mr(c.dev->pd, c.mem, c.mem_bytes,
                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!c.mr) return Error(StatusCode::kUnavailable, "{}", RegistrationError(errno, c.mem_bytes));
    c.stage_busy.assign(c.slots, 0);
    c.stage_done.resize(c.slots);
    c.stage_frags.assign(c.slots, 0);
    c.rdv.resize(c.fifo);
    c.credits = c.slots;
    for (uint32_t i = 0; i < c.rq_depth; ++i) {
      if (Status st = PostRecv(c); !st.ok()) return st;
    }
    return Status::Ok();
  }

  Hello MyHello(const Conn& c) const {
    Hello h;
    h.slots = static_cast<uint16_t>(c.slots);
    h.slot_bytes = c.slot_bytes;
    h.ring_addr = reinterpret_cast<uint64_t>(c.ring());
    h.ring_rkey = c.mr->rkey;
    h.cts_addr = reinterpret_cast<uint64_t>(c.cts_in());
    h.cts_rkey = c.mr->rkey;
    h.fifo = static_cast<uint16_t>(c.fifo);
    return h;
  }

  static Status CheckHello(const Conn& c, const void* data, size_t len, Hello* out) {
    if (!data || len < sizeof(Hello)) {
      return Error(StatusCode::kProtocol, "the peer sent no dsyncps RDMA parameters");
    }
    std::memcpy(out, data, sizeof(Hello));
    if (out->magic != kSlotMagic || out->version != 1) {
      return Error(StatusCode::kProtocol, "the peer is not a dsyncps RDMA transport");
    }
    if (out->slots != c.slots || out->slot_bytes != c.slot_bytes || out->fifo != c.fifo) {
      return Error(StatusCode::kInvalidArgument,
                   "the peer uses {} slots of {} bytes and {} CTS entries, this node {} of {} "
                   "and {}: run every node with the same RDMA settings",
                   out->slots, out->slot_bytes, out->fifo, c.slots, c.slot_bytes, c.fifo);
    }
    return Status::Ok();
  }

  static Status PostRecv(Conn& c) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.num_sge = 0;  // immediate-only: the data went by RDMA WRITE
    if (int err = ibv_post_recv(c.qp, &wr, &bad); err != 0) {
      return Error(StatusCode::kUnavailable, "ibv_post_recv: {}", std::strerror(err));
    }
    return Status::Ok();
  }

  static Status PostWrite(Conn& c, uint64_t wr_id, const void* local, uint32_t lkey, size_t len,
                          uint64_t remote, uint32_t rkey, bool with_imm, uint32_t imm,
                          bool signaled) {
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(local);
    sge.length = static_cast<uint32_t>(len);
    sge.lkey = lkey;
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = len ? &sge : nullptr;
    wr.num_sge = len ? 1 : 0;
    wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    if (int err = ibv_post_send(c.qp, &wr, &bad); err != 0) {
      return Error(StatusCode::kUnavailable, "ibv_post_send: {}", std::strerror(err));
    }
    return Status::Ok();
  }

  // Posts queued messages in order while credits, staging slots, send-queue room and (for
  // rendezvous) CTS FIFO entries allow. Caller holds c.mu.
  Status PostQueuedLocked(Conn& c) {
    while (!c.queue.empty()) {
      Outgoing* o = c.queue.front();
      const uint64_t body = sizeof(FrameHeader) + o->meta.size() + (o->rendezvous ? 0 : o->payload_len);
      const uint64_t total = sizeof(SlotHeader) + body;
      const uint32_t frags = static_cast<uint32_t>((total + c.slot_bytes - 1) / c.slot_bytes);
      // Staging slots bound the slot writes in the send queue; the FIFO bounds the rest.
      bool ready = c.credits >= frags && (!o->rendezvous || c.rdv_used < c.fifo);
      for (uint32_t f = 0; ready && f < frags; ++f) {
        if (c.stage_busy[(c.send_seq + f) % c.slots]) ready = false;
      }
      if (!ready) {
        ++c.credit_stalls;
        return Status::Ok();  // completions or credits will call us again
      }
      uint32_t rts_index = 0;
      if (o->rendezvous) {
        while (c.rdv[c.next_rts % c.fifo].used) ++c.next_rts;
        rts_index = c.next_rts++ % c.fifo;
        RdvOut& r = c.rdv[rts_index];
        r.used = true;
        r.payload = o->payload;
        r.len = o->payload_len;
        r.ref = o->ref;
        r.done = std::move(o->done);
        ++c.rdv_used;
        ++rendezvous_;
      } else {
        ++eager_;
      }
      // Lay the message out over `frags` staging slots (consecutive in ring order).
      SlotHeader sh;
      sh.kind = o->rendezvous ? kSlotRts : kSlotFrame;
      sh.fragments = static_cast<uint16_t>(frags);
      sh.length = static_cast<uint32_t>(body);
      sh.rts_id = rts_index;
      const std::pair<const void*, size_t> parts[] = {
          {&sh, sizeof(sh)},
          {&o->header, sizeof(FrameHeader)},
          {o->meta.data(), o->meta.size()},
          {o->payload, o->rendezvous ? 0 : o->payload_len}};
      uint64_t pos = 0;  // byte offset in the message
      for (const auto& [src, n] : parts) {
        size_t done_bytes = 0;
        while (done_bytes < n) {
          const uint64_t slot = (c.send_seq + pos / c.slot_bytes) % c.slots;
          const uint64_t in_slot = pos % c.slot_bytes;
          const size_t k = static_cast<size_t>(std::min<uint64_t>(n - done_bytes, c.slot_bytes - in_slot));
          std::memcpy(c.stage() + slot * c.slot_bytes + in_slot,
                      static_cast<const std::byte*>(src) + done_bytes, k);
          done_bytes += k;
          pos += k;
        }
      }
      for (uint32_t f = 0; f < frags; ++f) {
        const uint64_t seq = c.send_seq + f;
        const uint32_t slot = static_cast<uint32_t>(seq % c.slots);
        const bool last = f + 1 == frags;
        const size_t len = last ? static_cast<size_t>(total - uint64_t{f} * c.slot_bytes) : c.slot_bytes;
        c.stage_busy[slot] = 1;
        // Earlier fragments are plain writes; the last carries the immediate, and RC
        // delivers in order, so its completion at the peer means the whole message is there.
        DSYNC_RETURN_IF_ERROR(PostWrite(c, MakeWr(kWrSlot, seq), c.stage() + size_t{slot} * c.slot_bytes,
                                        c.mr->lkey, len, c.remote.ring_addr + uint64_t{slot} * c.slot_bytes,
                                        c.remote.ring_rkey, last, MakeImm(kImmSlot, slot), last));
      }
      const uint32_t last_slot = static_cast<uint32_t>((c.send_seq + frags - 1) % c.slots);
      c.stage_frags[last_slot] = frags;
      if (!o->rendezvous) c.stage_done[last_slot] = std::move(o->done);
      c.send_seq += frags;
      c.credits -= frags;
      c.queue.pop_front();
      o->done = nullptr;
      o->ref = {};
      o->payload = nullptr;
      c.spare.push_back(o);
    }
    return Status::Ok();
  }

  // ---- progress thread ----------------------------------------------------------------

  void ProgressLoop() {
    progress_id_ = std::this_thread::get_id();
    auto last_busy = SteadyClock::now();
    while (!stopping_.load()) {
      bool busy = HandleCmEvents();
      busy |= PollCqs();
      busy |= HandleCloseRequests();
      ExpireStrangers();
      const auto now = SteadyClock::now();
      if (busy) {
        last_busy = now;
        continue;
      }
      if (now - last_busy < options_.spin) {
        // Spin politely: on a machine with fewer cores than busy threads (several nodes in
        // one process, a VM) a hard spin would starve the very peer we wait for.
        std::this_thread::yield();
        continue;
      }
      // Arm every CQ, look once more (a completion may have raced the arming), then sleep
      // until the completion channel, the CM channel or a local request wakes us.
      ArmCqs();
      if (PollCqs()) {
        last_busy = SteadyClock::now();
        continue;
      }
      std::vector<pollfd> fds = {{cm_->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      {
        std::lock_guard lock(mu_);
        for (auto& d : devices_) fds.push_back({d->channel->fd, POLLIN, 0});
      }
      ++sleeps_;
      (void)poll(fds.data(), fds.size(), 100);
      uint64_t v;
      while (read(wake_fd_, &v, sizeof(v)) > 0) {
      }
      DrainCqEvents();
      last_busy = SteadyClock::now();
    }
    // Shutdown: listeners first (no new peers), then every connection.
    std::vector<rdma_cm_id*> listeners;
    std::vector<std::shared_ptr<Conn>> all;
    {
      std::lock_guard lock(mu_);
      listeners.swap(listeners_);
      for (auto& [id, c] : conns_) all.push_back(c);
    }
    for (rdma_cm_id* l : listeners) rdma_destroy_id(l);
    // What was sent before Shutdown still leaves (TCP delivers what was written before a
    // close): a scheduler's last kShutdown to its servers must arrive.
    for (auto& c : all) c->closing.store(true);
    DrainSends(all, SteadyClock::now() + std::chrono::seconds(2));
    for (auto& c : all) {
      Teardown(c, Error(StatusCode::kAborted, "transport shut down"));
    }
    // Events of ids already destroyed are gone; ack whatever is left.
    rdma_cm_event* ev = nullptr;
    while (rdma_get_cm_event(cm_, &ev) == 0) rdma_ack_cm_event(ev);
  }

  std::vector<std::shared_ptr<Conn>> OpenConns() {
    std::vector<std::shared_ptr<Conn>> v;
    std::lock_guard lock(mu_);
    v.reserve(conns_.size());
    for (auto& [id, c] : conns_) {
      if (c->cq) v.push_back(c);
    }
    return v;
  }

  void ArmCqs() {
    for (auto& c : OpenConns()) {
      if (c->state.load() != ConnState::kClosed) ibv_req_notify_cq(c->cq, 0);
    }
  }

  void DrainCqEvents() {
    std::vector<ibv_comp_channel*> chans;
    {
      std::lock_guard lock(mu_);
      for (auto& d : devices_) chans.push_back(d->channel);
    }
    for (ibv_comp_channel* ch : chans) {
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      while (ibv_get_cq_event(ch, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
    }
  }

  bool PollCqs() {
    bool any = false;
    ibv_wc wc[32];
    for (auto& c : OpenConns()) {
      if (c->state.load() == ConnState::kClosed) continue;
      const int n = ibv_poll_cq(c->cq, 32, wc);
      if (n < 0) {
        Teardown(c, Error(StatusCode::kUnavailable, "ibv_poll_cq failed"));
        continue;
      }
      for (int i = 0; i < n && c->state.load() != ConnState::kClosed; ++i) {
        any = true;
        HandleCompletion(c, wc[i]);
      }
    }
    return any;
  }

  void HandleCompletion(const std::shared_ptr<Conn>& c, const ibv_wc& wc) {
    if (wc.status != IBV_WC_SUCCESS) {
      Teardown(c, Error(StatusCode::kUnavailable, "RDMA {} to {} failed: {}",
                        wc.opcode & IBV_WC_RECV ? "receive" : "send", c->address,
                        ibv_wc_status_str(wc.status)));
      return;
    }
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      if (Status st = PostRecv(*c); !st.ok()) {
        Teardown(c, st);
        return;
      }
      const uint32_t imm = ntohl(wc.imm_data);
      const uint32_t value = imm & kImmValueMask;
      switch (static_cast<ImmKind>(imm >> 30)) {
        case kImmSlot: {
          // Everything up to this slot has arrived (RC delivers in order).
          const uint64_t at = c->arrived % c->slots;
          c->arrived += (value + c->slots - at) % c->slots + 1;
          c->unread.store(true);
          ProcessRing(c);
          return;
        }
        case kImmCredit:
          AddCredits(c, value);
          return;
        case kImmCts:
          HandleCts(c, value);
          return;
        case kImmData:
          HandleData(c, value);
          return;
      }
      return;
    }
    // Our own send completed.
    const uint64_t kind = wc.wr_id >> 56;
    const uint64_t value = wc.wr_id & ((uint64_t{1} << 56) - 1);
    SendDone done;
    MrCache::Ref release;
    {
      std::lock_guard lock(c->mu);
      if (kind == kWrSlot) {
        const uint32_t slot = static_cast<uint32_t>(value % c->slots);
        const uint32_t frags = c->stage_frags[slot];
        for (uint32_t f = 0; f < frags; ++f) c->stage_busy[(value - f) % c->slots] = 0;
        done = std::move(c->stage_done[slot]);
      } else if (kind == kWrData) {
        RdvOut& r = c->rdv[value];
        done = std::move(r.done);
        release = r.ref;
        r = RdvOut{};
        --c->rdv_used;
      } else if (kind == kWrCredit) {
        c->credit_in_flight = false;
      }
      if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
    }
    if (release) c->dev->cache->Release(release);
    if (done) done(Status::Ok());
    if (kind == kWrCredit) MaybeReturnCredits(c);
  }

  void AddCredits(const std::shared_ptr<Conn>& c, uint32_t n) {
    std::lock_guard lock(c->mu);
    c->credits += n;
    if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
  }

  // Returns consumed slots to the sender a quarter of the ring at a time, one return in
  // flight at most. No stall: a sender short of credits for a message (at most half the
  // ring) means more than half the ring is consumed or on its way to being consumed.
  void MaybeReturnCredits(const std::shared_ptr<Conn>& c) {
    std::lock_guard lock(c->mu);
    if (c->unreported < std::max<uint32_t>(1, c->slots / 4) || c->credit_in_flight ||
        c->state.load() != ConnState::kOpen) {
      return;
    }
    const uint32_t n = c->unreported;
    c->unreported = 0;
    c->credit_in_flight = true;
    Status st = PostWrite(*c, MakeWr(kWrCredit, 0), nullptr, 0, 0, c->remote.cts_addr,
                          c->remote.cts_rkey, true, MakeImm(kImmCredit, n), true);
    if (!st.ok()) c->why = st;
  }

  void HandleCts(const std::shared_ptr<Conn>& c, uint32_t index) {
    if (index >= c->fifo) {
      Teardown(c, Error(StatusCode::kProtocol, "CTS for entry {} of {}", index, c->fifo));
      return;
    }
    const Cts cts = c->cts_in()[index];
    SendDone done;
    MrCache::Ref release;
    {
      std::lock_guard lock(c->mu);
      RdvOut& r = c->rdv[index];
      if (!r.used) {
        Teardown(c, Error(StatusCode::kProtocol, "CTS for an idle rendezvous entry"));
        return;
      }
      if (cts.discard) {  // the receiver does not want the payload: nothing to write
        done = std::move(r.done);
        release = r.ref;
        r = RdvOut{};
        --c->rdv_used;
        if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
      } else {
        Status st = PostWrite(*c, MakeWr(kWrData, index), r.payload, r.ref.mr->lkey,
                              static_cast<size_t>(r.len), cts.addr, cts.rkey, true,
                              MakeImm(kImmData, cts.token), true);
        if (!st.ok()) c->why = st;
      }
    }
    if (release) c->dev->cache->Release(release);
    if (done) done(Status::Ok());
  }

  void HandleData(const std::shared_ptr<Conn>& c, uint32_t token) {
    auto& rin = c->rin;
    if (!rin.active || rin.token != (token & kImmValueMask)) {
      Teardown(c, Error(StatusCode::kProtocol, "unexpected rendezvous data from {}", c->address));
      return;
    }
    rin.active = false;
    c->dev->cache->Release(rin.ref);
    rin.ref = {};
    if (auto* h = handler_.load(); h && !c->closing.load()) {
      h->OnFrame(c->id, rin.header, rin.meta, rin.dest);
    }
    ProcessRing(c);
  }

  void SendCts(const std::shared_ptr<Conn>& c, uint32_t index, const Cts& cts) {
    std::lock_guard lock(c->mu);
    Cts* src = c->cts_out() + index;
    *src = cts;
    Status st = PostWrite(*c, MakeWr(kWrCts, index), src, c->mr->lkey, sizeof(Cts),
                          c->remote.cts_addr + uint64_t{index} * sizeof(Cts), c->remote.cts_rkey,
                          true, MakeImm(kImmCts, index), true);
    if (!st.ok()) c->why = st;
  }

  // Delivers arrived messages in order; stops while a rendezvous payload is on its way, so
  // that the handler sees frames of one peer strictly one after another.
  void ProcessRing(const std::shared_ptr<Conn>& c) {
    ps::TransportHandler* h = handler_.load();
    while (!c->rin.active && c->recv_seq < c->arrived && !c->closing.load() &&
           c->state.load() == ConnState::kOpen) {
      const uint32_t slot = static_cast<uint32_t>(c->recv_seq % c->slots);
      const std::byte* first = c->ring() + size_t{slot} * c->slot_bytes;
      SlotHeader sh;
      std::memcpy(&sh, first, sizeof(sh));
      if (sh.magic != kSlotMagic || sh.fragments == 0 || sh.fragments > c->slots / 2 ||
          sizeof(sh) + uint64_t{sh.length} > uint64_t{sh.fragments} * c->slot_bytes ||
          c->recv_seq + sh.fragments > c->arrived || sh.length < sizeof(FrameHeader)) {
        Teardown(c, Error(StatusCode::kProtocol, "malformed RDMA message from {}", c->address));
        return;
      }
      const std::byte* body = first + sizeof(sh);
      if (sh.fragments > 1) {  // gather the fragments, which may wrap around the ring
        c->reassembly.resize(sh.length);
        uint64_t pos = sizeof(sh);
        for (size_t done = 0; done < sh.length;) {
          const uint64_t s = (c->recv_seq + pos / c->slot_bytes) % c->slots;
          const uint64_t in = pos % c->slot_bytes;
          const size_t k = static_cast<size_t>(std::min<uint64_t>(sh.length - done, c->slot_bytes - in));
          std::memcpy(c->reassembly.data() + done, c->ring() + s * c->slot_bytes + in, k);
          done += k;
          pos += k;
        }
        body = c->reassembly.data();
      }
      FrameHeader fh;
      std::memcpy(&fh, body, sizeof(fh));
      const bool rts = sh.kind == kSlotRts;
      Status valid = ps::ValidateHeader(fh);
      const uint64_t want = sizeof(FrameHeader) + uint64_t{fh.meta_len} + (rts ? 0 : fh.payload_len);
      if (valid.ok() && (want != sh.length || (sh.kind != kSlotFrame && sh.kind != kSlotRts) ||
                         (rts && (fh.payload_len == 0 || sh.rts_id >= c->fifo)))) {
        valid = Error(StatusCode::kProtocol, "inconsistent frame lengths");
      }
      if (valid.ok() && !c->trusted.load()) valid = ps::CheckUnauthenticatedFrame(fh);
      if (!valid.ok()) {
        spdlog::warn("RDMA: dropping the connection from {}: {}", c->address, valid.message());
        Teardown(c, valid.WithContext(fmt::format("frame from {}", c->address)));
        return;
      }
      const std::span<const std::byte> meta(body + sizeof(FrameHeader), fh.meta_len);
      void* dst = h ? h->OnHeader(c->id, fh, meta) : nullptr;
      if (c->closing.load()) {  // closed from inside OnHeader: the payload never comes
        if (dst && fh.payload_len > 0 && h) h->OnPayloadLost(c->id, fh, dst);
        return;
      }
      if (!rts) {
        if (dst && fh.payload_len > 0 && InDeviceMemory(dst, fh.payload_len)) {
          // The CPU cannot copy into GPU memory; a handler must not ask for it (see
          // EnableDeviceMemory).
          if (h) h->OnPayloadLost(c->id, fh, dst);
          Teardown(c, Error(StatusCode::kInternal,
                            "the handler put a {}-byte eager payload in GPU memory",
                            fh.payload_len));
          return;
        }
        if (dst && fh.payload_len > 0) {
          std::memcpy(dst, body + sizeof(FrameHeader) + fh.meta_len, fh.payload_len);
        }
        // Credits go back only after the handler is done with the metadata, which is
        // still in the slot.
        if (h) h->OnFrame(c->id, fh, meta, dst);
        ConsumeSlots(c, sh.fragments);
        continue;
      }
      // Rendezvous: keep header and metadata, consume the slots, ask for the payload.
      Cts cts;
      if (!dst) {
        cts.discard = 1;
        SendCts(c, sh.rts_id, cts);
        if (h) h->OnFrame(c->id, fh, meta, nullptr);
        ConsumeSlots(c, sh.fragments);
        continue;
      }
      auto ref = c->dev->cache->Acquire(dst, fh.payload_len);
      if (!ref.ok()) {
        if (h) h->OnPayloadLost(c->id, fh, dst);
        Teardown(c, ref.status());
        return;
      }
      auto& rin = c->rin;
      rin.active = true;
      rin.header = fh;
      rin.meta.assign(meta.begin(), meta.end());
      rin.dest = dst;
      rin.ref = *ref;
      rin.token = c->next_token++ & kImmValueMask;
      ConsumeSlots(c, sh.fragments);
      cts.addr = reinterpret_cast<uint64_t>(dst);
      cts.rkey = ref->mr->rkey;
      cts.token = rin.token;
      SendCts(c, sh.rts_id, cts);
    }
    c->unread.store(c->recv_seq < c->arrived || c->rin.active);
  }

  void ConsumeSlots(const std::shared_ptr<Conn>& c, uint32_t n) {
    c->recv_seq += n;
    {
      std::lock_guard lock(c->mu);
      c->unreported += n;
    }
    MaybeReturnCredits(c);
  }

  // Polls the connections until their posted sends have completed (bounded): a frame sent
  // just before a close or shutdown still reaches the peer.
  void DrainSends(const std::vector<std::shared_ptr<Conn>>& cs, SteadyClock::time_point deadline) {
    while (true) {
      bool pending = false;
      for (const auto& c : cs) {
        if (c->state.load() != ConnState::kOpen) continue;
        ibv_wc wc[32];
        const int n = ibv_poll_cq(c->cq, 32, wc);
        for (int i = 0; i < n && c->state.load() != ConnState::kClosed; ++i) {
          HandleCompletion(c, wc[i]);
        }
        if (c->state.load() != ConnState::kOpen) continue;
        std::lock_guard lock(c->mu);
        pending = pending || !c->queue.empty() || c->rdv_used > 0 ||
                  std::find(c->stage_busy.begin(), c->stage_busy.end(), 1) != c->stage_busy.end();
      }
      if (!pending || SteadyClock::now() >= deadline) return;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Handles every completion already in the connection's queue.
  void DrainReceived(const std::shared_ptr<Conn>& c) {
    ibv_wc wc[32];
    int n;
    while (c->state.load() == ConnState::kOpen && c->cq && (n = ibv_poll_cq(c->cq, 32, wc)) > 0) {
      for (int i = 0; i < n && c->state.load() == ConnState::kOpen; ++i) HandleCompletion(c, wc[i]);
    }
  }

  bool HandleCloseRequests() {
    std::vector<std::shared_ptr<Conn>> reqs;
    {
      std::lock_guard lock(mu_);
      reqs.swap(close_requests_);
    }
    for (auto& c : reqs) {
      Status why;
      bool graceful;
      {
        std::lock_guard lock(mu_);
        why = c->why;
        graceful = c->graceful;
      }
      if (graceful) DrainSends({c}, SteadyClock::now() + std::chrono::seconds(1));
      Teardown(c, why.ok() ? Error(StatusCode::kAborted, "closed locally") : why);
    }
    return !reqs.empty();
  }

  // Ends a connection once: flushes its work requests (their senders hear of the failure),
  // tells the handler about a payload it will never get and that the peer is gone, then
  // frees the queue pair and memory. Progress thread only.
  void Teardown(const std::shared_ptr<Conn>& c, const Status& why) {
    if (c->state.exchange(ConnState::kClosed) == ConnState::kClosed) return;
    c->closing.store(true);
    if (c->qp) {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;  // flushes every outstanding work request
      ibv_modify_qp(c->qp, &attr, IBV_QP_STATE);
    }
    std::vector<SendDone> failed;
    std::vector<MrCache::Ref> refs;
    {
      std::lock_guard lock(c->mu);
      for (auto& d : c->stage_done) {
        if (d) failed.push_back(std::move(d));
      }
      for (auto& r : c->rdv) {
        if (r.used) {
          if (r.done) failed.push_back(std::move(r.done));
          refs.push_back(r.ref);
          r = RdvOut{};
        }
      }
      for (Outgoing* o : c->queue) {
        if (o->done) failed.push_back(std::move(o->done));
        if (o->ref) refs.push_back(o->ref);
        delete o;
      }
      c->queue.clear();
      for (Outgoing* o : c->spare) delete o;
      c->spare.clear();
    }
    if (c->rin.active) {
      c->rin.active = false;
      refs.push_back(c->rin.ref);
      if (auto* h = handler_.load(); h && c->notified) {
        h->OnPayloadLost(c->id, c->rin.header, c->rin.dest);
      }
    }
    for (auto& r : refs) {
      if (r && c->dev) c->dev->cache->Release(r);
    }
    const Status reason = why.WithContext(fmt::format("RDMA connection to {}", c->address));
    for (auto& d : failed) d(reason);
    {
      std::unique_lock lock(c->wait_mu);
      if (!c->decided) {
        c->decided = true;
        c->outcome = reason;
      }
    }
    c->wait_cv.notify_all();
    if (auto* h = handler_.load(); h && c->notified) h->OnDisconnected(c->id, reason);
    Forget(c);
    if (c->cm) rdma_disconnect(c->cm);
    if (c->qp) {
      // Drain the flushed completions before the CQ goes.
      ibv_wc wc[32];
      while (ibv_poll_cq(c->cq, 32, wc) > 0) {
      }
      rdma_destroy_qp(c->cm);
      c->qp = nullptr;
    }
    if (c->cq) {
      ibv_destroy_cq(c->cq);
      c->cq = nullptr;
    }
    if (c->mr) ibv_dereg_mr(c->mr);
    c->mr = nullptr;
    std::free(c->mem);
    c->mem = nullptr;
    if (c->cm) {
      rdma_destroy_id(c->cm);
      c->cm = nullptr;
    }
  }

  std::shared_ptr<Conn> ConnOf(rdma_cm_id* id) {
    std::lock_guard lock(mu_);
    auto it = by_cm_.find(id);
    return it == by_cm_.end() ? nullptr : it->second;
  }

  void Decide(const std::shared_ptr<Conn>& c, Status outcome, bool refused) {
    {
      std::lock_guard lock(c->wait_mu);
      if (c->decided) return;
      c->decided = true;
      c->outcome = std::move(outcome);
      c->refused = refused;
    }
    c->wait_cv.notify_all();
  }

  bool HandleCmEvents() {
    bool any = false;
    rdma_cm_event* ev = nullptr;
    while (rdma_get_cm_event(cm_, &ev) == 0) {
      any = true;
      // Copy what we need, then acknowledge: rdma_destroy_id waits for acknowledged events.
      const rdma_cm_event_type type = ev->event;
      rdma_cm_id* id = ev->id;
      rdma_cm_id* listen_id = ev->listen_id;
      const int status = ev->status;
      Hello hello;
      Status hello_ok = Status::Ok();
      std::shared_ptr<Conn> conn;
      std::byte pdata[sizeof(Hello)] = {};
      size_t plen = 0;
      (void)listen_id;
      if (type == RDMA_CM_EVENT_CONNECT_REQUEST && ev->param.conn.private_data) {
        plen = std::min<size_t>(ev->param.conn.private_data_len, sizeof(pdata));
        std::memcpy(pdata, ev->param.conn.private_data, plen);
      } else if (type == RDMA_CM_EVENT_ESTABLISHED) {
        conn = ConnOf(id);
        if (conn && !conn->inbound) {
          hello_ok = CheckHello(*conn, ev->param.conn.private_data,
                                ev->param.conn.private_data_len, &hello);
        }
      }
      rdma_ack_cm_event(ev);
      // Accepting (or refusing: destroying the id) only after the acknowledgement:
      // rdma_destroy_id waits for every event of its id to be acknowledged.
      if (type == RDMA_CM_EVENT_CONNECT_REQUEST) {
        Accept(id, plen ? pdata : nullptr, plen);
        continue;
      }
      if (!conn) conn = ConnOf(id);
      if (!conn) continue;  // a connection already torn down
      switch (type) {
        case RDMA_CM_EVENT_ADDR_RESOLVED:
          if (rdma_resolve_route(conn->cm, 2000) != 0) {
            Decide(conn, Error(StatusCode::kUnavailable, "rdma_resolve_route: {}",
                               std::strerror(errno)), false);
          }
          break;
        case RDMA_CM_EVENT_ROUTE_RESOLVED: {
          Status st = SetUp(*conn);
          if (st.ok()) {
            const Hello mine = MyHello(*conn);
            rdma_conn_param p{};
            p.private_data = &mine;
            p.private_data_len = sizeof(mine);
            p.retry_count = 7;
            p.rnr_retry_count = 7;  // 7 = retry forever: a receiver briefly out of WRs is no error
            if (rdma_connect(conn->cm, &p) != 0) {
              st = Error(StatusCode::kUnavailable, "rdma_connect: {}", std::strerror(errno));
            }
          }
          if (!st.ok()) Decide(conn, st, false);
          break;
        }
        case RDMA_CM_EVENT_ESTABLISHED:
          if (!hello_ok.ok()) {
            Decide(conn, hello_ok, false);
            break;
          }
          if (!conn->inbound) conn->remote = hello;
          conn->state.store(ConnState::kOpen);
          conn->notified = true;
          if (auto* h = handler_.load()) h->OnConnected(conn->id, conn->inbound);
          Decide(conn, Status::Ok(), false);
          // The peer may have written before this side saw ESTABLISHED (its QP was ready
          // first): deliver what is already in the ring.
          ProcessRing(conn);
          break;
        case RDMA_CM_EVENT_ADDR_ERROR:
          Decide(conn, Error(StatusCode::kUnavailable,
                             "address resolution failed ({}): is {} on an RDMA netdev's subnet?",
                             std::strerror(-status), conn->address), false);
          break;
        case RDMA_CM_EVENT_ROUTE_ERROR:
        case RDMA_CM_EVENT_UNREACHABLE:
          Decide(conn, Error(StatusCode::kUnavailable, "{} is unreachable over RDMA ({})",
                             conn->address, rdma_event_str(type)), true);
          break;
        case RDMA_CM_EVENT_REJECTED:
          Decide(conn, Error(StatusCode::kUnavailable,
                             "connection refused by {} (nothing listening there over RDMA, or "
                             "it runs with other RDMA settings)",
                             conn->address), true);
          break;
        case RDMA_CM_EVENT_CONNECT_ERROR:
          Decide(conn, Error(StatusCode::kUnavailable, "RDMA connect to {} failed", conn->address),
                 true);
          break;
        case RDMA_CM_EVENT_DISCONNECTED:
          // The peer's last frames arrived before its disconnect request: deliver them.
          DrainReceived(conn);
          [[fallthrough]];
        case RDMA_CM_EVENT_DEVICE_REMOVAL:
          Teardown(conn, Error(StatusCode::kUnavailable, "peer disconnected ({})",
                               rdma_event_str(type)));
          break;
        default:
          break;
      }
    }
    return any;
  }

  // A peer asks to connect: set the connection up and accept, sending our ring and FIFO.
  void Accept(rdma_cm_id* id, const void* pdata, size_t plen) {
    auto conn = std::make_shared<Conn>();
    conn->id = next_peer_++;
    conn->inbound = true;
    conn->trusted.store(false);
    conn->accepted_at = SteadyClock::now();
    conn->cm = id;
    id->context = conn.get();
    conn->address = AddrText(rdma_get_peer_addr(id));
    conn->source = conn->address.substr(0, conn->address.rfind(':'));
    {
      // Refused before its ring is allocated and registered.
      std::string why;
      std::lock_guard lock(mu_);
      if (!inbound_.Admit(conn->source, &why)) {
        const auto now = SteadyClock::now();
        if (now - last_cap_warning_ > std::chrono::seconds(1)) {
          last_cap_warning_ = now;
          spdlog::warn("RDMA: refusing connections from {} for now: {}", conn->address, why);
        }
        rdma_reject(id, nullptr, 0);
        rdma_destroy_id(id);
        return;
      }
      conn->pending = true;
    }
    Status st = SetUp(*conn);
    if (st.ok()) st = CheckHello(*conn, pdata, plen, &conn->remote);
    if (!st.ok()) {
      spdlog::warn("RDMA: refusing {}: {}", conn->address, st.message());
      {
        std::lock_guard lock(mu_);
        ReleasePendingLocked(*conn);
        inbound_.Closed();
      }
      rdma_reject(id, nullptr, 0);
      if (conn->qp) rdma_destroy_qp(id);
      if (conn->cq) ibv_destroy_cq(conn->cq);
      if (conn->mr) ibv_dereg_mr(conn->mr);
      std::free(conn->mem);
      rdma_destroy_id(id);
      return;
    }
    {
      std::lock_guard lock(mu_);
      conns_[conn->id] = conn;
      by_cm_[id] = conn;
    }
    const Hello mine = MyHello(*conn);
    rdma_conn_param p{};
    p.private_data = &mine;
    p.private_data_len = sizeof(mine);
    p.rnr_retry_count = 7;
    if (rdma_accept(id, &p) != 0) {
      Teardown(conn, Error(StatusCode::kUnavailable, "rdma_accept: {}", std::strerror(errno)));
    }
  }

  const RdmaOptions options_;
  const DeviceChoice choice_;
  std::atomic<ps::TransportHandler*> handler_{nullptr};
  std::atomic<PeerId> next_peer_{1};
  rdma_event_channel* cm_ = nullptr;
  int wake_fd_ = -1;
  std::thread progress_;
  std::thread::id progress_id_;
  std::atomic<bool> stopping_{false};
  std::mutex shutdown_mu_;

  mutable std::mutex mu_;  // guards what follows
  std::vector<std::unique_ptr<DeviceRes>> devices_;
  std::vector<rdma_cm_id*> listeners_;
  std::unordered_map<PeerId, std::shared_ptr<Conn>> conns_;
  std::unordered_map<rdma_cm_id*, std::shared_ptr<Conn>> by_cm_;
  std::vector<std::shared_ptr<Conn>> close_requests_;
  std::vector<std::pair<const void*, size_t>> pinned_;  // RegisterMemory'd, for new devices
  ps::InboundCounter inbound_{options_.admission};     // under mu_
  SteadyClock::time_point last_cap_warning_;
  SteadyClock::time_point last_expiry_check_;           // progress thread only
  std::atomic<const ps::DeviceMemory*> device_memory_{nullptr};  // GPUDirect RDMA, once on

  std::atomic<uint64_t> eager_{0}, rendezvous_{0}, sleeps_{0};
};

}  // namespace

Result<std::unique_ptr<RdmaTransport>> MakeRdmaTransport(const RdmaOptions& options) {
  DSYNC_ASSIGN_OR_RETURN(DeviceChoice choice, ChooseDevice(options.device));
  if (options.slots < 4 || options.slots > 4096 || options.slot_bytes < 512 ||
      options.max_rendezvous == 0 || options.max_rendezvous > 1024) {
    return Error(StatusCode::kInvalidArgument, "bad RDMA slot settings");
  }
  auto t = std::make_unique<Rdma>(options, std::move(choice));
  DSYNC_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<RdmaTransport>(std::move(t));
}

}  // namespace dsync::rdma
