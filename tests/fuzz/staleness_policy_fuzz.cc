// StalenessPolicy::Parse (--staleness-policy, DSYNC_STALENESS_POLICY, and the welcome every
// node receives): a parsed policy prints as text that parses back to it and is then its own
// canonical text; its weights lie in [0, 1] and are exactly 1 for fresh gradients; its
// compensation keeps what the contract allows; its tempered momentum is never above the
// momentum asked for, never below 0, and exactly it for fresh rounds.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "dsync/config.h"
#include "fuzz_check.h"

using namespace dsync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string text = in.ConsumeRandomLengthString(64);
  const Result<StalenessPolicy> p = StalenessPolicy::Parse(text);
  if (!p.ok()) {
    FUZZ_CHECK(p.status().code() == StatusCode::kInvalidArgument);
    // Every refusal names the text it refused.
    FUZZ_CHECK(p.status().message().find(text) != std::string::npos);
    return 0;
  }
  const std::string canonical = p->ToString();
  const Result<StalenessPolicy> again = StalenessPolicy::Parse(canonical);
  FUZZ_CHECK(again.ok() && *again == *p);
  FUZZ_CHECK(again->ToString() == canonical);
  FUZZ_CHECK(p->compensation >= 0.0f && std::isfinite(p->compensation));
  FUZZ_CHECK(p->depth <= StalenessPolicy::kMaxCompensationDepth);
  // damp: none until damped, then a policy that is no damp policy itself and not none.
  FUZZ_CHECK(!p->Active(true).damp && !p->Active(false).damp);
  if (p->damp) {
    FUZZ_CHECK(p->Active(false) == StalenessPolicy{});
    FUZZ_CHECK(!(p->Active(true) == StalenessPolicy{}));
  } else {
    FUZZ_CHECK(p->Active(false) == *p && p->Active(true) == *p);
  }

  const uint64_t s = in.ConsumeIntegral<uint64_t>();
  const float w = p->Weight(s);
  FUZZ_CHECK(p->Weight(0) == 1.0f);
  FUZZ_CHECK(w >= 0.0f && w <= 1.0f);

  const float m = in.ConsumeFloatingPointInRange<float>(0.0f, 1.0f);
  const double mean = in.ConsumeFloatingPoint<double>();
  const float t = p->RoundMomentum(m, mean);
  FUZZ_CHECK(p->RoundMomentum(m, 0.0) == m);
  if (!p->temper_momentum) FUZZ_CHECK(t == m);
  FUZZ_CHECK((t >= 0.0f && t <= m) || (m >= 1.0f && t == m));
  return 0;
}
