#include "rdma/rdma_progress.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "rdma/rdma_conn_table.h"
#include "rdma/rdma_connections.h"
#include "rdma/rdma_eager.h"

namespace dsync::rdma {

Progress::~Progress() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status Progress::Init() {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Error(StatusCode::kInternal, "eventfd: {}", std::strerror(errno));
  return Status::Ok();
}

void Progress::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Progress::Stop() {
  std::lock_guard sl(shutdown_mu_);
  stopping_.store(true);
  Wake();
  if (std::this_thread::get_id() == progress_id_.load()) return;  // the loop finishes after us
  if (thread_.joinable()) thread_.join();
}

void Progress::Join() {
  if (thread_.joinable()) thread_.join();
}

void Progress::Wake() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void Progress::RequestClose(const std::shared_ptr<Conn>& c, Status why, bool graceful) {
  c->closing.store(true);
  {
    // Under the connection's lock, as the eager channel writes why; never with close_mu_ too.
    std::lock_guard lock(c->mu);
    if (c->why.ok() && !why.ok()) c->why = why;
    if (graceful) c->graceful = true;
  }
  {
    std::lock_guard lock(close_mu_);
    close_requests_.push_back(c);
  }
  Wake();
}

void Progress::Loop() {
  progress_id_.store(std::this_thread::get_id());
  auto last_busy = SteadyClock::now();
  while (!stopping_.load()) {
    bool busy = conns_.HandleCmEvents();
    busy |= PollCqs();
    busy |= HandleCloseRequests();
    conns_.ExpireStrangers();
    const auto now = SteadyClock::now();
    if (busy) {
      last_busy = now;
      continue;
    }
    if (now - last_busy < tunables_.spin) {
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
    table_.Channels(channels_);
    fds_.assign({{conns_.channel()->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    for (ibv_comp_channel* ch : channels_) fds_.push_back({ch->fd, POLLIN, 0});
    ++sleeps_;
    (void)poll(fds_.data(), fds_.size(), static_cast<int>(tunables_.idle_wait.count()));
    uint64_t v;
    while (read(wake_fd_, &v, sizeof(v)) > 0) {
    }
    DrainCqEvents();
    last_busy = SteadyClock::now();
  }
  // Shutdown: listeners first (no new peers), then every connection.
  std::vector<rdma_cm_id*> listeners;
  std::vector<std::shared_ptr<Conn>> all;
  table_.TakeListeners(listeners);
  table_.All(all);
  for (rdma_cm_id* l : listeners) rdma_destroy_id(l);
  // What was sent before Shutdown still leaves (TCP delivers what was written before a
  // close): a scheduler's last kShutdown to its servers must arrive.
  for (auto& c : all) c->closing.store(true);
  DrainSends(all, SteadyClock::now() + tunables_.shutdown_drain);
  for (auto& c : all) {
    conns_.Teardown(c, Error(StatusCode::kAborted, "transport shut down"));
  }
  // Events of ids already destroyed are gone; ack whatever is left.
  rdma_cm_event* ev = nullptr;
  while (rdma_get_cm_event(conns_.channel(), &ev) == 0) rdma_ack_cm_event(ev);
}

void Progress::ArmCqs() {
  table_.Open(open_);
  for (auto& c : open_) {
    if (c->state.load() != ConnState::kClosed) ibv_req_notify_cq(c->cq, 0);
  }
  open_.clear();  // no connection kept alive past the pass
}

void Progress::DrainCqEvents() {
  table_.Channels(channels_);
  for (ibv_comp_channel* ch : channels_) {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ibv_get_cq_event(ch, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
  }
}

int Progress::Complete(const std::shared_ptr<Conn>& c, uint32_t batches) {
  return PollCq(c->cq, batches, [&](const ibv_wc& wc) {
    eager_.HandleCompletion(c, wc);
    return c->state.load() != ConnState::kClosed;
  });
}

bool Progress::PollCqs() {
  bool any = false;
  table_.Open(open_);
  for (auto& c : open_) {
    if (c->state.load() == ConnState::kClosed) continue;
    const int n = Complete(c, 1);
    if (n < 0) {
      conns_.Teardown(c, Error(StatusCode::kUnavailable, "ibv_poll_cq failed"));
      continue;
    }
    any = any || n > 0;
  }
  open_.clear();
  return any;
}

// Polls the connections until their posted sends have completed (bounded): a frame sent
// just before a close or shutdown still reaches the peer.
void Progress::DrainSends(std::span<const std::shared_ptr<Conn>> cs,
                          SteadyClock::time_point deadline) {
  while (true) {
    bool pending = false;
    for (const auto& c : cs) {
      if (c->state.load() != ConnState::kOpen) continue;
      Complete(c, 1);
      if (c->state.load() != ConnState::kOpen) continue;
      std::lock_guard lock(c->mu);
      pending = pending || !c->queue.empty() || c->rdv_used > 0 ||
                std::find(c->stage_busy.begin(), c->stage_busy.end(), 1) != c->stage_busy.end();
    }
    if (!pending || SteadyClock::now() >= deadline) return;
    std::this_thread::sleep_for(tunables_.drain_pause);
  }
}

void Progress::DrainReceived(const std::shared_ptr<Conn>& c) {
  if (c->state.load() == ConnState::kOpen && c->cq) Complete(c, kUntilEmpty);
}

bool Progress::HandleCloseRequests() {
  {
    std::lock_guard lock(close_mu_);
    closing_.swap(close_requests_);
  }
  for (auto& c : closing_) {
    Status why;
    bool graceful;
    {
      std::lock_guard lock(c->mu);
      why = c->why;
      graceful = c->graceful;
    }
    if (graceful) DrainSends({&c, 1}, SteadyClock::now() + tunables_.close_drain);
    conns_.Teardown(c, why.ok() ? Error(StatusCode::kAborted, "closed locally") : why);
  }
  const bool any = !closing_.empty();
  closing_.clear();  // both lists keep their capacity, swapped back and forth
  return any;
}

}  // namespace dsync::rdma
