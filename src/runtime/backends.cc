// Backend selection: which Transport and ParamStore a node runs with, from its
// configuration and from what this build and machine have.
#include "ps/backends.h"

#include "cpu/cpu_store.h"
#include "tcp/tcp_transport.h"

namespace dsync::ps {

Result<std::unique_ptr<Transport>> MakeTransport(const Config& config) {
  if (config.transport == "tcp" || config.transport == "auto") {
    return tcp::MakeTcpTransport({std::chrono::microseconds(config.link_delay_us)});
  }
  return Error(StatusCode::kUnimplemented,
               "transport '{}' is not available in this build; use --transport tcp",
               config.transport);
}

Result<std::unique_ptr<ParamStore>> MakeParamStore(const Config& config) {
  if (config.store == "cpu" || config.store == "auto") return cpu::MakeCpuStore();
  return Error(StatusCode::kUnimplemented,
               "parameter store '{}' is not available in this build; use --store cpu",
               config.store);
}

}  // namespace dsync::ps
