// A TCP transport wrapped for tests: it forwards every call and callback, and a test
// overrides the ones it wants to watch or bend (GPUDirect routing, delayed delivery).
#pragma once

#include <memory>
#include <string>

#include "ps/transport.h"
#include "tcp/tcp_transport.h"

namespace dsync::testing {

class WrappedTcp : public ps::Transport, public ps::TransportHandler {
 public:
  WrappedTcp() : tcp_(tcp::MakeTcpTransport({})) {}
  ~WrappedTcp() override { tcp_->Shutdown(); }

  std::string_view name() const override { return tcp_->name(); }
  void SetHandler(ps::TransportHandler* h) override {
    handler_ = h;
    tcp_->SetHandler(this);
  }
  Result<uint16_t> Listen(const std::string& host, uint16_t port) override {
    return tcp_->Listen(host, port);
  }
  Result<ps::PeerId> Connect(const std::string& host, uint16_t port, uint32_t t) override {
    return tcp_->Connect(host, port, t);
  }
  Status Send(ps::PeerId peer, ps::FrameHeader h, std::span<const std::byte> meta,
              const void* payload, uint64_t len, ps::SendDone done) override {
    return tcp_->Send(peer, h, meta, payload, len, std::move(done));
  }
  void Close(ps::PeerId peer) override { tcp_->Close(peer); }
  void Shutdown() override { tcp_->Shutdown(); }
  std::string PeerAddress(ps::PeerId peer) const override { return tcp_->PeerAddress(peer); }
  void Trust(ps::PeerId peer) override { tcp_->Trust(peer); }
  bool HasUnreadInput(ps::PeerId peer) const override { return tcp_->HasUnreadInput(peer); }

  void OnConnected(ps::PeerId peer, bool inbound) override { handler_->OnConnected(peer, inbound); }
  void* OnHeader(ps::PeerId peer, const ps::FrameHeader& h,
                 std::span<const std::byte> meta) override {
    return handler_->OnHeader(peer, h, meta);
  }
  void OnFrame(ps::PeerId peer, const ps::FrameHeader& h, std::span<const std::byte> meta,
               void* payload) override {
    handler_->OnFrame(peer, h, meta, payload);
  }
  void OnPayloadLost(ps::PeerId peer, const ps::FrameHeader& h, void* payload) override {
    handler_->OnPayloadLost(peer, h, payload);
  }
  void OnDisconnected(ps::PeerId peer, const Status& why) override {
    handler_->OnDisconnected(peer, why);
  }

 protected:
  std::unique_ptr<ps::Transport> tcp_;
  ps::TransportHandler* handler_ = nullptr;
};

}  // namespace dsync::testing
