// The scheduler's check of a commit (docs/contract.md, "Trust"): the worker claims which
// tensors it pushed and where their slices live; the servers' receipts, XOR-ed together by
// the worker, must equal what the scheduler recomputes from those claims with the job key.
// A receipt only exists once a server staged every slice of the tensor it holds, so a
// gradient is placed in a round only when every server holding a slice of it proved it
// staged it — a false claim (a tensor left out on some server, a wrong slice count or
// placement) yields other receipts and fails.
#pragma once

#include <cstdint>

#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/keys.h"
#include "ps/protocol.h"

namespace dsync::ps {

// `num_servers` servers with ids kFirstServerId + rank. `empty`: the worker pushed nothing.
Status VerifyCommit(const JobKey& key, uint32_t num_servers, WorkerId worker, Clock clock,
                    bool empty, const CommitProof& proof);

// What an honest worker sends: the receipts of every server holding a slice of each tensor
// (for tests and benchmarks that play a worker).
Tag ExpectedReceipts(const JobKey& key, uint32_t num_servers, WorkerId worker, Clock clock,
                     const std::vector<CommittedTensor>& tensors);

}  // namespace dsync::ps
