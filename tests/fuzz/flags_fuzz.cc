// The dsyncps program's node and job flags (apps/dsyncps/flags.h: CLI11 options, then
// ApplyFlagText), over an argument list read from the input, one argument per line. Beyond
// not crashing: only CLI11's own parse errors may be thrown; every flag that applies lands in
// the configuration as its setting reads it alone, and as the same text in its environment
// variable reads (src/ps/settings.cc: one reader for both); and a configuration that passes
// Validate() holds only finite optimizer settings (they travel to every node as JSON).
#include <spdlog/spdlog.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "dsync/config.h"
#include "flags.h"
#include "fuzz_check.h"
#include "ps/settings.h"

using namespace dsync;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args = {"dsyncps"};
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; std::getline(lines, line) && args.size() < 32;) args.push_back(line);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());

  Config config;
  app::FlagText text;
  CLI::App cli;
  app::AddNodeFlags(cli, config, text);
  app::AddJobFlags(cli, config, text);
  try {
    cli.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;  // told to the user by CLI11 (main's CLI11_PARSE)
  }
  const Status applied = app::ApplyFlagText(text, config);
  if (!applied.ok()) {
    FUZZ_CHECK(applied.code() == StatusCode::kInvalidArgument);
    return 0;
  }
  for (const ps::Setting& s : ps::Settings()) {
    auto it = text.values.find(s.env);
    if (s.is_switch || it == text.values.end() || it->second.empty()) continue;
    Config alone;
    FUZZ_CHECK(s.set(alone, it->second).ok());
    FUZZ_CHECK(s.get(alone) == s.get(config));
    const auto from_env = Config::FromEnvironment({{std::string(s.env), it->second}});
    FUZZ_CHECK(from_env.ok() && s.get(*from_env) == s.get(config));
  }
  FUZZ_CHECK(spdlog::get_level() == spdlog::level::from_str(text.log_level));
  if (config.Validate().ok()) {
    const OptimizerConfig& o = config.optimizer;
    for (float x : {o.lr, o.momentum, o.beta1, o.beta2, o.eps, o.weight_decay}) {
      FUZZ_CHECK(std::isfinite(x));
    }
  }
  return 0;
}
