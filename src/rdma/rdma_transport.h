// The RDMA implementation of the Transport seam: libibverbs for data, librdmacm for
// connection setup, one RC queue pair per peer.
//
// Protocol (see rdma_transport.cc for the details and the reasons):
// - Small frames (header + metadata + payload fit in one slot) are *eager*: copied into a
//   registered staging slot and written with RDMA WRITE WITH IMMEDIATE into the next slot
//   of a ring the receiver registered for this peer. Credit-based flow control: the sender
//   owns as many credits as the receiver has slots and gets them back in immediate-only
//   writes once the receiver has consumed the slots.
// - Larger payloads go by *rendezvous*: a ready-to-send message in a slot carries the header
//   and metadata; the receiver asks its handler where the payload goes (OnHeader),
//   registers that buffer and writes a clear-to-send entry (address, rkey) into the
//   sender's CTS FIFO, as NCCL does; the sender then writes the payload straight into the
//   destination with RDMA WRITE WITH IMMEDIATE. Zero copies on either side: a pull reply
//   lands in the worker's own tensor buffer.
// - Completions: one progress thread busy-polls while there is traffic and sleeps on the
//   completion channel otherwise (adaptive polling), so an idle node uses no CPU.
#pragma once

#include <chrono>
#include <memory>

#include "dsync/status.h"
#include "ps/transport.h"
#include "rdma/rdma_device.h"

namespace dsync::rdma {

struct RdmaOptions {
  DeviceOptions device;
  uint32_t slots = 32;           // eager ring slots per connection and direction
  uint32_t slot_bytes = 8192;    // eager frames up to this size (slot header included)
  uint32_t max_rendezvous = 16;  // rendezvous sends in flight per connection (CTS FIFO size)
  // After the last completion the progress thread keeps polling this long before it sleeps
  // on the completion channel: low latency under load, no core burnt when idle.
  std::chrono::microseconds spin{200};
  // Inbound connections before they authenticate (ps/transport.h): each costs a registered
  // ring, so they are capped before any is set up.
  ps::AdmissionLimits admission;
};

struct RdmaStats {
  uint64_t eager_frames = 0;       // sent whole in slots
  uint64_t rendezvous_frames = 0;  // sent by RTS/CTS and a direct write
  uint64_t credit_stalls = 0;      // sends that waited for credits or a staging slot
  uint64_t registrations = 0;      // ibv_reg_mr calls by the registration cache
  uint64_t registration_hits = 0;  // registrations reused
  uint64_t device_registrations = 0;  // of GPU memory, through dma-buf (GPUDirect RDMA)
  uint64_t sleeps = 0;             // times the progress thread slept on the channel
};

class RdmaTransport : public ps::Transport {
 public:
  virtual RdmaStats stats() const = 0;
  virtual const DeviceChoice& device() const = 0;
};

// Unavailable, with what to do, where no usable RDMA device exists.
Result<std::unique_ptr<RdmaTransport>> MakeRdmaTransport(const RdmaOptions& options = {});

}  // namespace dsync::rdma
