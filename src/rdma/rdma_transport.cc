// The RdmaTransport facade: it owns the parts (rdma_conn.h lists them) and wires each
// Transport call to the one that does it.
#include "rdma/rdma_transport.h"

#include <atomic>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "rdma/rdma_conn_table.h"
#include "rdma/rdma_connections.h"
#include "rdma/rdma_eager.h"
#include "rdma/rdma_progress.h"

namespace dsync::rdma {
namespace {

class Rdma final : public RdmaTransport {
 public:
  Rdma(RdmaOptions options, DeviceChoice choice)
      : options_(std::move(options)), choice_(std::move(choice)) {}

  ~Rdma() override {
    progress_.Stop();
    progress_.Join();
  }

  Status Init() {
    DSYNC_RETURN_IF_ERROR(conns_.Init());
    DSYNC_RETURN_IF_ERROR(progress_.Init());
    const RdmaTunables& t = options_.tunables;
    const uint64_t limit = MemlockLimit();
    const uint64_t per_conn = 2ull * t.slots * t.slot_bytes;
    if (limit < t.memlock_warn_connections * per_conn) {
      spdlog::warn(
          "RDMA: the locked-memory limit is {} KiB; each connection registers {} KiB and "
          "every payload in flight is registered too: raise it (ulimit -l unlimited; systemd: "
          "LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)",
          limit / 1024, per_conn / 1024);
    }
    progress_.Start();
    return Status::Ok();
  }

  std::string_view name() const override { return "rdma"; }
  const DeviceChoice& device() const override { return choice_; }

  void SetHandler(ps::TransportHandler* handler) override { handler_.store(handler); }

  Result<uint16_t> Listen(const std::string& host, uint16_t port) override {
    return conns_.Listen(host, port);
  }

  Result<PeerId> Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) override {
    return conns_.Connect(host, port, timeout_ms);
  }

  Status Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
              const void* payload, uint64_t payload_len, SendDone done) override {
    return eager_.Send(peer, header, meta, payload, payload_len, std::move(done));
  }

  void Close(PeerId peer) override {
    if (auto c = table_.Find(peer)) {
      progress_.RequestClose(c, Error(StatusCode::kAborted, "closed locally"), /*graceful=*/true);
    }
  }

  void Shutdown() override { progress_.Stop(); }

  void Trust(PeerId peer) override {
    std::shared_ptr<Conn> c = table_.Find(peer);
    if (!c || c->trusted.exchange(true)) return;
    table_.Trust(*c);
  }

  bool HasUnreadInput(PeerId peer) const override {
    std::shared_ptr<Conn> c = table_.Find(peer);
    return c && c->unread.load();
  }

  std::string PeerAddress(PeerId peer) const override {
    auto c = table_.Find(peer);
    return c ? c->address : fmt::format("peer {}", peer);
  }

  Status RegisterMemory(const void* ptr, size_t bytes) override {
    return table_.RegisterMemory(ptr, bytes);
  }

  void ForgetMemory(const void* ptr, size_t bytes) override { table_.ForgetMemory(ptr, bytes); }

  // GPUDirect RDMA. Only rendezvous payloads may be device memory: they are written by the
  // NIC from and into registered memory, while eager frames are copied by the CPU through
  // the slots. Every payload of at least slot_bytes goes by rendezvous (it cannot fit a slot
  // with its headers), so that is the threshold.
  Result<uint64_t> EnableDeviceMemory(const ps::DeviceMemory* memory) override {
    if (!memory) return Error(StatusCode::kInvalidArgument, "no device memory given");
    if (std::string why = memory->DmaBufUnsupported(); !why.empty()) {
      return Error(StatusCode::kUnimplemented, "{}", why);
    }
    DSYNC_RETURN_IF_ERROR(DmaBufSupport(choice_.device));
    table_.SetDeviceMemory(memory);
    return uint64_t{options_.tunables.slot_bytes};
  }

  RdmaStats stats() const override {
    RdmaStats s;
    s.eager_frames = eager_.eager_frames();
    s.rendezvous_frames = eager_.rendezvous_frames();
    s.sleeps = progress_.sleeps();
    table_.AddStats(s);
    return s;
  }

 private:
  const RdmaOptions options_;
  const DeviceChoice choice_;
  std::atomic<ps::TransportHandler*> handler_{nullptr};
  // Each part holds references to the others, bound before they are built and used only
  // once Init() runs. Destroyed in reverse: the devices, then the rdma_cm event channel,
  // then the wake eventfd.
  Progress progress_{options_, table_, conns_, eager_};
  ConnManager conns_{options_, choice_, handler_, table_, eager_, progress_};
  EagerChannel eager_{handler_, table_, conns_, progress_};
  ConnTable table_{options_};
};

}  // namespace

Result<std::unique_ptr<RdmaTransport>> MakeRdmaTransport(const RdmaOptions& options) {
  DSYNC_ASSIGN_OR_RETURN(DeviceChoice choice, ChooseDevice(options.device));
  DSYNC_RETURN_IF_ERROR(Validate(options.tunables));
  auto t = std::make_unique<Rdma>(options, std::move(choice));
  DSYNC_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<RdmaTransport>(std::move(t));
}

}  // namespace dsync::rdma
