// ps::DecodeCommit, a worker's claims about what it pushed and the servers' receipts for it,
// and the scheduler's check of them (ps::VerifyCommit). A decoded commit names each tensor
// once, in ascending order (a tensor named twice would cancel its receipts), encodes back to
// the same bytes, and is never proved by receipts it does not carry.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <vector>

#include "fuzz_check.h"
#include "ps/commit_proof.h"
#include "ps/protocol.h"

using namespace dsync;
using namespace dsync::ps;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto meta = FuzzBytes(data, size);
  CommitProof proof;
  const Status st = DecodeCommit(meta, proof);
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == StatusCode::kProtocol);
    return 0;
  }
  for (size_t i = 0; i < proof.tensors.size(); ++i) {
    FUZZ_CHECK(proof.tensors[i].slices > 0);
    if (i > 0) FUZZ_CHECK(proof.tensors[i - 1].tensor < proof.tensors[i].tensor);
  }
  FUZZ_CHECK(TensorCount(TensorsOf(proof)) == proof.tensors.size());
  std::vector<std::byte> encoded;
  EncodeCommit(proof, encoded);
  FUZZ_CHECK(encoded.size() == meta.size());
  FUZZ_CHECK(std::equal(encoded.begin(), encoded.end(), meta.begin()));

  // Under a key the input cannot know, what it claims is proved only by the receipts the
  // servers would give; the input's own receipts prove nothing (but with a chance of 2^-128).
  static const JobKey key = RandomJobKey();
  const Status verified = VerifyCommit(key, 3, kFirstWorkerId, 7, false, proof);
  FUZZ_CHECK(!verified.ok());
  FUZZ_CHECK(verified.code() == StatusCode::kPermissionDenied ||
             verified.code() == StatusCode::kInvalidArgument);
  bool placed = !proof.tensors.empty();
  for (const CommittedTensor& t : proof.tensors) placed = placed && t.first_rank < 3;
  if (placed) {
    proof.receipts = ExpectedReceipts(key, 3, kFirstWorkerId, 7, proof.tensors);
    FUZZ_CHECK(VerifyCommit(key, 3, kFirstWorkerId, 7, false, proof).ok());
    FUZZ_CHECK(!VerifyCommit(key, 3, kFirstWorkerId, 8, false, proof).ok());
  }
  return 0;
}
