#include "flags.h"

#include <spdlog/spdlog.h>

#include "ps/settings.h"

namespace dsync::app {
namespace {

// The first of a setting's flag names, for messages.
std::string_view FirstFlag(const ps::Setting& s) { return s.flags.substr(0, s.flags.find(',')); }

void AddFlag(CLI::App& app, const Config& config, FlagText& text, const ps::Setting& s,
             std::string_view help_override) {
  const std::string help = fmt::format("{} ({})", help_override.empty() ? s.help : help_override,
                                       s.env);
  const std::string names(s.flags);
  if (s.is_switch) {
    app.add_flag(names, text.switches[std::string(s.env)], help);
    return;
  }
  CLI::Option* o = app.add_option(names, text.values[std::string(s.env)], help);
  if (std::string shown = s.get(config); !shown.empty()) o->default_str(shown);
}

void AddScope(CLI::App& app, const Config& config, FlagText& text, ps::SettingScope scope) {
  for (const ps::Setting& s : ps::Settings()) {
    if (s.scope == scope && !s.flags.empty()) AddFlag(app, config, text, s, {});
  }
}

}  // namespace

void AddNodeFlags(CLI::App& app, const Config& config, FlagText& text) {
  AddScope(app, config, text, ps::SettingScope::kNode);
  app.add_option("--log-level", text.log_level, "trace|debug|info|warn|error")
      ->capture_default_str();
}

void AddJobFlags(CLI::App& app, const Config& config, FlagText& text, bool cluster_size) {
  if (cluster_size) AddScope(app, config, text, ps::SettingScope::kCluster);
  AddScope(app, config, text, ps::SettingScope::kJob);
  AddServerFlags(app, config, text);  // a launcher hands them to its servers
}

void AddServerFlags(CLI::App& app, const Config& config, FlagText& text) {
  AddScope(app, config, text, ps::SettingScope::kServer);
}

void AddSettingFlag(CLI::App& app, const Config& config, FlagText& text, std::string_view env,
                    std::string_view help) {
  const ps::Setting* s = ps::FindSetting(env);
  if (s && !s->flags.empty()) AddFlag(app, config, text, *s, help);
}

Status ApplyFlagText(const FlagText& text, Config& config) {
  for (const ps::Setting& s : ps::Settings()) {
    if (s.is_switch) {
      auto it = text.switches.find(s.env);
      if (it != text.switches.end() && it->second) {
        DSYNC_RETURN_IF_ERROR(ps::ApplySetting(s, config, "1", FirstFlag(s)));
      }
      continue;
    }
    auto it = text.values.find(s.env);
    if (it != text.values.end() && !it->second.empty()) {
      DSYNC_RETURN_IF_ERROR(ps::ApplySetting(s, config, it->second, FirstFlag(s)));
    }
  }
  const auto level = spdlog::level::from_str(text.log_level);
  if (level == spdlog::level::off && text.log_level != "off") {
    return Error(StatusCode::kInvalidArgument, "log level '{}' is not one of trace, debug, info, "
                 "warn, error, off", text.log_level);
  }
  spdlog::set_level(level);
  return Status::Ok();
}

}  // namespace dsync::app
