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

#include "cluster_harness.h"
#include "fashion_mnist.h"
#include "mlp.h"
#include "mlp_train.h"

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

}  // namespace
}  // namespace dsync::train
