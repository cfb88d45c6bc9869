// What the parts of the RDMA transport share: the wire formats, one connection's state, and
// the two loops each part would otherwise write again (taking completions off a CQ, copying a
// message over ring slots). The parts, as NCCL's net_ib is split:
//   rdma_conn_table.*   the connections and devices of a transport, under the table's lock
//   rdma_connections.*  rdma_cm: listen, connect, accept, the hello, QP/CQ setup, teardown
//   rdma_eager.*        the eager ring (slots, credits) and its rendezvous (CTS, direct write)
//   rdma_progress.*     the progress thread: CQs, CM and CQ events, close requests, drains
//   rdma_transport.cc   the RdmaTransport facade that wires them
// Internal to src/rdma.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dsync/status.h"
#include "ps/transport.h"
#include "rdma/mr_cache.h"
#include "rdma/rdma_transport.h"

namespace dsync::rdma {

using ps::FrameHeader;
using ps::PeerId;
using ps::SendDone;
using SteadyClock = std::chrono::steady_clock;

// Immediate data: 2 bits of kind, 30 bits of value. Every WRITE WITH IMMEDIATE consumes one
// receive WR on the peer and raises one completion there; plain writes raise none.
enum ImmKind : uint32_t { kImmSlot = 0, kImmCredit = 1, kImmCts = 2, kImmData = 3 };
inline constexpr uint32_t kImmValueMask = (1u << 30) - 1;
inline uint32_t MakeImm(ImmKind kind, uint32_t value) {
  return (kind << 30) | (value & kImmValueMask);
}

// Send work-request ids: kind in the top byte, value below.
enum WrKind : uint64_t { kWrSlot = 1, kWrCts = 2, kWrCredit = 3, kWrData = 4 };
inline uint64_t MakeWr(WrKind kind, uint64_t value) { return (uint64_t{kind} << 56) | value; }

inline constexpr uint32_t kSlotMagic = 0x4d534452;  // "RDSM"
enum SlotKind : uint16_t { kSlotFrame = 1, kSlotRts = 2 };

// At the start of a message's first slot. A message spans `fragments` consecutive slots of
// the ring (only frames with large metadata need more than one).
struct SlotHeader {
  uint32_t magic = kSlotMagic;
  uint16_t kind = 0;
  uint16_t fragments = 1;
  uint32_t length = 0;  // bytes after this header: frame header, metadata, eager payload
  uint32_t rts_id = 0;  // kSlotRts: index of the sender's CTS FIFO entry to answer in
};
static_assert(sizeof(SlotHeader) == 16);

// Written by a receiver into the sender's CTS FIFO (NCCL's "clear to send"): where the
// payload goes, or that the handler discards it.
struct Cts {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t token = 0;
  uint32_t discard = 0;
  uint32_t pad = 0;
};
static_assert(sizeof(Cts) == 24);

// Exchanged as rdma_cm private data (at most 56 bytes in a connect request).
struct Hello {
  uint32_t magic = kSlotMagic;
  uint16_t version = 1;
  uint16_t slots = 0;
  uint32_t slot_bytes = 0;
  uint32_t ring_rkey = 0;
  uint64_t ring_addr = 0;
  uint64_t cts_addr = 0;
  uint32_t cts_rkey = 0;
  uint16_t fifo = 0;
  uint16_t pad = 0;
};
static_assert(sizeof(Hello) == 40);

// Per device context: rdma_cm picks the device from the address, so there may be several.
struct DeviceRes {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  std::unique_ptr<MrCache> cache;
};

struct Outgoing {
  FrameHeader header;
  std::vector<std::byte> meta;  // capacity kept: entries are reused
  const void* payload = nullptr;
  uint64_t payload_len = 0;
  bool rendezvous = false;
  MrCache::Ref ref;  // rendezvous: the payload's registration
  SendDone done;
};

struct RdvOut {
  bool used = false;
  const void* payload = nullptr;
  uint64_t len = 0;
  MrCache::Ref ref;
  SendDone done;
};

enum class ConnState { kConnecting, kOpen, kClosed };

struct Conn {
  PeerId id = ps::kNoPeer;
  bool inbound = false;
  // Inbound peers are strangers until the handler calls Trust(): one small hello at most,
  // within the handshake timeout (ps/transport.h).
  std::atomic<bool> trusted{true};
  bool pending = false;  // counted in the pending caps (under the table's lock)
  std::string source;    // inbound: the peer's address without the port
  std::chrono::steady_clock::time_point accepted_at;
  std::atomic<bool> unread{false};  // arrived messages not yet delivered (progress thread)
  rdma_cm_id* cm = nullptr;
  DeviceRes* dev = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  std::string address;
  uint32_t slots = 0, slot_bytes = 0, fifo = 0, sq_depth = 0, rq_depth = 0;

  // One registered block: receive ring | staging ring | CTS FIFO (written by the peer) |
  // outgoing CTS entries (sources of our CTS writes).
  std::byte* mem = nullptr;
  size_t mem_bytes = 0;
  ibv_mr* mr = nullptr;
  std::byte* ring() const { return mem; }
  std::byte* stage() const { return mem + size_t{slots} * slot_bytes; }
  Cts* cts_in() const { return reinterpret_cast<Cts*>(mem + 2 * size_t{slots} * slot_bytes); }
  Cts* cts_out() const { return cts_in() + fifo; }

  Hello remote;  // the peer's ring and FIFO

  std::atomic<ConnState> state{ConnState::kConnecting};
  std::atomic<bool> closing{false};  // Close() asked: deliver nothing more
  bool graceful = false;             // Close(): let what was sent before it leave first (mu)
  bool notified = false;             // OnConnected ran (so OnDisconnected must)
  Status why;                        // the first error, set under mu

  // Send side, under mu (any thread).
  std::mutex mu;
  uint32_t credits = 0;
  uint64_t send_seq = 0;
  std::vector<uint8_t> stage_busy;
  std::vector<SendDone> stage_done;  // by the message's last slot
  std::vector<uint32_t> stage_frags;  // by the message's last slot: slots it spans
  std::deque<Outgoing*> queue;
  std::vector<Outgoing*> spare;
  std::vector<RdvOut> rdv;
  uint32_t rdv_used = 0;
  uint32_t next_rts = 0;
  uint64_t credit_stalls = 0;

  // Receive side, progress thread only.
  uint64_t recv_seq = 0;     // next slot to process
  uint64_t arrived = 0;      // slots that have arrived
  uint32_t unreported = 0;   // consumed slots not yet returned as credits
  bool credit_in_flight = false;
  uint32_t next_token = 1;
  struct {
    bool active = false;
    FrameHeader header;
    std::vector<std::byte> meta;
    void* dest = nullptr;
    MrCache::Ref ref;
    uint32_t token = 0;
  } rin;
  std::vector<std::byte> reassembly;

  // Connect(): the caller waits for the progress thread's verdict.
  std::mutex wait_mu;
  std::condition_variable wait_cv;
  bool decided = false;
  Status outcome;
  bool refused = false;  // retry-able: no listener yet, or not reachable yet
};

// Posting to a connection's queues (rdma_conn.cc).
Status PostRecv(Conn& c);
Status PostWrite(Conn& c, uint64_t wr_id, const void* local, uint32_t lkey, size_t len,
                 uint64_t remote, uint32_t rkey, bool with_imm, uint32_t imm, bool signaled);

// PollCq's batch limit for "until the queue is empty".
inline constexpr uint32_t kUntilEmpty = UINT32_MAX;

// The one way completions are taken off a CQ: RdmaTunables::kCqBatch per ibv_poll_cq call,
// each handed to `handle`, which returns false once its connection has closed (what is left
// was flushed: the teardown takes it). Stops at an empty queue or after `max_batches` calls.
// Returns the completions handled, or -1 when ibv_poll_cq failed.
template <typename Handle>
int PollCq(ibv_cq* cq, uint32_t max_batches, Handle&& handle) {
  ibv_wc wc[RdmaTunables::kCqBatch];
  int handled = 0;
  for (uint32_t b = 0; b < max_batches; ++b) {
    const int n = ibv_poll_cq(cq, RdmaTunables::kCqBatch, wc);
    if (n < 0) return -1;
    if (n == 0) break;
    for (int i = 0; i < n; ++i) {
      ++handled;
      if (!handle(wc[i])) return handled;
    }
  }
  return handled;
}

// Bytes [pos, pos + n) of a message that starts in slot `seq` of a ring of `slots` slots of
// `slot_bytes`, cut where a slot ends: piece(offset in the ring, offset in the n bytes,
// length). A message's slots are consecutive in ring order and wrap around its end.
template <typename Piece>
void ForRingPieces(uint32_t slots, uint32_t slot_bytes, uint64_t seq, uint64_t pos, size_t n,
                   Piece&& piece) {
  for (size_t done = 0; done < n;) {
    const uint64_t slot = (seq + pos / slot_bytes) % slots;
    const uint64_t in_slot = pos % slot_bytes;
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n - done, slot_bytes - in_slot));
    piece(static_cast<size_t>(slot * slot_bytes + in_slot), done, k);
    done += k;
    pos += k;
  }
}

// Copies n bytes into the ring at byte `pos` of the message starting in slot `seq`.
inline void CopyToRing(std::byte* ring, const Conn& c, uint64_t seq, uint64_t pos,
                       const void* src, size_t n) {
  ForRingPieces(c.slots, c.slot_bytes, seq, pos, n, [&](size_t at, size_t done, size_t k) {
    std::memcpy(ring + at, static_cast<const std::byte*>(src) + done, k);
  });
}

// Copies n bytes out of the ring from byte `pos` of the message starting in slot `seq`.
inline void CopyFromRing(const std::byte* ring, const Conn& c, uint64_t seq, uint64_t pos,
                         void* dst, size_t n) {
  ForRingPieces(c.slots, c.slot_bytes, seq, pos, n, [&](size_t at, size_t done, size_t k) {
    std::memcpy(static_cast<std::byte*>(dst) + done, ring + at, k);
  });
}

}  // namespace dsync::rdma
