// A new server taking a lost rank's place, so that the copies the lost server held exist
// again (docs/design.md, "Recreating lost copies"):
// - ServerEvents: the losses and takeovers in the order the scheduler decided them, and for
//   each takeover the first clock each worker pushed to the new server from: which servers'
//   receipts a worker's commit must carry.
// - Takeover: when the other servers may copy the rank's slices to the new server. A copy of
//   version V is enough once no round from V on names a gradient the new server did not get:
//   every clock a worker pushed before it pushed to the new server is in a round before V.
#pragma once

#include <cstdint>
#include <limits>
#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "dsync/types.h"

namespace dsync::ps {

constexpr Clock kNoClock = std::numeric_limits<Clock>::max();

class ServerEvents {
 public:
  explicit ServerEvents(uint32_t num_servers) : num_servers_(num_servers) {}

  // The next loss, and the next takeover of a rank. `live`: the workers live now, each of
  // which will say from which clock on it pushes to the new server (Pushes); workers that
  // join later push to it from their first clock.
  void Lost(NodeId server);
  void TakenOver(NodeId server, const std::vector<WorkerId>& live);
  // Worker w pushes its clocks from `clock` on to the server of takeover `index` (its first
  // answer; a worker answers once).
  void Pushes(uint32_t index, WorkerId w, Clock clock);
  // The first clock w pushes to the server of takeover `index` from (kNoClock: none yet).
  Clock PushesFrom(uint32_t index, WorkerId w) const;

  const std::vector<NodeId>& losses() const { return losses_; }
  const std::vector<NodeId>& takeovers() const { return takeovers_; }

  // By rank, the servers whose receipts a commit of w's `clock` leaves out, when the worker
  // knew of the first `losses` losses: the last event of each rank that applies to the
  // commit decides, a loss among the first `losses`, or a takeover whose server w pushed
  // that clock to.
  void LeftOut(uint32_t losses, WorkerId w, Clock clock, std::vector<bool>& out) const;

 private:
  struct Event {
    bool takeover = false;
    uint32_t rank = 0;
    uint32_t index = 0;  // among losses, or among takeovers
  };
  uint32_t num_servers_;
  std::vector<Event> events_;
  std::vector<NodeId> losses_;
  std::vector<NodeId> takeovers_;
  // Per takeover: the workers live when it was announced -> the first clock each pushes to
  // the new server (kNoClock until it says).
  std::vector<std::map<WorkerId, Clock>> pushes_from_;
};

class Takeover {
 public:
  // Takeover number `index` of `server`'s rank, announced when `from` rounds were sent;
  // `live`: the workers live then.
  Takeover(NodeId server, uint32_t index, Round from, const std::vector<WorkerId>& live);

  NodeId server() const { return server_; }
  uint32_t index() const { return index_; }
  Round from() const { return from_; }

  // w pushes to the new server from `clock` on (its first answer); w is gone, its clocks
  // from `void_from` on were never committed (a worker gone before the takeover began, with
  // commits no round placed yet, is added).
  void Pushes(WorkerId w, Clock clock);
  void Gone(WorkerId w, Clock void_from);

  // Whether the copies may be taken at the version of the rounds sent so far: every clock of
  // every worker that did not go to the new server is in a round already sent.
  // `placed_next(w)`: the next clock of w no round sent names.
  template <class PlacedNext>
  bool Ready(PlacedNext placed_next) const {
    for (const auto& [w, s] : workers_) {
      const Clock need = std::min(s.pushes_from, s.void_from);
      if (need == kNoClock || placed_next(w) < need) return false;
    }
    return true;
  }

  // The version the copies are of, once decided (Ready).
  std::optional<Version> copy_at;
  uint32_t copies_expected = 0;  // servers that send copies
  uint32_t copies_relayed = 0;   // of them, those that sent their last

 private:
  struct WorkerState {
    Clock pushes_from = kNoClock;
    Clock void_from = kNoClock;
  };
  NodeId server_;
  uint32_t index_;
  Round from_;
  std::map<WorkerId, WorkerState> workers_;
};

}  // namespace dsync::ps
