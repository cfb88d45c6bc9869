// The RDMA implementation of the Transport seam: libibverbs for data, librdmacm for
// connection setup, one RC queue pair per peer.
//
// Protocol (see rdma_eager.cc and rdma_connections.cc for the details and the reasons):
// - Small frames (header + metadata + payload fit in one slot) are *eager*: copied into a
//   registered staging slot and written with RDMA WRITE WITH IMMEDIATE into the next slot
//   of a ring the receiver registered for this peer. Credit-based flow control: the sender
//   owns as many credits as the receiver has slots and gets them back in immediate-only
//   writes once the receiver has consumed the slots.
// - Larger payloads go by *rendezvous*: a ready-to-send message in a slot carries the header
//   and metadata; the receiver asks its handler where the payload goes (OnHeader),
//   registers that buffer and writes a clear-to-send entry (address, rkey) into the
//   sender's CTS FIFO, as NCCL does; the sender then writes the payload straight into the
//   destination with RDMA WRITE WITH IMMEDIATE. Zero copies on either side: a pull reply
//   lands in the worker's own tensor buffer.
// - Completions: one progress thread busy-polls while there is traffic and sleeps on the
//   completion channel otherwise (adaptive polling), so an idle node uses no CPU.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>
#include <memory>

#include "dsync/status.h"
#include "ps/transport.h"
#include "rdma/rdma_device.h"

namespace dsync::rdma {

// Every number the RDMA transport runs by, named once. Those with a DSYNC_RDMA_* variable are
// the ones a user may want to change; ReadRdmaTunables reads them where a node builds its
// transport (runtime/backends.cc). slots, slot_bytes and max_rendezvous must be the same on
// every node: each side checks the other's in the connection hello.
struct RdmaTunables {
  // --- the eager ring and the rendezvous FIFO, per connection (every node alike) -----------
  // Eager ring slots per connection and direction, and so the sender's credits: small frames
  // in flight before a sender waits for the receiver to consume some. 32: with 8 KiB slots,
  // 256 KiB registered per direction and connection (DSYNC_RDMA_SLOTS, kMinSlots..kMaxSlots).
  uint32_t slots = 32;
  // Eager frames up to this size, slot header included; larger payloads go by rendezvous,
  // and smaller ones cannot be sent from GPU memory. 8 KiB: control frames and small pushes
  // fit with their metadata, while a payload large enough for a copy to cost goes zero-copy
  // (DSYNC_RDMA_SLOT_BYTES, kMinSlotBytes..kMaxSlotBytes, a multiple of 8 so that the CTS
  // FIFO after the rings stays aligned).
  uint32_t slot_bytes = 8192;
  // Rendezvous sends in flight per connection: the CTS FIFO's entries. Each costs three
  // send- and receive-queue entries (DSYNC_RDMA_MAX_RENDEZVOUS, 1..kMaxRendezvous).
  uint32_t max_rendezvous = 16;
  // What MakeRdmaTransport accepts. The hello carries slots and the FIFO size in 16 bits, and
  // a slot must hold the slot and frame headers. kMaxSlotBytes bounds the variable only: a
  // connection registers 2 x slots x slot_bytes.
  static constexpr uint32_t kMinSlots = 4, kMaxSlots = 4096;
  static constexpr uint32_t kMinSlotBytes = 512, kMaxSlotBytes = 1u << 20;
  static constexpr uint32_t kMaxRendezvous = 1024;
  // slots x slot_bytes at most: a connection registers (pins) twice that, ring and staging.
  static constexpr uint64_t kMaxRingBytes = 64ull << 20;
  // Work requests beyond the sizing rule of each queue (a credit return and some room).
  static constexpr uint32_t kQueueSlack = 8;
  // Consumed slots go back to the sender 1/kCreditReturnDivisor of the ring at a time. 2 or
  // more: a message spans at most half the ring, so a sender short of credits for one then
  // always has a return on its way.
  static constexpr uint32_t kCreditReturnDivisor = 4;

  // --- the progress thread ----------------------------------------------------------------
  // After the last completion the progress thread keeps polling this long before it sleeps
  // on the completion channel: low latency under load, no core burnt when idle
  // (DSYNC_RDMA_SPIN_US, 0..kMaxSpinUs).
  std::chrono::microseconds spin{200};
  static constexpr uint64_t kMaxSpinUs = 1'000'000;
  // Completions taken per ibv_poll_cq call, and per connection and pass of the loop (one busy
  // connection does not starve the others). A compile-time size: the batch is on the stack.
  static constexpr int kCqBatch = 32;
  // The longest the sleeping thread waits in poll(): every event that needs it writes to a
  // file descriptor it polls, so this only bounds how late an idle node drops a stranger
  // past its handshake timeout (10 s by default).
  std::chrono::milliseconds idle_wait{100};
  // How often connections are checked for strangers past the handshake timeout: the check
  // walks every connection under the transport's lock.
  std::chrono::milliseconds stranger_check{50};
  // Shutdown() lets what was sent before it leave for this long (a scheduler's last
  // kShutdown must reach its servers); Close() likewise for its one connection.
  std::chrono::milliseconds shutdown_drain{2000};
  std::chrono::milliseconds close_drain{1000};
  // Between passes of such a drain: sends complete in microseconds on a live link.
  std::chrono::microseconds drain_pause{50};

  // --- connection setup (rdma_cm) -----------------------------------------------------------
  // rdma_resolve_addr's timeout: what is left of Connect()'s, within these bounds: a nearly
  // spent deadline still gets a real try, and one attempt waits for an address (an ARP
  // answer on RoCE) no longer than 2 s.
  std::chrono::milliseconds resolve_addr_min{100};
  std::chrono::milliseconds resolve_addr_max{2000};
  // rdma_resolve_route's timeout: local on RoCE, a path query to the subnet manager on IB.
  std::chrono::milliseconds resolve_route{2000};
  // Connect() waits for the progress thread's verdict this long past its own deadline: the
  // resolutions have timeouts of their own, so this only catches an event that never comes.
  std::chrono::milliseconds connect_grace{5000};
  // Between attempts at a peer that refused (no listener yet, not reachable yet).
  std::chrono::milliseconds connect_retry_pause{50};
  // Times the NIC resends a packet the peer did not acknowledge before the connection fails;
  // 7, the most the field holds: a lossy link is slow rather than broken
  // (DSYNC_RDMA_RETRY_COUNT, 0..7).
  uint8_t retry_count = 7;
  // Likewise after "receiver not ready"; 7 means forever: a receiver briefly out of receive
  // WRs is no error.
  uint8_t rnr_retry_count = 7;
  // Both fields hold 3 bits on the wire (rdma_conn_param).
  static constexpr uint8_t kMaxRetryCount = 7;
  // rdma_listen's backlog: connect requests not yet taken by the progress thread.
  int listen_backlog = 128;
  // Refused inbound connections are logged at most once per this interval (a flood of them
  // must not flood the log).
  std::chrono::milliseconds refusal_warning{1000};
  // Init() warns when the locked-memory limit is below this many connections' rings.
  uint32_t memlock_warn_connections = 64;
};

struct RdmaOptions {
  DeviceOptions device;
  RdmaTunables tunables;
  // Inbound connections before they authenticate (ps/transport.h): each costs a registered
  // ring, so they are capped before any is set up.
  ps::AdmissionLimits admission;
};

// Whether the tunables make a transport: each in its range, and the ring's half large enough
// for the largest control frame (kMaxMetaBytes of metadata), which always goes eagerly.
// MakeRdmaTransport and ReadRdmaTunables both check it.
Status Validate(const RdmaTunables& tunables);
// The DSYNC_RDMA_* variables ReadRdmaTunables reads (settings.cc must know them all: tested).
std::vector<std::string_view> RdmaTunableVariables();

// Sets the tunables named by DSYNC_RDMA_* variables in the process's environment (or in
// `lookup`'s, which returns nullptr for an unset one); the others are left as they are. A bad
// value, or values that together fail Validate, are an error naming the variables, and
// change nothing.
Status ReadRdmaTunables(RdmaTunables& tunables);
Status ReadRdmaTunables(RdmaTunables& tunables,
                        const std::function<const char*(const char*)>& lookup);

struct RdmaStats {
  uint64_t eager_frames = 0;       // sent whole in slots
  uint64_t rendezvous_frames = 0;  // sent by RTS/CTS and a direct write
  uint64_t credit_stalls = 0;      // sends that waited for credits or a staging slot
  uint64_t registrations = 0;      // ibv_reg_mr calls by the registration cache
  uint64_t registration_hits = 0;  // registrations reused
  uint64_t device_registrations = 0;  // of GPU memory, through dma-buf (GPUDirect RDMA)
  uint64_t sleeps = 0;             // times the progress thread slept on the channel
};

class RdmaTransport : public ps::Transport {
 public:
  virtual RdmaStats stats() const = 0;
  virtual const DeviceChoice& device() const = 0;
};

// Unavailable, with what to do, where no usable RDMA device exists.
Result<std::unique_ptr<RdmaTransport>> MakeRdmaTransport(const RdmaOptions& options = {});

}  // namespace dsync::rdma
