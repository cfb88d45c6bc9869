// The C++ baseline of a whole training step for bench/python/overhead.py: the same
// parameters, the same backward pass through libtorch's autograd (the kernels and the
// allocator dsyncps.torch's backward runs on) and the same transfers through the C++ worker
// (PushPull per tensor once backward has returned, then Wait). The backward pass timed alone
// first, as step_worker.py does, then whole steps with the tensors pushed in backward order
// (as dsyncps.torch's hooks push them), then in registration order. Prints one JSON line like
// step_worker.py's torch mode: {"mode": "libtorch", "ms_per_step", "cpu_ms_per_step",
// "forward_order_ms_per_step", "forward_order_cpu_ms_per_step", "backward_ms",
// "backward_cpu_ms", "faults_per_step", "backward_faults_per_step", "steps"}.
#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/worker.h"
#include "step_timing.h"

int main(int argc, char** argv) {
  const std::optional<step_timing::Args> args =
      step_timing::ParseArgs(argc, argv, "torch_step_worker");
  if (!args) return 2;
  const int steps = args->steps;
  const std::vector<size_t>& sizes = args->sizes;
  torch::set_num_threads(1);  // as step_worker.py: one thread of compute beside the transfers
  std::vector<torch::Tensor> params, coeff;
  for (size_t n : sizes) {
    params.push_back(torch::full({static_cast<int64_t>(n)}, 0.5, torch::requires_grad()));
    coeff.push_back(torch::full({static_cast<int64_t>(n)}, 1e-3));
  }
  auto backward = [&] {  // zero_grad (in place, torch 1.13's default) and the backward pass
    for (auto& p : params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    torch::Tensor loss = (params[0] * coeff[0]).sum();
    for (size_t t = 1; t < params.size(); ++t) loss = loss + (params[t] * coeff[t]).sum();
    loss.backward();
    return true;
  };
  step_timing::Timed plain;
  plain.Run(steps, backward);

  auto config = dsync::Config::FromProcessEnvironment();
  if (!config.ok()) return std::fprintf(stderr, "%s\n", config.status().message().c_str()), 1;
  auto started = dsync::Worker::Start(config.value());
  if (!started.ok()) return std::fprintf(stderr, "%s\n", started.status().message().c_str()), 1;
  auto w = std::move(started).value();
  std::vector<dsync::TensorId> ids;
  for (size_t t = 0; t < sizes.size(); ++t) {
    auto id = w->Register("t" + std::to_string(t),
                          std::span<const float>(params[t].data_ptr<float>(), sizes[t]));
    if (!id.ok()) return std::fprintf(stderr, "%s\n", id.status().message().c_str()), 1;
    ids.push_back(*id);
  }
  std::vector<dsync::Handle> handles(sizes.size());
  dsync::Status failed;
  // A whole step, the tensors pushed in backward order (the last registered first: the order
  // in which autograd finishes their gradients, and dsyncps.torch's hooks push them) or in
  // registration order. The order matters: pushed first, the largest tensor's update and
  // pull overlap the smaller ones' transfers.
  auto step = [&](bool backward_order) {
    backward();
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t t = backward_order ? sizes.size() - 1 - k : k;
      handles[t] = w->PushPull(ids[t], params[t].grad().data_ptr<float>(), params[t].data_ptr<float>());
    }
    for (dsync::Handle h : handles) {
      if (dsync::Status st = w->Wait(h); !st.ok() && failed.ok()) failed = st;
    }
    return failed.ok();
  };
  step_timing::Timed whole, forward_order;
  const bool ok = whole.Run(steps, [&] { return step(true); }) &&
                  forward_order.Run(steps, [&] { return step(false); });
  if (!ok) return std::fprintf(stderr, "torch_step_worker: %s\n", failed.ToString().c_str()), 1;
  std::printf("{\"mode\": \"libtorch\", \"ms_per_step\": %.4f, \"cpu_ms_per_step\": %.4f, "
              "\"forward_order_ms_per_step\": %.4f, \"forward_order_cpu_ms_per_step\": %.4f, "
              "\"backward_ms\": %.4f, \"backward_cpu_ms\": %.4f, \"faults_per_step\": %.1f, "
              "\"backward_faults_per_step\": %.1f, \"steps\": %zu}\n",
              step_timing::MedianAfterWarmup(whole.ms), step_timing::MedianAfterWarmup(whole.cpu),
              step_timing::MedianAfterWarmup(forward_order.ms),
              step_timing::MedianAfterWarmup(forward_order.cpu),
              step_timing::MedianAfterWarmup(plain.ms), step_timing::MedianAfterWarmup(plain.cpu),
              whole.faults, plain.faults,
              step_timing::Kept(whole.ms.size()));
  return w->Leave().ok() ? 0 : 1;
}
