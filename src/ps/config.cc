#include "dsync/config.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include <spdlog/spdlog.h>

extern char** environ;  // NOLINT: POSIX

#include "ps/hostlist.h"
#include "ps/number_text.h"
#include "ps/settings.h"

namespace dsync {
namespace {

using ps::ParseUnsigned;

// Hyperparameters outside these ranges either cannot be sent to the nodes (JSON has no
// inf or nan) or make every update diverge; refused here, naming the flag and the variable.
Status CheckHyperparameter(std::string_view name, std::string_view flag, std::string_view var,
                           float v, bool ok, std::string_view range) {
  if (ok) return Status::Ok();
  return Error(StatusCode::kInvalidArgument, "{} {} must be {} ({}, {})", name, v, range, flag,
               var);
}

}  // namespace

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kScheduler: return "scheduler";
    case Role::kServer: return "server";
    case Role::kWorker: return "worker";
  }
  return "unknown";
}

Result<Role> ParseRole(std::string_view text) {
  if (text == "scheduler") return Role::kScheduler;
  if (text == "server") return Role::kServer;
  if (text == "worker") return Role::kWorker;
  return Error(StatusCode::kInvalidArgument,
               "role '{}' is not one of scheduler, server, worker", text);
}

Result<SyncMode> SyncMode::Parse(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Error(StatusCode::kInvalidArgument,
                 "sync mode '{}': {} (expected bsp, dsync:K, dsync:K,Q, dsync:auto[:KMAX], ssp:K or asp)", text,
                 why);
  };
  if (text == "bsp") return Bsp();
  if (text == "asp") return Asp();
  if (text.starts_with("ssp:")) {
    auto k = ParseUnsigned("ssp bound", text.substr(4), UINT32_MAX - 1);
    if (!k.ok()) return bad(k.status().message());
    return Ssp(static_cast<uint32_t>(*k));
  }
  if (text.starts_with("dsync:")) {
    std::string_view rest = text.substr(6);
    if (rest == "auto") return Auto();
    if (rest.starts_with("auto:")) {
      auto k = ParseUnsigned("maximum delay bound", rest.substr(5), 1024);
      if (!k.ok()) return bad(k.status().message());
      if (*k == 0) return bad("dsync:auto needs a maximum bound of at least 1 (bsp is dsync:0)");
      return Auto(static_cast<uint32_t>(*k));
    }
    std::string_view q_text;
    if (auto comma = rest.find(','); comma != std::string_view::npos) {
      q_text = rest.substr(comma + 1);
      rest = rest.substr(0, comma);
      if (q_text.empty()) return bad("the quorum after ',' is missing");
    }
    auto d = ParseUnsigned("delay bound", rest, UINT32_MAX - 1);
    if (!d.ok()) return bad(d.status().message());
    uint32_t q = kAll;
    if (!q_text.empty()) {
      auto qv = ParseUnsigned("quorum", q_text, UINT32_MAX - 1);
      if (!qv.ok()) return bad(qv.status().message());
      if (*qv == 0) return bad("the quorum must be at least 1");
      q = static_cast<uint32_t>(*qv);
    }
    return Dsync(static_cast<uint32_t>(*d), q);
  }
  return bad("unknown mode");
}

std::string SyncMode::ToString() const {
  switch (kind) {
    case SyncKind::kAsp: return "asp";
    case SyncKind::kSsp: return fmt::format("ssp:{}", bound);
    case SyncKind::kRound:
      if (adaptive) {
        return bound == kDefaultAutoMax ? "dsync:auto" : fmt::format("dsync:auto:{}", bound);
      }
      if (bound == 0) return "bsp";
      if (quorum == kAll) return fmt::format("dsync:{}", bound);
      return fmt::format("dsync:{},{}", bound, quorum);
  }
  return "unknown";
}

namespace {

constexpr std::string_view kStalenessForms =
    "none, inverse, exp:C (0 < C <= 1), dc:L[,D] or dca:L[,D] (L > 0, 1 <= D <= 64), or a "
    "weight and a compensation joined by '+' (inverse+dc:L); any of them but none may be "
    "followed by +momentum (inverse+dc:L+momentum), or momentum alone; damp, or damp: "
    "followed by any of them but none (damp:inverse+momentum)";
constexpr std::string_view kTemperMomentum = "momentum";
constexpr std::string_view kDamp = "damp";
// What "damp" alone switches to: the pair with the largest stable step of those measured
// (docs/benchmarks.md, "Why the bound's stable step is so small").
constexpr std::string_view kDefaultDamped = "inverse+momentum";

bool IsCompensation(std::string_view text) {
  return text.starts_with("dc:") || text.starts_with("dca:");
}

// "dc:L[,D]" or "dca:L[,D]".
Status ParseCompensation(std::string_view whole, std::string_view text, StalenessPolicy& p) {
  p.adaptive = text.starts_with("dca:");
  text.remove_prefix(p.adaptive ? 4 : 3);
  const size_t comma = text.find(',');
  auto lambda = ps::ParseFloat("", text.substr(0, comma));
  if (!lambda.ok() || !std::isfinite(*lambda) || *lambda <= 0.0f) {
    return Error(StatusCode::kInvalidArgument,
                 "staleness policy '{}': the factor L of dc:L or dca:L must be a finite number "
                 "above 0",
                 whole);
  }
  p.compensation = *lambda;
  if (comma == std::string_view::npos) return Status::Ok();
  auto depth = ps::ParseUnsigned("", text.substr(comma + 1), StalenessPolicy::kMaxCompensationDepth);
  if (!depth.ok() || *depth < 1) {
    return Error(StatusCode::kInvalidArgument,
                 "staleness policy '{}': the versions kept, D of dc:L,D, must be 1 to {}", whole,
                 StalenessPolicy::kMaxCompensationDepth);
  }
  p.depth = static_cast<uint32_t>(*depth);
  return Status::Ok();
}

Status ParseWeight(std::string_view whole, std::string_view text, StalenessPolicy& p) {
  if (text == "none") return Status::Ok();
  if (text == "inverse") {
    p.kind = StalenessKind::kInverse;
    return Status::Ok();
  }
  if (text.starts_with("exp:")) {
    auto c = ps::ParseFloat("", text.substr(4));
    if (c.ok() && *c > 0.0f && *c <= 1.0f) {
      p.kind = StalenessKind::kExp;
      p.base = *c;
      return Status::Ok();
    }
    return Error(StatusCode::kInvalidArgument,
                 "staleness policy '{}': the factor C of exp:C must be in (0, 1]", whole);
  }
  return Error(StatusCode::kInvalidArgument, "staleness policy '{}' is not one of {}", whole,
               kStalenessForms);
}

// A number of a policy's text: fmt's shortest form, which reads back to the same float, with
// no '+' in its exponent ("1e+18" is "1e18"): a '+' joins the policy's parts.
std::string PolicyNumber(float v) {
  std::string text = fmt::format("{}", v);
  std::erase(text, '+');
  return text;
}

}  // namespace

Result<StalenessPolicy> StalenessPolicy::Parse(std::string_view whole) {
  if (whole == kDamp || (whole.starts_with(kDamp) && whole.size() > kDamp.size() &&
                         whole[kDamp.size()] == ':')) {
    const std::string_view rest =
        whole == kDamp ? kDefaultDamped : whole.substr(kDamp.size() + 1);
    auto damped = Parse(rest);
    if (!damped.ok() || damped->damp || *damped == StalenessPolicy{}) {
      return Error(StatusCode::kInvalidArgument,
                   "staleness policy '{}' is not one of {}: damp applies a policy other than "
                   "none once the job needs it",
                   whole, kStalenessForms);
    }
    damped->damp = true;
    return damped;
  }
  StalenessPolicy p;
  std::string_view text = whole;
  if (text == kTemperMomentum) {
    p.temper_momentum = true;
    return p;
  }
  if (const size_t last = text.rfind('+');
      last != std::string_view::npos && text.substr(last + 1) == kTemperMomentum) {
    p.temper_momentum = true;
    text = text.substr(0, last);
    if (text == "none") {
      return Error(StatusCode::kInvalidArgument, "staleness policy '{}' is not one of {}", whole,
                   kStalenessForms);
    }
  }
  const size_t plus = text.find('+');
  const std::string_view first = text.substr(0, plus);
  if (plus == std::string_view::npos && IsCompensation(first)) {
    DSYNC_RETURN_IF_ERROR(ParseCompensation(whole, first, p));
    return p;
  }
  DSYNC_RETURN_IF_ERROR(ParseWeight(whole, first, p));
  if (plus == std::string_view::npos) return p;
  const std::string_view second = text.substr(plus + 1);
  if (!IsCompensation(second) || p.kind == StalenessKind::kNone) {
    return Error(StatusCode::kInvalidArgument, "staleness policy '{}' is not one of {}", whole,
                 kStalenessForms);
  }
  DSYNC_RETURN_IF_ERROR(ParseCompensation(whole, second, p));
  return p;
}

std::string StalenessPolicy::ToString() const {
  std::string weight;
  switch (kind) {
    case StalenessKind::kNone: weight = "none"; break;
    case StalenessKind::kInverse: weight = "inverse"; break;
    case StalenessKind::kExp: weight = "exp:" + PolicyNumber(base); break;
  }
  std::string text = kind == StalenessKind::kNone ? "" : weight;
  const auto add = [&](std::string_view part) {
    text += text.empty() ? "" : "+";
    text += part;
  };
  if (compensation != 0.0f) {
    std::string dc = fmt::format("{}:{}", adaptive ? "dca" : "dc", PolicyNumber(compensation));
    if (depth != 0) dc += fmt::format(",{}", depth);
    add(dc);
  }
  if (temper_momentum) add(kTemperMomentum);
  if (text.empty()) text = weight;
  return damp ? fmt::format("{}:{}", kDamp, text) : text;
}

StalenessPolicy StalenessPolicy::Active(bool damped) const {
  if (!damp) return *this;
  if (!damped) return {};
  StalenessPolicy p = *this;
  p.damp = false;
  return p;
}

uint32_t StalenessPolicy::CompensationDepth(const SyncMode& sync) const {
  if (compensation == 0.0f) return 0;
  // A round mode's staleness never exceeds its bound (0 in bsp); ssp and asp count rounds
  // of one gradient each, which no fixed number bounds.
  if (sync.kind == SyncKind::kRound) {
    return std::min({depth != 0 ? depth : sync.bound, sync.bound, kMaxCompensationDepth});
  }
  return depth != 0 ? depth : kDefaultCompensationDepth;
}

float StalenessPolicy::Weight(uint64_t staleness) const {
  if (staleness == 0) return 1.0f;
  // In double, rounded once: every server (and a test replaying the audit log) gets the
  // same float.
  const double s = static_cast<double>(staleness);
  switch (kind) {
    case StalenessKind::kNone: return 1.0f;
    case StalenessKind::kInverse: return static_cast<float>(1.0 / (1.0 + s));
    case StalenessKind::kExp: return static_cast<float>(std::pow(static_cast<double>(base), s));
  }
  return 1.0f;
}

float StalenessPolicy::RoundMomentum(float momentum, double mean_staleness) const {
  // A momentum of 1 or more never decays (torch accepts it): there is no gain 1 / (1 - m) to
  // keep, and the formula would raise it. Left as asked, as is a mean that is not a number.
  if (!temper_momentum || !(mean_staleness > 0.0) || !(momentum < 1.0f)) return momentum;
  // In double, rounded once, as Weight: every server and copy steps with the same float.
  const double keep = (1.0 - static_cast<double>(momentum)) * (1.0 + mean_staleness);
  return static_cast<float>(std::max(0.0, 1.0 - keep));
}

Status ValidateOptimizer(const OptimizerConfig& o) {
  const auto finite_at_least = [](float v, float lo) { return std::isfinite(v) && v >= lo; };
  const auto fraction = [](float v) { return v >= 0.0f && v < 1.0f; };  // false for nan
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("learning rate", "--lr", "DSYNC_LR", o.lr,
                                            finite_at_least(o.lr, 0.0f), "a finite number >= 0"));
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("momentum", "--momentum", "DSYNC_MOMENTUM",
                                            o.momentum, finite_at_least(o.momentum, 0.0f),
                                            "a finite number >= 0"));
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("dampening", "--dampening", "DSYNC_DAMPENING",
                                            o.dampening, finite_at_least(o.dampening, 0.0f) &&
                                                                 o.dampening <= 1.0f,
                                            "in [0, 1]"));
  // torch.optim.SGD refuses these too: nesterov needs a momentum and no dampening (sgd is
  // SGD with momentum 0).
  if (o.nesterov && o.kind != OptimizerKind::kMomentum) {
    return Error(StatusCode::kInvalidArgument,
                 "nesterov applies to the momentum optimizer only, not {} (--nesterov, "
                 "DSYNC_NESTEROV)",
                 OptimizerName(o.kind));
  }
  if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f)) {
    return Error(StatusCode::kInvalidArgument,
                 "nesterov momentum requires a momentum > 0 and zero dampening (momentum {}, "
                 "dampening {}; --nesterov, DSYNC_NESTEROV)",
                 o.momentum, o.dampening);
  }
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("adam beta1", "--beta1", "DSYNC_BETA1", o.beta1,
                                            fraction(o.beta1), "in [0, 1)"));
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("adam beta2", "--beta2", "DSYNC_BETA2", o.beta2,
                                            fraction(o.beta2), "in [0, 1)"));
  DSYNC_RETURN_IF_ERROR(CheckHyperparameter("adam epsilon", "--eps", "DSYNC_EPS", o.eps,
                                            std::isfinite(o.eps) && o.eps > 0.0f,
                                            "a finite number > 0"));
  return CheckHyperparameter("weight decay", "--weight-decay", "DSYNC_WEIGHT_DECAY",
                             o.weight_decay, finite_at_least(o.weight_decay, 0.0f),
                             "a finite number >= 0");
}

std::string DescribeOptimizer(const OptimizerConfig& o) {
  const std::string_view name = OptimizerName(o.kind);
  switch (o.kind) {
    case OptimizerKind::kSum: return std::string(name);
    case OptimizerKind::kSgd:
      return fmt::format("{}(lr {}, weight_decay {})", name, o.lr, o.weight_decay);
    case OptimizerKind::kMomentum:
      return fmt::format("{}(lr {}, momentum {}, dampening {}, nesterov {}, weight_decay {})",
                         name, o.lr, o.momentum, o.dampening, o.nesterov, o.weight_decay);
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return fmt::format("{}(lr {}, beta1 {}, beta2 {}, eps {}, weight_decay {})", name, o.lr,
                         o.beta1, o.beta2, o.eps, o.weight_decay);
  }
  return std::string(name);
}

std::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kMomentum: return "momentum";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSum: return "sum";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "unknown";
}

Result<OptimizerKind> ParseOptimizer(std::string_view text) {
  if (text == "sgd") return OptimizerKind::kSgd;
  if (text == "momentum") return OptimizerKind::kMomentum;
  if (text == "adam") return OptimizerKind::kAdam;
  if (text == "adamw") return OptimizerKind::kAdamW;
  if (text == "sum") return OptimizerKind::kSum;
  return Error(StatusCode::kInvalidArgument,
               "optimizer '{}' is not one of sgd, momentum, adam, adamw, sum", text);
}

std::string_view TransportName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kRdma: return "rdma";
    case TransportKind::kAuto: return "auto";
  }
  return "unknown";
}

Result<TransportKind> ParseTransport(std::string_view text) {
  if (text == "tcp") return TransportKind::kTcp;
  if (text == "rdma") return TransportKind::kRdma;
  if (text == "auto") return TransportKind::kAuto;
  return Error(StatusCode::kInvalidArgument, "transport '{}' is not one of tcp, rdma, auto", text);
}

std::string_view StoreName(StoreKind kind) {
  switch (kind) {
    case StoreKind::kCpu: return "cpu";
    case StoreKind::kCuda: return "cuda";
    case StoreKind::kAuto: return "auto";
  }
  return "unknown";
}

Result<StoreKind> ParseStore(std::string_view text) {
  if (text == "cpu") return StoreKind::kCpu;
  if (text == "cuda") return StoreKind::kCuda;
  if (text == "auto") return StoreKind::kAuto;
  return Error(StatusCode::kInvalidArgument, "parameter store '{}' is not one of cpu, cuda, auto",
               text);
}

std::string_view GpuDirectName(GpuDirectMode mode) {
  switch (mode) {
    case GpuDirectMode::kAuto: return "auto";
    case GpuDirectMode::kOn: return "on";
    case GpuDirectMode::kOff: return "off";
  }
  return "unknown";
}

Result<GpuDirectMode> ParseGpuDirect(std::string_view text) {
  if (text == "auto") return GpuDirectMode::kAuto;
  if (text == "on") return GpuDirectMode::kOn;
  if (text == "off") return GpuDirectMode::kOff;
  return Error(StatusCode::kInvalidArgument, "gpudirect '{}' is not one of auto, on, off", text);
}

Result<Config> Config::FromEnvironment(const std::map<std::string, std::string>& env) {
  Config c;
  // DSYNC_* first, then the ps-lite/BytePS name users may already have exported. Set but
  // empty counts as unset.
  auto get = [&](std::initializer_list<std::string_view> names) -> const std::string* {
    for (std::string_view n : names) {
      if (n.empty()) continue;
      if (auto it = env.find(std::string(n)); it != env.end() && !it->second.empty()) {
        return &it->second;
      }
    }
    return nullptr;
  };
  for (const ps::Setting& s : ps::Settings()) {
    for (std::string_view name : {s.env, s.fallbacks[0], s.fallbacks[1]}) {
      if (const std::string* v = get({name})) {
        DSYNC_RETURN_IF_ERROR(ps::ApplySetting(s, c, *v, name));
        break;
      }
    }
  }

  if (const std::string* v = get({"DSYNC_ROLE", "DMLC_ROLE"})) {
    DSYNC_ASSIGN_OR_RETURN(c.role, ParseRole(*v));
  } else {
    // Set but empty is a slip in a job script: taken as unset, the process would become a
    // worker retrying the default scheduler address for the whole connect timeout.
    for (const char* name : {"DSYNC_ROLE", "DMLC_ROLE"}) {
      if (env.contains(name)) {
        return Error(StatusCode::kInvalidArgument,
                     "{} is set but empty: set it to scheduler, server or worker, or unset it",
                     name);
      }
    }
  }
  // Under Slurm, with no scheduler address given, the scheduler is rank 0, which srun places
  // on the step's first host; every task derives the same port from the job and step ids.
  if (const std::string* list = get({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
      list && !get({"DSYNC_SCHEDULER_URI", "DMLC_PS_ROOT_URI"})) {
    auto hosts = ps::ExpandHostList(*list);
    if (!hosts.ok()) return hosts.status().WithContext("finding the scheduler from Slurm's node list");
    // A step on one host keeps everything on loopback (its name may resolve elsewhere).
    c.scheduler_host = hosts->size() == 1 ? "127.0.0.1" : hosts->front();
    c.slurm_hosts = static_cast<uint32_t>(hosts->size());
    const std::string* job = get({"SLURM_JOB_ID", "SLURM_JOBID"});
    if (job && !get({"DSYNC_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT"})) {
      DSYNC_ASSIGN_OR_RETURN(uint64_t id, ParseUnsigned("SLURM_JOB_ID", *job, UINT64_MAX));
      uint64_t step = 0;
      if (const std::string* s = get({"SLURM_STEP_ID", "SLURM_STEPID"})) {
        DSYNC_ASSIGN_OR_RETURN(step, ParseUnsigned("SLURM_STEP_ID", *s, UINT64_MAX));
      }
      c.scheduler_port = SlurmSchedulerPort(id, step);
    }
  }
  // Under srun or mpirun every task gets a rank: with no explicit role it picks one. Slurm's
  // rank counts only in a job step (srun sets SLURM_STEP_ID): a batch script has
  // SLURM_PROCID=0 too and is one process, as is a step of a single task (srun -n 1 dsyncps
  // launch ... runs the job on that host).
  const std::string* rank = nullptr;
  const std::string* size = nullptr;
  if (get({"SLURM_STEP_ID", "SLURM_STEPID"}) && get({"SLURM_PROCID"})) {
    rank = get({"SLURM_PROCID"});
    size = get({"SLURM_NTASKS"});
  } else {
    rank = get({"OMPI_COMM_WORLD_RANK", "PMI_RANK"});
    size = get({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  }
  if (size && *size == "1") rank = nullptr;
  if (rank && !get({"DSYNC_ROLE", "DMLC_ROLE"})) {
    DSYNC_ASSIGN_OR_RETURN(uint64_t r, ParseUnsigned("task rank", *rank, UINT32_MAX));
    c.task_rank = static_cast<uint32_t>(r);
    if (size && !get({"DSYNC_NUM_WORKERS", "DMLC_NUM_WORKER"})) {
      DSYNC_ASSIGN_OR_RETURN(uint64_t n, ParseUnsigned("task count", *size, UINT32_MAX));
      c.task_count = static_cast<uint32_t>(n);
    }
    DSYNC_RETURN_IF_ERROR(c.ApplyTaskRank());
    // A job over several hosts: the default loopback would keep the others out.
    if (c.slurm_hosts > 1 && !get({"DSYNC_INTERFACE", "DMLC_INTERFACE", "DMLC_NODE_HOST"})) {
      c.bind_host = "0.0.0.0";
    }
  }
  return c;
}

uint16_t SlurmSchedulerPort(uint64_t job_id, uint64_t step_id) {
  // Below Linux's ephemeral range (32768-60999), away from the well-known ports; the step
  // spreads the steps of one job over different ports.
  constexpr uint64_t kBase = 10000, kSpan = 20000;
  return static_cast<uint16_t>(kBase + (job_id * 7 + step_id) % kSpan);
}

Status Config::ApplyTaskRank() {
  if (!task_rank) return Status::Ok();
  const uint32_t r = *task_rank;
  role = r == 0 ? Role::kScheduler : r <= num_servers ? Role::kServer : Role::kWorker;
  if (task_count) {
    const uint64_t n = *task_count;
    if (n < 2 + uint64_t{num_servers}) {
      return Error(StatusCode::kInvalidArgument,
                   "{} tasks cannot hold a scheduler, {} server(s) and a worker; launch at "
                   "least {} tasks or set DSYNC_NUM_SERVERS",
                   n, num_servers, 2 + uint64_t{num_servers});
    }
    num_workers = static_cast<uint32_t>(n - 1 - num_servers);
  }
  return Status::Ok();
}

Result<Config> Config::FromProcessEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    if (!kv.starts_with("DSYNC_") && !kv.starts_with("DMLC_") && !kv.starts_with("SLURM_") &&
        !kv.starts_with("OMPI_COMM_WORLD_") && !kv.starts_with("PMI_")) {
      continue;
    }
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  for (const std::string& warning : UnknownVariables(env)) spdlog::warn("{}", warning);
  return FromEnvironment(env);
}

std::vector<std::string> Config::UnknownVariables(const std::map<std::string, std::string>& env) {
  std::vector<std::string> out;
  if (env.contains(std::string(ps::kEnvironmentChecked))) return out;
  for (const auto& [name, value] : env) {
    if (std::string w = ps::UnknownVariable(name); !w.empty()) out.push_back(std::move(w));
  }
  return out;
}

std::map<std::string, std::string> Config::ToEnvironment() const {
  std::map<std::string, std::string> env;
  for (const ps::Setting& s : ps::Settings()) {
    if (!s.travels) continue;
    if (std::string v = s.get(*this); !v.empty()) env[std::string(s.env)] = std::move(v);
  }
  return env;
}

Status Config::Validate() const {
  if (num_servers == 0) {
    return Error(StatusCode::kInvalidArgument, "the job needs at least one server (num_servers)");
  }
  if (replicas == 0 || replicas > num_servers) {
    return Error(StatusCode::kInvalidArgument,
                 "--replicas (DSYNC_REPLICAS) {} must be between 1 and the number of servers "
                 "({}): each copy of a slice lives on a server of its own",
                 replicas, num_servers);
  }
  if (finish_bsp_percent && *finish_bsp_percent > 100) {
    return Error(StatusCode::kInvalidArgument,
                 "--finish-bsp (DSYNC_FINISH_BSP) {} is a share of the budget: 0 to 100",
                 *finish_bsp_percent);
  }
  if (num_workers == 0) {
    return Error(StatusCode::kInvalidArgument, "the job needs at least one worker (num_workers)");
  }
  if (slice_bytes < 4 || slice_bytes > (1ull << 30)) {
    return Error(StatusCode::kInvalidArgument,
                 "slice size {} bytes is outside 4 bytes .. 1 GiB", slice_bytes);
  }
  if (heartbeat_interval_ms == 0 || heartbeat_timeout_ms <= heartbeat_interval_ms) {
    return Error(StatusCode::kInvalidArgument,
                 "heartbeat timeout ({} ms) must exceed the heartbeat interval ({} ms)",
                 heartbeat_timeout_ms, heartbeat_interval_ms);
  }
  if (handshake_timeout_ms == 0 || max_pending_connections == 0 || max_pending_per_source == 0) {
    return Error(StatusCode::kInvalidArgument,
                 "the handshake timeout and the pending-connection caps must be at least 1");
  }
#if !DSYNC_HAVE_RDMA
  if (transport == TransportKind::kRdma) {
    return Error(StatusCode::kUnimplemented,
                 "this build has no RDMA transport (libibverbs-dev and librdmacm-dev were not "
                 "found when it was configured); use --transport tcp, or rebuild with them");
  }
#endif
  if (checkpoint_every > 0 && checkpoint_dir.empty()) {
    return Error(StatusCode::kInvalidArgument,
                 "--checkpoint-every (DSYNC_CHECKPOINT_EVERY) needs --checkpoint-dir "
                 "(DSYNC_CHECKPOINT_DIR): where to write them");
  }
  DSYNC_RETURN_IF_ERROR(ValidateOptimizer(optimizer));
  // Last: a setting that cannot work is the more useful message.
  if (token.empty() && !insecure) {
    return Error(StatusCode::kInvalidArgument,
                 "no cluster token: set DSYNC_TOKEN (or --token) to the same secret on every "
                 "node, or run with --insecure (DSYNC_INSECURE=1) on a network where everyone "
                 "who can reach these ports may join the job");
  }
  return Status::Ok();
}

}  // namespace dsync
