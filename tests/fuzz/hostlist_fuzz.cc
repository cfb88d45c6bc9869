// ps::ExpandHostList (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): what it accepts expands to
// at most kMaxHostListHosts plain names, and those names, listed with commas, expand to
// themselves; what it refuses is an invalid-argument error.
#include <string>

#include "fuzz_check.h"
#include "ps/hostlist.h"

using namespace dsync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto hosts = ps::ExpandHostList(text);
  if (!hosts.ok()) {
    FUZZ_CHECK(hosts.status().code() == StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(!hosts->empty() && hosts->size() <= ps::kMaxHostListHosts);
  std::string plain;
  for (const std::string& h : *hosts) {
    FUZZ_CHECK(!h.empty());
    FUZZ_CHECK(h.find_first_of("[],") == std::string::npos);
    if (!plain.empty()) plain += ',';
    plain += h;
  }
  if (plain.size() < 4096) {
    const auto again = ps::ExpandHostList(plain);
    FUZZ_CHECK(again.ok() && *again == *hosts);
  }
  return 0;
}
