// Checkpoints on disk: what each server writes of its slices, the manifest the scheduler
// writes once every server has written its part, and finding the newest complete one.
//
//   DIR/ckpt-<version, 12 digits>/server-<rank>.ckpt   one per server, written by it
//   DIR/ckpt-<version, 12 digits>/MANIFEST.json        written last, by the scheduler
//
// A checkpoint is complete only with its manifest, and sound only if every file the
// manifest names has the size and CRC-32 it records. Every file is written to a temporary
// name, fsync'd, renamed into place and its directory fsync'd, so a crash leaves either the
// old state or the new one, never a torn file under the final name.
//
// A server file: "DSCKPT03", then (little-endian) u32 rank, u32 servers, u64 version,
// u64 slice bytes, u32 slices; per slice u32 tensor, u32 slice, u32 copy number (0: the
// primary; absent in "DSCKPT01" files), u64 elements, u64 steps, u32 state arrays, u32 kept
// versions K, K u64 rounds and u32 mean squares M, 0 or 1 (delay compensation; absent before
// "DSCKPT03"), u32 metadata bytes, the metadata (the tensor's kInit metadata: name, size,
// offset, optimizer, shape; ps/protocol.h), then the parameters, each state array, each kept
// version and the mean square as float32; last, the CRC-32 (zlib's) of everything before it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "dsync/status.h"
#include "dsync/types.h"
#include "ps/param_store.h"
#include "ps/protocol.h"

namespace dsync::ps {

struct CheckpointSlice {
  TensorId tensor = 0;
  uint32_t slice = 0;
  uint32_t replica = 0;  // which copy of the slice (Config::replicas)
  InitMeta meta;  // the tensor: name, elements, this slice's offset, optimizer, shape
  SliceSnapshot snapshot;
};

struct ServerCheckpoint {
  uint32_t rank = 0;
  uint32_t num_servers = 0;
  Version version = 0;
  uint64_t slice_bytes = 0;
  std::vector<CheckpointSlice> slices;
};

// Where a server's file went, for the manifest.
struct CheckpointFile {
  uint32_t rank = 0;
  std::string name;  // relative to the checkpoint's directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct CheckpointManifest {
  Version version = 0;
  uint32_t num_servers = 0;
  uint32_t replicas = 1;  // copies of every slice: the servers' files hold them all
  uint64_t slice_bytes = 0;
  std::string sync;                  // the job's sync mode, for the record
  uint64_t gradients_committed = 0;  // in the rounds before this version (budgets continue)
  // The clock every live worker's gradients reached in those rounds (their lowest next
  // clock): a resumed job's first workers start there. In bsp it is the version.
  Clock clock = 0;
  std::optional<std::pair<Round, float>> learning_rate;  // the newest change, if any
  std::optional<Round> damp_from;  // the staleness policy damp: damped from this round
  std::vector<CheckpointFile> files;  // one per server rank, but for the lost ones
  // Ranks lost before the checkpoint: they wrote no file. With copies (Config::replicas > 1)
  // the other ranks' files hold copies of every slice they held...
  std::vector<uint32_t> lost_ranks;
  // ...else the checkpoint is partial: what the servers left held when the job ended for
  // want of a lost one's slices. Export reads it (the tensors whole in it); --resume does not.
  bool partial = false;
};

// Whether the manifest's lost ranks (each below num_servers) leave some slice with no copy
// in its files: what makes a checkpoint partial.
bool MissesSomeSlice(const CheckpointManifest& manifest);

// The directory of the checkpoint at `version` under `dir`.
std::string CheckpointPath(const std::string& dir, Version version);
// The name of the file of the server of `rank`.
std::string ServerFileName(uint32_t rank);

// Writes the server's file into `checkpoint_dir` (created if missing) atomically.
Result<CheckpointFile> WriteServerCheckpoint(const std::string& checkpoint_dir,
                                             const ServerCheckpoint& checkpoint);
// Reads a server file, checking its format, every length against the file's size before
// anything is allocated, and its CRC-32 (and `expected_crc`, the manifest's, when given).
Result<ServerCheckpoint> ReadServerCheckpoint(const std::string& path,
                                              std::optional<uint32_t> expected_crc);

// The bytes of a server file for `checkpoint`, and their reading back (checked as a file is;
// `what` names them in errors): how a server sends the copies a new server of a lost rank
// needs over the network.
std::vector<std::byte> SerializeServerCheckpoint(const ServerCheckpoint& checkpoint);
Result<ServerCheckpoint> ParseServerCheckpoint(std::span<const std::byte> data,
                                               std::string_view what,
                                               std::optional<uint32_t> expected_crc);

// Writes `checkpoint_dir`/MANIFEST.json atomically: from then on the checkpoint is complete.
Status WriteManifest(const std::string& checkpoint_dir, const CheckpointManifest& manifest);

struct FoundCheckpoint {
  std::string path;  // its directory
  CheckpointManifest manifest;
};
struct SkippedCheckpoint {
  std::string path;  // its directory
  std::string why;   // names the file and what is wrong with it
  bool damaged = true;  // else sound but partial (CheckpointManifest::partial)
};
// One checkpoint's manifest, once the checkpoint is found complete and sound (as below).
// kDataLoss for damage, naming the file.
Result<CheckpointManifest> ReadCheckpoint(const std::string& checkpoint_dir);

// The newest checkpoint under `dir` that is complete and sound: its manifest is there and
// every file it names is a regular file with the recorded size, header (rank, servers,
// version, slice size) and CRC-32 (streamed: nothing is parsed or held in memory). A newer one
// that is damaged (no manifest; a missing, short, foreign or corrupt file: kDataLoss), or
// sound but partial, is appended to `skipped`; any other error (the disk cannot be read) is returned, since
// passing over a sound checkpoint would roll the job back. NotFound when there is none.
Result<FoundCheckpoint> FindNewestCheckpoint(const std::string& dir,
                                             std::vector<SkippedCheckpoint>* skipped);
// Paths travel in JSON (a server's welcome names its file): refused unless valid UTF-8.
Status CheckUtf8(const std::string& path);

// Moves a refused checkpoint aside (DIR/refused-ckpt-...), so that neither a later --resume
// nor pruning takes it for one of this job's.
Status SetAside(const std::string& checkpoint_dir);

// Moves a partial checkpoint (CheckpointManifest::partial) to DIR/partial-ckpt-... and
// returns that path: export reads it there; resuming, pruning and later checkpoints leave it.
Result<std::string> KeepPartial(const std::string& checkpoint_dir);

// Deletes complete checkpoints under `dir` older than the newest `keep` complete ones, and
// incomplete ones older than the newest complete one. Best effort: failures are logged.
void PruneCheckpoints(const std::string& dir, size_t keep);

}  // namespace dsync::ps
