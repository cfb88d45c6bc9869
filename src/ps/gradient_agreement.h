// What a stale gradient is worth, measured (dsync:auto; docs/contract.md, "What a stale
// gradient is worth, measured").
//
// A gradient g computed on an older model points where the model was, not where it is. How
// much of it still helps is its component along the current true gradient μ, relative to a
// fresh gradient's: (E[g_stale]·μ) / |μ|². The fresh gradients of the same round estimate μ
// without bias (independent minibatches on the current model), so for every gradient m of a
// round the servers measure
//     d_m = g_m · (F − [m fresh] g_m) / k_m,
// F the sum of the round's fresh gradients, k_m how many of them besides m. For a fresh m,
// E[d_m] = |μ|²; for a stale one, E[d_m] = E[g_m]·μ; their ratio over many rounds is what a
// stale gradient is worth. Dividing by k_m keeps the two comparable although a stale gradient
// is compared with one fresh gradient more than a fresh one is. Both sides come from the same
// rounds, the same model and the same coordinates, so the ratio needs no stationarity: early
// or late in training, it compares like with like.
//
// d_m is a sum over coordinates, so it adds up over slices and servers. Each server measures a
// sample of each slice's coordinates, `kAgreementSamples` at most (a stride through the slice
// that starts at an offset that moves every round, so every coordinate is visited in turn),
// scaled to the whole slice: the cost grows with the number of slices, not with their size
// (the strided reads miss the cache, so a few hundred nanoseconds per sample and member).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace dsync::ps {

// Coordinates of one slice sampled per round.
constexpr size_t kAgreementSamples = 4096;

// Adds, for each gradient m of one slice, its d_m over that slice to `dots[m]`, and sets
// `measured[m]` where it had a fresh partner (k_m > 0) and d_m is finite. `fresh[m]`: whether
// gradient m is fresh. `round` picks the sample's offset. `scratch` is reused from call to call.
void AddAgreement(std::span<const float* const> grads, std::span<const uint8_t> fresh,
                  size_t elements, uint64_t round, std::vector<double>& scratch,
                  std::span<double> dots, std::span<uint8_t> measured,
                  size_t max_samples = kAgreementSamples);

}  // namespace dsync::ps
