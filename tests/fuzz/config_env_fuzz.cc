// Config::FromEnvironment over arbitrary variables: the names it reads (and a few it does
// not) with arbitrary values. Beyond not crashing:
// - ps-lite's DMLC_* names are fallbacks: moving each to its DSYNC_* name (where that is not
//   set) changes nothing;
// - an empty variable counts as unset, but for the role (an empty DSYNC_ROLE is an error:
//   it used to make a silent worker);
// - an accepted configuration keeps its values in range, and one that also passes
//   Validate() holds only finite optimizer settings (they travel to every node as JSON,
//   which has no infinities);
// - what ToEnvironment writes for a launcher's children reads back to the same job settings.
#include <fuzzer/FuzzedDataProvider.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <utility>

#include "dsync/config.h"
#include "fuzz_check.h"

using namespace dsync;

namespace {

using Env = std::map<std::string, std::string>;

// Every name FromEnvironment reads, and two it must ignore.
constexpr const char* kNames[] = {
    "DSYNC_ROLE", "DMLC_ROLE", "DSYNC_SCHEDULER_URI", "DMLC_PS_ROOT_URI", "DSYNC_SCHEDULER_PORT",
    "DMLC_PS_ROOT_PORT", "DSYNC_PORT", "DMLC_PORT", "DSYNC_INTERFACE", "DMLC_INTERFACE",
    "DMLC_NODE_HOST", "DSYNC_ADVERTISE",
    "DSYNC_TOKEN", "DSYNC_NUM_SERVERS", "DMLC_NUM_SERVER", "DSYNC_NUM_WORKERS", "DMLC_NUM_WORKER",
    "DSYNC_SYNC", "DSYNC_OPTIMIZER", "DSYNC_LR", "DSYNC_MOMENTUM", "DSYNC_DAMPENING",
    "DSYNC_NESTEROV", "DSYNC_BETA1", "DSYNC_BETA2", "DSYNC_START_TIMEOUT_MS",
    "DSYNC_EPS", "DSYNC_WEIGHT_DECAY", "DSYNC_SLICE_BYTES", "DSYNC_MAX_GRADIENTS",
    "DSYNC_FINISH_BSP",
    "DSYNC_LINK_DELAY_MS", "DSYNC_HEARTBEAT_MS", "DSYNC_HEARTBEAT_TIMEOUT_MS",
    "DSYNC_CONNECT_TIMEOUT_MS", "DSYNC_TRANSPORT", "DSYNC_RDMA_DEVICE", "DSYNC_GID_INDEX",
    "DSYNC_STORE", "DSYNC_GPUDIRECT", "DSYNC_INSECURE", "DSYNC_HANDSHAKE_TIMEOUT_MS",
    "DSYNC_MAX_PENDING_CONNECTIONS", "DSYNC_MAX_PENDING_PER_SOURCE", "DSYNC_RENDEZVOUS",
    "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
    "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "DSYNC_AUDIT_LOG", "DSYNC_DUMP_MODEL",
    "DSYNC_UNKNOWN", "HOME"};

// ps-lite's names and the DSYNC_* names they stand in for.
constexpr std::pair<const char*, const char*> kFallbacks[] = {
    {"DMLC_ROLE", "DSYNC_ROLE"},           {"DMLC_PS_ROOT_URI", "DSYNC_SCHEDULER_URI"},
    {"DMLC_PS_ROOT_PORT", "DSYNC_SCHEDULER_PORT"}, {"DMLC_PORT", "DSYNC_PORT"},
    {"DMLC_INTERFACE", "DSYNC_INTERFACE"}, {"DMLC_NODE_HOST", "DSYNC_INTERFACE"}, {"DMLC_NUM_SERVER", "DSYNC_NUM_SERVERS"},
    {"DMLC_NUM_WORKER", "DSYNC_NUM_WORKERS"}};

bool SameBits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// Field by field, floats bit for bit (NaN settings compare equal to themselves); never
// memcmp the struct, whose padding after `nesterov` holds whatever the stack held.
bool SameOptimizer(const OptimizerConfig& x, const OptimizerConfig& y) {
  return x.kind == y.kind && x.nesterov == y.nesterov && SameBits(x.lr, y.lr) &&
         SameBits(x.momentum, y.momentum) && SameBits(x.dampening, y.dampening) &&
         SameBits(x.beta1, y.beta1) && SameBits(x.beta2, y.beta2) && SameBits(x.eps, y.eps) &&
         SameBits(x.weight_decay, y.weight_decay);
}

bool Same(const Config& a, const Config& b) {
  return a.role == b.role && a.scheduler_host == b.scheduler_host &&
         a.scheduler_port == b.scheduler_port && a.bind_host == b.bind_host &&
         a.advertise_host == b.advertise_host && a.port == b.port &&
         a.token == b.token && a.num_servers == b.num_servers && a.num_workers == b.num_workers &&
         a.sync == b.sync && SameOptimizer(a.optimizer, b.optimizer) &&
         a.start_timeout_ms == b.start_timeout_ms &&
         a.slice_bytes == b.slice_bytes && a.max_gradients == b.max_gradients &&
         a.finish_bsp_percent == b.finish_bsp_percent &&
         a.observer == b.observer && a.link_delay_us == b.link_delay_us &&
         a.heartbeat_interval_ms == b.heartbeat_interval_ms &&
         a.heartbeat_timeout_ms == b.heartbeat_timeout_ms &&
         a.connect_timeout_ms == b.connect_timeout_ms && a.transport == b.transport &&
         a.rdma_device == b.rdma_device && a.gid_index == b.gid_index && a.store == b.store &&
         a.gpudirect == b.gpudirect && a.audit_log == b.audit_log &&
         a.dump_model == b.dump_model && a.insecure == b.insecure &&
         a.handshake_timeout_ms == b.handshake_timeout_ms &&
         a.max_pending_connections == b.max_pending_connections &&
         a.max_pending_per_source == b.max_pending_per_source && a.task_rank == b.task_rank &&
         a.task_count == b.task_count && a.slurm_hosts == b.slurm_hosts;
}

bool SameFloat(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// The settings ToEnvironment carries.
bool SameJob(const Config& a, const Config& b) {
  const OptimizerConfig &x = a.optimizer, &y = b.optimizer;
  return a.scheduler_host == b.scheduler_host && a.scheduler_port == b.scheduler_port &&
         a.bind_host == b.bind_host && a.rendezvous == b.rendezvous && a.token == b.token &&
         a.insecure == b.insecure && a.num_servers == b.num_servers &&
         a.num_workers == b.num_workers && a.sync == b.sync && x.kind == y.kind &&
         SameFloat(x.lr, y.lr) && SameFloat(x.momentum, y.momentum) &&
         SameFloat(x.dampening, y.dampening) && x.nesterov == y.nesterov &&
         SameFloat(x.beta1, y.beta1) && SameFloat(x.beta2, y.beta2) && SameFloat(x.eps, y.eps) &&
         SameFloat(x.weight_decay, y.weight_decay) && a.slice_bytes == b.slice_bytes &&
         a.max_gradients == b.max_gradients && a.finish_bsp_percent == b.finish_bsp_percent &&
         a.heartbeat_interval_ms == b.heartbeat_interval_ms &&
         a.heartbeat_timeout_ms == b.heartbeat_timeout_ms &&
         a.connect_timeout_ms == b.connect_timeout_ms &&
         a.handshake_timeout_ms == b.handshake_timeout_ms &&
         a.max_pending_connections == b.max_pending_connections &&
         a.max_pending_per_source == b.max_pending_per_source && a.transport == b.transport &&
         a.rdma_device == b.rdma_device && a.gid_index == b.gid_index && a.store == b.store &&
         a.gpudirect == b.gpudirect;
}

bool SameOutcome(const Result<Config>& a, const Result<Config>& b) {
  if (a.ok() != b.ok()) return false;
  return a.ok() ? Same(*a, *b) : a.status().code() == b.status().code();
}

const std::string* Get(const Env& env, const char* name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty() ? &it->second : nullptr;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Env env;
  while (in.remaining_bytes() > 0 && env.size() < 16) {
    const char* name = kNames[in.ConsumeIntegralInRange<size_t>(0, std::size(kNames) - 1)];
    env[name] = in.ConsumeRandomLengthString(32);
  }
  const Result<Config> c = Config::FromEnvironment(env);

  Env renamed = env;
  for (const auto& [dmlc, dsync] : kFallbacks) {
    auto it = renamed.find(dmlc);
    if (it == renamed.end()) continue;
    std::string value = std::move(it->second);
    renamed.erase(it);
    if (!Get(renamed, dsync)) renamed[dsync] = std::move(value);
  }
  FUZZ_CHECK(SameOutcome(Config::FromEnvironment(renamed), c));

  Env padded = env;
  for (const char* name : kNames) {
    if (std::strcmp(name, "DSYNC_ROLE") != 0 && std::strcmp(name, "DMLC_ROLE") != 0) {
      padded.try_emplace(name, "");
    }
  }
  FUZZ_CHECK(SameOutcome(Config::FromEnvironment(padded), c));

  if (!c.ok()) {
    FUZZ_CHECK(c.status().code() == StatusCode::kInvalidArgument);
    return 0;
  }
  const Result<Config> back = Config::FromEnvironment(c->ToEnvironment());
  FUZZ_CHECK(back.ok() && SameJob(*back, *c));
  FUZZ_CHECK(c->link_delay_us <= 60'000'000u);
  FUZZ_CHECK(c->gid_index >= -1 && c->gid_index <= 65535);
  if (const std::string* sync = Get(env, "DSYNC_SYNC")) {
    FUZZ_CHECK(c->sync == SyncMode::Parse(*sync).value());
  }
  if (c->Validate().ok()) {
    const OptimizerConfig& o = c->optimizer;
    for (float x : {o.lr, o.momentum, o.dampening, o.beta1, o.beta2, o.eps, o.weight_decay}) {
      FUZZ_CHECK(std::isfinite(x));
    }
  }
  return 0;
}
