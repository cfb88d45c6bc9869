// The job's secrets and what is derived from them (docs/contract.md, "Trust").
//
// The cluster token only lets a node ask the scheduler to be admitted. Admission hands out
// credentials derived from a random job key that only the scheduler and the servers hold:
// - a worker's (or observer's) credential, which it presents to every server, so a server
//   can check an admission without asking the scheduler and without a race against it;
// - a server's proof towards one worker, which the worker checks in the server's
//   acknowledgement (the scheduler tells the worker what to expect);
// - push receipts: a server tags "every slice of tensor t that I hold is staged for worker w
//   at clock c" and the worker relays the tags, XOR-ed together, in its commit. The scheduler
//   recomputes them, so a gradient enters a round only when the servers proved they hold it
//   (an XOR of pseudorandom tags over distinct inputs is a sound aggregate MAC).
//
// The PRF is SipHash-2-4 with 128-bit output (libsodium's crypto_shorthash_siphashx24), a
// keyed PRF made for short inputs: every tag here covers at most seven 64-bit words, and two
// of them are computed per gradient (a server's receipt, the scheduler's check), where keyed
// BLAKE2b cost 40 % of the protocol's added instructions. Constant-time comparisons and the
// CSPRNG come with the same library.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "dsync/types.h"

namespace dsync::ps {

using JobKey = std::array<uint8_t, 16>;
using Tag = std::array<uint8_t, 16>;

constexpr Tag kZeroTag{};

// A fresh random key (libsodium's CSPRNG).
JobKey RandomJobKey();
// A random token for a job started on one machine: 32 hex digits.
std::string RandomToken();

// Hex text of a key or tag, and back (nullopt for text of the wrong length or alphabet).
std::string ToHex(std::span<const uint8_t> bytes);
std::optional<JobKey> JobKeyFromHex(std::string_view hex);
std::optional<Tag> TagFromHex(std::string_view hex);

// Constant-time equality.
bool TagsEqual(const Tag& a, const Tag& b);
inline void XorInto(Tag& acc, const Tag& t) {
  for (size_t i = 0; i < acc.size(); ++i) acc[i] ^= t[i];
}

// A client's credential: workers (observer = false) and observers have separate id ranges,
// but the kind is part of what is authenticated all the same.
Tag ClientCredential(const JobKey& key, NodeId id, bool observer);
// What server `server` presents to client `client` to prove it is that server of this job.
Tag ServerProof(const JobKey& key, NodeId server, NodeId client);
// What a scheduler restarted from its journal answers node `node`'s rejoin with, `nonce`
// being the node's, keyed by what both hold: the job key (a server) or the node's credential
// (a worker). A node never takes an impostor that took the scheduler's address for its
// scheduler.
Tag SchedulerProof(const JobKey& secret, NodeId node, const Tag& nonce);
// A fresh random nonce (libsodium's CSPRNG).
Tag RandomNonce();

// The receipt of server `server` for worker `w`'s gradient of `clock` on tensor `tensor`,
// cut into `slices` slices placed from server rank `first_rank` on: every slice of it that
// this server holds is staged.
struct ReceiptFields {
  NodeId server = 0;
  WorkerId worker = 0;
  Clock clock = 0;
  TensorId tensor = 0;
  uint32_t slices = 0;
  uint32_t first_rank = 0;
};
Tag Receipt(const JobKey& key, const ReceiptFields& f);

}  // namespace dsync::ps
