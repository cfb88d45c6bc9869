// Clusters of real processes on 127.0.0.1, driven through the dsyncps program: the local
// launcher, the environment bootstrap, and failures the way they happen (SIGKILL in the
// middle of a push, SIGSTOP so heartbeats stop, a worker joining late). Every test is
// bounded in time and kills what it started.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dsync/config.h"
#include "ps/checkpoint.h"
#if DSYNC_HAVE_CUDA
#include "cuda/cuda_store.h"
#endif
#include "net_util.h"
#include "proc.h"

namespace {

namespace fs = std::filesystem;
using dsync::testing::Proc;
using nlohmann::json;
using namespace std::chrono_literals;

class MultiProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dsync::testing::FreshTestDir("dsync-mp");
    fs::create_directories(dir_ / "dump");
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Runs `dsyncps local ARGS` and returns its output; asserts it exited 0.
  std::string RunLocal(std::vector<std::string> args, int expect_exit = 0) {
    std::vector<std::string> argv = {"local", "--timeout", "100",
                                     "--dump-model", (dir_ / "dump").string(),
                                     "--audit-log", (dir_ / "audit.jsonl").string()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunDsyncps(argv, expect_exit);
  }

  // Runs `dsyncps ARGS` (stdout is a file: progress comes as plain lines).
  std::string RunDsyncps(std::vector<std::string> args, int expect_exit = 0,
                         const std::map<std::string, std::string>& env = {}) {
    args.insert(args.begin(), DSYNC_BINARY);
    Proc p(args, env, dir_ / "dsyncps.log");
    const int status = p.Wait(240s);
    const std::string out = p.Output();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == expect_exit)
        << "status " << status << "\n" << out;
    return out;
  }

  // Every "completed N" a worker reported, summed. In the launcher's output only the relayed
  // worker lines count (its summary repeats them).
  static uint64_t Completed(const std::string& out, bool launcher = true) {
    std::regex re("completed (\\d+)");
    uint64_t total = 0;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if ((!launcher || line.rfind("[worker", 0) == 0) && std::regex_search(line, m, re)) {
        total += std::stoull(m[1]);
      }
    }
    return total;
  }

  // Every slice of every server's dump holds exactly `count` on every element.
  void ExpectModelCount(uint64_t count, uint32_t servers) {
    uint32_t files = 0, slices = 0;
    for (const auto& entry : fs::directory_iterator(dir_ / "dump")) {
      ++files;
      json j = json::parse(std::ifstream(entry.path()));
      for (const json& s : j["slices"]) {
        ++slices;
        EXPECT_EQ(s["min"].get<double>(), static_cast<double>(count))
            << entry.path() << " tensor " << s["tensor"] << " slice " << s["slice"];
        EXPECT_EQ(s["max"].get<double>(), static_cast<double>(count));
      }
    }
    EXPECT_EQ(files, servers);
    EXPECT_GT(slices, servers);
  }

  // The copies of each slice in the servers' dumps are alike (CRC-32); returns how many
  // slices have more than one.
  size_t CopiesAlike() {
    std::map<std::pair<uint32_t, uint32_t>, std::vector<uint64_t>> copies;
    for (const auto& entry : fs::directory_iterator(dir_ / "dump")) {
      json j = json::parse(std::ifstream(entry.path()));
      for (const json& s : j["slices"]) {
        copies[{s["tensor"].get<uint32_t>(), s["slice"].get<uint32_t>()}].push_back(
            s["crc32"].get<uint64_t>());
      }
    }
    size_t compared = 0;
    for (const auto& [key, crcs] : copies) {
      compared += crcs.size() > 1 ? 1 : 0;
      for (uint64_t crc : crcs) {
        EXPECT_EQ(crc, crcs.front()) << "tensor " << key.first << " slice " << key.second;
      }
    }
    return compared;
  }

  // Bound and quorum over the scheduler's decisions; returns the rounds.
  std::vector<json> CheckAudit(uint32_t bound) {
    std::vector<json> rounds;
    std::ifstream in(dir_ / "audit.jsonl");
    uint64_t expected = 0;
    for (std::string line; std::getline(in, line);) {
      json r = json::parse(line);
      if (r.contains("policy")) continue;  // a finish as bsp (below), dsync:auto's decisions
      if (r.contains("member")) {  // membership: every one names the node's address
        EXPECT_FALSE(r["member"]["address"].get<std::string>().empty()) << line;
        continue;
      }
      EXPECT_EQ(r["round"].get<uint64_t>(), expected++);
      uint32_t live_members = 0;
      for (const json& m : r["members"]) {
        EXPECT_LE(r["round"].get<uint64_t>() - m[2].get<uint64_t>(), bound) << line;
        ++live_members;
      }
      EXPECT_GE(live_members, r["quorum"].get<uint32_t>()) << line;
      rounds.push_back(std::move(r));
    }
    return rounds;
  }

  fs::path dir_;
};

TEST_F(MultiProcess, LocalClusterOfSeparateProcessesTrainsTheModel) {
  // 1 scheduler + 2 servers + 3 workers, each its own process.
  const std::string out = RunLocal({"--servers", "2", "--workers", "3", "--sync", "dsync:2",
                                    "--iters", "60", "--lr", "0.05", "--log-every", "20"});
  std::regex re("final loss ([0-9.]+) .*initial loss ([0-9.]+)");
  int finals = 0;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (line.rfind("[worker", 0) == 0 && std::regex_search(line, m, re)) {
      ++finals;
      EXPECT_LT(std::stod(m[1]), std::stod(m[2]) / 10) << line;
    }
  }
  EXPECT_EQ(finals, 3) << out;
  EXPECT_NE(out.find("job finished"), std::string::npos);
  const auto rounds = CheckAudit(2);
  EXPECT_GE(rounds.size(), 60u);
}

TEST_F(MultiProcess, AMisspeltVariableIsSaidOnceByTheLauncherNotByEachProcessItStarts) {
  const std::string out =
      RunDsyncps({"local", "--timeout", "100", "--servers", "1", "--workers", "2", "--iters", "5"},
                 0, {{"DSYNC_LRR", "0.1"}});
  const std::string warning = "DSYNC_LRR is not a setting and is ignored: did you mean DSYNC_LR?";
  size_t said = 0;
  for (size_t at = out.find(warning); at != std::string::npos; at = out.find(warning, at + 1)) {
    ++said;
  }
  EXPECT_EQ(said, 1u) << out;
  EXPECT_NE(out.find("job finished"), std::string::npos) << out;
}

TEST_F(MultiProcess, SigkillMidPushIsAppliedNowhereAndAfterPushExactlyOnce) {
  const std::string out =
      RunLocal({"--servers", "2", "--workers", "4", "--sync", "bsp", "--optimizer", "sum",
                "--model", "count", "--iters", "20", "--tensor-elems", "5000", "--slice-bytes",
                "4096", "--compute-ms", "5", "--worker-flags",
                "2=--kill-at-iter 5 --kill-point mid-push", "--worker-flags",
                "1=--kill-at-iter 7 --kill-point after-push"});
  EXPECT_NE(out.find("killed between two tensors of a push (completed 5)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("killed after a push (completed 8)"), std::string::npos) << out;
  EXPECT_NE(out.find("2 worker(s) were killed"), std::string::npos);
  const uint64_t total = Completed(out);
  EXPECT_EQ(total, 20u + 20u + 5u + 8u);
  ExpectModelCount(total, 2);
  CheckAudit(0);
}

// Checkpoints through the command line: a job with a worker killed mid-push checkpoints every
// 4 rounds and at its end; the job resumed from it goes on from there, and the final model
// counts every gradient either job applied, none twice.
TEST_F(MultiProcess, AJobResumedFromItsCheckpointKeepsEveryAppliedGradientOnce) {
  const std::string ckpt = (dir_ / "ckpt").string();
  const std::vector<std::string> job = {"--servers", "2", "--workers", "3", "--sync", "dsync:1,2",
                                        "--optimizer", "sum", "--model", "count",
                                        "--tensor-elems", "5000", "--slice-bytes", "4096"};
  std::vector<std::string> first = job;
  first.insert(first.end(), {"--iters", "15", "--checkpoint-dir", ckpt, "--checkpoint-every",
                             "4", "--worker-flags", "2=--kill-at-iter 6 --kill-point mid-push"});
  const std::string out1 = RunLocal(first);
  EXPECT_NE(out1.find("checkpoint of version 4 complete"), std::string::npos) << out1;
  const uint64_t before = Completed(out1);
  EXPECT_EQ(before, 15u + 15u + 6u);
  std::vector<std::string> second = job;
  second.insert(second.end(), {"--iters", "10", "--resume", ckpt});
  const std::string out2 = RunLocal(second);
  EXPECT_NE(out2.find("resuming from"), std::string::npos) << out2;
  EXPECT_NE(out2.find(std::to_string(before) + " gradient(s) applied before"), std::string::npos)
      << out2;
  ExpectModelCount(before + Completed(out2), 2);
}

// Ctrl-C (or Slurm's scancel) stops a job that writes checkpoints only once one of where it
// was is written; the job resumed from it loses nothing that was applied.
TEST_F(MultiProcess, AnInterruptedJobWritesACheckpointFirstAndResumesFromIt) {
  const std::string ckpt = (dir_ / "ckpt").string();
  const std::vector<std::string> job = {"--servers", "2", "--workers", "2", "--sync", "bsp",
                                        "--optimizer", "sum", "--model", "count",
                                        "--tensor-elems", "5000", "--slice-bytes", "4096"};
  std::vector<std::string> first = {DSYNC_BINARY, "local", "--timeout", "100", "--iters",
                                    "100000", "--compute-ms", "5", "--checkpoint-dir", ckpt,
                                    "--checkpoint-every", "1000"};
  first.insert(first.end(), job.begin(), job.end());
  Proc p(first, {}, dir_ / "interrupted.log");
  ASSERT_TRUE(p.WaitForOutput("joined (sync bsp", 30s)) << p.Output();
  std::this_thread::sleep_for(1500ms);
  p.Signal(SIGINT);
  const int status = p.Wait(60s);
  const std::string out1 = p.Output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 130) << "status " << status << out1;
  EXPECT_NE(out1.find("stopped; resume the job with --resume"), std::string::npos) << out1;
  EXPECT_NE(out1.find("scheduler  exit code 0"), std::string::npos) << out1;
  EXPECT_EQ(out1.find("still running"), std::string::npos) << "nothing had to be killed: " << out1;
  // The newest checkpoint is the one the stop wrote.
  fs::path newest;
  for (const auto& e : fs::directory_iterator(ckpt)) newest = std::max(newest, e.path());
  ASSERT_TRUE(fs::exists(newest / "MANIFEST.json")) << out1;
  const json manifest = json::parse(std::ifstream(newest / "MANIFEST.json"));
  const uint64_t before = manifest["gradients_committed"].get<uint64_t>();
  const uint64_t version = manifest["version"].get<uint64_t>();
  EXPECT_GT(version, 0u);
  // bsp: two gradients a round while both workers run; the launcher's SIGTERM reaches them at
  // different moments, and the rounds after the first one left close with the other alone.
  EXPECT_LE(before, 2 * version);
  EXPECT_GE(before, version);
  std::vector<std::string> second = job;
  second.insert(second.end(), {"--iters", "5", "--resume", ckpt});
  const std::string out2 = RunLocal(second);
  EXPECT_NE(out2.find("resuming from " + newest.string()), std::string::npos) << out2;
  ExpectModelCount(before + Completed(out2), 2);
}

// Export joins a tensor only from slices that tile it: files that pass their checksums but
// claim overlapping slices, or a tensor far larger than its slices, are refused by name,
// before anything the claimed size is allocated.
TEST_F(MultiProcess, ExportRefusesSlicesThatDoNotTileTheirTensor) {
  auto write = [&](const std::string& name, uint64_t elements, uint64_t second_offset) {
    const fs::path dir = dir_ / name / "ckpt-000000000003";
    dsync::ps::CheckpointManifest m;
    m.version = 3;
    m.num_servers = 2;
    m.slice_bytes = 16;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      dsync::ps::ServerCheckpoint c{rank, 2, 3, 16, {}};
      dsync::ps::CheckpointSlice s;
      s.tensor = 0;
      s.slice = rank;
      s.meta = dsync::ps::InitMeta{"w", elements, rank == 0 ? 0 : second_offset, std::nullopt, {}};
      s.snapshot.params.assign(4, 1.0f + static_cast<float>(rank));
      c.slices.push_back(s);
      auto f = dsync::ps::WriteServerCheckpoint(dir.string(), c);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      m.files.push_back(*f);
    }
    ASSERT_TRUE(dsync::ps::WriteManifest(dir.string(), m).ok());
  };
  write("good", 8, 4);
  const std::string ok = RunDsyncps({"checkpoint", "export", (dir_ / "good").string(), "--format",
                                     "npz", "--out", (dir_ / "good.npz").string()});
  EXPECT_NE(ok.find("wrote 1 tensor(s), 8 parameters, of version 3"), std::string::npos) << ok;
  write("overlap", 8, 2);
  const std::string overlap = RunDsyncps({"checkpoint", "export", (dir_ / "overlap").string(),
                                          "--format", "npz", "--out",
                                          (dir_ / "o.npz").string()}, 1);
  EXPECT_NE(overlap.find("not cut into slices that follow each other"), std::string::npos)
      << overlap;
  write("huge", uint64_t{1} << 50, 4);
  const std::string huge = RunDsyncps({"checkpoint", "export", (dir_ / "huge").string(),
                                       "--format", "npz", "--out", (dir_ / "h.npz").string()}, 1);
  EXPECT_NE(huge.find("has 8 of its 1125899906842624 elements"), std::string::npos) << huge;
  EXPECT_FALSE(fs::exists(dir_ / "o.npz") || fs::exists(dir_ / "h.npz"));
}

TEST_F(MultiProcess, StoppedWorkerIsDeclaredDeadByHeartbeatTimeout) {
  const std::string out = RunLocal(
      {"--servers", "1", "--workers", "3", "--sync", "dsync:1", "--optimizer", "sum", "--model",
       "count", "--iters", "30", "--tensor-elems", "3000", "--slice-bytes", "4096",
       "--compute-ms", "10", "--heartbeat-ms", "100", "--heartbeat-timeout-ms", "800",
       "--worker-flags", "1=--hang-at-iter 4"});
  EXPECT_NE(out.find("no heartbeat for 800 ms"), std::string::npos) << out;
  // The stopped worker never ends by itself: the launcher kills it once the job is over, and
  // says so instead of counting it as a worker killed during the job.
  EXPECT_EQ(out.find("killed during the job"), std::string::npos) << out;
  EXPECT_NE(out.find("the launcher stopped worker 1: still running 2 s after the scheduler had "
                     "ended"),
            std::string::npos)
      << out;
  const uint64_t total = Completed(out);  // the hung worker reports what it completed
  EXPECT_EQ(total, 30u + 30u + 4u);
  ExpectModelCount(total, 1);
  CheckAudit(1);
}

TEST_F(MultiProcess, WorkerJoinsAndAnotherLeavesWhileTrainingRuns) {
  // 120 iterations of 8 ms outlast the joiner's 600 ms head start even in the plain build,
  // and 600 ms leave the others time to commit rounds first under TSan on a loaded machine
  // (250 ms did not: the joiner once found round 0).
  const std::string out = RunLocal(
      {"--servers", "2", "--workers", "4", "--sync", "dsync:2,2", "--optimizer", "sum",
       "--model", "count", "--iters", "120", "--tensor-elems", "3000", "--slice-bytes", "4096",
       "--compute-ms", "8", "--join", "3=600", "--worker-flags", "1=--iters 6"});
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("worker 1003 joined from .*counts from round (\\d+)")))
      << "the late worker should join a running job\n" << out;
  EXPECT_GT(std::stoull(m[1]), 0u);
  EXPECT_NE(out.find("left after 6 gradient(s)"), std::string::npos) << out;
  // The joiner's clocks start where the slowest worker's were: the count is its commits,
  // not its last clock.
  EXPECT_NE(out.find("worker 1003 left after 120 gradient(s)"), std::string::npos) << out;
  const uint64_t total = Completed(out);
  EXPECT_EQ(total, 120u + 6u + 120u + 120u);
  ExpectModelCount(total, 2);
  CheckAudit(2);
}

TEST_F(MultiProcess, RolesBootstrapFromTheEnvironmentAlone) {
  // A free port for the scheduler (the launcher avoids this race with a ready pipe).
  const uint16_t free_port = dsync::testing::FreeLoopbackPort();
  ASSERT_NE(free_port, 0);
  const std::string port = std::to_string(free_port);

  const std::map<std::string, std::string> env = {
      {"DMLC_PS_ROOT_URI", "127.0.0.1"},  // ps-lite's names work as fallbacks
      {"DMLC_PS_ROOT_PORT", port},
      {"DSYNC_NUM_SERVERS", "1"},
      {"DSYNC_NUM_WORKERS", "2"},
      {"DSYNC_SYNC", "ssp:1"},
      {"DSYNC_OPTIMIZER", "sum"},
      {"DSYNC_TOKEN", "env-token"}};
  auto with_role = [&](const char* role) {
    auto e = env;
    e["DSYNC_ROLE"] = role;
    return e;
  };
  Proc sched({DSYNC_BINARY}, with_role("scheduler"), dir_ / "scheduler.log");
  Proc server({DSYNC_BINARY}, with_role("server"), dir_ / "server.log");
  Proc w0({DSYNC_BINARY, "worker", "--model", "count", "--iters", "15", "--tensor-elems", "100"},
          env, dir_ / "w0.log");
  Proc w1({DSYNC_BINARY, "worker", "--model", "count", "--iters", "15", "--tensor-elems", "100"},
          env, dir_ / "w1.log");
  EXPECT_EQ(w0.Wait(60s), 0) << w0.Output();
  EXPECT_EQ(w1.Wait(60s), 0) << w1.Output();
  EXPECT_EQ(sched.Wait(30s), 0) << sched.Output();
  EXPECT_EQ(server.Wait(30s), 0) << server.Output();
  EXPECT_NE(sched.Output().find("sync ssp:1"), std::string::npos) << sched.Output();
  EXPECT_EQ(Completed(w0.Output(), false) + Completed(w1.Output(), false), 30u);
}

TEST_F(MultiProcess, RankModeTakesEveryFlagAndFlagsMoveTheRanksRoles) {
  // One command line for every task, as `srun dsyncps FLAGS` gives: the rank picks the role,
  // and --num-servers 2 (a flag, not the environment) makes rank 2 a server.
  const std::string port = std::to_string(dsync::testing::FreeLoopbackPort());
  std::vector<std::unique_ptr<Proc>> tasks;
  for (int r = 0; r < 5; ++r) {
    tasks.push_back(std::make_unique<Proc>(
        std::vector<std::string>{DSYNC_BINARY, "--scheduler-port", port, "--num-servers", "2",
                                 "--model", "count", "--optimizer", "sum", "--iters", "10",
                                 "--tensor-elems", "5000", "--dump-model",
                                 (dir_ / "dump").string()},
        std::map<std::string, std::string>{{"SLURM_PROCID", std::to_string(r)},
                                           {"SLURM_NTASKS", "5"},
                                           {"SLURM_STEP_ID", "0"},
                                           {"DSYNC_SLICE_BYTES", "4096"},
                                           {"DSYNC_TOKEN", "rank-token"}},
        dir_ / ("rank" + std::to_string(r) + ".log")));
  }
  for (auto& t : tasks) EXPECT_EQ(t->Wait(60s), 0) << t->Output();
  EXPECT_NE(tasks[0]->Output().find("2 server(s), 2 initial worker(s)"), std::string::npos)
      << tasks[0]->Output();
  EXPECT_TRUE(std::regex_search(tasks[2]->Output(), std::regex("server [12] listening")))
      << tasks[2]->Output();
  EXPECT_EQ(Completed(tasks[3]->Output(), false) + Completed(tasks[4]->Output(), false), 20u);
  ExpectModelCount(20, 2);
}

// Processes of one job started by role, as under srun or mpirun: the scheduler on a free
// port, the servers, then the workers (count model, sum optimizer).
struct RoleJob {
  std::map<std::string, std::string> env;
  std::unique_ptr<Proc> scheduler;
  std::vector<std::unique_ptr<Proc>> servers, workers;

  RoleJob(const fs::path& dir, uint32_t servers_n, uint32_t workers_n,
          const std::vector<std::string>& worker_args,
          const std::map<std::string, std::string>& more_env = {}) {
    env = {{"DSYNC_SCHEDULER_URI", "127.0.0.1"},
           {"DSYNC_SCHEDULER_PORT", std::to_string(dsync::testing::FreeLoopbackPort())},
           {"DSYNC_NUM_SERVERS", std::to_string(servers_n)},
           {"DSYNC_NUM_WORKERS", std::to_string(workers_n)},
           {"DSYNC_SYNC", "bsp"},
           {"DSYNC_OPTIMIZER", "sum"},
           {"DSYNC_SLICE_BYTES", "4096"},
           {"DSYNC_HEARTBEAT_MS", "100"},
           {"DSYNC_HEARTBEAT_TIMEOUT_MS", "800"},
           {"DSYNC_TOKEN", "role-token"}};
    for (const auto& [k, v] : more_env) env[k] = v;
    scheduler = std::make_unique<Proc>(std::vector<std::string>{DSYNC_BINARY, "scheduler"}, env,
                                       dir / "scheduler.log");
    for (uint32_t i = 0; i < servers_n; ++i) {
      servers.push_back(std::make_unique<Proc>(std::vector<std::string>{DSYNC_BINARY, "server"},
                                               env, dir / fmt("server{}.log", i)));
    }
    for (uint32_t i = 0; i < workers_n; ++i) {
      std::vector<std::string> args = {DSYNC_BINARY, "worker", "--model", "count",
                                       "--tensor-elems", "3000"};
      args.insert(args.end(), worker_args.begin(), worker_args.end());
      workers.push_back(std::make_unique<Proc>(args, env, dir / fmt("worker{}.log", i)));
    }
  }
  // Ranks are given in the order servers register: each server's process by the id it
  // logged (a server that logged none is left out, and the caller's size check fails).
  std::map<uint32_t, Proc*> ServersById() const {
    std::map<uint32_t, Proc*> by_id;
    for (const auto& s : servers) {
      std::smatch m;
      const std::string out = s->Output();
      EXPECT_TRUE(std::regex_search(out, m, std::regex("server (\\d+) listening"))) << out;
      if (!m.empty()) by_id[static_cast<uint32_t>(std::stoul(m[1]))] = s.get();
    }
    return by_id;
  }
  static std::string fmt(const char* pattern, uint32_t i) {
    std::string s = pattern;
    return s.replace(s.find("{}"), 2, std::to_string(i));
  }
};

// A scheduler that does not run for twice the heartbeat timeout (SIGSTOP: a debugger, a VM
// steal) evicts nobody when it runs again: the heartbeats that piled up meanwhile are read
// before anyone is judged, and the job finishes with every gradient.
TEST_F(MultiProcess, AStalledSchedulerEvictsNobodyWhenItResumes) {
  RoleJob job(dir_, 1, 3, {"--iters", "120", "--compute-ms", "10"});
  ASSERT_TRUE(job.workers[2]->WaitForOutput("joined", 20s)) << job.workers[2]->Output();
  std::this_thread::sleep_for(300ms);
  job.scheduler->Signal(SIGSTOP);
  std::this_thread::sleep_for(1600ms);  // 2 x the heartbeat timeout
  job.scheduler->Signal(SIGCONT);
  uint64_t total = 0;
  for (auto& w : job.workers) {
    EXPECT_EQ(w->Wait(60s), 0) << w->Output();
    total += Completed(w->Output(), false);
  }
  EXPECT_EQ(job.scheduler->Wait(30s), 0) << job.scheduler->Output();
  EXPECT_EQ(job.servers[0]->Wait(30s), 0) << job.servers[0]->Output();
  const std::string sched = job.scheduler->Output();
  EXPECT_EQ(total, 3u * 120u);
  EXPECT_EQ(sched.find("declared dead"), std::string::npos) << sched;
  EXPECT_EQ(sched.find("stopped answering"), std::string::npos) << sched;
  EXPECT_NE(sched.find("this process was stalled for"), std::string::npos) << sched;
  EXPECT_NE(sched.find("failed 0"), std::string::npos) << sched;
}

// A journaled job outlives its scheduler: SIGKILLed mid-job and started again with
// --resume JOURNAL, it replays its decisions, the servers and workers come back within the
// reconnect grace, rounds the servers missed are sent again, a commit whose answer was lost
// is answered as before, and the job ends with every gradient applied exactly once.
TEST_F(MultiProcess, ASchedulerKilledAndRestartedFromItsJournalLosesNothing) {
  const std::string journal = (dir_ / "journal").string();
  struct Case {
    std::string sync;
    std::optional<int> crash_after_round;  // else SIGKILLed at some moment
    int restarts = 1;                      // the restarted scheduler is killed again
    // With a budget of every worker's iterations, its last this many percent as bsp: the
    // switch comes before the crash, and the rounds replayed after it must close alike.
    uint32_t finish_percent = 0;
  };
  for (const Case& c : {Case{"bsp", std::nullopt}, Case{"dsync:2,1", std::nullopt},
                        Case{"bsp", 20}, Case{"dsync:2,1", 20}, Case{"bsp", std::nullopt, 2},
                        Case{"dsync:2,1", 20, 1, 90}}) {
    SCOPED_TRACE(c.sync + (c.crash_after_round ? " crashing after a round" : " killed") +
                 fmt::format(", restarted {} time(s), finishing {} % as bsp", c.restarts,
                             c.finish_percent));
    fs::remove(journal);
    fs::remove_all(dir_ / "dump");
    fs::create_directories(dir_ / "dump");
    std::map<std::string, std::string> env = {
        {"DSYNC_SYNC", c.sync},
        {"DSYNC_JOURNAL", journal},
        {"DSYNC_RECONNECT_GRACE", "20"},
        {"DSYNC_AUDIT_LOG", (dir_ / "audit.jsonl").string()},
        {"DSYNC_DUMP_MODEL", (dir_ / "dump").string()}};
    if (c.crash_after_round) {
      env["DSYNC_TEST_CRASH_AFTER_ROUND"] = std::to_string(*c.crash_after_round);
    }
    const uint64_t iters = 80 * c.restarts;
    if (c.finish_percent) {
      env["DSYNC_MAX_GRADIENTS"] = std::to_string(2 * iters);
      env["DSYNC_FINISH_BSP"] = std::to_string(c.finish_percent);
    }
    RoleJob job(dir_, 2, 2, {"--iters", std::to_string(iters), "--compute-ms", "5"}, env);
    ASSERT_TRUE(job.workers[1]->WaitForOutput("joined", 20s)) << job.workers[1]->Output();
    if (!c.crash_after_round) {
      std::this_thread::sleep_for(400ms);
      job.scheduler->Signal(SIGKILL);
    }
    EXPECT_NE(job.scheduler->Wait(20s), 0) << job.scheduler->Output();
    std::this_thread::sleep_for(500ms);  // the nodes notice, and wait
    auto env2 = job.env;
    env2.erase("DSYNC_TEST_CRASH_AFTER_ROUND");
    for (int k = 1; k < c.restarts; ++k) {  // killed again once every node is back
      Proc between({DSYNC_BINARY, "scheduler", "--resume", journal}, env2,
                   dir_ / fmt::format("scheduler-between{}.log", k));
      ASSERT_TRUE(between.WaitForOutput("every node of the job is back", 30s)) << between.Output();
      std::this_thread::sleep_for(200ms);
      between.Signal(SIGKILL);
      EXPECT_NE(between.Wait(10s), 0);
      std::this_thread::sleep_for(300ms);
    }
    Proc again({DSYNC_BINARY, "scheduler", "--resume", journal}, env2, dir_ / "scheduler2.log");
    uint64_t total = 0;
    for (auto& w : job.workers) {
      EXPECT_EQ(w->Wait(60s), 0) << w->Output();
      EXPECT_NE(w->Output().find("back with the restarted scheduler"), std::string::npos)
          << w->Output();
      total += Completed(w->Output(), false);
    }
    EXPECT_EQ(again.Wait(30s), 0) << again.Output();
    for (auto& s : job.servers) EXPECT_EQ(s->Wait(30s), 0) << s->Output();
    const std::string out = again.Output();
    EXPECT_NE(out.find("continuing the job of " + journal), std::string::npos) << out;
    EXPECT_NE(out.find("every node of the job is back"), std::string::npos) << out;
    if (c.crash_after_round) {
      // Round 20 was journaled and never sent: the servers get it (and what follows) now, and
      // the commits answered with it are answered again.
      EXPECT_EQ(out.find(" (0 round(s) sent again)"), std::string::npos) << out;
      EXPECT_NE(out.find("round(s) sent again"), std::string::npos) << out;
    }
    EXPECT_EQ(total, 2u * iters);
    ExpectModelCount(total, 2);
    const auto rounds = CheckAudit(c.sync == "bsp" ? 0 : 2);  // numbered 0, 1, ... once each
    EXPECT_FALSE(rounds.empty());
    if (c.finish_percent) {
      // The switch: 16 of 160 gradients in, before the crash after round 20.
      EXPECT_NE(job.scheduler->Output().find("committed; the last 90 % runs as bsp"),
                std::string::npos)
          << job.scheduler->Output();
      // Once the gradients granted under the bound have landed, every round holds both
      // workers' gradients of the version before it (the last may hold one of a worker that
      // left when it had made its last commit, and the other's).
      uint64_t gradients = 0, bsp_rounds = 0;
      for (const json& r : rounds) {
        if (gradients >= 40) {
          if (r["live"].get<uint32_t>() == 2) {
            ++bsp_rounds;
            EXPECT_EQ(r["members"].size(), 2u) << r.dump();
          }
          for (const json& m : r["members"]) {
            EXPECT_EQ(m[2].get<uint64_t>(), r["round"].get<uint64_t>()) << r.dump();
          }
        }
        gradients += r["members"].size();
      }
      EXPECT_GE(bsp_rounds, 55u);  // (160 - 40) / 2, less the job's end
    }
    // The journal says the job is over: a scheduler started on it again refuses.
    Proc late({DSYNC_BINARY, "scheduler", "--resume", journal}, env2, dir_ / "late.log");
    EXPECT_NE(late.Wait(20s), 0);
    EXPECT_NE(late.Output().find("is over (finished): there is nothing to resume"),
              std::string::npos)
        << late.Output();
    if (HasFailure()) break;
  }
}

// What answers at a lost scheduler's address is not taken for it unless it proves it holds
// the job's secrets: another job's scheduler there refuses the rejoins (a refusal proves
// nothing either), the nodes keep trying, and the job's restarted scheduler takes them back.
TEST_F(MultiProcess, ANodeTakesNoImpostorForItsRestartedScheduler) {
  const std::string journal = (dir_ / "journal").string();
  RoleJob job(dir_, 1, 2, {"--iters", "80", "--compute-ms", "5"},
              {{"DSYNC_JOURNAL", journal},
               {"DSYNC_RECONNECT_GRACE", "20"},
               {"DSYNC_DUMP_MODEL", (dir_ / "dump").string()}});
  ASSERT_TRUE(job.workers[1]->WaitForOutput("joined", 20s)) << job.workers[1]->Output();
  std::this_thread::sleep_for(300ms);
  job.scheduler->Signal(SIGKILL);
  EXPECT_NE(job.scheduler->Wait(10s), 0);
  auto other = job.env;  // the same address and token, another job (and journal)
  other["DSYNC_JOURNAL"] = (dir_ / "other.journal").string();
  {
    Proc impostor({DSYNC_BINARY, "scheduler"}, other, dir_ / "impostor.log");
    ASSERT_TRUE(impostor.WaitForOutput("cannot rejoin", 20s)) << impostor.Output();
    std::this_thread::sleep_for(500ms);
    impostor.Signal(SIGKILL);
    impostor.Wait(10s);
  }
  Proc again({DSYNC_BINARY, "scheduler", "--resume", journal}, job.env, dir_ / "again.log");
  uint64_t total = 0;
  for (auto& w : job.workers) {
    EXPECT_EQ(w->Wait(60s), 0) << w->Output();
    EXPECT_NE(w->Output().find("refused at the scheduler's address"), std::string::npos)
        << w->Output();
    total += Completed(w->Output(), false);
  }
  EXPECT_EQ(again.Wait(30s), 0) << again.Output();
  EXPECT_EQ(job.servers[0]->Wait(30s), 0) << job.servers[0]->Output();
  EXPECT_EQ(total, 160u);
  ExpectModelCount(total, 1);
}

// A scheduler that is not restarted within the reconnect grace: every server and worker
// stops by itself, naming the grace.
TEST_F(MultiProcess, ASchedulerRestartedTooLateStopsEveryNodeNamingTheGrace) {
  RoleJob job(dir_, 1, 2, {"--iters", "100000", "--compute-ms", "5"},
              {{"DSYNC_JOURNAL", (dir_ / "journal").string()}, {"DSYNC_RECONNECT_GRACE", "2"}});
  ASSERT_TRUE(job.workers[1]->WaitForOutput("joined", 20s)) << job.workers[1]->Output();
  std::this_thread::sleep_for(300ms);
  const auto killed = std::chrono::steady_clock::now();
  job.scheduler->Signal(SIGKILL);
  std::vector<Proc*> nodes = {job.servers[0].get(), job.workers[0].get(), job.workers[1].get()};
  for (Proc* p : nodes) {
    const int status = p->Wait(30s);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status << p->Output();
    // Each says so, or that a node which stopped waiting for it went (whichever came first).
    EXPECT_NE(p->Output().find("the reconnect grace of 2 s (--reconnect-grace)"),
              std::string::npos)
        << p->Output();
  }
  const auto took = std::chrono::steady_clock::now() - killed;
  EXPECT_GE(took, 2s);
  EXPECT_LT(took, 15s);
}

// A hung server (SIGSTOP) is detected within the heartbeat timeout: the job stops, saying
// which server stopped answering, instead of freezing silently.
TEST_F(MultiProcess, AHungServerStopsTheJobWithinTheHeartbeatTimeout) {
  RoleJob job(dir_, 2, 2, {"--iters", "100000", "--compute-ms", "5"});
  ASSERT_TRUE(job.workers[1]->WaitForOutput("joined", 20s)) << job.workers[1]->Output();
  std::this_thread::sleep_for(300ms);
  job.servers[1]->Signal(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  const int status = job.scheduler->Wait(10s);
  const auto took = std::chrono::steady_clock::now() - stopped;
  const std::string sched = job.scheduler->Output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << sched;
  EXPECT_LT(took, 800ms + 1s) << "detected within the timeout + 1 s";
  std::smatch m;
  EXPECT_TRUE(std::regex_search(
      sched, m, std::regex("server [12] stopped answering \\(no heartbeat for 800 ms\\)")))
      << sched;
  // The workers do not wait forever either: they lose the scheduler, or first the healthy
  // server that left when the scheduler did (two connections, two readers: either may tell
  // first), and say so.
  for (auto& w : job.workers) {
    const int ws = w->Wait(10s);
    EXPECT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) != 0) << ws << "\n" << w->Output();
    EXPECT_TRUE(std::regex_search(
        w->Output(), std::regex("lost the connection to (the scheduler|server [12])")))
        << w->Output();
  }
}

// Two copies of every slice over five servers: one server SIGKILLed while the workers push
// (some mid-push), another stopped (SIGSTOP) past the heartbeat timeout. The job goes on
// without them and ends cleanly; every copy left holds exactly the gradients the workers
// completed, and the copies of each slice are bit-identical.
TEST_F(MultiProcess, WithTwoCopiesAJobOutlivesAKilledAndAHungServerExactly) {
  const uint32_t iters = 1200;
  RoleJob job(dir_, 5, 3, {"--iters", std::to_string(iters), "--compute-ms", "5"},
              {{"DSYNC_REPLICAS", "2"},
               {"DSYNC_DUMP_MODEL", (dir_ / "dump").string()},
               {"DSYNC_AUDIT_LOG", (dir_ / "audit.jsonl").string()}});
  ASSERT_TRUE(job.workers[2]->WaitForOutput("joined", 20s)) << job.workers[2]->Output();
  // Ranks are given in the order servers register: find ids 1 and 3 (not adjacent, so every
  // slice keeps a copy).
  std::map<uint32_t, Proc*> by_id = job.ServersById();
  ASSERT_EQ(by_id.size(), 5u);
  std::this_thread::sleep_for(500ms);
  by_id[1]->Signal(SIGKILL);
  std::this_thread::sleep_for(500ms);
  by_id[3]->Signal(SIGSTOP);
  uint64_t total = 0;
  for (auto& w : job.workers) {
    EXPECT_EQ(w->Wait(120s), 0) << w->Output();
    total += Completed(w->Output(), false);
  }
  EXPECT_EQ(job.scheduler->Wait(30s), 0) << job.scheduler->Output();
  // The hung server, running again, reads that the job went on without it and stops (not
  // as a failure: nothing it held is missed), writing no model summary (its copies are stale).
  by_id[3]->Signal(SIGCONT);
  EXPECT_EQ(by_id[3]->Wait(30s), 0) << by_id[3]->Output();
  EXPECT_NE(by_id[3]->Output().find("declared this server lost"), std::string::npos)
      << by_id[3]->Output();
  for (uint32_t id : {2u, 4u, 5u}) EXPECT_EQ(by_id[id]->Wait(30s), 0) << by_id[id]->Output();
  const std::string sched = job.scheduler->Output();
  EXPECT_NE(sched.find("server 1 disconnected"), std::string::npos) << sched;
  EXPECT_NE(sched.find("server 3 stopped answering (no heartbeat for 800 ms); every slice it "
                       "held has another copy"),
            std::string::npos)
      << sched;
  EXPECT_NE(sched.find("servers lost 2"), std::string::npos) << sched;
  EXPECT_EQ(total, 3u * iters);
  ExpectModelCount(total, 3);
  EXPECT_GT(CopiesAlike(), 0u) << "some slices keep both copies (those on ranks 3 and 4)";
  const auto rounds = CheckAudit(0);
  EXPECT_EQ(rounds.size(), iters);
  for (const json& r : rounds) EXPECT_EQ(r["members"].size(), 3u) << r.dump();
}

// A lost server's copies exist again once a new `dsyncps server` takes its place: the job
// runs on throughout, the new server gets its rank's slices as copies from the others, and
// the proof that they are whole is that the job then outlives losing the server next to it
// (which held the only other copy of some slices), ending exact with equal copies.
TEST_F(MultiProcess, ANewServerTakesALostOnesPlaceAndTheJobOutlivesLosingItsNeighbour) {
  for (const std::string sync : {"bsp", "dsync:2,1"}) {
    SCOPED_TRACE(sync);
    fs::remove_all(dir_ / "dump");
    fs::create_directories(dir_ / "dump");
    fs::remove(dir_ / "audit.jsonl");
    const uint32_t iters = 1500;
    RoleJob job(dir_, 3, 3, {"--iters", std::to_string(iters), "--compute-ms", "5"},
                {{"DSYNC_REPLICAS", "2"},
                 {"DSYNC_SYNC", sync},
                 {"DSYNC_DUMP_MODEL", (dir_ / "dump").string()},
                 {"DSYNC_AUDIT_LOG", (dir_ / "audit.jsonl").string()}});
    ASSERT_TRUE(job.workers[2]->WaitForOutput("joined", 20s)) << job.workers[2]->Output();
    std::map<uint32_t, Proc*> by_id = job.ServersById();
    ASSERT_EQ(by_id.size(), 3u);
    std::this_thread::sleep_for(500ms);
    by_id[2]->Signal(SIGKILL);
    ASSERT_TRUE(job.scheduler->WaitForOutput("server 2 disconnected", 20s))
        << job.scheduler->Output();
    Proc fresh({DSYNC_BINARY, "server"}, job.env, dir_ / "server-new.log");
    ASSERT_TRUE(fresh.WaitForOutput("holds the copies of rank 1 at version", 60s))
        << fresh.Output() << job.scheduler->Output();
    std::this_thread::sleep_for(500ms);
    // Ranks 1 and 2 hold the only copies of the slices whose primary is rank 1.
    by_id[3]->Signal(SIGKILL);
    uint64_t total = 0;
    for (auto& w : job.workers) {
      EXPECT_EQ(w->Wait(120s), 0) << w->Output();
      EXPECT_NE(w->Output().find("took the place of the lost server of rank 1"),
                std::string::npos)
          << w->Output();
      total += Completed(w->Output(), false);
    }
    EXPECT_EQ(job.scheduler->Wait(30s), 0) << job.scheduler->Output();
    EXPECT_EQ(fresh.Wait(30s), 0) << fresh.Output();
    EXPECT_EQ(by_id[1]->Wait(30s), 0) << by_id[1]->Output();
    const std::string sched = job.scheduler->Output();
    EXPECT_NE(sched.find("server 2 holds the copies of rank 1 again"), std::string::npos) << sched;
    EXPECT_NE(sched.find("server 3 disconnected"), std::string::npos) << sched;
    EXPECT_EQ(total, 3u * iters);
    ExpectModelCount(total, 2);
    EXPECT_GT(CopiesAlike(), 0u) << "the slices whose primary is rank 0 keep both copies";
    const auto rounds = CheckAudit(sync == "bsp" ? 0 : 2);
    if (sync == "bsp") {
      EXPECT_EQ(rounds.size(), iters);
      for (const json& r : rounds) EXPECT_EQ(r["members"].size(), 3u) << r.dump();
    }
    if (HasFailure()) break;
  }
}

TEST_F(MultiProcess, ClearErrorsForBadSetups) {
  {
    Proc p({DSYNC_BINARY, "scheduler", "--sync", "dsync:x"}, {}, dir_ / "a.log");
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 2);
    EXPECT_NE(p.Output().find("expected bsp, dsync:K, dsync:K,Q, dsync:auto[:KMAX], ssp:K or asp"),
              std::string::npos)
        << p.Output();
  }
  {
    Proc p({DSYNC_BINARY, "worker", "--scheduler-port", "1", "--connect-timeout-ms", "300"},
           {{"DSYNC_TOKEN", "t"}}, dir_ / "b.log");
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 1);
    EXPECT_NE(p.Output().find("cannot reach 127.0.0.1:1"), std::string::npos) << p.Output();
  }
  {
    Proc p({DSYNC_BINARY, "server", "--transport", "rdma"}, {{"DSYNC_TOKEN", "t"}},
           dir_ / "c.log");
#if DSYNC_HAVE_RDMA
    // Built with RDMA, on a machine without a device (this one; the VM runs other tests).
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 1);
    EXPECT_NE(p.Output().find("no RDMA device found"), std::string::npos) << p.Output();
    EXPECT_NE(p.Output().find("scripts/setup-rxe.sh"), std::string::npos) << p.Output();
#else
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 2);
#endif
    EXPECT_NE(p.Output().find("use --transport tcp"), std::string::npos) << p.Output();
  }
  {
    Proc p({DSYNC_BINARY}, {}, dir_ / "d.log");
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 2);
    EXPECT_NE(p.Output().find("set DSYNC_ROLE"), std::string::npos) << p.Output();
  }
  {
    // A port that accepts but never answers: the worker gives up after --connect-timeout-ms
    // of silence, saying what it waited for.
    const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(listen(lfd, 4), 0);
    ASSERT_EQ(getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    const auto start = std::chrono::steady_clock::now();
    Proc p({DSYNC_BINARY, "worker", "--scheduler-port", std::to_string(ntohs(addr.sin_port)),
            "--connect-timeout-ms", "500"},
           {{"DSYNC_TOKEN", "t"}}, dir_ / "mute.log");
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 1);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
    EXPECT_NE(p.Output().find("accepted the connection but did not answer the hello within 500 ms"),
              std::string::npos)
        << p.Output();
    close(lfd);
  }
  {
    // Role mode without a token: refused, saying what to set; --insecure runs, warning once.
    Proc p({DSYNC_BINARY, "scheduler", "--scheduler-port", "0"}, {}, dir_ / "e.log");
    EXPECT_EQ(WEXITSTATUS(p.Wait(20s)), 2);
    EXPECT_NE(p.Output().find("no cluster token: set DSYNC_TOKEN"), std::string::npos)
        << p.Output();
    Proc q({DSYNC_BINARY, "worker", "--insecure", "--scheduler-port", "1",
            "--connect-timeout-ms", "100"},
           {}, dir_ / "f.log");
    EXPECT_EQ(WEXITSTATUS(q.Wait(20s)), 1);
    const std::string out = q.Output();
    const auto warned = out.find("running without a cluster token (--insecure)");
    EXPECT_NE(warned, std::string::npos) << out;
    EXPECT_EQ(out.find("running without a cluster token", warned + 1), std::string::npos)
        << "one warning: " << out;
  }
}

TEST_F(MultiProcess, OptionsThatCannotRunAreRefusedBeforeAnyProcessStarts) {
  struct Case {
    std::vector<std::string> args;
    std::map<std::string, std::string> env;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"local", "--iters", "0"}, {}, "--iters must be at least 1"},
      {{"local", "--model", "mlp", "--iters", "0"}, {}, "this job has none"},
      {{"local", "--batch", "0"}, {}, "--batch must be at least 1"},
      {{"local", "--compute-ms", "nan"}, {}, "--compute-ms nan is not a compute time"},
      {{"local", "--compute-ms", "-5"}, {}, "from 0 to 60000"},
      {{"local", "--slow", "-1"}, {}, "--slow -1 is not a factor on the compute time in (0, "},
      {{"local", "--port", "7000"}, {}, "dsyncps local does not take --port: every process"},
      {{"local", "--scheduler-port", "7000"}, {}, "does not take --scheduler-port"},
      {{"local", "--scheduler-uri", "10.0.0.1"}, {}, "does not take --scheduler-uri"},
      {{"local", "--num-workers", "3"}, {}, "--workers says how many"},
      {{"local", "--model", "bogus"}, {}, "model 'bogus' is not one of mlp, linreg, count"},
      {{"local", "--transport", "carrier-pigeon"}, {}, "not one of tcp, rdma, auto"},
      {{"local", "--lr", "inf"}, {}, "learning rate inf must be a finite number >= 0 (--lr"},
      {{"local", "--momentum", "nan"}, {}, "(--momentum, DSYNC_MOMENTUM)"},
      {{"local", "--weight-decay", "nan"}, {}, "(--weight-decay, DSYNC_WEIGHT_DECAY)"},
      {{"local", "--eps", "-1"}, {}, "adam epsilon -1 must be a finite number > 0"},
      {{"local"}, {{"DSYNC_LR", "1e999"}}, "DSYNC_LR: '1e999' does not fit a 32-bit float"},
      {{"train", "--lr", "inf"}, {}, "(--lr, DSYNC_LR)"},
      {{"train", "--compute-ms", "-5"}, {}, "--compute-ms -5 is not a compute time"},
      {{"worker", "--iters", "0"}, {}, "--iters must be at least 1"},
      {{"worker", "--slow", "nan"}, {}, "--slow nan is not a factor"},
      {{"scheduler", "--beta1", "1"}, {}, "adam beta1 1 must be in [0, 1) (--beta1, DSYNC_BETA1)"},
      {{}, {{"DSYNC_ROLE", ""}}, "DSYNC_ROLE is set but empty"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = cases[i];
    std::vector<std::string> argv = {DSYNC_BINARY};
    argv.insert(argv.end(), k.args.begin(), k.args.end());
    auto env = k.env;
    env.emplace("DSYNC_TOKEN", "t");  // role mode needs one; the refusal is about the rest
    Proc p(argv, env, dir_ / ("refused-" + std::to_string(i) + ".log"));
    const int status = p.Wait(20s);
    const std::string out = p.Output();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << k.expect << "\n" << out;
    EXPECT_NE(out.find(k.expect), std::string::npos) << out;
    EXPECT_EQ(out.find("[scheduler]"), std::string::npos) << out;
  }
}

TEST_F(MultiProcess, ASchedulerThatCannotStartIsReportedWithItsExitCode) {
  const std::string out = RunDsyncps(
      {"local", "--timeout", "60", "--audit-log", (dir_ / "missing" / "audit.jsonl").string()},
      /*expect_exit=*/1);
  EXPECT_NE(out.find("cannot write the audit log"), std::string::npos) << out;
  EXPECT_NE(out.find("the scheduler did not start (exit code 1)"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex("scheduler +exit code 1"))) << out;
  EXPECT_EQ(out.find("exit code 0"), std::string::npos) << out;
}

TEST_F(MultiProcess, AWorkerThatFailsBeforeJoiningStopsTheJobWithItsReason) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--worker-flags", "1=--nonsense"},
       "worker 1 failed before joining the job (exit code 2: The following argument was not "
       "expected: --nonsense); stopping the job"},
      // A joiner too: the job is running when it fails.
      {{"--join", "2=300", "--worker-flags", "2=--model bogus", "--compute-ms", "5"},
       "worker 2 failed before joining the job (exit code 2: invalid argument: model 'bogus' is "
       "not one of mlp, linreg, count); stopping the job"},
  };
  for (const Case& k : cases) {
    std::vector<std::string> args = {"--workers", "3", "--iters", "400"};
    args.insert(args.end(), k.args.begin(), k.args.end());
    const auto start = std::chrono::steady_clock::now();
    const std::string out = RunLocal(args, /*expect_exit=*/1);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 30s) << "not left to the timeout\n" << out;
    EXPECT_NE(out.find(k.expect), std::string::npos) << out;
    EXPECT_NE(out.find("job FAILED: worker"), std::string::npos) << out;
    // The others were stopped by the launcher, not killed during the job.
    EXPECT_EQ(out.find("killed during the job"), std::string::npos) << out;
    EXPECT_NE(out.find("the launcher stopped scheduler, server 0, server 1, worker 0"),
              std::string::npos)
        << out;
  }
}

TEST_F(MultiProcess, TrainStopsWhenItsWorkersCannotJoin) {
  // The test set is there (the launcher checks it), the training set is not: every worker
  // fails before it joins.
  const fs::path data = dir_ / "t10k-only";
  fs::create_directories(data);
  for (const char* f : {"t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    fs::copy_file(fs::path("/usr/share/datasets/fashion-mnist") / f, data / f);
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string out = RunDsyncps(
      {"train", "--workers", "2", "--servers", "1", "--data-dir", data.string()},
      /*expect_exit=*/1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "not the observer's connect timeout\n" << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex("worker \\d failed before joining the job \\(exit code 1: .*train-images")))
      << out;
}

TEST_F(MultiProcess, SigtermStopsTheSchedulerAndAServerCleanly) {
  // Several times: the signal used to race the process's exit (and OpenBLAS's threads, which
  // block nothing, could take it and die of it).
  auto expect_clean_stop = [](Proc& p) {
    p.Signal(SIGTERM);
    const int status = p.Wait(20s);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "status " << status << "\n" << p.Output();
    EXPECT_NE(p.Output().find("signal 15 received; stopping"), std::string::npos) << p.Output();
  };
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const std::string n = std::to_string(round);
    Proc sched({DSYNC_BINARY, "scheduler", "--scheduler-port", "0", "--num-servers", "1"},
               {{"DSYNC_TOKEN", "t"}}, dir_ / ("scheduler-" + n + ".log"));
    ASSERT_TRUE(sched.WaitForOutput("scheduler listening on", 20s)) << sched.Output();
    std::smatch m;
    const std::string sched_out = sched.Output();
    ASSERT_TRUE(std::regex_search(sched_out, m, std::regex("listening on 127.0.0.1:(\\d+)")));
    Proc server({DSYNC_BINARY, "server", "--scheduler-port", m[1].str()},
                {{"DSYNC_TOKEN", "t"}}, dir_ / ("server-" + n + ".log"));
    ASSERT_TRUE(server.WaitForOutput("listening on", 20s)) << server.Output();
    expect_clean_stop(server);
    sched.Wait(20s);  // it ends the job: its server is gone
    Proc alone({DSYNC_BINARY, "scheduler", "--scheduler-port", "0"}, {{"DSYNC_TOKEN", "t"}},
               dir_ / ("alone-" + n + ".log"));
    ASSERT_TRUE(alone.WaitForOutput("scheduler listening on", 20s)) << alone.Output();
    expect_clean_stop(alone);
  }
}

TEST_F(MultiProcess, AJobThatCannotFormEndsWithWhatItWaitedFor) {
  // Two servers expected, one started: nothing may wait forever. The scheduler gives up once
  // no node arrived for the start timeout, and the worker it held hears why.
  const std::string port = std::to_string(dsync::testing::FreeLoopbackPort());
  const std::map<std::string, std::string> env = {{"DSYNC_TOKEN", "t"},
                                                  {"DSYNC_SCHEDULER_PORT", port}};
  const auto start = std::chrono::steady_clock::now();
  Proc sched({DSYNC_BINARY, "scheduler", "--num-servers", "2", "--num-workers", "1",
              "--start-timeout-ms", "1500"},
             env, dir_ / "scheduler.log");
  ASSERT_TRUE(sched.WaitForOutput("scheduler listening on", 20s)) << sched.Output();
  Proc server({DSYNC_BINARY, "server"}, env, dir_ / "server.log");
  Proc worker({DSYNC_BINARY, "worker", "--model", "count", "--iters", "5"}, env,
              dir_ / "worker.log");
  const int status = sched.Wait(60s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status << sched.Output();
  const std::string why = "waiting for 1 more server(s) to register (1 of 2)";
  EXPECT_NE(sched.Output().find("the job did not start: " + why), std::string::npos)
      << sched.Output();
  EXPECT_NE(sched.Output().find("no node arrived for 1500 ms"), std::string::npos)
      << sched.Output();
  const int wstatus = worker.Wait(30s);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) != 0) << wstatus << worker.Output();
  EXPECT_NE(worker.Output().find(why), std::string::npos) << worker.Output();
  const int sstatus = server.Wait(30s);
  EXPECT_TRUE(WIFEXITED(sstatus) && WEXITSTATUS(sstatus) != 0) << sstatus << server.Output();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 45s);
}

// --- The main job: dsyncps train / compare ---------------------------------------------

TEST_F(MultiProcess, TrainRunsTheMainJobThroughJoinLeaveKillAndLatency) {
  const fs::path out_dir = dir_ / "train";
  const std::string out = RunDsyncps(
      {"train", "--workers", "4", "--servers", "2", "--epochs", "1.5", "--compute-ms", "2",
       "--eval-interval", "0.3", "--join", "3=60", "--leave", "2=150", "--kill", "1=200",
       "--latency", "0=3", "--out", out_dir.string()});
  EXPECT_NE(out.find("starting worker 3 at round"), std::string::npos) << out;
  EXPECT_NE(out.find("leaving at round"), std::string::npos) << out;
  EXPECT_NE(out.find("worker 1 was killed"), std::string::npos) << out;
  EXPECT_NE(out.find("test acc"), std::string::npos) << "progress lines\n" << out;
  const json summary = json::parse(std::ifstream(out_dir / "summary.json"));
  EXPECT_TRUE(summary["ok"].get<bool>()) << out;
  EXPECT_EQ(summary["scenario"].get<std::string>(),
            "worker 3 joins at round 60; worker 2 leaves at round 150; worker 1 killed at round "
            "200; worker 0 +3 ms link latency");
  // The budget (1.5 epochs of 64-sample minibatches: 1407 gradients) was trained, by whoever
  // was there. The count sums the workers' reports, every 10 iterations and when a worker
  // stops: the killed worker's last (up to 9) iterations go uncounted.
  EXPECT_GE(summary["gradients"].get<uint64_t>(), 1407u - 9u);
  EXPECT_GE(summary["final_accuracy"].get<double>(), 0.70) << out;
  const auto& curve = summary["curve"];
  ASSERT_GE(curve.size(), 3u);
  for (size_t i = 1; i < curve.size(); ++i) {
    EXPECT_GE(curve[i]["seconds"].get<double>(), curve[i - 1]["seconds"].get<double>());
    EXPECT_GE(curve[i]["round"].get<uint64_t>(), curve[i - 1]["round"].get<uint64_t>());
  }
  EXPECT_EQ(curve.back()["round"].get<uint64_t>(), summary["final_version"].get<uint64_t>());
  std::ifstream csv(out_dir / "metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "seconds,round,gradients,accuracy,test_loss,train_loss");
  EXPECT_NE(out.find("@train {"), std::string::npos);
}

TEST_F(MultiProcess, CompareWritesTheTableAndThePlots) {
  const fs::path out_dir = dir_ / "compare";
  const std::string out = RunDsyncps({"compare", "--modes", "bsp,dsync:2,1", "--workers", "2",
                                      "--servers", "1", "--epochs", "0.4", "--eval-interval",
                                      "0.3", "--straggler", "1=2", "--out", out_dir.string()});
  EXPECT_NE(out.find("reach_s"), std::string::npos) << out;
  EXPECT_NE(out.find("@compare {"), std::string::npos) << out;
  std::ifstream csv(out_dir / "compare.csv");
  std::vector<std::string> lines;
  for (std::string line; std::getline(csv, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_TRUE(lines[1].starts_with("bsp,1,")) << lines[1];
  EXPECT_TRUE(lines[2].starts_with("\"dsync:2,1\",1,")) << lines[2];
  for (const char* f : {"bsp.csv", "dsync_2_1.csv", "plot.gp", "accuracy_time.svg",
                        "accuracy_rounds.svg"}) {
    EXPECT_TRUE(fs::exists(out_dir / f)) << f << " (gnuplot-nox installed?)\n" << out;
  }
  std::ifstream svg(out_dir / "accuracy_time.svg");
  std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("dsync:2,1"), std::string::npos) << "one line per mode, labelled";
}

TEST_F(MultiProcess, AServerThatCannotStartStopsTheJobWithItsReason) {
#if DSYNC_HAVE_CUDA
  if (dsync::cuda::DeviceAvailable()) GTEST_SKIP() << "a GPU is visible: --store cuda runs here";
#endif
  const auto start = std::chrono::steady_clock::now();
  const std::string out = RunDsyncps(
      {"train", "--store", "cuda", "--workers", "1", "--servers", "1", "--epochs", "0.1"},
      /*expect_exit=*/1);
  EXPECT_NE(out.find("use --store cpu"), std::string::npos) << out;
  EXPECT_NE(out.find("server 0 ended (exit code 1) while the job runs; stopping the job"),
            std::string::npos)
      << out;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s) << "not left to the job's timeout";
}

TEST_F(MultiProcess, TrainWithoutTheDatasetNamesThePackageAndStartsNothing) {
  const std::string out =
      RunDsyncps({"train", "--data-dir", (dir_ / "nowhere").string()}, /*expect_exit=*/1);
  EXPECT_NE(out.find("apt-get install dataset-fashion-mnist"), std::string::npos) << out;
  EXPECT_EQ(out.find("[scheduler]"), std::string::npos) << out;
  const std::string bad = RunDsyncps({"train", "--straggler", "7=3"}, /*expect_exit=*/2);
  EXPECT_NE(bad.find("--straggler '7=3' is not WORKER=FACTOR with WORKER < 4"), std::string::npos)
      << bad;
}

}  // namespace

