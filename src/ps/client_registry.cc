#include "ps/client_registry.h"

namespace dsync::ps {

void ClientRegistry::Configure(const JobKey& key, NodeId server) {
  std::lock_guard lock(mu_);
  key_ = key;
  server_ = server;
}

void ClientRegistry::Connected(PeerId peer) {
  std::lock_guard lock(mu_);
  peers_[peer] = std::make_unique<Client>();
}

void ClientRegistry::Disconnected(PeerId peer) {
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  if (const NodeId id = it->second->id; id != 0) {
    if (auto c = connected_.find(id); c != connected_.end() && c->second == peer) {
      connected_.erase(c);
    }
  }
  peers_.erase(it);
}

ClientRegistry::Client* ClientRegistry::Find(PeerId peer) {
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  return it == peers_.end() ? nullptr : it->second.get();
}

Result<Tag> ClientRegistry::Admit(PeerId peer, const Hello& hello) {
  std::lock_guard lock(mu_);
  if (!key_) {
    return Error(StatusCode::kUnavailable,
                 "this server is not part of a job yet (the scheduler has not admitted it); "
                 "try again once every server has registered");
  }
  if (hello.role != Role::kWorker || hello.node < kFirstWorkerId) {
    return Error(StatusCode::kPermissionDenied, "only workers and observers connect to servers");
  }
  const bool observer = hello.node >= kFirstObserverId;
  if (hello.observer != observer) {
    return Error(StatusCode::kPermissionDenied, "node {} is not a{} as it claims", hello.node,
                 hello.observer ? "n observer" : " worker");
  }
  if (!hello.credential ||
      !TagsEqual(*hello.credential, ClientCredential(*key_, hello.node, observer))) {
    return Error(StatusCode::kPermissionDenied,
                 "{} {} presented no valid credential: only nodes the scheduler admitted, with "
                 "the credential it gave them, may connect to a server",
                 observer ? "observer" : "worker", hello.node);
  }
  if (auto g = gone_.find(hello.node); g != gone_.end()) {
    return Error(StatusCode::kPermissionDenied,
                 "worker {} is no longer a member of the job (it left or was declared dead)",
                 hello.node);
  }
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Error(StatusCode::kUnavailable, "the connection is gone");
  if (auto c = connected_.find(hello.node); c != connected_.end() && c->second != peer) {
    return Error(StatusCode::kAlreadyExists,
                 "{} {} is already connected to server {}; a second connection under its id is "
                 "refused",
                 observer ? "observer" : "worker", hello.node, server_);
  }
  connected_[hello.node] = peer;
  it->second->id = hello.node;
  it->second->observer = observer;
  return ServerProof(*key_, server_, hello.node);
}

PeerId ClientRegistry::MarkGone(WorkerId w, Clock next_clock) {
  std::lock_guard lock(mu_);
  gone_[w] = next_clock;
  auto c = connected_.find(w);
  return c == connected_.end() ? kNoPeer : c->second;
}

Status ClientRegistry::CheckNotGone(WorkerId w, Clock clock) const {
  std::lock_guard lock(mu_);
  auto it = gone_.find(w);
  if (it != gone_.end() && clock >= it->second) {
    return Error(StatusCode::kAborted,
                 "worker {} is no longer a member of the job; gradient of clock {} discarded", w,
                 clock);
  }
  return Status::Ok();
}

}  // namespace dsync::ps
