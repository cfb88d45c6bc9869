// Choosing the RDMA device, port and GID, and saying clearly why none fits: the
// failures users of other parameter servers hit most are no device, a port that is down, no
// usable GID and a memlock limit too low for registrations.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsync/status.h"

namespace dsync::rdma {

struct DeviceOptions {
  std::string device;   // --rdma-device; empty: the first that fits
  int gid_index = -1;   // --gid-index; -1: the RoCE v2 IPv4-mapped GID of the device's netdev
  // The IPv4 address of the NIC this node was told to use (--interface): the device and GID
  // on that NIC, not merely the first that works (a host with an RDMA NIC per network).
  // Empty: no preference.
  std::string interface_ip;
};

// A port and GID the transport can use; rdma_cm binds by IP address, so the GID's IPv4
// address is what selects the device for listening and connecting.
struct DeviceChoice {
  std::string device;
  uint32_t port = 1;
  uint32_t gid_index = 0;
  std::string ipv4;    // of the GID (RoCE v2, IPv4-mapped)
  std::string netdev;  // the network device the GID belongs to
};

// Picks a device/port/GID; `ip` (else options.interface_ip), when not empty, must be the
// GID's address (the interface the node was told to use). Errors say what is missing and
// what to do.
Result<DeviceChoice> ChooseDevice(const DeviceOptions& options, std::string_view ip = {});

// Names of the RDMA devices present (empty when none or without kernel support).
std::vector<std::string> DeviceNames();

// GPUDirect RDMA over dma-buf: OK when the device's kernel driver can register dma-buf memory
// (ibv_reg_dmabuf_mr), otherwise why not.
Status DmaBufSupport(const std::string& device);

// The soft locked-memory limit in bytes (UINT64_MAX: unlimited).
uint64_t MemlockLimit();

// What every "no RDMA" message ends with.
inline constexpr std::string_view kRdmaHelp =
    "use --transport tcp, or set up soft-RoCE on a netdev with scripts/setup-rxe.sh <netdev>";

}  // namespace dsync::rdma
