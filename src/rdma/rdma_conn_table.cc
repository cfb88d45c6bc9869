#include "rdma/rdma_conn_table.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

namespace dsync::rdma {

ConnTable::~ConnTable() {
  for (auto& d : devices_) {
    d->cache.reset();
    if (d->pd) ibv_dealloc_pd(d->pd);
    if (d->channel) ibv_destroy_comp_channel(d->channel);
  }
}

std::shared_ptr<Conn> ConnTable::Find(PeerId peer) const {
  std::lock_guard lock(mu_);
  auto it = conns_.find(peer);
  return it == conns_.end() ? nullptr : it->second;
}

std::shared_ptr<Conn> ConnTable::ConnOf(rdma_cm_id* id) const {
  std::lock_guard lock(mu_);
  auto it = by_cm_.find(id);
  return it == by_cm_.end() ? nullptr : it->second;
}

void ConnTable::Add(const std::shared_ptr<Conn>& c) {
  std::lock_guard lock(mu_);
  conns_[c->id] = c;
  by_cm_[c->cm] = c;
}

void ConnTable::Forget(const std::shared_ptr<Conn>& c) {
  std::lock_guard lock(mu_);
  ReleasePendingLocked(*c);
  if (c->inbound && by_cm_.contains(c->cm)) inbound_.Closed();
  conns_.erase(c->id);
  by_cm_.erase(c->cm);
}

void ConnTable::ReleasePendingLocked(Conn& c) {
  if (!c.pending) return;
  c.pending = false;
  inbound_.NoLongerPending(c.source);
}

bool ConnTable::Admit(Conn& c) {
  std::string why;
  std::lock_guard lock(mu_);
  if (!inbound_.Admit(c.source, &why)) {
    const auto now = SteadyClock::now();
    if (now - last_cap_warning_ > options_.tunables.refusal_warning) {
      last_cap_warning_ = now;
      spdlog::warn("RDMA: refusing connections from {} for now: {}", c.address, why);
    }
    return false;
  }
  c.pending = true;
  return true;
}

void ConnTable::Refused(Conn& c) {
  std::lock_guard lock(mu_);
  ReleasePendingLocked(c);
  inbound_.Closed();
}

void ConnTable::Trust(Conn& c) {
  std::lock_guard lock(mu_);
  ReleasePendingLocked(c);
}

void ConnTable::Open(std::vector<std::shared_ptr<Conn>>& out) const {
  out.clear();
  std::lock_guard lock(mu_);
  for (auto& [id, c] : conns_) {
    if (c->cq) out.push_back(c);
  }
}

void ConnTable::All(std::vector<std::shared_ptr<Conn>>& out) const {
  out.clear();
  std::lock_guard lock(mu_);
  for (auto& [id, c] : conns_) out.push_back(c);
}

void ConnTable::LateStrangers(SteadyClock::time_point now,
                              std::vector<std::shared_ptr<Conn>>& out) const {
  out.clear();
  std::lock_guard lock(mu_);
  for (auto& [id, c] : conns_) {
    if (c->pending && now - c->accepted_at > options_.admission.handshake_timeout) {
      out.push_back(c);
    }
  }
}

void ConnTable::Channels(std::vector<ibv_comp_channel*>& out) const {
  out.clear();
  std::lock_guard lock(mu_);
  for (auto& d : devices_) out.push_back(d->channel);
}

void ConnTable::AddListener(rdma_cm_id* id) {
  std::lock_guard lock(mu_);
  listeners_.push_back(id);
}

void ConnTable::TakeListeners(std::vector<rdma_cm_id*>& out) {
  std::lock_guard lock(mu_);
  out.swap(listeners_);
}

Result<DeviceRes*> ConnTable::DeviceFor(ibv_context* ctx) {
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

Status ConnTable::RegisterMemory(const void* ptr, size_t bytes) {
  std::lock_guard lock(mu_);
  pinned_.emplace_back(ptr, bytes);
  Status first;
  for (auto& d : devices_) {
    Status st = d->cache->Pin(ptr, bytes);
    if (first.ok()) first = st;
  }
  return first;
}

void ConnTable::ForgetMemory(const void* ptr, size_t bytes) {
  std::lock_guard lock(mu_);
  std::erase_if(pinned_, [&](const auto& p) { return p.first == ptr; });
  for (auto& d : devices_) d->cache->Invalidate(ptr, bytes);
}

void ConnTable::SetDeviceMemory(const ps::DeviceMemory* memory) {
  std::lock_guard lock(mu_);
  device_memory_.store(memory, std::memory_order_release);
  for (auto& d : devices_) d->cache->SetDeviceMemory(memory);
}

bool ConnTable::InDeviceMemory(const void* p, uint64_t bytes) const {
  const ps::DeviceMemory* m = device_memory_.load(std::memory_order_acquire);
  return m && m->Contains(p, bytes);
}

void ConnTable::AddStats(RdmaStats& s) const {
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
}

}  // namespace dsync::rdma
