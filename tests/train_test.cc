// The training application: the Fashion-MNIST loader (known statistics of Debian's files,
// clear errors for missing, corrupt and truncated ones), the MLP's gradients against finite
// differences, and a short distributed training run through the PS.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cblas.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "cluster_harness.h"
#include "fashion_mnist.h"
#include "mlp.h"
#include "mlp_train.h"
#include "run_metrics.h"

namespace dsync::train {
namespace {

namespace fs = std::filesystem;

bool HaveData() {
  return fs::exists(std::string(kDefaultDataDir) + "/train-images-idx3-ubyte.gz");
}

#define REQUIRE_DATA()                                                                   \
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST is not installed here (Debian package " \
                                   "dataset-fashion-mnist; scripts/deps.sh installs it)"

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("dsync-train-" + std::to_string(getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void WriteGzip(const fs::path& p, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

TEST(FashionMnist, TrainAndTestSetsHaveTheKnownContents) {
  REQUIRE_DATA();
  auto train = LoadFashionMnist(kDefaultDataDir, "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  EXPECT_EQ(train->count, 60000u);
  EXPECT_EQ(train->rows, 28u);
  EXPECT_EQ(train->cols, 28u);
  ASSERT_EQ(train->pixels.size(), 60000u * 784);
  std::array<uint32_t, 10> per_class{};
  for (uint8_t l : train->labels) ++per_class.at(l);
  for (uint32_t n : per_class) EXPECT_EQ(n, 6000u);
  EXPECT_EQ(std::vector<uint8_t>(train->labels.begin(), train->labels.begin() + 10),
            (std::vector<uint8_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  uint64_t first = 0;
  for (uint32_t j = 0; j < 784; ++j) first += train->image(0)[j];
  EXPECT_EQ(first, 76247u);  // mean pixel of the first image: 97.25
  uint64_t all = 0;
  for (uint8_t p : train->pixels) all += p;
  EXPECT_NEAR(static_cast<double>(all) / static_cast<double>(train->pixels.size()), 72.9404, 1e-3);

  auto test = LoadFashionMnist(kDefaultDataDir, "t10k");
  ASSERT_TRUE(test.ok()) << test.status().ToString();
  EXPECT_EQ(test->count, 10000u);
  EXPECT_EQ(std::vector<uint8_t>(test->labels.begin(), test->labels.begin() + 10),
            (std::vector<uint8_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
  uint64_t first_test = 0;
  for (uint32_t j = 0; j < 784; ++j) first_test += test->image(0)[j];
  EXPECT_EQ(first_test, 33456u);
}

TEST(FashionMnist, MissingFilesNameThePackage) {
  TempDir dir;
  auto r = LoadFashionMnist(dir.path().string(), "train");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("apt-get install dataset-fashion-mnist"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(LoadFashionMnist(kDefaultDataDir, "validation").ok());
}

TEST(FashionMnist, TruncatedAndCorruptFilesAreRefusedClearly) {
  TempDir dir;
  // A valid-looking IDX whose header promises more images than it holds.
  std::vector<uint8_t> images = {0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2};
  images.resize(images.size() + 2 * 4, 7);  // 2 images of 2x2 instead of 3
  std::vector<uint8_t> labels = {0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3};
  WriteGzip(dir.path() / "train-images-idx3-ubyte.gz", images);
  WriteGzip(dir.path() / "train-labels-idx1-ubyte.gz", labels);
  auto r = LoadFashionMnist(dir.path().string(), "train");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("header promises 28"), std::string::npos)
      << r.status().message();

  // The gzip stream itself cut in half.
  const std::string real = std::string(kDefaultDataDir) + "/t10k-labels-idx1-ubyte.gz";
  if (fs::exists(real)) {
    std::ifstream in(real, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(dir.path() / "t10k-labels-idx1-ubyte.gz", std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
    fs::copy_file(std::string(kDefaultDataDir) + "/t10k-images-idx3-ubyte.gz",
                  dir.path() / "t10k-images-idx3-ubyte.gz");
    auto cut = LoadFashionMnist(dir.path().string(), "t10k");
    ASSERT_FALSE(cut.ok());
    EXPECT_NE(cut.status().message().find("t10k-labels-idx1-ubyte.gz"), std::string::npos);
    EXPECT_NE(cut.status().message().find("reinstall dataset-fashion-mnist"), std::string::npos)
        << cut.status().message();
  }

  // Bytes that are no IDX at all, and a label outside 0..9.
  std::ofstream(dir.path() / "train-labels-idx1-ubyte.gz") << "certainly not a data set";
  auto garbage = LoadFashionMnist(dir.path().string(), "train");
  ASSERT_FALSE(garbage.ok());
  WriteGzip(dir.path() / "train-images-idx3-ubyte.gz",
            {0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 200});
  WriteGzip(dir.path() / "train-labels-idx1-ubyte.gz", {0, 0, 8, 1, 0, 0, 0, 1, 12});
  auto bad_label = LoadFashionMnist(dir.path().string(), "train");
  ASSERT_FALSE(bad_label.ok());
  EXPECT_NE(bad_label.status().message().find("label 12"), std::string::npos);
}

TEST(Mlp, GradientsMatchFiniteDifferences) {
  Mlp model({6, 5, 4, 3}, 4);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 0.7f);
  std::vector<std::vector<float>> params = model.Initialize(5);
  for (auto& p : params) {
    for (float& v : p) v += 0.1f * n(rng);  // non-zero biases too
  }
  std::vector<float> x(4 * 6);
  for (float& v : x) v = n(rng);
  const std::vector<uint8_t> labels = {0, 2, 1, 2};
  std::vector<std::vector<float>> grads;
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (auto& p : params) {
    grads.emplace_back(p.size());
    pp.push_back(p.data());
  }
  for (auto& g : grads) gp.push_back(g.data());
  model.Gradient(pp, x.data(), labels.data(), 4, gp);

  std::vector<std::vector<float>> scratch(grads);
  std::vector<float*> sp;
  for (auto& g : scratch) sp.push_back(g.data());
  auto loss = [&] { return static_cast<double>(model.Gradient(pp, x.data(), labels.data(), 4, sp)); };
  int checked = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    for (size_t i = 0; i < params[t].size(); ++i) {
      const float keep = params[t][i];
      const float h = 1e-2f;
      params[t][i] = keep + h;
      const double up = loss();
      params[t][i] = keep - h;
      const double down = loss();
      params[t][i] = keep;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(grads[t][i], numeric, 2e-3 + 2e-2 * std::abs(numeric))
          << model.params()[t].name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6 * 5 + 5 + 5 * 4 + 4 + 4 * 3 + 3);
}

TEST(Mlp, LearnsFashionMnistThroughTheParameterServer) {
  REQUIRE_DATA();
  auto train = LoadFashionMnist(kDefaultDataDir, "train");
  auto test = LoadFashionMnist(kDefaultDataDir, "t10k");
  ASSERT_TRUE(train.ok() && test.ok());
  openblas_set_num_threads(1);  // two workers share two cores
  Config cfg = dsync::testing::TestConfig("bsp", 1, 2);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.1f;
  dsync::testing::LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = dsync::testing::StartWorkers(cluster.WorkerConfig(), 2);
  ASSERT_EQ(workers.size(), 2u);
  std::vector<Result<MlpTrainReport>> reports(2, Status(StatusCode::kAborted, "not run"));
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      MlpTrainOptions o;
      o.iterations = 150;  // bounded: 150 rounds of 2 x 64 samples, a third of an epoch
      o.shard = r;
      o.shards = 2;
      o.eval_every = 0;
      reports[r] = TrainMlp(*workers[r], *train, *test, o);
      EXPECT_TRUE(workers[r]->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());
  for (const auto& rep : reports) {
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_EQ(rep->iterations, 150u);
    EXPECT_EQ(rep->final_version, 150u);
    EXPECT_EQ(rep->final_eval.samples, 10000u);
    EXPECT_GE(rep->final_eval.accuracy, 0.70) << "test loss " << rep->final_eval.loss;
  }
  std::printf("test accuracy after 150 rounds of 2 x 64 samples: %.4f (loss %.4f)\n",
              reports[0]->final_eval.accuracy, reports[0]->final_eval.loss);
  // Both workers read the same final model: the same accuracy to the last sample.
  EXPECT_EQ(reports[0]->final_eval.accuracy, reports[1]->final_eval.accuracy);
}

// --- What a run measured ------------------------------------------------------------------

RunMetrics Curve(std::initializer_list<std::pair<double, double>> points) {
  RunMetrics m;
  m.target = 0.85;
  Version round = 0;
  for (const auto& [t, acc] : points) m.curve.push_back({t, round += 10, 0, acc, 0, 0});
  ComputeTargetTimes(m);
  return m;
}

TEST(RunMetrics, TimeToTargetIsTheFirstCrossingAndStaysFromTheLastDip) {
  const RunMetrics m = Curve({{1, 0.5}, {2, 0.86}, {3, 0.84}, {4, 0.85}, {5, 0.87}});
  ASSERT_TRUE(m.first_reach_s && m.stays_from_s);
  EXPECT_EQ(*m.first_reach_s, 2);
  EXPECT_EQ(*m.first_reach_round, 20u);
  EXPECT_EQ(*m.stays_from_s, 4);  // 0.85 counts as reached
  EXPECT_EQ(*m.stays_from_round, 40u);
  // A final model below the target: it never "stays", though it reached it once.
  const RunMetrics dropped = Curve({{1, 0.86}, {2, 0.84}});
  EXPECT_TRUE(dropped.first_reach_s.has_value());
  EXPECT_FALSE(dropped.stays_from_s.has_value());
  const RunMetrics never = Curve({{1, 0.5}, {2, 0.6}});
  EXPECT_FALSE(never.first_reach_s || never.stays_from_s);
  EXPECT_FALSE(Curve({}).first_reach_s.has_value());
}

TEST(RunMetrics, TableCsvAndJsonCarryEveryMode) {
  RunMetrics a = Curve({{1, 0.5}, {2, 0.9}});
  a.label = "bsp";
  a.ok = true;
  a.seconds = 2.5;
  a.final_accuracy = 0.9;
  RunMetrics b = Curve({{1, 0.5}, {2, 0.6}});
  b.label = "dsync:4,3";
  const std::string table = CompareTable({a, b});
  EXPECT_NE(table.find("bsp"), std::string::npos);
  EXPECT_NE(table.find("dsync:4,3"), std::string::npos);
  EXPECT_NE(table.find("(job FAILED)"), std::string::npos) << "b.ok is false\n" << table;
  const fs::path dir = fs::temp_directory_path() / ("dsync_metrics_" + std::to_string(getpid()));
  fs::create_directories(dir);
  ASSERT_TRUE(WriteCompareCsv({a, b}, (dir / "c.csv").string()).ok());
  std::ifstream csv(dir / "c.csv");
  std::string header, row_a, row_b;
  std::getline(csv, header);
  std::getline(csv, row_a);
  std::getline(csv, row_b);
  EXPECT_TRUE(header.starts_with("mode,ok,seconds,"));
  EXPECT_TRUE(row_a.starts_with("bsp,1,2.500,")) << row_a;
  EXPECT_TRUE(row_b.starts_with("\"dsync:4,3\",0,")) << row_b;  // quoted: it holds a comma
  ASSERT_TRUE(WriteCurveCsv(a, (dir / "curve.csv").string()).ok());
  std::ifstream curve(dir / "curve.csv");
  std::string line;
  int rows = 0;
  while (std::getline(curve, line)) ++rows;
  EXPECT_EQ(rows, 3);
  const std::string json = SummaryJson(a);
  EXPECT_NE(json.find("\"first_reach_s\":2"), std::string::npos) << json;
  EXPECT_NE(SummaryJson(b).find("\"first_reach_s\":null"), std::string::npos);
  EXPECT_EQ(FileSafe("dsync:4,3"), "dsync_4_3");
  EXPECT_FALSE(WriteCurveCsv(a, (dir / "missing" / "x.csv").string()).ok());
  fs::remove_all(dir);
}

TEST(SnapshotEvaluator, QueueAllEvaluatesEverySnapshotNewestFirstAndSkipDropsWhenBusy) {
  auto test = LoadFashionMnist(kDefaultDataDir, "t10k");
  ASSERT_TRUE(test.ok()) << test.status().ToString();
  const std::vector<uint32_t> sizes = LayerSizes(*test, {16});
  Mlp model(sizes, 1);
  auto params = model.Initialize(3);
  std::vector<std::span<const float>> views(params.begin(), params.end());
  {
    SnapshotEvaluator all(*test, sizes, 2000, SnapshotEvaluator::Policy::kQueueAll,
                          /*low_priority=*/true);
    for (uint32_t i = 0; i < 5; ++i) EXPECT_TRUE(all.Offer(views, i, i * 10, i * 0.5));
    all.Drain();
    auto points = all.Take();
    ASSERT_EQ(points.size(), 5u);
    std::set<uint32_t> seen;
    for (const EvalPoint& p : points) {
      seen.insert(p.iteration);
      EXPECT_EQ(p.version, p.iteration * 10u);
      EXPECT_DOUBLE_EQ(p.seconds, p.iteration * 0.5);
      EXPECT_EQ(p.eval.samples, 2000u);
      EXPECT_GT(p.eval.accuracy, 0.0);  // an untrained model: ~10 %, but evaluated
    }
    EXPECT_EQ(seen.size(), 5u);
    EXPECT_TRUE(all.Take().empty());
  }
  SnapshotEvaluator skip(*test, sizes, 0, SnapshotEvaluator::Policy::kSkipWhenBusy);
  int offered = 0;
  for (uint32_t i = 0; i < 50; ++i) offered += skip.Offer(views, i, i, 0) ? 1 : 0;
  skip.Drain();
  EXPECT_GE(offered, 1);
  EXPECT_LT(offered, 50) << "a busy evaluator skips instead of queueing";
  EXPECT_EQ(skip.Take().size(), static_cast<size_t>(offered));
}

}  // namespace
}  // namespace dsync::train
