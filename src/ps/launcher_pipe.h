// A launcher's ready pipe (DSYNC_READY_FD): a process started by `dsyncps local`, `train` or
// `launch` writes one line there once it is up — the scheduler its port once it listens, a
// worker its id once it has joined the job — so the launcher can tell a worker that failed
// before joining (the job cannot start without it) from one that died in the job (which the
// job survives). Worker::Start writes it itself, so the user's own worker programs do too.
#pragma once

#include <string_view>

namespace dsync::ps {

// Writes `line` and a newline to the pipe named by DSYNC_READY_FD, then closes it. Once per
// process; nothing without the variable, or when that descriptor is not a pipe (the number
// may have been reused for something else by then).
void TellLauncher(std::string_view line);

}  // namespace dsync::ps
