// The staleness policy damp's growth watch (ps/growth_watch.h): when a job's gradients grow,
// on synthetic traces against a plain reference; and the gradient size the workers report.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "ps/growth_watch.h"

namespace dsync::ps {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The rule written plainly: the lower median of the measured sizes, two running means from
// the first measured round, growth once past the warm-up.
std::optional<Round> ReferenceFiring(const std::vector<std::vector<float>>& rounds,
                                     const GrowthWatchOptions& o = {}) {
  double slow = 0, fast = 0;
  uint64_t measured = 0;
  for (Round r = 0; r < rounds.size(); ++r) {
    std::vector<float> m;
    for (float v : rounds[r]) {
      if (std::isnan(v)) v = kInf;
      if (v > 0) m.push_back(v);
    }
    if (m.empty()) continue;
    std::sort(m.begin(), m.end());
    const double size = m[(m.size() - 1) / 2];
    ++measured;
    if (!std::isfinite(size)) return r;
    if (measured == 1) {
      slow = fast = size;
    } else {
      slow = slow + o.slow * (size - slow);
      fast = fast + o.fast * (size - fast);
    }
    if (measured > o.warmup && fast > o.ratio * slow) return r;
  }
  return std::nullopt;
}

// Feeds every round; checks that it fires at most once, where the reference does.
std::optional<Round> Feed(GrowthWatch& watch, std::vector<std::vector<float>> rounds) {
  const auto expected = ReferenceFiring(rounds);
  std::optional<Round> fired;
  for (Round r = 0; r < rounds.size(); ++r) {
    if (watch.RoundClosed(r, rounds[r])) {
      EXPECT_FALSE(fired.has_value()) << "fired twice: " << *fired << " and " << r;
      fired = r;
    }
  }
  EXPECT_EQ(fired, expected);
  EXPECT_EQ(watch.fired_at(), fired);
  EXPECT_EQ(watch.reason().empty(), !fired.has_value());
  return fired;
}

std::vector<std::vector<float>> Trace(size_t rounds, size_t members, auto&& size_of) {
  std::vector<std::vector<float>> t(rounds);
  for (size_t r = 0; r < rounds; ++r) {
    for (size_t m = 0; m < members; ++m) t[r].push_back(size_of(r, m));
  }
  return t;
}

TEST(GrowthWatch, StableJobsNeverFire) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> noise(0.7f, 1.3f);
  // Level with noise, shrinking as training does, shrinking with noise, and slow growth (1 %
  // a round: the means settle at 1.4 times apart, below 2), over 2,000 rounds each.
  for (const auto& t :
       {Trace(2000, 4, [&](size_t, size_t) { return 0.05f * noise(rng); }),
        Trace(2000, 4, [](size_t r, size_t) { return 3.0f / (1.0f + 0.01f * static_cast<float>(r)); }),
        Trace(2000, 3, [&](size_t r, size_t) { return noise(rng) / (1.0f + 0.002f * static_cast<float>(r)); }),
        Trace(300, 4, [](size_t r, size_t) { return std::pow(1.01f, static_cast<float>(r)); })}) {
    GrowthWatch watch;
    EXPECT_FALSE(Feed(watch, t).has_value());
    EXPECT_GT(watch.rounds_measured(), 0u);
  }
}

TEST(GrowthWatch, DivergenceFiresOnceSoonAfterItStarts) {
  // Level for 20 rounds, then 50 % larger every round (a job blowing up): fired within a
  // few rounds, where the reference fires, and never again.
  GrowthWatch watch;
  const auto fired = Feed(watch, Trace(60, 4, [](size_t r, size_t m) {
                           const float level = 0.1f + 0.01f * static_cast<float>(m);
                           return r < 20 ? level : level * std::pow(1.5f, static_cast<float>(r) - 19.0f);
                         }));
  ASSERT_TRUE(fired.has_value());
  EXPECT_GT(*fired, 20u);
  EXPECT_LE(*fired, 26u);
  EXPECT_NE(watch.reason().find("grew"), std::string::npos) << watch.reason();
  EXPECT_NE(watch.reason().find(std::to_string(*fired)), std::string::npos) << watch.reason();
  EXPECT_GT(watch.fast_mean(), GrowthWatchOptions{}.ratio * watch.slow_mean());
  std::vector<float> more{1e9f, 1e9f};
  EXPECT_FALSE(watch.RoundClosed(100, more));
  EXPECT_EQ(watch.fired_at(), fired);
}

TEST(GrowthWatch, NothingIsJudgedBeforeTheWarmup) {
  // Growing from the first round: the warm-up rounds set the level, whatever they show.
  GrowthWatch watch;
  const auto fired = Feed(watch, Trace(30, 2, [](size_t r, size_t) {
                           return std::pow(2.0f, static_cast<float>(r));
                         }));
  ASSERT_TRUE(fired.has_value());
  EXPECT_EQ(*fired, GrowthWatchOptions{}.warmup);
}

TEST(GrowthWatch, OneWorkerCannotFireIt) {
  // One of three (or of two: the lower median) reports sizes far too large, infinite or not
  // a number: the round's size is the others'.
  for (const float liar : {1e30f, kInf, kNan}) {
    GrowthWatch three;
    EXPECT_FALSE(Feed(three, Trace(200, 3, [&](size_t, size_t m) { return m == 1 ? liar : 0.5f; }))
                     .has_value());
    GrowthWatch two;
    EXPECT_FALSE(Feed(two, Trace(200, 2, [&](size_t, size_t m) { return m == 0 ? liar : 0.5f; }))
                     .has_value());
  }
}

TEST(GrowthWatch, SizesOfZeroAreNotMeasured) {
  // Gradients of zeros set no level (nor does a worker of two reporting 0 through the
  // warm-up, or later: the other's size is the round's): what follows is not growth from it.
  GrowthWatch watch;
  EXPECT_FALSE(Feed(watch, Trace(40, 2, [](size_t r, size_t) { return r < 10 ? 0.0f : 0.3f; }))
                   .has_value());
  EXPECT_EQ(watch.rounds_measured(), 30u);
  GrowthWatch liar;
  EXPECT_FALSE(Feed(liar, Trace(40, 2, [](size_t, size_t m) { return m == 0 ? 0.0f : 0.3f; }))
                   .has_value());
  EXPECT_EQ(liar.rounds_measured(), 40u);
}

TEST(GrowthWatch, GradientsThatAreNotFiniteFireAtOnce) {
  // Most of a round's workers send gradients holding inf or NaN: the job diverged; no
  // warm-up waits for it.
  for (const float bad : {kInf, kNan}) {
    GrowthWatch watch;
    auto t = Trace(10, 3, [](size_t, size_t) { return 1.0f; });
    t[2] = {bad, bad, 1.0f};
    EXPECT_EQ(Feed(watch, t), Round{2});
    EXPECT_NE(watch.reason().find("not finite"), std::string::npos) << watch.reason();
  }
}

TEST(GrowthWatch, UnmeasuredSizesCountForNothing) {
  // Empty commits, commits replayed from a journal: not measured, not a round of the level.
  GrowthWatch watch;
  auto t = Trace(40, 3, [](size_t r, size_t m) {
    if (r < 20 || m == 2) return -1.0f;
    return std::pow(2.0f, static_cast<float>(r) - 20.0f);
  });
  const auto fired = Feed(watch, t);
  ASSERT_TRUE(fired.has_value());
  EXPECT_EQ(*fired, 20u + GrowthWatchOptions{}.warmup);
  GrowthWatch idle;
  std::vector<float> none{-1.0f, -1.0f};
  EXPECT_FALSE(idle.RoundClosed(0, none));
  EXPECT_EQ(idle.rounds_measured(), 0u);
}

TEST(GrowthWatch, SumOfSquaresMatchesAPlainSumInDouble) {
  std::mt19937 rng(3);
  std::normal_distribution<float> value(0.0f, 2.0f);
  for (const size_t n : {0u, 1u, 15u, 16u, 17u, 4095u, 4096u, 4097u, 100003u}) {
    std::vector<float> v(n);
    double plain = 0.0;
    for (float& x : v) {
      x = value(rng);
      plain += static_cast<double>(x) * x;
    }
    const double got = SumOfSquares(v);
    EXPECT_NEAR(got, plain, 1e-5 * plain) << n;
  }
  std::vector<float> bad{1.0f, kNan, 2.0f};
  EXPECT_TRUE(std::isnan(SumOfSquares(bad)));
  bad[1] = kInf;
  EXPECT_TRUE(std::isinf(SumOfSquares(bad)));
}

}  // namespace
}  // namespace dsync::ps
