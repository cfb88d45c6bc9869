// Latency and bandwidth of a transport (tcp or rdma), and push/pull through a whole
// in-process PS over it: the figures to put beside perftest's ib_write_lat / ib_write_bw run
// on the same device (bench/rdma_vs_perftest.sh does both in one soft-RoCE VM boot).
//
//   bench_transport [--transport tcp|rdma] [--host IP] [--lat-iters 2000]
//                   [--bw-kib 64,4096] [--bw-mib 256] [--ps-kib 4,4096] [--ps-iters 200]
//
// - latency: ping-pong of frames with a 2-byte payload; one-way = median round trip / 2 (as
//   ib_write_lat reports).
// - bandwidth: a stream of frames of each size, at most 16 in flight; MiB/s = 2^20 bytes/s.
// - ps: one worker, one server, bsp, sgd; an iteration = PushPull of one tensor + Wait;
//   median iteration time, and 2 * tensor bytes / that time.
#include <condition_variable>
#include <cstdio>
#include <mutex>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "runtime/backends.h"
#include "ps/transport.h"

namespace dsync::bench {
namespace {

using ps::FrameHeader;
using ps::PeerId;

struct Options {
  std::string transport = "tcp";
  std::string host = "127.0.0.1";
  int lat_iters = 2000;
  std::vector<uint64_t> bw_kib{64, 4096};
  uint64_t bw_mib = 256;
  std::vector<uint64_t> ps_kib{4, 4096};
  int ps_iters = 200;
};

// Receives everything into one reused buffer; optionally answers every frame (ping-pong).
class Sink : public ps::TransportHandler {
 public:
  Sink(ps::Transport* t, bool echo, size_t max_bytes) : t_(t), echo_(echo), buf_(max_bytes + 1) {}
  void* OnHeader(PeerId, const FrameHeader&, std::span<const std::byte>) override {
    return buf_.data();
  }
  void OnFrame(PeerId peer, const FrameHeader& h, std::span<const std::byte>, void*) override {
    if (echo_) (void)t_->Send(peer, h, {}, buf_.data(), h.payload_len);
    std::lock_guard lock(mu_);
    ++frames_;
    cv_.notify_all();
  }
  void OnDisconnected(PeerId, const Status&) override {}
  bool WaitFrames(uint64_t n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return frames_ >= n; });
  }

 private:
  ps::Transport* t_;
  bool echo_;
  std::vector<std::byte> buf_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t frames_ = 0;
};

Result<std::unique_ptr<ps::Transport>> Make(const Options& o) {
  Config c;
  DSYNC_ASSIGN_OR_RETURN(c.transport, ParseTransport(o.transport));
  return runtime::MakeTransport(c);
}

struct Pair {
  std::unique_ptr<ps::Transport> server, client;
  std::unique_ptr<Sink> server_sink, client_sink;
  PeerId peer = ps::kNoPeer;
};

Result<Pair> Connect(const Options& o, bool echo, size_t max_bytes) {
  Pair p;
  DSYNC_ASSIGN_OR_RETURN(p.server, Make(o));
  DSYNC_ASSIGN_OR_RETURN(p.client, Make(o));
  p.server_sink = std::make_unique<Sink>(p.server.get(), echo, max_bytes);
  p.client_sink = std::make_unique<Sink>(p.client.get(), false, max_bytes);
  p.server->SetHandler(p.server_sink.get());
  p.client->SetHandler(p.client_sink.get());
  DSYNC_ASSIGN_OR_RETURN(uint16_t port, p.server->Listen(o.host, 0));
  DSYNC_ASSIGN_OR_RETURN(p.peer, p.client->Connect(o.host, port, 10000));
  return p;
}

Result<double> LatencyUs(const Options& o) {
  DSYNC_ASSIGN_OR_RETURN(Pair p, Connect(o, true, 64));
  const std::byte payload[2] = {};
  std::vector<double> rtt;
  for (int i = 0; i < o.lat_iters + 100; ++i) {
    const auto t0 = SteadyClock::now();
    DSYNC_RETURN_IF_ERROR(
        p.client->Send(p.peer, ps::MakeHeader(ps::MsgType::kHeartbeat, 1), {}, payload, 2));
    if (!p.client_sink->WaitFrames(static_cast<uint64_t>(i) + 1)) {
      return Error(StatusCode::kDeadlineExceeded, "no echo");
    }
    if (i >= 100) rtt.push_back(Seconds(t0, SteadyClock::now()));  // 100 warm-up round trips
  }
  p.client->Shutdown();
  p.server->Shutdown();
  return Median(rtt) / 2 * 1e6;
}

Result<double> BandwidthMiBs(const Options& o, uint64_t bytes) {
  DSYNC_ASSIGN_OR_RETURN(Pair p, Connect(o, false, bytes));
  std::vector<std::byte> src(bytes, std::byte{1});
  const uint64_t frames = std::max<uint64_t>(16, o.bw_mib * kMiB / bytes);
  std::mutex mu;
  std::condition_variable cv;
  uint64_t done = 0;
  auto send_one = [&]() {
    return p.client->Send(p.peer, ps::MakeHeader(ps::MsgType::kPush, 1), {}, src.data(), bytes,
                          [&](const Status&) {
                            std::lock_guard lock(mu);
                            ++done;
                            cv.notify_all();
                          });
  };
  DSYNC_RETURN_IF_ERROR(send_one());  // warm-up: registration, first touch
  if (!p.server_sink->WaitFrames(1)) return Error(StatusCode::kDeadlineExceeded, "stalled");
  const auto t0 = SteadyClock::now();
  for (uint64_t i = 0; i < frames; ++i) {
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return i + 1 - done < 16; });  // at most 16 in flight
    }
    DSYNC_RETURN_IF_ERROR(send_one());
  }
  if (!p.server_sink->WaitFrames(frames + 1)) return Error(StatusCode::kDeadlineExceeded, "stalled");
  const double s = Seconds(t0, SteadyClock::now());
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done == frames + 1; });
  }
  p.client->Shutdown();
  p.server->Shutdown();
  return static_cast<double>(frames * bytes) / s / static_cast<double>(kMiB);
}

// Median PushPull iteration of one worker against one server, in seconds. `pin`: the worker
// registers its buffers (Worker::RegisterBuffer), as a training loop would.
Result<double> PsIteration(const Options& o, uint64_t bytes, bool pin) {
  Config cfg = BenchConfig(1, 1);
  DSYNC_ASSIGN_OR_RETURN(cfg.transport, ParseTransport(o.transport));
  cfg.bind_host = o.host;
  cfg.scheduler_host = o.host;
  cfg.optimizer.kind = OptimizerKind::kSgd;
  cfg.optimizer.lr = 1e-3f;
  DSYNC_ASSIGN_OR_RETURN(auto cluster, InProcessCluster::Start(cfg));
  DSYNC_ASSIGN_OR_RETURN(auto worker, Worker::Start(cluster->WorkerConfig()));
  const size_t n = std::max<size_t>(1, bytes / sizeof(float));
  FloatBuffer params(n, 0.5f), grad(n, 0.001f);
  DSYNC_ASSIGN_OR_RETURN(TensorId t, worker->Register("w", {params.data(), n}));
  if (pin) {
    DSYNC_RETURN_IF_ERROR(worker->RegisterBuffer(params.data(), params.bytes()));
    DSYNC_RETURN_IF_ERROR(worker->RegisterBuffer(grad.data(), grad.bytes()));
  }
  DSYNC_RETURN_IF_ERROR(worker->Wait(worker->Pull(t, params.data())));
  std::vector<double> iters;
  for (int i = 0; i < o.ps_iters + 10; ++i) {
    const auto t0 = SteadyClock::now();
    DSYNC_RETURN_IF_ERROR(worker->Wait(worker->PushPull(t, grad.data(), params.data())));
    if (i >= 10) iters.push_back(Seconds(t0, SteadyClock::now()));
  }
  DSYNC_RETURN_IF_ERROR(worker->Leave());
  if (pin) {
    worker->UnregisterBuffer(params.data(), params.bytes());
    worker->UnregisterBuffer(grad.data(), grad.bytes());
  }
  DSYNC_RETURN_IF_ERROR(cluster->WaitFinished(std::chrono::seconds(30)));
  return Median(iters);
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"transport latency/bandwidth and PS push/pull over tcp or rdma"};
  app.add_option("--transport", o.transport, "tcp or rdma")->capture_default_str();
  app.add_option("--host", o.host, "address to listen on and connect to (rdma: the RDMA netdev's IP)")
      ->capture_default_str();
  app.add_option("--lat-iters", o.lat_iters, "timed round trips")->capture_default_str();
  app.add_option("--bw-kib", o.bw_kib, "frame sizes for bandwidth (KiB)")->delimiter(',');
  app.add_option("--bw-mib", o.bw_mib, "bytes per bandwidth measurement (MiB)")->capture_default_str();
  app.add_option("--ps-kib", o.ps_kib, "tensor sizes for push/pull (KiB)")->delimiter(',');
  app.add_option("--ps-iters", o.ps_iters, "timed push/pull iterations")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  QuietLogs();

  nlohmann::json result = {{"bench", "transport"}, {"transport", o.transport}, {"host", o.host}};
  auto lat = LatencyUs(o);
  if (!lat.ok()) {
    std::fprintf(stderr, "bench_transport: %s\n", lat.status().ToString().c_str());
    return 1;
  }
  std::printf("%-34s %12s\n", "measure", "value");
  std::printf("%-34s %9.2f us\n", "one-way latency, 2-byte frames", *lat);
  result["latency_us"] = *lat;
  // Plain "METRIC name value" lines too, for shell scripts without a JSON parser (the VM).
  std::printf("METRIC latency_us %.3f\n", *lat);
  for (uint64_t kib : o.bw_kib) {
    auto bw = BandwidthMiBs(o, kib * 1024);
    if (!bw.ok()) {
      std::fprintf(stderr, "bench_transport: %s\n", bw.status().ToString().c_str());
      return 1;
    }
    std::printf("%-34s %9.1f MiB/s\n", fmt::format("bandwidth, {} KiB frames", kib).c_str(), *bw);
    result["bandwidth_mibs"][std::to_string(kib)] = *bw;
    std::printf("METRIC bw_mibs_%llu %.3f\n", static_cast<unsigned long long>(kib), *bw);
  }
  for (uint64_t kib : o.ps_kib) {
    for (bool pin : {false, true}) {
      auto it = PsIteration(o, kib * 1024, pin);
      if (!it.ok()) {
        std::fprintf(stderr, "bench_transport: %s\n", it.status().ToString().c_str());
        return 1;
      }
      const double mibs = 2.0 * static_cast<double>(kib * 1024) / *it / static_cast<double>(kMiB);
      std::printf("%-34s %9.1f us  %9.1f MiB/s\n",
                  fmt::format("PS push+pull, {} KiB tensor{}", kib, pin ? ", registered" : "")
                      .c_str(),
                  *it * 1e6, mibs);
      const std::string key = std::to_string(kib) + (pin ? "_registered" : "");
      result["ps"][key] = {{"iteration_us", *it * 1e6}, {"mibs", mibs}};
      std::printf("METRIC ps_us_%s %.3f\nMETRIC ps_mibs_%s %.3f\n", key.c_str(), *it * 1e6,
                  key.c_str(), mibs);
    }
  }
  std::printf("RESULT %s\n", result.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace dsync::bench

int main(int argc, char** argv) { return dsync::bench::Main(argc, argv); }
