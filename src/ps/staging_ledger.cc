#include "ps/staging_ledger.h"

#include <algorithm>

namespace dsync::ps {

void StagingLedger::Configure(const JobKey& key, NodeId server, uint32_t num_servers,
                              uint32_t window, uint32_t replicas) {
  std::lock_guard lock(mu_);
  key_ = key;
  server_ = server;
  rank_ = server - kFirstServerId;
  num_servers_ = std::max<uint32_t>(1, num_servers);
  window_ = window;
  replicas_ = std::clamp<uint32_t>(replicas, 1, num_servers_);
}

void StagingLedger::set_window(uint32_t window) {
  std::lock_guard lock(mu_);
  window_ = window;
}

Status StagingLedger::Place(TensorId tensor, uint32_t slices, uint32_t slice, uint32_t replica) {
  std::lock_guard lock(mu_);
  if (replica >= replicas_ || slice >= slices) {
    return Error(StatusCode::kInvalidArgument,
                 "tensor {}: copy {} of slice {} of {} does not exist (the job keeps {} "
                 "cop{} of each slice)",
                 tensor, replica, slice, slices, replicas_, replicas_ == 1 ? "y" : "ies");
  }
  const uint64_t s = num_servers_;
  const auto first = static_cast<uint32_t>((rank_ + 2 * s - slice % s - replica) % s);
  // Copy d of slice k lives here when (first + k + d) mod S == rank: for each d < R, the
  // slices k = k0, k0 + S, ... with k0 = (rank - first - d) mod S. R <= S, so no slice is
  // counted twice.
  uint32_t here = 0;
  for (uint32_t d = 0; d < replicas_; ++d) {
    const auto k0 = static_cast<uint32_t>((rank_ + 2 * s - first - d) % s);
    if (k0 < slices) here += 1 + (slices - 1 - k0) / num_servers_;
  }
  auto [it, fresh] = placement_.try_emplace(tensor, Placement{slices, first, here});
  Placement& p = it->second;
  if (!fresh && (p.slices != slices || p.first_rank != first)) {
    return Error(StatusCode::kInvalidArgument,
                 "tensor {} slice {} does not belong on server rank {}: its other slices here "
                 "place slice 0 on rank {} (every worker must register the same tensors in "
                 "the same order with the same slice size)",
                 tensor, slice, rank_, p.first_rank);
  }
  return Status::Ok();
}

Status StagingLedger::AdmitLocked(WorkerId w, const WorkerLedger* ledger, Clock clock) const {
  if (!ledger) return Status::Ok();
  if (clock < ledger->applied_below) {
    return Error(StatusCode::kFailedPrecondition,
                 "worker {}: clock {} was already applied here; a gradient is pushed once", w,
                 clock);
  }
  const bool known = std::any_of(ledger->clocks.begin(), ledger->clocks.end(),
                                 [&](const ClockSlices& c) { return c.clock == clock; });
  if (!known && ledger->clocks.size() >= window_) {
    return Error(StatusCode::kResourceExhausted,
                 "worker {} already has {} clocks staged on server {}, the most its delay "
                 "bound lets a worker have in flight; clock {} is refused (pull the model and "
                 "wait for earlier pushes before pushing more)",
                 w, ledger->clocks.size(), server_, clock);
  }
  return Status::Ok();
}

Status StagingLedger::Admit(WorkerId w, Clock clock) const {
  std::lock_guard lock(mu_);
  auto it = workers_.find(w);
  return AdmitLocked(w, it == workers_.end() ? nullptr : &it->second, clock);
}

Status StagingLedger::Staged(WorkerId w, Clock clock, TensorId tensor,
                             std::optional<Tag>* receipt) {
  std::lock_guard lock(mu_);
  WorkerLedger& ledger = workers_[w];
  DSYNC_RETURN_IF_ERROR(AdmitLocked(w, &ledger, clock));
  auto c = std::find_if(ledger.clocks.begin(), ledger.clocks.end(),
                        [&](const ClockSlices& x) { return x.clock == clock; });
  if (c == ledger.clocks.end()) {
    ledger.clocks.push_back({clock, 1});
  } else {
    ++c->slices;
  }
  receipt->reset();
  auto place = placement_.find(tensor);
  if (place == placement_.end()) return Status::Ok();  // cannot happen: pushes need a slice
  auto p = std::find_if(progress_.begin(), progress_.end(), [&](const Progress& x) {
    return x.worker == w && x.clock == clock && x.tensor == tensor;
  });
  if (p == progress_.end()) {
    progress_.push_back({w, clock, tensor, 0});
    p = progress_.end() - 1;
  }
  if (++p->staged < place->second.here) return Status::Ok();
  *p = progress_.back();
  progress_.pop_back();
  *receipt = Receipt(key_, {server_, w, clock, tensor, place->second.slices,
                            place->second.first_rank});
  return Status::Ok();
}

void StagingLedger::Applied(WorkerId w, Clock clock) {
  std::lock_guard lock(mu_);
  WorkerLedger& ledger = workers_[w];
  std::erase_if(ledger.clocks, [&](const ClockSlices& c) { return c.clock == clock; });
  ledger.applied_below = std::max(ledger.applied_below, clock + 1);
  std::erase_if(progress_, [&](const Progress& p) { return p.worker == w && p.clock == clock; });
}

void StagingLedger::Gone(WorkerId w, Clock next_clock) {
  std::lock_guard lock(mu_);
  auto it = workers_.find(w);
  if (it != workers_.end()) {
    std::erase_if(it->second.clocks, [&](const ClockSlices& c) { return c.clock >= next_clock; });
  }
  std::erase_if(progress_,
                [&](const Progress& p) { return p.worker == w && p.clock >= next_clock; });
}

}  // namespace dsync::ps
