// The data path of the RDMA transport: the eager channel and its rendezvous.
// - Eager: a message is copied into registered staging slots and written with RDMA WRITE
//   (WITH IMMEDIATE on its last slot) into the same slots of the peer's ring; the sender
//   spends a credit per slot and gets them back in immediate-only writes once the receiver
//   has consumed the slots.
// - Rendezvous: a ready-to-send message in a slot carries a large frame's header and
//   metadata; the receiver registers the destination its handler names and writes a CTS entry
//   into the sender's FIFO; the sender writes the payload straight there.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>

#include "rdma/rdma_conn.h"

namespace dsync::rdma {

class ConnTable;
class ConnManager;
class Progress;

class EagerChannel {
 public:
  EagerChannel(std::atomic<ps::TransportHandler*>& handler, ConnTable& table, ConnManager& conns,
               Progress& progress)
      : handler_(handler), table_(table), conns_(conns), progress_(progress) {}
  EagerChannel(const EagerChannel&) = delete;
  EagerChannel& operator=(const EagerChannel&) = delete;

  // Transport::Send. Any thread.
  Status Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
              const void* payload, uint64_t payload_len, SendDone done);

  // Progress thread only, as is everything below.
  void HandleCompletion(const std::shared_ptr<Conn>& c, const ibv_wc& wc);
  // Delivers arrived messages in order; stops while a rendezvous payload is on its way, so
  // that the handler sees frames of one peer strictly one after another.
  void ProcessRing(const std::shared_ptr<Conn>& c);

  uint64_t eager_frames() const { return eager_.load(); }
  uint64_t rendezvous_frames() const { return rendezvous_.load(); }

 private:
  Status PostQueuedLocked(Conn& c);
  void AddCredits(const std::shared_ptr<Conn>& c, uint32_t n);
  void MaybeReturnCredits(const std::shared_ptr<Conn>& c);
  void HandleCts(const std::shared_ptr<Conn>& c, uint32_t index);
  void HandleData(const std::shared_ptr<Conn>& c, uint32_t token);
  void SendCts(const std::shared_ptr<Conn>& c, uint32_t index, const Cts& cts);
  void ConsumeSlots(const std::shared_ptr<Conn>& c, uint32_t n);

  std::atomic<ps::TransportHandler*>& handler_;
  ConnTable& table_;
  ConnManager& conns_;
  Progress& progress_;
  std::atomic<uint64_t> eager_{0}, rendezvous_{0};
};

}  // namespace dsync::rdma
