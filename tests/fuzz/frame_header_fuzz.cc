// ps::ValidateHeader, the first check on every frame a peer sends: a header it passes has a
// frame's magic and version and lengths within the limits, whatever the other bytes say.
// ps::CheckUnauthenticatedFrame, the check on a stranger's frame: what it passes is a hello
// of at most kMaxHelloMetaBytes with no payload, and nothing else.
// Bytes after the header are a kError frame's metadata, decoded by ps::ErrorFromFrame.
#include <algorithm>
#include <cstring>

#include "fuzz_check.h"
#include "ps/handshake.h"  // ErrorFromFrame
#include "ps/protocol.h"

using namespace dsync;
using namespace dsync::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The input overlays a valid header, so that short inputs mutate its first fields only.
  FrameHeader h = MakeHeader(MsgType::kPush, kFirstWorkerId);
  std::memcpy(&h, data, std::min(size, sizeof h));
  const Status st = ValidateHeader(h);
  (void)MsgTypeName(h.msg_type());
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol || st.code() == StatusCode::kUnimplemented);
    FUZZ_CHECK(!st.message().empty());
    return 0;
  }
  FUZZ_CHECK(h.magic == kFrameMagic);
  FUZZ_CHECK(h.version == kProtocolVersion);
  FUZZ_CHECK(h.meta_len <= kMaxMetaBytes);
  FUZZ_CHECK(h.payload_len <= kMaxPayloadBytes);
  const Status stranger = CheckUnauthenticatedFrame(h);
  FUZZ_CHECK(stranger.ok() == (h.msg_type() == MsgType::kHello &&
                               h.meta_len <= kMaxHelloMetaBytes && h.payload_len == 0));
  if (!stranger.ok()) FUZZ_CHECK(stranger.code() == StatusCode::kPermissionDenied);

  if (h.msg_type() == MsgType::kError && size > sizeof h) {
    const auto meta = FuzzBytes(data + sizeof h, size - sizeof h);
    const Status error = ErrorFromFrame(h, meta);
    FUZZ_CHECK(!error.ok());  // an error frame never reads as success, whatever its code
    FUZZ_CHECK(error.message() == AsText(meta));
    (void)error.ToString();   // codes this node does not know still print
  }
  return 0;
}
