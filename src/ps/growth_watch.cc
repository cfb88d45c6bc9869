#include "ps/growth_watch.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace dsync::ps {

double SumOfSquares(std::span<const float> values) {
  constexpr size_t kLanes = 16;
  constexpr size_t kBlock = 4096;  // float partial sums of at most 256 terms per lane
  double total = 0.0;
  size_t i = 0;
  while (i < values.size()) {
    const size_t end = std::min(values.size(), i + kBlock);
    float lanes[kLanes] = {};
    for (; i + kLanes <= end; i += kLanes) {
      for (size_t k = 0; k < kLanes; ++k) lanes[k] += values[i + k] * values[i + k];
    }
    for (; i < end; ++i) lanes[0] += values[i] * values[i];
    for (float lane : lanes) total += static_cast<double>(lane);
  }
  return total;
}

GrowthWatch::GrowthWatch(GrowthWatchOptions options) : opt_(options) {}

bool GrowthWatch::RoundClosed(Round round, std::span<float> sizes) {
  if (fired_at_) return false;
  // Not measured sizes to the back; NaN counts as infinite (std::sort needs an order). A
  // size of 0 (a gradient of zeros) says nothing of a level either: counted, a worker
  // reporting zeros through the warm-up would make any later size look like growth.
  size_t n = 0;
  for (float& v : sizes) {
    if (std::isnan(v)) v = INFINITY;
    if (v > 0.0f) std::swap(v, sizes[n++]);
  }
  if (n == 0) return false;
  const std::span<float> measured = sizes.first(n);
  std::sort(measured.begin(), measured.end());
  const double size = measured[(n - 1) / 2];
  ++measured_;
  if (!std::isfinite(size)) {
    fired_at_ = round;
    reason_ = fmt::format("round {}'s gradients are not finite numbers (the median of {} "
                          "worker(s) measured)",
                          round, n);
    return true;
  }
  if (measured_ == 1) {
    slow_ = fast_ = size;
  } else {
    slow_ += opt_.slow * (size - slow_);
    fast_ += opt_.fast * (size - fast_);
  }
  if (measured_ <= opt_.warmup) return false;
  if (fast_ / slow_ > peak_ratio_) {
    peak_ratio_ = fast_ / slow_;
    peak_round_ = round;
  }
  if (!(fast_ > opt_.ratio * slow_)) return false;
  fired_at_ = round;
  reason_ = fmt::format("the gradients grew: their size (root mean square, median of the "
                        "round's workers) averages {:.4g} over the last rounds against "
                        "{:.4g} over the job, {:.2f} times (growth is over {:.2f}), at round {}",
                        fast_, slow_, fast_ / slow_, opt_.ratio, round);
  return true;
}

}  // namespace dsync::ps
