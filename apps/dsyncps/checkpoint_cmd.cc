#include "checkpoint_cmd.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <map>

#include "npz_writer.h"
#include "ps/checkpoint.h"

extern char** environ;

namespace dsync::app {
namespace {

namespace fs = std::filesystem;

struct Assembled {
  std::string name;
  std::vector<uint64_t> shape;
  std::vector<float> values;
  uint64_t filled = 0;  // elements placed so far
};

// The checkpoint: DIR itself when it holds a manifest, else the newest sound one under it.
Result<ps::FoundCheckpoint> Locate(const std::string& dir) {
  std::error_code ec;
  const fs::path p(dir);
  std::vector<ps::SkippedCheckpoint> skipped;
  if (fs::exists(p / "MANIFEST.json", ec)) {
    // One checkpoint named directly: checked the same way, as the only candidate.
    auto found = ps::FindNewestCheckpoint(p.parent_path().string(), &skipped);
    if (found.ok() && fs::equivalent(found->path, p, ec)) return found;
    for (const ps::SkippedCheckpoint& s : skipped) {
      if (fs::equivalent(s.path, p, ec)) return Error(StatusCode::kDataLoss, "{}", s.why);
    }
    if (!found.ok()) return found.status();
    return Error(StatusCode::kInvalidArgument,
                 "'{}' is not the newest sound checkpoint of its directory ('{}' is); pass the "
                 "directory to export the newest",
                 dir, found->path);
  }
  auto found = ps::FindNewestCheckpoint(dir, &skipped);
  for (const ps::SkippedCheckpoint& s : skipped) {
    std::fprintf(stderr, "dsyncps: warning: refused a checkpoint: %s\n", s.why.c_str());
  }
  return found;
}

// Every tensor whole, from every server's slices, in tensor-id order.
Result<std::vector<Assembled>> Assemble(const ps::FoundCheckpoint& found) {
  std::map<TensorId, Assembled> tensors;
  for (const ps::CheckpointFile& f : found.manifest.files) {
    const std::string path = (fs::path(found.path) / f.name).string();
    DSYNC_ASSIGN_OR_RETURN(ps::ServerCheckpoint c, ps::ReadServerCheckpoint(path, f.crc32));
    for (ps::CheckpointSlice& s : c.slices) {
      Assembled& t = tensors[s.tensor];
      if (t.values.empty()) {
        t.name = s.meta.name;
        t.shape = s.meta.shape.empty() ? std::vector<uint64_t>{s.meta.tensor_elements}
                                       : s.meta.shape;
        t.values.assign(s.meta.tensor_elements, 0.0f);
      }
      const uint64_t n = s.snapshot.params.size();
      if (t.name != s.meta.name || t.values.size() != s.meta.tensor_elements ||
          s.meta.slice_offset > t.values.size() || n > t.values.size() - s.meta.slice_offset) {
        return Error(StatusCode::kDataLoss, "'{}': tensor {} slice {} does not fit the tensor "
                                            "'{}' of {} elements",
                     path, s.tensor, s.slice, t.name, t.values.size());
      }
      std::copy(s.snapshot.params.begin(), s.snapshot.params.end(),
                t.values.begin() + static_cast<std::ptrdiff_t>(s.meta.slice_offset));
      t.filled += n;
    }
  }
  std::vector<Assembled> out;
  for (auto& [id, t] : tensors) {
    if (t.filled != t.values.size()) {
      return Error(StatusCode::kDataLoss, "checkpoint {}: tensor '{}' has {} of its {} elements",
                   found.path, t.name, t.filled, t.values.size());
    }
    out.push_back(std::move(t));
  }
  return out;
}

// Runs `python -c script args...`; its exit status, or -1 when it cannot run. `quiet` sends
// its stderr to /dev/null.
int RunPython(const char* python, const char* script, std::vector<std::string> args, bool quiet) {
  args.insert(args.begin(), {python, "-c", script});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (quiet) posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, python, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The first python3 (on PATH, then Debian's, which sees python3-torch) that imports torch.
const char* PythonWithTorch() {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    if (RunPython(python, "import numpy, torch", {}, /*quiet=*/true) == 0) return python;
  }
  return nullptr;
}

}  // namespace

CLI::App* AddCheckpointCommand(CLI::App& app, CheckpointCli& cli) {
  auto* ckpt = app.add_subcommand("checkpoint", "work with the checkpoints a job wrote "
                                                "(--checkpoint-dir)");
  ckpt->require_subcommand(1);
  auto* exp = ckpt->add_subcommand(
      "export", "write a checkpoint's model as a PyTorch state dict (torch.load) or a NumPy "
                ".npz (numpy.load), one array per tensor under its registered name");
  exp->add_option("dir", cli.dir,
                  "a checkpoint (ckpt-VERSION) or a directory of them (the newest sound one)")
      ->required();
  cli.format = "torch";
  exp->add_option("--format", cli.format,
                  "torch (where python3 imports torch; else .npz, said so) | npz")
      ->check(CLI::IsMember({"torch", "npz"}))
      ->capture_default_str();
  exp->add_option("--out", cli.out, "the file to write (default model.pt or model.npz)");
  return exp;
}

int RunCheckpointExport(const CheckpointCli& cli) {
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "dsyncps: error: %s\n", st.ToString().c_str());
    return 1;
  };
  auto found = Locate(cli.dir);
  if (!found.ok()) return fail(found.status());
  auto tensors = Assemble(*found);
  if (!tensors.ok()) return fail(tensors.status());
  std::vector<NpzArray> arrays;
  uint64_t elements = 0;
  for (const Assembled& t : *tensors) {
    arrays.push_back({t.name, t.shape, t.values});
    elements += t.values.size();
  }
  const bool torch = cli.format == "torch";
  std::string out = cli.out.empty() ? (torch ? "model.pt" : "model.npz") : cli.out;
  const std::string npz = torch ? out + ".npz.tmp" : out;
  if (Status st = WriteNpz(npz, arrays); !st.ok()) return fail(st);
  if (torch) {
    static const char* kToTorch =
        "import sys\n"
        "import numpy, torch\n"
        "d = numpy.load(sys.argv[1])\n"
        "torch.save({k: torch.from_numpy(d[k].copy()) for k in d.files}, sys.argv[2])\n";
    const char* python = PythonWithTorch();
    std::error_code ec;
    if (!python) {
      const std::string fallback = fs::path(out).replace_extension(".npz").string();
      fs::rename(npz, fallback, ec);
      if (ec) {
        return fail(Error(StatusCode::kUnavailable, "cannot write '{}': {}", fallback,
                          ec.message()));
      }
      std::fprintf(stderr, "dsyncps: no python3 here imports torch (install python3-torch); "
                           "wrote NumPy arrays instead: %s (numpy.load)\n", fallback.c_str());
      out = fallback;
    } else {
      const int rc = RunPython(python, kToTorch, {npz, out}, /*quiet=*/false);
      fs::remove(npz, ec);
      if (rc != 0) {
        return fail(Error(StatusCode::kUnavailable,
                          "{} could not write the state dict '{}' (exit status {}; its error "
                          "above)", python, out, rc));
      }
    }
  }
  std::printf("dsyncps: wrote %zu tensor(s), %llu parameters, of version %llu (%s) to %s\n",
              arrays.size(), static_cast<unsigned long long>(elements),
              static_cast<unsigned long long>(found->manifest.version), found->path.c_str(),
              out.c_str());
  return 0;
}

}  // namespace dsync::app
