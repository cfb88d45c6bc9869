// Random test inputs that are never zero (a zero hides a missing term in a sum).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace dsync::testing {

inline std::vector<float> Random(size_t n, uint32_t seed, float lo = -2.0f, float hi = 2.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = d(rng);
    } while (x == 0.0f);
  }
  return v;
}

}  // namespace dsync::testing
