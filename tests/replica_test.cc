// Replicated slices (Config::replicas): every copy of a slice applies the same rounds, so
// copies are bit-identical and the model is the one a single copy would hold; a job that
// loses a server whose slices have other copies goes on and ends with the same model, bit
// for bit, as the job that lost nothing; a job that loses every copy of a slice ends, saying
// so.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "cluster_harness.h"
#include "ps/checkpoint.h"

namespace dsync {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::LocalCluster;
using testing::StartWorkers;
using testing::TestConfig;

constexpr uint32_t kWorkers = 2;
constexpr size_t kDim = 100;  // 7 slices of 16 floats (64-byte slices)
constexpr Clock kClocks = 24;

float GradientOf(uint32_t rank, Clock clock, size_t j) {
  return 0.01f * std::sin(0.37f * static_cast<float>((clock + 1) * (j + 1)) +
                          static_cast<float>(rank));
}

// Adam with weight decay in bsp: every element's state depends on every round, in order.
Config ReplicaJobConfig(uint32_t servers, uint32_t replicas, const fs::path& dump) {
  Config cfg = TestConfig("bsp", servers, kWorkers);
  cfg.replicas = replicas;
  cfg.optimizer.kind = OptimizerKind::kAdam;
  cfg.optimizer.lr = 0.05f;
  cfg.optimizer.weight_decay = 0.01f;
  cfg.slice_bytes = 64;
  cfg.dump_model = dump.string();
  return cfg;
}

fs::path FreshDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("dsync-replica-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct JobResult {
  std::vector<float> w;  // as every worker pulled it at the end
  Status finished;
  SchedulerStats stats;
};

// Runs kWorkers workers for kClocks clocks; `after_clock(rank, clock, cluster)` runs on each
// worker's thread once that clock is committed.
JobResult RunJob(const Config& cfg,
                 const std::function<void(uint32_t, Clock, LocalCluster&)>& after_clock = {},
                 Clock end = kClocks) {
  LocalCluster cluster(cfg);
  EXPECT_TRUE(cluster.ok());
  if (!cluster.ok()) return {};
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  EXPECT_EQ(workers.size(), kWorkers);
  std::vector<std::vector<float>> pulled(workers.size());
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < workers.size(); ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> params(kDim, 0.5f), grad(kDim);
      auto id = w.Register("w", params);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      for (Clock c = w.job().start_clock; c < end; ++c) {
        Status st = w.Wait(w.Pull(*id, params.data()));
        ASSERT_TRUE(st.ok()) << "clock " << c << ": " << st.ToString();
        for (size_t j = 0; j < kDim; ++j) grad[j] = GradientOf(rank, c, j);
        w.Push(*id, grad.data());
        st = w.WaitAll();
        ASSERT_TRUE(st.ok()) << "clock " << c << ": " << st.ToString();
        if (after_clock) after_clock(rank, c, cluster);
      }
      ASSERT_TRUE(w.Wait(w.Pull(*id, params.data())).ok());
      pulled[rank] = params;
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  JobResult r;
  r.finished = cluster.WaitFinished();
  r.stats = cluster.scheduler().stats();
  for (size_t i = 1; i < pulled.size(); ++i) EXPECT_EQ(pulled[i], pulled[0]);
  r.w = pulled[0];
  return r;
}

// The job's settings with a checkpoint every 5 rounds into `dir`, or resumed from it.
Config Checkpointing(Config cfg, const fs::path& dir) {
  cfg.checkpoint_dir = dir.string();
  cfg.checkpoint_every = 5;
  return cfg;
}
Config Resuming(Config cfg, const fs::path& dir) {
  cfg.resume = dir.string();
  return cfg;
}

// The final models are the same, bit for bit.
void ExpectSameModel(const JobResult& got, const JobResult& want, const std::string& what) {
  ASSERT_TRUE(got.finished.ok()) << what << ": " << got.finished.ToString();
  ASSERT_EQ(got.w.size(), kDim) << what;
  ASSERT_EQ(want.w.size(), kDim) << what;
  EXPECT_EQ(0, std::memcmp(got.w.data(), want.w.data(), kDim * sizeof(float)))
      << what << ": w[0] " << got.w[0] << " vs " << want.w[0];
}

// (tensor, slice) -> the CRC-32 of each copy in the servers' dumps.
std::map<std::pair<uint32_t, uint32_t>, std::vector<uint64_t>> Copies(const fs::path& dump) {
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint64_t>> copies;
  for (const auto& e : fs::directory_iterator(dump)) {
    json j = json::parse(std::ifstream(e.path()));
    for (const json& s : j["slices"]) {
      copies[{s["tensor"].get<uint32_t>(), s["slice"].get<uint32_t>()}].push_back(
          s["crc32"].get<uint64_t>());
    }
  }
  return copies;
}

// A server started while the job runs (one taking a lost rank's place).
Config NewServerConfig(LocalCluster& cluster) {
  Config sc = cluster.WorkerConfig();
  sc.role = Role::kServer;
  sc.port = 0;
  return sc;
}

// Servers that stopped early wrote their dumps then: keeps only those of the servers that
// applied every round and returns how many there are.
size_t KeepFinalDumps(const fs::path& dump) {
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dump)) {
    json j = json::parse(std::ifstream(e.path()));
    if (j["rounds"].get<uint64_t>() == kClocks) {
      ++files;
    } else {
      fs::remove(e.path());
    }
  }
  return files;
}

void ExpectCopiesEqual(const fs::path& dump, size_t copies_each) {
  const auto copies = Copies(dump);
  EXPECT_EQ(copies.size(), (kDim + 15) / 16);
  for (const auto& [key, crcs] : copies) {
    EXPECT_EQ(crcs.size(), copies_each) << "tensor " << key.first << " slice " << key.second;
    for (uint64_t crc : crcs) {
      EXPECT_EQ(crc, crcs.front()) << "tensor " << key.first << " slice " << key.second;
    }
  }
}

TEST(Replicas, EveryCopyIsBitIdenticalAndTheModelIsOneCopysBitForBit) {
  const fs::path one = FreshDir("one"), two = FreshDir("two"), three = FreshDir("three");
  const JobResult single = RunJob(ReplicaJobConfig(3, 1, one));
  ASSERT_TRUE(single.finished.ok()) << single.finished.ToString();
  ASSERT_EQ(single.w.size(), kDim);
  ExpectCopiesEqual(one, 1);
  for (const auto& [replicas, dir] : {std::pair{2u, two}, std::pair{3u, three}}) {
    ExpectSameModel(RunJob(ReplicaJobConfig(3, replicas, dir)), single,
                    std::to_string(replicas) + " copies");
    ExpectCopiesEqual(dir, replicas);
    fs::remove_all(dir);
  }
  fs::remove_all(one);
}

// A server stopped in the middle of a bsp job (its connections end, as when its process dies):
// its slices' other copies serve the pulls, the remaining rounds are applied on them, and the
// final model is the one of the job that lost nothing, bit for bit.
TEST(Replicas, ABspJobThatLosesAServerEndsWithTheSameModelBitForBit) {
  const fs::path ref = FreshDir("ref"), lost = FreshDir("lost");
  const JobResult through = RunJob(ReplicaJobConfig(3, 1, ref));
  ASSERT_TRUE(through.finished.ok()) << through.finished.ToString();
  for (size_t victim : {size_t{0}, size_t{2}}) {
    fs::remove_all(lost);
    fs::create_directories(lost);
    std::atomic<bool> stopped{false};
    const JobResult failed_over =
        RunJob(ReplicaJobConfig(3, 2, lost), [&](uint32_t rank, Clock c, LocalCluster& cluster) {
          if (rank == 0 && c == 8 && !stopped.exchange(true)) cluster.server(victim).Stop();
        });
    ExpectSameModel(failed_over, through, "server " + std::to_string(victim) + " lost");
    EXPECT_EQ(failed_over.stats.servers_lost, 1u);
    EXPECT_EQ(failed_over.stats.rounds_closed, kClocks);
    // The surviving copies agree; the lost server wrote its dump when it stopped (at clock
    // 8), so only its copies may differ: checked by counting the survivors' files.
    EXPECT_EQ(KeepFinalDumps(lost), 2u);
    const auto copies = Copies(lost);
    for (const auto& [key, crcs] : copies) {
      for (uint64_t crc : crcs) EXPECT_EQ(crc, crcs.front()) << "slice " << key.second;
    }
  }
  fs::remove_all(ref);
  fs::remove_all(lost);
}

// A new server takes the place of a lost one in the middle of a bsp job (Adam with weight
// decay: every element's state depends on every round): the others copy it the rank's slices
// with their optimizer state, and it applies the rounds from there. That the copies are
// whole shows when the server next to it is lost too: the slices it shared with the lost
// one live only on the new server then, and the job still ends with the model of the job
// that lost nothing, bit for bit, every copy alike.
TEST(Replicas, ANewServerTakesALostOnesPlaceAndTheJobEndsAsIfNothingWasLost) {
  const fs::path ref = FreshDir("takeover-ref"), dump = FreshDir("takeover");
  const JobResult through = RunJob(ReplicaJobConfig(3, 1, ref));
  ASSERT_TRUE(through.finished.ok()) << through.finished.ToString();
  std::unique_ptr<Server> fresh;
  std::thread fresh_run;
  Status fresh_result = Error(StatusCode::kInternal, "never ran");
  // An observer reads through it all: once the neighbour is lost too, only the new server
  // holds some slices, which it must read from there.
  std::unique_ptr<Worker> observer;
  bool neighbour_stopped = false;  // rank 0's thread only
  const JobResult got =
      RunJob(ReplicaJobConfig(3, 2, dump), [&](uint32_t rank, Clock c, LocalCluster& cluster) {
        if (rank != 0) return;
        if (c == 2) {
          Config oc = cluster.WorkerConfig();
          oc.observer = true;
          auto o = Worker::Start(oc);
          ASSERT_TRUE(o.ok()) << o.status().ToString();
          observer = std::move(o).value();
          std::vector<float> view(kDim, 0.0f);
          ASSERT_TRUE(observer->Register("w", view).ok());
        }
        if (c == 20) {
          std::vector<float> view(kDim, 0.0f);
          Version version = 0;
          Status st = observer->Wait(observer->Pull(0, view.data()), &version);
          EXPECT_TRUE(st.ok()) << st.ToString();
          EXPECT_GE(version, 17u);
          EXPECT_TRUE(observer->Leave().ok());
        }
        if (c == 5) cluster.server(1).Stop();
        if (c == 8) {
          auto s = Server::Start(NewServerConfig(cluster));
          ASSERT_TRUE(s.ok()) << s.status().ToString();
          fresh = std::move(s).value();
          fresh_run = std::thread([&] { fresh_result = fresh->Run(); });
        }
        // The copies go out once every worker's clocks up to the one from which it pushes to
        // the new server are in rounds: waiting for them here, before this worker's later
        // clocks, could hold the very round they wait for (a loaded machine announces the
        // takeover late). So look from clock 16 on and wait only near the end, by when every
        // clock the copies could need was committed.
        if (c >= 16 && !neighbour_stopped &&
            (cluster.scheduler().stats().servers_restored == 1 || c + 3 >= kClocks)) {
          neighbour_stopped = true;
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (cluster.scheduler().stats().servers_restored == 0 &&
                 std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          ASSERT_EQ(cluster.scheduler().stats().servers_restored, 1u);
          // The rank after the lost one: with it, the copies of the lost rank's primaries.
          const NodeId next =
              kFirstServerId + (cluster.server(1).id() - kFirstServerId + 1) % 3;
          for (size_t i = 0; i < 3; ++i) {
            if (i != 1 && cluster.server(i).id() == next) cluster.server(i).Stop();
          }
        }
      });
  ASSERT_TRUE(fresh_run.joinable());
  fresh_run.join();
  EXPECT_TRUE(fresh_result.ok()) << fresh_result.ToString();
  ASSERT_TRUE(got.finished.ok()) << got.finished.ToString();
  ExpectSameModel(got, through, "a server lost, another taking its place, then its neighbour lost");
  EXPECT_EQ(got.stats.servers_lost, 2u);
  EXPECT_EQ(got.stats.servers_restored, 1u);
  EXPECT_EQ(got.stats.rounds_closed, kClocks);
  // The lost servers wrote their dumps when they stopped: only the two that ran to the end
  // (the third one and the new one) count, and they hold equal copies.
  EXPECT_EQ(KeepFinalDumps(dump), 2u);
  size_t both = 0;
  for (const auto& [key, crcs] : Copies(dump)) {
    both += crcs.size() == 2 ? 1 : 0;
    for (uint64_t crc : crcs) EXPECT_EQ(crc, crcs.front()) << "slice " << key.second;
  }
  EXPECT_GT(both, 0u);
  fs::remove_all(ref);
  fs::remove_all(dump);
}

// A server registering while every rank has its server is refused, saying so. A new server
// that goes before it holds its copies costs nothing (the job goes on as before it came),
// and the next new server takes the rank over: the job ends with the model of the job that
// lost nothing, bit for bit.
TEST(Replicas, ANewServerIsRefusedWhileNoRankIsLostAndOneThatGoesEarlyCostsNothing) {
  const fs::path ref = FreshDir("again-ref"), dump = FreshDir("again");
  const JobResult through = RunJob(ReplicaJobConfig(3, 1, ref));
  ASSERT_TRUE(through.finished.ok()) << through.finished.ToString();
  std::unique_ptr<Server> fresh;
  std::thread fresh_run;
  const JobResult got =
      RunJob(ReplicaJobConfig(3, 2, dump), [&](uint32_t rank, Clock c, LocalCluster& cluster) {
        if (rank != 0) return;
        if (c == 2) {
          auto refused = Server::Start(NewServerConfig(cluster));
          ASSERT_FALSE(refused.ok());
          EXPECT_NE(refused.status().message().find(
                        "all 3 servers of this job have registered already, and none of them "
                        "is lost"),
                    std::string::npos)
              << refused.status().ToString();
        }
        if (c == 4) cluster.server(1).Stop();
        if (c == 6) {
          auto early = Server::Start(NewServerConfig(cluster));
          ASSERT_TRUE(early.ok()) << early.status().ToString();
          // Gone at once: before, or while, the others copy it the rank's slices.
        }
        if (c == 12) {
          auto s = Server::Start(NewServerConfig(cluster));
          ASSERT_TRUE(s.ok()) << s.status().ToString();
          fresh = std::move(s).value();
          fresh_run = std::thread([&] { (void)fresh->Run(); });
        }
      });
  ASSERT_TRUE(fresh_run.joinable());
  fresh_run.join();
  ASSERT_TRUE(got.finished.ok()) << got.finished.ToString();
  ExpectSameModel(got, through, "a new server gone early, another taking its place");
  EXPECT_EQ(got.stats.servers_lost, 2u);
  EXPECT_EQ(got.stats.servers_restored, 1u);
  fs::remove_all(ref);
  fs::remove_all(dump);
}

// Two of three servers lost with two copies of each slice: some slice has no copy left, and
// the job ends saying so instead of serving a partial model.
TEST(Replicas, LosingEveryCopyOfASliceEndsTheJobSayingSo) {
  const fs::path dump = FreshDir("all");
  Config cfg = ReplicaJobConfig(3, 2, dump);
  cfg.num_workers = 1;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  std::vector<float> params(kDim, 0.5f), grad(kDim, 0.01f);
  auto id = workers[0]->Register("w", params);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  ASSERT_TRUE(workers[0]->Wait(workers[0]->Pull(*id, params.data())).ok());
  cluster.server(1).Stop();
  // The job goes on with one server lost...
  for (int i = 0; i < 3; ++i) {
    workers[0]->Push(*id, grad.data());
    ASSERT_TRUE(workers[0]->WaitAll().ok());
    ASSERT_TRUE(workers[0]->Wait(workers[0]->Pull(*id, params.data())).ok());
  }
  // ...not with two.
  cluster.server(2).Stop();
  const Status st = cluster.WaitFinished();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("every copy of some slices is lost"), std::string::npos)
      << st.ToString();
  EXPECT_EQ(cluster.scheduler().stats().servers_lost, 1u);
  workers[0]->Abandon();
  fs::remove_all(dump);
}

// Each server's checkpoint file holds every copy it keeps; the copies of a slice in the
// checkpoint are bit-identical, and the job resumed from it with the same copies equals the
// uninterrupted one bit for bit (another number of copies is refused, naming the one to use).
TEST(Replicas, CheckpointsHoldEveryCopyAndResumeBitForBit) {
  const fs::path dump = FreshDir("ckpt-dump"), dir = FreshDir("ckpt");
  const JobResult through = RunJob(ReplicaJobConfig(3, 2, dump));
  ASSERT_TRUE(through.finished.ok()) << through.finished.ToString();
  const JobResult stopped = RunJob(Checkpointing(ReplicaJobConfig(3, 2, dump), dir), {}, 12);
  ASSERT_TRUE(stopped.finished.ok()) << stopped.finished.ToString();
  auto found = ps::FindNewestCheckpoint(dir.string(), nullptr);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->manifest.version, 12u);
  EXPECT_EQ(found->manifest.replicas, 2u);
  std::map<std::pair<uint32_t, uint32_t>, std::vector<const ps::CheckpointSlice*>> copies;
  std::vector<ps::ServerCheckpoint> files;
  for (const ps::CheckpointFile& f : found->manifest.files) {
    auto c = ps::ReadServerCheckpoint((fs::path(found->path) / f.name).string(), f.crc32);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    files.push_back(std::move(c).value());
  }
  for (const ps::ServerCheckpoint& c : files) {
    for (const ps::CheckpointSlice& s : c.slices) copies[{s.tensor, s.slice}].push_back(&s);
  }
  EXPECT_EQ(copies.size(), (kDim + 15) / 16);
  for (const auto& [key, list] : copies) {
    ASSERT_EQ(list.size(), 2u) << "slice " << key.second;
    EXPECT_NE(list[0]->replica, list[1]->replica);
    EXPECT_EQ(list[0]->snapshot.params, list[1]->snapshot.params);
    EXPECT_EQ(list[0]->snapshot.state, list[1]->snapshot.state) << "Adam's m and v too";
    EXPECT_EQ(list[0]->snapshot.steps, list[1]->snapshot.steps);
    EXPECT_EQ(list[0]->snapshot.kept, list[1]->snapshot.kept);
    EXPECT_EQ(list[0]->snapshot.mean_square, list[1]->snapshot.mean_square);
  }

  auto refused = InProcessCluster::Start(Resuming(ReplicaJobConfig(3, 1, dump), dir));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--replicas 2"), std::string::npos)
      << refused.status().ToString();

  ExpectSameModel(RunJob(Resuming(ReplicaJobConfig(3, 2, dump), dir)), through, "resumed");
  fs::remove_all(dir);
  fs::remove_all(dump);
}

// A checkpoint written after a server was lost has no file of its rank: the other ranks'
// files hold copies of its slices. The job resumed from it (every rank back) takes that rank's
// slices from those copies and ends with the model of the job that lost nothing, bit for bit.
TEST(Replicas, ACheckpointAfterALossResumesTheLostRankFromItsCopies) {
  const fs::path dump = FreshDir("loss-dump"), dir = FreshDir("loss-ckpt");
  const JobResult through = RunJob(ReplicaJobConfig(3, 2, dump));
  ASSERT_TRUE(through.finished.ok()) << through.finished.ToString();
  std::atomic<bool> stopped{false};
  const JobResult lost = RunJob(
      Checkpointing(ReplicaJobConfig(3, 2, dump), dir),
      [&](uint32_t rank, Clock c, LocalCluster& cluster) {
        if (rank == 1 && c == 7 && !stopped.exchange(true)) {
          cluster.server(1).Stop();  // in a job with checkpoints it drains for the checkpoint;
          cluster.server(1).Stop();  // asked again, it stops at once
        }
      },
      16);
  ASSERT_TRUE(lost.finished.ok()) << lost.finished.ToString();
  EXPECT_EQ(lost.stats.servers_lost, 1u);
  auto found = ps::FindNewestCheckpoint(dir.string(), nullptr);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->manifest.version, 16u);
  ASSERT_EQ(found->manifest.lost_ranks.size(), 1u);
  EXPECT_EQ(found->manifest.files.size(), 2u);

  ExpectSameModel(RunJob(Resuming(ReplicaJobConfig(3, 2, dump), dir)), through,
                  "resumed after a loss");
  // Every rank holds its copies again, identical to the others.
  for (const auto& e : fs::directory_iterator(dump)) {
    json j = json::parse(std::ifstream(e.path()));
    if (j["rounds"].get<uint64_t>() != kClocks) fs::remove(e.path());
  }
  ExpectCopiesEqual(dump, 2);
  fs::remove_all(dir);
  fs::remove_all(dump);
}

// Workers may register a tensor with different initial values (no shared seed): the first
// registration sets the primary's, and every other copy is created from the primary, so the
// copies agree and every worker reads the same model.
TEST(Replicas, CopiesStartFromThePrimaryWhateverEachWorkerRegistered) {
  const fs::path dump = FreshDir("init");
  LocalCluster cluster(ReplicaJobConfig(3, 3, dump));
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), kWorkers);
  std::vector<std::vector<float>> pulled(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    threads.emplace_back([&, rank] {
      std::vector<float> params(kDim);
      for (size_t j = 0; j < kDim; ++j) params[j] = static_cast<float>(rank * 1000 + j);
      auto id = workers[rank]->Register("w", params);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      std::vector<float> out(kDim);
      ASSERT_TRUE(workers[rank]->Wait(workers[rank]->Pull(*id, out.data())).ok());
      pulled[rank] = out;
      ASSERT_TRUE(workers[rank]->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());
  EXPECT_EQ(pulled[0], pulled[1]);
  ExpectCopiesEqual(dump, 3);
  fs::remove_all(dump);
}

// Workers pull from primaries only, so a backup may trail them; the scheduler holds rounds
// back while a copy trails by kReplicaLagRounds, and servers leave room for it: many quick
// rounds of several workers never overrun a backup's staging quota (before both, a backup
// behind by a round refused an honest worker's push now and then).
TEST(Replicas, QuickRoundsNeverOverrunABackupsStagingQuota) {
  for (const char* sync : {"bsp", "dsync:2", "asp"}) {
    Config cfg = TestConfig(sync, 2, 4);
    cfg.replicas = 2;
    cfg.optimizer.kind = OptimizerKind::kSum;
    LocalCluster cluster(cfg);
    ASSERT_TRUE(cluster.ok());
    auto workers = StartWorkers(cluster.WorkerConfig(), 4);
    ASSERT_EQ(workers.size(), 4u);
    std::vector<std::thread> threads;
    for (auto& w : workers) {
      threads.emplace_back([&w, sync] {
        std::vector<float> params(16, 0.0f), grad(16, 1.0f);
        auto id = w->Register("w", params);
        ASSERT_TRUE(id.ok()) << id.status().ToString();
        for (int i = 0; i < 400; ++i) {
          const Status st = w->Wait(w->PushPull(*id, grad.data(), params.data()));
          ASSERT_TRUE(st.ok()) << sync << " iteration " << i << ": " << st.ToString();
        }
        ASSERT_TRUE(w->Leave().ok());
      });
    }
    for (auto& t : threads) t.join();
    const Status st = cluster.WaitFinished();
    EXPECT_TRUE(st.ok()) << sync << ": " << st.ToString();
    EXPECT_EQ(cluster.scheduler().stats().gradients_committed, 1600u) << sync;
  }
}

// With one copy, losing a server ends the job; in a job that writes checkpoints the other
// servers' slices are written first, as a partial checkpoint: --resume passes over it (to the
// newest complete one), `dsyncps checkpoint export` writes the tensors whole in it.
TEST(Replicas, WithOneCopyALostServerEndsTheJobAfterAPartialCheckpoint) {
  const fs::path dump = FreshDir("salvage-dump"), dir = FreshDir("salvage");
  // Two tensors: "a" in one slice, "b" in 7 (kDim floats, 64-byte slices), over 3 servers.
  LocalCluster cluster(Checkpointing(ReplicaJobConfig(3, 1, dump), dir));
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  ASSERT_EQ(workers.size(), kWorkers);
  std::atomic<bool> stopped{false};
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < kWorkers; ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> a(4, 1.0f), b(kDim, 0.5f), ga(4, 0.01f), gb(kDim, 0.01f);
      auto ia = w.Register("a", a);
      auto ib = w.Register("b", b);
      ASSERT_TRUE(ia.ok() && ib.ok());
      for (Clock c = 0; c < 40; ++c) {
        if (rank == 1 && c == 7 && !stopped.exchange(true)) {
          // The loss comes after the first periodic checkpoint (version 5) is whole: the test
          // is about what --resume finds then. It needs no further round, so waiting for it
          // here holds nothing it waits for; a loaded machine may still be writing it.
          std::vector<ps::SkippedCheckpoint> ignored;
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (!ps::FindNewestCheckpoint(dir.string(), &ignored).ok() &&
                 std::chrono::steady_clock::now() < deadline) {
            ignored.clear();
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          cluster.server(2).Stop();  // drains for a checkpoint in a job that writes them...
          cluster.server(2).Stop();  // ...asked again, it stops at once
        }
        if (!w.Wait(w.Pull(*ia, a.data())).ok() || !w.Wait(w.Pull(*ib, b.data())).ok()) break;
        w.Push(*ia, ga.data());
        w.Push(*ib, gb.data());
        if (!w.WaitAll().ok()) break;  // the job ended under it
      }
      w.Abandon();
    });
  }
  for (auto& t : threads) t.join();
  const Status st = cluster.WaitFinished();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("the job cannot continue without its slices; the surviving slices "
                              "are in"),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("a partial checkpoint"), std::string::npos) << st.ToString();

  // The partial checkpoint is kept aside (partial-ckpt-...), named in the error; --resume
  // takes the newest complete one, a periodic one before the loss.
  std::smatch m;
  const std::string msg = st.message();
  ASSERT_TRUE(std::regex_search(msg, m, std::regex("surviving slices are in (\\S+) \\(")))
      << msg;
  const std::string partial_path = m[1];
  EXPECT_EQ(fs::path(partial_path).filename().string().rfind("partial-ckpt-", 0), 0u)
      << partial_path;
  std::vector<ps::SkippedCheckpoint> skipped;
  auto found = ps::FindNewestCheckpoint(dir.string(), &skipped);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_TRUE(skipped.empty());
  EXPECT_FALSE(found->manifest.partial);
  EXPECT_EQ(found->manifest.version % 5, 0u) << "a periodic one";
  auto partial = ps::ReadCheckpoint(partial_path);
  ASSERT_TRUE(partial.ok()) << partial.status().ToString();
  EXPECT_TRUE(partial->partial);
  EXPECT_EQ(partial->files.size(), 2u);
  EXPECT_EQ(partial->lost_ranks.size(), 1u);
  EXPECT_GT(partial->version, found->manifest.version);

  // Export: "a" (one slice) is whole unless it was on the lost rank (then it has no slice
  // at all); "b" has slices on every rank, so it is left out, said so.
  const std::string out = (dir / "partial.npz").string();
  const std::string cmd = std::string(DSYNC_BINARY) + " checkpoint export " + partial_path +
                          " --format npz --out " + out + " > " + (dir / "export.log").string() +
                          " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log_in(dir / "export.log");
  const std::string log((std::istreambuf_iterator<char>(log_in)), {});
  EXPECT_NE(log.find("tensor 'b' is not whole in this partial checkpoint"), std::string::npos)
      << log;
  if (log.find("tensor 0 has no slice in this partial checkpoint") == std::string::npos) {
    EXPECT_EQ(rc, 0) << log;
    EXPECT_TRUE(fs::exists(out)) << log;
    EXPECT_NE(log.find("wrote 1 tensor(s), 4 parameters"), std::string::npos) << log;
  } else {
    EXPECT_NE(rc, 0) << log;
    EXPECT_NE(log.find("holds no tensor whole"), std::string::npos) << log;
  }
  fs::remove_all(dir);
  fs::remove_all(dump);
}

}  // namespace
}  // namespace dsync
