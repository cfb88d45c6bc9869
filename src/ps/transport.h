// The Transport seam: everything src/ps knows about moving bytes. The TCP transport
// (src/tcp) and the RDMA transport (src/rdma) implement it.
//
// Receiving is two-phase so payloads land where they belong without an intermediate copy:
// the transport reads a frame's header and metadata, asks the handler where the payload
// goes (OnHeader), reads the payload straight into that buffer, then hands over the whole
// frame (OnFrame).
//
// Threading contract: callbacks for one peer never run concurrently and arrive in frame
// order; callbacks for different peers may run concurrently. A handler may call Send() and
// Close() from any callback.
//
// Strangers: an inbound connection is *unauthenticated* until the handler calls Trust() on
// it. Until then the transport reads nothing but one hello of at most kMaxHelloMetaBytes
// (anything else drops the link from its header alone), drops it when no trusted state is
// reached within the handshake timeout, and caps how many such connections may be open, in
// all and from one address (AdmissionLimits). What a stranger can make a node hold is
// bounded and given back.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "dsync/status.h"
#include "ps/device_memory.h"
#include "ps/inline_callback.h"
#include "ps/protocol.h"

namespace dsync::ps {

using PeerId = uint64_t;  // a connection, unique for the transport's lifetime
constexpr PeerId kNoPeer = 0;

// Called exactly once when a send accepted by Send() has left the payload buffer (OK) or
// can no longer be delivered (peer gone, shutdown). Runs on a transport thread, never inside
// Send() itself (callers send under their own locks). Inline storage: a send never allocates
// for its completion.
using SendDone = InlineCallback<void(const Status&), 32>;

// Limits on inbound connections that have not authenticated yet (Config: handshake_timeout_ms,
// max_pending_connections, max_pending_per_source) and on connections in all.
struct AdmissionLimits {
  std::chrono::milliseconds handshake_timeout{10000};
  uint32_t max_pending = 64;             // unauthenticated connections per listener
  uint32_t max_pending_per_source = 16;  // of them from one address
  uint32_t max_connections = 4096;       // per listener, authenticated or not
};

class TransportHandler {
 public:
  virtual ~TransportHandler() = default;

  virtual void OnConnected(PeerId /*peer*/, bool /*inbound*/) {}
  // Returns where the header.payload_len payload bytes go, or nullptr to discard them.
  virtual void* OnHeader(PeerId peer, const FrameHeader& header,
                         std::span<const std::byte> meta) = 0;
  // The whole frame arrived. `payload` is what OnHeader returned.
  virtual void OnFrame(PeerId peer, const FrameHeader& header, std::span<const std::byte> meta,
                       void* payload) = 0;
  // A payload buffer handed out by OnHeader will never be filled (the link broke mid-frame).
  virtual void OnPayloadLost(PeerId /*peer*/, const FrameHeader& /*header*/, void* /*payload*/) {}
  // The connection is gone, once per peer; no callbacks for it follow.
  virtual void OnDisconnected(PeerId peer, const Status& why) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string_view name() const = 0;

  // The handler must outlive the transport's Shutdown().
  virtual void SetHandler(TransportHandler* handler) = 0;

  // Starts accepting on host:port (port 0 picks a free port); returns the bound port.
  virtual Result<uint16_t> Listen(const std::string& host, uint16_t port) = 0;
  // Connects, retrying a refused connection until timeout_ms has passed.
  virtual Result<PeerId> Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) = 0;

  // Queues a frame. header.meta_len and header.payload_len are set from the arguments. The
  // metadata is copied; the payload is not and must stay valid until `done` runs. On a
  // non-OK return nothing was queued and `done` is not called.
  virtual Status Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
                      const void* payload, uint64_t payload_len, SendDone done = {}) = 0;

  // Drops a connection; OnDisconnected follows (from a transport thread).
  virtual void Close(PeerId peer) = 0;
  // Stops listening and drops every connection; no callback runs after it returns.
  virtual void Shutdown() = 0;

  // "host:port" of the peer, for messages.
  virtual std::string PeerAddress(PeerId peer) const = 0;

  // The handler has authenticated an inbound peer: lift the limits on strangers (one small
  // hello, the handshake timeout, the pending-connection caps). No effect on outbound ones.
  virtual void Trust(PeerId peer) = 0;
  // The peer sent bytes this node has not processed yet (they sit in a socket or a ring).
  // A node that was itself stalled asks this before it judges a peer silent.
  virtual bool HasUnreadInput(PeerId peer) const = 0;

  // Memory the node will send from and receive into again and again (pooled buffers): a
  // transport that must register memory (RDMA) registers it once, not per message.
  // ForgetMemory before the memory is freed. Failing to register only costs speed.
  virtual Status RegisterMemory(const void* /*ptr*/, size_t /*bytes*/) { return Status::Ok(); }
  virtual void ForgetMemory(const void* /*ptr*/, size_t /*bytes*/) {}

  // GPUDirect RDMA: lets the transport move payloads straight from and into `memory` (which
  // must outlive the transport). Returns the smallest payload that may then live in device
  // memory, registered first with RegisterMemory; smaller payloads are copied by the CPU and
  // must stay in host memory. An error says why the transport cannot (TCP never can; RDMA
  // needs a NIC driver and a GPU driver that both support dma-buf).
  virtual Result<uint64_t> EnableDeviceMemory(const DeviceMemory* /*memory*/) {
    return Error(StatusCode::kUnimplemented,
                 "the {} transport cannot reach GPU memory (GPUDirect RDMA needs --transport "
                 "rdma)",
                 name());
  }
};

}  // namespace dsync::ps
