// Device-memory ParamStore: every slice's parameters and optimizer state live in
// GPU memory; gradients arrive in pinned host buffers (AllocateHost) and are copied to the
// device asynchronously on the calling thread's own stream; a round is applied by one fused
// kernel (sum in worker-id order + the optimizer math shared with the CPU store, 16-byte
// loads where aligned). NVTX ranges: "store: aggregate" (the copies), "store: apply",
// "store: read".
#pragma once

#include <memory>
#include <string>

#include "dsync/status.h"
#include "ps/param_store.h"

namespace dsync::cuda {

// Whether a CUDA device is visible; otherwise `why` says what the runtime answered.
bool DeviceAvailable(std::string* why = nullptr);

// Unavailable (with what to do instead) when no device is visible.
Result<std::unique_ptr<ps::ParamStore>> MakeCudaStore();

}  // namespace dsync::cuda
