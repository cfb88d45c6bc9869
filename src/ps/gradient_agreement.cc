#include "ps/gradient_agreement.h"

#include <algorithm>
#include <cmath>

namespace dsync::ps {

void AddAgreement(std::span<const float* const> grads, std::span<const uint8_t> fresh,
                  size_t elements, uint64_t round, std::vector<double>& scratch,
                  std::span<double> dots, std::span<uint8_t> measured, size_t max_samples) {
  size_t fresh_count = 0;
  for (size_t m = 0; m < grads.size(); ++m) fresh_count += fresh[m] ? 1 : 0;
  if (elements == 0 || fresh_count == 0 || max_samples == 0) return;
  size_t stride = (elements + max_samples - 1) / max_samples;
  // Odd, so that a stride through a row-major matrix with rows of a power-of-two length
  // visits every column, not the same few.
  if (stride > 1 && stride % 2 == 0) ++stride;
  const size_t offset = static_cast<size_t>(round % stride);
  const size_t samples = offset < elements ? (elements - offset + stride - 1) / stride : 0;
  if (samples == 0) return;
  const double scale = static_cast<double>(elements) / static_cast<double>(samples);

  scratch.assign(samples, 0.0);  // F at the sampled coordinates
  for (size_t m = 0; m < grads.size(); ++m) {
    if (!fresh[m]) continue;
    const float* g = grads[m];
    for (size_t j = 0, i = offset; j < samples; ++j, i += stride) scratch[j] += g[i];
  }
  for (size_t m = 0; m < grads.size(); ++m) {
    const size_t partners = fresh_count - (fresh[m] ? 1 : 0);
    if (partners == 0) continue;
    const float* g = grads[m];
    double dot = 0;
    double self = 0;
    for (size_t j = 0, i = offset; j < samples; ++j, i += stride) {
      const double x = g[i];
      dot += x * scratch[j];
      self += x * x;
    }
    if (fresh[m]) dot -= self;  // F without m itself
    const double d = scale * dot / static_cast<double>(partners);
    if (!std::isfinite(d)) continue;  // a gradient holding inf or NaN says nothing
    dots[m] += d;
    measured[m] = 1;
  }
}

}  // namespace dsync::ps
