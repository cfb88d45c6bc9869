// Command-line flags of the settings (src/ps/settings.cc: each setting's flag, variable and
// help are defined there once). Flags start from the environment (DSYNC_*, DMLC_*) and
// override it.
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <string>
#include <string_view>

#include "dsync/config.h"

namespace dsync::app {

// What the flags said, as text, until ApplyFlagText reads it with the settings' own readers
// (the same ones that read the environment, so both refuse the same things the same way).
struct FlagText {
  std::map<std::string, std::string, std::less<>> values;  // by DSYNC_* name
  std::map<std::string, bool, std::less<>> switches;
  // Every option bound to a setting (several subcommands bind the same one): a flag given
  // with an empty value (--interface "") still counts as given.
  std::multimap<std::string, const CLI::Option*, std::less<>> options;
  std::string log_level = "info";
};

// The flags of every role (where the scheduler is, the token, timeouts, transport, ...);
// `config` supplies the values shown as defaults (the environment's, if set).
void AddNodeFlags(CLI::App& app, const Config& config, FlagText& text);
// The job-wide flags the scheduler owns (sync mode, optimizer, slices, budget, logs), and
// the servers' own (launchers pass them on).
// `cluster_size`: also --num-servers/--num-workers (launchers size the cluster themselves).
void AddJobFlags(CLI::App& app, const Config& config, FlagText& text, bool cluster_size = true);
// The servers' own flags (--dump-model).
void AddServerFlags(CLI::App& app, const Config& config, FlagText& text);
// One setting's flag, by its variable's name (`help`: instead of the table's).
void AddSettingFlag(CLI::App& app, const Config& config, FlagText& text, std::string_view env,
                    std::string_view help = {});
// Reads the flags given into `config` and sets the log level.
Status ApplyFlagText(const FlagText& text, Config& config);

}  // namespace dsync::app
