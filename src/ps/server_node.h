// A server with the transport and store it is given, rather than the ones its configuration
// names: for tests that wrap a backend to watch what the server does with it.
#pragma once

#include <memory>

#include "dsync/config.h"
#include "dsync/server.h"
#include "ps/param_store.h"
#include "ps/transport.h"

namespace dsync::ps {

Result<std::unique_ptr<Server>> StartServer(const Config& config,
                                            std::unique_ptr<Transport> transport,
                                            std::unique_ptr<ParamStore> store);

}  // namespace dsync::ps
