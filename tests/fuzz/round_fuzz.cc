// ps::DecodeRound, the kRound metadata a server applies: members in worker order, each with
// the runs of tensors its gradient covers. The encoding has one form per round, so whatever
// decodes must encode back to the very same bytes; and any well-formed round the scheduler
// encodes must decode to itself.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <vector>

#include "fuzz_check.h"
#include "ps/protocol.h"

using namespace dsync;
using namespace dsync::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  std::vector<RoundEntry> entries;
  const Status st = DecodeRound(meta, entries);
  if (st.ok()) {
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i > 0) FUZZ_CHECK(entries[i - 1].member.worker < entries[i].member.worker);
      uint64_t next = 0;
      for (const TensorRange& r : entries[i].tensors) {
        FUZZ_CHECK(r.count > 0 && r.first >= next);
        next = uint64_t{r.first} + r.count;
        FUZZ_CHECK(Contains(entries[i].tensors, r.first));
        FUZZ_CHECK(Contains(entries[i].tensors, static_cast<TensorId>(next - 1)));
      }
    }
    std::vector<std::byte> encoded;
    EncodeRound(entries, encoded);
    FUZZ_CHECK(encoded.size() == meta.size());
    FUZZ_CHECK(std::equal(encoded.begin(), encoded.end(), meta.begin()));
  } else {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol);
  }

  // The other direction: a well-formed round built from the input.
  FuzzedDataProvider in(data, size);
  std::vector<RoundEntry> built(in.ConsumeIntegralInRange<size_t>(0, 32));
  WorkerId worker = kFirstWorkerId;
  for (RoundEntry& e : built) {
    worker += in.ConsumeIntegralInRange<WorkerId>(1, 100);
    e.member = {worker, in.ConsumeIntegral<Clock>(), in.ConsumeIntegral<Version>()};
    TensorId first = 0;
    for (size_t k = in.ConsumeIntegralInRange<size_t>(0, 8); k > 0; --k) {
      first += in.ConsumeIntegralInRange<TensorId>(0, 1000);
      const uint32_t count = in.ConsumeIntegralInRange<uint32_t>(1, 1000);
      e.tensors.push_back({first, count});
      first += count;
    }
  }
  std::vector<std::byte> encoded;
  EncodeRound(built, encoded);
  std::vector<RoundEntry> decoded;
  FUZZ_CHECK(DecodeRound(encoded, decoded).ok());
  FUZZ_CHECK(decoded.size() == built.size());
  for (size_t i = 0; i < built.size(); ++i) {
    FUZZ_CHECK(decoded[i].member == built[i].member);
    FUZZ_CHECK(decoded[i].tensors == built[i].tensors);
  }
  // A truncated round is refused, never read short.
  if (!encoded.empty()) {
    encoded.pop_back();
    FUZZ_CHECK(!DecodeRound(encoded, decoded).ok());
  }
  return 0;
}
