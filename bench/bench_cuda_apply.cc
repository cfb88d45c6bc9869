// GPU apply throughput: LaunchApplyRound (the CUDA store's fused update kernel) on slices in
// device memory, beside a device-to-device cudaMemcpyAsync of the same slices, timed with
// CUDA events. The CUDA store's target: sgd and adam at >= 85 % of the copy's GB/s.
//
// Bytes moved per element of a round with k gradients, counted exactly: 4k (gradient reads)
// + 8 (w read + write) + 8 per state array (read + write): sum and sgd 8+4k, momentum 16+4k,
// adam 24+4k. The copy moves 8 (read + write).
//
//   bench_cuda_apply [--slices-mib 4,16,64,256,1024] [--grads 1] [--pass-mib 1024]
//                    [--optimizers sgd,adam,momentum,sum] [--reps 20] [--warmup 3] [--scalar]
//
// A timed pass applies one round to every slice of a --pass-mib region, each slice with its
// own memory, so that a small slice is not served from the L2 cache left by the previous
// launch; the pass is one CUDA graph, so that the host's launch rate does not pace small
// slices. Copy rows copy the same slices the same way. The rows of a slice size are timed
// interleaved (rep 1 of every row, then rep 2, ...); medians are reported. --scalar adds
// rows on arrays one float off 16-byte alignment: the kernel's scalar fallback.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "cuda/apply_kernels.h"
#include "cuda/apply_thread.h"
#include "ps/optimizer.h"

namespace dsync::bench {
namespace {

struct Options {
  std::vector<uint64_t> slices_mib{4, 16, 64, 256, 1024};
  std::vector<uint32_t> grads{1};
  std::vector<std::string> optimizers{"sgd", "adam", "momentum", "sum"};
  uint64_t pass_mib = 1024;
  int reps = 20;
  int warmup = 3;
  bool scalar = false;
};

constexpr double kTargetRatio = 0.85;

// A benchmark has nothing to recover: any CUDA error ends it with what failed.
void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  fmt::print(stderr, "bench_cuda_apply: {}: {} ({})\n", what, cudaGetErrorString(err),
             cudaGetErrorName(err));
  std::exit(1);
}

float* DeviceFloats(uint64_t n, const char* what) {
  void* p = nullptr;
  Check(cudaMalloc(&p, n * sizeof(float)), what);
  return static_cast<float*>(p);
}

cuda::Update UpdateOf(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSum: return cuda::Update::kSum;
    case OptimizerKind::kSgd: return cuda::Update::kSgd;
    case OptimizerKind::kMomentum: return cuda::Update::kMomentum;
    case OptimizerKind::kAdam: return cuda::Update::kAdam;
    case OptimizerKind::kAdamW: return cuda::Update::kAdamW;
  }
  return cuda::Update::kSgd;
}

bool UsesVec4(cuda::Update u, const float* w, const float* s0, const float* s1, const float* g,
              uint32_t k, uint64_t stride) {
  switch (u) {
    case cuda::Update::kSum: return cuda::UsesVec4<cuda::Update::kSum>(w, s0, s1, g, k, stride);
    case cuda::Update::kSgd: return cuda::UsesVec4<cuda::Update::kSgd>(w, s0, s1, g, k, stride);
    case cuda::Update::kMomentum:
      return cuda::UsesVec4<cuda::Update::kMomentum>(w, s0, s1, g, k, stride);
    case cuda::Update::kAdam: return cuda::UsesVec4<cuda::Update::kAdam>(w, s0, s1, g, k, stride);
    case cuda::Update::kAdamW:
      return cuda::UsesVec4<cuda::Update::kAdamW>(w, s0, s1, g, k, stride);
  }
  return false;
}

uint64_t BytesPerElement(OptimizerKind kind, uint32_t k) {
  return 4ull * k + 8 + 8ull * ps::OptimizerStateSlots(kind);
}

// Whatever `enqueue` puts on `stream`, as a graph to launch repeatedly.
cudaGraphExec_t Capture(cudaStream_t stream, const std::function<void()>& enqueue) {
  Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "beginning a capture");
  enqueue();
  cudaGraph_t graph = nullptr;
  Check(cudaStreamEndCapture(stream, &graph), "ending a capture");
  cudaGraphExec_t exec = nullptr;
  Check(cudaGraphInstantiate(&exec, graph, 0), "instantiating a graph");
  Check(cudaGraphDestroy(graph), "destroying a graph");
  return exec;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"dsyncps GPU apply throughput (the CUDA store's update kernel vs a D2D copy)"};
  app.add_option("--slices-mib", o.slices_mib, "slice sizes in MiB")->delimiter(',');
  app.add_option("--grads", o.grads, "gradients per round")->delimiter(',');
  app.add_option("--optimizers", o.optimizers, "sgd, momentum, adam, adamw, sum")->delimiter(',');
  app.add_option("--pass-mib", o.pass_mib,
                 "MiB of distinct slices per timed pass (keeps small slices out of L2)");
  app.add_option("--reps", o.reps, "timed passes per row, after the warm-up")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed passes per row")->check(CLI::NonNegativeNumber);
  app.add_flag("--scalar", o.scalar, "also time the scalar path (arrays off 16-byte alignment)");
  CLI11_PARSE(app, argc, argv);
  QuietLogs();

  auto parsed = ParseOptimizers(o.optimizers);
  if (!parsed.ok()) {
    fmt::print(stderr, "{}\n", parsed.status().ToString());
    return 2;
  }
  const std::vector<OptimizerKind> kinds = *parsed;
  for (uint64_t mib : o.slices_mib) {
    if (mib == 0) {
      fmt::print(stderr, "--slices-mib: sizes must be positive\n");
      return 2;
    }
  }
  for (uint32_t k : o.grads) {
    if (k == 0) {
      fmt::print(stderr, "--grads: a round has at least one gradient\n");
      return 2;
    }
  }
  if (o.slices_mib.empty() || o.grads.empty()) {
    fmt::print(stderr, "--slices-mib and --grads need at least one value\n");
    return 2;
  }

  int devices = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&devices); err != cudaSuccess || devices == 0) {
    fmt::print(stderr, "no CUDA device is visible ({}); this benchmark needs a GPU\n",
               err != cudaSuccess
                   ? fmt::format("{} ({})", cudaGetErrorString(err), cudaGetErrorName(err))
                   : std::string("no device"));
    return 1;
  }
  int device = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");

  // One region per array, shared by every slice size: slice i of a size starts i slices in
  // (its k gradients i*k slices in, `stride` = the slice apart, as the store lays them out).
  // The 4 extra floats let the scalar rows start one float in.
  const uint64_t max_slice = *std::max_element(o.slices_mib.begin(), o.slices_mib.end()) * kMiB / 4;
  const uint64_t region = std::max<uint64_t>(o.pass_mib * kMiB / 4, max_slice);
  const uint32_t max_k = *std::max_element(o.grads.begin(), o.grads.end());
  const uint64_t need_bytes = (4 * (region + 4) + max_k * region + 4) * sizeof(float);
  size_t free_bytes = 0, total_bytes = 0;
  Check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (need_bytes > free_bytes) {
    fmt::print(stderr,
               "bench_cuda_apply: needs {:.2f} GiB of device memory, {:.2f} GiB free; lower "
               "--pass-mib, --grads or the largest --slices-mib\n",
               static_cast<double>(need_bytes) / (1 << 30), static_cast<double>(free_bytes) / (1 << 30));
    return 1;
  }
  float* w = DeviceFloats(region + 4, "allocating w");
  float* s0 = DeviceFloats(region + 4, "allocating state 0");
  float* s1 = DeviceFloats(region + 4, "allocating state 1");
  float* dst = DeviceFloats(region + 4, "allocating the copy destination");
  float* grads = DeviceFloats(max_k * region + 4, "allocating gradients");
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
  // Non-zero, normal inputs (bytes 0x3f: w = 0.747; 0x3a: 7.1e-4), written before any timing.
  Check(cudaMemsetAsync(w, 0x3f, (region + 4) * sizeof(float), stream), "filling w");
  Check(cudaMemsetAsync(s0, 0x3a, (region + 4) * sizeof(float), stream), "filling state 0");
  Check(cudaMemsetAsync(s1, 0x3a, (region + 4) * sizeof(float), stream), "filling state 1");
  Check(cudaMemsetAsync(dst, 0, (region + 4) * sizeof(float), stream), "filling the copy destination");
  Check(cudaMemsetAsync(grads, 0x3a, (max_k * region + 4) * sizeof(float), stream), "filling gradients");
  Check(cudaStreamSynchronize(stream), "filling the inputs");
  cudaEvent_t start = nullptr, stop = nullptr;
  Check(cudaEventCreate(&start), "creating an event");
  Check(cudaEventCreate(&stop), "creating an event");

  fmt::print("dsyncps GPU apply throughput: {} ({} SMs, L2 {} MiB, {:.0f} GiB)\n", prop.name,
             prop.multiProcessorCount, prop.l2CacheSize / (1 << 20),
             static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  fmt::print("bytes moved per element = 4k (gradient reads) + 8 (w read+write) + 8 per state "
             "array (momentum 1, adam 2); copy = 8 (read+write)\n");
  fmt::print("a pass = one round on each slice of {} MiB of distinct slices (one CUDA graph); "
             "GB/s = bytes moved / median pass time over {} passes after {} warm-up; x copy = "
             "that / the D2D cudaMemcpyAsync GB/s of the same slices; target >= {:.2f} for sgd "
             "and adam\n",
             o.pass_mib, o.reps, o.warmup, kTargetRatio);
  fmt::print("\n{:>7} {:>6} {:>9} {:>6} {:>5} {:>6} {:>9} {:>8} {:>7}   {}\n", "slice", "slices",
             "kernel", "path", "grads", "B/elem", "pass ms", "GB/s", "x copy", "[min .. max ms]");

  nlohmann::json rows = nlohmann::json::array();
  nlohmann::json baselines = nlohmann::json::array();
  std::vector<std::string> below_target;
  for (uint64_t slice_mib : o.slices_mib) {
    const uint64_t n = slice_mib * kMiB / 4;
    const uint64_t slices = std::max<uint64_t>(region / n, 1);
    const uint64_t stride = cuda::GradientStride(n);  // == n: sizes are whole MiB

    struct Row {
      std::string kernel;
      std::optional<OptimizerKind> kind;  // none: the copy
      bool vec4 = false;
      uint32_t grads = 0;
      uint64_t bytes_per_elem = 0;
      cudaGraphExec_t exec = nullptr;
      std::vector<double> ms;
    };
    std::vector<Row> table;
    table.push_back({"copy", std::nullopt, false, 0, 8,
                     Capture(stream, [&] {
                       for (uint64_t i = 0; i < slices; ++i) {
                         Check(cudaMemcpyAsync(dst + i * n, w + i * n, n * sizeof(float),
                                               cudaMemcpyDeviceToDevice, stream),
                               "copying a slice");
                       }
                     }),
                     {}});
    for (OptimizerKind kind : kinds) {
      for (uint32_t k : o.grads) {
        OptimizerConfig config;
        config.kind = kind;
        config.lr = 1e-3f;
        const ps::OptimizerScalars sc = ps::MakeOptimizerScalars(config, 1, k);
        const cuda::Update u = UpdateOf(kind);
        for (uint64_t off : {uint64_t{0}, uint64_t{1}}) {
          if (off == 1 && !o.scalar) continue;
          Row row{std::string(OptimizerName(kind)), kind,
                  UsesVec4(u, w + off, s0 + off, s1 + off, grads + off, k, stride), k,
                  BytesPerElement(kind, k), nullptr, {}};
          row.exec = Capture(stream, [&] {
            for (uint64_t i = 0; i < slices; ++i) {
              Check(cuda::LaunchApplyRound(u, w + off + i * n, s0 + off + i * n, s1 + off + i * n,
                                           grads + off + i * k * n, nullptr, {}, k, stride, n,
                                           sc, stream),
                    "launching the update kernel");
            }
          });
          table.push_back(std::move(row));
        }
      }
    }

    for (Row& r : table) {
      for (int i = 0; i < o.warmup; ++i) Check(cudaGraphLaunch(r.exec, stream), "warm-up pass");
    }
    Check(cudaStreamSynchronize(stream), "warm-up");
    for (int rep = 0; rep < o.reps; ++rep) {
      for (Row& r : table) {
        Check(cudaEventRecord(start, stream), "cudaEventRecord");
        Check(cudaGraphLaunch(r.exec, stream), "timed pass");
        Check(cudaEventRecord(stop, stream), "cudaEventRecord");
        Check(cudaEventSynchronize(stop), "timed pass");
        float ms = 0;
        Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
        r.ms.push_back(ms);
      }
    }

    const double elems = static_cast<double>(slices * n);
    const double copy_ms = Median(table[0].ms);
    const double copy_gbps = 8 * elems / (copy_ms * 1e-3) / kGB;
    baselines.push_back({{"slice_mib", slice_mib},
                         {"slices", slices},
                         {"copy_gbps", copy_gbps},
                         {"copy_ms", copy_ms},
                         {"copy_ms_min", Min(table[0].ms)},
                         {"copy_ms_max", Max(table[0].ms)}});
    for (Row& r : table) {
      const double ms = Median(r.ms);
      const double gbps = static_cast<double>(r.bytes_per_elem) * elems / (ms * 1e-3) / kGB;
      const std::string path = r.kind ? (r.vec4 ? "vec4" : "scalar") : "-";
      fmt::print("{:>4}MiB {:>6} {:>9} {:>6} {:>5} {:>6} {:>9.3f} {:>8.1f} {:>7.3f}   [{:.3f} .. {:.3f}]\n",
                 slice_mib, slices, r.kernel, path, r.kind ? fmt::format("{}", r.grads) : "-",
                 r.bytes_per_elem, ms, gbps, gbps / copy_gbps, Min(r.ms), Max(r.ms));
      Check(cudaGraphExecDestroy(r.exec), "destroying a graph");
      if (!r.kind) continue;
      const bool targeted = r.vec4 && (*r.kind == OptimizerKind::kSgd || *r.kind == OptimizerKind::kAdam);
      if (targeted && gbps / copy_gbps < kTargetRatio) {
        below_target.push_back(fmt::format("{} k={} {} MiB ({:.3f})", r.kernel, r.grads, slice_mib,
                                           gbps / copy_gbps));
      }
      rows.push_back({{"slice_mib", slice_mib},
                      {"slices", slices},
                      {"kernel", r.kernel},
                      {"path", path},
                      {"grads", r.grads},
                      {"bytes_per_elem", r.bytes_per_elem},
                      {"pass_ms", ms},
                      {"pass_ms_min", Min(r.ms)},
                      {"pass_ms_max", Max(r.ms)},
                      {"gbps", gbps},
                      {"ratio_to_copy", gbps / copy_gbps}});
    }
    std::fflush(stdout);
  }

  if (below_target.empty()) {
    fmt::print("\nsgd and adam (vec4) rows at >= {:.2f} x copy: all\n", kTargetRatio);
  } else {
    fmt::print("\nsgd and adam (vec4) rows below {:.2f} x copy: {}\n", kTargetRatio,
               fmt::join(below_target, ", "));
  }
  nlohmann::json result = {{"bench", "cuda_apply"},
                           {"store", "cuda"},
                           {"device", std::string(prop.name)},
                           {"sms", prop.multiProcessorCount},
                           {"l2_bytes", prop.l2CacheSize},
                           {"pass_mib", o.pass_mib},
                           {"reps", o.reps},
                           {"warmup", o.warmup},
                           {"target_ratio", kTargetRatio},
                           {"below_target", below_target},
                           {"baselines", baselines},
                           {"rows", rows}};
  fmt::print("\nRESULT {}\n", result.dump());

  Check(cudaEventDestroy(start), "cudaEventDestroy");
  Check(cudaEventDestroy(stop), "cudaEventDestroy");
  Check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  for (float* p : {w, s0, s1, dst, grads}) Check(cudaFree(p), "cudaFree");
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
