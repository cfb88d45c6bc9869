// ParseScenario (apps/dsyncps/train_job.h): the repeated WORKER=VALUE flags of `dsyncps
// train` and `compare` (--straggler, --join, --leave, --kill, --latency). Beyond not
// crashing: an accepted scenario names only workers that exist, holds finite factors and
// latencies within their bounds, and leaves at least one worker to start the job.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "train_job.h"

using namespace dsync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const uint32_t workers = in.ConsumeIntegralInRange<uint32_t>(0, 16);
  std::vector<std::string> flags[5];
  for (auto& specs : flags) {
    specs.resize(in.ConsumeIntegralInRange<size_t>(0, 3));
    for (std::string& spec : specs) spec = in.ConsumeRandomLengthString(24);
  }
  app::Scenario s;
  const Status st =
      app::ParseScenario(flags[0], flags[1], flags[2], flags[3], flags[4], workers, &s);
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == StatusCode::kInvalidArgument);
    return 0;
  }
  for (const auto& [w, factor] : s.slow) FUZZ_CHECK(w < workers && std::isfinite(factor) && factor >= 1);
  for (const auto& [w, ms] : s.latency_ms) FUZZ_CHECK(w < workers && std::isfinite(ms) && ms >= 0);
  for (const auto* rounds : {&s.join_round, &s.leave_round, &s.kill_round}) {
    for (const auto& [w, round] : *rounds) FUZZ_CHECK(w < workers);
  }
  FUZZ_CHECK(s.join_round.size() < workers);
  (void)s.Describe();
  return 0;
}
