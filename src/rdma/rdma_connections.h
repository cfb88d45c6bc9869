// Connection management of the RDMA transport: the rdma_cm event channel, listening,
// connecting and accepting with each side's ring and FIFO in the hello (private data), a
// connection's queue pair, CQ and registered rings, and its teardown.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "rdma/rdma_conn.h"

namespace dsync::rdma {

class ConnTable;
class EagerChannel;
class Progress;

class ConnManager {
 public:
  ConnManager(const RdmaOptions& options, const DeviceChoice& choice,
              std::atomic<ps::TransportHandler*>& handler, ConnTable& table, EagerChannel& eager,
              Progress& progress)
      : options_(options), tunables_(options.tunables), choice_(choice), handler_(handler),
        table_(table), eager_(eager), progress_(progress) {}
  ~ConnManager();  // destroys the event channel (every id is gone by then)
  ConnManager(const ConnManager&) = delete;
  ConnManager& operator=(const ConnManager&) = delete;

  Status Init();  // the rdma_cm event channel
  rdma_event_channel* channel() const { return cm_; }

  Result<uint16_t> Listen(const std::string& host, uint16_t port);
  Result<PeerId> Connect(const std::string& host, uint16_t port, uint32_t timeout_ms);

  // Progress thread only, as is everything below.
  bool HandleCmEvents();
  // Strangers past the handshake timeout are dropped.
  void ExpireStrangers();
  // Ends a connection once: flushes its work requests (their senders hear of the failure),
  // tells the handler about a payload it will never get and that the peer is gone, then
  // frees the queue pair and memory.
  void Teardown(const std::shared_ptr<Conn>& c, const Status& why);

 private:
  Status SetUp(Conn& c);
  Hello MyHello(const Conn& c) const;
  static Status CheckHello(const Conn& c, const void* data, size_t len, Hello* out);
  void Decide(const std::shared_ptr<Conn>& c, Status outcome, bool refused);
  void Accept(rdma_cm_id* id, const void* pdata, size_t plen);

  const RdmaOptions& options_;
  const RdmaTunables& tunables_;
  const DeviceChoice& choice_;
  std::atomic<ps::TransportHandler*>& handler_;
  ConnTable& table_;
  EagerChannel& eager_;
  Progress& progress_;
  rdma_event_channel* cm_ = nullptr;
  std::atomic<PeerId> next_peer_{1};
  SteadyClock::time_point last_expiry_check_;       // progress thread only
  std::vector<std::shared_ptr<Conn>> late_;          // ExpireStrangers' list, reused
};

}  // namespace dsync::rdma
