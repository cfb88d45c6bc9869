// dsyncps: run a whole cluster on this machine (`local`), or one role of a cluster
// (`scheduler`, `server`, `worker`) configured by flags or by DSYNC_* environment variables
// (ps-lite's DMLC_* names work too). With no subcommand, DSYNC_ROLE picks the role, or
// under srun/mpirun the task rank does.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <climits>
#include <cstdio>

#include "checkpoint_cmd.h"
#include "flags.h"
#include "launch.h"
#include "launcher.h"
#include "roles.h"
#include "fashion_mnist.h"
#include "train_job.h"

namespace {

using dsync::Config;
using dsync::app::FlagText;
using dsync::app::LocalOptions;
using dsync::app::TrainOptions;

void AddTrainFlags(CLI::App& app, TrainOptions& t) {
  // A launcher appends per-worker flags after the common ones: the last one wins.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--model", t.model, "built-in model: mlp (Fashion-MNIST) | linreg | count")
      ->capture_default_str();
  app.add_option("--data-dir", t.data_dir, "mlp: folder of the Fashion-MNIST *-ubyte.gz files")
      ->capture_default_str();
  app.add_option("--eval-every", t.eval_every, "mlp: test accuracy every N iterations")
      ->capture_default_str();
  app.add_option("--eval-samples", t.eval_samples, "mlp: test samples per evaluation (0: all)")
      ->capture_default_str();
  app.add_option("--shards", t.shards, "mlp: data shards (default: the job's initial workers)");
  app.add_option("--iters", t.iters, "training iterations per worker")->capture_default_str();
  app.add_option("--batch", t.batch, "minibatch size")->capture_default_str();
  app.add_option("--dim", t.dim, "linreg: features")->capture_default_str();
  app.add_option("--samples", t.samples, "linreg: data set size")->capture_default_str();
  app.add_option("--tensor-elems", t.tensor_elems, "count: elements of the big tensor")
      ->capture_default_str();
  app.add_option("--seed", t.seed, "data seed (the same for every worker)")->capture_default_str();
  app.add_option("--compute-ms", t.compute_ms, "simulated compute time per iteration")
      ->capture_default_str();
  app.add_option("--slow", t.slow, "straggler: multiply the compute time by this")
      ->capture_default_str();
  app.add_option("--log-every", t.log_every, "print progress every N iterations")
      ->capture_default_str();
  app.add_option("--kill-at-iter", t.kill_at_iter, "failure injection: SIGKILL itself here");
  app.add_option("--kill-point", t.kill_point, "after-push | mid-push")->capture_default_str();
  app.add_option("--hang-at-iter", t.hang_at_iter,
                 "failure injection: SIGSTOP itself here (stops heartbeating)");
  app.add_option("--leave-at-round", t.leave_at_round,
                 "mlp: leave gracefully once the model reaches this version");
  app.add_option("--kill-at-round", t.kill_at_round,
                 "mlp: SIGKILL itself once the model reaches this version");
  app.add_option("--report-every", t.report_every,
                 "mlp: print an @progress JSON line every N iterations (for launchers)")
      ->capture_default_str();
  app.add_option("--worker-math", t.worker_math,
                 "mlp: gradients on cpu | cuda (cuBLAS) | auto (cuda when a GPU is visible)")
      ->capture_default_str();
}

// Flags of `train` and `compare` (the main job).
struct MainJobCli {
  dsync::app::TrainSpec spec;
  std::vector<std::string> straggler, join, leave, kill, latency;
  std::string modes = "bsp,dsync:4,dsync:4,3,ssp:4,asp,dsync:auto";
  std::string title;
  std::vector<std::string> runs;  // compare these finished runs instead of running jobs
};

void AddMainJobFlags(CLI::App& app, MainJobCli& c) {
  dsync::app::TrainSpec& s = c.spec;
  app.add_option("--servers", s.servers, "servers to start")->capture_default_str();
  app.add_option("--workers", s.workers, "workers (joiners included)")->capture_default_str();
  app.add_option("--epochs", s.epochs,
                 "training budget: passes over the 60000 training images, all workers together")
      ->capture_default_str();
  app.add_option("--batch", s.batch, "minibatch per worker")->capture_default_str();
  app.add_option("--seed", s.seed, "model initialization and data order")->capture_default_str();
  app.add_option("--data-dir", s.data_dir, "Fashion-MNIST *-ubyte.gz files")
      ->capture_default_str();
  app.add_option("--compute-ms", s.compute_ms,
                 "extra simulated compute per iteration, every worker (a bigger model)")
      ->capture_default_str();
  app.add_option("--eval-interval", s.eval_interval_s,
                 "seconds between test-set evaluations of the model")
      ->capture_default_str();
  app.add_option("--target", s.target, "test accuracy whose time-to-reach is reported")
      ->capture_default_str();
  app.add_option("--timeout", s.timeout_s, "kill a job after this many seconds")
      ->capture_default_str();
  app.add_flag("-v,--verbose", s.verbose, "show every line of every process");
  app.add_option("--straggler", c.straggler,
                 "I=F: worker I takes F times its own compute time per iteration");
  app.add_option("--join", c.join, "I=R: worker I joins once the model reaches round R");
  app.add_option("--leave", c.leave, "I=R: worker I leaves gracefully at round R");
  app.add_option("--kill", c.kill, "I=R: worker I is killed (SIGKILL) at round R");
  app.add_option("--latency", c.latency, "I=MS: MS milliseconds of added latency on worker I's link");
}

using dsync::app::Refuse;

// Node flags that `local` decides for itself: refused, not silently ignored.
dsync::Status CheckLocalFlags(const CLI::App& loc) {
  struct Unused {
    const char* flag;
    const char* instead;
  };
  static constexpr Unused kUnused[] = {
      {"--port", "every process of a local cluster listens on a free port of its own"},
      {"--scheduler-port", "it starts its own scheduler on a free port, printed at start"},
      {"--scheduler-uri", "it starts its own scheduler on the --bind address"},
      {"--num-servers", "--servers says how many servers it starts"},
      {"--num-workers", "--workers says how many workers it starts"},
  };
  for (const Unused& u : kUnused) {
    if (loc.get_option(u.flag)->count() > 0) {
      return dsync::Error(dsync::StatusCode::kInvalidArgument,
                          "dsyncps local does not take {}: {}", u.flag, u.instead);
    }
  }
  return dsync::Status::Ok();
}

// What `local` checks before it starts a process: its own flags, the training options
// every worker gets, and the job configuration every node gets.
dsync::Status CheckLocal(const CLI::App& loc, const LocalOptions& local, Config job,
                         const TrainOptions& train) {
  DSYNC_RETURN_IF_ERROR(CheckLocalFlags(loc));
  if (local.servers == 0 || local.workers == 0) {
    return dsync::Error(dsync::StatusCode::kInvalidArgument,
                        "--servers and --workers must be at least 1");
  }
  DSYNC_RETURN_IF_ERROR(dsync::app::CheckTrainOptions(train));
  if (train.iters == 0 && job.max_gradients == 0) {
    return dsync::Error(dsync::StatusCode::kInvalidArgument,
                        "--iters 0 trains until the job's gradient budget is spent, and this "
                        "job has none: give --iters N, or set DSYNC_MAX_GRADIENTS");
  }
  job.role = dsync::Role::kScheduler;
  job.num_servers = local.servers;
  job.num_workers = local.workers;
  return job.Validate();
}

std::string SelfPath(const char* argv0) {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) return std::string(buf, static_cast<size_t>(n));
  return argv0;
}

}  // namespace

int main(int argc, char** argv) {
  auto env = Config::FromProcessEnvironment();
  if (!env.ok()) {
    std::fprintf(stderr, "dsyncps: error: %s\n", env.status().ToString().c_str());
    return 2;
  }
  Config config = *env;
  FlagText text;
  TrainOptions train;
  LocalOptions local;

  CLI::App app{"dsyncps: a parameter server with delayed synchronization (bounded staleness, "
               "live membership)"};
  app.set_help_all_flag("--help-all", "help for every subcommand");
  auto* sched = app.add_subcommand("scheduler", "run the scheduler (membership, rounds)");
  auto* server = app.add_subcommand("server", "run a server (holds and updates slices)");
  auto* worker = app.add_subcommand("worker", "run a worker training the built-in model");
  auto* loc = app.add_subcommand("local", "run a whole cluster as processes on this machine");
  auto* trn = app.add_subcommand(
      "train", "the main job: train an MLP on Fashion-MNIST on a local cluster under a sync mode "
               "and a scenario, with live progress, metrics and time-to-accuracy");
  auto* cmp = app.add_subcommand(
      "compare", "run the main job once per sync mode on the same scenario; write a table and "
                 "plots of test accuracy against time and rounds");
  // The main job's defaults: momentum SGD tuned for the MLP (DSYNC_* variables still win).
  Config main_config = *env;
  if (!std::getenv("DSYNC_OPTIMIZER")) main_config.optimizer.kind = dsync::OptimizerKind::kMomentum;
  if (!std::getenv("DSYNC_LR")) main_config.optimizer.lr = 0.02f;
  FlagText main_text;
  MainJobCli main_cli;
  main_cli.spec.data_dir = dsync::train::kDefaultDataDir;
  for (CLI::App* sub : {trn, cmp}) {
    dsync::app::AddJobFlags(*sub, main_config, main_text, /*cluster_size=*/false);
    AddMainJobFlags(*sub, main_cli);
    sub->add_option("--worker-math", main_cli.spec.worker_math,
                    "workers' gradient math: cpu | cuda (cuBLAS) | auto (cuda when a GPU is "
                    "visible)")
        ->capture_default_str();
    // The node settings a local job is run with (its processes get them all).
    for (const char* var : {"DSYNC_STORE", "DSYNC_TRANSPORT", "DSYNC_INTERFACE", "DSYNC_GPUDIRECT",
                            "DSYNC_RDMA_DEVICE", "DSYNC_GID_INDEX"}) {
      dsync::app::AddSettingFlag(*sub, main_config, main_text, var);
    }
  }
  trn->add_option("--out", main_cli.spec.out_dir, "write metrics.csv and summary.json here");
  cmp->add_option("--modes", main_cli.modes,
                  "comma-separated sync modes, each optionally MODE/STALENESS-POLICY "
                  "(dsync:4,3/inverse)")->capture_default_str();
  cmp->add_option("--out", main_cli.spec.out_dir, "folder for the table, curves and plots")
      ->capture_default_str();
  cmp->add_option("--title", main_cli.title, "plot title (default: the scenario)");
  cmp->add_option("--runs", main_cli.runs,
                  "compare finished runs instead of running jobs: folders holding a summary.json "
                  "(dsyncps train --out, examples/pytorch/fmnist_cnn.py --out) or the files")
      ->delimiter(',');
  main_cli.spec.out_dir = "dsyncps-compare";
  dsync::app::CheckpointCli checkpoint_cli;
  CLI::App* checkpoint_export = dsync::app::AddCheckpointCommand(app, checkpoint_cli);
  for (CLI::App* sub : {sched, server, worker, loc}) dsync::app::AddNodeFlags(*sub, config, text);
  dsync::app::AddServerFlags(*server, config, text);
  // Rank mode (no subcommand: DSYNC_ROLE or the task rank decides) takes every flag a role
  // takes, so one `srun dsyncps FLAGS` line serves every task.
  dsync::app::AddNodeFlags(app, config, text);
  dsync::app::AddJobFlags(app, config, text);
  AddTrainFlags(app, train);
  dsync::app::AddJobFlags(*sched, config, text);
  dsync::app::AddJobFlags(*loc, config, text);
  AddTrainFlags(*worker, train);
  AddTrainFlags(*loc, train);
  loc->add_option("--servers", local.servers, "servers to start")->capture_default_str();
  loc->add_option("--workers", local.workers, "workers to start")->capture_default_str();
  loc->add_option("--timeout", local.timeout_s, "kill the job after this many seconds")
      ->capture_default_str();
  loc->add_option("--join", local.join,
                  "WORKER=MS: start that worker MS milliseconds late; it joins the running job");
  loc->add_option("--worker-flags", local.worker_extra,
                  "WORKER=FLAGS: extra flags for one worker, e.g. '3=--slow 3'");

  // The user's own program as the workers. Everything from the program's name on is its
  // own (prefix_command): `launch --workers 2 python3 train.py --lr 0.1` and the same with
  // `--` before the program both work.
  dsync::app::LaunchOptions launch;
  launch.servers = config.num_servers;
  launch.workers = config.num_workers;
  auto* lch = app.add_subcommand(
      "launch",
      "run your own program as the job's workers: on this machine the scheduler, --servers "
      "servers and --workers copies of CMD; under srun or mpirun rank 0 is the scheduler, the "
      "next --servers ranks servers and the rest run CMD. Usage: launch [FLAGS] -- CMD ARGS");
  auto* jn = app.add_subcommand(
      "join", "run your own program as one more worker of a running job (the scheduler's "
              "address and the token from flags or DSYNC_*). Usage: join [FLAGS] -- CMD ARGS");
  for (CLI::App* sub : {lch, jn}) {
    dsync::app::AddNodeFlags(*sub, config, text);
    sub->prefix_command();
  }
  dsync::app::AddJobFlags(*lch, config, text, /*cluster_size=*/false);
  lch->add_option("--servers", launch.servers, "servers (DSYNC_NUM_SERVERS)")->capture_default_str();
  lch->add_option("--workers", launch.workers,
                  "copies of CMD on this machine (DSYNC_NUM_WORKERS); under srun/mpirun every "
                  "rank after the servers")
      ->capture_default_str();
  lch->add_option("--timeout", launch.timeout_s,
                  "on this machine: stop the job after this many seconds (0: never)")
      ->capture_default_str();
  lch->add_option("--exit-grace", launch.exit_grace_s,
                  "on this machine: once the job has ended, give workers this many seconds to "
                  "finish (evaluate, save) before they are stopped")
      ->capture_default_str();

  // "dsyncps: error:" like every other refusal, so a launcher relaying it shows the reason.
  app.failure_message([](const CLI::App* a, const CLI::Error& e) {
    return "dsyncps: error: " + CLI::FailureMessage::simple(a, e);
  });
  // `launch`/`join`: the program after `--` is the user's, never parsed here (CLI11 would
  // hand it back to the top level).
  std::vector<std::string> command_after_dashes;
  bool dashes = false;
  {
    int cut = argc;
    bool launcher_command = false;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (a == "--") {
        cut = i;
        break;
      }
      launcher_command = launcher_command || a == "launch" || a == "join";
    }
    if (launcher_command && cut < argc) {
      dashes = true;
      command_after_dashes.assign(argv + cut + 1, argv + argc);
      argc = cut;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is a success; anything else a usage error
  }
  if (checkpoint_export->parsed()) return dsync::app::RunCheckpointExport(checkpoint_cli);
  if (trn->parsed() || cmp->parsed()) {
    if (dsync::Status s = dsync::app::ApplyFlagText(main_text, main_config); !s.ok()) {
      std::fprintf(stderr, "dsyncps: error: %s\n", s.ToString().c_str());
      return 2;
    }
    MainJobCli& c = main_cli;
    if (cmp->parsed() && !c.runs.empty()) {
      const bool target_given = cmp->get_option("--target")->count() > 0;
      return dsync::app::RunCompareFiles(
          c.runs, c.spec.out_dir, c.title,
          target_given ? std::optional<double>(c.spec.target) : std::nullopt);
    }
    dsync::app::EnsureJobToken(main_config);
    c.spec.job = main_config;
    if (trn->parsed() && trn->get_option("--out")->count() == 0) c.spec.out_dir.clear();
    if (dsync::Status s = dsync::app::ParseScenario(c.straggler, c.join, c.leave, c.kill,
                                                    c.latency, c.spec.workers, &c.spec.scenario);
        !s.ok()) {
      std::fprintf(stderr, "dsyncps: error: %s\n", s.ToString().c_str());
      return 2;
    }
    return trn->parsed() ? dsync::app::RunTrainCommand(SelfPath(argv[0]), c.spec)
                         : dsync::app::RunCompareCommand(SelfPath(argv[0]), c.spec, c.modes,
                                                         c.title);
  }
  if (dsync::Status s = dsync::app::ApplyFlagText(text, config); !s.ok()) {
    std::fprintf(stderr, "dsyncps: error: %s\n", s.ToString().c_str());
    return 2;
  }

  // The program: after `--`, or from its name on (prefix_command), in which case a `--` later
  // on is the program's own.
  auto command_of = [&](CLI::App* sub) {
    std::vector<std::string> command = sub->remaining();
    if (dashes && !command.empty()) command.push_back("--");
    command.insert(command.end(), command_after_dashes.begin(), command_after_dashes.end());
    return command;
  };
  if (dashes && !lch->parsed() && !jn->parsed()) {
    return Refuse(dsync::Error(dsync::StatusCode::kInvalidArgument,
                               "arguments after -- are a program for launch or join to run; "
                               "this command takes none"));
  }
  if (lch->parsed() || jn->parsed()) {
    std::vector<std::string> command = command_of(lch->parsed() ? lch : jn);
    if (jn->parsed()) {
      // Under Slurm the scheduler's address is derived from the step, and a joiner runs in a
      // step of its own: the running job's address must be given.
      auto given = [&](const char* flag, std::initializer_list<const char*> vars) {
        bool any = jn->get_option(flag)->count() > 0;
        for (const char* v : vars) any = any || (std::getenv(v) && *std::getenv(v));
        return any;
      };
      if (config.slurm_hosts > 0 && config.rendezvous.empty() &&
          !(given("--scheduler-uri", {"DSYNC_SCHEDULER_URI", "DMLC_PS_ROOT_URI"}) &&
            given("--scheduler-port", {"DSYNC_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT"}))) {
        return Refuse(dsync::Error(
            dsync::StatusCode::kInvalidArgument,
            "under Slurm a joiner cannot derive the running job's scheduler (that address "
            "comes from the job's own step): give --scheduler-uri and --scheduler-port (or "
            "DSYNC_SCHEDULER_URI and DSYNC_SCHEDULER_PORT), or --rendezvous"));
      }
      return dsync::app::RunJoinCommand(config, command);
    }
    launch.command = std::move(command);
    launch.workers_given = lch->get_option("--workers")->count() > 0;
    // On one machine a fresh token; the ranks of srun/mpirun need one they share (DSYNC_TOKEN
    // exported to every task), which Validate asks for.
    if (!config.task_rank) dsync::app::EnsureJobToken(config);
    return dsync::app::RunLaunchCommand(SelfPath(argv[0]), launch, config);
  }

  const bool subcommand = sched->parsed() || server->parsed() || worker->parsed() || loc->parsed();
  if (!subcommand && config.task_rank) {
    // Flags may have changed the number of servers, which moves the ranks' roles.
    if (app.get_option("--num-workers")->count() > 0) config.task_count.reset();
    if (dsync::Status s = config.ApplyTaskRank(); !s.ok()) return Refuse(s);
  }
  dsync::Role role = config.role;
  if (sched->parsed()) role = dsync::Role::kScheduler;
  if (server->parsed()) role = dsync::Role::kServer;
  if (worker->parsed()) role = dsync::Role::kWorker;
  if (loc->parsed()) {
    dsync::app::EnsureJobToken(config);
    if (dsync::Status s = CheckLocal(*loc, local, config, train); !s.ok()) return Refuse(s);
    return dsync::app::RunLocal(SelfPath(argv[0]), local, config, train);
  }
  bool role_from_env = false;
  for (const char* v : {"DSYNC_ROLE", "DMLC_ROLE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                        "PMI_RANK"}) {
    role_from_env = role_from_env || std::getenv(v) != nullptr;
  }
  if (!sched->parsed() && !server->parsed() && !worker->parsed() && !role_from_env) {
    std::fprintf(stderr, "%s\ndsyncps: error: name a subcommand (local, scheduler, server, "
                 "worker) or set DSYNC_ROLE\n", app.help().c_str());
    return 2;
  }
  config.role = role;
  if (dsync::Status s = config.Validate(); !s.ok()) {
    std::fprintf(stderr, "dsyncps: error: %s\n", s.ToString().c_str());
    return 2;
  }
  if (config.token.empty() && role != dsync::Role::kScheduler) {  // the scheduler says it itself
    spdlog::warn("{}: running without a cluster token (--insecure): anyone who can reach the "
                 "job's ports may join it",
                 dsync::RoleName(role));
  }
  // Before joining: a worker that cannot compute must not take a place in the job.
  if (role == dsync::Role::kWorker) {
    if (dsync::Status s = dsync::app::CheckTrainOptions(train); !s.ok()) return Refuse(s);
  }
  switch (role) {
    case dsync::Role::kScheduler: return dsync::app::RunScheduler(config);
    case dsync::Role::kServer: return dsync::app::RunServer(config);
    case dsync::Role::kWorker: return dsync::app::RunWorker(config, train);
  }
  return 2;
}
