// The C++ side of bench/python/overhead.py: one worker that pushes and pulls the same tensors
// every iteration (PushPull per tensor, then Wait), timing the iterations after a warm-up.
// Prints one JSON line: {"mode": "cpp", "ms_per_step": median, "cpu_ms_per_step": median of
// the process's CPU time (all its threads), "faults_per_step": minor page faults, "steps": N}.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"
#include "step_timing.h"

int main(int argc, char** argv) {
  const std::optional<step_timing::Args> args = step_timing::ParseArgs(argc, argv, "step_worker");
  if (!args) return 2;
  const int steps = args->steps;
  const std::vector<size_t>& sizes = args->sizes;
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
  std::vector<dsync::Handle> handles(sizes.size());
  dsync::Status failed;
  step_timing::Timed run;
  const bool ok = run.Run(steps, [&] {
    for (size_t t = 0; t < sizes.size(); ++t) handles[t] = w->PushPull(ids[t], grad[t].data(), model[t].data());
    for (dsync::Handle h : handles) {
      if (dsync::Status st = w->Wait(h); !st.ok() && failed.ok()) failed = st;
    }
    return failed.ok();
  });
  if (!ok) return std::fprintf(stderr, "step_worker: %s\n", failed.ToString().c_str()), 1;
  std::printf("{\"mode\": \"cpp\", \"ms_per_step\": %.4f, \"cpu_ms_per_step\": %.4f, "
              "\"faults_per_step\": %.1f, \"steps\": %zu}\n",
              step_timing::MedianAfterWarmup(run.ms), step_timing::MedianAfterWarmup(run.cpu),
              run.faults, step_timing::Kept(run.ms.size()));
  for (size_t t = 0; t < sizes.size(); ++t) {
    w->UnregisterBuffer(model[t].data(), sizes[t] * sizeof(float));
    w->UnregisterBuffer(grad[t].data(), sizes[t] * sizeof(float));
  }
  return w->Leave().ok() ? 0 : 1;
}
