#include "rdma/rdma_device.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dsync::rdma {
namespace {

struct DeviceList {
  ibv_device** list = nullptr;
  int count = 0;
  DeviceList() { list = ibv_get_device_list(&count); }
  ~DeviceList() {
    if (list) ibv_free_device_list(list);
  }
};

struct Context {
  ibv_context* ctx = nullptr;
  explicit Context(ibv_device* d) : ctx(ibv_open_device(d)) {}
  ~Context() {
    if (ctx) ibv_close_device(ctx);
  }
};

// ::ffff:a.b.c.d, the form RoCE v2 GIDs of IPv4 addresses take.
bool Ipv4Mapped(const ibv_gid& gid, std::string* ip) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(gid.raw, kPrefix, sizeof(kPrefix)) != 0) return false;
  char buf[INET_ADDRSTRLEN];
  if (!inet_ntop(AF_INET, gid.raw + 12, buf, sizeof(buf))) return false;
  *ip = buf;
  return true;
}

std::string GidText(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN];
  return inet_ntop(AF_INET6, gid.raw, buf, sizeof(buf)) ? buf : "?";
}

const char* GidType(uint32_t type) {
  switch (type) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
  }
  return "unknown";
}

std::string Netdev(uint32_t ifindex) {
  char name[IF_NAMESIZE] = {};
  return ifindex && if_indextoname(ifindex, name) ? name : "";
}

}  // namespace

std::vector<std::string> DeviceNames() {
  DeviceList devs;
  std::vector<std::string> names;
  for (int i = 0; devs.list && i < devs.count; ++i) names.emplace_back(ibv_get_device_name(devs.list[i]));
  return names;
}

// As NCCL's net_ib does: a registration with fd -1 fails with EBADF where the driver has the
// dma-buf path and with EOPNOTSUPP (EPROTONOSUPPORT from older libraries) where it has not.
Status DmaBufSupport(const std::string& device) {
  DeviceList devices;
  for (int i = 0; i < devices.count; ++i) {
    if (device != ibv_get_device_name(devices.list[i])) continue;
    Context c(devices.list[i]);
    if (!c.ctx) {
      return Error(StatusCode::kUnavailable, "cannot open RDMA device {}: {}", device,
                   std::strerror(errno));
    }
    ibv_pd* pd = ibv_alloc_pd(c.ctx);
    if (!pd) {
      return Error(StatusCode::kUnavailable, "ibv_alloc_pd on {}: {}", device,
                   std::strerror(errno));
    }
    errno = 0;
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
    const int err = errno;
    if (mr) ibv_dereg_mr(mr);
    ibv_dealloc_pd(pd);
    if (err == EOPNOTSUPP || err == EPROTONOSUPPORT) {
      return Error(StatusCode::kUnimplemented,
                   "the driver of RDMA device {} cannot register GPU memory (ibv_reg_dmabuf_mr: "
                   "{}; soft-RoCE never can, mlx5 on Linux 5.12+ can)",
                   device, std::strerror(err));
    }
    return Status::Ok();
  }
  return Error(StatusCode::kNotFound, "RDMA device {} is gone", device);
}

uint64_t MemlockLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  return lim.rlim_cur;
}

Result<DeviceChoice> ChooseDevice(const DeviceOptions& o, std::string_view ip) {
  if (ip.empty()) ip = o.interface_ip;
  DeviceList devs;
  if (!devs.list || devs.count == 0) {
    const int err = errno;
    return Error(StatusCode::kUnavailable, "no RDMA device found ({}); {}",
                 devs.list ? "the device list is empty"
                           : fmt::format("ibv_get_device_list: {}", std::strerror(err)),
                 kRdmaHelp);
  }
  std::vector<std::string> seen;     // what was looked at, for the error message
  std::vector<std::string> reasons;  // why each candidate did not fit
  bool named_found = false;
  for (int d = 0; d < devs.count; ++d) {
    const std::string name = ibv_get_device_name(devs.list[d]);
    seen.push_back(name);
    if (!o.device.empty() && o.device != name) continue;
    named_found = true;
    Context c(devs.list[d]);
    if (!c.ctx) {
      reasons.push_back(fmt::format("{}: cannot open it ({})", name, std::strerror(errno)));
      continue;
    }
    ibv_device_attr attr{};
    if (ibv_query_device(c.ctx, &attr) != 0) {
      reasons.push_back(fmt::format("{}: ibv_query_device failed", name));
      continue;
    }
    for (uint32_t port = 1; port <= attr.phys_port_cnt; ++port) {
      ibv_port_attr pa{};
      if (ibv_query_port(c.ctx, static_cast<uint8_t>(port), &pa) != 0) continue;
      std::vector<ibv_gid_entry> gids(pa.gid_tbl_len ? pa.gid_tbl_len : 1);
      const ssize_t n = ibv_query_gid_table(c.ctx, gids.data(), gids.size(), 0);
      gids.resize(n > 0 ? static_cast<size_t>(n) : 0);
      const ibv_gid_entry* pick = nullptr;
      std::string pick_ip;
      for (const ibv_gid_entry& g : gids) {
        if (g.port_num != port) continue;
        std::string gip;
        const bool usable = g.gid_type == IBV_GID_TYPE_ROCE_V2 && Ipv4Mapped(g.gid, &gip);
        if (o.gid_index >= 0) {
          if (g.gid_index != static_cast<uint32_t>(o.gid_index)) continue;
          if (!usable) {
            return Error(StatusCode::kInvalidArgument,
                         "GID index {} of {} port {} is {} {}; the RDMA transport needs a "
                         "RoCE v2 GID holding an IPv4 address (ibv_devinfo -v -d {} lists "
                         "them; omit --gid-index to pick one)",
                         o.gid_index, name, port, GidType(g.gid_type), GidText(g.gid), name);
          }
        } else if (!usable || (!ip.empty() && gip != ip)) {
          continue;
        }
        pick = &g;
        pick_ip = gip;
        break;
      }
      if (!pick) {
        reasons.push_back(
            o.gid_index >= 0
                ? fmt::format("{} port {}: no GID at index {}", name, port, o.gid_index)
            : ip.empty()
                ? fmt::format("{} port {}: no RoCE v2 GID with an IPv4 address (give its "
                              "netdev an IPv4 address)",
                              name, port)
                : fmt::format("{} port {}: no RoCE v2 GID for {}", name, port, ip));
        continue;
      }
      if (pa.state != IBV_PORT_ACTIVE) {
        reasons.push_back(fmt::format("{} port {} is {} (bring its netdev {} up: ip link set {} up)",
                                      name, port, ibv_port_state_str(pa.state),
                                      Netdev(pick->ndev_ifindex), Netdev(pick->ndev_ifindex)));
        continue;
      }
      DeviceChoice choice;
      choice.device = name;
      choice.port = port;
      choice.gid_index = pick->gid_index;
      choice.ipv4 = pick_ip;
      choice.netdev = Netdev(pick->ndev_ifindex);
      return choice;
    }
  }
  if (!o.device.empty() && !named_found) {
    return Error(StatusCode::kNotFound, "RDMA device '{}' not found (devices here: {}); {}",
                 o.device, fmt::join(seen, ", "), kRdmaHelp);
  }
  return Error(StatusCode::kUnavailable, "no usable RDMA port: {}; {}",
               fmt::join(reasons, "; "), kRdmaHelp);
}

}  // namespace dsync::rdma
