// Job and node configuration: from environment variables (ps-lite/BytePS style names, with
// DMLC_* accepted as fallbacks) and from command-line flags (apps/). The scheduler is the
// source of truth for job-wide settings (sync mode, optimizer, slice size): servers and
// workers receive them in the join handshake, so a cluster cannot run with two opinions.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <vector>
#include <optional>
#include <string>
#include <string_view>

#include "dsync/status.h"

namespace dsync {

enum class Role { kScheduler, kServer, kWorker };
std::string_view RoleName(Role role);
Result<Role> ParseRole(std::string_view text);

// docs/contract.md. Round modes (bsp, dsync) close rounds by the delay bound D and quorum Q;
// ssp and asp apply each gradient on arrival (one gradient per round).
enum class SyncKind { kRound, kSsp, kAsp };

struct SyncMode {
  static constexpr uint32_t kAll = 0;  // quorum: every live worker
  static constexpr uint32_t kUnbounded = std::numeric_limits<uint32_t>::max();

  SyncKind kind = SyncKind::kRound;
  uint32_t bound = 0;       // D (round modes) or K (ssp); kUnbounded for asp
  uint32_t quorum = kAll;   // Q for round modes
  // dsync:auto: the scheduler chooses the quorum and each worker's allowance (<= bound,
  // the maximum) per round from measured iteration times (src/ps/auto_policy.h).
  bool adaptive = false;

  static constexpr uint32_t kDefaultAutoMax = 4;

  static SyncMode Bsp() { return {}; }
  static SyncMode Dsync(uint32_t d, uint32_t q = kAll) {
    // D = 0 forces the quorum to "all": dsync:0 is bsp.
    return {SyncKind::kRound, d, d == 0 ? kAll : q};
  }
  static SyncMode Auto(uint32_t max_bound = kDefaultAutoMax) {
    return {SyncKind::kRound, max_bound, kAll, true};
  }
  static SyncMode Ssp(uint32_t k) { return {SyncKind::kSsp, k, kAll}; }
  static SyncMode Asp() { return {SyncKind::kAsp, kUnbounded, 1}; }

  // "bsp", "dsync:K", "dsync:K,Q", "dsync:auto", "dsync:auto:KMAX", "ssp:K", "asp".
  static Result<SyncMode> Parse(std::string_view text);
  std::string ToString() const;
  bool operator==(const SyncMode&) const = default;
};

// How the servers treat a gradient that is s rounds stale (s = the round it is applied in
// minus the model version it was computed on; docs/contract.md, "Staleness"), chosen per job.
// Its weight: none weighs every gradient 1; inverse weighs it 1 / (1 + s) (staleness-aware
// asynchronous SGD: the learning rate divided by the staleness); exp:C weighs it C^s,
// 0 < C <= 1. Its delay compensation (dc:L[,D], alone or after a weight: "inverse+dc:L"):
// g + L * g * g * (w - w_base), DC-ASGD's first-order correction toward the current model w,
// with the servers keeping the last D versions of each slice to know w_base; dca:L[,D] is
// DC-ASGD's adaptive form, L / sqrt(ms) in place of L, ms a running mean of g * g per element.
// A gradient with s = 0 is always left exactly as it is, so bsp is the same under every policy.
// "+momentum", last (or alone), tempers momentum SGD's momentum by the round's staleness
// (RoundMomentum): stale gradients carry a momentum of their own.
// "damp" (or "damp:P", P any of the above but none) applies none until the job shows that
// its stale gradients make it unstable, then P (inverse+momentum for "damp") to the end: the
// scheduler watches the size of the gradients the workers commit and, the round it grows
// fast (GrowthWatch, src/ps/growth_watch.h), tells every server to apply P from that round.
// A bounded job whose step is small enough is stable unpoliced, and every policy costs it
// accuracy; at a step too large for stale gradients it diverges unless damped
// (docs/contract.md, "Staleness").
enum class StalenessKind { kNone, kInverse, kExp };

struct StalenessPolicy {
  // dc:L without D keeps this many versions where the sync mode has no bound of its own
  // (ssp, asp); a round mode keeps its bound D, which no gradient's staleness exceeds.
  static constexpr uint32_t kDefaultCompensationDepth = 4;
  // Each version kept is a copy of every slice: D is capped well below what memory allows.
  static constexpr uint32_t kMaxCompensationDepth = 64;

  StalenessKind kind = StalenessKind::kNone;
  float base = 1.0f;  // exp: C
  float compensation = 0.0f;  // dc, dca: L (0: no compensation)
  uint32_t depth = 0;         // dc, dca: D (0: the default above)
  bool adaptive = false;      // dca
  bool temper_momentum = false;  // +momentum
  // damp: the fields above hold what applies once the scheduler damps the job; none before.
  bool damp = false;

  // "none", "inverse", "exp:C", "dc:L", "dc:L,D", "inverse+dc:L[,D]", "exp:C+dc:L[,D]", and
  // the same with dca for dc; any of them but none followed by "+momentum", or "momentum";
  // "damp" (damp:inverse+momentum) or "damp:" followed by any of them but none.
  static Result<StalenessPolicy> Parse(std::string_view text);
  // What the servers apply to a round: the policy itself, or for damp, none until the job is
  // damped (`damped`) and the damped policy from then on. Never itself a damp policy.
  StalenessPolicy Active(bool damped) const;
  std::string ToString() const;
  // The weight of a gradient `staleness` rounds stale, in [0, 1]; exactly 1 at 0.
  float Weight(uint64_t staleness) const;
  // The momentum a round of momentum SGD steps with, its gradients `mean_staleness` rounds
  // stale on average (weighed as they are summed). Asynchrony acts as momentum of its own
  // (Mitliagkas et al. 2016, "Asynchrony begets momentum"): gradients s rounds stale on
  // average add about s / (1 + s). With +momentum the explicit momentum m is lowered so that
  // the two together keep the gain 1 / (1 - m) of m alone:
  //   (1 - m') (1 - s / (1 + s)) = 1 - m,  i.e.  m' = max(0, 1 - (1 - m)(1 + s)).
  // Without +momentum, or at s = 0, m exactly.
  float RoundMomentum(float momentum, double mean_staleness) const;
  // How many versions of each slice the servers keep to compensate under `sync`: 0 without
  // compensation, or where no gradient is ever stale (bsp). For damp, what the damped policy
  // keeps, from the job's start: the versions are there the round it is damped.
  uint32_t CompensationDepth(const SyncMode& sync) const;
  bool operator==(const StalenessPolicy&) const = default;
};

// The servers' optimizers, with torch.optim's formulas (docs/contract.md, "Optimizers"):
// sgd is torch.optim.SGD without momentum (the momentum field is ignored), momentum is
// torch.optim.SGD with momentum, dampening and nesterov, adam is torch.optim.Adam, adamw is
// torch.optim.AdamW; sum adds the round's gradients (exactness tests). The values travel in
// kInit frames: a new kind goes last.
enum class OptimizerKind { kSgd, kMomentum, kAdam, kSum, kAdamW };
std::string_view OptimizerName(OptimizerKind kind);
Result<OptimizerKind> ParseOptimizer(std::string_view text);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;
  float momentum = 0.9f;
  float dampening = 0.0f;   // momentum
  bool nesterov = false;    // momentum
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  // L2 decay for sgd, momentum and adam; decoupled decay for adamw. One default for all, 0:
  // torch.optim.AdamW's own default is 1e-2, so a front end mirroring it sets it explicitly.
  float weight_decay = 0.0f;
  bool operator==(const OptimizerConfig&) const = default;
};
// Whether the hyperparameters are usable (finite, in range, and combinations torch accepts);
// the error names the flag and variable of the offending one.
Status ValidateOptimizer(const OptimizerConfig& optimizer);
// "adam(lr 0.001, beta1 0.9, ...)": the settings that matter for the kind, for messages.
std::string DescribeOptimizer(const OptimizerConfig& optimizer);

// How nodes talk (DSYNC_TRANSPORT): TCP sockets, RDMA verbs (libibverbs; a clear error where
// no RDMA device is usable), or RDMA where a usable device exists, else TCP.
enum class TransportKind { kTcp, kRdma, kAuto };
std::string_view TransportName(TransportKind kind);
Result<TransportKind> ParseTransport(std::string_view text);

// Where servers keep their slices (DSYNC_STORE): host memory, GPU memory (a clear error
// where no GPU is visible), or the GPU when one is visible.
enum class StoreKind { kCpu, kCuda, kAuto };
std::string_view StoreName(StoreKind kind);
Result<StoreKind> ParseStore(std::string_view text);

// Servers' GPUDirect RDMA, the NIC reading and writing the CUDA store's memory directly
// (DSYNC_GPUDIRECT). auto: where the RDMA device and the GPU driver both support dma-buf,
// else staged through pinned host memory (said once in the log) | on: a server that cannot
// do it fails to start, saying why | off: always staged.
enum class GpuDirectMode { kAuto, kOn, kOff };
std::string_view GpuDirectName(GpuDirectMode mode);
Result<GpuDirectMode> ParseGpuDirect(std::string_view text);

// The scheduler port every task of Slurm job `job_id`, step `step_id` derives alike.
uint16_t SlurmSchedulerPort(uint64_t job_id, uint64_t step_id);

// A job that writes checkpoints and is asked to stop (SIGTERM, SIGINT: Ctrl-C, Slurm's
// scancel or preemption) first writes one of where it is: the scheduler waits this long for it,
// servers keep serving the scheduler up to this long (and a few seconds more), and launchers
// give their processes that much more time before they kill them. Within Slurm's default
// KillWait (30 s).
inline constexpr uint32_t kStopCheckpointSeconds = 20;

// With copies of each slice (Config::replicas > 1), workers pull from primaries only, so
// nothing a worker waits for keeps a backup from falling behind. The scheduler closes no
// round while a live server trails the rounds it announced by this many or more; servers
// then let each worker stage twice its delay bound's window plus this many clocks (a backup
// may still hold those of the rounds it trails).
inline constexpr uint32_t kReplicaLagRounds = 4;

// A node of a journaled job that lost its scheduler tries to reach it again (restarted from
// its journal) until the reconnect grace is over: each attempt waits this long for the
// connection and for the answer to its rejoin, and the next begins this long after a failed
// connect.
inline constexpr uint32_t kRejoinAttemptMs = 1000;
inline constexpr uint32_t kRejoinRetryMs = 200;
// A scheduler whose journal write (write + fdatasync) has not returned for this long stops
// the job: every decision waits for it, and a disk that does not answer would hold the job
// forever while every heartbeat still flows.
inline constexpr uint32_t kJournalStallSeconds = 30;
// A server that takes a lost rank's place must hold every copy of that rank within this long
// of its registration (the workers reach it, the rounds before the copies' version are sent,
// the others send the copies); else it is declared lost again and the job goes on without it.
inline constexpr uint32_t kTakeoverSeconds = 120;
// What one kCopy frame carries at most (one slice more if a single slice is larger): the
// copies a server sends travel in frames of about this size.
inline constexpr uint64_t kCopyChunkBytes = 64ull << 20;
// Until its copies are in, a server taking a lost rank over releases nothing it stages (the
// rounds' version it can start from is not decided yet): it lets each worker stage this many
// times its usual quota meanwhile.
inline constexpr uint32_t kTakeoverStagingFactor = 4;

// dsync:auto's default share of a job's budget run as bsp at its end (Config::finish_bsp_percent).
inline constexpr uint32_t kAutoFinishPercent = 10;

struct Config {
  Role role = Role::kWorker;

  // Where the scheduler listens / is reached.
  std::string scheduler_host = "127.0.0.1";
  uint16_t scheduler_port = 9091;
  // Interface this node's listeners bind to (servers, scheduler). Loopback unless configured:
  // a parameter server accepts model writes from the network (docs/contract.md, "Trust").
  // A NIC name (eth0, ib0) or an address (IPv4, IPv6) or a host name; a NIC's name means its
  // address (ps/net_address.h).
  std::string bind_host = "127.0.0.1";
  // The address a server tells the scheduler (and so the workers) to reach it at. Empty: its
  // listen address, or for a wildcard one (0.0.0.0, ::) the address of its interface that
  // routes to the scheduler. Set it behind NAT or in containers.
  std::string advertise_host;
  // A file on a file system every node shares (--rendezvous, DSYNC_RENDEZVOUS): the scheduler
  // writes its address there; the others read the scheduler's host and port from it.
  std::string rendezvous;
  // Port a server listens on (0: any free port, announced to the scheduler).
  uint16_t port = 0;
  // Cluster token: a peer that does not present it is refused before it can ask to join.
  // Admitted nodes get credentials of their own from the scheduler (docs/contract.md).
  std::string token;
  // Run without a token (everyone who reaches the ports may join): refused unless set.
  bool insecure = false;

  uint32_t num_servers = 1;
  // Copies of every slice, on distinct servers (1..num_servers): a primary that answers pulls
  // and replicas - 1 backups that stage and apply the same gradients, so the job survives
  // the loss of any replicas - 1 servers whose ranks are adjacent (docs/contract.md).
  uint32_t replicas = 1;
  // Workers that must join before round 0 opens; later workers join a running job.
  uint32_t num_workers = 1;

  SyncMode sync;
  OptimizerConfig optimizer;
  StalenessPolicy staleness;
  uint64_t slice_bytes = 4ull << 20;

  // Scheduler: the job's training budget. Once this many gradients are committed, every
  // commit acknowledgement tells its worker to stop (Worker::stop_requested()); 0: the
  // workers decide when they are done.
  uint64_t max_gradients = 0;
  // Scheduler, round modes with a budget: the last this many percent of max_gradients
  // (rounded up to whole gradients) run as bsp (quorum all, no allowance), whatever the mode
  // or dsync:auto's policy would do, so that the rounds that step the model last hold every
  // worker's gradient, none stale (docs/contract.md). 0 delays to the end; the cost is that
  // share of the budget at bsp's pace. Unset: FinishBspPercent()'s default for the mode.
  std::optional<uint32_t> finish_bsp_percent;
  // finish_bsp_percent, or its default: kAutoFinishPercent under dsync:auto, which chose its
  // delay itself; 0 under dsync:K,Q, whose delay the user chose explicitly.
  uint32_t FinishBspPercent() const {
    return finish_bsp_percent.value_or(sync.adaptive ? kAutoFinishPercent : 0);
  }
  // Worker: join as an observer, a read-only client (an evaluator, a monitor) that pulls
  // the newest model without waiting and never pushes, so it never holds a round.
  bool observer = false;
  // Python workers and observers: pin glibc's heap thresholds at start, so that what a step
  // frees serves the next instead of being handed back to the kernel and faulted in again
  // (docs/python.md). false leaves glibc's defaults; so does any MALLOC_* or
  // GLIBC_TUNABLES heap setting of the user's own.
  bool pin_heap = true;

  // Emulated latency added to every frame this node sends (experiments with a far-away
  // worker on one machine, like netem without root); 0 in production.
  uint32_t link_delay_us = 0;

  uint32_t heartbeat_interval_ms = 500;
  uint32_t heartbeat_timeout_ms = 5000;
  uint32_t connect_timeout_ms = 30000;
  // Scheduler: a job that has not started (servers or initial workers missing) ends once no
  // node has arrived for this long, saying what it waited for; 0 waits forever.
  uint32_t start_timeout_ms = 300000;
  // Inbound connections that have not authenticated: dropped after this long, and capped in
  // number per listener and per source address.
  uint32_t handshake_timeout_ms = 10000;
  uint32_t max_pending_connections = 64;
  uint32_t max_pending_per_source = 16;

  TransportKind transport = TransportKind::kTcp;
  std::string rdma_device;  // RDMA device to use (empty: the one on --interface's NIC, else
                            // the first with a usable port)
  int gid_index = -1;       // GID index (-1: the RoCE v2 IPv4-mapped GID of its netdev)
  StoreKind store = StoreKind::kCpu;
  GpuDirectMode gpudirect = GpuDirectMode::kAuto;  // servers

  // Scheduler: append every round decision as a JSON line here (audits, tests).
  std::string audit_log;
  // Scheduler: consistent checkpoints under this directory (docs/contract.md, "Checkpoints"):
  // every `checkpoint_every` rounds (seconds with checkpoint_every_seconds; 0: only the
  // final one, when the job ends), each server writes its slices, the scheduler the manifest.
  std::string checkpoint_dir;
  uint64_t checkpoint_every = 0;
  bool checkpoint_every_seconds = false;
  // Scheduler: start from the newest complete checkpoint under this directory, or, given a
  // journal file, continue the job that journal is of (a restarted scheduler).
  std::string resume;
  // Scheduler: journal every decision to this file, written and fdatasync'd before it is
  // sent, so that the scheduler can be restarted with --resume FILE (docs/contract.md).
  std::string journal;
  // Servers and workers of a journaled job: how long they wait for a lost scheduler to be
  // restarted and take them back before they stop. The scheduler's value is the job's.
  uint32_t reconnect_grace_ms = 30000;
  // Tests of a restartable scheduler (DSYNC_TEST_CRASH_AFTER_ROUND): the scheduler's process
  // ends at once, as if killed, when the journal holds round N on disk and nothing decided
  // with it was sent yet: the worst moment for the nodes, which must get it all again.
  std::optional<uint64_t> test_crash_after_round;
  // Server: at the end of the job, write a summary of every slice (version, min, max, sum)
  // as JSON to this directory (server-<id>.json).
  std::string dump_model;

  // Under srun or mpirun without DSYNC_ROLE: this task's rank, and the number of tasks unless
  // DSYNC_NUM_WORKERS says how many workers there are (ApplyTaskRank).
  std::optional<uint32_t> task_rank;
  std::optional<uint32_t> task_count;
  // Hosts of the Slurm step (SLURM_STEP_NODELIST or SLURM_JOB_NODELIST), 0 outside Slurm.
  // Without DSYNC_SCHEDULER_URI the scheduler is the first of them, at SlurmSchedulerPort
  // unless DSYNC_SCHEDULER_PORT says otherwise; a task of a step over several hosts listens
  // on every address unless DSYNC_INTERFACE says otherwise.
  uint32_t slurm_hosts = 0;

  // Reads DSYNC_* (falling back to ps-lite's DMLC_* names) from `env` over the defaults;
  // every variable is in one table (src/ps/settings.cc), which the flags use too.
  // Launched by srun or mpirun without DSYNC_ROLE, the task rank picks the role: 0 the
  // scheduler, 1..num_servers servers, the rest workers (DSYNC_NUM_WORKERS defaults to them).
  static Result<Config> FromEnvironment(const std::map<std::string, std::string>& env);
  // FromEnvironment over this process's environment; it also logs a warning for every DSYNC_*
  // variable that no node reads (UnknownVariables).
  static Result<Config> FromProcessEnvironment();
  // A warning for each DSYNC_* name in `env` that is no setting and nothing else the
  // processes or the project's scripts read: a misspelt or renamed setting, which would
  // otherwise be ignored in silence. Names the nearest setting, or the new name. None in a
  // process a dsyncps launcher started (DSYNC_ENV_CHECKED): the launcher said it once.
  static std::vector<std::string> UnknownVariables(const std::map<std::string, std::string>& env);
  // The variable the launchers set in the environment of every process they start: the
  // launcher has said what is wrong with the environment they share, and the processes do
  // not say it again.
  static constexpr std::string_view kEnvironmentChecked = "DSYNC_ENV_CHECKED";
  // With a task rank: rank 0 is the scheduler, 1..num_servers servers, the rest workers; with
  // a task count, num_workers = tasks - 1 - num_servers. Run again after flags change
  // num_servers (rank mode takes every flag).
  Status ApplyTaskRank();
  // The DSYNC_* variables that give another process of the job these settings, for launchers
  // (FromEnvironment reads them back to equal values). Left out, being one node's own: the
  // role, the task rank, the listen port, --advertise, the link delay, the audit log and the
  // model dump.
  std::map<std::string, std::string> ToEnvironment() const;
  Status Validate() const;
};

}  // namespace dsync
