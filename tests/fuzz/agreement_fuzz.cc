// ps::DecodeAgreement, the kApplied metadata a server sends the scheduler under dsync:auto:
// per member a flag and a double. One form per report, so whatever decodes encodes back to
// the very same bytes; every value measured is finite; a refusal is a protocol error.
#include <algorithm>
#include <cmath>
#include <vector>

#include "fuzz_check.h"
#include "ps/protocol.h"

using namespace dsync;
using namespace dsync::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  Agreement a;
  const Status st = DecodeAgreement(meta, a);
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol);
    return 0;
  }
  FUZZ_CHECK(a.dots.size() == a.measured.size());
  for (size_t m = 0; m < a.dots.size(); ++m) {
    FUZZ_CHECK(a.measured[m] <= 1);
    FUZZ_CHECK(a.measured[m] ? std::isfinite(a.dots[m]) : a.dots[m] == 0.0);
  }
  std::vector<std::byte> encoded;
  EncodeAgreement(a, encoded);
  FUZZ_CHECK(encoded.size() == meta.size());
  FUZZ_CHECK(std::equal(encoded.begin(), encoded.end(), meta.begin()));
  return 0;
}
