// The measured worth of stale gradients: the servers' agreement of each gradient with the
// fresh ones of its round (ps/gradient_agreement.h) against a plain reference, its sampling,
// and what the scheduler makes of the reports (ps/stale_worth.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "ps/gradient_agreement.h"
#include "ps/stale_worth.h"

namespace dsync::ps {
namespace {

using Grads = std::vector<std::vector<float>>;

std::vector<const float*> Pointers(const Grads& g) {
  std::vector<const float*> p;
  for (const auto& v : g) p.push_back(v.data());
  return p;
}

// d_m = g_m . (sum of the fresh gradients other than m) / their number, every coordinate.
double Reference(const Grads& g, const std::vector<uint8_t>& fresh, size_t m) {
  double dot = 0;
  size_t partners = 0;
  for (size_t j = 0; j < g.size(); ++j) {
    if (j == m || !fresh[j]) continue;
    ++partners;
    for (size_t i = 0; i < g[m].size(); ++i) dot += double{g[m][i]} * double{g[j][i]};
  }
  return partners ? dot / static_cast<double>(partners) : NAN;
}

Grads Random(size_t gradients, size_t elements, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Grads g(gradients, std::vector<float>(elements));
  for (auto& v : g) {
    for (float& x : v) x = n(rng);
  }
  return g;
}

TEST(GradientAgreement, EveryCoordinateOfASmallSliceMatchesThePlainSum) {
  const Grads g = Random(5, 1000, 1);
  const std::vector<uint8_t> fresh = {1, 0, 1, 1, 0};
  std::vector<double> dots(5, 0.0);
  std::vector<uint8_t> measured(5, 0);
  std::vector<double> scratch;
  AddAgreement(Pointers(g), fresh, 1000, 7, scratch, dots, measured);
  for (size_t m = 0; m < 5; ++m) {
    EXPECT_EQ(measured[m], 1) << m;
    EXPECT_NEAR(dots[m], Reference(g, fresh, m), 1e-9 * (1 + std::fabs(Reference(g, fresh, m))))
        << m;
  }
  // Adds up: a second slice adds its share to what is there.
  AddAgreement(Pointers(g), fresh, 1000, 8, scratch, dots, measured);
  EXPECT_NEAR(dots[1], 2 * Reference(g, fresh, 1), 1e-9 * (1 + std::fabs(dots[1])));
}

TEST(GradientAgreement, AGradientWithoutAFreshPartnerIsNotMeasured) {
  const Grads g = Random(3, 100, 2);
  std::vector<double> scratch;
  {
    // One fresh gradient: the stale ones are measured against it, it has nothing to agree with.
    std::vector<double> dots(3, 0.0);
    std::vector<uint8_t> measured(3, 0);
    AddAgreement(Pointers(g), std::vector<uint8_t>{0, 1, 0}, 100, 0, scratch, dots, measured);
    EXPECT_EQ(measured, (std::vector<uint8_t>{1, 0, 1}));
    EXPECT_EQ(dots[1], 0.0);
    EXPECT_NEAR(dots[0], Reference(g, {0, 1, 0}, 0), 1e-9 * (1 + std::fabs(dots[0])));
  }
  {
    std::vector<double> dots(3, 0.0);
    std::vector<uint8_t> measured(3, 0);
    AddAgreement(Pointers(g), std::vector<uint8_t>{0, 0, 0}, 100, 0, scratch, dots, measured);
    EXPECT_EQ(measured, (std::vector<uint8_t>{0, 0, 0}));
    EXPECT_EQ(dots, (std::vector<double>{0, 0, 0}));
  }
}

// A large slice is sampled: the estimate is scaled to the whole slice (exact for gradients
// that are the same on every coordinate) and, over consecutive rounds, the moving offset
// visits every coordinate, so the mean estimate approaches the exact value.
TEST(GradientAgreement, ALargeSliceIsSampledAndScaledToTheWholeSlice) {
  constexpr size_t kElements = 100'003;
  constexpr size_t kSamples = 1000;
  Grads flat(3, std::vector<float>(kElements));
  for (size_t m = 0; m < 3; ++m) std::fill(flat[m].begin(), flat[m].end(), 0.5f + static_cast<float>(m));
  const std::vector<uint8_t> fresh = {1, 1, 0};
  std::vector<double> scratch;
  for (uint64_t round : {0u, 5u, 99u}) {
    std::vector<double> dots(3, 0.0);
    std::vector<uint8_t> measured(3, 0);
    AddAgreement(Pointers(flat), fresh, kElements, round, scratch, dots, measured, kSamples);
    for (size_t m = 0; m < 3; ++m) {
      EXPECT_NEAR(dots[m], Reference(flat, fresh, m), 1e-9 * Reference(flat, fresh, m));
    }
  }
  const Grads g = Random(3, kElements, 3);
  std::vector<double> sum(3, 0.0);
  const int rounds = 101;  // the stride for 100003 elements in 1000 samples
  for (int round = 0; round < rounds; ++round) {
    std::vector<double> dots(3, 0.0);
    std::vector<uint8_t> measured(3, 0);
    AddAgreement(Pointers(g), fresh, kElements, round, scratch, dots, measured, kSamples);
    for (size_t m = 0; m < 3; ++m) sum[m] += dots[m] / rounds;
  }
  for (size_t m = 0; m < 3; ++m) {
    // Each round's scale differs by one sample at most: 0.1 %, on a sum of ~300 in magnitude.
    EXPECT_NEAR(sum[m], Reference(g, fresh, m), 2.0) << m;
  }
}

// The point of it all: gradients of a model that moved since (their mean a*mu + nu, nu
// orthogonal to mu) agree with fresh ones (mean mu) a times as much, whatever the noise.
TEST(GradientAgreement, StaleGradientsAreWorthTheirShareOfTheTrueGradient) {
  constexpr size_t kElements = 20'000;
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> mu(kElements), nu(kElements);
  for (size_t i = 0; i < kElements; ++i) {
    mu[i] = 0.05f * n(rng);
    nu[i] = (i % 2 ? 0.05f : -0.05f) * std::fabs(mu[i ^ 1]);  // roughly orthogonal
  }
  for (const double a : {1.0, 0.4, -0.5}) {
    StaleWorth worth({.memory = 1e9, .min_rounds = 1});
    std::vector<double> scratch;
    for (Round r = 10; r < 210; ++r) {
      RoundRecord rec;
      rec.round = r;
      Grads g(4, std::vector<float>(kElements));
      for (size_t m = 0; m < 4; ++m) {
        rec.members.push_back({WorkerId(1000 + m), 0, m < 3 ? r : r - 3});
        for (size_t i = 0; i < kElements; ++i) {
          const float mean = m < 3 ? mu[i] : static_cast<float>(a) * mu[i] + nu[i];
          g[m][i] = mean + 0.2f * n(rng);  // noise 4x the signal per coordinate
        }
      }
      std::vector<double> dots(4, 0.0);
      std::vector<uint8_t> measured(4, 0);
      AddAgreement(Pointers(g), std::vector<uint8_t>{1, 1, 1, 0}, kElements, r, scratch, dots,
                   measured, 4096);
      worth.Add(rec, dots, measured);
    }
    EXPECT_TRUE(worth.Measured(3));
    EXPECT_NEAR(worth.Worth(3), a, 0.15) << "a = " << a;
  }
}

// Rounds of three fresh gradients (d = fresh) and one `s` rounds stale (d = stale).
void Report(StaleWorth& worth, int reports, uint64_t s, double fresh, double stale) {
  for (int i = 0; i < reports; ++i) {
    RoundRecord rec;
    rec.round = 100;
    for (int m = 0; m < 3; ++m) rec.members.push_back({WorkerId(1000 + m), 0, 100});
    rec.members.push_back({1003, 0, 100 - s});
    const std::vector<double> dots = {fresh, fresh, fresh, stale};
    const std::vector<uint8_t> measured = {1, 1, 1, 1};
    worth.Add(rec, dots, measured);
  }
}

// A memory far longer than the reports: their counts are exact.
constexpr double kForever = 1e12;

TEST(StaleWorth, UntilMeasuredAStaleGradientIsWorthOneOverOnePlusS) {
  StaleWorth worth({.memory = kForever, .min_rounds = 24});
  EXPECT_EQ(worth.Worth(0), 1.0);
  EXPECT_DOUBLE_EQ(worth.Worth(1), 0.5);
  EXPECT_DOUBLE_EQ(worth.Worth(3), 0.25);
  EXPECT_FALSE(worth.Measured(3));
  Report(worth, 23, 3, 0.5, 0.2);
  EXPECT_FALSE(worth.Measured(3));
  EXPECT_DOUBLE_EQ(worth.Worth(3), 0.25);
  Report(worth, 1, 3, 0.5, 0.2);
  EXPECT_TRUE(worth.Measured(3));
  EXPECT_NEAR(worth.Worth(3), 0.4, 1e-12);
  EXPECT_FALSE(worth.Measured(2));
  EXPECT_EQ(worth.Describe((1u << 2) | (1u << 3)),
            "0.33 at staleness 2 (not measured yet), 0.40 at staleness 3 (measured over 24 "
            "rounds)");
}

TEST(StaleWorth, WorthLiesBetweenMinusOneAndOne) {
  StaleWorth worth({.memory = kForever, .min_rounds = 4});
  Report(worth, 10, 1, 0.5, 2.0);   // noise: "worth" 4
  Report(worth, 10, 2, 0.5, -3.0);  // against the model's way: -6
  EXPECT_EQ(worth.Worth(1), 1.0);
  EXPECT_EQ(worth.Worth(2), -1.0);
}

TEST(StaleWorth, AStalerGradientIsNeverWorthMoreThanAFresherOneMeasured) {
  StaleWorth worth({.memory = kForever, .min_rounds = 4});
  Report(worth, 10, 3, 1.0, 0.8);
  EXPECT_DOUBLE_EQ(worth.Worth(3), 0.8);  // level 1 and 2 unmeasured: they cap nothing
  Report(worth, 10, 2, 1.0, 0.3);
  EXPECT_DOUBLE_EQ(worth.Worth(2), 0.3);
  EXPECT_DOUBLE_EQ(worth.Worth(3), 0.3);
  EXPECT_DOUBLE_EQ(worth.Worth(4), 0.2);  // its prior, under the cap
  EXPECT_DOUBLE_EQ(worth.Worth(1), 0.5);
}

TEST(StaleWorth, VeryStaleGradientsShareOneLevel) {
  StaleWorth worth({.memory = kForever, .min_rounds = 4});
  Report(worth, 2, 8, 1.0, 0.1);
  Report(worth, 2, 40, 1.0, 0.3);
  EXPECT_TRUE(worth.Measured(8));
  EXPECT_TRUE(worth.Measured(1000));
  EXPECT_NEAR(worth.Worth(1000), 0.2, 1e-9);
  EXPECT_EQ(worth.Describe(1u << StaleWorth::kLevels),
            "0.20 at staleness 8+ (measured over 4 rounds)");
}

TEST(StaleWorth, OldReportsFade) {
  StaleWorth worth({.memory = 50, .min_rounds = 4});
  Report(worth, 200, 2, 1.0, 0.9);
  EXPECT_NEAR(worth.Worth(2), 0.9, 1e-9);
  Report(worth, 150, 2, 1.0, -0.5);  // three memories later, the old ones weigh e^-3
  EXPECT_NEAR(worth.Worth(2), -0.5 + 1.4 * std::exp(-3.0), 0.02);
}

// The servers' reports of one round count one round together; a report is counted in what
// it measured.
TEST(StaleWorth, ReportsOfOneRoundFromSeveralServersCountOneRound) {
  StaleWorth worth({.memory = kForever, .min_rounds = 2});
  RoundRecord rec;
  rec.round = 50;
  rec.members = {{1000, 0, 50}, {1001, 0, 50}, {1002, 0, 47}};
  for (int server = 0; server < 3; ++server) {
    EXPECT_TRUE(worth.Add(rec, std::vector<double>{0.2, 0.4, 0.15},
                          std::vector<uint8_t>{1, 1, 1}, 1.0 / 3));
  }
  EXPECT_FALSE(worth.Measured(3));  // one round
  for (int server = 0; server < 3; ++server) {
    EXPECT_TRUE(worth.Add(rec, std::vector<double>{0.2, 0.4, 0.15},
                          std::vector<uint8_t>{1, 1, 1}, 1.0 / 3));
  }
  EXPECT_TRUE(worth.Measured(3));
  EXPECT_NEAR(worth.Worth(3), 0.5, 1e-12);
  EXPECT_EQ(worth.Describe(1u << 3), "0.50 at staleness 3 (measured over 2 rounds)");
}

// Reports of values near the largest double would overflow the sums and leave the worth NaN
// for good: the one that would is not taken, and the worth stays a number in [-1, 1].
TEST(StaleWorth, AReportThatWouldOverflowIsNotTaken) {
  StaleWorth worth({.memory = 200, .min_rounds = 1});
  RoundRecord rec;
  rec.round = 50;
  rec.members = {{1000, 0, 50}, {1001, 0, 49}};
  EXPECT_TRUE(worth.Add(rec, std::vector<double>{1.0, 0.5}, std::vector<uint8_t>{1, 1}));
  const double huge = std::numeric_limits<double>::max();
  int refused = 0;
  for (int i = 0; i < 3; ++i) {
    refused += worth.Add(rec, std::vector<double>{huge, -huge}, std::vector<uint8_t>{1, 1}) ? 0 : 1;
    EXPECT_TRUE(std::isfinite(worth.Worth(1)));
    EXPECT_GE(worth.Worth(1), -1.0);
  }
  EXPECT_GE(refused, 2);
  EXPECT_FALSE(worth.Add(rec, std::vector<double>{1.0, 0.5}, std::vector<uint8_t>{1, 1}, 0.0));
  EXPECT_FALSE(worth.Add(rec, std::vector<double>{1.0, 0.5}, std::vector<uint8_t>{1, 1}, NAN));
}

TEST(StaleWorth, RoundsWithoutAMeasuredFreshGradientSayNothing) {
  StaleWorth worth({.memory = kForever, .min_rounds = 1});
  RoundRecord rec;
  rec.round = 50;
  rec.members = {{1000, 0, 50}, {1001, 0, 48}};
  worth.Add(rec, std::vector<double>{0.5, 0.5}, std::vector<uint8_t>{0, 1});
  EXPECT_FALSE(worth.Measured(2));
  // Nor do values that are not numbers, or reports shorter than the round.
  worth.Add(rec, std::vector<double>{NAN, 0.5}, std::vector<uint8_t>{1, 1});
  worth.Add(rec, std::vector<double>{0.5}, std::vector<uint8_t>{1});
  EXPECT_FALSE(worth.Measured(2));
  worth.Add(rec, std::vector<double>{0.5, INFINITY}, std::vector<uint8_t>{1, 1});
  EXPECT_FALSE(worth.Measured(2));
  worth.Add(rec, std::vector<double>{0.5, 0.25}, std::vector<uint8_t>{1, 1});
  EXPECT_DOUBLE_EQ(worth.Worth(2), 0.5);
}

}  // namespace
}  // namespace dsync::ps
