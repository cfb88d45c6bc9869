// The first frames on every connection: kHello carries who the peer is and the cluster
// token (DESIGN.md §6: a peer without it is refused before it can join or push); kHelloAck
// carries what the joining node needs to know about the job. Both are JSON: rare, small,
// and easy to extend without breaking the frame format.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/protocol.h"
#include "ps/transport.h"

namespace dsync::ps {

struct Hello {
  Role role = Role::kWorker;
  std::string token;
  NodeId node = 0;        // worker -> server: the worker id the scheduler assigned
  std::string host;       // server -> scheduler: where workers reach it
  uint16_t port = 0;
  bool observer = false;  // worker -> scheduler: a read-only client (Config::observer)
};
std::string EncodeHello(const Hello& hello);
Result<Hello> DecodeHello(std::span<const std::byte> meta);
// Decodes a hello and checks its token: PermissionDenied, with what to set, when wrong.
Result<Hello> AcceptHello(std::span<const std::byte> meta, const std::string& token);

struct ServerAddress {
  NodeId id = 0;
  std::string host;
  uint16_t port = 0;
};

// What the scheduler tells a node that joined.
struct Welcome {
  NodeId id = 0;
  SyncMode sync;
  OptimizerConfig optimizer;
  uint64_t slice_bytes = 0;
  uint32_t heartbeat_interval_ms = 0;
  std::vector<ServerAddress> servers;  // workers: every server, by rank
  Round join_round = 0;                // workers
  Clock start_clock = 0;
  Version gate = 0;
  bool observer = false;               // admitted read-only
};
std::string EncodeWelcome(const Welcome& welcome);
Result<Welcome> DecodeWelcome(std::span<const std::byte> meta);

// Compares tokens in time independent of where they differ.
bool TokenMatches(const std::string& expected, const std::string& presented);

// Sends a kError frame answering `about` (request, tensor and slice echoed). With
// `close_after`, the connection is dropped once the frame has left: closing at once would
// discard it from the send queue and leave the peer guessing why it was cut off.
Status SendError(Transport& transport, PeerId peer, NodeId self, const Status& error,
                 const FrameHeader& about, bool close_after = false);
// Sends a frame without payload or metadata.
Status SendControl(Transport& transport, PeerId peer, const FrameHeader& header);

// Decodes a kError frame into the Status it carries.
Status ErrorFromFrame(const FrameHeader& header, std::span<const std::byte> meta);

}  // namespace dsync::ps
