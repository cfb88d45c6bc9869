// A scheduler with the transport it is given rather than the one its configuration names:
// for tests that wrap a transport to control when frames are delivered.
#pragma once

#include <memory>

#include "dsync/config.h"
#include "dsync/scheduler.h"
#include "ps/transport.h"

namespace dsync::ps {

Result<std::unique_ptr<Scheduler>> StartScheduler(const Config& config,
                                                  std::unique_ptr<Transport> transport);

}  // namespace dsync::ps
