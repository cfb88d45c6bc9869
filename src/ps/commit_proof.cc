#include "ps/commit_proof.h"

#include <algorithm>

namespace dsync::ps {

Tag ExpectedReceipts(const JobKey& key, const Holders& h, WorkerId worker, Clock clock,
                     const std::vector<CommittedTensor>& tensors) {
  Tag expected{};
  const uint32_t num_servers = std::max<uint32_t>(1, h.num_servers);
  for (const CommittedTensor& t : tensors) {
    // Copy j of slice k is on rank first + k + j: the holders are the ranks first + i for
    // i < slices + replicas - 1, at most every rank once.
    const uint64_t span = uint64_t{t.slices} + std::max<uint32_t>(1, h.replicas) - 1;
    const auto holders = static_cast<uint32_t>(std::min<uint64_t>(span, num_servers));
    for (uint32_t k = 0; k < holders; ++k) {
      const uint32_t rank = (t.first_rank + k) % num_servers;
      if (h.left_out && rank < h.left_out->size() && (*h.left_out)[rank]) continue;
      XorInto(expected, Receipt(key, {kFirstServerId + rank, worker, clock, t.tensor, t.slices,
                                      t.first_rank}));
    }
  }
  return expected;
}

Status VerifyCommit(const JobKey& key, const Holders& holders, WorkerId worker, Clock clock,
                    bool empty, const CommitProof& proof) {
  const uint32_t num_servers = holders.num_servers;
  if (empty) {
    if (!proof.tensors.empty() || proof.receipts != kZeroTag) {
      return Error(StatusCode::kInvalidArgument,
                   "worker {}: an empty commit of clock {} names tensors", worker, clock);
    }
    return Status::Ok();
  }
  if (proof.tensors.empty()) {
    return Error(StatusCode::kInvalidArgument,
                 "worker {}: the commit of clock {} names no tensor (a clock with nothing "
                 "pushed is committed as empty)",
                 worker, clock);
  }
  for (const CommittedTensor& t : proof.tensors) {
    if (t.first_rank >= num_servers) {
      return Error(StatusCode::kInvalidArgument,
                   "worker {}: the commit of clock {} places tensor {} on server rank {}, but "
                   "the job has {} server(s)",
                   worker, clock, t.tensor, t.first_rank, num_servers);
    }
  }
  if (!TagsEqual(ExpectedReceipts(key, holders, worker, clock, proof.tensors),
                 proof.receipts)) {
    return Error(StatusCode::kPermissionDenied,
                 "worker {}: the commit of clock {} is not proved by the servers' receipts for "
                 "its {} tensor(s) (tensors {}..{}): a gradient enters a round only once every "
                 "server holding a slice of it has staged it",
                 worker, clock, proof.tensors.size(), proof.tensors.front().tensor,
                 proof.tensors.back().tensor);
  }
  return Status::Ok();
}

}  // namespace dsync::ps
