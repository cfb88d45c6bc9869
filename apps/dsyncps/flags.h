// Command-line flags shared by the roles: they start from the environment (DSYNC_*, DMLC_*)
// and override it.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "dsync/config.h"

namespace dsync::app {

// Text flags that need parsing after CLI11 has run.
struct FlagText {
  std::string sync;
  std::string optimizer;
  std::string slice;
  std::string log_level = "info";
};

// Adds the flags of every role (where the scheduler is, the token, ...).
void AddNodeFlags(CLI::App& app, Config& config, FlagText& text);
// Adds the job-wide flags the scheduler owns (sync mode, optimizer, slices, membership).
// `cluster_size`: also --num-servers/--num-workers (launchers size the cluster themselves).
void AddJobFlags(CLI::App& app, Config& config, FlagText& text, bool cluster_size = true);
// Parses the text flags into `config` and sets the log level.
Status ApplyFlagText(const FlagText& text, Config& config);

}  // namespace dsync::app
