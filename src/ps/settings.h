// Every setting of a node, defined once: its environment variable (with ps-lite's DMLC_*
// fallbacks), its command-line flag, its help, which nodes take it, whether a launcher hands
// it to the processes it starts, and how its text is read and written. Config::FromEnvironment,
// Config::ToEnvironment and the flags of apps/dsyncps all come from this table, the way NCCL's
// NCCL_PARAM lines define its variables; the defaults are Config's member initializers.
// What is not here is not a plain setting: the role (a subcommand, or derived from the task
// rank), and what Slurm's variables derive (Config::FromEnvironment).
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "dsync/config.h"
#include "dsync/status.h"

namespace dsync::ps {

enum class SettingScope {
  kNode,     // every role: where the scheduler is, this node's address, timeouts, transport
  kCluster,  // the job's size (launchers size it themselves and do not take these)
  kJob,      // owned by the scheduler and handed to every node: sync, optimizer, slices
  kServer,   // servers' own (and launchers', which pass them to their servers)
};

struct Setting {
  std::string_view env;                 // DSYNC_* name
  std::string_view fallbacks[2];        // ps-lite/BytePS names read when env is unset ("": none)
  std::string_view flags;               // CLI11 names, "--a,--b" ("": no flag)
  std::string_view help;
  SettingScope scope;
  bool travels;  // Config::ToEnvironment hands it on (not: one node's own, like its port)
  bool is_switch = false;  // a flag without a value ("1" when given)
  // Reads `text` into the config. Errors say what is wrong with the text; the caller names
  // the variable or flag.
  Status (*set)(Config& config, std::string_view text) = nullptr;
  // The config's value as text the setter reads back; "" for "not set".
  std::string (*get)(const Config& config) = nullptr;
  bool secret = false;  // never shown (help texts show the others' current values)
};

std::span<const Setting> Settings();
// The setting of a DSYNC_* variable, or nullptr.
const Setting* FindSetting(std::string_view env);
// Reads `text` into `config`; an error names `source` (the variable or the flag).
Status ApplySetting(const Setting& setting, Config& config, std::string_view text,
                    std::string_view source);

// What is wrong with a DSYNC_* variable in a node's environment that no node reads (a
// misspelt or renamed setting, which would otherwise be ignored in silence), as a warning's
// text ("DSYNC_AUTO_FINISH is not a setting and is ignored: it is DSYNC_FINISH_BSP now");
// "" for a setting, a variable the processes read besides (DSYNC_ROLE, what launchers hand
// their children) or one the project's scripts read, and for any name not starting DSYNC_.
std::string UnknownVariable(std::string_view name);
// Set by the launchers in the environment of every process they start (Config's).
inline constexpr std::string_view kEnvironmentChecked = Config::kEnvironmentChecked;

}  // namespace dsync::ps
