#include "ps/checkpoint_coordinator.h"

#include <fmt/ranges.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>

namespace dsync::ps {
namespace {

// Absolute: the servers may run in another directory (they get the path from here). Left
// as given where the working directory cannot be read.
std::string Absolute(const std::string& dir) {
  if (dir.empty()) return dir;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(dir, ec);
  return ec ? dir : p.string();
}

}  // namespace

CheckpointCoordinator::CheckpointCoordinator(const Config& config, Version start)
    : dir_(Absolute(config.checkpoint_dir)), every_(config.checkpoint_every),
      every_seconds_(config.checkpoint_every_seconds), start_(start), last_begun_(start),
      last_begun_at_(Clock::now()) {}

bool CheckpointCoordinator::Due(Version version, Clock::time_point now) const {
  if (!enabled() || every_ == 0 || pending_ || version <= last_begun_) return false;
  if (every_seconds_) return now - last_begun_at_ >= std::chrono::seconds(every_);
  return version % every_ == 0;
}

bool CheckpointCoordinator::FinalNeeded(Version version) const {
  return enabled() && !pending_ && version > last_begun_;
}

std::string CheckpointCoordinator::Begin(CheckpointManifest manifest, Clock::time_point now) {
  last_begun_ = manifest.version;
  last_begun_at_ = now;
  const std::string path = CheckpointPath(dir_, manifest.version);
  Pending p;
  p.files.resize(manifest.num_servers);
  p.manifest = std::move(manifest);
  p.began = now;
  pending_ = std::move(p);
  spdlog::info("scheduler: checkpoint of version {} to {}", last_begun_, path);
  return path;
}

bool CheckpointCoordinator::Reported(uint32_t rank, Version version,
                                     const Result<CheckpointFile>& file) {
  if (!pending_ || version != pending_->manifest.version || rank >= pending_->files.size()) {
    return false;
  }
  const std::vector<uint32_t>& lost = pending_->manifest.lost_ranks;
  if (std::find(lost.begin(), lost.end(), rank) != lost.end()) return false;
  if (!file.ok()) {
    last_result_ = file.status().WithContext(
        fmt::format("the checkpoint of version {} failed on server rank {}", version, rank));
    spdlog::error("scheduler: {}; the newest complete checkpoint stands", last_result_.message());
    pending_.reset();
    return true;
  }
  pending_->files[rank] = *file;
  return Settle();
}

bool CheckpointCoordinator::Lost(uint32_t rank) {
  if (!pending_ || rank >= pending_->files.size()) return false;
  if (pending_->files[rank]) return false;  // it wrote its part before it went: kept
  std::vector<uint32_t>& lost = pending_->manifest.lost_ranks;
  if (std::find(lost.begin(), lost.end(), rank) == lost.end()) lost.push_back(rank);
  return Settle();
}

bool CheckpointCoordinator::Settle() {
  CheckpointManifest& m = pending_->manifest;
  const Version version = m.version;
  const std::string path = CheckpointPath(dir_, version);
  // Every rank has written its part or is lost.
  size_t written = 0;
  for (const auto& f : pending_->files) written += f ? 1 : 0;
  if (written + m.lost_ranks.size() < pending_->files.size()) return false;
  std::sort(m.lost_ranks.begin(), m.lost_ranks.end());
  m.partial = MissesSomeSlice(m);
  uint64_t bytes = 0;
  for (const auto& f : pending_->files) {
    if (!f) continue;
    m.files.push_back(*f);
    bytes += f->bytes;
  }
  last_result_ = WriteManifest(path, m);
  if (!last_result_.ok()) {
    last_result_ = last_result_.WithContext(
        fmt::format("the checkpoint of version {} is incomplete", version));
    spdlog::error("scheduler: {}", last_result_.message());
  } else {
    const double s = std::chrono::duration<double>(Clock::now() - pending_->began).count();
    if (m.partial) {
      Result<std::string> kept = KeepPartial(path);
      if (!kept.ok()) {
        last_result_ = kept.status();
        spdlog::error("scheduler: {}", last_result_.message());
      } else {
        last_written_ = Written{version, *kept, true};
        spdlog::warn("scheduler: partial checkpoint of version {} written: {} bytes from {} "
                     "server(s) in {:.2f} s ({}); the slices of lost server rank(s) {} are not "
                     "in it: `dsyncps checkpoint export` reads it, --resume does not",
                     version, bytes, m.files.size(), s, *kept, fmt::join(m.lost_ranks, ", "));
      }
      pending_.reset();
      return true;
    }
    last_written_ = Written{version, path, false};
    spdlog::info("scheduler: checkpoint of version {} complete: {} bytes from {} server(s) in "
                 "{:.2f} s ({}){}",
                 version, bytes, m.files.size(), s, path,
                 m.lost_ranks.empty()
                     ? std::string()
                     : fmt::format("; the lost ranks' slices are in their copies"));
    complete_any_ = true;
    PruneCheckpoints(dir_, kCheckpointsKept);
  }
  pending_.reset();
  return true;
}


}  // namespace dsync::ps
