// ps::DecodeInit, the kInit metadata naming the tensor a worker registers. Whatever decodes
// must encode back to the very same bytes (one form per value), and every InitMeta a worker
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
  InitMeta im;
  const Status st = DecodeInit(meta, im);
  if (st.ok()) {
    std::vector<std::byte> encoded;
    EncodeInit(im, encoded);
    FUZZ_CHECK(encoded.size() == meta.size());
    FUZZ_CHECK(std::equal(encoded.begin(), encoded.end(), meta.begin()));
  } else {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol);
  }

  FuzzedDataProvider in(data, size);
  InitMeta built;
  built.tensor_elements = in.ConsumeIntegral<uint64_t>();
  built.slice_offset = in.ConsumeIntegral<uint64_t>();
  if (in.ConsumeBool()) {
    // Any optimizer a worker may send: a valid one (Register checks it before sending).
    OptimizerConfig o;
    o.kind = static_cast<OptimizerKind>(
        in.ConsumeIntegralInRange<int>(0, static_cast<int>(OptimizerKind::kAdamW)));
    o.lr = in.ConsumeFloatingPointInRange<float>(0.0f, 10.0f);
    o.weight_decay = in.ConsumeFloatingPointInRange<float>(0.0f, 1.0f);
    o.dampening = in.ConsumeFloatingPointInRange<float>(0.0f, 1.0f);
    o.beta1 = in.ConsumeFloatingPointInRange<float>(0.0f, 0.99f);
    built.optimizer = o;
  }
  built.name = in.ConsumeRemainingBytesAsString();
  std::vector<std::byte> encoded;
  EncodeInit(built, encoded);
  InitMeta decoded;
  FUZZ_CHECK(DecodeInit(encoded, decoded).ok());
  FUZZ_CHECK(decoded.name == built.name && decoded.tensor_elements == built.tensor_elements &&
             decoded.slice_offset == built.slice_offset && decoded.optimizer == built.optimizer);
  encoded.pop_back();  // metadata cut short is refused, never read past the end
  FUZZ_CHECK(!DecodeInit(encoded, decoded).ok());
  return 0;
}
