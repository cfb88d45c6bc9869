// In-process clusters for integration tests: a scheduler and S servers on their own
// threads, each with its own transport on 127.0.0.1 ephemeral ports; workers are started by
// the tests (on threads, since the first workers are admitted together).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "dsync/config.h"
#include "dsync/in_process_cluster.h"
#include "dsync/scheduler.h"
#include "dsync/server.h"
#include "dsync/worker.h"

namespace dsync::testing {

inline Config TestConfig(const char* sync, uint32_t servers, uint32_t workers) {
  Config c;
  c.sync = SyncMode::Parse(sync).value();
  c.num_servers = servers;
  c.num_workers = workers;
  c.scheduler_port = 0;
  c.token = "test-token";
  c.heartbeat_interval_ms = 100;
  c.heartbeat_timeout_ms = 2000;
  c.connect_timeout_ms = 5000;
  return c;
}

// InProcessCluster for tests: a failure to start is a test failure.
class LocalCluster {
 public:
  explicit LocalCluster(Config config) {
    auto c = InProcessCluster::Start(std::move(config));
    if (!c.ok()) {
      ADD_FAILURE() << "starting the cluster: " << c.status().ToString();
      return;
    }
    cluster_ = std::move(c).value();
  }

  bool ok() const { return cluster_ && cluster_->num_servers() == cluster_->config().num_servers; }
  const Config& config() const { return cluster_->config(); }
  Config WorkerConfig() const { return cluster_->WorkerConfig(); }
  Scheduler& scheduler() { return cluster_->scheduler(); }
  Server& server(size_t i) { return cluster_->server(i); }
  size_t num_servers() const { return cluster_->num_servers(); }
  Status WaitFinished(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    return cluster_->WaitFinished(timeout);
  }

 private:
  std::unique_ptr<InProcessCluster> cluster_;
};

// Starts n workers concurrently (they are admitted together).
inline std::vector<std::unique_ptr<Worker>> StartWorkers(const Config& config, int n) {
  std::vector<std::future<Result<std::unique_ptr<Worker>>>> f;
  for (int i = 0; i < n; ++i) {
    f.push_back(std::async(std::launch::async, [&config] { return Worker::Start(config); }));
  }
  std::vector<std::unique_ptr<Worker>> out;
  for (auto& x : f) {
    auto w = x.get();
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    if (w.ok()) out.push_back(std::move(w).value());
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a->job().worker_id < b->job().worker_id; });
  return out;
}

// Checks the bound and quorum invariants (docs/contract.md) on the scheduler's decisions.
inline void ExpectRoundInvariants(const std::vector<RoundRecord>& rounds, const SyncMode& mode) {
  Round expected = 0;
  for (const RoundRecord& r : rounds) {
    EXPECT_EQ(r.round, expected++);
    EXPECT_GE(r.live_members, r.quorum_needed) << "round " << r.round << " closed under quorum";
    for (size_t i = 0; i < r.members.size(); ++i) {
      if (i > 0) {
        EXPECT_LT(r.members[i - 1].worker, r.members[i].worker);
      }
      if (mode.kind == SyncKind::kRound) {
        EXPECT_LE(r.round - r.members[i].base, mode.bound)
            << "round " << r.round << ": worker " << r.members[i].worker << " clock "
            << r.members[i].clock << " base " << r.members[i].base;
      }
    }
  }
}

// Small least-squares problem: y = <x, w*> + b* + noise, deterministic from a seed.
class LinearData {
 public:
  LinearData(uint32_t dim, uint32_t samples, uint32_t seed) : dim_(dim), x_(dim * samples), y_(samples) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> w(dim);
    for (float& v : w) v = n(rng);
    for (uint32_t i = 0; i < samples; ++i) {
      float dot = 0.5f;
      for (uint32_t j = 0; j < dim; ++j) {
        x_[i * dim + j] = n(rng);
        dot += x_[i * dim + j] * w[j];
      }
      y_[i] = dot + 0.01f * n(rng);
    }
  }
  uint32_t dim() const { return dim_; }
  uint32_t samples() const { return static_cast<uint32_t>(y_.size()); }

  // Gradient of the mean of 0.5 (pred - y)^2 over samples [first, first + count).
  void Gradient(const float* w, float b, uint32_t first, uint32_t count, float* gw,
                float* gb) const {
    std::fill(gw, gw + dim_, 0.0f);
    *gb = 0.0f;
    for (uint32_t k = 0; k < count; ++k) {
      const uint32_t i = (first + k) % samples();
      float pred = b;
      for (uint32_t j = 0; j < dim_; ++j) pred += x_[i * dim_ + j] * w[j];
      const float err = pred - y_[i];
      for (uint32_t j = 0; j < dim_; ++j) gw[j] += err * x_[i * dim_ + j];
      *gb += err;
    }
    const float inv = 1.0f / static_cast<float>(count);
    for (uint32_t j = 0; j < dim_; ++j) gw[j] *= inv;
    *gb *= inv;
  }

  float Loss(const float* w, float b) const {
    double sum = 0;
    for (uint32_t i = 0; i < samples(); ++i) {
      float pred = b;
      for (uint32_t j = 0; j < dim_; ++j) pred += x_[i * dim_ + j] * w[j];
      sum += 0.5 * (pred - y_[i]) * (pred - y_[i]);
    }
    return static_cast<float>(sum / samples());
  }

 private:
  uint32_t dim_;
  std::vector<float> x_;
  std::vector<float> y_;
};

}  // namespace dsync::testing
