// The TCP implementation of the Transport seam.
//
// Blocking sockets with one reader and one writer thread per connection and one accept
// thread per listener: simple to reason about, and at the connection counts of a parameter
// server (tens to hundreds of peers) the threads cost less than an event loop's copies.
// The reader reads each payload straight into the buffer the handler hands out; the writer
// sends header, metadata and the caller's payload with one gathering sendmsg, so payloads
// are never copied by the transport.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ps/inbound_counter.h"
#include "ps/transport.h"

namespace dsync::tcp {

namespace detail {
struct Conn;
struct Listener;
}  // namespace detail

struct TcpOptions {
  // Emulated one-way latency: every frame this node sends leaves this long after it was
  // queued (frames keep their order and may overlap, as on a long link). For experiments
  // with a far-away worker on one machine; 0 in production.
  std::chrono::microseconds send_delay{0};
  // Inbound connections before they authenticate (ps/transport.h).
  ps::AdmissionLimits admission;
};

class TcpTransport final : public ps::Transport {
 public:
  explicit TcpTransport(TcpOptions options = {});
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  std::string_view name() const override { return "tcp"; }
  void SetHandler(ps::TransportHandler* handler) override;
  Result<uint16_t> Listen(const std::string& host, uint16_t port) override;
  Result<ps::PeerId> Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) override;
  Status Send(ps::PeerId peer, ps::FrameHeader header, std::span<const std::byte> meta,
              const void* payload, uint64_t payload_len, ps::SendDone done = {}) override;
  void Close(ps::PeerId peer) override;
  // From inside a transport callback it can only close everything (joining would wait for
  // the calling thread); the threads are then joined by the next outside call or the
  // destructor.
  void Shutdown() override;
  std::string PeerAddress(ps::PeerId peer) const override;
  void Trust(ps::PeerId peer) override;
  bool HasUnreadInput(ps::PeerId peer) const override;

 private:
  using Conn = detail::Conn;
  using Listener = detail::Listener;

  std::shared_ptr<Conn> Find(ps::PeerId peer) const;
  // Takes ownership of a connected socket and starts its threads.
  Result<ps::PeerId> Adopt(int fd, bool inbound, std::string source = {});
  // The connection authenticated or ended: it no longer counts as pending.
  void ReleasePending(Conn& conn);
  void ReleasePendingLocked(Conn& conn);
  // The connection ended: it no longer counts at all. Caller holds mu_.
  void ForgetInboundLocked(Conn& conn);
  void AcceptLoop(Listener* listener);
  void ReaderMain(std::shared_ptr<Conn> conn);
  Status ReadFrames(Conn& conn, bool* linger);
  static void WriterMain(Conn& conn);
  // Joins the reader threads of connections that have ended.
  void Reap();

  const TcpOptions options_;
  std::atomic<ps::TransportHandler*> handler_{nullptr};
  std::atomic<ps::PeerId> next_peer_{1};

  mutable std::shared_mutex mu_;       // guards everything below
  std::condition_variable_any ended_;  // a connection moved to finished_
  bool stopping_ = false;
  std::unordered_map<ps::PeerId, std::shared_ptr<Conn>> conns_;
  std::vector<std::shared_ptr<Conn>> finished_;  // reader done, not yet joined
  std::vector<std::unique_ptr<Listener>> listeners_;
  ps::InboundCounter inbound_;
  std::chrono::steady_clock::time_point last_cap_warning_;  // one warning per second at most

  std::mutex shutdown_mu_;  // makes a second Shutdown() wait for the first
};

std::unique_ptr<ps::Transport> MakeTcpTransport(TcpOptions options = {});

}  // namespace dsync::tcp
