// ParseRole and ParseOptimizer (DSYNC_ROLE, DSYNC_OPTIMIZER, --optimizer, and the hello and
// welcome JSON): a name is accepted only when it is exactly the canonical name of what it
// parses to.
#include <string>

#include "dsync/config.h"
#include "fuzz_check.h"

using namespace dsync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (const Result<Role> r = ParseRole(text); r.ok()) {
    FUZZ_CHECK(RoleName(*r) == text);
  } else {
    FUZZ_CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
  if (const Result<OptimizerKind> o = ParseOptimizer(text); o.ok()) {
    FUZZ_CHECK(OptimizerName(*o) == text);
  } else {
    FUZZ_CHECK(o.status().code() == StatusCode::kInvalidArgument);
  }
  return 0;
}
