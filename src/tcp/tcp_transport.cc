#include "tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace dsync::tcp {

using ps::FrameHeader;
using ps::PeerId;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr size_t kScratchBytes = 64u << 10;  // drain buffer for discarded payloads
constexpr int kMaxIov = 256;                 // iovecs per sendmsg (IOV_MAX is 1024)
// How long a connection refusing an incompatible peer waits for its kError frame to leave.
constexpr auto kLingerTimeout = std::chrono::seconds(5);
// How often an idle accept thread wakes to join the threads of connections that ended, so
// that what a burst of strangers cost is given back without waiting for the next connection.
constexpr int kReapIntervalMs = 500;

// The transport whose thread this is, to catch Shutdown() from inside a callback.
thread_local const TcpTransport* tls_running = nullptr;

std::string ErrnoText(int err) { return std::strerror(err); }

std::string FormatAddress(const sockaddr* sa) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip));
    return fmt::format("{}:{}", ip, ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof(ip));
    return fmt::format("[{}]:{}", ip, ntohs(in6->sin6_port));
  }
  return "unknown";
}

std::string PeerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "unknown";
  return FormatAddress(reinterpret_cast<sockaddr*>(&ss));
}

// The address without the port: what the per-source caps count by.
std::string SourceOf(const sockaddr* sa) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, ip, sizeof(ip));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, ip, sizeof(ip));
  }
  return ip;
}

void SetNoDelay(int fd) {
  // Control frames are small and latency-bound; Nagle would hold them back.
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// getaddrinfo for a TCP endpoint; returns the EAI_ code.
int Resolve(const std::string& host, uint16_t port, bool passive, AddrInfoPtr* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  out->reset(rc == 0 ? res : nullptr);
  return rc;
}

// One connect attempt bounded by `deadline`; returns a blocking socket or -1 with *err set.
int TryConnect(const addrinfo* ai, Clock::time_point deadline, int* err) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  // Non-blocking connect so that an unroutable address cannot outlast the caller's timeout.
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      *err = errno;
      close(fd);
      return -1;
    }
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    pollfd pfd{fd, POLLOUT, 0};
    int rc;
    do {
      rc = poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 60'000)));
    } while (rc < 0 && errno == EINTR);
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    if (rc == 0) {
      so_error = ETIMEDOUT;
    } else if (rc < 0) {
      so_error = errno;
    } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) {
      so_error = errno;
    }
    if (so_error != 0) {
      *err = so_error;
      close(fd);
      return -1;
    }
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool RetryableConnectError(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH ||
         err == ECONNRESET || err == ECONNABORTED || err == EAGAIN || err == EINTR;
}

enum class Io { kOk, kEof, kError, kClosed, kTimeout };

struct IoResult {
  Io io = Io::kOk;
  size_t got = 0;
  int err = 0;
};

// Waits until fd is readable or `deadline` passes (false).
bool WaitReadable(int fd, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int rc = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 60'000)));
    if (rc > 0 || (rc < 0 && errno != EINTR)) return true;  // errors show in the recv
  }
}

// Reads exactly n bytes, stopping early when the connection is being closed locally so
// that a closed peer's large payload is not drained. With a deadline (a peer that has not
// authenticated), bytes trickling in do not extend it; it lapses once `trusted` is set.
IoResult RecvAll(int fd, void* buf, size_t n, const std::atomic<bool>& closing,
                 std::optional<Clock::time_point> deadline = std::nullopt,
                 const std::atomic<bool>* trusted = nullptr) {
  IoResult r;
  auto* p = static_cast<std::byte*>(buf);
  while (r.got < n) {
    if (closing.load(std::memory_order_relaxed)) {
      r.io = Io::kClosed;
      return r;
    }
    if (deadline && trusted && trusted->load()) deadline.reset();
    if (deadline && !WaitReadable(fd, *deadline)) {
      if (trusted && trusted->load()) continue;  // trusted while it waited
      r.io = Io::kTimeout;
      return r;
    }
    ssize_t k = recv(fd, p + r.got, n - r.got, deadline ? MSG_DONTWAIT : MSG_WAITALL);
    if (k < 0 && errno == EAGAIN && deadline) continue;
    if (k > 0) {
      r.got += static_cast<size_t>(k);
    } else if (k == 0) {
      r.io = closing.load() ? Io::kClosed : Io::kEof;
      return r;
    } else if (errno != EINTR) {
      r.io = closing.load() ? Io::kClosed : Io::kError;
      r.err = errno;
      return r;
    }
  }
  return r;
}

}  // namespace

namespace detail {

// A queued outgoing frame. Entries are reused (see Conn::queue), so `meta` keeps its capacity.
struct OutFrame {
  FrameHeader header;
  std::vector<std::byte> meta;
  const void* payload = nullptr;
  ps::SendDone done;
  std::chrono::steady_clock::time_point due;  // TcpOptions::send_delay after queueing

  uint64_t bytes() const { return sizeof(FrameHeader) + meta.size() + header.payload_len; }
};

struct Conn {
  Conn(PeerId id_, int fd_, bool inbound_, std::string address_, std::string source_,
       ps::TransportHandler* h, std::chrono::microseconds delay)
      : id(id_), fd(fd_), inbound(inbound_), address(std::move(address_)),
        source(std::move(source_)), handler(h), send_delay(delay), trusted(!inbound_),
        pending(inbound_), accepted_at(std::chrono::steady_clock::now()) {}
  // The fd is closed only here, after both threads are joined, so a concurrent Close()
  // holding a reference can never shut down a reused descriptor.
  ~Conn() { close(fd); }

  // Records why the connection ends (the first cause wins), refuses further sends, and
  // unblocks both threads.
  void Fail(const Status& why) {
    {
      std::lock_guard lock(mu);
      if (reason.ok()) reason = why;
      open = false;
      stop = true;
    }
    closing.store(true);
    writer_cv.notify_all();
    shutdown(fd, SHUT_RDWR);
  }

  Status Reason() {
    std::lock_guard lock(mu);
    return reason;
  }

  // What `done` receives for a frame that never left.
  Status SendFailure() {
    Status r = Reason();
    if (r.ok()) r = Status(StatusCode::kUnavailable, "connection closed");
    StatusCode code =
        r.code() == StatusCode::kAborted ? StatusCode::kAborted : StatusCode::kUnavailable;
    return Error(code, "frame to {} was not sent: {}", address, r.message());
  }

  const PeerId id;
  const int fd;
  const bool inbound;
  const std::string address;
  const std::string source;  // inbound: the peer's address without the port
  ps::TransportHandler* const handler;
  const std::chrono::microseconds send_delay;
  // Outbound connections go where this node chose; inbound ones are strangers until the
  // handler calls Trust().
  std::atomic<bool> trusted;
  bool pending;  // counted in the transport's pending caps (guarded by the transport's mu_)
  const std::chrono::steady_clock::time_point accepted_at;
  std::atomic<bool> mid_frame{false};  // the reader holds a frame it has not delivered yet
  std::thread reader;  // joined by Reap()/Shutdown()
  std::thread writer;  // joined by the reader

  std::atomic<bool> closing{false};  // tells the reader to stop promptly

  std::mutex mu;  // guards the members below
  std::condition_variable writer_cv;
  std::condition_variable writer_exited_cv;
  bool open = true;    // Send() is accepted
  bool stop = false;   // writer: fail what is queued and exit
  bool drain = false;  // writer: flush what is queued, then exit
  bool writer_exited = false;
  Status reason;
  // queue[0, queued) are pending. The writer swaps the whole vector for its empty one, so
  // entries and their meta capacity are reused instead of allocated per frame.
  std::vector<OutFrame> queue;
  size_t queued = 0;

  // Reader-only buffers, grown on demand: a stranger costs a hello's worth at most.
  std::vector<std::byte> meta_buf;
  std::vector<std::byte> scratch;
};

struct Listener {
  int fd = -1;
  std::string address;
  std::atomic<bool> stopping{false};
  std::thread thread;
};

}  // namespace detail

using detail::Conn;
using detail::Listener;
using detail::OutFrame;

namespace {

Status Enqueue(Conn& c, FrameHeader header, std::span<const std::byte> meta, const void* payload,
               uint64_t payload_len, ps::SendDone done);

}  // namespace

TcpTransport::~TcpTransport() { Shutdown(); }

void TcpTransport::SetHandler(ps::TransportHandler* handler) { handler_.store(handler); }

Result<uint16_t> TcpTransport::Listen(const std::string& host, uint16_t port) {
  if (handler_.load() == nullptr) {
    return Error(StatusCode::kFailedPrecondition, "SetHandler() must be called before Listen()");
  }
  const std::string bind_host = host.empty() ? "0.0.0.0" : host;
  AddrInfoPtr addrs;
  if (int rc = Resolve(bind_host, port, true, &addrs); rc != 0) {
    return Error(StatusCode::kInvalidArgument, "cannot listen on {}:{}: cannot resolve '{}' ({})",
                 bind_host, port, bind_host, gai_strerror(rc));
  }
  int err = 0;
  int fd = -1;
  for (const addrinfo* ai = addrs.get(); ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    // Lets a restarted node rebind its port while old connections sit in TIME_WAIT.
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      err = errno;
      close(fd);
      fd = -1;
    }
  }
  if (fd < 0) {
    std::string hint = err == EADDRINUSE      ? "; is another process already using this port?"
                       : err == EADDRNOTAVAIL ? "; is that an address of this machine?"
                                              : "";
    return Error(err == EADDRNOTAVAIL ? StatusCode::kInvalidArgument : StatusCode::kUnavailable,
                 "cannot listen on {}:{} ({}){}", bind_host, port, ErrnoText(err), hint);
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  const uint16_t bound =
      ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                     : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);

  auto listener = std::make_unique<Listener>();
  listener->fd = fd;
  listener->address = FormatAddress(reinterpret_cast<sockaddr*>(&ss));
  std::unique_lock lock(mu_);
  if (stopping_) {
    close(fd);
    return Error(StatusCode::kAborted, "transport is shut down");
  }
  Listener* l = listener.get();
  try {
    l->thread = std::thread([this, l] {
      tls_running = this;
      AcceptLoop(l);
    });
  } catch (const std::system_error& e) {
    close(fd);
    return Error(StatusCode::kUnavailable, "cannot start the accept thread: {}", e.what());
  }
  listeners_.push_back(std::move(listener));
  spdlog::debug("tcp: listening on {}", l->address);
  return bound;
}

void TcpTransport::AcceptLoop(Listener* l) {
  for (;;) {
    pollfd pfd{l->fd, POLLIN, 0};
    if (poll(&pfd, 1, kReapIntervalMs) == 0) {
      if (l->stopping.load()) return;
      Reap();
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = accept4(l->fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (l->stopping.load()) return;  // Shutdown() shut the socket down
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Transient resource exhaustion: back off instead of spinning.
        spdlog::warn("tcp: accept on {} failed ({}); retrying", l->address, ErrnoText(err));
        std::this_thread::sleep_for(milliseconds(100));
        continue;
      }
      spdlog::error("tcp: accept on {} failed ({}); no longer accepting", l->address,
                    ErrnoText(err));
      return;
    }
    Reap();
    auto peer = Adopt(fd, true, SourceOf(reinterpret_cast<sockaddr*>(&ss)));
    if (!peer.ok()) spdlog::debug("tcp: dropped inbound connection: {}", peer.status().message());
  }
}

void TcpTransport::ReleasePending(Conn& c) {
  std::lock_guard lock(mu_);
  ReleasePendingLocked(c);
}

void TcpTransport::ForgetInboundLocked(Conn& c) {
  ReleasePendingLocked(c);
  if (c.inbound) inbound_.Closed();
}

void TcpTransport::ReleasePendingLocked(Conn& c) {
  if (!c.pending) return;
  c.pending = false;
  inbound_.NoLongerPending(c.source);
}

Result<PeerId> TcpTransport::Connect(const std::string& host, uint16_t port, uint32_t timeout_ms) {
  if (handler_.load() == nullptr) {
    return Error(StatusCode::kFailedPrecondition, "SetHandler() must be called before Connect()");
  }
  Reap();
  const auto start = Clock::now();
  const auto deadline = start + milliseconds(timeout_ms);
  auto backoff = milliseconds(20);
  std::string last_error;
  for (;;) {
    {
      std::shared_lock lock(mu_);
      if (stopping_) return Error(StatusCode::kAborted, "transport is shut down");
    }
    AddrInfoPtr addrs;
    int rc = Resolve(host, port, false, &addrs);
    bool retry = false;
    if (rc != 0) {
      last_error = fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc));
      retry = rc == EAI_AGAIN;  // DNS may come up late; an unknown name will not
    } else {
      for (const addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
        int err = 0;
        int fd = TryConnect(ai, deadline, &err);
        if (fd >= 0) return Adopt(fd, false);
        last_error = ErrnoText(err);
        retry = RetryableConnectError(err);
      }
    }
    const auto now = Clock::now();
    if (!retry || now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, milliseconds(500));
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  return Error(StatusCode::kUnavailable,
               "cannot reach {}:{} after {:.1f} s ({}); is the peer running, and are the host "
               "and port right?",
               host, port, secs, last_error);
}

Result<PeerId> TcpTransport::Adopt(int fd, bool inbound, std::string source) {
  SetNoDelay(fd);
  std::string address = PeerName(fd);
  std::unique_lock lock(mu_);
  if (stopping_) {
    close(fd);
    return Error(StatusCode::kAborted, "transport is shut down");
  }
  if (inbound) {
    // Refused before any thread or buffer exists for it: a flood of strangers costs an
    // accept and a close each.
    std::string why;
    if (!inbound_.Admit(source, &why)) {
      close(fd);
      const auto now = Clock::now();
      if (now - last_cap_warning_ > std::chrono::seconds(1)) {
        last_cap_warning_ = now;
        spdlog::warn("tcp: refusing connections from {} for now: {}", address, why);
      }
      return Error(StatusCode::kResourceExhausted, "refused {}: {}", address, why);
    }
  }
  const PeerId id = next_peer_.fetch_add(1);
  auto c = std::make_shared<Conn>(id, fd, inbound, std::move(address), std::move(source),
                                  handler_.load(), options_.send_delay);
  // Threads start under mu_ so that ReaderMain cannot reach finished_ (and be joined)
  // before c->reader is assigned.
  try {
    c->writer = std::thread([this, p = c.get()] {  // the reader, holding c, joins it
      tls_running = this;
      WriterMain(*p);
    });
  } catch (const std::system_error& e) {
    ForgetInboundLocked(*c);
    return Error(StatusCode::kUnavailable, "cannot start a connection thread: {}", e.what());
  }
  try {
    c->reader = std::thread([this, c]() mutable {
      tls_running = this;
      ReaderMain(std::move(c));
    });
  } catch (const std::system_error& e) {
    c->Fail(Status(StatusCode::kAborted, "no reader thread"));
    c->writer.join();
    ForgetInboundLocked(*c);
    return Error(StatusCode::kUnavailable, "cannot start a connection thread: {}", e.what());
  }
  conns_.emplace(id, std::move(c));
  return id;
}

void TcpTransport::ReaderMain(std::shared_ptr<Conn> c) {
  spdlog::debug("tcp: peer {} connected ({} {})", c->id, c->inbound ? "from" : "to", c->address);
  c->handler->OnConnected(c->id, c->inbound);
  bool linger = false;
  Status why = ReadFrames(*c, &linger);
  if (linger) {
    // An error frame is queued for the peer: let the writer flush it before dropping.
    std::unique_lock lock(c->mu);
    if (c->reason.ok()) c->reason = why;
    c->open = false;
    c->drain = true;
    c->writer_cv.notify_all();
    c->writer_exited_cv.wait_for(lock, kLingerTimeout, [&] { return c->writer_exited; });
  }
  c->Fail(why);
  c->writer.join();  // every queued frame's done() has run after this
  const Status reason = c->Reason();
  spdlog::debug("tcp: peer {} ({}) disconnected: {}", c->id, c->address, reason.ToString());
  c->handler->OnDisconnected(c->id, reason);
  std::lock_guard lock(mu_);
  ForgetInboundLocked(*c);
  conns_.erase(c->id);
  finished_.push_back(std::move(c));
  // Notified under the lock: once Shutdown() sees the list drained, this thread no longer
  // touches the transport.
  ended_.notify_all();
}

Status TcpTransport::ReadFrames(Conn& c, bool* linger) {
  auto ended = [&](const IoResult& r, std::string_view what) -> Status {
    if (r.io == Io::kClosed) return c.Reason();
    if (r.io == Io::kTimeout) {
      return Error(StatusCode::kDeadlineExceeded,
                   "{} did not authenticate within the handshake timeout of {} ms", c.address,
                   options_.admission.handshake_timeout.count());
    }
    if (r.io == Io::kEof) {
      if (what.empty())
        return Error(StatusCode::kUnavailable, "{} closed the connection", c.address);
      return Error(StatusCode::kUnavailable, "{} closed the connection in the middle of {}",
                   c.address, what);
    }
    return Error(StatusCode::kUnavailable, "connection to {} broke: {}", c.address,
                 ErrnoText(r.err));
  };
  // Tells a peer why it is dropped, rather than leaving it to guess from a reset.
  auto refuse = [&](const FrameHeader& h, const Status& st) {
    spdlog::warn("tcp: dropping the connection from {}: {}", c.address, st.message());
    FrameHeader err = ps::MakeHeader(ps::MsgType::kError, 0);
    err.status = static_cast<uint16_t>(st.code());
    err.request = h.request;
    err.set_refused(h.msg_type());
    *linger = Enqueue(c, err, ps::AsBytes(st.message()), nullptr, 0, {}).ok();
    return st.WithContext(fmt::format("frame from {}", c.address));
  };

  for (;;) {
    // A stranger's reads share one deadline: trickling bytes do not extend it.
    std::optional<Clock::time_point> deadline;
    if (!c.trusted.load()) deadline = c.accepted_at + options_.admission.handshake_timeout;
    FrameHeader h;
    IoResult r = RecvAll(c.fd, &h, sizeof(h), c.closing, deadline, &c.trusted);
    if (r.io != Io::kOk) return ended(r, r.got == 0 ? "" : "a frame header");
    c.mid_frame.store(true);
    // Judged by what the peer is now that its frame is here (the handler may have trusted it
    // while this thread waited).
    const bool stranger = !c.trusted.load();
    if (!stranger) deadline.reset();

    if (Status st = ValidateHeader(h); !st.ok()) {
      if (st.code() == StatusCode::kUnimplemented) return refuse(h, st);
      spdlog::warn("tcp: dropping the connection from {}: {}", c.address, st.message());
      return st.WithContext(fmt::format("frame from {}", c.address));
    }
    if (stranger) {
      // Nothing beyond a hello's size is read from a peer that has not authenticated.
      if (Status st = ps::CheckUnauthenticatedFrame(h); !st.ok()) return refuse(h, st);
    }

    if (c.meta_buf.size() < h.meta_len) c.meta_buf.resize(h.meta_len);
    const std::span<const std::byte> meta(c.meta_buf.data(), h.meta_len);
    r = RecvAll(c.fd, c.meta_buf.data(), h.meta_len, c.closing, deadline, &c.trusted);
    if (r.io != Io::kOk) return ended(r, fmt::format("a {} frame", MsgTypeName(h.msg_type())));

    void* dst = c.handler->OnHeader(c.id, h, meta);
    if (h.payload_len > 0 || c.closing.load()) {
      if (dst != nullptr) {
        r = RecvAll(c.fd, dst, h.payload_len, c.closing);
      } else {
        if (c.scratch.empty()) c.scratch.resize(kScratchBytes);
        for (uint64_t left = h.payload_len; left > 0 && r.io == Io::kOk;) {
          size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, c.scratch.size()));
          r = RecvAll(c.fd, c.scratch.data(), chunk, c.closing);
          left -= r.got;
        }
      }
      // Closed from OnHeader with nothing left to read still ends here, so every buffer
      // handed out gets exactly one of OnFrame / OnPayloadLost.
      if (r.io == Io::kOk && c.closing.load()) r.io = Io::kClosed;
      if (r.io != Io::kOk) {
        if (dst != nullptr) c.handler->OnPayloadLost(c.id, h, dst);
        return ended(r, fmt::format("a {} frame", MsgTypeName(h.msg_type())));
      }
    }
    c.handler->OnFrame(c.id, h, meta, dst);
    c.mid_frame.store(false);
  }
}

namespace {

void Complete(OutFrame& f, const Status& st) {
  ps::SendDone done = std::exchange(f.done, nullptr);
  f.payload = nullptr;
  if (done) done(st);
}

// Appends [p + skip, p + len) to iov; consumes `skip` across the pieces of a partly sent frame.
void AddPiece(iovec* iov, int* n, const void* p, uint64_t len, uint64_t* skip) {
  if (*skip >= len) {
    *skip -= len;
    return;
  }
  iov[(*n)++] = {const_cast<std::byte*>(static_cast<const std::byte*>(p)) + *skip,
                 static_cast<size_t>(len - *skip)};
  *skip = 0;
}

// Writes batch[0, n) with gathering sendmsg calls; false once the socket failed (the frames
// not written are then left for the caller to fail).
bool WriteBatch(Conn& c, std::vector<OutFrame>& batch, size_t n, size_t* sent) {
  iovec iov[kMaxIov];
  uint64_t off = 0;  // bytes of batch[*sent] already written
  while (*sent < n) {
    int cnt = 0;
    for (size_t i = *sent; i < n && cnt + 3 <= kMaxIov; ++i) {
      uint64_t skip = i == *sent ? off : 0;
      const OutFrame& f = batch[i];
      AddPiece(iov, &cnt, &f.header, sizeof(f.header), &skip);
      AddPiece(iov, &cnt, f.meta.data(), f.meta.size(), &skip);
      AddPiece(iov, &cnt, f.payload, f.header.payload_len, &skip);
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(cnt);
    ssize_t w = sendmsg(c.fd, &msg, MSG_NOSIGNAL);  // MSG_NOSIGNAL: EPIPE, not SIGPIPE
    if (w < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      c.Fail(Error(StatusCode::kUnavailable, "sending to {} failed: {}", c.address, ErrnoText(err)));
      return false;
    }
    for (auto left = static_cast<uint64_t>(w); *sent < n;) {
      const uint64_t rest = batch[*sent].bytes() - off;
      if (left < rest) {
        off += left;
        break;
      }
      left -= rest;
      off = 0;
      Complete(batch[(*sent)++], Status::Ok());
    }
  }
  return true;
}

Status Enqueue(Conn& c, FrameHeader header, std::span<const std::byte> meta, const void* payload,
               uint64_t payload_len, ps::SendDone done) {
  header.meta_len = static_cast<uint32_t>(meta.size());
  header.payload_len = payload_len;
  std::unique_lock lock(c.mu);
  if (!c.open) {
    Status r = c.reason.ok() ? Status(StatusCode::kUnavailable, "closing") : c.reason;
    return Error(StatusCode::kUnavailable, "connection to {} is closed: {}", c.address,
                 r.message());
  }
  if (c.queued == c.queue.size()) c.queue.emplace_back();
  OutFrame& f = c.queue[c.queued++];
  f.header = header;
  f.meta.assign(meta.begin(), meta.end());
  f.payload = payload;
  f.done = std::move(done);
  if (c.send_delay.count() > 0) f.due = std::chrono::steady_clock::now() + c.send_delay;
  const bool wake = c.queued == 1;  // the writer only sleeps on an empty queue
  lock.unlock();
  if (wake) c.writer_cv.notify_all();
  return Status::Ok();
}

}  // namespace

void TcpTransport::WriterMain(Conn& c) {
  std::vector<OutFrame> batch;
  for (;;) {
    size_t n = 0;
    {
      std::unique_lock lock(c.mu);
      c.writer_cv.wait(lock, [&] { return c.queued > 0 || c.stop || c.drain; });
      if (c.stop || c.queued == 0) break;
      std::swap(c.queue, batch);
      n = std::exchange(c.queued, 0);
      if (c.send_delay.count() > 0) {
        // Emulated latency: the batch leaves when its newest frame is due (frames queued
        // together, as a push's slices are, leave together).
        c.writer_cv.wait_until(lock, batch[n - 1].due, [&] { return c.stop; });
        if (c.stop) {
          lock.unlock();
          const Status failure = c.SendFailure();
          for (size_t i = 0; i < n; ++i) Complete(batch[i], failure);
          break;
        }
      }
    }
    size_t sent = 0;
    if (!WriteBatch(c, batch, n, &sent)) {
      const Status failure = c.SendFailure();
      for (size_t i = sent; i < n; ++i) Complete(batch[i], failure);
      break;
    }
  }
  // Nothing can be queued after this (open = false), so every frame gets its done() here.
  size_t n = 0;
  {
    std::lock_guard lock(c.mu);
    c.open = false;
    c.writer_exited = true;
    std::swap(c.queue, batch);
    n = std::exchange(c.queued, 0);
  }
  c.writer_exited_cv.notify_all();
  if (n > 0) {
    const Status failure = c.SendFailure();
    for (size_t i = 0; i < n; ++i) Complete(batch[i], failure);
  }
}

Status TcpTransport::Send(PeerId peer, FrameHeader header, std::span<const std::byte> meta,
                          const void* payload, uint64_t payload_len, ps::SendDone done) {
  if (meta.size() > ps::kMaxMetaBytes) {
    return Error(StatusCode::kInvalidArgument,
                 "{} bytes of frame metadata exceed the {} byte limit", meta.size(),
                 ps::kMaxMetaBytes);
  }
  if (payload_len > ps::kMaxPayloadBytes) {
    return Error(StatusCode::kInvalidArgument, "a payload of {} bytes exceeds the {} byte limit",
                 payload_len, ps::kMaxPayloadBytes);
  }
  if (payload_len > 0 && payload == nullptr) {
    return Error(StatusCode::kInvalidArgument, "payload of {} bytes has no buffer", payload_len);
  }
  std::shared_ptr<Conn> c = Find(peer);
  if (!c) return Error(StatusCode::kUnavailable, "peer {} is not connected", peer);
  return Enqueue(*c, header, meta, payload, payload_len, std::move(done));
}

void TcpTransport::Close(PeerId peer) {
  if (std::shared_ptr<Conn> c = Find(peer)) {
    c->Fail(Error(StatusCode::kAborted, "connection to {} closed locally", c->address));
  }
}

void TcpTransport::Shutdown() {
  std::vector<std::shared_ptr<Conn>> live;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;  // no new listeners or connections from here on
    for (auto& l : listeners_) {
      l->stopping.store(true);
      shutdown(l->fd, SHUT_RDWR);  // wakes accept() with EINVAL
    }
    for (auto& [id, c] : conns_) live.push_back(c);
  }
  for (auto& c : live) c->Fail(Status(StatusCode::kAborted, "transport shut down"));
  live.clear();
  if (tls_running == this) {
    // Joining would wait for this very thread; everything is closed, and a Shutdown() from
    // outside (or the destructor) finishes the job.
    spdlog::debug("tcp: Shutdown() from a transport callback; threads are joined later");
    return;
  }

  std::lock_guard shutdown_lock(shutdown_mu_);
  std::vector<std::unique_ptr<Listener>> listeners;
  {
    std::lock_guard lock(mu_);
    listeners.swap(listeners_);
  }
  for (auto& l : listeners) {
    l->thread.join();
    close(l->fd);
  }

  std::unique_lock lock(mu_);
  for (;;) {
    if (!finished_.empty()) {
      std::vector<std::shared_ptr<Conn>> done;
      done.swap(finished_);
      lock.unlock();
      for (auto& c : done) c->reader.join();
      done.clear();
      lock.lock();
      continue;
    }
    if (conns_.empty()) break;
    ended_.wait(lock);
  }
}

void TcpTransport::Reap() {
  std::vector<std::shared_ptr<Conn>> done;
  {
    std::lock_guard lock(mu_);
    done.swap(finished_);
  }
  for (auto& c : done) c->reader.join();  // each has passed its last callback
}

std::shared_ptr<Conn> TcpTransport::Find(PeerId peer) const {
  std::shared_lock lock(mu_);
  auto it = conns_.find(peer);
  return it == conns_.end() ? nullptr : it->second;
}

void TcpTransport::Trust(PeerId peer) {
  std::shared_ptr<Conn> c = Find(peer);
  if (!c || c->trusted.exchange(true)) return;
  ReleasePending(*c);
}

bool TcpTransport::HasUnreadInput(PeerId peer) const {
  std::shared_ptr<Conn> c = Find(peer);
  if (!c) return false;
  if (c->mid_frame.load()) return true;
  int unread = 0;
  return ioctl(c->fd, FIONREAD, &unread) == 0 && unread > 0;
}

std::string TcpTransport::PeerAddress(PeerId peer) const {
  if (std::shared_ptr<Conn> c = Find(peer)) return c->address;
  return fmt::format("peer {}", peer);
}

TcpTransport::TcpTransport(TcpOptions options)
    : options_(options), inbound_(options.admission) {}

std::unique_ptr<ps::Transport> MakeTcpTransport(TcpOptions options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace dsync::tcp
