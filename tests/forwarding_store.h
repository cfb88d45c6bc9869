// A ParamStore that hands every call to a CPU store: tests derive from it and override only
// what they change (fake device memory, injected failures).
#pragma once

#include <memory>

#include "cpu/cpu_store.h"
#include "ps/param_store.h"

namespace dsync::testing {

class ForwardingStore : public ps::ParamStore {
 public:
  std::string_view name() const override { return "forwarding"; }
  void* AllocateHost(size_t bytes) override { return cpu_->AllocateHost(bytes); }
  void FreeHost(void* p, size_t bytes) override { cpu_->FreeHost(p, bytes); }
  Status InitSlice(ps::SliceKey k, std::span<const float> init) override {
    return cpu_->InitSlice(k, init);
  }
  bool HasSlice(ps::SliceKey k) const override { return cpu_->HasSlice(k); }
  uint64_t SliceElements(ps::SliceKey k) const override { return cpu_->SliceElements(k); }
  using ps::ParamStore::ApplyRound;
  Status ApplyRound(ps::SliceKey k, std::span<const float* const> grads,
                    std::span<const float> weights, const ps::Compensation& comp,
                    const OptimizerConfig& opt) override {
    return cpu_->ApplyRound(k, grads, weights, comp, opt);
  }
  Status Read(ps::SliceKey k, std::span<float> out) const override { return cpu_->Read(k, out); }
  Status Snapshot(ps::SliceKey k, ps::SliceSnapshot& out) const override {
    return cpu_->Snapshot(k, out);
  }
  Status Restore(ps::SliceKey k, const ps::SliceSnapshot& in) override {
    return cpu_->Restore(k, in);
  }

 protected:
  std::unique_ptr<ps::ParamStore> cpu_ = cpu::MakeCpuStore();
};

}  // namespace dsync::testing
