#include "ps/rejoin.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "ps/keys.h"
#include "ps/protocol.h"
#include "ps/rendezvous.h"

namespace dsync::ps {

bool RejoinState::Lost(const std::string& why) {
  lost = true;
  lost_at = std::chrono::steady_clock::now();
  what = why;
  if (looping) return false;
  looping = true;
  return true;
}

bool RejoinState::Proven(const Welcome& welcome, const JobKey& secret, NodeId self) const {
  if (welcome.scheduler_proof && TagsEqual(*welcome.scheduler_proof, SchedulerProof(secret, self, nonce))) {
    return true;
  }
  spdlog::warn("node {}: what answers at the scheduler's address did not prove it is this job's "
               "scheduler; trying again",
               self);
  return false;
}

std::optional<Welcome> RejoinState::TakeAnswer(const FrameHeader& h,
                                               std::span<const std::byte> meta,
                                               const JobKey& secret, NodeId self) {
  if (h.msg_type() == MsgType::kError) {
    answer = Answer::kCut;
    refusal = ErrorFromFrame(h, meta);
    spdlog::warn("node {}: refused at the scheduler's address ({}); trying again", self,
                 refusal.message());
    return std::nullopt;
  }
  if (h.msg_type() != MsgType::kHelloAck) return std::nullopt;
  auto w = DecodeWelcome(meta);
  if (!w.ok() || !Proven(*w, secret, self)) {
    answer = Answer::kCut;  // not the job's scheduler: tried again
    return std::nullopt;
  }
  peer = kNoPeer;
  answer = Answer::kWelcomed;
  lost = false;
  return std::move(w).value();
}

Status RunRejoin(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 Transport& transport, const Config& config, uint32_t grace_ms, NodeId self,
                 RejoinState& state, const std::function<bool()>& ended,
                 const std::function<Hello()>& hello) {
  using SteadyClock = std::chrono::steady_clock;
  const auto grace = std::chrono::milliseconds(grace_ms);
  Status result;
  while (state.lost && !ended()) {
    const auto deadline = state.lost_at + grace;
    const auto now = SteadyClock::now();
    if (now >= deadline) {
      result = Error(StatusCode::kUnavailable,
                     "lost the scheduler ({}), and it did not come back within the reconnect "
                     "grace of {} s (--reconnect-grace): restart it with --resume and its "
                     "journal sooner, or raise the grace{}",
                     state.what, grace_ms / 1000,
                     state.refusal.ok() ? std::string()
                                        : "; what answers at its address refused this node: " +
                                              state.refusal.message());
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    lock.unlock();
    Result<PeerId> peer = ReconnectScheduler(
        transport, config, static_cast<uint32_t>(std::min<int64_t>(left.count(), kRejoinAttemptMs)));
    lock.lock();
    if (!peer.ok()) {
      cv.wait_for(lock, std::min(left, std::chrono::milliseconds(kRejoinRetryMs)), ended);
      continue;
    }
    state.answer = RejoinState::Answer::kNone;
    state.peer = *peer;
    state.nonce = RandomNonce();
    Hello h = hello();
    h.nonce = state.nonce;
    const std::string text = EncodeHello(h);
    lock.unlock();
    // A connection closed before state.peer named it was not seen closing: the send fails.
    const Status sent =
        transport.Send(*peer, MakeHeader(MsgType::kHello, self), AsBytes(text), nullptr, 0);
    lock.lock();
    if (!sent.ok()) state.answer = RejoinState::Answer::kCut;
    // The answer waits for the scheduler's journal to be on disk: as long as the connection
    // lasts, until the grace is over.
    cv.wait_until(lock, deadline,
                  [&] { return ended() || state.answer != RejoinState::Answer::kNone; });
    if (state.answer == RejoinState::Answer::kWelcomed) continue;  // back, unless lost again
    state.peer = kNoPeer;
    transport.Close(*peer);
    cv.wait_for(lock, std::chrono::milliseconds(kRejoinRetryMs), ended);
  }
  state.looping = false;
  return result;
}

}  // namespace dsync::ps
