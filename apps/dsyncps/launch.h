// `dsyncps launch -- CMD` and `dsyncps join -- CMD`: the user's own program as the job's
// workers, the way torchrun or bpslaunch run a training script.
//   launch on one machine: starts the scheduler and --servers servers, runs CMD --workers
//     times with what a worker needs in its environment (DSYNC_ROLE=worker, the scheduler's
//     address, the token, DSYNC_WORKER_RANK, the job's settings); the job ends when the
//     workers have ended, and the command's exit code is theirs.
//   launch under srun or mpirun (a task rank in the environment): rank 0 runs the scheduler,
//     ranks 1..S the servers, and every other rank execs CMD as a worker.
//   join: execs CMD as one more worker of a running job.
// Worker::Start(Config::FromProcessEnvironment()) in CMD then joins the job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsync/config.h"

namespace dsync::app {

struct LaunchOptions {
  uint32_t servers = 1;
  uint32_t workers = 1;         // on one machine; under srun/mpirun the ranks decide
  bool workers_given = false;
  uint32_t timeout_s = 0;       // on one machine: stop the job after this long (0: never)
  // on one machine: the job has ended; a worker still evaluating or saving gets this long
  uint32_t exit_grace_s = 300;
  std::vector<std::string> command;  // the worker program and its arguments
};

// `job`: the environment and the flags, with num_servers = options.servers.
int RunLaunchCommand(const std::string& self, const LaunchOptions& options, Config job);
int RunJoinCommand(const Config& job, const std::vector<std::string>& command);

}  // namespace dsync::app
