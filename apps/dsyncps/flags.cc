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
  const std::string env(s.env);
  if (s.is_switch) {
    text.options.emplace(env, app.add_flag(names, text.switches[env], help));
    return;
  }
  CLI::Option* o = app.add_option(names, text.values[env], help);
  text.options.emplace(env, o);
  if (std::string shown = s.get(config); !shown.empty() && !s.secret) o->default_str(shown);
}

// Whether any option bound to the setting was given.
bool Given(const FlagText& text, std::string_view env) {
  auto [first, last] = text.options.equal_range(env);
  for (auto it = first; it != last; ++it) {
    if (it->second->count() > 0) return true;
  }
  return false;
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
    if (!Given(text, s.env)) continue;
    if (s.is_switch) {
      DSYNC_RETURN_IF_ERROR(ps::ApplySetting(s, config, "1", FirstFlag(s)));
      continue;
    }
    auto it = text.values.find(s.env);
    DSYNC_RETURN_IF_ERROR(
        ps::ApplySetting(s, config, it == text.values.end() ? "" : it->second, FirstFlag(s)));
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
