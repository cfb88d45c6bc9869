// The roles' public Start functions: each validates its configuration, finds the scheduler
// (rendezvous file) where it needs to, and wires the role to the backends this build and
// machine give it (backends.h). The roles themselves (src/ps) know only the interfaces.
#include "dsync/scheduler.h"
#include "dsync/server.h"
#include "dsync/worker.h"
#include "ps/net_address.h"
#include "ps/rendezvous.h"
#include "ps/scheduler_node.h"
#include "ps/server_node.h"
#include "ps/worker_node.h"
#include "runtime/backends.h"

namespace dsync {

Result<std::unique_ptr<Scheduler>> Scheduler::Start(const Config& config) {
  DSYNC_RETURN_IF_ERROR(config.Validate());
  DSYNC_ASSIGN_OR_RETURN(auto transport, runtime::MakeTransport(config));
  return ps::StartScheduler(config, std::move(transport));
}

Result<std::unique_ptr<Server>> Server::Start(const Config& given) {
  DSYNC_RETURN_IF_ERROR(given.Validate());
  DSYNC_ASSIGN_OR_RETURN(const Config config, ps::FindScheduler(given));
  DSYNC_ASSIGN_OR_RETURN(auto transport, runtime::MakeTransport(config));
  DSYNC_ASSIGN_OR_RETURN(auto store, runtime::MakeParamStore(config));
  return ps::StartServer(config, std::move(transport), std::move(store));
}

Result<std::unique_ptr<Worker>> Worker::Start(const Config& given) {
  DSYNC_RETURN_IF_ERROR(given.Validate());
  // A worker listens nowhere, but a NIC name that does not exist on this host is a slip in
  // the job's script all the same (the job's servers get the same variable): said, not
  // ignored.
  if (auto nic = ps::ResolveListenHost(given.bind_host); !nic.ok()) {
    return nic.status().WithContext("DSYNC_INTERFACE/--interface of this worker");
  }
  DSYNC_ASSIGN_OR_RETURN(const Config config, ps::FindScheduler(given));
  DSYNC_ASSIGN_OR_RETURN(auto transport, runtime::MakeTransport(config));
  return ps::StartWorker(config, std::move(transport));
}

}  // namespace dsync
