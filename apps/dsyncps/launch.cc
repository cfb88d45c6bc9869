#include "launch.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include <fmt/format.h>

#include "launcher.h"
#include "ps/settings.h"
#include "roles.h"
#include "runtime/exec_image.h"

namespace dsync::app {
namespace {

bool Executable(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// CMD's path as execvp would find it, looked up before anything starts so that a typo is
// one clear error rather than N workers failing.
Result<std::string> FindProgram(const std::string& name) {
  if (name.empty()) {
    return Error(StatusCode::kInvalidArgument,
                 "no worker program: give it after --, e.g. dsyncps launch --workers 2 -- "
                 "python3 train.py");
  }
  if (name.find('/') != std::string::npos) {
    if (Executable(name)) return name;
    return Error(StatusCode::kInvalidArgument, "the worker program '{}' is not an executable file",
                 name);
  }
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    if (const std::string candidate = dir + "/" + name; Executable(candidate)) return candidate;
    start = end + 1;
  }
  return Error(StatusCode::kInvalidArgument, "the worker program '{}' is not in PATH ({})", name,
               dirs);
}

// What a worker rank's program gets on top of this process's environment.
std::map<std::string, std::string> WorkerEnvironment(const Config& job) {
  std::map<std::string, std::string> env = job.ToEnvironment();
  env["DSYNC_ROLE"] = "worker";
  // This launcher said what was wrong with the environment it hands on (Config::
  // UnknownVariables); the ranks need not say it again, each.
  env[std::string(ps::kEnvironmentChecked)] = "1";
  return env;
}

[[noreturn]] void ExecWorker(const std::string& program, const std::vector<std::string>& command,
                             const std::map<std::string, std::string>& env) {
  std::fflush(stdout);
  std::fflush(stderr);
  const runtime::ExecImage image(program, {command.begin() + 1, command.end()}, env);
  image.ExecOrExit();
}

// The exit code of a job on one machine: the first worker's (by rank) that did not exit 0 by
// itself — a signal as 128 + its number, like a shell — else 1 if the scheduler or a server
// failed. A worker the launcher stopped because another failed counts only with an exit code
// of its own (it may have failed by itself just before it was told to stop).
int JobExitCode(const LaunchOutcome& outcome) {
  if (outcome.interrupted) return 130;
  for (bool stopped_too : {false, true}) {
    for (const ChildOutcome& c : outcome.children) {
      if (!c.is_worker || !c.started) continue;
      if (!c.stopped.empty() && !(stopped_too && WIFEXITED(c.status))) continue;
      if (WIFEXITED(c.status) && WEXITSTATUS(c.status) != 0) return WEXITSTATUS(c.status);
      if (WIFSIGNALED(c.status)) return 128 + WTERMSIG(c.status);
    }
  }
  return outcome.ok ? 0 : 1;
}

int LaunchHere(const std::string& self, const LaunchOptions& options, const Config& job,
               const std::string& program) {
  if (options.workers == 0) return Refuse(Error(StatusCode::kInvalidArgument, "--workers must be at least 1"));
  LaunchPlan plan;
  plan.servers = options.servers;
  plan.timeout_s = options.timeout_s;
  plan.exit_grace_s = options.exit_grace_s;
  std::vector<std::string> command = options.command;
  command.front() = program;
  for (uint32_t i = 0; i < options.workers; ++i) {
    WorkerLaunch w;
    w.command = command;
    plan.workers.push_back(std::move(w));
  }
  LaunchHooks hooks;
  hooks.on_started = [&](const std::map<std::string, std::string>& env) {
    std::printf("dsyncps launch: scheduler on %s:%s, %u server(s), %u worker(s) running %s, "
                "sync %s\n",
                env.at("DSYNC_SCHEDULER_URI").c_str(), env.at("DSYNC_SCHEDULER_PORT").c_str(),
                options.servers, options.workers, options.command.front().c_str(),
                job.sync.ToString().c_str());
    std::fflush(stdout);
  };
  const LaunchOutcome outcome = RunCluster(self, job, plan, hooks);
  PrintLaunchSummary(outcome, "dsyncps launch");
  return JobExitCode(outcome);
}

}  // namespace

int RunLaunchCommand(const std::string& self, const LaunchOptions& options, Config job) {
  auto program = FindProgram(options.command.empty() ? "" : options.command.front());
  if (!program.ok()) return Refuse(program.status());
  if (options.servers == 0) {
    return Refuse(Error(StatusCode::kInvalidArgument, "--servers must be at least 1"));
  }
  job.num_servers = options.servers;
  if (!job.task_rank) {
    job.num_workers = options.workers;
    job.role = Role::kScheduler;
    if (Status s = job.Validate(); !s.ok()) return Refuse(s);
    return LaunchHere(self, options, job, *program);
  }
  // Under srun/mpirun: this task's rank picks its part.
  if (Status s = job.ApplyTaskRank(); !s.ok()) return Refuse(s);
  if (options.workers_given && job.task_count && options.workers != job.num_workers) {
    return Refuse(Error(StatusCode::kInvalidArgument,
                        "--workers {} disagrees with the {} task(s) launched: under srun or "
                        "mpirun every task after the scheduler and {} server(s) is a worker; "
                        "drop --workers or launch {} tasks",
                        options.workers, *job.task_count, job.num_servers,
                        1 + job.num_servers + options.workers));
  }
  if (Status s = job.Validate(); !s.ok()) return Refuse(s);
  switch (job.role) {
    case Role::kScheduler: return RunScheduler(job);
    case Role::kServer: return RunServer(job);
    case Role::kWorker: break;
  }
  auto env = WorkerEnvironment(job);
  env["DSYNC_WORKER_RANK"] = std::to_string(*job.task_rank - 1 - job.num_servers);
  ExecWorker(*program, options.command, env);
}

int RunJoinCommand(const Config& given, const std::vector<std::string>& command) {
  auto program = FindProgram(command.empty() ? "" : command.front());
  if (!program.ok()) return Refuse(program.status());
  Config job = given;
  job.role = Role::kWorker;
  if (Status s = job.Validate(); !s.ok()) return Refuse(s);
  ExecWorker(*program, command, WorkerEnvironment(job));
}

}  // namespace dsync::app
