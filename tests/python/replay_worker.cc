// The C++ twin of tests/python/workers/core_worker.py --mode replay: the same tensors, initial
// values and gradients through the C++ API, the final model written to OUT.RANK (raw float32),
// so the test can compare the two front ends bit for bit. Public headers only.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: replay_worker ITERS SIZES(a,b,..) OUT\n");
    return 2;
  }
  const int iters = std::atoi(argv[1]);
  std::vector<long> sizes;
  for (std::string s = argv[2]; !s.empty();) {
    const size_t comma = s.find(',');
    sizes.push_back(std::stol(s.substr(0, comma)));
    s = comma == std::string::npos ? "" : s.substr(comma + 1);
  }
  const char* rank_text = std::getenv("DSYNC_WORKER_RANK");
  const long rank = rank_text != nullptr ? std::atol(rank_text) : 0;
  auto config = dsync::Config::FromProcessEnvironment();
  if (!config.ok()) return std::fprintf(stderr, "%s\n", config.status().message().c_str()), 1;
  auto started = dsync::Worker::Start(config.value());
  if (!started.ok()) return std::fprintf(stderr, "%s\n", started.status().message().c_str()), 1;
  std::unique_ptr<dsync::Worker> w = std::move(started).value();
  const size_t t_count = sizes.size();
  std::vector<std::vector<float>> model(t_count), grad(t_count);
  std::vector<dsync::TensorId> ids;
  for (size_t t = 0; t < t_count; ++t) {
    std::vector<float> init(static_cast<size_t>(sizes[t]));
    for (long i = 0; i < sizes[t]; ++i) {
      init[static_cast<size_t>(i)] = static_cast<float>((i * 7 + static_cast<long>(t)) % 23 - 11) / 16.0f;
    }
    auto id = w->Register("t" + std::to_string(t), init);
    if (!id.ok()) return std::fprintf(stderr, "%s\n", id.status().message().c_str()), 1;
    ids.push_back(id.value());
    model[t].resize(init.size());
    grad[t].resize(init.size());
    if (auto st = w->Wait(w->Pull(ids[t], model[t].data())); !st.ok()) return 1;
  }
  for (long k = 0; k < iters; ++k) {
    std::vector<dsync::Handle> handles;
    for (size_t t = 0; t < t_count; ++t) {
      for (long i = 0; i < sizes[t]; ++i) {
        const long v = (k * 31 + i * 17 + static_cast<long>(t) * 13 + rank * 7) % 101 - 50;
        grad[t][static_cast<size_t>(i)] = static_cast<float>(v) / 64.0f;
      }
      handles.push_back(w->PushPull(ids[t], grad[t].data(), model[t].data()));
    }
    for (dsync::Handle h : handles) {
      if (auto st = w->Wait(h); !st.ok()) return std::fprintf(stderr, "%s\n", st.message().c_str()), 1;
    }
  }
  std::ofstream out(std::string(argv[3]) + "." + std::to_string(rank), std::ios::binary);
  for (const auto& m : model) {
    out.write(reinterpret_cast<const char*>(m.data()), static_cast<std::streamsize>(m.size() * sizeof(float)));
  }
  std::printf("rank %ld done: %d iterations\n", rank, iters);
  return w->Leave().ok() ? 0 : 1;
}
