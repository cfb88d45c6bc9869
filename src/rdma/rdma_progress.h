// The RDMA transport's progress thread: it polls the CQs while there is traffic and sleeps
// on the completion channels otherwise (adaptive polling), handles rdma_cm events and close
// requests, and drains what was sent before a close or shutdown. Every handler callback runs
// on it, which gives the Transport threading contract (ps/transport.h).
#pragma once

#include <poll.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "rdma/rdma_conn.h"

namespace dsync::rdma {

class ConnTable;
class ConnManager;
class EagerChannel;

class Progress {
 public:
  Progress(const RdmaOptions& options, ConnTable& table, ConnManager& conns, EagerChannel& eager)
      : tunables_(options.tunables), table_(table), conns_(conns), eager_(eager) {}
  ~Progress();  // closes the wake eventfd (after Stop and Join)
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  Status Init();  // the wake eventfd
  void Start();   // the thread
  // Shutdown(): the loop tears every connection down and ends; joined here unless called on
  // the progress thread itself (a handler), which finishes after it.
  void Stop();
  void Join();
  bool stopping() const { return stopping_.load(); }

  // Close requests are carried out by the progress thread, which owns the teardown. Any
  // thread.
  void RequestClose(const std::shared_ptr<Conn>& c, Status why = {}, bool graceful = false);
  // Handles every completion already in the connection's queue (progress thread).
  void DrainReceived(const std::shared_ptr<Conn>& c);

  uint64_t sleeps() const { return sleeps_.load(); }

 private:
  void Wake();
  void Loop();
  void ArmCqs();
  void DrainCqEvents();
  bool PollCqs();
  // Up to `batches` batches of c's completions, handled while it is not closed (PollCq).
  int Complete(const std::shared_ptr<Conn>& c, uint32_t batches);
  bool HandleCloseRequests();
  void DrainSends(std::span<const std::shared_ptr<Conn>> cs, SteadyClock::time_point deadline);

  const RdmaTunables& tunables_;
  ConnTable& table_;
  ConnManager& conns_;
  EagerChannel& eager_;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> progress_id_;  // set by the loop, read by Stop() on any thread
  std::atomic<bool> stopping_{false};
  std::mutex shutdown_mu_;
  std::atomic<uint64_t> sleeps_{0};

  // Guards close_requests_ (a request's Conn::why and Conn::graceful are under Conn::mu).
  std::mutex close_mu_;
  std::vector<std::shared_ptr<Conn>> close_requests_;

  // Reused by every pass of the loop (cleared, capacity kept): a pass allocates nothing.
  std::vector<std::shared_ptr<Conn>> open_;
  std::vector<std::shared_ptr<Conn>> closing_;
  std::vector<ibv_comp_channel*> channels_;
  std::vector<pollfd> fds_;
};

}  // namespace dsync::rdma
