// LocalGpuGroup (include/dsync/local_gpus.h): one worker process drives all its GPUs, which
// reduce their gradients with NCCL, push once, pull once and broadcast the model. Checked
// against an in-process cluster with the `sum` optimizer, so the model must equal
// init + (what the process pushed), and the servers must see one gradient per iteration.
// Without a GPU only the refusal runs; the GPU tests skip, saying why.
#include "dsync/local_gpus.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if DSYNC_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

#include "cluster_harness.h"

namespace dsync::testing {
namespace {

using ::testing::HasSubstr;

// (a) Runs everywhere: no GPU (or no NCCL in the build) is a clear refusal, not a crash, and
// the worker it was given keeps working from host memory.
TEST(LocalGpus, CreateWithoutAGpuSaysWhatToDo) {
#if DSYNC_HAVE_NCCL
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    GTEST_SKIP() << count << " CUDA device(s) visible: this checks machines without one";
  }
#endif
  LocalCluster cluster(TestConfig("bsp", 1, 1));
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  for (const std::vector<int>& devices : {std::vector<int>{}, std::vector<int>{0, 1}}) {
    LocalGpuOptions options;
    options.devices = devices;
    auto group = LocalGpuGroup::Create(*workers[0], options);
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kUnavailable);
    const std::string& message = group.status().message();
#if DSYNC_HAVE_NCCL
    EXPECT_THAT(message, HasSubstr("no CUDA device is visible"));
    EXPECT_THAT(message, HasSubstr("CUDA_VISIBLE_DEVICES"));
#else
    EXPECT_THAT(message, HasSubstr("this build has no NCCL"));
#endif
    EXPECT_THAT(message, HasSubstr("dsync::Worker directly"));
    if (devices.empty()) std::cout << "refusal: " << group.status().ToString() << "\n";
  }
  std::vector<float> w(4, 1.0f), g(4, 0.5f);
  auto t = workers[0]->Register("w", w);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Version v = 0;
  ASSERT_TRUE(workers[0]->Wait(workers[0]->PushPull(*t, g.data(), w.data()), &v).ok());
  EXPECT_EQ(v, 1u);
  ASSERT_TRUE(workers[0]->Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
}

#if DSYNC_HAVE_NCCL

// --- (b) On GPUs: every visible device, in one group -----------------------------------

::testing::AssertionResult CudaOk(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << cudaGetErrorString(err) << " ("
                                       << cudaGetErrorName(err) << ")";
}
#define ASSERT_CUDA(call) ASSERT_TRUE(CudaOk((call), #call))

// Empty when a device is visible; otherwise what the runtime said.
std::string NoGpuReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return std::string(cudaGetErrorString(err));
  return count == 0 ? "the CUDA runtime reports 0 devices" : "";
}
#define SKIP_WITHOUT_GPU()                                                         \
  if (const std::string why = NoGpuReason(); !why.empty()) {                       \
    GTEST_SKIP() << "needs a CUDA device: " << why;                                \
  }

// One float array of n elements on each GPU of the group.
class PerGpu {
 public:
  PerGpu(std::vector<int> devices, size_t n)
      : devices_(std::move(devices)), n_(n), ptrs_(devices_.size(), nullptr) {}
  ~PerGpu() {
    for (float* p : ptrs_) {
      if (p != nullptr) (void)cudaFree(p);
    }
  }
  PerGpu(const PerGpu&) = delete;
  PerGpu& operator=(const PerGpu&) = delete;

  ::testing::AssertionResult Allocate() {
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (auto r = CudaOk(cudaSetDevice(devices_[d]), "cudaSetDevice"); !r) return r;
      void* p = nullptr;
      if (auto r = CudaOk(cudaMalloc(&p, n_ * sizeof(float)), "cudaMalloc"); !r) return r;
      ptrs_[d] = static_cast<float*>(p);
    }
    return ::testing::AssertionSuccess();
  }
  // Synchronous copies: the test does not lean on the group's stream ordering.
  ::testing::AssertionResult Upload(size_t d, const std::vector<float>& host) {
    if (auto r = CudaOk(cudaSetDevice(devices_[d]), "cudaSetDevice"); !r) return r;
    if (auto r = CudaOk(cudaMemcpy(ptrs_[d], host.data(), n_ * sizeof(float),
                                   cudaMemcpyHostToDevice),
                        "cudaMemcpy H2D");
        !r) {
      return r;
    }
    return CudaOk(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ::testing::AssertionResult Poison() {
    const std::vector<float> nan(n_, std::numeric_limits<float>::quiet_NaN());
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (auto r = Upload(d, nan); !r) return r;
    }
    return ::testing::AssertionSuccess();
  }
  std::vector<float> Download(size_t d) const {
    std::vector<float> host(n_, std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(CudaOk(cudaSetDevice(devices_[d]), "cudaSetDevice"));
    EXPECT_TRUE(CudaOk(cudaMemcpy(host.data(), ptrs_[d], n_ * sizeof(float),
                                  cudaMemcpyDeviceToHost),
                       "cudaMemcpy D2H"));
    return host;
  }

  std::vector<const float*> Const() const { return {ptrs_.begin(), ptrs_.end()}; }
  const std::vector<float*>& Mut() const { return ptrs_; }

 private:
  std::vector<int> devices_;
  size_t n_;
  std::vector<float*> ptrs_;
};

std::vector<float> RandomValues(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Magnitudes in [0.5, 2), random sign: no gradient element is zero, so a GPU left out of the
// reduction cannot go unnoticed.
std::vector<float> RandomNonZero(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(0.5f, 2.0f);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

// The model a GPU holds against the float-free reference (double sums). NCCL's summation
// order is its own, so the tolerance is relative to the sum of the terms' magnitudes.
void ExpectModel(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& magnitude, const std::string& where) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(static_cast<double>(got[i]) - want[i]), 1e-6 * magnitude[i])
        << where << ", element " << i << ": got " << got[i] << ", want " << want[i];
  }
}

// One worker process, all visible GPUs, `sum` optimizer: after each PushPull every GPU holds
// init + the sum of every GPU's gradients so far, and the servers applied one gradient per
// iteration (the process's), not one per GPU.
TEST(LocalGpus, PushPullSumsTheGpusGradientsIntoOnePushAndBroadcastsTheModel) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kN = 1000;  // 4 slices of 1 KiB over both servers
  constexpr Version kIterations = 2;
  Config cfg = TestConfig("bsp", 2, 1);
  cfg.optimizer.kind = OptimizerKind::kSum;
  cfg.slice_bytes = 1024;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  Worker& worker = *workers[0];

  LocalGpuOptions options;
  options.reduce = LocalReduce::kSum;
  auto created = LocalGpuGroup::Create(worker, options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<LocalGpuGroup> group = std::move(created).value();
  int visible = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&visible));
  ASSERT_EQ(group->size(), static_cast<size_t>(visible)) << "empty devices: every visible GPU";
  const size_t gpus = group->size();
  std::cout << "group of " << gpus << " GPU(s)\n";

  std::mt19937 rng(20240604);
  const std::vector<float> init = RandomValues(kN, rng);
  auto tensor = group->Register("w", init);
  ASSERT_TRUE(tensor.ok()) << tensor.status().ToString();
  PerGpu grads(group->devices(), kN), params(group->devices(), kN);
  ASSERT_TRUE(grads.Allocate());
  ASSERT_TRUE(params.Allocate());

  // The initial model reaches every GPU through Pull (version 0, bit for bit).
  ASSERT_TRUE(params.Poison());
  auto v0 = group->Pull(*tensor, params.Mut());
  ASSERT_TRUE(v0.ok()) << v0.status().ToString();
  EXPECT_EQ(*v0, 0u);
  for (size_t d = 0; d < gpus; ++d) EXPECT_EQ(params.Download(d), init) << "GPU " << d;

  std::vector<double> want(init.begin(), init.end()), magnitude(kN);
  for (size_t i = 0; i < kN; ++i) magnitude[i] = std::fabs(want[i]);
  for (Version iter = 1; iter <= kIterations; ++iter) {
    std::vector<std::vector<float>> host_grads;
    for (size_t d = 0; d < gpus; ++d) {
      host_grads.push_back(RandomNonZero(kN, rng));
      ASSERT_TRUE(grads.Upload(d, host_grads.back()));
      for (size_t i = 0; i < kN; ++i) {
        want[i] += host_grads.back()[i];
        magnitude[i] += std::fabs(host_grads.back()[i]);
      }
    }
    ASSERT_TRUE(params.Poison());

    auto version = group->PushPull(*tensor, grads.Const(), params.Mut());
    ASSERT_TRUE(version.ok()) << version.status().ToString();
    EXPECT_EQ(*version, iter);
    for (size_t d = 0; d < gpus; ++d) {
      ExpectModel(params.Download(d), want, magnitude,
                  "iteration " + std::to_string(iter) + ", GPU " + std::to_string(d));
      EXPECT_EQ(grads.Download(d), host_grads[d]) << "gradients are not modified, GPU " << d;
    }
    // One process, one gradient per round, whatever the number of GPUs.
    const auto history = cluster.scheduler().history();
    ASSERT_EQ(history.size(), iter);
    EXPECT_EQ(history.back().members.size(), 1u);
    EXPECT_EQ(cluster.scheduler().stats().gradients_committed, iter);
    for (size_t s = 0; s < cluster.num_servers(); ++s) {
      EXPECT_EQ(cluster.server(s).stats().gradients_applied, iter) << "server " << s;
    }
  }
  EXPECT_TRUE(group->Flush().ok());
  group.reset();
  ASSERT_TRUE(worker.Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
}

// Several tensors: Push each (the last push commits the iteration), then Pull each. The
// default reduction averages over the group.
TEST(LocalGpus, PushEachTensorThenPullEachAveragesOverTheGroup) {
  SKIP_WITHOUT_GPU();
  Config cfg = TestConfig("bsp", 1, 1);
  cfg.optimizer.kind = OptimizerKind::kSum;
  LocalCluster cluster(cfg);
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  auto created = LocalGpuGroup::Create(*workers[0]);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<LocalGpuGroup> group = std::move(created).value();
  EXPECT_EQ(group->reduce(), LocalReduce::kAverage);
  const size_t gpus = group->size();

  std::mt19937 rng(7);
  const std::vector<size_t> sizes = {1000, 3};
  std::vector<TensorId> ids;
  std::vector<std::vector<float>> inits;
  std::vector<std::unique_ptr<PerGpu>> grads, params;
  std::vector<std::vector<double>> want, magnitude;
  for (size_t t = 0; t < sizes.size(); ++t) {
    inits.push_back(RandomValues(sizes[t], rng));
    auto id = group->Register("t" + std::to_string(t), inits.back());
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
    grads.push_back(std::make_unique<PerGpu>(group->devices(), sizes[t]));
    params.push_back(std::make_unique<PerGpu>(group->devices(), sizes[t]));
    ASSERT_TRUE(grads.back()->Allocate());
    ASSERT_TRUE(params.back()->Allocate());
    ASSERT_TRUE(params.back()->Poison());
    want.emplace_back(inits.back().begin(), inits.back().end());
    magnitude.emplace_back(sizes[t]);
    for (size_t i = 0; i < sizes[t]; ++i) magnitude[t][i] = std::fabs(want[t][i]);
    for (size_t d = 0; d < gpus; ++d) {
      const std::vector<float> g = RandomNonZero(sizes[t], rng);
      ASSERT_TRUE(grads[t]->Upload(d, g));
      for (size_t i = 0; i < sizes[t]; ++i) {
        want[t][i] += static_cast<double>(g[i]) / static_cast<double>(gpus);
        magnitude[t][i] += std::fabs(g[i]) / static_cast<double>(gpus);
      }
    }
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    Status st = group->Push(ids[t], grads[t]->Const());
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    auto version = group->Pull(ids[t], params[t]->Mut());
    ASSERT_TRUE(version.ok()) << version.status().ToString();
    EXPECT_EQ(*version, 1u);
    for (size_t d = 0; d < gpus; ++d) {
      ExpectModel(params[t]->Download(d), want[t], magnitude[t],
                  "tensor " + std::to_string(t) + ", GPU " + std::to_string(d));
    }
  }
  Status flushed = group->Flush();
  EXPECT_TRUE(flushed.ok()) << flushed.ToString();
  EXPECT_EQ(cluster.server(0).stats().gradients_applied, 1u);
  group.reset();
  ASSERT_TRUE(workers[0]->Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
}

// Misuse is refused with a message, before any NCCL call could hang or fault.
TEST(LocalGpus, RefusesBadDevicesAndBuffers) {
  SKIP_WITHOUT_GPU();
  LocalCluster cluster(TestConfig("bsp", 1, 1));
  ASSERT_TRUE(cluster.ok());
  auto workers = StartWorkers(cluster.WorkerConfig(), 1);
  ASSERT_EQ(workers.size(), 1u);
  int visible = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&visible));
  {
    LocalGpuOptions options;
    options.devices = {0, 0};
    auto group = LocalGpuGroup::Create(*workers[0], options);
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(group.status().message(), HasSubstr("listed twice"));
  }
  {
    LocalGpuOptions options;
    options.devices = {visible};
    auto group = LocalGpuGroup::Create(*workers[0], options);
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kUnavailable);
    EXPECT_THAT(group.status().message(), HasSubstr("CUDA_VISIBLE_DEVICES"));
  }
  auto created = LocalGpuGroup::Create(*workers[0]);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<LocalGpuGroup> group = std::move(created).value();
  const std::vector<float> init(8, 1.0f);
  auto tensor = group->Register("w", init);
  ASSERT_TRUE(tensor.ok()) << tensor.status().ToString();
  PerGpu params(group->devices(), init.size());
  ASSERT_TRUE(params.Allocate());

  std::vector<float> host(init.size());
  std::vector<float*> host_ptrs(group->size(), host.data());
  auto r = group->Pull(*tensor, host_ptrs);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("must be device memory of CUDA device"));

  std::vector<float*> too_many(params.Mut());
  too_many.push_back(params.Mut()[0]);
  r = group->Pull(*tensor, too_many);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("one pointer per GPU"));

  r = group->Pull(*tensor + 1, params.Mut());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);

  // The group still works after the refusals.
  r = group->Pull(*tensor, params.Mut());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (size_t d = 0; d < group->size(); ++d) EXPECT_EQ(params.Download(d), init);
  group.reset();
  ASSERT_TRUE(workers[0]->Leave().ok());
  EXPECT_TRUE(cluster.WaitFinished().ok());
}

#endif  // DSYNC_HAVE_NCCL

}  // namespace
}  // namespace dsync::testing
