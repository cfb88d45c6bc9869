// `dsyncps checkpoint export DIR`: a checkpoint's model as a PyTorch state dict or a NumPy .npz.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace dsync::app {

struct CheckpointCli {
  std::string dir;     // a checkpoint (ckpt-V) or a directory of them (the newest sound one)
  std::string format;  // torch | npz
  std::string out;     // default: model.pt / model.npz
};

// Adds `checkpoint export` to `app`; returns the `export` subcommand.
CLI::App* AddCheckpointCommand(CLI::App& app, CheckpointCli& cli);
// Exit status: 0 written, 1 it could not be, 2 a usage error.
int RunCheckpointExport(const CheckpointCli& cli);

}  // namespace dsync::app
