"""Fixtures for the Python front end's tests: run jobs with `dsyncps launch`, bounded in time.

ctest runs these with DSYNCPS_BINARY (the dsyncps program), DSYNCPS_REPLAY_WORKER (the C++
worker of replay tests) and PYTHONPATH (the package in the build tree) set.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"


def binary():
    path = os.environ.get("DSYNCPS_BINARY")
    if not path or not os.path.exists(path):
        pytest.fail("DSYNCPS_BINARY must name the dsyncps program (ctest sets it)")
    return path


class Job:
    """One `dsyncps launch` run: its output, exit code and files."""

    def __init__(self, proc, out, folder):
        self.returncode = proc.returncode
        self.out = out
        self.dir = folder

    def worker_lines(self, rank=None):
        prefix = "[worker %d]" % rank if rank is not None else "[worker"
        return [l for l in self.out.splitlines() if l.startswith(prefix)]

    def audit(self):
        with open(self.dir / "audit.jsonl") as f:
            return [json.loads(l) for l in f if l.strip()]

    def rounds(self):
        return [r for r in self.audit() if "round" in r and "members" in r]


def run_command(cmd, folder, timeout, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    # Its own session, so that a job past its time is ended with everything it started.
    proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("%s did not end within %d s:\n%s" % (" ".join(cmd), timeout, out[-4000:]))
    return proc, out


@pytest.fixture
def launch(tmp_path):
    """launch(program_args, workers=1, servers=1, flags=()) -> Job, after it ended.

    program_args: a worker script under tests/python/workers (run with this interpreter) and
    its arguments, or ["exe", path, ...] for a program of its own.
    """

    def run(program_args, workers=1, servers=1, flags=(), timeout=150, expect=0, env=None):
        program_args = [str(a) for a in program_args]
        if program_args[0] == "exe":
            program = program_args[1:]
        else:
            program = [sys.executable, str(WORKERS / program_args[0])] + program_args[1:]
        cmd = [binary(), "launch", "--workers", str(workers), "--servers", str(servers),
               "--timeout", str(timeout - 20), "--audit-log", str(tmp_path / "audit.jsonl"),
               *[str(f) for f in flags], "--", *program]
        proc, out = run_command(cmd, tmp_path, timeout, env)
        job = Job(proc, out, tmp_path)
        if expect is not None:
            assert proc.returncode == expect, out[-6000:]
        if os.environ.get("DSYNCPS_TEST_VERBOSE"):
            print(out)
        return job

    return run
