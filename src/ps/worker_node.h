// A worker on the transport it is given (the roles' Start functions pick one, src/runtime).
#pragma once

#include <memory>

#include "dsync/config.h"
#include "dsync/worker.h"
#include "ps/transport.h"

namespace dsync::ps {

// Joins the job named by `config` (its scheduler address already found); tells the launcher
// (if any) once it has joined.
Result<std::unique_ptr<Worker>> StartWorker(const Config& config,
                                            std::unique_ptr<Transport> transport);

}  // namespace dsync::ps
