// The server node: checkpoints written and restored, copies sent to and taken by a server
// taking a lost rank's place, the final dump. The class: ps/server_internal.h.
#include "ps/server_internal.h"

namespace dsync::ps {

Result<CheckpointFile> ServerNode::WriteCheckpoint(Version version, const std::string& dir) {
  if (version != stats_.rounds_applied) {
    return Error(StatusCode::kProtocol, "asked to write version {} after applying {} round(s)",
                 version, stats_.rounds_applied.load());
  }
  ServerCheckpoint c;
  c.rank = ServerRank(id_);
  c.num_servers = job_.num_servers;
  c.version = version;
  c.slice_bytes = job_.slice_bytes;
  {
    std::shared_lock lock(slices_mu_);
    c.slices.reserve(slice_list_.size());
    for (SliceState* s : slice_list_) {
      CheckpointSlice cs;
      DSYNC_RETURN_IF_ERROR(SnapshotSlice(*s, cs));
      c.slices.push_back(std::move(cs));
    }
  }
  return WriteServerCheckpoint(dir, c);
}

Status ServerNode::SnapshotSlice(SliceState& s, CheckpointSlice& cs) {
  const TensorMeta& t = tensors_.at(s.tensor);
  cs.tensor = s.tensor;
  cs.slice = s.index;
  cs.replica = s.replica;
  cs.meta = InitMeta{t.name, t.elements, uint64_t{s.index} * SliceElements(), t.optimizer,
                     t.shape};
  std::lock_guard slock(s.mu);
  return store_->Snapshot(s.key, cs.snapshot);
}

void ServerNode::SendCopies(Version version, uint32_t takeover, NodeId for_id,
                            const std::vector<bool>& live) {
  const uint32_t n = job_.num_servers;
  const uint32_t me = ServerRank(id_);
  const uint32_t target = ServerRank(for_id);
  const auto header = [&](bool last) {
    FrameHeader h = MakeHeader(MsgType::kCopy, id_);
    h.set_round(version);
    h.set_backs(takeover);
    if (last) h.flags |= kFlagLast;
    return h;
  };
  const auto send = [&](ServerCheckpoint& chunk, bool last) -> Status {
    auto bytes = std::make_unique<std::vector<std::byte>>(SerializeServerCheckpoint(chunk));
    chunk.slices.clear();
    if (bytes->size() > kMaxPayloadBytes) {
      return Error(StatusCode::kOutOfRange, "a slice's copy of {} bytes is more than a frame "
                                            "carries ({} bytes); lower --slice-bytes",
                   bytes->size(), kMaxPayloadBytes);
    }
    std::vector<std::byte>* raw = bytes.get();
    DSYNC_RETURN_IF_ERROR(transport_->Send(scheduler_, header(last), {}, raw->data(),
                                           raw->size(), [raw](const Status&) { delete raw; }));
    (void)bytes.release();
    return Status::Ok();
  };
  Status st = version == stats_.rounds_applied
                  ? Status::Ok()
                  : Error(StatusCode::kProtocol, "asked for copies of version {} after applying "
                                                 "{} round(s)",
                          version, stats_.rounds_applied.load());
  ServerCheckpoint chunk{me, n, version, job_.slice_bytes, {}};
  uint64_t chunk_bytes = 0, sent = 0;
  if (st.ok()) {
    std::shared_lock lock(slices_mu_);
    for (SliceState* s : slice_list_) {
      const uint32_t primary = PrimaryRank(me, s->replica, n);
      if (CopyNumber(target, primary, n) >= job_.replicas) continue;
      uint32_t donor = n;
      for (uint32_t j = 0; j < job_.replicas && donor == n; ++j) {
        const uint32_t rank = ReplicaRank(primary, j, n);
        if (rank != target && rank < live.size() && live[rank]) donor = rank;
      }
      if (donor != me) continue;
      CheckpointSlice cs;
      st = SnapshotSlice(*s, cs);
      if (!st.ok()) break;
      chunk_bytes += (cs.snapshot.params.size() *
                          (1 + cs.snapshot.state.size() + cs.snapshot.kept.size()) +
                      cs.snapshot.mean_square.size()) *
                     sizeof(float);
      chunk.slices.push_back(std::move(cs));
      ++sent;
      if (chunk_bytes >= kCopyChunkBytes) {
        st = send(chunk, false);
        chunk_bytes = 0;
        if (!st.ok()) break;
      }
    }
  }
  if (st.ok()) st = send(chunk, true);
  if (!st.ok()) {
    spdlog::error("server {}: cannot send the copies server {} needs: {}", id_.load(), for_id,
                  st.message());
    FrameHeader h = header(/*last=*/true);
    h.status = static_cast<uint16_t>(st.code());
    (void)transport_->Send(scheduler_, h, AsBytes(st.message()), nullptr, 0);
    return;
  }
  spdlog::info("server {}: sent server {} the copies of {} slice(s) at version {}", id_.load(),
               for_id, sent, version);
}

void ServerNode::TakeCopies(const FrameHeader& h, std::byte* payload) {
  std::unique_ptr<std::byte[]> hold(payload);
  std::optional<Version> at;
  uint32_t number = 0;
  {
    std::lock_guard lock(mu_);
    at = copy_at_;
    number = takeover_number_;
  }
  Status st = awaiting_copies_.load() && at && *at == h.round() && h.backs() == number
                  ? Status::Ok()
                  : Error(StatusCode::kProtocol, "copies of version {} came unasked", h.round());
  if (st.ok() && !payload && h.payload_len > 0) {
    st = Error(StatusCode::kResourceExhausted,
               "no memory for the {} bytes of copies from server {}", h.payload_len, h.sender);
  }
  if (st.ok() && payload) {
    const std::string what = fmt::format("the copies from server {}", h.sender);
    Result<ServerCheckpoint> c =
        ParseServerCheckpoint({payload, h.payload_len}, what, std::nullopt);
    st = c.status();
    if (st.ok() && (c->num_servers != job_.num_servers || c->version != *at ||
                    c->slice_bytes != job_.slice_bytes || c->rank >= job_.num_servers)) {
      st = Error(StatusCode::kDataLoss, "{} are of rank {} of {} at version {} with slices of "
                                        "{} bytes, not of this job at version {}",
                 what, c->rank, c->num_servers, c->version, c->slice_bytes, *at);
    }
    for (size_t i = 0; st.ok() && i < c->slices.size(); ++i) {
      st = InstallCopy(what, c->rank, *at, c->slices[i]);
    }
  }
  hold.reset();
  std::lock_guard lock(mu_);
  if (!st.ok()) {
    FailTakeover(st);
    return;
  }
  if (h.flags & kFlagLast) ++copies_done_;
  if (copies_done_ == copies_expected_ && awaiting_copies_.load()) FinishCopies();
}

Status ServerNode::InstallCopy(const std::string& what, uint32_t from_rank, Version at,
                               CheckpointSlice& cs) {
  const uint32_t n = job_.num_servers;
  const uint32_t mine = CopyNumber(ServerRank(id_), PrimaryRank(from_rank, cs.replica, n), n);
  if (cs.replica >= job_.replicas || mine >= job_.replicas) {
    return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} is no copy this rank holds",
                 what, cs.meta.name, cs.slice);
  }
  cs.replica = mine;
  const SliceKey key = MakeSliceKey(cs.tensor, cs.slice);
  {
    std::shared_lock lock(slices_mu_);
    if (auto it = slices_.find(key); it != slices_.end()) {
      SliceState& s = *it->second;
      std::lock_guard slock(s.mu);
      if (s.copied || !s.awaiting_copy || s.elements != cs.snapshot.params.size()) {
        return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} came twice or does not "
                                            "fit the slice here",
                     what, cs.meta.name, cs.slice);
      }
      DSYNC_RETURN_IF_ERROR(store_->Restore(key, cs.snapshot).WithContext(what));
      s.copied = true;
      std::vector<float>().swap(s.init_values);
      return Status::Ok();
    }
  }
  DSYNC_RETURN_IF_ERROR(RestoreSlice(what, at, cs));
  SliceState* s = FindSlice(cs.tensor, cs.slice);
  std::lock_guard slock(s->mu);
  s->awaiting_copy = true;  // FinishCopies lets its pulls through with every other's
  s->copied = true;
  return Status::Ok();
}

void ServerNode::FinishCopies() {
  Status st;
  {
    std::unique_lock lock(slices_mu_);
    for (SliceState* s : slice_list_) {
      if (!s->awaiting_copy || s->copied) continue;
      if (s->layout_only) {
        st = Error(StatusCode::kDataLoss, "no server sent the copy of tensor {} slice {} "
                                          "that this rank holds",
                   s->tensor, s->index);
        break;
      }
      st = store_->InitSlice(s->key, s->init_values);
      if (!st.ok()) break;
    }
    if (st.ok()) {
      for (SliceState* s : slice_list_) {
        std::lock_guard slock(s->mu);
        if (!s->awaiting_copy) continue;
        s->awaiting_copy = false;
        s->version = *copy_at_;
        std::vector<float>().swap(s->init_values);
        std::erase_if(s->waiting, [&](const WaitingPull& p) {
          if (p.min_version > s->version) return false;
          ReplyPull(*s, p.peer, p.request);
          return true;
        });
      }
      awaiting_copies_ = false;
      ledger_.set_window(ledger_.window() / kTakeoverStagingFactor);
    }
  }
  if (!st.ok()) {
    FailTakeover(st);
    return;
  }
  FrameHeader done = MakeHeader(MsgType::kCopied, id_);
  done.set_round(*copy_at_);
  (void)SendControl(*transport_, scheduler_, done);
  spdlog::info("server {}: holds the copies of rank {} at version {}; it applies the rounds "
               "from there",
               id_.load(), ServerRank(id_), *copy_at_);
  cv_.notify_all();
}

void ServerNode::FailTakeover(const Status& why) {
  if (!result_.ok()) return;
  // The scheduler names the sender itself: the error sent does not.
  const Status sent = why.WithContext(fmt::format("taking over rank {}", ServerRank(id_)));
  result_ = sent.WithContext(fmt::format("server {}", id_.load()));
  spdlog::error("{}", result_.message());
  FrameHeader about = MakeHeader(MsgType::kCopy, id_);
  error_sent_ = SendError(*transport_, scheduler_, id_, sent, about).ok();
  cv_.notify_all();
}

void ServerNode::ReportCheckpoint(Version version, const Result<CheckpointFile>& file) {
  FrameHeader h = MakeHeader(MsgType::kCheckpointDone, id_);
  h.set_round(version);
  if (!file.ok()) {
    spdlog::error("server {}: checkpoint of version {} failed: {}", id_.load(), version,
                  file.status().message());
    h.status = static_cast<uint16_t>(file.status().code());
    (void)transport_->Send(scheduler_, h, AsBytes(file.status().message()), nullptr, 0);
    return;
  }
  std::vector<std::byte> meta;
  EncodeCheckpointDone({file->name, file->bytes, file->crc32}, meta);
  (void)transport_->Send(scheduler_, h, meta, nullptr, 0);
}

Status ServerNode::RestoreCheckpoint(const Welcome::Restore& from) {
  const uint32_t rank = ServerRank(id_);
  const bool own = from.copies.empty();
  std::vector<std::pair<std::string, uint32_t>> sources;
  if (own) {
    sources.emplace_back(from.file, from.crc32);
  } else {
    for (const Welcome::Restore::Source& src : from.copies) sources.emplace_back(src.file, src.crc32);
  }
  uint64_t restored = 0;
  for (const auto& [file, crc] : sources) {
    DSYNC_ASSIGN_OR_RETURN(ServerCheckpoint c, ReadServerCheckpoint(file, crc));
    if ((own && c.rank != rank) || c.rank >= job_.num_servers ||
        c.num_servers != job_.num_servers || c.version != from.version ||
        c.slice_bytes != job_.slice_bytes) {
      return Error(StatusCode::kDataLoss,
                   "checkpoint file '{}' holds rank {} of {} at version {} with slices of {} "
                   "bytes, not {} of {} at version {} with slices of {} bytes",
                   file, c.rank, c.num_servers, c.version, c.slice_bytes,
                   own ? fmt::format("rank {}", rank) : std::string("a rank"), job_.num_servers,
                   from.version, job_.slice_bytes);
    }
    for (CheckpointSlice& cs : c.slices) {
      if (!own) {
        // Copy j of a slice on rank r: its primary is r - j, and this rank holds copy
        // (rank - primary) mod S if that is below the job's copies.
        const uint32_t n = job_.num_servers;
        const uint32_t mine = CopyNumber(rank, PrimaryRank(c.rank, cs.replica, n), n);
        if (cs.replica >= job_.replicas) {
          return Error(StatusCode::kDataLoss,
                       "checkpoint file '{}': tensor '{}' slice {} is copy {}, but the job "
                       "keeps {} cop{}",
                       file, cs.meta.name, cs.slice, cs.replica, job_.replicas,
                       job_.replicas == 1 ? "y" : "ies");
        }
        if (mine >= job_.replicas) continue;  // not a slice this rank holds
        cs.replica = mine;
        std::shared_lock lock(slices_mu_);
        if (slices_.contains(MakeSliceKey(cs.tensor, cs.slice))) continue;  // another copy
      }
      DSYNC_RETURN_IF_ERROR(RestoreSlice(fmt::format("checkpoint file '{}'", file), c.version, cs));
      ++restored;
    }
  }
  stats_.rounds_applied = from.version;
  spdlog::info("server {}: restored {} slice(s) at version {} from {}", id_.load(), restored,
               from.version,
               own ? from.file
                   : fmt::format("the copies in {} other file(s) (this rank had no file)",
                                 sources.size()));
  return Status::Ok();
}

Status ServerNode::RestoreSlice(const std::string& what, Version version, CheckpointSlice& cs) {
  const uint64_t per = SliceElements();
  std::unique_lock lock(slices_mu_);
  const SliceKey key = MakeSliceKey(cs.tensor, cs.slice);
  const uint64_t n = cs.snapshot.params.size();
  if (cs.meta.tensor_elements == 0 || (cs.meta.tensor_elements - 1) / per >= UINT32_MAX ||
      cs.meta.slice_offset != uint64_t{cs.slice} * per ||
      n != std::min(per, cs.meta.tensor_elements - std::min(cs.meta.tensor_elements,
                                                            cs.meta.slice_offset))) {
    return Error(StatusCode::kDataLoss, "{}: tensor '{}' slice {} does not fit the job's "
                                        "slicing",
                 what, cs.meta.name, cs.slice);
  }
  DSYNC_RETURN_IF_ERROR(ledger_.Place(
      cs.tensor, static_cast<uint32_t>((cs.meta.tensor_elements - 1) / per + 1), cs.slice,
      cs.replica));
  DSYNC_RETURN_IF_ERROR(store_->Restore(key, cs.snapshot)
                            .WithContext(fmt::format("restoring {}", what)));
  auto t = tensors_.try_emplace(cs.tensor,
                                TensorMeta{cs.meta.name, cs.meta.tensor_elements,
                                           cs.meta.optimizer.value_or(job_.optimizer),
                                           cs.meta.shape});
  auto s = std::make_unique<SliceState>();
  s->key = key;
  s->tensor = cs.tensor;
  s->index = cs.slice;
  s->replica = cs.replica;
  s->elements = n;
  s->version = version;
  s->optimizer = t.first->second.optimizer;
  slice_list_.push_back(s.get());
  slices_.emplace(key, std::move(s));
  return Status::Ok();
}

Status ServerNode::DumpModel() {
  const std::string path = fmt::format("{}/server-{}.json", cfg_.dump_model, id_);
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return Error(StatusCode::kInvalidArgument, "cannot write the model dump '{}'", path);
  std::shared_lock lock(slices_mu_);
  std::vector<float> values;
  std::fprintf(f, "{\"server\":%u,\"rounds\":%llu,\"slices\":[", id_.load(),
               static_cast<unsigned long long>(stats_.rounds_applied.load()));
  for (size_t i = 0; i < slice_list_.size(); ++i) {
    const SliceState& s = *slice_list_[i];
    values.resize(s.elements);
    (void)store_->Read(s.key, values);
    double sum = 0;
    float lo = values[0], hi = values[0];
    for (float v : values) {
      sum += v;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    // The CRC-32 of the values' bytes: copies of a slice on other servers compare by it.
    const auto crc = static_cast<unsigned long>(
        crc32(crc32(0, nullptr, 0), reinterpret_cast<const Bytef*>(values.data()),
              static_cast<uInt>(values.size() * sizeof(float))));
    std::fprintf(f,
                 "%s\n{\"tensor\":%u,\"slice\":%u,\"replica\":%u,\"version\":%llu,"
                 "\"elements\":%llu,\"min\":%.9g,\"max\":%.9g,\"sum\":%.17g,\"crc32\":%lu}",
                 i ? "," : "", s.tensor, s.index, s.replica,
                 static_cast<unsigned long long>(s.version),
                 static_cast<unsigned long long>(s.elements), static_cast<double>(lo),
                 static_cast<double>(hi), sum, crc);
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return Status::Ok();
}

}  // namespace dsync::ps
