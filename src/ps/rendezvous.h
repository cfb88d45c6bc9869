// Finding the scheduler through a file every node can read (a shared file system): the
// scheduler writes its address there once it listens, atomically (a temporary file renamed
// over it), and removes it when it ends; the other nodes wait for it, bounded by their
// connect timeout. For launchers that give no node list: mpirun, Kubernetes, plain ssh.
#pragma once

#include <string>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/transport.h"

namespace dsync::ps {

// Writes "dsyncps-scheduler HOST PORT" to `path`.
Status WriteRendezvous(const std::string& path, const std::string& host, uint16_t port);

// Removes `path` if it still names this scheduler (a newer one may have replaced it).
void RemoveRendezvous(const std::string& path, const std::string& host, uint16_t port);

// With config.rendezvous set: waits up to config.connect_timeout_ms for the file and returns
// the configuration with the scheduler's host and port from it. Without: the configuration.
Result<Config> FindScheduler(const Config& config);

// A node that lost its scheduler connects to it again: at the address the rendezvous file
// names now (a restarted scheduler may be on another host), else at the one it knew;
// `timeout_ms` bounds the attempt.
Result<PeerId> ReconnectScheduler(Transport& transport, const Config& config,
                                  uint32_t timeout_ms);

}  // namespace dsync::ps
