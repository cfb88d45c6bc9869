// Server apply throughput: the CPU ParamStore's ApplyRound over a whole model cut into
// slices, beside memcpy and triad bandwidth on buffers of the same sizes, single-threaded
// (the server applies rounds on one thread).
//
// Bytes moved per element of a round with n gradients: n*4 (gradient reads) + 8 (param read
// + write) + optimizer state reads + writes (momentum 8, adam 16). memcpy counts read +
// write (8 per float), triad a = b + s*c counts 12.
//
//   bench_apply [--total-mib 256] [--slices-mib 4,16,64] [--grads 1,4]
//               [--optimizers sgd,adam,momentum,sum] [--reps 5]
//
// The rows of one slice size are timed interleaved (rep 1 of every row, then rep 2, ...),
// so that the machine's slow and fast periods fall on every row alike and the ratios
// within a slice size stay meaningful on a noisy shared host.
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "cpu/cpu_store.h"
#include "ps/optimizer.h"
#include "ps/param_store.h"

namespace dsync::bench {
namespace {

struct Options {
  uint64_t total_mib = 256;
  std::vector<uint64_t> slices_mib{4, 16, 64};
  std::vector<uint32_t> grads{1, 4};
  std::vector<std::string> optimizers{"sgd", "adam", "momentum", "sum"};
  int reps = 5;
};

uint64_t StateBytes(OptimizerKind k) { return 4ull * 2 * ps::OptimizerStateSlots(k); }
uint64_t BytesPerElement(OptimizerKind k, uint32_t n) { return 4ull * n + 8 + StateBytes(k); }

OptimizerConfig MakeOptimizer(OptimizerKind kind) {
  OptimizerConfig c;
  c.kind = kind;
  c.lr = 1e-3f;
  return c;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps server apply throughput (CPU store)"};
  app.add_option("--total-mib", o.total_mib, "model size in MiB");
  app.add_option("--slices-mib", o.slices_mib, "slice sizes in MiB")->delimiter(',');
  app.add_option("--grads", o.grads, "gradients per round")->delimiter(',');
  app.add_option("--optimizers", o.optimizers, "sgd, momentum, adam, adamw, sum")->delimiter(',');
  app.add_option("--reps", o.reps, "timed rounds per row (after one untimed)");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();

  auto parsed = ParseOptimizers(o.optimizers);
  if (!parsed.ok()) {
    fmt::print(stderr, "{}\n", parsed.status().ToString());
    return 2;
  }
  const std::vector<OptimizerKind> kinds = *parsed;
  const uint64_t total_elems = o.total_mib * kMiB / sizeof(float);
  const uint32_t max_grads = o.grads.empty() ? 1 : *std::max_element(o.grads.begin(), o.grads.end());

  // Every buffer is written once here: no first-touch faults in timed sections. Gradients
  // span the whole model (one region per slice, as the server's staging buffers do), so no
  // slice's gradient is still in cache from the previous slice.
  const auto setup0 = SteadyClock::now();
  std::vector<FloatBuffer> grads;
  for (uint32_t k = 0; k < std::max<uint32_t>(max_grads, 2); ++k) {
    grads.emplace_back(total_elems);
    FillPattern(grads.back().data(), total_elems, 1e-3f, 11 + k);
  }
  FloatBuffer dst(total_elems, 0.5f);  // memcpy destination, triad a
  const double setup_s = Seconds(setup0, SteadyClock::now());

  fmt::print("dsyncps apply throughput, CPU store, one thread; model {} MiB ({} floats)\n",
             o.total_mib, total_elems);
  fmt::print("bytes moved per element = n*4 (gradient reads) + 8 (param read+write) + state "
             "(momentum 8, adam 16); memcpy = 8 (read+write), triad a=b+s*c = 12\n");
  fmt::print("GB/s = bytes moved / median round time; x memcpy, x triad = that / the same "
             "slice size's memcpy / triad GB/s; median of {} timed rounds per row after 1 untimed, rows of a slice size interleaved\n",
             o.reps);
  fmt::print("(buffers pre-touched in {:.1f} s; first touch costs ~12 us per 4 KiB page here)\n",
             setup_s);
  fmt::print("\n{:>6} {:>14} {:>5} {:>6} {:>10} {:>8} {:>9} {:>8}   {}\n", "slice", "kernel",
             "grads", "B/elem", "round ms", "GB/s", "x memcpy", "x triad", "[min .. max ms]");

  nlohmann::json rows = nlohmann::json::array();
  nlohmann::json baselines = nlohmann::json::array();
  for (uint64_t slice_mib : o.slices_mib) {
    const uint64_t slice_elems = std::min<uint64_t>(slice_mib * kMiB / sizeof(float), total_elems);
    const uint64_t num_slices = (total_elems + slice_elems - 1) / slice_elems;
    auto for_each_slice = [&](auto&& fn) {
      for (uint64_t k = 0; k < num_slices; ++k) {
        const uint64_t off = k * slice_elems;
        fn(k, off, std::min(slice_elems, total_elems - off));
      }
    };

    // The store: every slice initialized from pre-touched memory; one adam round allocates
    // (and zeroes) both state arrays, which every optimizer then reuses.
    auto store = cpu::MakeCpuStore();
    bool failed = false;
    for_each_slice([&](uint64_t k, uint64_t off, uint64_t len) {
      Status st = store->InitSlice(k, {dst.data() + off, len});
      if (!st.ok() && !failed) {
        fmt::print(stderr, "InitSlice: {}\n", st.ToString());
        failed = true;
      }
    });
    if (failed) return 1;
    for_each_slice([&](uint64_t k, uint64_t off, uint64_t) {
      const float* gp[1] = {grads[0].data() + off};
      (void)store->ApplyRound(k, gp, MakeOptimizer(OptimizerKind::kAdam));
    });

    // Every row of this slice size: a name, what it moves per element, one timed run.
    struct Case {
      std::string kernel;
      std::optional<OptimizerKind> kind;  // none: a baseline
      uint32_t grads = 0;
      uint64_t bytes_per_elem = 0;
      std::function<void()> run;
      std::vector<double> times;
    };
    std::vector<Case> cases;
    std::vector<const float*> gp;
    const float* g0 = grads[0].data();
    const float* g1 = grads[1].data();
    cases.push_back({"memcpy", std::nullopt, 0, 8, [&] {
                       for_each_slice([&](uint64_t, uint64_t off, uint64_t len) {
                         std::memcpy(dst.data() + off, g0 + off, len * sizeof(float));
                       });
                       DoNotOptimize(dst.data());
                     }, {}});
    cases.push_back({"triad", std::nullopt, 0, 12, [&] {
                       for_each_slice([&](uint64_t, uint64_t off, uint64_t len) {
                         float* __restrict a = dst.data() + off;
                         const float* __restrict b = g0 + off;
                         const float* __restrict c = g1 + off;
                         for (uint64_t i = 0; i < len; ++i) a[i] = b[i] + 0.5f * c[i];
                       });
                       DoNotOptimize(dst.data());
                     }, {}});
    for (OptimizerKind kind : kinds) {
      for (uint32_t n : o.grads) {
        cases.push_back({std::string(OptimizerName(kind)), kind, n, BytesPerElement(kind, n),
                         [&, kind, n] {
                           const OptimizerConfig opt = MakeOptimizer(kind);
                           for_each_slice([&](uint64_t k, uint64_t off, uint64_t) {
                             gp.clear();
                             for (uint32_t j = 0; j < n; ++j) gp.push_back(grads[j].data() + off);
                             (void)store->ApplyRound(k, gp, opt);
                           });
                         }, {}});
      }
    }
    for (Case& c : cases) c.run();  // untimed
    for (int rep = 0; rep < o.reps; ++rep) {
      for (Case& c : cases) {
        const auto t0 = SteadyClock::now();
        c.run();
        c.times.push_back(Seconds(t0, SteadyClock::now()));
      }
    }
    store.reset();  // gives its memory back before the next slice size allocates

    const double elems = static_cast<double>(total_elems);
    const double memcpy_gbps = 8 * elems / Median(cases[0].times) / kGB;
    const double triad_gbps = 12 * elems / Median(cases[1].times) / kGB;
    baselines.push_back({{"slice_mib", slice_mib},
                         {"memcpy_gbps", memcpy_gbps},
                         {"memcpy_ms", Median(cases[0].times) * 1e3},
                         {"triad_gbps", triad_gbps},
                         {"triad_ms", Median(cases[1].times) * 1e3}});
    for (const Case& c : cases) {
      const double t = Median(c.times);
      const double gbps = static_cast<double>(c.bytes_per_elem) * elems / t / kGB;
      fmt::print("{:>3}MiB {:>14} {:>5} {:>6} {:>10.2f} {:>8.2f} {:>9.2f} {:>8.2f}   [{:.1f} .. {:.1f}]\n",
                 slice_mib, c.kernel, c.kind ? fmt::format("{}", c.grads) : "-",
                 c.bytes_per_elem, t * 1e3, gbps, gbps / memcpy_gbps, gbps / triad_gbps,
                 Min(c.times) * 1e3, Max(c.times) * 1e3);
      if (!c.kind) continue;
      rows.push_back({{"slice_mib", slice_mib},
                      {"kernel", c.kernel},
                      {"optimizer", OptimizerName(*c.kind)},
                      {"grads", c.grads},
                      {"bytes_per_elem", c.bytes_per_elem},
                      {"round_ms", t * 1e3},
                      {"round_ms_min", Min(c.times) * 1e3},
                      {"round_ms_max", Max(c.times) * 1e3},
                      {"gbps", gbps},
                      {"ratio_to_memcpy", gbps / memcpy_gbps},
                      {"ratio_to_triad", gbps / triad_gbps}});
    }
    std::fflush(stdout);
  }

  nlohmann::json result = {{"bench", "apply"},
                           {"store", "cpu"},
                           {"total_mib", o.total_mib},
                           {"reps", o.reps},
                           {"baselines", baselines},
                           {"rows", rows}};
  fmt::print("\nRESULT {}\n", result.dump());
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
