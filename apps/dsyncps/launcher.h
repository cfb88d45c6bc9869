// Runs a whole cluster on this machine as processes of this program: the scheduler first
// (it reports its port through a pipe, DSYNC_READY_FD), then the servers and workers (each
// says on a pipe of its own when it has joined; one that ends before stops the job). Every
// child's output is relayed line by line; children die with the launcher (PR_SET_PDEATHSIG)
// and are killed when the job ends or times out. `dsyncps local` and `dsyncps train` are
// built on it; hooks let `train` watch the output, start joiners on demand and draw progress.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dsync/config.h"

namespace dsync::app {

struct WorkerLaunch {
  // The user's program (its path first, found in PATH beforehand) and its arguments, run with
  // DSYNC_ROLE=worker and DSYNC_WORKER_RANK; empty: this program's `worker` subcommand.
  std::vector<std::string> command;
  std::vector<std::string> args;           // after "worker"
  std::map<std::string, std::string> env;  // extra environment (e.g. DSYNC_LINK_DELAY_MS)
  uint32_t start_after_ms = 0;             // > 0: joins the running job this late
  bool on_demand = false;                  // started when LaunchHooks::start_worker says so
  bool joins() const { return start_after_ms > 0 || on_demand; }
};

struct LaunchPlan {
  uint32_t servers = 2;
  std::vector<WorkerLaunch> workers;
  uint32_t timeout_s = 600;  // 0: none
  // Once the scheduler has ended the job, workers still running are stopped after this long.
  // Workers of our own exit at once; a user's program may still evaluate and save its model.
  uint32_t exit_grace_s = 2;
  std::map<std::string, std::string> scheduler_env;  // e.g. DSYNC_MAX_GRADIENTS
};

struct LaunchHooks {
  // The scheduler is up; `env` is what every node of the job gets (a monitor joins with it).
  std::function<void(const std::map<std::string, std::string>& env)> on_started;
  // One output line of a child (`worker`: its index, -1 for the scheduler and servers).
  // Returns whether the line is printed.
  std::function<bool(int worker, std::string_view line)> on_line;
  // Prints a relayed line (default: "[name] line" on stdout).
  std::function<void(const std::string& name, std::string_view line)> print;
  // About every 50 ms: true starts on-demand worker `worker` now.
  std::function<bool(uint32_t worker)> start_worker;
  std::function<void()> on_tick;
  // A worker process ended (wait status; whether the launcher had signalled it).
  std::function<void(uint32_t worker, int status, bool stopped_by_launcher)> on_worker_exit;
};

struct ChildOutcome {
  std::string name;
  bool is_worker = false;
  bool started = false;
  int status = 0;
  std::string result;  // a worker's last "final ..." / "completed ..." line
  std::string stopped;  // why the launcher signalled it ("" if it did not)
};

struct LaunchOutcome {
  bool ok = false;        // scheduler and servers finished cleanly, in time
  bool timed_out = false;
  int interrupted = 0;    // the signal that stopped the launcher, or 0
  // Workers that died by a signal the launcher did not send (a scenario the job survives).
  int workers_killed = 0;
  // Servers that died by such a signal in a job with copies of every slice (Config::replicas).
  int servers_killed = 0;
  std::string failure;    // why the launcher stopped the job early ("" if it did not)
  std::vector<ChildOutcome> children;
};

// Returns once every child has ended. Failures to start are reported in the outcome.
// A job started on this machine gets a fresh random token unless one was given.
void EnsureJobToken(Config& job);

LaunchOutcome RunCluster(const std::string& self, const Config& job, const LaunchPlan& plan,
                         const LaunchHooks& hooks);
// The per-process table `dsyncps local` prints at the end.
void PrintLaunchSummary(const LaunchOutcome& outcome, const char* who);
// Exit code for a launcher: 130 when interrupted, 0 when ok, else 1.
int LaunchExitCode(const LaunchOutcome& outcome);

// "I=VALUE" flags (repeated): every one parsed into out[I], I < limit. False after printing
// what is wrong with a malformed one.
bool ParseIndexedAll(const std::vector<std::string>& specs, uint32_t limit, const char* flag,
                     const char* what, std::map<uint32_t, std::string>* out);
std::vector<std::string> SplitWords(const std::string& text);

}  // namespace dsync::app
