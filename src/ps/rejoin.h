// A server or worker of a journaled job that lost its scheduler (docs/design.md, "A
// restartable scheduler"): it keeps trying to reach the scheduler again, restarted from its
// journal, for the reconnect grace, and rejoins it with a hello that proves who it is.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "dsync/config.h"
#include "dsync/status.h"
#include "ps/handshake.h"
#include "ps/transport.h"

namespace dsync::ps {

// Under the node's mutex, but for `peer`, which its transport threads read.
struct RejoinState {
  enum class Answer { kNone, kWelcomed, kCut };
  bool lost = false;     // the scheduler is lost and not back yet
  bool looping = false;  // RunRejoin runs (on the node's rejoin thread)
  std::chrono::steady_clock::time_point lost_at;
  std::string what;      // why the newest loss happened
  Answer answer = Answer::kNone;
  Tag nonce{};  // of the attempt under way: the scheduler's answer proves itself over it
  // The newest refusal heard at the scheduler's address. A refusal proves nothing (an
  // impostor can refuse), so attempts go on; it is said if the grace ends.
  Status refusal;
  std::atomic<PeerId> peer{kNoPeer};  // the connection of the attempt under way

  // Whether a welcome proves it comes from the job's scheduler (`secret`: the job key for a
  // server, the credential for a worker). Says so when it does not.
  bool Proven(const Welcome& welcome, const JobKey& secret, NodeId self) const;
  // A frame on the attempt's connection. The job's scheduler's welcome ends the attempt (the
  // node is back; its welcome is returned). A refusal, or a welcome without the proof, makes
  // the attempt fail and the next one begin; anything else is ignored.
  std::optional<Welcome> TakeAnswer(const FrameHeader& h, std::span<const std::byte> meta,
                                    const JobKey& secret, NodeId self);

  // The scheduler's connection ended: true when a rejoin thread must be started (none runs;
  // a running one goes on, with the grace counted from now).
  bool Lost(const std::string& why);
};

// Tries until the node is back (state.lost is false: the node's handler of the answer
// clears it), `ended()`, or the grace is over, counted from the newest loss: then it returns
// the error to stop with. `hello()`
// builds the rejoin hello, under the lock (the nonce is set here). `lock` holds the node's mutex; it is released
// while connecting and sending, and the node's `cv` is waited on.
Status RunRejoin(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                 Transport& transport, const Config& config, uint32_t grace_ms, NodeId self,
                 RejoinState& state, const std::function<bool()>& ended,
                 const std::function<Hello()>& hello);

}  // namespace dsync::ps
