// The Transport and ParamStore a node runs with, from its configuration and what this build
// and machine have. src/runtime is the one place that knows which backends exist: the roles'
// Start functions (start_roles.cc) get their backends here; src/ps never names one.
#pragma once

#include <memory>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/param_store.h"
#include "ps/transport.h"

namespace dsync::runtime {

Result<std::unique_ptr<ps::Transport>> MakeTransport(const Config& config);
// The limits on strangers a node's transport applies, from its configuration.
ps::AdmissionLimits AdmissionLimitsOf(const Config& config);
Result<std::unique_ptr<ps::ParamStore>> MakeParamStore(const Config& config);

}  // namespace dsync::runtime
