// The C++ side of bench/python/overhead.py: one worker that pushes and pulls the same tensors
// every iteration (PushPull per tensor, then Wait), timing the iterations after a warm-up.
// Prints one JSON line: {"mode": "cpp", "ms_per_step": median, "steps": N}.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"

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
  std::vector<double> ms;
  std::vector<dsync::Handle> handles(sizes.size());
  for (int k = 0; k < steps; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t t = 0; t < sizes.size(); ++t) handles[t] = w->PushPull(ids[t], grad[t].data(), model[t].data());
    for (dsync::Handle h : handles) {
      if (auto st = w->Wait(h); !st.ok()) return std::fprintf(stderr, "%s\n", st.message().c_str()), 1;
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const size_t warm = std::min<size_t>(ms.size() / 5, 10);
  std::vector<double> kept(ms.begin() + static_cast<long>(warm), ms.end());
  std::nth_element(kept.begin(), kept.begin() + static_cast<long>(kept.size() / 2), kept.end());
  std::printf("{\"mode\": \"cpp\", \"ms_per_step\": %.4f, \"steps\": %zu}\n", kept[kept.size() / 2],
              kept.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    w->UnregisterBuffer(model[t].data(), sizes[t] * sizeof(float));
    w->UnregisterBuffer(grad[t].data(), sizes[t] * sizeof(float));
  }
  return w->Leave().ok() ? 0 : 1;
}
