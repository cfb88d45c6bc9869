// A server's view of its clients (workers and observers): who each connection proved to be,
// and which workers are gone. A client proves itself with the credential the scheduler gave
// it at admission (ps/keys.h); one connection per client id at a time, and never again once
// the scheduler said the worker is gone.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/handshake.h"
#include "ps/keys.h"
#include "ps/transport.h"

namespace dsync::ps {

class ClientRegistry {
 public:
  // Per connection. The transport's threading contract makes its frames sequential, so the
  // reader thread of a connection may use these fields without the registry's lock.
  struct Client {
    NodeId id = 0;           // 0 until the hello is accepted
    bool observer = false;   // read-only: pulls only
    Status verdict;          // OnHeader's judgement of the frame being read
    bool init_exists = false;
    bool drop_quietly = false;  // the frame is dropped without an answer (OnHeader's call)
    bool doomed = false;     // refused and being dropped: its frames are ignored
  };

  // Known once the scheduler admitted this server; until then every hello is refused.
  void Configure(const JobKey& key, NodeId server);

  void Connected(PeerId peer);
  void Disconnected(PeerId peer);
  // Stable while the peer is connected.
  Client* Find(PeerId peer);

  // Checks a hello whose token was already accepted: a live admission (the credential the
  // scheduler derived for this id and kind, not gone) and no other connection under the id.
  // On success the connection is that client's and the server's proof is returned.
  Result<Tag> Admit(PeerId peer, const Hello& hello);

  // The scheduler says worker w is gone: its clocks from next_clock on are void. Returns its
  // connection to drop, if it has one.
  PeerId MarkGone(WorkerId w, Clock next_clock);
  // kAborted when w's gradient of `clock` can no longer be staged.
  Status CheckNotGone(WorkerId w, Clock clock) const;

 private:
  mutable std::mutex mu_;
  std::optional<JobKey> key_;
  NodeId server_ = 0;
  std::unordered_map<PeerId, std::unique_ptr<Client>> peers_;
  std::unordered_map<NodeId, PeerId> connected_;  // client id -> its one connection
  std::unordered_map<WorkerId, Clock> gone_;      // worker -> first void clock
};

}  // namespace dsync::ps
