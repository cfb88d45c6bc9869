// A scheduler and S servers inside this process, each with its own transport on the
// configured interface (127.0.0.1 by default) and ephemeral ports: for tests, benchmarks and
// single-machine experiments. Workers join it as usual, with WorkerConfig().
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <vector>

#include "dsync/config.h"
#include "dsync/scheduler.h"
#include "dsync/server.h"
#include "dsync/status.h"

namespace dsync {

class InProcessCluster {
 public:
  // config.scheduler_port 0 picks a free port. Returns once every server has registered.
  static Result<std::unique_ptr<InProcessCluster>> Start(Config config);
  ~InProcessCluster();  // stops whatever still runs
  InProcessCluster(const InProcessCluster&) = delete;
  InProcessCluster& operator=(const InProcessCluster&) = delete;

  const Config& config() const { return config_; }  // with the scheduler's actual port
  Config WorkerConfig() const;
  Scheduler& scheduler() { return *scheduler_; }
  Server& server(size_t i) { return *servers_[i]; }
  size_t num_servers() const { return servers_.size(); }

  // Waits for the job to end by itself (every worker gone, every round applied) and returns
  // the first failure of the scheduler or a server.
  Status WaitFinished(std::chrono::milliseconds timeout);

 private:
  explicit InProcessCluster(Config config) : config_(std::move(config)) {}
  Status Init();

  Config config_;
  std::unique_ptr<Scheduler> scheduler_;
  std::future<Status> scheduler_done_;
  std::vector<std::unique_ptr<Server>> servers_;
  std::vector<std::future<Status>> server_done_;
};

}  // namespace dsync
