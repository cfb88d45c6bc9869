// ps::DecodeMembers, the kRound metadata a server applies. The encoding has one form per
// member list, so whatever decodes must encode back to the very same bytes; and any member
// list the scheduler encodes must decode to itself.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <vector>

#include "fuzz_check.h"
#include "ps/protocol.h"

using namespace dsync;
using namespace dsync::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  std::vector<RoundMember> members;
  const Status st = DecodeMembers(meta, members);
  if (st.ok()) {
    std::vector<std::byte> encoded;
    EncodeMembers(members, encoded);
    FUZZ_CHECK(encoded.size() == meta.size());
    FUZZ_CHECK(std::equal(encoded.begin(), encoded.end(), meta.begin()));
  } else {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol);
  }

  // The other direction: a list built from the input.
  FuzzedDataProvider in(data, size);
  std::vector<RoundMember> built(in.ConsumeIntegralInRange<size_t>(0, 64));
  for (RoundMember& m : built) {
    m.worker = in.ConsumeIntegral<WorkerId>();
    m.clock = in.ConsumeIntegral<Clock>();
    m.base = in.ConsumeIntegral<Version>();
  }
  std::vector<std::byte> encoded;
  EncodeMembers(built, encoded);
  std::vector<RoundMember> decoded;
  FUZZ_CHECK(DecodeMembers(encoded, decoded).ok());
  FUZZ_CHECK(decoded == built);
  // A truncated list is refused, never read short.
  if (!encoded.empty()) {
    encoded.pop_back();
    FUZZ_CHECK(!DecodeMembers(encoded, decoded).ok());
  }
  return 0;
}
