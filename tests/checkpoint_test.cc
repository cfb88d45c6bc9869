// Consistent checkpoints: the file format refuses what is torn or corrupt, naming the file;
// a job stopped and resumed from its checkpoint ends with the same model, bit for bit, as the
// job that ran through, optimizer state included; a damaged newest checkpoint falls back to
// the one before it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cluster_harness.h"
#include "ps/checkpoint.h"

#include <zlib.h>

namespace dsync {
namespace {

namespace fs = std::filesystem;
using testing::LocalCluster;
using testing::StartWorkers;
using testing::TestConfig;

fs::path FreshDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("dsync-ckpt-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void FlipByte(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

ps::ServerCheckpoint SampleCheckpoint() {
  ps::ServerCheckpoint c;
  c.rank = 1;
  c.num_servers = 2;
  c.version = 42;
  c.slice_bytes = 64;
  for (uint32_t t = 0; t < 2; ++t) {
    ps::CheckpointSlice s;
    s.tensor = t;
    s.slice = 0;
    OptimizerConfig o;
    o.kind = t == 0 ? OptimizerKind::kAdam : OptimizerKind::kMomentum;
    s.meta = ps::InitMeta{t == 0 ? "w" : "b", t == 0 ? 16u : 3u, 0, o, {}};
    const size_t n = t == 0 ? 16 : 3;
    for (size_t i = 0; i < n; ++i) s.snapshot.params.push_back(0.25f * static_cast<float>(i) - 1);
    s.snapshot.state.assign(t == 0 ? 2 : 1, std::vector<float>(n, 0.5f + static_cast<float>(t)));
    s.snapshot.steps = 7 + t;
    if (t == 0) {  // delay compensation's kept versions
      for (uint64_t round : {39u, 41u}) {
        s.snapshot.kept.push_back({round, std::vector<float>(n, static_cast<float>(round))});
      }
      s.snapshot.mean_square.assign(n, 0.125f);
    }
    c.slices.push_back(std::move(s));
  }
  return c;
}

TEST(CheckpointFile, RoundTripsEverySliceWithItsStateAndMetadata) {
  const fs::path dir = FreshDir("roundtrip");
  const ps::ServerCheckpoint c = SampleCheckpoint();
  auto f = ps::WriteServerCheckpoint(dir.string(), c);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->name, "server-1.ckpt");
  EXPECT_EQ(f->bytes, fs::file_size(dir / f->name));
  EXPECT_FALSE(fs::exists(dir / "server-1.ckpt.tmp")) << "the temporary file is renamed away";
  auto back = ps::ReadServerCheckpoint((dir / f->name).string(), f->crc32);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->rank, 1u);
  EXPECT_EQ(back->num_servers, 2u);
  EXPECT_EQ(back->version, 42u);
  EXPECT_EQ(back->slice_bytes, 64u);
  ASSERT_EQ(back->slices.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back->slices[i].tensor, c.slices[i].tensor);
    EXPECT_EQ(back->slices[i].meta.name, c.slices[i].meta.name);
    EXPECT_EQ(back->slices[i].meta.optimizer, c.slices[i].meta.optimizer);
    EXPECT_EQ(back->slices[i].snapshot.params, c.slices[i].snapshot.params);
    EXPECT_EQ(back->slices[i].snapshot.state, c.slices[i].snapshot.state);
    EXPECT_EQ(back->slices[i].snapshot.steps, c.slices[i].snapshot.steps);
    ASSERT_EQ(back->slices[i].snapshot.kept.size(), c.slices[i].snapshot.kept.size());
    for (size_t k = 0; k < c.slices[i].snapshot.kept.size(); ++k) {
      EXPECT_EQ(back->slices[i].snapshot.kept[k].round, c.slices[i].snapshot.kept[k].round);
      EXPECT_EQ(back->slices[i].snapshot.kept[k].params, c.slices[i].snapshot.kept[k].params);
    }
    EXPECT_EQ(back->slices[i].snapshot.mean_square, c.slices[i].snapshot.mean_square);
  }
  // The bytes a takeover sends parse back the same.
  const std::vector<std::byte> bytes = ps::SerializeServerCheckpoint(c);
  EXPECT_EQ(bytes.size(), f->bytes);
  auto parsed = ps::ParseServerCheckpoint(bytes, "copies", std::nullopt);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->slices[0].snapshot.kept.size(), 2u);
  EXPECT_EQ(parsed->slices[0].snapshot.kept[1].round, 41u);
  EXPECT_EQ(parsed->slices[0].snapshot.mean_square.size(), 16u);
  EXPECT_TRUE(parsed->slices[1].snapshot.mean_square.empty());
  fs::remove_all(dir);
}

// A file of the format before kept versions ("DSCKPT02", written here byte by byte as that
// format lays it out) still loads, keeping nothing.
TEST(CheckpointManifest, CarriesTheLearningRateAndTheRoundAJobIsDampedFrom) {
  // A resumed job runs with the learning rate set before its checkpoint and stays damped
  // from the round it was (the staleness policy damp).
  const fs::path dir = FreshDir("manifest_damp");
  ps::CheckpointManifest m;
  m.version = 50;
  m.num_servers = 1;
  m.slice_bytes = 1024;
  m.sync = "dsync:1,3";
  m.lost_ranks = {0};  // no server file to check: the manifest alone
  m.partial = true;
  m.learning_rate = std::make_pair(Round{3}, 0.5f);
  m.damp_from = 12;
  ASSERT_TRUE(ps::WriteManifest(dir.string(), m).ok());
  auto back = ps::ReadCheckpoint(dir.string());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->damp_from, std::optional<Round>(12));
  EXPECT_EQ(back->learning_rate, m.learning_rate);
  m.damp_from.reset();
  ASSERT_TRUE(ps::WriteManifest(dir.string(), m).ok());
  EXPECT_FALSE(ps::ReadCheckpoint(dir.string()).value().damp_from.has_value());
  // Damped from a round the checkpoint does not reach: damaged.
  m.damp_from = 51;
  ASSERT_TRUE(ps::WriteManifest(dir.string(), m).ok());
  EXPECT_EQ(ps::ReadCheckpoint(dir.string()).status().code(), StatusCode::kDataLoss);
}

TEST(CheckpointFile, TheFormatBeforeKeptVersionsStillLoads) {
  ps::ServerCheckpoint c = SampleCheckpoint();
  std::vector<std::byte> out;
  const auto put = [&](const auto& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(v));
  };
  for (char ch : std::string("DSCKPT02")) put(ch);
  put(c.rank);
  put(c.num_servers);
  put(c.version);
  put(c.slice_bytes);
  put(static_cast<uint32_t>(c.slices.size()));
  for (const ps::CheckpointSlice& sl : c.slices) {
    std::vector<std::byte> meta;
    ps::EncodeInit(sl.meta, meta);
    put(sl.tensor);
    put(sl.slice);
    put(sl.replica);
    put(static_cast<uint64_t>(sl.snapshot.params.size()));
    put(sl.snapshot.steps);
    put(static_cast<uint32_t>(sl.snapshot.state.size()));
    put(static_cast<uint32_t>(meta.size()));
    out.insert(out.end(), meta.begin(), meta.end());
    for (float x : sl.snapshot.params) put(x);
    for (const auto& st : sl.snapshot.state) {
      for (float x : st) put(x);
    }  // the sample's kept versions and mean square have no place in this format
  }
  put(static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(out.data()),
                                  static_cast<uInt>(out.size()))));
  auto back = ps::ParseServerCheckpoint(out, "a DSCKPT02 file", std::nullopt);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->slices.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back->slices[i].snapshot.params, c.slices[i].snapshot.params);
    EXPECT_EQ(back->slices[i].snapshot.state, c.slices[i].snapshot.state);
    EXPECT_TRUE(back->slices[i].snapshot.kept.empty());
    EXPECT_TRUE(back->slices[i].snapshot.mean_square.empty());
  }
}

TEST(CheckpointFile, CorruptTornOrForeignFilesAreRefusedNamingTheFile) {
  const fs::path dir = FreshDir("corrupt");
  auto f = ps::WriteServerCheckpoint(dir.string(), SampleCheckpoint());
  ASSERT_TRUE(f.ok());
  const fs::path file = dir / f->name;
  // Every byte matters: the CRC-32 covers the header, the metadata and the floats.
  for (uint64_t at : {uint64_t{9}, uint64_t{40}, f->bytes / 2, f->bytes - 6}) {
    fs::copy_file(file, dir / "copy.ckpt", fs::copy_options::overwrite_existing);
    FlipByte(dir / "copy.ckpt", at);
    auto r = ps::ReadServerCheckpoint((dir / "copy.ckpt").string(), std::nullopt);
    ASSERT_FALSE(r.ok()) << "byte " << at;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find("copy.ckpt"), std::string::npos) << r.status().message();
  }
  // Cut short.
  fs::copy_file(file, dir / "short.ckpt", fs::copy_options::overwrite_existing);
  fs::resize_file(dir / "short.ckpt", f->bytes - 20);
  EXPECT_FALSE(ps::ReadServerCheckpoint((dir / "short.ckpt").string(), std::nullopt).ok());
  // Sound, but not the file the manifest recorded.
  auto other = ps::ReadServerCheckpoint(file.string(), f->crc32 ^ 1u);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("manifest"), std::string::npos);
  // Not a checkpoint at all.
  std::ofstream(dir / "junk.ckpt") << "hello";
  auto junk = ps::ReadServerCheckpoint((dir / "junk.ckpt").string(), std::nullopt);
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.status().message().find("junk.ckpt"), std::string::npos);
  fs::remove_all(dir);
}

// --- Whole jobs -------------------------------------------------------------------------

constexpr uint32_t kWorkers = 2;
constexpr size_t kDim = 40;  // 3 slices of 16 floats (64-byte slices) over both servers

// The gradient of worker `rank` at `clock`: any deterministic function will do.
float GradientOf(uint32_t rank, Clock clock, size_t j) {
  return 0.01f * std::sin(0.37f * static_cast<float>((clock + 1) * (j + 1)) +
                          static_cast<float>(rank));
}

Config CheckpointJobConfig() {
  Config cfg = TestConfig("bsp", 2, kWorkers);
  cfg.optimizer.kind = OptimizerKind::kAdam;  // state (m, v) and the step count matter
  cfg.optimizer.lr = 0.05f;
  cfg.optimizer.weight_decay = 0.01f;
  cfg.slice_bytes = 64;
  return cfg;
}

struct JobResult {
  std::vector<float> w;  // as the first worker pulled it at the end
  Clock first_clock = 0;
};

// Runs the workers until their clock reaches `end`, from wherever the job starts them. The
// job must end cleanly, unless `finished` is given to take how it ended.
JobResult RunJob(const Config& cfg, Clock end, Status* finished = nullptr) {
  LocalCluster cluster(cfg);
  EXPECT_TRUE(cluster.ok());
  if (!cluster.ok()) return {};
  auto workers = StartWorkers(cluster.WorkerConfig(), kWorkers);
  EXPECT_EQ(workers.size(), kWorkers);
  std::vector<JobResult> results(workers.size());
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < workers.size(); ++rank) {
    threads.emplace_back([&, rank] {
      Worker& w = *workers[rank];
      std::vector<float> params(kDim, 0.5f), grad(kDim);
      auto id = w.Register("w", params);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      results[rank].first_clock = w.job().start_clock;
      for (Clock c = w.job().start_clock; c < end; ++c) {
        ASSERT_TRUE(w.Wait(w.Pull(*id, params.data())).ok());
        for (size_t j = 0; j < kDim; ++j) grad[j] = GradientOf(rank, c, j);
        w.Push(*id, grad.data());
        ASSERT_TRUE(w.WaitAll().ok());
      }
      ASSERT_TRUE(w.Wait(w.Pull(*id, params.data())).ok());
      results[rank].w = params;
      ASSERT_TRUE(w.Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  const Status st = cluster.WaitFinished();
  if (finished) {
    *finished = st;
  } else {
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  EXPECT_EQ(results[0].w, results[1].w);
  return results[0];
}

std::vector<std::string> Listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(Checkpoint, AStoppedAndResumedBspJobEqualsTheUninterruptedOneBitForBit) {
  const Config cfg = CheckpointJobConfig();
  const JobResult through = RunJob(cfg, 20);
  ASSERT_EQ(through.w.size(), kDim);

  const fs::path dir = FreshDir("resume");
  Config first = cfg;
  first.checkpoint_dir = dir.string();
  first.checkpoint_every = 3;
  const JobResult stopped = RunJob(first, 10);
  EXPECT_EQ(stopped.first_clock, 0u);
  // Periodic ones at 3, 6, 9 and the final one at 10; the newest three are kept.
  EXPECT_EQ(Listing(dir), (std::vector<std::string>{"ckpt-000000000006", "ckpt-000000000009",
                                                    "ckpt-000000000010"}));
  EXPECT_EQ(Listing(dir / "ckpt-000000000010"),
            (std::vector<std::string>{"MANIFEST.json", "server-0.ckpt", "server-1.ckpt"}));
  std::vector<ps::SkippedCheckpoint> skipped;
  auto found = ps::FindNewestCheckpoint(dir.string(), &skipped);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_TRUE(skipped.empty());
  EXPECT_EQ(found->manifest.version, 10u);
  EXPECT_EQ(found->manifest.gradients_committed, 10u * kWorkers);
  EXPECT_EQ(found->manifest.clock, 10u) << "bsp: every worker's clock is the version";

  Config second = cfg;
  second.resume = dir.string();
  const JobResult resumed = RunJob(second, 20);
  EXPECT_EQ(resumed.first_clock, 10u) << "the workers go on from the checkpoint's clock";
  ASSERT_EQ(resumed.w.size(), kDim);
  EXPECT_EQ(0, std::memcmp(resumed.w.data(), through.w.data(), kDim * sizeof(float)))
      << "w[0] " << resumed.w[0] << " vs " << through.w[0];
  fs::remove_all(dir);
}

TEST(Checkpoint, ADamagedNewestCheckpointIsRefusedAndThePreviousOneUsed) {
  const Config cfg = CheckpointJobConfig();
  const JobResult through = RunJob(cfg, 14);
  const fs::path dir = FreshDir("fallback");
  Config first = cfg;
  first.checkpoint_dir = dir.string();
  first.checkpoint_every = 4;
  (void)RunJob(first, 10);  // checkpoints at 4, 8 and 10
  FlipByte(dir / "ckpt-000000000010" / "server-1.ckpt", 100);

  std::vector<ps::SkippedCheckpoint> skipped;
  auto found = ps::FindNewestCheckpoint(dir.string(), &skipped);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->manifest.version, 8u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].why.find("ckpt-000000000010/server-1.ckpt"), std::string::npos)
      << skipped[0].why;

  Config second = cfg;
  second.resume = dir.string();
  const JobResult resumed = RunJob(second, 14);
  EXPECT_EQ(resumed.first_clock, 8u);
  EXPECT_EQ(0, std::memcmp(resumed.w.data(), through.w.data(), kDim * sizeof(float)));
  // The refused one was set aside: a later --resume cannot roll back to it.
  EXPECT_TRUE(fs::exists(dir / "refused-ckpt-000000000010"));
  EXPECT_FALSE(fs::exists(dir / "ckpt-000000000010"));

  // A checkpoint without its manifest (the job died while writing it) is not complete, nor
  // one whose manifest is no regular file (nothing blocks on a FIFO).
  fs::remove(dir / "ckpt-000000000008" / "MANIFEST.json");
  ASSERT_EQ(0, mkfifo((dir / "ckpt-000000000008" / "MANIFEST.json").c_str(), 0600));
  skipped.clear();
  found = ps::FindNewestCheckpoint(dir.string(), &skipped);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->manifest.version, 4u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].why.find("not a regular file"), std::string::npos) << skipped[0].why;
  fs::remove(dir / "ckpt-000000000008" / "MANIFEST.json");
  skipped.clear();
  found = ps::FindNewestCheckpoint(dir.string(), &skipped);
  ASSERT_TRUE(found.ok());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].why.find("no manifest"), std::string::npos) << skipped[0].why;
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumingWithAnotherShapeOfJobIsAClearError) {
  const fs::path dir = FreshDir("mismatch");
  Config first = CheckpointJobConfig();
  first.checkpoint_dir = dir.string();
  (void)RunJob(first, 2);
  Config three = CheckpointJobConfig();
  three.num_servers = 3;
  three.resume = dir.string();
  auto c = InProcessCluster::Start(three);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("written by 2 server(s)"), std::string::npos)
      << c.status().message();
  Config slices = CheckpointJobConfig();
  slices.slice_bytes = 128;
  slices.resume = dir.string();
  c = InProcessCluster::Start(slices);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--slice-bytes 64"), std::string::npos)
      << c.status().message();
  // A checkpoint directory that cannot be made is said at the start, not at the end.
  std::ofstream(dir / "a-file") << "x";
  Config unwritable = CheckpointJobConfig();
  unwritable.checkpoint_dir = (dir / "a-file" / "ckpt").string();
  c = InProcessCluster::Start(unwritable);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--checkpoint-dir"), std::string::npos)
      << c.status().message();
  Config none = CheckpointJobConfig();
  none.resume = (dir / "nothing-here").string();
  c = InProcessCluster::Start(none);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nothing-here"), std::string::npos) << c.status().message();
  fs::remove_all(dir);
}

// A checkpoint a server cannot write is said and the job goes on; when that was the final
// one (here a periodic one falling on the job's last version), the job ends with an error.
TEST(Checkpoint, AFailedCheckpointIsSaidAndAFailedFinalOneFailsTheJob) {
  const fs::path dir = FreshDir("failing");
  // A file where a checkpoint's directory would go: its servers cannot write it.
  std::ofstream(dir / "ckpt-000000000004") << "in the way";
  Config cfg = CheckpointJobConfig();
  cfg.checkpoint_dir = dir.string();
  cfg.checkpoint_every = 4;
  Status finished;
  (void)RunJob(cfg, 10, &finished);
  EXPECT_TRUE(finished.ok()) << "a periodic failure does not stop the job: "
                             << finished.ToString();
  EXPECT_TRUE(fs::exists(dir / "ckpt-000000000008" / "MANIFEST.json"));
  EXPECT_TRUE(fs::exists(dir / "ckpt-000000000010" / "MANIFEST.json"));

  const fs::path dir2 = FreshDir("failing-final");
  std::ofstream(dir2 / "ckpt-000000000010") << "in the way";
  cfg.checkpoint_dir = dir2.string();
  cfg.checkpoint_every = 5;
  (void)RunJob(cfg, 10, &finished);
  ASSERT_FALSE(finished.ok());
  EXPECT_NE(finished.message().find("final checkpoint"), std::string::npos) << finished.message();
  EXPECT_NE(finished.message().find("ckpt-000000000010"), std::string::npos) << finished.message();
  EXPECT_TRUE(fs::exists(dir2 / "ckpt-000000000005" / "MANIFEST.json"));
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

}  // namespace
}  // namespace dsync
