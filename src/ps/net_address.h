// Which address a node listens on and which it tells its peers. Declared here for the roles,
// defined in src/runtime (it asks the operating system about its NICs and routes).
#pragma once

#include <cstdint>
#include <string>

#include "dsync/status.h"

namespace dsync::ps {

// The address to listen on for --interface / DSYNC_INTERFACE `spec`: a NIC's name (eth0,
// ib0, as ps-lite's DMLC_INTERFACE takes) becomes that NIC's IPv4 address (or its first
// global IPv6 one); an address or a resolvable host name is kept; "[v6]" loses its
// brackets; empty stays empty (every address). Anything else is an error naming the NICs
// this host has.
Result<std::string> ResolveListenHost(const std::string& spec);

// True for the addresses that mean "every address": "", 0.0.0.0, ::.
bool IsWildcardHost(const std::string& host);

// The host a node tells its peers to connect to: `advertise` (--advertise, DSYNC_ADVERTISE)
// when set; for a wildcard `listen_host`, the address of this host's interface that routes
// to the scheduler at `toward_host`:`toward_port` (with no `toward_host`: the first address
// of a NIC that is up and not loopback); else `listen_host` itself.
Result<std::string> AdvertisedHost(const std::string& listen_host, const std::string& advertise,
                                   const std::string& toward_host, uint16_t toward_port);

}  // namespace dsync::ps
