// The workers' GPU math (--worker-math): its selection and the errors that stop a run before
// it starts (these run anywhere), and GpuMlp against the CPU Mlp (these skip, with the
// runtime's reason, where no CUDA device is visible).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "cluster_harness.h"
#include "fashion_mnist.h"
#include "mlp.h"
#include "mlp_math.h"
#include "mlp_train.h"

namespace dsync::train {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool HaveData() {
  return std::filesystem::exists(std::string(kDefaultDataDir) + "/train-images-idx3-ubyte.gz");
}

// Skips where the GPU math cannot run, saying why (no device, a build without CUDA); where
// it can, creating a GpuMlp must then succeed.
#define REQUIRE_GPU()                                                          \
  if (auto gpu_ok_ = ResolveMlpMath(MlpMathKind::kCuda); !gpu_ok_.ok())       \
  GTEST_SKIP() << gpu_ok_.status().message()

// Runs a shell command; returns its wait status, its output (stdout and stderr) in *out.
int RunShell(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  return pclose(p);
}

TEST(MlpMath, ParsesTheThreeChoices) {
  for (MlpMathKind k : {MlpMathKind::kCpu, MlpMathKind::kCuda, MlpMathKind::kAuto}) {
    auto parsed = ParseMlpMath(MlpMathName(k));
    ASSERT_TRUE(parsed.ok()) << MlpMathName(k);
    EXPECT_EQ(*parsed, k);
  }
  auto bad = ParseMlpMath("gpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'gpu' is not one of cpu, cuda, auto"));
  EXPECT_EQ(*ResolveMlpMath(MlpMathKind::kCpu), MlpMathKind::kCpu);
  EXPECT_EQ(MlpTrainOptions{}.math, MlpMathKind::kCpu) << "existing runs stay on the CPU";
}

TEST(MlpMath, CudaWithoutADeviceIsAClearError) {
  auto r = ResolveMlpMath(MlpMathKind::kCuda);
  if (r.ok()) GTEST_SKIP() << "a CUDA device is visible here; the error needs a machine without";
  const std::string& msg = r.status().message();
  if (BuildHasCudaMath()) {
    EXPECT_THAT(msg, StartsWith("no CUDA device is visible ("));
    EXPECT_THAT(msg, EndsWith("); use --worker-math cpu"));
    EXPECT_GT(msg.size(), std::string("no CUDA device is visible (); use --worker-math cpu").size())
        << "the runtime's reason is part of the message";
  } else {
    EXPECT_THAT(msg, HasSubstr("this build has no CUDA worker math"));
    EXPECT_THAT(msg, HasSubstr("use --worker-math cpu"));
  }
  // auto quietly falls back; building the GPU math directly fails the same way.
  EXPECT_EQ(*ResolveMlpMath(MlpMathKind::kAuto), MlpMathKind::kCpu);
  auto gpu = MakeCudaMlp({4, 3, 2}, 2);
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().message(), msg);
}

// cuBLAS is opened at run time (not linked): the library and every entry point used must be
// found wherever the build has CUDA, device or not.
TEST(MlpMath, CublasLoadsWhereTheBuildHasCuda) {
  if (!BuildHasCudaMath()) GTEST_SKIP() << "this build has no CUDA worker math";
  Status s = LoadCudaMathLibraries();
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// The user's path: the launcher and a worker refuse before anything starts (no job headline,
// no connection attempt: the worker names no reachable scheduler).
TEST(MlpMath, TheProgramRefusesCudaWithoutADeviceBeforeStarting) {
  if (ResolveMlpMath(MlpMathKind::kCuda).ok()) GTEST_SKIP() << "a CUDA device is visible here";
  const std::string bin = DSYNC_BINARY;
  std::string out;
  int st = RunShell("timeout 60 " + bin + " train --worker-math cuda --workers 1 --servers 1 "
               "--epochs 0.01",
               &out);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 1) << out;
  EXPECT_THAT(out, HasSubstr("use --worker-math cpu"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("worker(s)"))) << "the job must not have started";
  if (BuildHasCudaMath()) {
    EXPECT_THAT(out, HasSubstr("no CUDA device is visible ("));
  }

  out.clear();
  st = RunShell("timeout 60 " + bin +
                    " worker --token t --model mlp --worker-math cuda --scheduler-port 1 "
                    "--connect-timeout-ms 100",
           &out);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 1) << out;
  EXPECT_THAT(out, HasSubstr("use --worker-math cpu"));

  out.clear();
  st = RunShell("timeout 60 " + bin + " compare --worker-math gpu", &out);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 2) << out;
  EXPECT_THAT(out, HasSubstr("--worker-math 'gpu' is not one of cpu, cuda, auto"));
}

// --- The CPU and the GPU compute the same thing -------------------------------------------

TEST(Mlp, GradientNormIsTheL2NormOfEveryTensor) {
  Mlp model({6, 5, 3}, 4);
  std::vector<std::vector<float>> params = model.Initialize(2);
  std::vector<const float*> pp;
  for (const auto& p : params) pp.push_back(p.data());
  std::vector<std::vector<float>> grads;
  std::vector<float*> gp;
  for (const auto& p : params) grads.emplace_back(p.size(), kNaN);
  for (auto& g : grads) gp.push_back(g.data());
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(4 * 6);
  for (float& v : x) v = n(rng);
  const std::vector<uint8_t> labels = {0, 2, 1, 2};
  model.Gradient(pp, x.data(), labels.data(), 4, gp);
  double squares = 0;
  for (const auto& g : grads) {
    for (float v : g) squares += double{v} * v;
  }
  EXPECT_GT(squares, 0.0);
  EXPECT_NEAR(model.last_gradient_norm(), std::sqrt(squares), 1e-7 * std::sqrt(squares));
}

const std::vector<uint32_t> kSizes = {784, 256, 128, 10};

struct Model {
  std::vector<std::vector<float>> params;
  std::vector<const float*> ptrs;
};

// He-initialized weights with non-zero biases (a zero bias would hide a bias bug).
Model RandomModel(uint32_t seed) {
  Model m;
  m.params = Mlp(kSizes, 1).Initialize(seed);
  std::mt19937 rng(seed + 7);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (size_t t = 1; t < m.params.size(); t += 2) {
    for (float& v : m.params[t]) v = n(rng);
  }
  for (const auto& p : m.params) m.ptrs.push_back(p.data());
  return m;
}

// Whether sample x is far (margin) from a ReLU kink in every hidden unit and from a tie for
// the largest logit, computed in double. Near those the CPU and the GPU may legitimately
// disagree (their GEMMs sum in different orders) on a ReLU mask or an argmax, which would
// change a gradient row or a prediction outright: such samples are left out.
bool WellConditioned(const Model& m, const float* x, double margin) {
  std::vector<double> in(x, x + kSizes[0]);
  for (size_t l = 1; l < kSizes.size(); ++l) {
    const float* w = m.params[2 * (l - 1)].data();
    const float* b = m.params[2 * (l - 1) + 1].data();
    std::vector<double> out(kSizes[l]);
    for (uint32_t o = 0; o < kSizes[l]; ++o) {
      double z = b[o];
      for (uint32_t i = 0; i < kSizes[l - 1]; ++i) {
        z += double{w[size_t{o} * kSizes[l - 1] + i]} * in[i];
      }
      out[o] = z;
    }
    if (l + 1 < kSizes.size()) {
      for (double& z : out) {
        if (std::abs(z) < margin) return false;
        z = std::max(z, 0.0);
      }
    } else {
      std::vector<double> sorted = out;
      std::sort(sorted.rbegin(), sorted.rend());
      if (sorted[0] - sorted[1] < margin) return false;
    }
    in = std::move(out);
  }
  return true;
}

// `count` well-conditioned samples for model m: Fashion-MNIST training images where the data
// is installed, random pixels and labels elsewhere.
Dataset Samples(const Model& m, uint32_t count, uint32_t seed) {
  static const Dataset source = [] {  // loaded once: the tests draw from it several times
    if (!HaveData()) return Dataset{};
    auto train = LoadFashionMnist(kDefaultDataDir, "train");
    return train.ok() ? std::move(*train) : Dataset{};
  }();
  std::mt19937 rng(seed);
  Dataset d;
  d.rows = 28;
  d.cols = 28;
  std::vector<float> x(d.features());
  std::vector<uint8_t> img(d.features());
  uint32_t tries = 0;
  while (d.count < count && ++tries < 20 * count) {
    uint8_t label = 0;
    if (source.count) {
      const auto i = static_cast<uint32_t>(rng() % source.count);
      std::copy(source.image(i), source.image(i) + d.features(), img.begin());
      label = source.labels[i];
    } else {
      for (uint8_t& p : img) p = static_cast<uint8_t>(rng() % 256);
      label = static_cast<uint8_t>(rng() % 10);
    }
    for (uint32_t j = 0; j < d.features(); ++j) x[j] = static_cast<float>(img[j]) / 255.0f;
    if (!WellConditioned(m, x.data(), 1e-4)) continue;
    d.pixels.insert(d.pixels.end(), img.begin(), img.end());
    d.labels.push_back(label);
    ++d.count;
  }
  return d;
}

struct Grads {
  std::vector<std::vector<float>> values;
  std::vector<float*> ptrs;
  explicit Grads(const Model& m) {
    for (const auto& p : m.params) values.emplace_back(p.size(), kNaN);  // poisoned
    for (auto& g : values) ptrs.push_back(g.data());
  }
};

// Elements outside |gpu - cpu| <= 1e-4 |cpu| + 1e-6, with the first one described.
size_t Mismatches(const Grads& gpu, const Grads& cpu, const Mlp& model, std::string* first) {
  size_t bad = 0;
  for (size_t t = 0; t < cpu.values.size(); ++t) {
    for (size_t i = 0; i < cpu.values[t].size(); ++i) {
      const float c = cpu.values[t][i], g = gpu.values[t][i];
      const bool ok = std::isfinite(g) && std::abs(g - c) <= 1e-4f * std::abs(c) + 1e-6f;
      if (!ok && bad++ == 0) {
        *first = model.params()[t].name + "[" + std::to_string(i) + "]: gpu " +
                 std::to_string(g) + ", cpu " + std::to_string(c);
      }
    }
  }
  return bad;
}

TEST(GpuMlp, GradientLossAndNormMatchTheCpu) {
  REQUIRE_GPU();
  openblas_set_num_threads(1);
  constexpr uint32_t kMaxBatch = 128;
  Mlp cpu(kSizes, kMaxBatch);
  auto made = MakeCudaMlp(kSizes, kMaxBatch);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  MlpMath& gpu = **made;
  // A fresh model per call: parameters are uploaded every time, never reused stale. Batch
  // sizes: partial buffers, full buffers, a single sample, an odd size.
  uint32_t seed = 11;
  for (uint32_t batch : {64u, 128u, 1u, 37u}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    const Model m = RandomModel(++seed);
    const Dataset data = Samples(m, batch, seed);
    ASSERT_EQ(data.count, batch);
    std::vector<uint32_t> idx(batch);
    std::iota(idx.begin(), idx.end(), 0u);
    std::vector<float> x(size_t{batch} * data.features());
    std::vector<uint8_t> labels(batch);
    Mlp::Gather(data, idx.data(), batch, x.data(), labels.data());

    Grads want(m), got(m);
    const float cpu_loss = cpu.Gradient(m.ptrs, x.data(), labels.data(), batch, want.ptrs);
    const float gpu_loss = gpu.Gradient(m.ptrs, x.data(), labels.data(), batch, got.ptrs);
    ASSERT_TRUE(gpu.status().ok()) << gpu.status().ToString();
    EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss));
    std::string first;
    EXPECT_EQ(Mismatches(got, want, cpu, &first), 0u) << "first: " << first;
    // The norm, from the CPU's gradient in double, as both sides compute it.
    double squares = 0;
    for (const auto& g : want.values) {
      for (float v : g) squares += double{v} * v;
    }
    // (OpenBLAS's dsdot kernels agree with an exact double sum to ~1e-9, not bit for bit.)
    EXPECT_NEAR(cpu.last_gradient_norm(), std::sqrt(squares), 1e-7 * std::sqrt(squares));
    EXPECT_GT(cpu.last_gradient_norm(), 0.0);
    EXPECT_NEAR(gpu.last_gradient_norm(), cpu.last_gradient_norm(),
                1e-5 * cpu.last_gradient_norm());
  }
}

TEST(GpuMlp, EvaluateMatchesTheCpu) {
  REQUIRE_GPU();
  openblas_set_num_threads(1);
  const Model m = RandomModel(5);
  const Dataset data = Samples(m, 300, 5);  // 128 + 128 + 44: a partial last batch
  ASSERT_EQ(data.count, 300u);
  Mlp cpu(kSizes, 128);
  auto made = MakeCudaMlp(kSizes, 128);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  for (uint32_t limit : {0u, 200u}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    const Evaluation want = cpu.Evaluate(m.ptrs, data, limit);
    const Evaluation got = (*made)->Evaluate(m.ptrs, data, limit);
    ASSERT_TRUE((*made)->status().ok()) << (*made)->status().ToString();
    EXPECT_EQ(got.samples, want.samples);
    // No logit ties (WellConditioned): the same predictions, to the sample.
    EXPECT_EQ(got.accuracy, want.accuracy);
    EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss);
  }
}

TEST(GpuMlp, ABatchAboveItsBuffersIsAnErrorAndNaNs) {
  REQUIRE_GPU();
  const Model m = RandomModel(3);
  auto made = MakeCudaMlp(kSizes, 4);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::vector<float> x(5 * 784, 0.5f);
  std::vector<uint8_t> labels(5, 1);
  Grads got(m);
  for (auto& g : got.values) std::fill(g.begin(), g.end(), 0.0f);
  const float loss = (*made)->Gradient(m.ptrs, x.data(), labels.data(), 5, got.ptrs);
  EXPECT_TRUE(std::isnan(loss));
  ASSERT_FALSE((*made)->status().ok());
  EXPECT_THAT((*made)->status().message(), HasSubstr("batch 5"));
  for (const auto& g : got.values) EXPECT_TRUE(std::isnan(g.front()) && std::isnan(g.back()));
}

TEST(GpuMlp, TrainsFashionMnistThroughTheParameterServer) {
  REQUIRE_GPU();
  if (!HaveData()) GTEST_SKIP() << "Fashion-MNIST is not installed here";
  auto train = LoadFashionMnist(kDefaultDataDir, "train");
  auto test = LoadFashionMnist(kDefaultDataDir, "t10k");
  ASSERT_TRUE(train.ok() && test.ok());
  openblas_set_num_threads(1);
  Config cfg = dsync::testing::TestConfig("bsp", 1, 2);
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 0.1f;
  dsync::testing::LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = dsync::testing::StartWorkers(cluster.WorkerConfig(), 2);
  ASSERT_EQ(workers.size(), 2u);
  std::vector<Result<MlpTrainReport>> reports(2, Status(StatusCode::kAborted, "not run"));
  std::vector<double> norms(2, 0);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      MlpTrainOptions o;
      o.iterations = 150;  // as the CPU test in train_test.cc: a third of an epoch
      o.shard = r;
      o.shards = 2;
      o.eval_every = 0;
      o.math = MlpMathKind::kCuda;
      reports[r] = TrainMlp(*workers[r], *train, *test, o,
                            [&, r](const Progress& p) { norms[r] = p.grad_norm; });
      EXPECT_TRUE(workers[r]->Leave().ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(cluster.WaitFinished().ok());
  for (uint32_t r = 0; r < 2; ++r) {
    const auto& rep = reports[r];
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    EXPECT_EQ(rep->math, MlpMathKind::kCuda);
    EXPECT_EQ(rep->iterations, 150u);
    EXPECT_EQ(rep->final_version, 150u);
    EXPECT_EQ(rep->final_eval.samples, 10000u);
    EXPECT_GE(rep->final_eval.accuracy, 0.70) << "test loss " << rep->final_eval.loss;
    EXPECT_TRUE(std::isfinite(norms[r]) && norms[r] > 0) << norms[r];
  }
  EXPECT_EQ(reports[0]->final_eval.accuracy, reports[1]->final_eval.accuracy);
}

}  // namespace
}  // namespace dsync::train
