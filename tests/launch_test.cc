// `dsyncps launch` and `dsyncps join`: the user's own program (examples/cpp/linear_worker)
// as the job's workers, on one machine, as a joiner, and by rank under mpirun (emulated by
// the rank variables, then the real mpirun when Open MPI is installed).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "proc.h"

namespace {

namespace fs = std::filesystem;
using dsync::testing::Proc;
using namespace std::chrono_literals;

class Launch : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = dsync::testing::FreshTestDir("dsync-launch"); }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Runs `dsyncps ARGS`; returns its output after checking its exit code.
  std::string Run(std::vector<std::string> args, int expect_exit,
                  const std::map<std::string, std::string>& env = {}) {
    args.insert(args.begin(), DSYNC_BINARY);
    Proc p(args, env, dir_ / ("run-" + std::to_string(runs_++) + ".log"));
    const int status = p.Wait(120s);
    const std::string out = p.Output();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == expect_exit)
        << "status " << status << "\n" << out;
    return out;
  }

  // Every "linear_worker rank R (worker ID): loss A -> B" line: rank -> {A, B}.
  static std::map<int, std::pair<double, double>> Losses(const std::string& out) {
    std::map<int, std::pair<double, double>> found;
    const std::regex re(R"(linear_worker rank (\d+) \(worker \d+\): loss (\S+) -> (\S+) after)");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
         ++it) {
      found[std::stoi((*it)[1])] = {std::stod((*it)[2]), std::stod((*it)[3])};
    }
    return found;
  }

  // A job of three worker ranks that ran to its end: each rank printed its losses, and all
  // `gradients` reached the model with every worker gone cleanly.
  static void ExpectThreeRanksTrained(const std::string& out, int gradients) {
    EXPECT_EQ(Losses(out).size(), 3u) << out;
    EXPECT_NE(out.find(std::to_string(gradients) +
                       " gradient(s), workers joined 3, left 3, failed 0"),
              std::string::npos)
        << out;
  }

  fs::path dir_;
  int runs_ = 0;
};

TEST_F(Launch, RunsTheUsersProgramAsTheJobsWorkers) {
  const std::string out =
      Run({"launch", "--workers", "3", "--servers", "2", "--sync", "dsync:2", "--audit-log",
           (dir_ / "audit.jsonl").string(), "--", DSYNC_EXAMPLE_WORKER, "150"},
          0);
  const auto losses = Losses(out);
  ASSERT_EQ(losses.size(), 3u) << out;  // ranks 0, 1, 2: DSYNC_WORKER_RANK
  for (const auto& [rank, loss] : losses) {
    EXPECT_LT(loss.second, loss.first / 50) << "rank " << rank << " did not learn\n" << out;
  }
  // Every gradient of every worker reached the model, and the job ended by itself.
  EXPECT_NE(out.find("450 gradient(s), workers joined 3, left 3, failed 0"), std::string::npos)
      << out;
  EXPECT_NE(out.find("dsyncps launch: job finished"), std::string::npos) << out;
  std::ifstream audit(dir_ / "audit.jsonl");
  EXPECT_TRUE(audit.good()) << "the job's flags reach the scheduler";
  // The program's name without `--` works too.
  const std::string plain = Run({"launch", "--workers", "1", DSYNC_EXAMPLE_WORKER, "5"}, 0);
  EXPECT_EQ(Losses(plain).size(), 1u) << plain;
}

TEST_F(Launch, TheJobsExitCodeIsTheWorkers) {
  // A program that ends before joining: nothing can start; its code is the job's, at once.
  const auto start = std::chrono::steady_clock::now();
  const std::string early = Run({"launch", "--workers", "2", "--", "sh", "-c", "exit 3"}, 3);
  EXPECT_TRUE(std::regex_search(
      early, std::regex(R"(worker [01] failed before joining the job \(exit code 3\))")))
      << early;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s) << "not left to a timeout";
  // One that fails after it trained: the job goes on without it, and says so in the code.
  const std::string late =
      Run({"launch", "--workers", "2", "--", "sh", "-c",
           std::string(DSYNC_EXAMPLE_WORKER) + " 20 && exit 4"},
          4);
  EXPECT_EQ(Losses(late).size(), 2u) << late;
  EXPECT_NE(late.find("exit code 4"), std::string::npos) << late;
  // A program that is not there: said before anything starts.
  const std::string missing = Run({"launch", "--", "no-such-trainer", "--lr", "3"}, 2);
  EXPECT_NE(missing.find("the worker program 'no-such-trainer' is not in PATH"),
            std::string::npos)
      << missing;
  EXPECT_EQ(missing.find("[scheduler]"), std::string::npos) << missing;
  // From the program's name on everything is the program's, a `--` of its own included.
  Run({"launch", "--workers", "1", "sh", "-c",
       std::string("[ \"$1\" = -- ] && [ \"$2\" = x ] && exec ") + DSYNC_EXAMPLE_WORKER + " 3",
       "sh", "--", "x"},
      0);
  // A program after -- for a command that runs none is refused, not dropped.
  const std::string stray = Run({"worker", "--token", "launch", "--", "x"}, 2);
  EXPECT_NE(stray.find("arguments after -- are a program for launch or join"), std::string::npos)
      << stray;
}

// The worker program inherits its output (0-2) and the ready pipe (3), nothing of the
// launcher's own: a launcher's signal pipe held by a worker let a worker that was signalled
// before it ran its program stop the launcher as if the launcher had been signalled.
TEST_F(Launch, TheUsersProgramInheritsNoneOfTheLaunchersDescriptors) {
  // ls, a child of the shell, lists the shell's descriptors (those the launcher gave it), one
  // per line of the worker's output. (Not redirected: dash keeps a copy of a descriptor it
  // redirects.)
  const std::string out = Run(
      {"launch", "--workers", "1", "--", "sh", "-c", "ls /proc/$$/fd; exec " DSYNC_EXAMPLE_WORKER " 3"},
      0);
  std::vector<int> fds;
  const std::regex line(R"(\[worker 0\] (\d+)\n)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
       ++it) {
    fds.push_back(std::stoi((*it)[1]));
  }
  std::sort(fds.begin(), fds.end());
  EXPECT_EQ(fds, (std::vector<int>{0, 1, 2, 3})) << out;
  EXPECT_EQ(Losses(out).size(), 1u) << out;
}

TEST_F(Launch, JoinAddsTheUsersProgramToARunningJob) {
  const std::map<std::string, std::string> env = {{"DSYNC_TOKEN", "join-token"}};
  Proc job({DSYNC_BINARY, "launch", "--workers", "2", "--servers", "2", "--sync", "dsync:2", "--",
            DSYNC_EXAMPLE_WORKER, "200", "15"},
           env, dir_ / "launch.log");
  ASSERT_TRUE(job.WaitForOutput("joined (sync", 60s)) << job.Output();
  std::smatch m;
  const std::string head = job.Output();
  ASSERT_TRUE(std::regex_search(head, m, std::regex(R"(scheduler on 127\.0\.0\.1:(\d+))")));
  const std::string joiner =
      Run({"join", "--scheduler-port", m[1].str(), "--", DSYNC_EXAMPLE_WORKER, "30"}, 0, env);
  EXPECT_EQ(Losses(joiner).size(), 1u) << joiner;
  EXPECT_EQ(job.Wait(120s), 0) << job.Output();
  EXPECT_NE(job.Output().find("workers joined 3, left 3, failed 0"), std::string::npos)
      << job.Output();
  // A joiner without the token is refused by the launcher's checks, naming it.
  const std::string refused =
      Run({"join", "--", DSYNC_EXAMPLE_WORKER, "1"}, 2, {{"DSYNC_TOKEN", ""}});
  EXPECT_NE(refused.find("no cluster token"), std::string::npos) << refused;
  // Under Slurm the joiner's own step would give another scheduler address: it must be told.
  const std::string slurm = Run({"join", "--", DSYNC_EXAMPLE_WORKER, "1"}, 2,
                                {{"SLURM_JOB_NODELIST", "node[1-2]"}, {"SLURM_JOB_ID", "7"},
                                 {"SLURM_STEP_ID", "3"}, {"SLURM_PROCID", "0"},
                                 {"SLURM_NTASKS", "1"}, {"DSYNC_TOKEN", "t"}});
  EXPECT_NE(slurm.find("under Slurm a joiner cannot derive the running job's scheduler"),
            std::string::npos)
      << slurm;
}

// What mpirun gives every task: its rank and the task count; a shared rendezvous file.
std::map<std::string, std::string> RankEnv(const fs::path& rendezvous, int rank, int size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"DSYNC_RENDEZVOUS", rendezvous.string()},
          {"DSYNC_TOKEN", "rank-token"}};
}

TEST_F(Launch, ByRankTheFirstTasksRunTheRolesAndTheRestTheProgram) {
  constexpr int kTasks = 5;  // scheduler, 2 servers, 2 workers
  std::vector<std::unique_ptr<Proc>> tasks;
  for (int r = 0; r < kTasks; ++r) {
    tasks.push_back(std::make_unique<Proc>(
        std::vector<std::string>{DSYNC_BINARY, "launch", "--servers", "2", "--sync", "dsync:1",
                                 "--", DSYNC_EXAMPLE_WORKER, "40"},
        RankEnv(dir_ / "scheduler.addr", r, kTasks), dir_ / ("task-" + std::to_string(r) + ".log")));
  }
  std::string workers;
  for (int r = 0; r < kTasks; ++r) {
    EXPECT_EQ(tasks[r]->Wait(120s), 0) << "task " << r << "\n" << tasks[r]->Output();
    if (r >= 3) workers += tasks[r]->Output();
  }
  const auto losses = Losses(workers);
  EXPECT_EQ(losses.size(), 2u) << workers;  // ranks 3 and 4 are workers 0 and 1
  EXPECT_NE(tasks[0]->Output().find("80 gradient(s), workers joined 2"), std::string::npos)
      << tasks[0]->Output();
  EXPECT_FALSE(fs::exists(dir_ / "scheduler.addr")) << "the scheduler removes its file";
  // --workers that the ranks contradict is refused, with what to do.
  const std::string bad = Run({"launch", "--servers", "2", "--workers", "7", "--",
                               DSYNC_EXAMPLE_WORKER},
                              2, RankEnv(dir_ / "other.addr", 4, kTasks));
  EXPECT_NE(bad.find("--workers 7 disagrees with the 5 task(s) launched"), std::string::npos)
      << bad;
}

// PATH with this build's dsyncps first: the examples call it by name.
std::string PathWithDsyncps() {
  const char* path = std::getenv("PATH");
  return fs::path(DSYNC_BINARY).parent_path().string() + ":" + (path ? path : "/usr/bin:/bin");
}

TEST_F(Launch, TheMpiExampleStartsTheWholeJob) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "mpirun is not installed (scripts/deps.sh installs openmpi-bin)";
  }
  // Root may run mpirun only when it says so (CI runs as root).
  const std::map<std::string, std::string> env = {{"PATH", PathWithDsyncps()},
                                                  {"RENDEZVOUS", (dir_ / "sched").string()},
                                                  {"SERVERS", "2"},
                                                  {"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                                  {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  Proc mpi({DSYNC_SOURCE_DIR "/examples/mpi/run.sh", "--oversubscribe", "-np", "6", "--",
            DSYNC_EXAMPLE_WORKER, "60"},
           env, dir_ / "mpirun.log");
  const int status = mpi.Wait(120s);
  const std::string out = mpi.Output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << out;
  ExpectThreeRanksTrained(out, 180);
  // The example listens on every address (ranks may be on several hosts); the file names the
  // scheduler's NIC address, and the servers tell the address that routes to it.
  EXPECT_NE(out.find("scheduler listening on 0.0.0.0:"), std::string::npos) << out;
  EXPECT_NE(out.find("to the rendezvous file"), std::string::npos) << out;
  EXPECT_EQ(out.find("registered at 0.0.0.0"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir_ / "sched"));
}

// A Slurm cluster of one node (scripts/slurm-local.sh), started once for the suite.
class SlurmLaunch : public Launch {
 protected:
  static void SetUpTestSuite() {
    if (getuid() != 0 || std::system("command -v slurmctld >/dev/null 2>&1") != 0) {
      skip_ = "needs root and slurm-wlm + munge (scripts/deps.sh installs them)";
      return;
    }
    cluster_ = fs::temp_directory_path() / ("dsync-slurm-" + std::to_string(getpid()));
    const std::string start = std::string(DSYNC_SOURCE_DIR "/scripts/slurm-local.sh start ") +
                              cluster_.string() + " >" + (cluster_.string() + ".log") + " 2>&1";
    if (std::system(start.c_str()) != 0) {
      std::ifstream log(cluster_.string() + ".log");
      failed_ = std::string((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    }
  }
  static void TearDownTestSuite() {
    if (cluster_.empty()) return;
    const std::string stop =
        std::string(DSYNC_SOURCE_DIR "/scripts/slurm-local.sh stop ") + cluster_.string();
    (void)std::system(stop.c_str());
    fs::remove_all(cluster_);
    fs::remove(cluster_.string() + ".log");
  }
  void SetUp() override {
    Launch::SetUp();
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    ASSERT_TRUE(failed_.empty()) << "the Slurm cluster did not start:\n" << failed_;
  }
  std::map<std::string, std::string> Env() const {
    return {{"SLURM_CONF", (cluster_ / "slurm.conf").string()},
            {"PATH", PathWithDsyncps()},
            {"DSYNC_TOKEN", "slurm-token"}};
  }
  static inline fs::path cluster_;
  static inline std::string skip_, failed_;
};

TEST_F(SlurmLaunch, SrunRunsTheJobAndEveryTaskFindsTheSchedulerFromTheNodeList) {
  Proc srun({"/usr/bin/env", "srun", "-n", "6", "--overcommit", "--kill-on-bad-exit=1",
             DSYNC_BINARY, "launch", "--servers", "2", "--sync", "dsync:1", "--",
             DSYNC_EXAMPLE_WORKER, "60"},
            Env(), dir_ / "srun.log");
  const int status = srun.Wait(120s);
  const std::string out = srun.Output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << out;
  ExpectThreeRanksTrained(out, 180);
  // No address was given: the port comes from the job and step ids (10000 .. 29999).
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(scheduler listening on 127\.0\.0\.1:(\d+))")))
      << out;
  EXPECT_GE(std::stoi(m[1]), 10000);
  EXPECT_LT(std::stoi(m[1]), 30000);
}

TEST_F(SlurmLaunch, TheSbatchExampleCompletes) {
  const fs::path output = dir_ / "job.out";
  auto env = Env();
  env["WORKER_CMD"] = std::string(DSYNC_EXAMPLE_WORKER) + " 40";
  // The example asks for 2 nodes of 4 tasks; this cluster has one node: 6 tasks on it.
  Proc sbatch({"/usr/bin/env", "sbatch", "--wait", "-N", "1", "-n", "6",
               "--ntasks-per-node", "6", "--overcommit",
               "--output", output.string(), DSYNC_SOURCE_DIR "/examples/slurm/train.sbatch"},
              env, dir_ / "sbatch.log");
  const int status = sbatch.Wait(150s);
  std::ifstream in(output);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << status << "\n" << sbatch.Output() << "\n" << out;
  ExpectThreeRanksTrained(out, 120);
}

}  // namespace
