// Jobs across hosts. Which address a node listens on and advertises (NIC names, wildcards,
// --advertise), then real separate hosts on one machine: every node in a network namespace
// of its own, joined by a bridge in a namespace of its own, nothing on 127.0.0.1. The
// namespace cases need root and iproute2; without them they skip, saying so.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "proc.h"
#include "ps/net_address.h"

namespace {

namespace fs = std::filesystem;
using dsync::testing::Proc;
using namespace std::chrono_literals;
using dsync::ps::AdvertisedHost;
using dsync::ps::IsWildcardHost;
using dsync::ps::ResolveListenHost;

TEST(ListenHost, ANicNameBecomesItsAddressAndAddressesStay) {
  EXPECT_EQ(*ResolveListenHost("lo"), "127.0.0.1");
  EXPECT_EQ(*ResolveListenHost("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(*ResolveListenHost("0.0.0.0"), "0.0.0.0");
  EXPECT_EQ(*ResolveListenHost("::1"), "::1");
  EXPECT_EQ(*ResolveListenHost("[::1]"), "::1");
  EXPECT_EQ(*ResolveListenHost("localhost"), "localhost");  // a host name resolves
  EXPECT_EQ(*ResolveListenHost(""), "");
}

TEST(ListenHost, AnUnknownNameListsTheNicsPresent) {
  auto r = ResolveListenHost("nosuchnic9");
  ASSERT_FALSE(r.ok());
  const std::string msg = r.status().ToString();
  EXPECT_NE(msg.find("interface 'nosuchnic9' is neither a NIC of this host"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("NICs here: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("lo 127.0.0.1"), std::string::npos) << msg;
  // A worker listens nowhere, yet it says so too rather than ignoring the name.
  const auto log = std::filesystem::temp_directory_path() /
                   ("dsync-worker-nic-" + std::to_string(getpid()) + ".log");
  Proc worker({DSYNC_BINARY, "worker", "--insecure", "--interface", "nosuchnic9"}, {}, log);
  const int status = worker.Wait(30s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << worker.Output();
  EXPECT_NE(worker.Output().find("--interface of this worker: interface 'nosuchnic9'"),
            std::string::npos)
      << worker.Output();
  std::filesystem::remove(log);
}

TEST(ListenHost, WildcardsAreKnown) {
  for (const char* w : {"", "0.0.0.0", "::", "[::]"}) EXPECT_TRUE(IsWildcardHost(w)) << w;
  for (const char* h : {"127.0.0.1", "::1", "eth0", "10.0.0.1"}) {
    EXPECT_FALSE(IsWildcardHost(h)) << h;
  }
}

TEST(AdvertisedHost, ExplicitThenListenAddressThenTheRouteToTheScheduler) {
  EXPECT_EQ(*AdvertisedHost("0.0.0.0", "10.9.8.7", "127.0.0.1", 9091), "10.9.8.7");
  EXPECT_EQ(*AdvertisedHost("0.0.0.0", "[fd00::7]", "127.0.0.1", 9091), "fd00::7");
  EXPECT_EQ(*AdvertisedHost("127.0.0.1", "", "127.0.0.1", 9091), "127.0.0.1");
  // Bound to every address: the one that routes to the scheduler.
  EXPECT_EQ(*AdvertisedHost("0.0.0.0", "", "127.0.0.1", 9091), "127.0.0.1");
  EXPECT_EQ(*AdvertisedHost("::", "", "::1", 9091), "::1");
}

TEST(AdvertisedHost, AWildcardOrUnroutableAddressSaysWhatToSet) {
  auto wild = AdvertisedHost("0.0.0.0", "0.0.0.0", "127.0.0.1", 9091);
  ASSERT_FALSE(wild.ok());
  EXPECT_NE(wild.status().ToString().find("--advertise 0.0.0.0 is a wildcard"),
            std::string::npos)
      << wild.status().ToString();
  // 192.0.2.0/24 is TEST-NET-1; with no route at all the kernel says so at connect. Where a
  // default route exists it is "routed", so only the message of a real failure is checked.
  auto none = AdvertisedHost("0.0.0.0", "", "no-such-host.invalid", 9091);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().ToString().find("set --advertise (DSYNC_ADVERTISE)"), std::string::npos)
      << none.status().ToString();
}

TEST(LocalJob, TakesANicNameAndRefusesAnUnknownOneBeforeStartingAnything) {
  const fs::path dir = fs::temp_directory_path() / ("dsync-hosts-local-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::vector<std::string> job = {"--servers", "1", "--workers", "2", "--model", "count",
                                        "--optimizer", "sum", "--iters", "5", "--timeout", "60"};
  auto args = std::vector<std::string>{DSYNC_BINARY, "local", "--interface", "lo"};
  args.insert(args.end(), job.begin(), job.end());
  Proc ok(args, {}, dir / "ok.log");
  EXPECT_EQ(ok.Wait(90s), 0) << ok.Output();
  EXPECT_NE(ok.Output().find("scheduler on 127.0.0.1:"), std::string::npos) << ok.Output();
  args = {DSYNC_BINARY, "local", "--interface", "nosuchnic9"};
  args.insert(args.end(), job.begin(), job.end());
  Proc bad(args, {}, dir / "bad.log");
  const int status = bad.Wait(30s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << bad.Output();
  EXPECT_NE(bad.Output().find("interface 'nosuchnic9' is neither a NIC"), std::string::npos)
      << bad.Output();
  EXPECT_EQ(bad.Output().find("server 0"), std::string::npos) << "nothing started\n"
                                                              << bad.Output();
  fs::remove_all(dir);
}

TEST(Rendezvous, AFileThatNeverAppearsOrIsNotOursIsNamed) {
  const fs::path dir = fs::temp_directory_path() / ("dsync-rdv-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string missing = (dir / "never").string();
  Proc w({DSYNC_BINARY, "worker", "--rendezvous", missing, "--connect-timeout-ms", "600"},
         {{"DSYNC_TOKEN", "t"}}, dir / "w.log");
  int status = w.Wait(30s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << w.Output();
  EXPECT_NE(w.Output().find("the rendezvous file " + missing + " did not appear within 600 ms"),
            std::string::npos)
      << w.Output();
  const fs::path other = dir / "other";
  std::ofstream(other) << "hello world\n";
  Proc s({DSYNC_BINARY, "server", "--rendezvous", other.string()}, {{"DSYNC_TOKEN", "t"}},
         dir / "s.log");
  status = s.Wait(30s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << s.Output();
  EXPECT_NE(s.Output().find("does not hold a scheduler's address"), std::string::npos)
      << s.Output();
  fs::remove_all(dir);
}

// --- separate hosts ---------------------------------------------------------------------

constexpr const char* kIp = "/usr/sbin/ip";

// Runs a command, returns its exit status (-1 if it could not run) and its output.
int Run(const std::string& cmd, std::string* out = nullptr) {
  std::string text;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) text += buf;
  const int status = pclose(p);
  if (out) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// N hosts, each a namespace with one NIC "dsync0" at 10.77.S.(i+1)/24 on a bridge that lives
// in a namespace of its own: the test machine's own network is not touched.
class Hosts {
 public:
  explicit Hosts(int n) : tag_(std::to_string(getpid() % 100000)), subnet_(getpid() % 250) {
    std::string out;
    if (geteuid() != 0) {
      why_not_ = "needs root (network namespaces)";
      return;
    }
    if (access(kIp, X_OK) != 0) {
      why_not_ = "needs iproute2 (/usr/sbin/ip)";
      return;
    }
    const std::string sw = Switch();
    if (Run(fmt::format("{} netns add {}", kIp, sw), &out) != 0) {
      why_not_ = "cannot create a network namespace: " + out;
      return;
    }
    std::vector<std::string> cmds = {
        fmt::format("{} -n {} link add br0 type bridge", kIp, sw),
        fmt::format("{} -n {} link set br0 up", kIp, sw)};
    for (int i = 0; i < n; ++i) {
      const std::string h = Host(i);
      names_.push_back(h);
      cmds.push_back(fmt::format("{} netns add {}", kIp, h));
      cmds.push_back(fmt::format("{} -n {} link set lo up", kIp, h));
      cmds.push_back(fmt::format("{} -n {} link add dsync0 type veth peer name p{} netns {}", kIp, h, i, sw));
      cmds.push_back(fmt::format("{} -n {} link set p{} master br0 up", kIp, sw, i));
      cmds.push_back(fmt::format("{} -n {} addr add {}/24 dev dsync0", kIp, h, Address(i)));
      cmds.push_back(fmt::format("{} -n {} link set dsync0 up", kIp, h));
    }
    for (const std::string& c : cmds) {
      if (Run(c, &out) != 0) {
        why_not_ = "'" + c + "' failed: " + out;
        return;
      }
    }
  }
  ~Hosts() {
    for (const std::string& h : names_) Run(fmt::format("{} netns del {}", kIp, h));
    Run(fmt::format("{} netns del {}", kIp, Switch()));
  }

  const std::string& why_not() const { return why_not_; }
  std::string Host(int i) const { return fmt::format("dsh{}-{}", tag_, i); }
  std::string Address(int i) const { return fmt::format("10.77.{}.{}", subnet_, i + 1); }
  // argv that runs `args` on host i.
  std::vector<std::string> On(int i, std::vector<std::string> args) const {
    args.insert(args.begin(), {kIp, "netns", "exec", Host(i)});
    return args;
  }
  int Exec(int i, const std::string& cmd, std::string* out = nullptr) const {
    return Run(fmt::format("{} netns exec {} {}", kIp, Host(i), cmd), out);
  }

 private:
  std::string Switch() const { return fmt::format("dsw{}", tag_); }

  std::string tag_;
  int subnet_;
  std::vector<std::string> names_;
  std::string why_not_;
};

class SeparateHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = dsync::testing::FreshTestDir("dsync-hosts");
    fs::create_directories(dir_ / "dump");
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // The environment every node of a job shares: the scheduler at host 0's address.
  std::map<std::string, std::string> JobEnv(const Hosts& hosts, uint32_t servers,
                                            uint32_t workers) const {
    return {{"DSYNC_SCHEDULER_URI", hosts.Address(0)},
            {"DSYNC_SCHEDULER_PORT", "47911"},
            {"DSYNC_NUM_SERVERS", std::to_string(servers)},
            {"DSYNC_NUM_WORKERS", std::to_string(workers)},
            {"DSYNC_SYNC", "bsp"},
            {"DSYNC_OPTIMIZER", "sum"},
            {"DSYNC_SLICE_BYTES", "4096"},
            {"DSYNC_HEARTBEAT_MS", "100"},
            {"DSYNC_HEARTBEAT_TIMEOUT_MS", "1000"},
            {"DSYNC_DUMP_MODEL", (dir_ / "dump").string()},
            {"DSYNC_TOKEN", "hosts-token"}};
  }

  // Every slice of every server's dump holds exactly `count` on every element.
  void ExpectModelCount(double count, uint32_t servers) {
    uint32_t files = 0;
    for (const auto& entry : fs::directory_iterator(dir_ / "dump")) {
      ++files;
      const nlohmann::json j = nlohmann::json::parse(std::ifstream(entry.path()));
      EXPECT_FALSE(j["slices"].empty()) << entry.path();
      for (const auto& s : j["slices"]) {
        EXPECT_EQ(s["min"].get<double>(), count) << entry.path() << " slice " << s["slice"];
        EXPECT_EQ(s["max"].get<double>(), count) << entry.path() << " slice " << s["slice"];
      }
    }
    EXPECT_EQ(files, servers);
  }

  fs::path dir_;
};

#define SKIP_WITHOUT_HOSTS(hosts) \
  if (!(hosts).why_not().empty()) GTEST_SKIP() << "separate hosts: " << (hosts).why_not()

TEST_F(SeparateHosts, AJobOfSixHostsAddressedByNicNameAndWildcard) {
  // Scheduler on host 0 (by NIC name), servers on hosts 1-2 bound to every address (they
  // advertise the address that routes to the scheduler), workers on hosts 3-5 by NIC name.
  Hosts hosts(6);
  SKIP_WITHOUT_HOSTS(hosts);
  const auto env = JobEnv(hosts, 2, 3);
  const std::string bin = DSYNC_BINARY;
  Proc sched(hosts.On(0, {bin, "scheduler", "--interface", "dsync0", "--audit-log",
                          (dir_ / "audit.jsonl").string()}),
             env, dir_ / "s.log");
  ASSERT_TRUE(sched.WaitForOutput("scheduler listening on " + hosts.Address(0), 20s))
      << sched.Output();
  std::vector<std::unique_ptr<Proc>> servers, workers;
  for (int i = 1; i <= 2; ++i) {
    servers.push_back(std::make_unique<Proc>(
        hosts.On(i, {bin, "server", "--interface", "0.0.0.0"}), env,
        dir_ / ("server" + std::to_string(i) + ".log")));
  }
  for (int i = 3; i <= 5; ++i) {
    auto e = env;
    e["DSYNC_INTERFACE"] = "dsync0";  // ps-lite style: a NIC name
    workers.push_back(std::make_unique<Proc>(
        hosts.On(i, {bin, "worker", "--model", "count", "--iters", "20", "--tensor-elems",
                     "3000"}),
        e, dir_ / ("worker" + std::to_string(i) + ".log")));
  }
  for (auto& w : workers) EXPECT_EQ(w->Wait(60s), 0) << w->Output();
  EXPECT_EQ(sched.Wait(30s), 0) << sched.Output();
  for (auto& s : servers) EXPECT_EQ(s->Wait(30s), 0) << s->Output();
  const std::string log = sched.Output();
  // Each server registered at its own host's address, not at 0.0.0.0.
  for (int i = 1; i <= 2; ++i) {
    EXPECT_TRUE(std::regex_search(
        log, std::regex("server \\d registered at " + hosts.Address(i) + ":\\d+")))
        << log;
  }
  EXPECT_EQ(log.find("0.0.0.0"), std::string::npos) << log;
  EXPECT_NE(servers[0]->Output().find("listening on 0.0.0.0:"), std::string::npos)
      << servers[0]->Output();
  EXPECT_NE(servers[0]->Output().find(", reached at " + hosts.Address(1)), std::string::npos)
      << servers[0]->Output();
  ExpectModelCount(3 * 20, 2);
  // The audit log names every node's address: servers where workers reach them, workers
  // where they connected from; each worker also leaves.
  std::map<std::string, std::set<std::string>> seen;  // "registered server" -> hosts
  std::ifstream audit(dir_ / "audit.jsonl");
  for (std::string line; std::getline(audit, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("member")) continue;
    const auto& m = j["member"];
    const std::string address = m["address"];
    seen[m["event"].get<std::string>() + " " + m["role"].get<std::string>()].insert(
        address.substr(0, address.rfind(':')));
  }
  EXPECT_EQ(seen["registered server"],
            (std::set<std::string>{hosts.Address(1), hosts.Address(2)}));
  const std::set<std::string> worker_hosts = {hosts.Address(3), hosts.Address(4),
                                              hosts.Address(5)};
  EXPECT_EQ(seen["joined worker"], worker_hosts);
  EXPECT_EQ(seen["left worker"], worker_hosts);
}

TEST_F(SeparateHosts, AServerBehindAnAdvertisedAddress) {
  // The server listens on every address and names the one to reach it at; a wrong one
  // would leave the workers unable to connect.
  Hosts hosts(3);
  SKIP_WITHOUT_HOSTS(hosts);
  const auto env = JobEnv(hosts, 1, 1);
  const std::string bin = DSYNC_BINARY;
  Proc sched(hosts.On(0, {bin, "scheduler", "--interface", hosts.Address(0)}), env,
             dir_ / "s.log");
  ASSERT_TRUE(sched.WaitForOutput("scheduler listening on", 20s)) << sched.Output();
  auto senv = env;
  senv["DSYNC_INTERFACE"] = "::";
  senv["DSYNC_ADVERTISE"] = hosts.Address(1);
  Proc server(hosts.On(1, {bin, "server"}), senv, dir_ / "server.log");
  Proc worker(hosts.On(2, {bin, "worker", "--model", "count", "--iters", "10"}), env,
              dir_ / "worker.log");
  EXPECT_EQ(worker.Wait(60s), 0) << worker.Output();
  EXPECT_EQ(sched.Wait(30s), 0) << sched.Output();
  EXPECT_EQ(server.Wait(30s), 0) << server.Output();
  EXPECT_NE(sched.Output().find("registered at " + hosts.Address(1)), std::string::npos)
      << sched.Output();
  ExpectModelCount(10, 1);
}

TEST_F(SeparateHosts, NodesFindTheSchedulerThroughARendezvousFile) {
  // As under mpirun or Kubernetes: no addresses given, one file every host can read. The
  // scheduler listens on every address and writes the address of its NIC.
  Hosts hosts(4);
  SKIP_WITHOUT_HOSTS(hosts);
  auto env = JobEnv(hosts, 1, 2);
  env.erase("DSYNC_SCHEDULER_URI");
  env.erase("DSYNC_SCHEDULER_PORT");
  const std::string file = (dir_ / "scheduler.addr").string();
  env["DSYNC_RENDEZVOUS"] = file;
  const std::string bin = DSYNC_BINARY;
  // The workers and the server start first and wait for the file.
  Proc server(hosts.On(1, {bin, "server", "--interface", "dsync0"}), env, dir_ / "server.log");
  std::vector<std::unique_ptr<Proc>> workers;
  for (int i = 2; i <= 3; ++i) {
    workers.push_back(std::make_unique<Proc>(
        hosts.On(i, {bin, "worker", "--model", "count", "--iters", "10"}), env,
        dir_ / ("worker" + std::to_string(i) + ".log")));
  }
  std::this_thread::sleep_for(2500ms);  // past the one second after which they say so
  Proc sched(hosts.On(0, {bin, "scheduler", "--interface", "0.0.0.0", "--scheduler-port", "0"}),
             env, dir_ / "s.log");
  for (auto& w : workers) EXPECT_EQ(w->Wait(60s), 0) << w->Output();
  EXPECT_EQ(sched.Wait(30s), 0) << sched.Output();
  EXPECT_EQ(server.Wait(30s), 0) << server.Output();
  EXPECT_NE(sched.Output().find("wrote " + hosts.Address(0) + ":"), std::string::npos)
      << sched.Output();
  EXPECT_NE(workers[0]->Output().find("waiting for the scheduler's address in " + file),
            std::string::npos)
      << workers[0]->Output();
  EXPECT_FALSE(fs::exists(file)) << "the scheduler removes its file when it ends";
  ExpectModelCount(20, 1);
}

TEST_F(SeparateHosts, AWorkerWhoseLinkGoesDownIsReportedAndNothingCommittedIsLost) {
  Hosts hosts(4);
  SKIP_WITHOUT_HOSTS(hosts);
  const auto env = JobEnv(hosts, 1, 2);
  const std::string bin = DSYNC_BINARY;
  Proc sched(hosts.On(0, {bin, "scheduler", "--interface", "dsync0"}), env, dir_ / "s.log");
  ASSERT_TRUE(sched.WaitForOutput("scheduler listening on", 20s)) << sched.Output();
  Proc server(hosts.On(1, {bin, "server", "--interface", "dsync0"}), env, dir_ / "server.log");
  Proc steady(hosts.On(2, {bin, "worker", "--model", "count", "--iters", "150",
                           "--compute-ms", "20"}),
              env, dir_ / "steady.log");
  Proc cut(hosts.On(3, {bin, "worker", "--model", "count", "--iters", "100000",
                        "--compute-ms", "20"}),
           env, dir_ / "cut.log");
  ASSERT_TRUE(cut.WaitForOutput("joined", 20s)) << cut.Output();
  std::this_thread::sleep_for(500ms);
  std::string out;
  ASSERT_EQ(hosts.Exec(3, "ip link set dsync0 down", &out), 0) << out;
  const auto down = std::chrono::steady_clock::now();
  ASSERT_TRUE(sched.WaitForOutput("declared dead", 20s)) << sched.Output();
  const auto took = std::chrono::steady_clock::now() - down;
  EXPECT_LT(took, 1000ms + 1500ms) << "reported within the heartbeat timeout (+ slack)";
  EXPECT_EQ(steady.Wait(60s), 0) << steady.Output();
  EXPECT_EQ(sched.Wait(30s), 0) << sched.Output();
  EXPECT_EQ(server.Wait(30s), 0) << server.Output();
  cut.Signal(SIGKILL);
  cut.Wait(10s);
  // Every gradient the scheduler committed is in the model, on every slice alike.
  std::smatch m;
  const std::string log = sched.Output();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("round\\(s\\), (\\d+) gradient\\(s\\)")))
      << log;
  const double committed = std::stod(m[1]);
  EXPECT_GE(committed, 150) << log;
  ExpectModelCount(committed, 1);
}

}  // namespace
