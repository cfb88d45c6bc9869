// The C++ side of bench/python/overhead.py: one worker that pushes and pulls the same tensors
// every iteration (PushPull per tensor, then Wait), timing the iterations after a warm-up.
// Prints one JSON line: {"mode": "cpp", "ms_per_step": median, "cpu_ms_per_step": median of
// the process's CPU time (all its threads), "steps": N}.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"

namespace {

double CpuMs() {  // this process's CPU time, every thread: the transfers' threads count too
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// The median of the values after a warm-up (the first fifth, at most 10).
double MedianAfterWarmup(const std::vector<double>& v) {
  const size_t warm = std::min<size_t>(v.size() / 5, 10);
  std::vector<double> kept(v.begin() + static_cast<long>(warm), v.end());
  std::nth_element(kept.begin(), kept.begin() + static_cast<long>(kept.size() / 2), kept.end());
  return kept[kept.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: step_worker STEPS SIZES(a,b,..)\n");
    return 2;
  }
  const int steps = std::atoi(argv[1]);
  std::vector<size_t> sizes;
  for (std::string s = argv[2]; !s.empty();) {
    const size_t comma = s.find(',');
    sizes.push_back(std::stoul(s.substr(0, comma)));
    s = comma == std::string::npos ? "" : s.substr(comma + 1);
  }
  auto config = dsync::Config::FromProcessEnvironment();
  if (!config.ok()) return std::fprintf(stderr, "%s\n", config.status().message().c_str()), 1;
  auto started = dsync::Worker::Start(config.value());
  if (!started.ok()) return std::fprintf(stderr, "%s\n", started.status().message().c_str()), 1;
  auto w = std::move(started).value();
  std::vector<std::vector<float>> model, grad;
  std::vector<dsync::TensorId> ids;
  for (size_t t = 0; t < sizes.size(); ++t) {
    model.emplace_back(sizes[t], 0.5f);
    grad.emplace_back(sizes[t], 1e-3f);
    auto id = w->Register("t" + std::to_string(t), model[t]);
    if (!id.ok()) return std::fprintf(stderr, "%s\n", id.status().message().c_str()), 1;
    ids.push_back(*id);
    (void)w->RegisterBuffer(model[t].data(), sizes[t] * sizeof(float));
    (void)w->RegisterBuffer(grad[t].data(), sizes[t] * sizeof(float));
  }
  std::vector<double> ms, cpu;
  std::vector<dsync::Handle> handles(sizes.size());
  for (int k = 0; k < steps; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = CpuMs();
    for (size_t t = 0; t < sizes.size(); ++t) handles[t] = w->PushPull(ids[t], grad[t].data(), model[t].data());
    for (dsync::Handle h : handles) {
      if (auto st = w->Wait(h); !st.ok()) return std::fprintf(stderr, "%s\n", st.message().c_str()), 1;
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(CpuMs() - c0);
  }
  std::printf("{\"mode\": \"cpp\", \"ms_per_step\": %.4f, \"cpu_ms_per_step\": %.4f, \"steps\": %zu}\n",
              MedianAfterWarmup(ms), MedianAfterWarmup(cpu), ms.size() - std::min<size_t>(ms.size() / 5, 10));
  for (size_t t = 0; t < sizes.size(); ++t) {
    w->UnregisterBuffer(model[t].data(), sizes[t] * sizeof(float));
    w->UnregisterBuffer(grad[t].data(), sizes[t] * sizeof(float));
  }
  return w->Leave().ok() ? 0 : 1;
}
