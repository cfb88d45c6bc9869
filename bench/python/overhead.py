#!/usr/bin/python3
"""The cost of the Python layer: one worker pushing and pulling the same tensors (1 M
parameters by default) every iteration, through the C++ API, the Python core and
dsyncps.torch, each a job of its own (1 server, TCP, bsp), runs interleaved, medians.

    bench/python/overhead.py BUILD_DIR [--runs 5] [--steps 60] [--sizes 600000,...]

dsyncps.torch's figure has its zero_grad and backward pass taken out (timed alone in the same process),
so the three columns compare the same transfers. Wall time per step, and the worker process's
CPU time per step (every thread: the transfers' too): on a machine whose cores the worker, the
server and autograd share, the wall figure carries their contention and the CPU figure is
what the layer itself costs. Prints a table and a RESULT {json} line.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("build")
p.add_argument("--runs", type=int, default=5)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--sizes", default="600000,300000,99000,1000")
a = p.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
dsyncps = os.path.join(a.build, "apps", "dsyncps", "dsyncps")
cpp = os.path.join(a.build, "bench", "step_worker")
env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))


def job(program):
    out = subprocess.run([dsyncps, "launch", "--workers", "1", "--servers", "1", "--timeout",
                          "300", "--optimizer", "sgd", "--"] + program, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400).stdout
    for line in out.splitlines():
        if '"ms_per_step"' in line:
            return json.loads(line[line.index("{"):])
    raise SystemExit("no result from %s:\n%s" % (program, out[-3000:]))


results = {"cpp": [], "core": [], "torch": []}
cpu = {"cpp": [], "core": [], "torch": []}
backward = []
for r in range(a.runs):  # interleaved: the machine's drift hits each alike
    for mode, program in (("cpp", [cpp, str(a.steps), a.sizes]),
                          ("core", [sys.executable, os.path.join(here, "step_worker.py"), "--mode",
                                    "core", "--steps", str(a.steps), "--sizes", a.sizes]),
                          ("torch", [sys.executable, os.path.join(here, "step_worker.py"),
                                     "--mode", "torch", "--steps", str(a.steps), "--sizes",
                                     a.sizes])):
        t = job(program)
        results[mode].append(t["ms_per_step"] - t.get("backward_ms", 0))
        cpu[mode].append(t["cpu_ms_per_step"] - t.get("backward_cpu_ms", 0))
        if mode == "torch":
            backward.append(t["backward_ms"])
med = {k: statistics.median(v) for k, v in results.items()}
cmed = {k: statistics.median(v) for k, v in cpu.items()}
params = sum(int(s) for s in a.sizes.split(","))
print("%-8s %10s %8s %10s %8s   (%d parameters, %d runs, medians per iteration)" % (
    "layer", "wall ms", "vs C++", "CPU ms", "vs C++", params, a.runs))
for k in ("cpp", "core", "torch"):
    print("%-8s %10.3f %8.3f %10.3f %8.3f   wall runs: %s" % (
        k, med[k], med[k] / med["cpp"], cmed[k], cmed[k] / cmed["cpp"],
        " ".join("%.2f" % x for x in results[k])))
print("torch: zero_grad + backward alone %.3f ms (taken out)" % statistics.median(backward))
print("RESULT " + json.dumps({"bench": "python_overhead", "parameters": params,
                              "cpp_ms": med["cpp"], "core_ms": med["core"],
                              "torch_ms": med["torch"], "core_ratio": med["core"] / med["cpp"],
                              "torch_ratio": med["torch"] / med["cpp"],
                              "cpp_cpu_ms": cmed["cpp"], "core_cpu_ms": cmed["core"],
                              "torch_cpu_ms": cmed["torch"],
                              "core_cpu_ratio": cmed["core"] / cmed["cpp"],
                              "torch_cpu_ratio": cmed["torch"] / cmed["cpp"]}))
