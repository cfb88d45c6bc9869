#include "rdma/rdma_eager.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "rdma/rdma_conn_table.h"
#include "rdma/rdma_connections.h"
#include "rdma/rdma_progress.h"

namespace dsync::rdma {

Status EagerChannel::Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
                          const void* payload, uint64_t payload_len, SendDone done) {
  std::shared_ptr<Conn> c = table_.Find(peer);
  if (!c || c->state.load() != ConnState::kOpen || c->closing.load()) {
    return Error(StatusCode::kUnavailable, "peer {} is not connected", peer);
  }
  if (meta.size() > ps::kMaxMetaBytes || payload_len > ps::kMaxPayloadBytes) {
    return Error(StatusCode::kInvalidArgument,
                 "frame too large: {} bytes of metadata, {} of payload", meta.size(),
                 payload_len);
  }
  header.meta_len = static_cast<uint32_t>(meta.size());
  header.payload_len = payload_len;
  const uint64_t eager_bytes = sizeof(SlotHeader) + sizeof(FrameHeader) + meta.size() + payload_len;
  const bool rendezvous = payload_len > 0 && eager_bytes > c->slot_bytes;
  const uint64_t msg_bytes =
      sizeof(SlotHeader) + sizeof(FrameHeader) + meta.size() + (rendezvous ? 0 : payload_len);
  if (msg_bytes > uint64_t{c->slots} * c->slot_bytes / 2) {
    return Error(StatusCode::kInvalidArgument,
                 "{} bytes of metadata do not fit the RDMA transport's slots", meta.size());
  }
  if (!rendezvous && payload_len > 0 && table_.InDeviceMemory(payload, payload_len)) {
    return Error(StatusCode::kInvalidArgument,
                 "a {}-byte payload in GPU memory is below the {} bytes the RDMA transport "
                 "can send from GPU memory",
                 payload_len, c->slot_bytes);
  }
  MrCache::Ref ref;
  if (rendezvous) {
    auto r = c->dev->cache->Acquire(payload, payload_len);
    if (!r.ok()) return r.status();
    ref = *r;
  }
  std::unique_lock lock(c->mu);
  if (c->state.load() != ConnState::kOpen || c->closing.load()) {
    lock.unlock();
    if (ref) c->dev->cache->Release(ref);
    return Error(StatusCode::kUnavailable, "peer {} is not connected", peer);
  }
  Outgoing* o;
  if (!c->spare.empty()) {
    o = c->spare.back();
    c->spare.pop_back();
  } else {
    o = new Outgoing;
  }
  o->header = header;
  o->meta.assign(meta.begin(), meta.end());
  o->payload = payload;
  o->payload_len = payload_len;
  o->rendezvous = rendezvous;
  o->ref = ref;
  o->done = std::move(done);
  c->queue.push_back(o);
  if (Status st = PostQueuedLocked(*c); !st.ok()) {
    lock.unlock();
    progress_.RequestClose(c, st);
  }
  return Status::Ok();
}

// Posts queued messages in order while credits, staging slots, send-queue room and (for
// rendezvous) CTS FIFO entries allow. Caller holds c.mu.
Status EagerChannel::PostQueuedLocked(Conn& c) {
  while (!c.queue.empty()) {
    Outgoing* o = c.queue.front();
    const uint64_t body = sizeof(FrameHeader) + o->meta.size() + (o->rendezvous ? 0 : o->payload_len);
    const uint64_t total = sizeof(SlotHeader) + body;
    const uint32_t frags = static_cast<uint32_t>((total + c.slot_bytes - 1) / c.slot_bytes);
    // Staging slots bound the slot writes in the send queue; the FIFO bounds the rest.
    bool ready = c.credits >= frags && (!o->rendezvous || c.rdv_used < c.fifo);
    for (uint32_t f = 0; ready && f < frags; ++f) {
      if (c.stage_busy[(c.send_seq + f) % c.slots]) ready = false;
    }
    if (!ready) {
      ++c.credit_stalls;
      return Status::Ok();  // completions or credits will call us again
    }
    uint32_t rts_index = 0;
    if (o->rendezvous) {
      while (c.rdv[c.next_rts % c.fifo].used) ++c.next_rts;
      rts_index = c.next_rts++ % c.fifo;
      RdvOut& r = c.rdv[rts_index];
      r.used = true;
      r.payload = o->payload;
      r.len = o->payload_len;
      r.ref = o->ref;
      r.done = std::move(o->done);
      ++c.rdv_used;
      ++rendezvous_;
    } else {
      ++eager_;
    }
    // Lay the message out over `frags` staging slots (consecutive in ring order).
    SlotHeader sh;
    sh.kind = o->rendezvous ? kSlotRts : kSlotFrame;
    sh.fragments = static_cast<uint16_t>(frags);
    sh.length = static_cast<uint32_t>(body);
    sh.rts_id = rts_index;
    const std::pair<const void*, size_t> parts[] = {
        {&sh, sizeof(sh)},
        {&o->header, sizeof(FrameHeader)},
        {o->meta.data(), o->meta.size()},
        {o->payload, o->rendezvous ? 0 : o->payload_len}};
    uint64_t pos = 0;  // byte offset in the message
    for (const auto& [src, n] : parts) {
      CopyToRing(c.stage(), c, c.send_seq, pos, src, n);
      pos += n;
    }
    for (uint32_t f = 0; f < frags; ++f) {
      const uint64_t seq = c.send_seq + f;
      const uint32_t slot = static_cast<uint32_t>(seq % c.slots);
      const bool last = f + 1 == frags;
      const size_t len = last ? static_cast<size_t>(total - uint64_t{f} * c.slot_bytes) : c.slot_bytes;
      c.stage_busy[slot] = 1;
      // Earlier fragments are plain writes; the last carries the immediate, and RC
      // delivers in order, so its completion at the peer means the whole message is there.
      DSYNC_RETURN_IF_ERROR(PostWrite(c, MakeWr(kWrSlot, seq), c.stage() + size_t{slot} * c.slot_bytes,
                                      c.mr->lkey, len, c.remote.ring_addr + uint64_t{slot} * c.slot_bytes,
                                      c.remote.ring_rkey, last, MakeImm(kImmSlot, slot), last));
    }
    const uint32_t last_slot = static_cast<uint32_t>((c.send_seq + frags - 1) % c.slots);
    c.stage_frags[last_slot] = frags;
    if (!o->rendezvous) c.stage_done[last_slot] = std::move(o->done);
    c.send_seq += frags;
    c.credits -= frags;
    c.queue.pop_front();
    o->done = nullptr;
    o->ref = {};
    o->payload = nullptr;
    c.spare.push_back(o);
  }
  return Status::Ok();
}

void EagerChannel::HandleCompletion(const std::shared_ptr<Conn>& c, const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    conns_.Teardown(c, Error(StatusCode::kUnavailable, "RDMA {} to {} failed: {}",
                             wc.opcode & IBV_WC_RECV ? "receive" : "send", c->address,
                             ibv_wc_status_str(wc.status)));
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    if (Status st = PostRecv(*c); !st.ok()) {
      conns_.Teardown(c, st);
      return;
    }
    const uint32_t imm = ntohl(wc.imm_data);
    const uint32_t value = imm & kImmValueMask;
    switch (static_cast<ImmKind>(imm >> 30)) {
      case kImmSlot: {
        // Everything up to this slot has arrived (RC delivers in order).
        const uint64_t at = c->arrived % c->slots;
        c->arrived += (value + c->slots - at) % c->slots + 1;
        c->unread.store(true);
        ProcessRing(c);
        return;
      }
      case kImmCredit:
        AddCredits(c, value);
        return;
      case kImmCts:
        HandleCts(c, value);
        return;
      case kImmData:
        HandleData(c, value);
        return;
    }
    return;
  }
  // Our own send completed.
  const uint64_t kind = wc.wr_id >> 56;
  const uint64_t value = wc.wr_id & ((uint64_t{1} << 56) - 1);
  SendDone done;
  MrCache::Ref release;
  {
    std::lock_guard lock(c->mu);
    if (kind == kWrSlot) {
      const uint32_t slot = static_cast<uint32_t>(value % c->slots);
      const uint32_t frags = c->stage_frags[slot];
      for (uint32_t f = 0; f < frags; ++f) c->stage_busy[(value - f) % c->slots] = 0;
      done = std::move(c->stage_done[slot]);
    } else if (kind == kWrData) {
      RdvOut& r = c->rdv[value];
      done = std::move(r.done);
      release = r.ref;
      r = RdvOut{};
      --c->rdv_used;
    } else if (kind == kWrCredit) {
      c->credit_in_flight = false;
    }
    if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
  }
  if (release) c->dev->cache->Release(release);
  if (done) done(Status::Ok());
  if (kind == kWrCredit) MaybeReturnCredits(c);
}

void EagerChannel::AddCredits(const std::shared_ptr<Conn>& c, uint32_t n) {
  std::lock_guard lock(c->mu);
  c->credits += n;
  if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
}

// Returns consumed slots to the sender a quarter of the ring at a time, one return in
// flight at most. No stall: a sender short of credits for a message (at most half the
// ring) means more than half the ring is consumed or on its way to being consumed.
void EagerChannel::MaybeReturnCredits(const std::shared_ptr<Conn>& c) {
  std::lock_guard lock(c->mu);
  if (c->unreported < std::max<uint32_t>(1, c->slots / RdmaTunables::kCreditReturnDivisor) ||
      c->credit_in_flight || c->state.load() != ConnState::kOpen) {
    return;
  }
  const uint32_t n = c->unreported;
  c->unreported = 0;
  c->credit_in_flight = true;
  Status st = PostWrite(*c, MakeWr(kWrCredit, 0), nullptr, 0, 0, c->remote.cts_addr,
                        c->remote.cts_rkey, true, MakeImm(kImmCredit, n), true);
  if (!st.ok()) c->why = st;
}

void EagerChannel::HandleCts(const std::shared_ptr<Conn>& c, uint32_t index) {
  if (index >= c->fifo) {
    conns_.Teardown(c, Error(StatusCode::kProtocol, "CTS for entry {} of {}", index, c->fifo));
    return;
  }
  const Cts cts = c->cts_in()[index];
  SendDone done;
  MrCache::Ref release;
  bool idle = false;
  {
    std::lock_guard lock(c->mu);
    RdvOut& r = c->rdv[index];
    if (!r.used) {
      idle = true;  // torn down below: Teardown takes c->mu itself
    } else if (cts.discard) {  // the receiver does not want the payload: nothing to write
      done = std::move(r.done);
      release = r.ref;
      r = RdvOut{};
      --c->rdv_used;
      if (Status st = PostQueuedLocked(*c); !st.ok()) c->why = st;
    } else {
      Status st = PostWrite(*c, MakeWr(kWrData, index), r.payload, r.ref.mr->lkey,
                            static_cast<size_t>(r.len), cts.addr, cts.rkey, true,
                            MakeImm(kImmData, cts.token), true);
      if (!st.ok()) c->why = st;
    }
  }
  if (idle) {
    conns_.Teardown(c, Error(StatusCode::kProtocol, "CTS for an idle rendezvous entry"));
    return;
  }
  if (release) c->dev->cache->Release(release);
  if (done) done(Status::Ok());
}

void EagerChannel::HandleData(const std::shared_ptr<Conn>& c, uint32_t token) {
  auto& rin = c->rin;
  if (!rin.active || rin.token != (token & kImmValueMask)) {
    conns_.Teardown(c, Error(StatusCode::kProtocol, "unexpected rendezvous data from {}",
                             c->address));
    return;
  }
  rin.active = false;
  c->dev->cache->Release(rin.ref);
  rin.ref = {};
  if (auto* h = handler_.load(); h && !c->closing.load()) {
    h->OnFrame(c->id, rin.header, rin.meta, rin.dest);
  }
  ProcessRing(c);
}

void EagerChannel::SendCts(const std::shared_ptr<Conn>& c, uint32_t index, const Cts& cts) {
  std::lock_guard lock(c->mu);
  Cts* src = c->cts_out() + index;
  *src = cts;
  Status st = PostWrite(*c, MakeWr(kWrCts, index), src, c->mr->lkey, sizeof(Cts),
                        c->remote.cts_addr + uint64_t{index} * sizeof(Cts), c->remote.cts_rkey,
                        true, MakeImm(kImmCts, index), true);
  if (!st.ok()) c->why = st;
}

void EagerChannel::ProcessRing(const std::shared_ptr<Conn>& c) {
  ps::TransportHandler* h = handler_.load();
  while (!c->rin.active && c->recv_seq < c->arrived && !c->closing.load() &&
         c->state.load() == ConnState::kOpen) {
    const uint32_t slot = static_cast<uint32_t>(c->recv_seq % c->slots);
    const std::byte* first = c->ring() + size_t{slot} * c->slot_bytes;
    SlotHeader sh;
    std::memcpy(&sh, first, sizeof(sh));
    if (sh.magic != kSlotMagic || sh.fragments == 0 || sh.fragments > c->slots / 2 ||
        sizeof(sh) + uint64_t{sh.length} > uint64_t{sh.fragments} * c->slot_bytes ||
        c->recv_seq + sh.fragments > c->arrived || sh.length < sizeof(FrameHeader)) {
      conns_.Teardown(c, Error(StatusCode::kProtocol, "malformed RDMA message from {}",
                               c->address));
      return;
    }
    const std::byte* body = first + sizeof(sh);
    if (sh.fragments > 1) {  // gather the fragments, which may wrap around the ring
      c->reassembly.resize(sh.length);
      CopyFromRing(c->ring(), *c, c->recv_seq, sizeof(sh), c->reassembly.data(), sh.length);
      body = c->reassembly.data();
    }
    FrameHeader fh;
    std::memcpy(&fh, body, sizeof(fh));
    const bool rts = sh.kind == kSlotRts;
    Status valid = ps::ValidateHeader(fh);
    const uint64_t want = sizeof(FrameHeader) + uint64_t{fh.meta_len} + (rts ? 0 : fh.payload_len);
    if (valid.ok() && (want != sh.length || (sh.kind != kSlotFrame && sh.kind != kSlotRts) ||
                       (rts && (fh.payload_len == 0 || sh.rts_id >= c->fifo)))) {
      valid = Error(StatusCode::kProtocol, "inconsistent frame lengths");
    }
    if (valid.ok() && !c->trusted.load()) valid = ps::CheckUnauthenticatedFrame(fh);
    if (!valid.ok()) {
      spdlog::warn("RDMA: dropping the connection from {}: {}", c->address, valid.message());
      conns_.Teardown(c, valid.WithContext(fmt::format("frame from {}", c->address)));
      return;
    }
    const std::span<const std::byte> meta(body + sizeof(FrameHeader), fh.meta_len);
    void* dst = h ? h->OnHeader(c->id, fh, meta) : nullptr;
    if (c->closing.load()) {  // closed from inside OnHeader: the payload never comes
      if (dst && fh.payload_len > 0 && h) h->OnPayloadLost(c->id, fh, dst);
      return;
    }
    if (!rts) {
      if (dst && fh.payload_len > 0 && table_.InDeviceMemory(dst, fh.payload_len)) {
        // The CPU cannot copy into GPU memory; a handler must not ask for it (see
        // EnableDeviceMemory).
        if (h) h->OnPayloadLost(c->id, fh, dst);
        conns_.Teardown(c, Error(StatusCode::kInternal,
                                 "the handler put a {}-byte eager payload in GPU memory",
                                 fh.payload_len));
        return;
      }
      if (dst && fh.payload_len > 0) {
        std::memcpy(dst, body + sizeof(FrameHeader) + fh.meta_len, fh.payload_len);
      }
      // Credits go back only after the handler is done with the metadata, which is
      // still in the slot.
      if (h) h->OnFrame(c->id, fh, meta, dst);
      ConsumeSlots(c, sh.fragments);
      continue;
    }
    // Rendezvous: keep header and metadata, consume the slots, ask for the payload.
    Cts cts;
    if (!dst) {
      cts.discard = 1;
      SendCts(c, sh.rts_id, cts);
      if (h) h->OnFrame(c->id, fh, meta, nullptr);
      ConsumeSlots(c, sh.fragments);
      continue;
    }
    auto ref = c->dev->cache->Acquire(dst, fh.payload_len);
    if (!ref.ok()) {
      if (h) h->OnPayloadLost(c->id, fh, dst);
      conns_.Teardown(c, ref.status());
      return;
    }
    auto& rin = c->rin;
    rin.active = true;
    rin.header = fh;
    rin.meta.assign(meta.begin(), meta.end());
    rin.dest = dst;
    rin.ref = *ref;
    rin.token = c->next_token++ & kImmValueMask;
    ConsumeSlots(c, sh.fragments);
    cts.addr = reinterpret_cast<uint64_t>(dst);
    cts.rkey = ref->mr->rkey;
    cts.token = rin.token;
    SendCts(c, sh.rts_id, cts);
  }
  c->unread.store(c->recv_seq < c->arrived || c->rin.active);
}

void EagerChannel::ConsumeSlots(const std::shared_ptr<Conn>& c, uint32_t n) {
  c->recv_seq += n;
  {
    std::lock_guard lock(c->mu);
    c->unreported += n;
  }
  MaybeReturnCredits(c);
}

}  // namespace dsync::rdma
