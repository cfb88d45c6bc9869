// The server node: workers' requests (hellos, a tensor's first registration, pushes staged,
// pulls answered). The class: ps/server_internal.h.
#include "ps/server_internal.h"

namespace dsync::ps {

ServerNode::SliceState* ServerNode::FindSlice(uint32_t tensor, uint32_t slice) {
  std::shared_lock lock(slices_mu_);
  auto it = slices_.find(MakeSliceKey(tensor, slice));
  return it == slices_.end() ? nullptr : it->second.get();
}

void ServerNode::Refuse(PeerId peer, const FrameHeader& about, const Status& error, bool drop) {
  ++stats_.requests_refused;
  spdlog::warn("server {}: refused {} from {}: {}", id_.load(), MsgTypeName(about.msg_type()),
               transport_->PeerAddress(peer), error.message());
  if (drop) {
    ++stats_.connections_dropped;
    if (Client* ps = clients_.Find(peer)) ps->doomed = true;  // ignore it until it is gone
  }
  (void)SendError(*transport_, peer, id_, error, about, /*close_after=*/drop);
}

Status ServerNode::CheckData(const FrameHeader& h, SliceState** out) {
  SliceState* s = FindSlice(h.tensor(), h.slice());
  if (!s) {
    return Error(StatusCode::kNotFound,
                 "tensor {} slice {} is not on server {}; register the tensor first",
                 h.tensor(), h.slice(), id_.load());
  }
  if (h.msg_type() == MsgType::kPush) {
    if (h.dtype != static_cast<uint8_t>(DType::kFloat32)) {
      return Error(StatusCode::kInvalidArgument,
                   "push to tensor {} slice {}: dtype {} is not supported (the model is float32)",
                   h.tensor(), h.slice(), DTypeName(static_cast<DType>(h.dtype)));
    }
    if (h.payload_len != s->elements * sizeof(float)) {
      return Error(StatusCode::kInvalidArgument,
                   "push to tensor {} slice {}: {} bytes, expected {} ({} float32)", h.tensor(),
                   h.slice(), h.payload_len, s->elements * sizeof(float), s->elements);
    }
  }
  *out = s;
  return Status::Ok();
}

Status ServerNode::CheckPushFrom(const Client& c, const FrameHeader& h, SliceState** s) {
  if (c.observer) {
    return Error(StatusCode::kPermissionDenied, "observer {} is read-only: it cannot push",
                 c.id);
  }
  DSYNC_RETURN_IF_ERROR(CheckData(h, s));
  DSYNC_RETURN_IF_ERROR(clients_.CheckNotGone(c.id, h.clock()));
  return ledger_.Admit(c.id, h.clock());
}

uint64_t ServerNode::SliceElements() const {
  return std::max<uint64_t>(1, job_.slice_bytes / sizeof(float));
}

uint64_t ServerNode::InitElements(const FrameHeader& h, const InitMeta& im) const {
  if (!(h.flags & kFlagLayout)) return h.payload_len / sizeof(float);
  return im.slice_offset < im.tensor_elements
             ? std::min(SliceElements(), im.tensor_elements - im.slice_offset)
             : 0;
}

Status ServerNode::CheckInit(const FrameHeader& h, std::span<const std::byte> meta, bool observer,
                             bool* exists) {
  InitMeta im;
  DSYNC_RETURN_IF_ERROR(DecodeInit(meta, im));
  if (h.dtype != static_cast<uint8_t>(DType::kFloat32)) {
    return Error(StatusCode::kInvalidArgument, "tensor '{}': dtype {} is not supported (float32)",
                 im.name, DTypeName(static_cast<DType>(h.dtype)));
  }
  // A slice is exactly where the job's slice size puts it: then a tensor's slice count,
  // which receipts attest, is the same for every server and every worker.
  const uint64_t per = SliceElements();
  const bool layout = (h.flags & kFlagLayout) != 0;
  if (layout && (observer || !awaiting_copies_.load() || h.payload_len != 0)) {
    return Error(StatusCode::kInvalidArgument,
                 "tensor '{}' slice {}: an init without values is only for a server taking a "
                 "lost one's place, from a worker, before its copies are in",
                 im.name, h.slice());
  }
  const uint64_t bytes = layout ? InitElements(h, im) * sizeof(float) : h.payload_len;
  if (bytes == 0 || bytes % sizeof(float) != 0 ||
      im.slice_offset + bytes / sizeof(float) > im.tensor_elements ||
      im.slice_offset != uint64_t{h.slice()} * per ||
      bytes / sizeof(float) != std::min(per, im.tensor_elements - im.slice_offset)) {
    return Error(StatusCode::kInvalidArgument,
                 "tensor '{}' slice {}: {} bytes at element {} are not slice {} of a tensor "
                 "of {} elements cut into slices of {} elements",
                 im.name, h.slice(), bytes, im.slice_offset, h.slice(),
                 im.tensor_elements, per);
  }
  std::shared_lock lock(slices_mu_);
  if (auto t = tensors_.find(h.tensor()); t != tensors_.end()) {
    if (t->second.name == im.name && !t->second.shape.empty() && !im.shape.empty() &&
        t->second.shape != im.shape) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor {} '{}' has shape {} on server {}, but this worker registers shape "
                   "{}: every worker must build the same model",
                   h.tensor(), im.name, ShapeText(t->second.shape), id_.load(),
                   ShapeText(im.shape));
    }
    if (t->second.name != im.name || t->second.elements != im.tensor_elements) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor {} is '{}' ({} elements) on server {}, but this worker registers "
                   "'{}' ({} elements): every worker must register the same tensors in the "
                   "same order",
                   h.tensor(), t->second.name, t->second.elements, id_.load(), im.name,
                   im.tensor_elements);
    }
    const OptimizerConfig asked = im.optimizer.value_or(job_.optimizer);
    if (!(observer && !im.optimizer) && !SameBesidesLearningRate(asked, t->second.optimizer)) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor {} '{}' runs {} on server {}, but this worker registers it with {}: "
                   "every worker must register a tensor with the same optimizer (only the "
                   "learning rate may differ)",
                   h.tensor(), im.name, DescribeOptimizer(t->second.optimizer), id_.load(),
                   DescribeOptimizer(asked));
    }
  }
  if (auto it = slices_.find(MakeSliceKey(h.tensor(), h.slice())); it != slices_.end()) {
    if (it->second->elements * sizeof(float) != bytes) {
      return Error(StatusCode::kInvalidArgument,
                   "tensor '{}' slice {} holds {} elements here, not {}: is the slice size the "
                   "same on every worker?",
                   im.name, h.slice(), it->second->elements, bytes / sizeof(float));
    }
    *exists = true;
  }
  return Status::Ok();
}

void ServerNode::HandleHello(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta) {
  auto hello = AcceptHello(meta, cfg_.token);
  Result<Tag> proof = hello.ok() ? clients_.Admit(peer, *hello) : Result<Tag>(hello.status());
  if (!proof.ok()) {
    Refuse(peer, h, proof.status(), true);
    return;
  }
  transport_->Trust(peer);
  FrameHeader ack = MakeHeader(MsgType::kHelloAck, id_);
  ack.request = h.request;
  (void)transport_->Send(peer, ack, {reinterpret_cast<const std::byte*>(proof->data()),
                                     proof->size()},
                         nullptr, 0);
}

void ServerNode::HandleInit(PeerId peer, const FrameHeader& h, std::span<const std::byte> meta,
                            void* payload, bool exists) {
  InitMeta im;
  (void)DecodeInit(meta, im);  // validated in OnHeader
  SliceState* slice = nullptr;
  if (!exists) {
    const uint64_t per = SliceElements();
    const bool layout = (h.flags & kFlagLayout) != 0;
    const uint64_t n = InitElements(h, im);
    std::unique_lock lock(slices_mu_);
    const SliceKey key = MakeSliceKey(h.tensor(), h.slice());
    // Checked again under the lock that ends the wait for copies (FinishCopies).
    const bool awaiting = awaiting_copies_.load();
    Status st = layout && !awaiting
                    ? Error(StatusCode::kFailedPrecondition,
                            "tensor '{}' slice {}: the copies are in already; a layout init "
                            "came too late",
                            im.name, h.slice())
                    : Status::Ok();
    if (!st.ok()) {
      lock.unlock();
      Refuse(peer, h, st, false);
      return;
    }
    if (!slices_.contains(key)) {  // else another worker's init won the race
      st = ledger_.Place(h.tensor(),
                         static_cast<uint32_t>((im.tensor_elements + per - 1) / per),
                         h.slice(), h.replica());
      // A server taking a lost rank's place creates the slice in the store once the copies
      // are in (FinishCopies): from a copy, or from these values.
      if (st.ok() && !awaiting) {
        st = store_->InitSlice(key, {static_cast<const float*>(payload), n});
      }
      if (!st.ok()) {
        lock.unlock();
        if (payload) ReleaseBuffer(payload, h.payload_len);
        Refuse(peer, h, st, false);
        return;
      }
      auto s = std::make_unique<SliceState>();
      s->key = key;
      s->tensor = h.tensor();
      s->index = h.slice();
      s->replica = h.replica();
      s->elements = n;
      s->version = stats_.rounds_applied;  // it exists from the current model version on
      s->awaiting_copy = awaiting;
      s->layout_only = layout;
      if (awaiting && !layout) {
        s->init_values.assign(static_cast<const float*>(payload),
                              static_cast<const float*>(payload) + n);
      }
      // A tensor's slices here share the optimizer of its first registration.
      auto t = tensors_.try_emplace(h.tensor(),
                                    TensorMeta{im.name, im.tensor_elements,
                                               im.optimizer.value_or(job_.optimizer),
                                               im.shape});
      s->optimizer = t.first->second.optimizer;
      slice_list_.push_back(s.get());
      slices_.emplace(key, std::move(s));
    }
    lock.unlock();
    if (payload) ReleaseBuffer(payload, h.payload_len);
  }
  slice = FindSlice(h.tensor(), h.slice());
  FrameHeader ack = MakeHeader(MsgType::kInitAck, id_);
  ack.request = h.request;
  ack.set_tensor(h.tensor());
  ack.set_slice(h.slice());
  {
    std::lock_guard lock(slice->mu);
    ack.set_slice_version(slice->version);
  }
  (void)SendControl(*transport_, peer, ack);
}

void ServerNode::StagePush(PeerId peer, WorkerId worker, const FrameHeader& h, void* payload) {
  trace::Scoped range(trace::Range::kServerPush);
  SliceState* s = FindSlice(h.tensor(), h.slice());
  Status error;
  std::optional<Tag> receipt;
  {
    std::lock_guard lock(s->mu);
    error = clients_.CheckNotGone(worker, h.clock());
    for (const Staged& st : s->staged) {
      if (error.ok() && st.worker == worker && st.clock == h.clock()) {
        error = Error(StatusCode::kAlreadyExists,
                      "worker {} pushed tensor {} slice {} twice for clock {}", worker,
                      h.tensor(), h.slice(), h.clock());
      }
    }
    if (error.ok()) error = ledger_.Staged(worker, h.clock(), h.tensor(), &receipt);
    if (error.ok()) {
      s->staged.push_back({worker, h.clock(), static_cast<float*>(payload)});
      ++stats_.staged_now;
    }
  }
  if (!error.ok()) {
    ReleaseBuffer(payload, h.payload_len);
    Refuse(peer, h, error, false);
    return;
  }
  ++stats_.pushes_received;
  FrameHeader ack = MakeHeader(MsgType::kPushAck, id_);
  ack.request = h.request;
  ack.set_tensor(h.tensor());
  ack.set_slice(h.slice());
  ack.set_clock(h.clock());
  std::span<const std::byte> meta;
  if (receipt) meta = {reinterpret_cast<const std::byte*>(receipt->data()), receipt->size()};
  (void)transport_->Send(peer, ack, meta, nullptr, 0);
}

void ServerNode::HandlePull(PeerId peer, const FrameHeader& h) {
  SliceState* s = nullptr;
  Status st = CheckData(h, &s);
  if (!st.ok()) {
    Refuse(peer, h, st, false);
    return;
  }
  std::lock_guard lock(s->mu);
  if (!s->awaiting_copy && s->version >= h.min_version()) {
    ReplyPull(*s, peer, h.request);
  } else {
    s->waiting.push_back({peer, h.request, h.min_version()});
  }
}

void ServerNode::ReplyPull(SliceState& s, PeerId peer, uint64_t request) {
  trace::Scoped range(trace::Range::kServerPull);
  const size_t bytes = s.elements * sizeof(float);
  void* buf = AcquireBuffer(bytes);
  if (!buf) return;
  Status st = store_->Read(s.key, {static_cast<float*>(buf), s.elements});
  FrameHeader h = MakeHeader(MsgType::kPullReply, id_);
  h.request = request;
  h.set_tensor(s.tensor);
  h.set_slice(s.index);
  h.set_slice_version(s.version);
  h.dtype = static_cast<uint8_t>(DType::kFloat32);
  if (st.ok()) {
    st = transport_->Send(peer, h, {}, buf, bytes,
                          [this, buf, bytes](const Status&) { ReleaseBuffer(buf, bytes); });
  }
  if (!st.ok()) {
    ReleaseBuffer(buf, bytes);
    return;
  }
  ++stats_.pulls_answered;
}

}  // namespace dsync::ps
