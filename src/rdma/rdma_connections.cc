#include "rdma/rdma_connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "rdma/rdma_conn_table.h"
#include "rdma/rdma_eager.h"
#include "rdma/rdma_progress.h"

namespace dsync::rdma {
namespace {

// The rings are page-aligned: a registration pins whole pages.
constexpr size_t kRingAlignment = 4096;

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

}  // namespace

ConnManager::~ConnManager() {
  if (cm_) rdma_destroy_event_channel(cm_);
}

Status ConnManager::Init() {
  cm_ = rdma_create_event_channel();
  if (!cm_) {
    return Error(StatusCode::kUnavailable, "rdma_create_event_channel: {} ({})",
                 std::strerror(errno), "is the rdma_ucm kernel module loaded?");
  }
  if (fcntl(cm_->fd, F_SETFL, fcntl(cm_->fd, F_GETFL) | O_NONBLOCK) != 0) {
    return Error(StatusCode::kInternal, "fcntl: {}", std::strerror(errno));
  }
  return Status::Ok();
}

Result<uint16_t> ConnManager::Listen(const std::string& host, uint16_t port) {
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
  if (rdma_listen(id, tunables_.listen_backlog) != 0) {
    const int err = errno;
    rdma_destroy_id(id);
    return Error(StatusCode::kUnavailable, "rdma_listen on {}:{}: {}", host, port,
                 std::strerror(err));
  }
  const uint16_t bound = ntohs(rdma_get_src_port(id));
  table_.AddListener(id);
  return bound;
}

Result<PeerId> ConnManager::Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) {
  DSYNC_ASSIGN_OR_RETURN(sockaddr_in dst, ParseAddr(host, port));
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
  Status last;
  while (true) {
    if (progress_.stopping()) return Error(StatusCode::kUnavailable, "transport shut down");
    auto conn = std::make_shared<Conn>();
    conn->id = next_peer_++;
    conn->address = fmt::format("{}:{}", host, port);
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(cm_, &id, conn.get(), RDMA_PS_TCP) != 0) {
      return Error(StatusCode::kUnavailable, "rdma_create_id: {}", std::strerror(errno));
    }
    conn->cm = id;
    table_.Add(conn);
    sockaddr_in src{};
    sockaddr* srcp = nullptr;
    if (!options_.device.device.empty() || options_.device.gid_index >= 0) {
      src.sin_family = AF_INET;
      inet_pton(AF_INET, choice_.ipv4.c_str(), &src.sin_addr);
      srcp = reinterpret_cast<sockaddr*>(&src);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - SteadyClock::now());
    const int resolve_ms = static_cast<int>(std::clamp<int64_t>(
        left.count(), tunables_.resolve_addr_min.count(), tunables_.resolve_addr_max.count()));
    if (rdma_resolve_addr(id, srcp, reinterpret_cast<sockaddr*>(&dst), resolve_ms) != 0) {
      last = Error(StatusCode::kUnavailable, "rdma_resolve_addr {}: {}", conn->address,
                   std::strerror(errno));
      table_.Forget(conn);
      rdma_destroy_id(id);
      return last;
    }
    {
      std::unique_lock lock(conn->wait_mu);
      conn->wait_cv.wait_until(lock, deadline + tunables_.connect_grace,
                               [&] { return conn->decided; });
      if (!conn->decided) {
        conn->decided = true;
        conn->outcome = Error(StatusCode::kDeadlineExceeded, "no answer from {} over RDMA",
                              conn->address);
      }
    }
    if (conn->outcome.ok()) return conn->id;
    last = conn->outcome;
    progress_.RequestClose(conn);  // the progress thread frees what the attempt created
    if (!conn->refused || SteadyClock::now() + tunables_.connect_retry_pause >= deadline) {
      break;
    }
    std::this_thread::sleep_for(tunables_.connect_retry_pause);
  }
  return Error(last.code() == StatusCode::kOk ? StatusCode::kUnavailable : last.code(),
               "cannot connect to {}:{} over RDMA within {} ms: {}", host, port, timeout_ms,
               last.message());
}

void ConnManager::ExpireStrangers() {
  const auto now = SteadyClock::now();
  if (now - last_expiry_check_ < tunables_.stranger_check) return;
  last_expiry_check_ = now;
  table_.LateStrangers(now, late_);
  for (auto& c : late_) {
    Teardown(c, Error(StatusCode::kDeadlineExceeded,
                      "{} did not authenticate within the handshake timeout of {} ms",
                      c->address, options_.admission.handshake_timeout.count()));
  }
  late_.clear();
}

// Queue pair, completion queue, rings: everything a connection needs once its device is
// known (after address resolution, or on a connect request).
Status ConnManager::SetUp(Conn& c) {
  DSYNC_ASSIGN_OR_RETURN(c.dev, table_.DeviceFor(c.cm->verbs));
  c.slots = tunables_.slots;
  c.slot_bytes = tunables_.slot_bytes;
  c.fifo = tunables_.max_rendezvous;
  // Send queue: every staging slot, a data write per FIFO entry, CTS answers to the peer's
  // rendezvous (its FIFO, twice over: an entry can be reused before our CTS write's
  // completion is polled), one credit return.
  c.sq_depth = c.slots + 3 * c.fifo + RdmaTunables::kQueueSlack;
  // Receive queue: one WR per immediate the peer can have in flight, same budget.
  c.rq_depth = c.slots + 3 * c.fifo + RdmaTunables::kQueueSlack;
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
  c.mem = static_cast<std::byte*>(std::aligned_alloc(
      kRingAlignment, (c.mem_bytes + kRingAlignment - 1) & ~(kRingAlignment - 1)));
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

Hello ConnManager::MyHello(const Conn& c) const {
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

Status ConnManager::CheckHello(const Conn& c, const void* data, size_t len, Hello* out) {
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
                 "and {}: run every node with the same DSYNC_RDMA_SLOTS, DSYNC_RDMA_SLOT_BYTES "
                 "and DSYNC_RDMA_MAX_RENDEZVOUS",
                 out->slots, out->slot_bytes, out->fifo, c.slots, c.slot_bytes, c.fifo);
  }
  return Status::Ok();
}

void ConnManager::Teardown(const std::shared_ptr<Conn>& c, const Status& why) {
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
  table_.Forget(c);
  if (c->cm) rdma_disconnect(c->cm);
  if (c->qp) {
    // Drain the flushed completions before the CQ goes.
    PollCq(c->cq, kUntilEmpty, [](const ibv_wc&) { return true; });
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

void ConnManager::Decide(const std::shared_ptr<Conn>& c, Status outcome, bool refused) {
  {
    std::lock_guard lock(c->wait_mu);
    if (c->decided) return;
    c->decided = true;
    c->outcome = std::move(outcome);
    c->refused = refused;
  }
  c->wait_cv.notify_all();
}

bool ConnManager::HandleCmEvents() {
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
      conn = table_.ConnOf(id);
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
    if (!conn) conn = table_.ConnOf(id);
    if (!conn) continue;  // a connection already torn down
    switch (type) {
      case RDMA_CM_EVENT_ADDR_RESOLVED:
        if (rdma_resolve_route(conn->cm, static_cast<int>(tunables_.resolve_route.count())) != 0) {
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
          p.retry_count = tunables_.retry_count;
          p.rnr_retry_count = tunables_.rnr_retry_count;
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
        eager_.ProcessRing(conn);
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
                           "it runs with other DSYNC_RDMA_SLOTS, DSYNC_RDMA_SLOT_BYTES or "
                           "DSYNC_RDMA_MAX_RENDEZVOUS: its log names them)",
                           conn->address), true);
        break;
      case RDMA_CM_EVENT_CONNECT_ERROR:
        Decide(conn, Error(StatusCode::kUnavailable, "RDMA connect to {} failed", conn->address),
               true);
        break;
      case RDMA_CM_EVENT_DISCONNECTED:
        // The peer's last frames arrived before its disconnect request: deliver them.
        progress_.DrainReceived(conn);
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
void ConnManager::Accept(rdma_cm_id* id, const void* pdata, size_t plen) {
  auto conn = std::make_shared<Conn>();
  conn->id = next_peer_++;
  conn->inbound = true;
  conn->trusted.store(false);
  conn->accepted_at = SteadyClock::now();
  conn->cm = id;
  id->context = conn.get();
  conn->address = AddrText(rdma_get_peer_addr(id));
  conn->source = conn->address.substr(0, conn->address.rfind(':'));
  if (!table_.Admit(*conn)) {  // refused before its ring is allocated and registered
    rdma_reject(id, nullptr, 0);
    rdma_destroy_id(id);
    return;
  }
  Status st = SetUp(*conn);
  if (st.ok()) st = CheckHello(*conn, pdata, plen, &conn->remote);
  if (!st.ok()) {
    spdlog::warn("RDMA: refusing {}: {}", conn->address, st.message());
    table_.Refused(*conn);
    rdma_reject(id, nullptr, 0);
    if (conn->qp) rdma_destroy_qp(id);
    if (conn->cq) ibv_destroy_cq(conn->cq);
    if (conn->mr) ibv_dereg_mr(conn->mr);
    std::free(conn->mem);
    rdma_destroy_id(id);
    return;
  }
  table_.Add(conn);
  const Hello mine = MyHello(*conn);
  rdma_conn_param p{};
  p.private_data = &mine;
  p.private_data_len = sizeof(mine);
  p.rnr_retry_count = tunables_.rnr_retry_count;
  if (rdma_accept(id, &p) != 0) {
    Teardown(conn, Error(StatusCode::kUnavailable, "rdma_accept: {}", std::strerror(errno)));
  }
}

}  // namespace dsync::rdma
