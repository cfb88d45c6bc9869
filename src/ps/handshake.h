// The first frames on every connection (docs/contract.md, "Trust"). To the scheduler, kHello
// carries the cluster token, which only lets a node ask to be admitted; kHelloAck carries
// what the admitted node needs to know about the job, its credential among it. To a server,
// a worker's kHello carries its credential, and the server's kHelloAck proves the server.
// Hellos and welcomes are JSON: rare, small, and easy to extend.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/keys.h"
#include "ps/protocol.h"
#include "ps/transport.h"

namespace dsync::ps {

struct Hello {
  Role role = Role::kWorker;
  std::string token;
  NodeId node = 0;        // worker -> server: the worker id the scheduler assigned
  std::string host;       // server -> scheduler: where workers reach it
  uint16_t port = 0;
  bool observer = false;  // a read-only client (Config::observer)
  std::optional<Tag> credential;  // worker/observer -> server: from its welcome
  // To a scheduler restarted from its journal: node `node` comes back. A worker presents its
  // credential, a server ServerProof(job key, its id, kSchedulerId); a server says how many
  // rounds it has received, so that the scheduler sends it the rest.
  bool rejoin = false;
  Round rounds_received = 0;
  Round rounds_applied = 0;
  Tag nonce{};  // rejoin: the scheduler's answer proves it holds the job key over this
};
std::string EncodeHello(const Hello& hello);
Result<Hello> DecodeHello(std::span<const std::byte> meta);
// Decodes a hello and checks its token: PermissionDenied, with what to set, when wrong.
Result<Hello> AcceptHello(std::span<const std::byte> meta, const std::string& token);

struct ServerAddress {
  NodeId id = 0;
  std::string host;
  uint16_t port = 0;
  Tag proof{};  // what this server must answer the client's hello with
};

// kServerBack's metadata to a worker: where the new server of the rank listens, and its proof.
std::string EncodeServerAddress(const ServerAddress& address);
Result<ServerAddress> DecodeServerAddress(std::span<const std::byte> meta);

// kCopyOut's metadata to a server: by rank, the servers live now (those that may send copies).
std::string EncodeLiveRanks(const std::vector<bool>& live);
Status DecodeLiveRanks(std::span<const std::byte> meta, uint32_t num_servers,
                       std::vector<bool>& live);

// What the scheduler tells a node that joined.
struct Welcome {
  NodeId id = 0;
  SyncMode sync;
  OptimizerConfig optimizer;
  StalenessPolicy staleness;           // servers weigh stale gradients by it
  uint64_t slice_bytes = 0;
  uint32_t heartbeat_interval_ms = 0;
  std::vector<ServerAddress> servers;  // workers: every server, by rank
  Round join_round = 0;                // workers
  Clock start_clock = 0;
  Version gate = 0;
  bool observer = false;               // admitted read-only
  Tag credential{};                    // workers and observers: present it to the servers
  std::optional<JobKey> job_key;       // servers: to check credentials, prove, sign receipts
  uint32_t num_servers = 0;            // servers: for the slice placement of receipts
  uint32_t replicas = 1;               // copies of every slice (Config::replicas)
  std::vector<NodeId> servers_lost;    // workers: the servers lost so far, in that order
  // workers: the ranks a new server took over since (kServerBack), in that order; a server is
  // lost now when it was lost more often than taken over.
  std::vector<NodeId> servers_back;
  // workers: servers taking a lost rank over that do not hold their copies yet (pulls go to
  // the other copies until kServerServes).
  std::vector<NodeId> servers_filling;
  // A server that takes a lost rank's place (its id is that rank's): the first round it is
  // sent. Its slices come as copies from the other servers (kCopyOut), not from workers.
  std::optional<Round> takeover_from;
  // servers: the newest change of the learning rate (its first round, the rate), so that a
  // server joining after it runs with it too.
  std::optional<std::pair<Round, float>> learning_rate;
  // servers, where the staleness policy damps: the round from which the job is damped, once
  // it is (kDamp), so that a server joining after it applies the damped policy too.
  std::optional<Round> damp_from;
  // servers of a resumed job: the checkpoint file to load before taking clients, its CRC-32
  // (the manifest's) and the version it holds.
  struct Restore {
    std::string file;
    uint32_t crc32 = 0;
    Version version = 0;
    // A rank lost before the checkpoint has no file (file empty): it takes its slices from
    // the copies in the other ranks' files.
    struct Source {
      std::string file;
      uint32_t crc32 = 0;
    };
    std::vector<Source> copies;
  };
  std::optional<Restore> restore;
  bool checkpoints = false;  // servers: the job writes checkpoints (a stop waits for one)
  // The scheduler journals its decisions: a node that loses it waits this long for it to be
  // restarted from its journal and rejoins (0: the job cannot outlive its scheduler).
  uint32_t reconnect_grace_ms = 0;
  // The answer to a rejoin: SchedulerProof(job key, the node, the hello's nonce).
  std::optional<Tag> scheduler_proof;
};
std::string EncodeWelcome(const Welcome& welcome);
Result<Welcome> DecodeWelcome(std::span<const std::byte> meta);

// Compares tokens in time independent of where they differ.
bool TokenMatches(const std::string& expected, const std::string& presented);

// The rank (0..S-1) of a server id.
inline uint32_t ServerRank(NodeId server) { return server - kFirstServerId; }

// Sends a kError frame answering `about` (request, tensor and slice echoed). With
// `close_after`, the connection is dropped once the frame has left: closing at once would
// discard it from the send queue and leave the peer guessing why it was cut off. Without
// `close_after`, `then` (if any) runs once the frame has left or failed.
Status SendError(Transport& transport, PeerId peer, NodeId self, const Status& error,
                 const FrameHeader& about, bool close_after = false, SendDone then = {});
// Sends a frame without payload or metadata.
Status SendControl(Transport& transport, PeerId peer, const FrameHeader& header);

// Decodes a kError frame into the Status it carries.
Status ErrorFromFrame(const FrameHeader& header, std::span<const std::byte> meta);

}  // namespace dsync::ps
