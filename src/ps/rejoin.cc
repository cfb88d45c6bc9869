#include "ps/rejoin.h"

#include <algorithm>

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

Status RunRejoin(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 Transport& transport, const Config& config, uint32_t grace_ms, NodeId self,
                 RejoinState& state, const std::function<bool()>& ended,
                 const std::function<Hello()>& hello) {
  using SteadyClock = std::chrono::steady_clock;
  const auto grace = std::chrono::milliseconds(grace_ms);
  Status result;
  while (state.lost && !ended() && state.answer != RejoinState::Answer::kRefused) {
    const auto deadline = state.lost_at + grace;
    const auto now = SteadyClock::now();
    if (now >= deadline) {
      result = Error(StatusCode::kUnavailable,
                     "lost the scheduler ({}), and it did not come back within the reconnect "
                     "grace of {} s (--reconnect-grace): restart it with --resume and its "
                     "journal sooner, or raise the grace",
                     state.what, grace_ms / 1000);
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
    const std::string text = EncodeHello(hello());
    lock.unlock();
    (void)transport.Send(*peer, MakeHeader(MsgType::kHello, self), AsBytes(text), nullptr, 0);
    lock.lock();
    // The answer waits for the scheduler's journal to be on disk: as long as the connection
    // lasts, until the grace is over.
    cv.wait_until(lock, deadline,
                  [&] { return ended() || state.answer != RejoinState::Answer::kNone; });
    if (state.answer == RejoinState::Answer::kWelcomed) continue;  // back, unless lost again
    state.peer = kNoPeer;
    if (state.answer != RejoinState::Answer::kRefused) transport.Close(*peer);
  }
  state.looping = false;
  return result;
}

}  // namespace dsync::ps
