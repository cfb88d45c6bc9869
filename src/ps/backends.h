// The roles get their Transport and ParamStore from here. Only the declarations live in
// src/ps; src/runtime defines them and is the one place that knows which backends exist.
#pragma once

#include <memory>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/param_store.h"
#include "ps/transport.h"

namespace dsync::ps {

Result<std::unique_ptr<Transport>> MakeTransport(const Config& config);
// The limits on strangers a node's transport applies, from its configuration.
AdmissionLimits AdmissionLimitsOf(const Config& config);
Result<std::unique_ptr<ParamStore>> MakeParamStore(const Config& config);

}  // namespace dsync::ps
