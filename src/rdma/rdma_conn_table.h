// The connections, listeners and devices of one RDMA transport, under its one lock: what
// every other part looks up, and the inbound admission counts (ps/inbound_counter.h).
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ps/device_memory.h"
#include "ps/inbound_counter.h"
#include "rdma/rdma_conn.h"

namespace dsync::rdma {

class ConnTable {
 public:
  explicit ConnTable(const RdmaOptions& options) : options_(options) {}
  ~ConnTable();  // frees the devices' protection domains and channels
  ConnTable(const ConnTable&) = delete;
  ConnTable& operator=(const ConnTable&) = delete;

  std::shared_ptr<Conn> Find(PeerId peer) const;
  std::shared_ptr<Conn> ConnOf(rdma_cm_id* id) const;
  void Add(const std::shared_ptr<Conn>& c);
  void Forget(const std::shared_ptr<Conn>& c);

  // An inbound connection before its ring is set up: counted as pending, or refused (false,
  // logged at most once per RdmaTunables::refusal_warning).
  bool Admit(Conn& c);
  // An admitted connection that was refused after all (its setup or hello failed).
  void Refused(Conn& c);
  // The handler trusts the peer: it no longer counts against the pending caps.
  void Trust(Conn& c);

  // The lists are cleared and filled, their capacity kept: the progress loop reuses them.
  void Open(std::vector<std::shared_ptr<Conn>>& out) const;  // those with a CQ
  void All(std::vector<std::shared_ptr<Conn>>& out) const;
  // Pending strangers accepted more than the handshake timeout before `now`.
  void LateStrangers(SteadyClock::time_point now, std::vector<std::shared_ptr<Conn>>& out) const;
  void Channels(std::vector<ibv_comp_channel*>& out) const;  // the devices' completion channels

  void AddListener(rdma_cm_id* id);
  void TakeListeners(std::vector<rdma_cm_id*>& out);

  Result<DeviceRes*> DeviceFor(ibv_context* ctx);

  Status RegisterMemory(const void* ptr, size_t bytes);
  void ForgetMemory(const void* ptr, size_t bytes);
  void SetDeviceMemory(const ps::DeviceMemory* memory);
  bool InDeviceMemory(const void* p, uint64_t bytes) const;

  // Adds the registration caches' counts and the connections' credit stalls.
  void AddStats(RdmaStats& s) const;

 private:
  void ReleasePendingLocked(Conn& c);

  const RdmaOptions& options_;
  mutable std::mutex mu_;  // guards what follows
  std::vector<std::unique_ptr<DeviceRes>> devices_;
  std::vector<rdma_cm_id*> listeners_;
  std::unordered_map<PeerId, std::shared_ptr<Conn>> conns_;
  std::unordered_map<rdma_cm_id*, std::shared_ptr<Conn>> by_cm_;
  std::vector<std::pair<const void*, size_t>> pinned_;  // RegisterMemory'd, for new devices
  ps::InboundCounter inbound_{options_.admission};
  SteadyClock::time_point last_cap_warning_;
  std::atomic<const ps::DeviceMemory*> device_memory_{nullptr};  // GPUDirect RDMA, once on
};

}  // namespace dsync::rdma
