// A server node: holds the slices placed on it, stages pushed gradients, applies the rounds
// the scheduler decides, answers pulls.
#pragma once

#include <cstdint>
#include <memory>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"

namespace dsync {

struct ServerStats {
  Round rounds_applied = 0;       // = the server's model version
  uint64_t gradients_applied = 0; // (worker, clock) gradients applied, counted once each
  uint64_t pushes_received = 0;   // slice pushes staged
  uint64_t pulls_answered = 0;
  uint64_t requests_refused = 0;  // bad requests answered with an error
  uint64_t connections_dropped = 0;
  uint64_t slices = 0;
  uint64_t staged_slices = 0;     // pushed slices held now, waiting for their round
  uint64_t staging_buffers = 0;   // receive buffers the pool has ever created
  uint64_t device_buffers = 0;    // of those, in GPU memory (GPUDirect RDMA)
};

class Server {
 public:
  // Binds the listener and registers with the scheduler (blocking until it answers).
  static Result<std::unique_ptr<Server>> Start(const Config& config);
  virtual ~Server() = default;

  virtual NodeId id() const = 0;
  virtual uint16_t port() const = 0;
  // Serves until the scheduler ends the job (OK) or something fatal happens.
  virtual Status Run() = 0;
  virtual void Stop() = 0;
  virtual ServerStats stats() const = 0;
};

}  // namespace dsync
