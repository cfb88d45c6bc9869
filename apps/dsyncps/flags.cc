#include "flags.h"

#include <spdlog/spdlog.h>

namespace dsync::app {

void AddNodeFlags(CLI::App& app, Config& c, FlagText& text) {
  app.add_option("--scheduler-uri,--scheduler-host", c.scheduler_host,
                 "scheduler address (DSYNC_SCHEDULER_URI)")
      ->capture_default_str();
  app.add_option("--scheduler-port", c.scheduler_port, "scheduler port (DSYNC_SCHEDULER_PORT)")
      ->capture_default_str();
  app.add_option("--interface,--bind", c.bind_host,
                 "NIC name (eth0) or address this node listens on (DSYNC_INTERFACE); "
                 "loopback unless set, 0.0.0.0 or :: for every address")
      ->capture_default_str();
  app.add_option("--advertise", c.advertise_host,
                 "address a server tells its peers to reach it at (DSYNC_ADVERTISE; default: "
                 "its --interface address, or for a wildcard the one that routes to the "
                 "scheduler)");
  app.add_option("--rendezvous", c.rendezvous,
                 "a file every node can read: the scheduler writes its address there, the "
                 "others wait for it (DSYNC_RENDEZVOUS; instead of --scheduler-uri/-port)");
  app.add_option("--port", c.port, "port this node listens on; 0 picks one (DSYNC_PORT)")
      ->capture_default_str();
  app.add_option("--token", c.token, "cluster token shared by every node (DSYNC_TOKEN)");
  app.add_flag("--insecure", c.insecure,
               "run without a cluster token: anyone who reaches the ports may join "
               "(DSYNC_INSECURE=1)");
  app.add_option("--heartbeat-ms", c.heartbeat_interval_ms, "heartbeat interval (DSYNC_HEARTBEAT_MS)")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout-ms", c.heartbeat_timeout_ms,
                 "a worker silent this long is declared dead (DSYNC_HEARTBEAT_TIMEOUT_MS)")
      ->capture_default_str();
  app.add_option("--connect-timeout-ms", c.connect_timeout_ms,
                 "how long to retry reaching a peer (DSYNC_CONNECT_TIMEOUT_MS)")
      ->capture_default_str();
  app.add_option("--transport", c.transport,
                 "tcp | rdma (libibverbs/librdmacm; listen with --bind on the RDMA netdev's IP) "
                 "| auto (rdma when a usable device exists) (DSYNC_TRANSPORT)")
      ->capture_default_str();
  app.add_option("--rdma-device", c.rdma_device,
                 "RDMA device, e.g. mlx5_0 or rxe0 (DSYNC_RDMA_DEVICE; default: the first with "
                 "an active port and an IPv4 RoCE v2 GID)");
  app.add_option("--gid-index", c.gid_index,
                 "GID index (DSYNC_GID_INDEX; default: the RoCE v2 IPv4-mapped GID of the "
                 "device's netdev)");
  app.add_option("--store", c.store,
                 "parameter store: cpu | cuda | auto (the GPU when one is visible) (DSYNC_STORE)")
      ->capture_default_str();
  app.add_option("--gpudirect", c.gpudirect,
                 "servers: NIC reads/writes GPU memory directly (GPUDirect RDMA over dma-buf): "
                 "auto | on (fail if impossible) | off (DSYNC_GPUDIRECT)")
      ->capture_default_str();
  app.add_option("--log-level", text.log_level, "trace|debug|info|warn|error")
      ->capture_default_str();
}

void AddJobFlags(CLI::App& app, Config& c, FlagText& text, bool cluster_size) {
  app.add_option("--sync", text.sync,
                 "bsp | dsync:K | dsync:K,Q | dsync:auto[:KMAX] | ssp:K | asp (DSYNC_SYNC; "
                 "default bsp)");
  app.add_option("--optimizer", text.optimizer, "sgd | momentum | adam | sum (DSYNC_OPTIMIZER)");
  app.add_option("--lr", c.optimizer.lr, "learning rate (DSYNC_LR)")->capture_default_str();
  app.add_option("--momentum", c.optimizer.momentum, "momentum (DSYNC_MOMENTUM)")
      ->capture_default_str();
  app.add_option("--beta1", c.optimizer.beta1, "adam beta1")->capture_default_str();
  app.add_option("--beta2", c.optimizer.beta2, "adam beta2")->capture_default_str();
  app.add_option("--eps", c.optimizer.eps, "adam epsilon")->capture_default_str();
  app.add_option("--weight-decay", c.optimizer.weight_decay, "L2 weight decay")
      ->capture_default_str();
  app.add_option("--slice-bytes", text.slice,
                 "tensors are cut into slices of this size, e.g. 4M (DSYNC_SLICE_BYTES)");
  if (cluster_size) {
    app.add_option("--num-servers", c.num_servers, "servers in the job (DSYNC_NUM_SERVERS)")
        ->capture_default_str();
    app.add_option("--num-workers", c.num_workers,
                   "workers that start the job together (DSYNC_NUM_WORKERS); more may join later")
        ->capture_default_str();
  }
  app.add_option("--audit-log", c.audit_log, "scheduler: write each round decision here (JSON lines)");
  app.add_option("--dump-model", c.dump_model,
                 "server: at the end, write per-slice summaries to this directory");
}

Status ApplyFlagText(const FlagText& text, Config& c) {
  if (!text.sync.empty()) {
    DSYNC_ASSIGN_OR_RETURN(c.sync, SyncMode::Parse(text.sync));
  }
  if (!text.optimizer.empty()) {
    DSYNC_ASSIGN_OR_RETURN(c.optimizer.kind, ParseOptimizer(text.optimizer));
  }
  if (!text.slice.empty()) {
    // Reuse the environment parser's size syntax (4M, 512k, ...).
    DSYNC_ASSIGN_OR_RETURN(Config parsed,
                           Config::FromEnvironment({{"DSYNC_SLICE_BYTES", text.slice}}));
    c.slice_bytes = parsed.slice_bytes;
  }
  const auto level = spdlog::level::from_str(text.log_level);
  if (level == spdlog::level::off && text.log_level != "off") {
    return Error(StatusCode::kInvalidArgument, "log level '{}' is not one of trace, debug, info, "
                 "warn, error, off", text.log_level);
  }
  spdlog::set_level(level);
  return Status::Ok();
}

}  // namespace dsync::app
