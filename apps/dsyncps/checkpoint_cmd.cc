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
};

// The checkpoint: DIR itself when it holds a manifest (any sound one, not only the newest),
// else the newest sound one under it.
Result<ps::FoundCheckpoint> Locate(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::absolute(dir, ec).lexically_normal();
  if (ec) return Error(StatusCode::kInvalidArgument, "'{}': {}", dir, ec.message());
  if (p.filename().empty()) p = p.parent_path();  // "ckpt-5/" as tab completion gives it
  if (fs::exists(p / "MANIFEST.json", ec)) {
    DSYNC_ASSIGN_OR_RETURN(ps::CheckpointManifest m, ps::ReadCheckpoint(p.string()));
    return ps::FoundCheckpoint{p.string(), std::move(m)};
  }
  std::vector<ps::SkippedCheckpoint> skipped;
  auto found = ps::FindNewestCheckpoint(p.string(), &skipped);
  for (const ps::SkippedCheckpoint& s : skipped) {
    std::fprintf(stderr, "dsyncps: warning: refused a checkpoint: %s\n", s.why.c_str());
  }
  return found;
}

// Every tensor whole, from every server's slices, in tensor-id order. The slices must tile
// each tensor exactly (no gap, no overlap, one name per tensor) before anything the size of
// a tensor is allocated: a damaged file cannot make it allocate what it claims.
Result<std::vector<Assembled>> Assemble(const ps::FoundCheckpoint& found) {
  std::vector<ps::ServerCheckpoint> files;
  for (const ps::CheckpointFile& f : found.manifest.files) {
    const std::string path = (fs::path(found.path) / f.name).string();
    DSYNC_ASSIGN_OR_RETURN(ps::ServerCheckpoint c, ps::ReadServerCheckpoint(path, f.crc32));
    files.push_back(std::move(c));
  }
  std::map<TensorId, std::vector<const ps::CheckpointSlice*>> slices;
  for (const ps::ServerCheckpoint& c : files) {
    for (const ps::CheckpointSlice& s : c.slices) slices[s.tensor].push_back(&s);
  }
  std::map<std::string, TensorId> names;
  const uint32_t copies = found.manifest.replicas;
  for (auto& [id, list] : slices) {
    std::sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
      return std::pair(a->meta.slice_offset, a->replica) <
             std::pair(b->meta.slice_offset, b->replica);
    });
    // Each slice is there once per copy (Config::replicas) kept by a rank that wrote a file,
    // and every copy applied the same rounds: they must be bit-identical (values, optimizer
    // state, step count, versions kept for delay compensation). One is kept.
    std::vector<const ps::CheckpointSlice*> unique;
    for (size_t i = 0; i < list.size();) {
      const ps::CheckpointSlice* a = list[i];
      size_t j = i;
      for (; j < list.size() && list[j]->slice == a->slice; ++j) {
        const ps::CheckpointSlice* b = list[j];
        if (b->replica >= copies || (j > i && b->replica == list[j - 1]->replica)) {
          return Error(StatusCode::kDataLoss,
                       "checkpoint {}: tensor {} ('{}') slice {} has copy {} twice or beyond "
                       "the job's {} cop{}",
                       found.path, id, a->meta.name, a->slice, b->replica, copies,
                       copies == 1 ? "y" : "ies");
        }
        if (b->snapshot.params != a->snapshot.params || b->snapshot.state != a->snapshot.state ||
            b->snapshot.steps != a->snapshot.steps || b->snapshot.kept != a->snapshot.kept ||
            b->snapshot.mean_square != a->snapshot.mean_square || b->meta.name != a->meta.name ||
            b->meta.tensor_elements != a->meta.tensor_elements ||
            b->meta.optimizer != a->meta.optimizer || b->meta.shape != a->meta.shape) {
          return Error(StatusCode::kDataLoss,
                       "checkpoint {}: the copies of tensor {} ('{}') slice {} differ (copy {} "
                       "is not the first): every copy applies the same rounds, so one of them "
                       "is damaged",
                       found.path, id, a->meta.name, a->slice, b->replica);
        }
      }
      unique.push_back(a);
      i = j;
    }
    list = std::move(unique);
    const ps::InitMeta& first = list.front()->meta;
    uint64_t end = 0;
    bool gap = false;  // a partial checkpoint lacks the slices of the servers that were lost
    for (const ps::CheckpointSlice* s : list) {
      if (found.manifest.partial && s->meta.name == first.name &&
          s->meta.tensor_elements == first.tensor_elements && s->meta.slice_offset > end) {
        gap = true;
        end = s->meta.slice_offset;
      }
      if (s->meta.name != first.name || s->meta.tensor_elements != first.tensor_elements ||
          s->meta.slice_offset != end) {
        return Error(StatusCode::kDataLoss,
                     "checkpoint {}: tensor {} ('{}') is not cut into slices that follow each "
                     "other (slice {} at element {}, expected {})",
                     found.path, id, first.name, s->slice, s->meta.slice_offset, end);
      }
      end += s->snapshot.params.size();
    }
    if (found.manifest.partial && (gap || end < first.tensor_elements)) {
      std::fprintf(stderr,
                   "dsyncps: tensor '%s' is not whole in this partial checkpoint (slices of a "
                   "lost server); left out\n",
                   first.name.c_str());
      list.clear();
      continue;
    }
    if (end != first.tensor_elements) {
      return Error(StatusCode::kDataLoss, "checkpoint {}: tensor '{}' has {} of its {} elements",
                   found.path, first.name, end, first.tensor_elements);
    }
    if (!names.emplace(first.name, id).second) {
      return Error(StatusCode::kDataLoss, "checkpoint {}: tensors {} and {} are both named '{}'",
                   found.path, names[first.name], id, first.name);
    }
  }
  if (found.manifest.partial) {
    std::fprintf(stderr,
                 "dsyncps: %s is partial (server rank(s) lost: their slices are not in it); only "
                 "the tensors whole in it are written\n",
                 found.path.c_str());
  }
  if (found.manifest.partial && !slices.empty()) {
    for (TensorId id = 0; id < slices.rbegin()->first; ++id) {
      if (!slices.contains(id)) {
        std::fprintf(stderr,
                     "dsyncps: tensor %u has no slice in this partial checkpoint (all were on "
                     "the lost server); left out\n",
                     id);
      }
    }
  }
  std::vector<Assembled> out;
  for (const auto& [id, list] : slices) {
    if (list.empty()) continue;  // not whole in a partial checkpoint
    const ps::InitMeta& meta = list.front()->meta;
    Assembled t;
    t.name = meta.name;
    t.shape = meta.shape.empty() ? std::vector<uint64_t>{meta.tensor_elements} : meta.shape;
    t.values.reserve(meta.tensor_elements);  // the sum of slices that exist: bounded by the files
    for (const ps::CheckpointSlice* s : list) {
      t.values.insert(t.values.end(), s->snapshot.params.begin(), s->snapshot.params.end());
    }
    out.push_back(std::move(t));
  }
  if (out.empty() && found.manifest.partial) {
    return Error(StatusCode::kDataLoss,
                 "checkpoint {} is partial and holds no tensor whole: every tensor had slices "
                 "on the lost server(s)",
                 found.path);
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
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
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

namespace {

int ExportOrFail(const CheckpointCli& cli) {
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
      // Into a temporary name first: a failed or killed conversion leaves no partial file.
      const std::string partial = out + ".tmp";
      const int rc = RunPython(python, kToTorch, {npz, partial}, /*quiet=*/false);
      fs::remove(npz, ec);
      if (rc == 0) fs::rename(partial, out, ec);
      if (rc != 0 || ec) {
        fs::remove(partial, ec);
        return fail(Error(StatusCode::kUnavailable,
                          "{} could not write the state dict '{}' ({}; its error above)", python,
                          out, rc > 128 ? fmt::format("killed by signal {}", rc - 128)
                                        : fmt::format("exit status {}", rc)));
      }
    }
  }
  std::printf("dsyncps: wrote %zu tensor(s), %llu parameters, of version %llu (%s) to %s\n",
              arrays.size(), static_cast<unsigned long long>(elements),
              static_cast<unsigned long long>(found->manifest.version), found->path.c_str(),
              out.c_str());
  return 0;
}

}  // namespace

int RunCheckpointExport(const CheckpointCli& cli) {
  try {
    return ExportOrFail(cli);
  } catch (const std::bad_alloc&) {  // a model larger than this machine's memory
    std::fprintf(stderr, "dsyncps: error: not enough memory to export '%s'\n", cli.dir.c_str());
    return 1;
  }
}

}  // namespace dsync::app
