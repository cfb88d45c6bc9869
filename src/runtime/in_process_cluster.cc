#include "dsync/in_process_cluster.h"

namespace dsync {

Result<std::unique_ptr<InProcessCluster>> InProcessCluster::Start(Config config) {
  std::unique_ptr<InProcessCluster> c(new InProcessCluster(std::move(config)));
  DSYNC_RETURN_IF_ERROR(c->Init());
  return c;
}

Status InProcessCluster::Init() {
  config_.role = Role::kScheduler;
  DSYNC_ASSIGN_OR_RETURN(scheduler_, Scheduler::Start(config_));
  config_.scheduler_port = scheduler_->port();
  scheduler_done_ = std::async(std::launch::async, [this] { return scheduler_->Run(); });
  Config server_config = config_;
  server_config.role = Role::kServer;
  server_config.port = 0;
  // Servers register concurrently: Start blocks until the scheduler answers.
  std::vector<std::future<Result<std::unique_ptr<Server>>>> starting;
  for (uint32_t i = 0; i < config_.num_servers; ++i) {
    starting.push_back(
        std::async(std::launch::async, [server_config] { return Server::Start(server_config); }));
  }
  Status first;
  for (auto& f : starting) {
    auto s = f.get();
    if (!s.ok()) {
      if (first.ok()) first = s.status().WithContext("starting a server");
      continue;
    }
    servers_.push_back(std::move(s).value());
  }
  for (auto& s : servers_) {
    Server* raw = s.get();
    server_done_.push_back(std::async(std::launch::async, [raw] { return raw->Run(); }));
  }
  return first;
}

InProcessCluster::~InProcessCluster() {
  if (scheduler_) scheduler_->Stop();
  for (auto& s : servers_) s->Stop();
  for (auto& f : server_done_) {
    if (f.valid()) f.wait();
  }
  if (scheduler_done_.valid()) scheduler_done_.wait();
}

Config InProcessCluster::WorkerConfig() const {
  Config c = config_;
  c.role = Role::kWorker;
  return c;
}

Status InProcessCluster::WaitFinished(std::chrono::milliseconds timeout) {
  if (!scheduler_done_.valid()) return Status::Ok();
  if (scheduler_done_.wait_for(timeout) != std::future_status::ready) {
    return Error(StatusCode::kDeadlineExceeded, "the job did not finish within {} ms",
                 timeout.count());
  }
  Status result = scheduler_done_.get();
  for (auto& f : server_done_) {
    if (!f.valid()) continue;
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      return Error(StatusCode::kDeadlineExceeded, "a server did not stop after the job ended");
    }
    Status st = f.get();
    if (result.ok()) result = st;
  }
  return result;
}

}  // namespace dsync
