#include "ps/takeover.h"

#include <algorithm>

namespace dsync::ps {

void ServerEvents::Lost(NodeId server) {
  events_.push_back({false, server - kFirstServerId, static_cast<uint32_t>(losses_.size())});
  losses_.push_back(server);
}

void ServerEvents::TakenOver(NodeId server, const std::vector<WorkerId>& live) {
  events_.push_back({true, server - kFirstServerId, static_cast<uint32_t>(takeovers_.size())});
  takeovers_.push_back(server);
  auto& from = pushes_from_.emplace_back();
  for (WorkerId w : live) from[w] = kNoClock;
}

void ServerEvents::Pushes(uint32_t index, WorkerId w, Clock clock) {
  if (index >= pushes_from_.size()) return;
  // The first answer counts: a worker answers each takeover once.
  if (auto it = pushes_from_[index].find(w); it != pushes_from_[index].end() &&
                                             it->second == kNoClock) {
    it->second = clock;
  }
}

Clock ServerEvents::PushesFrom(uint32_t index, WorkerId w) const {
  if (index >= pushes_from_.size()) return kNoClock;
  auto it = pushes_from_[index].find(w);
  return it == pushes_from_[index].end() ? 0 : it->second;  // joined later: from its first
}

void ServerEvents::LeftOut(uint32_t losses, WorkerId w, Clock clock,
                           std::vector<bool>& out) const {
  out.assign(num_servers_, false);
  for (const Event& e : events_) {
    if (e.rank >= num_servers_) continue;
    if (!e.takeover) {
      if (e.index < losses) out[e.rank] = true;
    } else if (clock >= PushesFrom(e.index, w)) {
      out[e.rank] = false;
    }
  }
}

Takeover::Takeover(NodeId server, uint32_t index, Round from, const std::vector<WorkerId>& live)
    : server_(server), index_(index), from_(from) {
  for (WorkerId w : live) workers_[w] = {};
}

void Takeover::Pushes(WorkerId w, Clock clock) {
  if (auto it = workers_.find(w); it != workers_.end() && it->second.pushes_from == kNoClock) {
    it->second.pushes_from = clock;
  }
}

void Takeover::Gone(WorkerId w, Clock void_from) {
  Clock& from = workers_[w].void_from;  // one gone before the takeover began is added
  from = std::min(from, void_from);
}

}  // namespace dsync::ps
