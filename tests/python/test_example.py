"""examples/pytorch/fmnist_cnn.py, the script users copy: under dsyncps launch and under DDP."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import binary, run_command

pytest.importorskip("torch", reason="this interpreter has no PyTorch: install python3-torch")
pytest.importorskip("torchvision", reason="this interpreter has no torchvision: install "
                    "python3-torchvision")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "fmnist_cnn.py"
DATA = "/usr/share/datasets/fashion-mnist"
if not os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz")):
    pytest.skip("no Fashion-MNIST: install dataset-fashion-mnist", allow_module_level=True)


def summary(out):
    lines = [l for l in out.splitlines() if "@train " in l]
    assert lines, out[-3000:]
    return json.loads(lines[-1].split("@train ", 1)[1])


def test_the_example_changes_at_most_five_lines_for_dsyncps():
    code = [l for l in EXAMPLE.read_text().splitlines()
            if not l.lstrip().startswith("#") and re.search(r"\bdps\b|dsyncps\.torch", l)]
    assert len(code) <= 5, code


def test_the_example_trains_under_dsyncps_launch_and_compare_reads_it(launch, tmp_path):
    job = launch(["exe", sys.executable, EXAMPLE, "--epochs", "0.2", "--eval-interval", "0.5",
                  "--cache", tmp_path / "cache", "--out", tmp_path / "run", "--target", "0.6"],
                 workers=2, flags=["--sync", "dsync:auto"], timeout=240)
    s = summary(job.out)
    assert s["sync"] == "dsync:auto" and s["workers"] == 2 and s["ok"], s
    assert s["final_accuracy"] > 0.6, s
    assert s["first_reach_s"] is not None, s
    csv = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert csv[0] == "seconds,round,gradients,accuracy,test_loss,train_loss"
    assert len(csv) >= 3, csv
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["curve"]
    proc, out = run_command([binary(), "compare", "--runs", str(tmp_path / "run"), "--out",
                             str(tmp_path / "cmp")], tmp_path, 60)
    assert proc.returncode == 0, out
    assert (tmp_path / "cmp" / "compare.csv").exists(), out
    assert "dsync:auto" in out, out


def test_the_same_script_runs_under_ddp(tmp_path):
    proc, out = run_command([sys.executable, str(EXAMPLE), "--ddp", "--nproc", "2", "--epochs",
                             "0.05", "--cache", str(tmp_path / "cache")], tmp_path, 240)
    assert proc.returncode == 0, out[-3000:]
    s = summary(out)
    assert s["sync"] == "ddp" and s["workers"] == 2, s
    assert s["final_accuracy"] > 0.5, s
