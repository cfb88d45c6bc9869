// Backend selection: which Transport and ParamStore a node runs with, from its
// configuration and from what this build and machine have.
#include "runtime/backends.h"

#include <arpa/inet.h>
#include <netdb.h>

#include "cpu/cpu_store.h"
#include "ps/net_address.h"
#include "tcp/tcp_transport.h"
#if DSYNC_HAVE_RDMA
#include "rdma/rdma_transport.h"
#endif
#if DSYNC_HAVE_CUDA
#include "cuda/cuda_store.h"
#endif

namespace dsync::runtime {

using ps::AdmissionLimits;
using ps::ParamStore;
using ps::Transport;

AdmissionLimits AdmissionLimitsOf(const Config& config) {
  AdmissionLimits a;
  a.handshake_timeout = std::chrono::milliseconds(config.handshake_timeout_ms);
  a.max_pending = config.max_pending_connections;
  a.max_pending_per_source = config.max_pending_per_source;
  return a;
}

#if DSYNC_HAVE_RDMA
namespace {
// The IPv4 address --interface names (a NIC's or a literal one), "" for a wildcard, loopback
// or anything else: that is the address whose GID picks the RDMA device. An interface that
// does not resolve is left to the listener to report.
std::string InterfaceIpv4(const std::string& interface) {
  if (ps::IsWildcardHost(interface)) return "";
  auto resolved = ps::ResolveListenHost(interface);
  if (!resolved.ok()) return "";
  in_addr a{};
  if (inet_pton(AF_INET, resolved->c_str(), &a) != 1) {
    // A host name: its IPv4 address, as the listener will bind it.
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* found = nullptr;
    if (getaddrinfo(resolved->c_str(), nullptr, &hints, &found) != 0 || !found) return "";
    a = reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr;
    freeaddrinfo(found);
  }
  if ((ntohl(a.s_addr) >> 24) == 127) return "";
  char text[INET_ADDRSTRLEN];
  return inet_ntop(AF_INET, &a, text, sizeof(text)) ? text : "";
}
}  // namespace
#endif

Result<std::unique_ptr<Transport>> MakeTransport(const Config& config) {
#if DSYNC_HAVE_RDMA
  if (config.transport == TransportKind::kRdma || config.transport == TransportKind::kAuto) {
    rdma::RdmaOptions o;
    o.device.device = config.rdma_device;
    o.device.gid_index = config.gid_index;
    o.device.interface_ip = InterfaceIpv4(config.bind_host);
    o.admission = AdmissionLimitsOf(config);
    DSYNC_RETURN_IF_ERROR(rdma::ReadRdmaTunables(o.tunables));  // DSYNC_RDMA_* variables
    auto t = rdma::MakeRdmaTransport(o);
    if (t.ok()) return std::unique_ptr<Transport>(std::move(*t));
    if (config.transport == TransportKind::kRdma) return t.status();
    // auto: no usable RDMA device here, which is what TCP is for.
  }
#else
  if (config.transport == TransportKind::kRdma) {
    return Error(StatusCode::kUnimplemented,
                 "this build has no RDMA transport; use --transport tcp");
  }
#endif
  return tcp::MakeTcpTransport(
      {std::chrono::microseconds(config.link_delay_us), AdmissionLimitsOf(config)});
}

Result<std::unique_ptr<ParamStore>> MakeParamStore(const Config& config) {
#if DSYNC_HAVE_CUDA
  if (config.store == StoreKind::kCuda ||
      (config.store == StoreKind::kAuto && cuda::DeviceAvailable())) {
    return cuda::MakeCudaStore();
  }
#else
  if (config.store == StoreKind::kCuda) {
    return Error(StatusCode::kUnimplemented,
                 "this build has no CUDA store (nvcc was not found when it was configured); "
                 "use --store cpu, or rebuild where the CUDA toolkit is installed");
  }
#endif
  return cpu::MakeCpuStore();
}

}  // namespace dsync::runtime
