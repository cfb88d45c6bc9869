#include "ps/settings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "ps/number_text.h"

namespace dsync::ps {
namespace {

// Readers and writers by member; the table below picks one per setting.
template <auto M>
Status SetText(Config& c, std::string_view v) {
  c.*M = std::string(v);
  return Status::Ok();
}
template <auto M>
std::string GetText(const Config& c) {
  return c.*M;
}

template <auto M, uint64_t kMax = UINT32_MAX>
Status SetUnsigned(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(uint64_t x, ParseUnsigned("", v, kMax));
  c.*M = static_cast<std::remove_reference_t<decltype(c.*M)>>(x);
  return Status::Ok();
}
template <auto M>
std::string GetNumber(const Config& c) {
  return fmt::format("{}", c.*M);
}

// Whole seconds, up to a day, kept in milliseconds.
template <auto M>
Status SetSeconds(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(uint64_t x, ParseUnsigned("", v, 86400));
  c.*M = static_cast<uint32_t>(x * 1000);
  return Status::Ok();
}
template <auto M>
std::string GetSeconds(const Config& c) {
  return fmt::format("{}", c.*M / 1000);
}

Status SetOptionalRound(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(uint64_t x, ParseUnsigned("", v, UINT64_MAX));
  c.test_crash_after_round = x;
  return Status::Ok();
}
// An optional number's text, "" when it is not set.
template <auto M>
std::string GetOptionalNumber(const Config& c) {
  return c.*M ? fmt::format("{}", *(c.*M)) : std::string();
}

// A percentage or "" (unset: the mode's default, Config::FinishBspPercent), the form a
// journal records an unset value in.
Status SetFinishBsp(Config& c, std::string_view v) {
  if (v.empty()) {
    c.finish_bsp_percent.reset();
    return Status::Ok();
  }
  DSYNC_ASSIGN_OR_RETURN(uint64_t x, ParseUnsigned("", v, 100));
  c.finish_bsp_percent = static_cast<uint32_t>(x);
  return Status::Ok();
}

template <auto M>
Status SetPort(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(uint64_t x, ParseUnsigned("", v, UINT64_MAX));
  if (x > 65535) return Error(StatusCode::kInvalidArgument, "{} is not a port", v);
  c.*M = static_cast<uint16_t>(x);
  return Status::Ok();
}

template <auto M>
Status SetOptimizerFloat(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.optimizer.*M, ParseFloat("", v));
  return Status::Ok();
}
template <auto M>
std::string GetOptimizerFloat(const Config& c) {
  return fmt::format("{}", c.optimizer.*M);  // the shortest text that reads back exactly
}

// A 0/1 value.
Status ReadBool(std::string_view v, bool& out) {
  if (v != "0" && v != "1") return Error(StatusCode::kInvalidArgument, "'{}' is not 0 or 1", v);
  out = v == "1";
  return Status::Ok();
}
template <auto M>
Status SetBool(Config& c, std::string_view v) {
  return ReadBool(v, c.*M);
}
template <auto M>
std::string GetBool(const Config& c) {
  return c.*M ? "1" : "0";
}
Status SetNesterov(Config& c, std::string_view v) { return ReadBool(v, c.optimizer.nesterov); }
std::string GetNesterov(const Config& c) { return c.optimizer.nesterov ? "1" : "0"; }

// An enum through its Parse/Name pair.
template <auto M, auto Parse, auto Name>
Status SetEnum(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.*M, Parse(v));
  return Status::Ok();
}
template <auto M, auto Parse, auto Name>
std::string GetEnum(const Config& c) {
  return std::string(Name(c.*M));
}

Status SetSync(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.sync, SyncMode::Parse(v));
  return Status::Ok();
}
std::string GetSync(const Config& c) { return c.sync.ToString(); }

Status SetStaleness(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.staleness, StalenessPolicy::Parse(v));
  return Status::Ok();
}
std::string GetStaleness(const Config& c) { return c.staleness.ToString(); }

Status SetOptimizer(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.optimizer.kind, ParseOptimizer(v));
  return Status::Ok();
}
std::string GetOptimizer(const Config& c) { return std::string(OptimizerName(c.optimizer.kind)); }

Status SetSliceBytes(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(c.slice_bytes, ParseBytes("", v));
  return Status::Ok();
}

// "N" rounds or "Ns" seconds.
Status SetCheckpointEvery(Config& c, std::string_view v) {
  const bool seconds = !v.empty() && v.back() == 's';
  DSYNC_ASSIGN_OR_RETURN(c.checkpoint_every,
                         ParseUnsigned("", seconds ? v.substr(0, v.size() - 1) : v, UINT32_MAX));
  c.checkpoint_every_seconds = seconds;
  return Status::Ok();
}
std::string GetCheckpointEvery(const Config& c) {
  return fmt::format("{}{}", c.checkpoint_every, c.checkpoint_every_seconds ? "s" : "");
}

Status SetLinkDelay(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(float ms, ParseFloat("", v));
  if (!(ms >= 0.0f && ms <= 60000.0f)) {
    return Error(StatusCode::kInvalidArgument, "{} is outside 0 .. 60000 milliseconds", v);
  }
  c.link_delay_us = static_cast<uint32_t>(ms * 1000.0f);
  return Status::Ok();
}
std::string GetLinkDelay(const Config& c) { return fmt::format("{}", c.link_delay_us / 1000.0); }

Status SetGidIndex(Config& c, std::string_view v) {
  DSYNC_ASSIGN_OR_RETURN(uint64_t gid, ParseUnsigned("", v, 65535));
  c.gid_index = static_cast<int>(gid);
  return Status::Ok();
}
std::string GetGidIndex(const Config& c) {
  return c.gid_index < 0 ? "" : std::to_string(c.gid_index);
}

using S = SettingScope;

// clang-format off
constexpr Setting kSettings[] = {
  // --- every node: where the job is, this node's place in it -------------------------------
  {"DSYNC_SCHEDULER_URI", {"DMLC_PS_ROOT_URI"}, "--scheduler-uri,--scheduler-host",
   "scheduler address (under Slurm: the step's first host)", S::kNode, true, false,
   SetText<&Config::scheduler_host>, GetText<&Config::scheduler_host>},
  {"DSYNC_SCHEDULER_PORT", {"DMLC_PS_ROOT_PORT"}, "--scheduler-port",
   "scheduler port (under Slurm: derived from the job and step ids)", S::kNode, true, false,
   SetPort<&Config::scheduler_port>, GetNumber<&Config::scheduler_port>},
  {"DSYNC_INTERFACE", {"DMLC_INTERFACE", "DMLC_NODE_HOST"}, "--interface,--bind",
   "NIC name (eth0, ib0) or address this node listens on, 0.0.0.0 or :: for every address; "
   "with RDMA it also picks the RDMA device on that NIC", S::kNode, true, false,
   SetText<&Config::bind_host>, GetText<&Config::bind_host>},
  {"DSYNC_ADVERTISE", {}, "--advertise",
   "address a server tells its peers to reach it at (default: its --interface address, or "
   "for a wildcard the one that routes to the scheduler); behind NAT, in containers",
   S::kNode, false, false, SetText<&Config::advertise_host>, GetText<&Config::advertise_host>},
  {"DSYNC_RENDEZVOUS", {}, "--rendezvous",
   "a file every node can read: the scheduler writes its address there, the others wait for "
   "it (instead of --scheduler-uri/-port)", S::kNode, true, false,
   SetText<&Config::rendezvous>, GetText<&Config::rendezvous>},
  {"DSYNC_PORT", {"DMLC_PORT"}, "--port", "port this node listens on; 0 picks one",
   S::kNode, false, false, SetPort<&Config::port>, GetNumber<&Config::port>},
  {"DSYNC_TOKEN", {}, "--token", "cluster token shared by every node", S::kNode, true, false,
   SetText<&Config::token>, GetText<&Config::token>, /*secret=*/true},
  {"DSYNC_INSECURE", {}, "--insecure",
   "run without a cluster token: anyone who reaches the ports may join", S::kNode, true, true,
   SetBool<&Config::insecure>, GetBool<&Config::insecure>},
  {"DSYNC_HEARTBEAT_MS", {}, "--heartbeat-ms", "heartbeat interval in ms", S::kNode, true, false,
   SetUnsigned<&Config::heartbeat_interval_ms>, GetNumber<&Config::heartbeat_interval_ms>},
  {"DSYNC_HEARTBEAT_TIMEOUT_MS", {}, "--heartbeat-timeout-ms",
   "a worker silent this long (ms) is declared dead, a server stops the job", S::kNode, true,
   false, SetUnsigned<&Config::heartbeat_timeout_ms>, GetNumber<&Config::heartbeat_timeout_ms>},
  {"DSYNC_CONNECT_TIMEOUT_MS", {}, "--connect-timeout-ms",
   "how long (ms) to keep trying to reach a peer, a rendezvous file or an answer to a hello",
   S::kNode, true, false,
   SetUnsigned<&Config::connect_timeout_ms>, GetNumber<&Config::connect_timeout_ms>},
  {"DSYNC_HANDSHAKE_TIMEOUT_MS", {}, "--handshake-timeout-ms",
   "a connection that has not authenticated within this many ms is dropped", S::kNode, true,
   false, SetUnsigned<&Config::handshake_timeout_ms>, GetNumber<&Config::handshake_timeout_ms>},
  {"DSYNC_MAX_PENDING_CONNECTIONS", {}, "--max-pending-connections",
   "connections that have not authenticated, at most, per listener", S::kNode, true, false,
   SetUnsigned<&Config::max_pending_connections>,
   GetNumber<&Config::max_pending_connections>},
  {"DSYNC_MAX_PENDING_PER_SOURCE", {}, "--max-pending-per-source",
   "connections that have not authenticated, at most, from one address", S::kNode, true, false,
   SetUnsigned<&Config::max_pending_per_source>, GetNumber<&Config::max_pending_per_source>},
  {"DSYNC_LINK_DELAY_MS", {}, "--link-delay-ms",
   "emulated latency (ms) added to every frame this node sends (experiments)", S::kNode, false,
   false, SetLinkDelay, GetLinkDelay},
  {"DSYNC_TRANSPORT", {}, "--transport",
   "tcp | rdma (libibverbs/librdmacm; listen on the RDMA netdev's address) | auto (rdma when "
   "a usable device exists)", S::kNode, true, false,
   SetEnum<&Config::transport, ParseTransport, TransportName>,
   GetEnum<&Config::transport, ParseTransport, TransportName>},
  {"DSYNC_RDMA_DEVICE", {}, "--rdma-device",
   "RDMA device, e.g. mlx5_0 or rxe0 (default: the one on --interface's NIC, else the first "
   "with an active port and an IPv4 RoCE v2 GID)", S::kNode, true, false,
   SetText<&Config::rdma_device>, GetText<&Config::rdma_device>},
  {"DSYNC_GID_INDEX", {}, "--gid-index",
   "GID index (default: the RoCE v2 IPv4-mapped GID of the device's netdev)", S::kNode, true,
   false, SetGidIndex, GetGidIndex},
  {"DSYNC_STORE", {}, "--store",
   "servers' parameter store: cpu | cuda | auto (the GPU when one is visible)", S::kNode, true,
   false, SetEnum<&Config::store, ParseStore, StoreName>,
   GetEnum<&Config::store, ParseStore, StoreName>},
  {"DSYNC_GPUDIRECT", {}, "--gpudirect",
   "servers: the NIC reads/writes GPU memory directly (GPUDirect RDMA over dma-buf): auto | "
   "on (fail if impossible) | off", S::kNode, true, false,
   SetEnum<&Config::gpudirect, ParseGpuDirect, GpuDirectName>,
   GetEnum<&Config::gpudirect, ParseGpuDirect, GpuDirectName>},
  {"DSYNC_PIN_HEAP", {}, "--pin-heap",
   "Python workers: keep the memory a step frees for the next one instead of returning it to "
   "the kernel (glibc's heap thresholds pinned; docs/python.md): 1 | 0", S::kNode, true, false,
   SetBool<&Config::pin_heap>, GetBool<&Config::pin_heap>},
  // --- the job's size ------------------------------------------------------------------------
  {"DSYNC_NUM_SERVERS", {"DMLC_NUM_SERVER"}, "--num-servers", "servers in the job",
   S::kCluster, true, false, SetUnsigned<&Config::num_servers>,
   GetNumber<&Config::num_servers>},
  {"DSYNC_REPLICAS", {}, "--replicas",
   "copies of every slice on distinct servers: 1 (a lost server ends the job) or more (its "
   "slices' backups take over and the job goes on)", S::kJob, true, false,
   SetUnsigned<&Config::replicas>, GetNumber<&Config::replicas>},
  {"DSYNC_NUM_WORKERS", {"DMLC_NUM_WORKER"}, "--num-workers",
   "workers that start the job together; more may join later", S::kCluster, true, false,
   SetUnsigned<&Config::num_workers>, GetNumber<&Config::num_workers>},
  // --- the job: the scheduler owns these and hands them to every node ------------------------
  {"DSYNC_START_TIMEOUT_MS", {}, "--start-timeout-ms",
   "scheduler: a job still missing servers or initial workers ends once no node has arrived "
   "for this many ms, saying what it waited for (0: wait forever)", S::kJob, true, false,
   SetUnsigned<&Config::start_timeout_ms>, GetNumber<&Config::start_timeout_ms>},
  {"DSYNC_SYNC", {}, "--sync",
   "bsp | dsync:K | dsync:K,Q | dsync:auto[:KMAX] | ssp:K | asp", S::kJob, true, false,
   SetSync, GetSync},
  {"DSYNC_STALENESS_POLICY", {}, "--staleness-policy",
   "servers weigh a gradient s rounds stale: none | inverse (1/(1+s)) | exp:C (C^s, 0<C<=1); and/or correct it: dc:L[,D] (g + L*g*g*(w - w_base), D versions kept) or dca:L[,D] (L/sqrt(mean g*g)), e.g. inverse+dca:L; a final +momentum (or momentum alone) lowers momentum SGD's momentum m to max(0, 1-(1-m)(1+s)), s the round's mean staleness; damp[:P] applies none until the workers' gradients grow fast, then P (inverse+momentum) to the end",
   S::kJob, true, false, SetStaleness, GetStaleness},
  {"DSYNC_OPTIMIZER", {}, "--optimizer",
   "sgd | momentum | adam | adamw | sum (torch.optim's formulas; sum: w += the gradients)",
   S::kJob, true, false,
   SetOptimizer, GetOptimizer},
  {"DSYNC_LR", {}, "--lr", "learning rate", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::lr>, GetOptimizerFloat<&OptimizerConfig::lr>},
  {"DSYNC_MOMENTUM", {}, "--momentum", "momentum", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::momentum>, GetOptimizerFloat<&OptimizerConfig::momentum>},
  {"DSYNC_DAMPENING", {}, "--dampening", "momentum: dampening in [0, 1]", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::dampening>,
   GetOptimizerFloat<&OptimizerConfig::dampening>},
  {"DSYNC_NESTEROV", {}, "--nesterov",
   "momentum: Nesterov momentum (needs momentum > 0, dampening 0)", S::kJob, true, true,
   SetNesterov, GetNesterov},
  {"DSYNC_BETA1", {}, "--beta1", "adam beta1", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::beta1>, GetOptimizerFloat<&OptimizerConfig::beta1>},
  {"DSYNC_BETA2", {}, "--beta2", "adam beta2", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::beta2>, GetOptimizerFloat<&OptimizerConfig::beta2>},
  {"DSYNC_EPS", {}, "--eps", "adam epsilon", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::eps>, GetOptimizerFloat<&OptimizerConfig::eps>},
  {"DSYNC_WEIGHT_DECAY", {}, "--weight-decay",
   "weight decay: L2 (sgd, momentum, adam) or decoupled (adamw); default 0 for all", S::kJob, true, false,
   SetOptimizerFloat<&OptimizerConfig::weight_decay>,
   GetOptimizerFloat<&OptimizerConfig::weight_decay>},
  {"DSYNC_SLICE_BYTES", {}, "--slice-bytes",
   "tensors are cut into slices of this size, e.g. 4M, spread over the servers", S::kJob, true,
   false, SetSliceBytes, GetNumber<&Config::slice_bytes>},
  {"DSYNC_MAX_GRADIENTS", {}, "--max-gradients",
   "the job's budget: once this many gradients are committed every worker is told to stop "
   "(0: the workers decide)", S::kJob, true, false,
   SetUnsigned<&Config::max_gradients, UINT64_MAX>, GetNumber<&Config::max_gradients>},
  {"DSYNC_FINISH_BSP", {}, "--finish-bsp",
   "round modes: the last PERCENT of the job's budget (--max-gradients) runs as bsp, so that "
   "the rounds that step the model last hold every worker's gradient, none stale (0: delay "
   "to the end; unset: 10 under dsync:auto, 0 under dsync:K,Q)", S::kJob, true, false,
   SetFinishBsp, GetOptionalNumber<&Config::finish_bsp_percent>},
  {"DSYNC_AUDIT_LOG", {}, "--audit-log",
   "scheduler: write each round decision and membership change here (JSON lines)", S::kJob,
   false, false, SetText<&Config::audit_log>, GetText<&Config::audit_log>},
  {"DSYNC_CHECKPOINT_DIR", {}, "--checkpoint-dir",
   "scheduler: write consistent checkpoints of the model and optimizer state here (each "
   "server its slices, the scheduler a manifest); one at the end of the job at least",
   S::kJob, true, false, SetText<&Config::checkpoint_dir>, GetText<&Config::checkpoint_dir>},
  {"DSYNC_CHECKPOINT_EVERY", {}, "--checkpoint-every",
   "scheduler: a checkpoint every N rounds, or every N seconds with Ns (0: only at the end)",
   S::kJob, true, false, SetCheckpointEvery, GetCheckpointEvery},
  {"DSYNC_RESUME", {}, "--resume",
   "scheduler: start from the newest complete checkpoint under this directory (a torn or "
   "corrupt one is refused, naming the file, and the one before it used); given a --journal "
   "file, continue that job where its scheduler stopped", S::kJob, true,
   false, SetText<&Config::resume>, GetText<&Config::resume>},
  {"DSYNC_JOURNAL", {}, "--journal",
   "scheduler: journal every decision to this file (fdatasync'd before it is sent), so that a "
   "scheduler that dies can be started again with --resume FILE and the job goes on", S::kJob,
   true, false, SetText<&Config::journal>, GetText<&Config::journal>},
  {"DSYNC_TEST_CRASH_AFTER_ROUND", {}, "--test-crash-after-round",
   "tests: the scheduler's process ends as if killed once round N is journaled, before it is "
   "sent", S::kJob, false, false, SetOptionalRound,
   GetOptionalNumber<&Config::test_crash_after_round>},
  {"DSYNC_RECONNECT_GRACE", {}, "--reconnect-grace",
   "scheduler of a journaled job: seconds its servers and workers wait for it to be restarted "
   "after it is lost, before they stop", S::kJob, true, false, SetSeconds<&Config::reconnect_grace_ms>,
   GetSeconds<&Config::reconnect_grace_ms>},
  {"DSYNC_DUMP_MODEL", {}, "--dump-model",
   "servers: at the end, write per-slice summaries to this directory", S::kServer, false, false,
   SetText<&Config::dump_model>, GetText<&Config::dump_model>},
};
// clang-format on

}  // namespace

std::span<const Setting> Settings() { return kSettings; }

namespace {

// DSYNC_* variables read besides the settings: the role, what launchers hand the processes
// they start, the RDMA transport's tunables (rdma::ReadRdmaTunables, which checks them), and
// (by prefix) what the project's build, test and VM scripts read.
constexpr std::string_view kOtherVariables[] = {
    "DSYNC_ROLE", "DSYNC_READY_FD", "DSYNC_WORKER_RANK", kEnvironmentChecked,
    "DSYNC_RDMA_SLOTS", "DSYNC_RDMA_SLOT_BYTES", "DSYNC_RDMA_MAX_RENDEZVOUS",
    "DSYNC_RDMA_SPIN_US", "DSYNC_RDMA_RETRY_COUNT"};
constexpr std::string_view kScriptPrefixes[] = {"DSYNC_BUILD_", "DSYNC_RXE_", "DSYNC_SKIP_",
                                                "DSYNC_FUZZ", "DSYNC_RDMA_VM_", "DSYNC_BENCH_"};
// Settings that were renamed: (old, new).
constexpr std::pair<std::string_view, std::string_view> kRenamed[] = {
    {"DSYNC_AUTO_FINISH", "DSYNC_FINISH_BSP"},
};

// Edits (insert, delete, replace) from a to b, or more than `limit` once that is certain:
// names are short and this runs once per variable at start, so the plain table does; the
// length check keeps a hostile environment's long names cheap.
size_t EditDistance(std::string_view a, std::string_view b, size_t limit) {
  const size_t apart = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  if (apart > limit) return limit + 1;
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The name as a log line may show it: control characters (a newline would forge a line of
// its own) and anything beyond ASCII become '?'.
std::string Printable(std::string_view name) {
  std::string out(name);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return out;
}

}  // namespace

std::string UnknownVariable(std::string_view name) {
  if (!name.starts_with("DSYNC_") || FindSetting(name) != nullptr) return "";
  for (std::string_view other : kOtherVariables) {
    if (name == other) return "";
  }
  for (std::string_view prefix : kScriptPrefixes) {
    if (name.starts_with(prefix)) return "";
  }
  const std::string shown = Printable(name);
  for (const auto& [old_name, new_name] : kRenamed) {
    if (name == old_name) {
      return fmt::format("{} is not a setting and is ignored: it is {} now", shown, new_name);
    }
  }
  // The nearest settings, a slip of the keyboard or a word left out away: at most a third of
  // the name after DSYNC_ (and 3) edits, so that short names are not matched to any other
  // short name (DSYNC_HOST is not DSYNC_PORT).
  constexpr size_t kPrefix = 6;  // "DSYNC_"
  const std::string_view word = name.substr(kPrefix);
  const size_t limit = std::min<size_t>(3, word.size() / 3);
  size_t best = limit + 1;
  std::vector<std::string_view> nearest;
  for (const Setting& s : kSettings) {
    const size_t d = EditDistance(word, s.env.substr(kPrefix), limit);
    if (d > limit || d > best) continue;
    if (d < best) nearest.clear();
    best = d;
    nearest.push_back(s.env);
  }
  if (!nearest.empty()) {
    std::string names(nearest[0]);
    for (size_t i = 1; i < nearest.size(); ++i) {
      names += fmt::format("{}{}", i + 1 == nearest.size() ? " or " : ", ", nearest[i]);
    }
    return fmt::format("{} is not a setting and is ignored: did you mean {}?", shown, names);
  }
  return fmt::format("{} is not a setting and is ignored (README.md's table of variables, or "
                     "dsyncps ROLE --help, lists them)",
                     shown);
}

const Setting* FindSetting(std::string_view env) {
  for (const Setting& s : kSettings) {
    if (s.env == env) return &s;
  }
  return nullptr;
}

Status ApplySetting(const Setting& setting, Config& config, std::string_view text,
                    std::string_view source) {
  Status st = setting.set(config, text);
  if (st.ok()) return st;
  return Error(st.code(), "{}: {}", source, st.message());
}

}  // namespace dsync::ps
