"""Checkpoints from the user's side: a job of Python workers writes them, a resumed job goes on
from the newest, and `dsyncps checkpoint export` gives the model to torch.load and numpy.load
under the parameters' own names and shapes."""
import subprocess

import numpy as np
import pytest
import torch

from conftest import binary


def export(folder, ckpt, fmt, out):
    p = subprocess.run([binary(), "checkpoint", "export", str(ckpt), "--format", fmt, "--out",
                        str(folder / out)], cwd=folder, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=120)
    assert p.returncode == 0, p.stdout
    return p.stdout


def test_a_resumed_job_continues_from_the_checkpoint_and_export_reads_it(launch, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--sync", "bsp", "--optimizer", "sum", "--slice-bytes", "64",
             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    first = launch(["checkpoint_worker.py", "5"], workers=2, servers=2, flags=flags)
    assert "checkpoint of version 5 complete" in first.out, first.out[-3000:]
    out = export(tmp_path, ckpt, "torch", "model.pt")
    assert "of version 5" in out
    sd = torch.load(tmp_path / "model.pt")
    assert set(sd) == {"weight", "bias"}
    assert tuple(sd["weight"].shape) == (3, 7) and tuple(sd["bias"].shape) == (3,)
    # Every worker pushes ones: with `sum` each element is 0.5 + the gradients applied.
    assert torch.all(sd["weight"] == 0.5 + 10)
    npz = np.load(tmp_path / export_npz(tmp_path, ckpt))
    assert np.array_equal(npz["weight"], sd["weight"].numpy())

    second = launch(["checkpoint_worker.py", "3"], workers=2, servers=2,
                    flags=["--sync", "bsp", "--optimizer", "sum", "--slice-bytes", "64",
                           "--resume", str(ckpt), "--checkpoint-dir", str(ckpt)])
    assert "resuming from" in second.out
    # The workers' clocks went on from the checkpoint's.
    assert "start clock 5" in second.out, second.out[-3000:]
    export(tmp_path, ckpt, "torch", "model2.pt")
    sd2 = torch.load(tmp_path / "model2.pt")
    assert torch.all(sd2["weight"] == 0.5 + 10 + 6)


def export_npz(folder, ckpt):
    export(folder, ckpt, "npz", "model.npz")
    return "model.npz"


def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    p = subprocess.run([binary(), "checkpoint", "export", str(tmp_path)], text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert p.returncode == 1
    assert "holds no checkpoint" in p.stdout
