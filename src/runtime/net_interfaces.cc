// NIC names and routes, from getifaddrs(3) and the kernel's routing table. A UDP socket that
// is connect()ed is bound by the kernel to the source address of the route to its peer, and
// sends nothing (udp(7)): getsockname then tells which local address reaches the scheduler.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "ps/net_address.h"

namespace dsync::ps {
namespace {

std::string AddressText(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, text, sizeof(text));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

// A link-local IPv6 address needs its interface's scope to be reached, which a host string
// handed to peers on other hosts cannot carry.
bool IsLinkLocal(const sockaddr* sa) {
  return sa->sa_family == AF_INET6 &&
         IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

struct Nic {
  std::vector<std::string> ipv4;
  std::vector<std::string> ipv6;  // global ones only
  bool up = false;
  bool loopback = false;
};

// Every NIC by name, in name order (for messages that list them).
Result<std::map<std::string, Nic>> Nics() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return Error(StatusCode::kUnavailable, "cannot list this host's NICs (getifaddrs: {})",
                 std::strerror(errno));
  }
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> owned(list, freeifaddrs);
  std::map<std::string, Nic> nics;
  for (const ifaddrs* a = list; a; a = a->ifa_next) {
    Nic& nic = nics[a->ifa_name];
    nic.up = nic.up || (a->ifa_flags & IFF_UP);
    nic.loopback = nic.loopback || (a->ifa_flags & IFF_LOOPBACK);
    if (!a->ifa_addr) continue;
    if (a->ifa_addr->sa_family == AF_INET) nic.ipv4.push_back(AddressText(a->ifa_addr));
    if (a->ifa_addr->sa_family == AF_INET6 && !IsLinkLocal(a->ifa_addr)) {
      nic.ipv6.push_back(AddressText(a->ifa_addr));
    }
  }
  return nics;
}

std::string DescribeNics(const std::map<std::string, Nic>& nics) {
  std::string out;
  for (const auto& [name, nic] : nics) {
    if (!out.empty()) out += ", ";
    out += name;
    for (const auto& a : nic.ipv4) out += " " + a;
    for (const auto& a : nic.ipv6) out += " " + a;
    if (nic.ipv4.empty() && nic.ipv6.empty()) out += " (no address)";
  }
  return out.empty() ? "none" : out;
}

bool IsAddressLiteral(const std::string& host) {
  in6_addr v6;
  in_addr v4;
  return inet_pton(AF_INET, host.c_str(), &v4) == 1 || inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

bool Resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  freeaddrinfo(res);
  return true;
}

std::string Unbracketed(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

bool IsWildcardHost(const std::string& host) {
  const std::string h = Unbracketed(host);
  return h.empty() || h == "0.0.0.0" || h == "::";
}

Result<std::string> ResolveListenHost(const std::string& spec) {
  const std::string host = Unbracketed(spec);
  if (host.empty() || IsAddressLiteral(host)) return host;
  DSYNC_ASSIGN_OR_RETURN(auto nics, Nics());
  if (auto it = nics.find(host); it != nics.end()) {
    const Nic& nic = it->second;
    if (!nic.ipv4.empty()) return nic.ipv4.front();
    if (!nic.ipv6.empty()) return nic.ipv6.front();
    return Error(StatusCode::kInvalidArgument,
                 "interface '{}' has no IPv4 or global IPv6 address{} (NICs here: {})", host,
                 nic.up ? "" : " and is down", DescribeNics(nics));
  }
  if (Resolves(host)) return host;
  return Error(StatusCode::kInvalidArgument,
               "interface '{}' is neither a NIC of this host nor an address or host name it "
               "can resolve (NICs here: {})",
               host, DescribeNics(nics));
}

Result<std::string> AdvertisedHost(const std::string& listen_host, const std::string& advertise,
                                   const std::string& toward_host, uint16_t toward_port) {
  if (!advertise.empty()) {
    const std::string a = Unbracketed(advertise);
    if (IsWildcardHost(a)) {
      return Error(StatusCode::kInvalidArgument,
                   "--advertise {} is a wildcard; peers need an address they can connect to",
                   advertise);
    }
    return a;
  }
  if (!IsWildcardHost(listen_host)) return Unbracketed(listen_host);
  if (toward_host.empty()) {
    // Nobody to route to (the scheduler itself): the first address of a NIC that is up and
    // not loopback, IPv4 first; a host with none has only loopback to offer.
    DSYNC_ASSIGN_OR_RETURN(auto nics, Nics());
    for (const bool v4 : {true, false}) {
      for (const auto& [name, nic] : nics) {
        (void)name;
        const auto& list = v4 ? nic.ipv4 : nic.ipv6;
        if (!nic.up || nic.loopback || list.empty()) continue;
        return list.front();
      }
    }
    return std::string("127.0.0.1");
  }
  const std::string hint = fmt::format(
      "this node listens on every address ({}); set --advertise (DSYNC_ADVERTISE) to the "
      "address its peers reach it at, or --interface to one NIC",
      listen_host.empty() ? "0.0.0.0" : listen_host);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(toward_port);
  if (int rc = getaddrinfo(Unbracketed(toward_host).c_str(), service.c_str(), &hints, &res);
      rc != 0) {
    return Error(StatusCode::kUnavailable, "cannot resolve the scheduler's host '{}' ({}): {}",
                 toward_host, gai_strerror(rc), hint);
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(res, freeaddrinfo);
  int last_error = 0;
  for (const addrinfo* ai = res; ai; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = errno;
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const bool routed = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!routed) last_error = errno;
    close(fd);
    if (routed) return AddressText(reinterpret_cast<const sockaddr*>(&local));
  }
  return Error(StatusCode::kUnavailable, "no route to the scheduler at {}:{} ({}): {}",
               toward_host, toward_port, std::strerror(last_error), hint);
}

}  // namespace dsync::ps
