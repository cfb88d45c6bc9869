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

// The servers whose receipts a commit must carry: `num_servers` servers with ids
// kFirstServerId + rank, every slice on `replicas` of them (ps/slicing.h), less the ranks
// marked in `left_out` (servers lost before the commit; none when null).
struct Holders {
  Holders(uint32_t servers, uint32_t copies = 1, const std::vector<bool>* lost = nullptr)
      : num_servers(servers), replicas(copies), left_out(lost) {}
  uint32_t num_servers;
  uint32_t replicas;
  const std::vector<bool>* left_out;
};

// `empty`: the worker pushed nothing.
Status VerifyCommit(const JobKey& key, const Holders& holders, WorkerId worker, Clock clock,
                    bool empty, const CommitProof& proof);

// What an honest worker sends: the receipts of every server holding a copy of a slice of
// each tensor (for tests and benchmarks that play a worker).
Tag ExpectedReceipts(const JobKey& key, const Holders& holders, WorkerId worker, Clock clock,
                     const std::vector<CommittedTensor>& tensors);

}  // namespace dsync::ps
