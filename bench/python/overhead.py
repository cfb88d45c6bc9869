#!/usr/bin/python3
"""The cost of the Python layer: one worker pushing and pulling the same tensors (1 M
parameters by default) every iteration, each a job of its own (1 server, TCP, bsp), runs
interleaved, medians.

    bench/python/overhead.py BUILD_DIR [--runs 5] [--steps 400] [--sizes 600000,...]

Two comparisons:
- transfers: the C++ worker (step_worker.cc), the Python core (NumPy) and dsyncps.torch with
  its zero_grad and backward pass taken out (timed alone in the same process);
- whole steps, the same backward pass on both sides: dsyncps.torch (hooks and step())
  against a C++ worker that runs the backward pass through libtorch and then pushes
  (torch_step_worker.cc; built where Debian's libtorch-dev is) in the order the hooks do,
  the last registered tensor first (its row "C++ fwd": in registration order); the row "Py
  nohook" is Python's backward pass followed by the core's push_pull of each gradient, no
  hooks and no dsyncps.torch. Taking the backward pass out
  of a step measured with the transfers is not exact: on a machine whose cores the worker,
  the server and autograd share, the transfers slow the backward pass down (contention, the
  cache), and this comparison carries that alike on both sides.
Wall time per step, the worker process's CPU time per step (every thread), and its minor page
faults per step (first touches, slow on VMs: glibc's heap trimming can cause them in a
Python process). Prints tables and a RESULT {json} line.
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
p.add_argument("--steps", type=int, default=400)
p.add_argument("--sizes", default="600000,300000,99000,1000")
a = p.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
dsyncps = os.path.join(a.build, "apps", "dsyncps", "dsyncps")
cpp = os.path.join(a.build, "bench", "step_worker")
libtorch = os.path.join(a.build, "bench", "torch_step_worker")
env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))


def job(program):
    out = subprocess.run([dsyncps, "launch", "--workers", "1", "--servers", "1", "--timeout",
                          "300", "--optimizer", "sgd", "--"] + program, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400).stdout
    for line in out.splitlines():
        if '"ms_per_step"' in line:
            return json.loads(line[line.index("{"):])
    raise SystemExit("no result from %s:\n%s" % (program, out[-3000:]))


py_worker = [sys.executable, os.path.join(here, "step_worker.py"), "--steps", str(a.steps),
             "--sizes", a.sizes, "--mode"]
programs = [("cpp", [cpp, str(a.steps), a.sizes]), ("core", py_worker + ["core"]),
            ("torch", py_worker + ["torch"]), ("torch-core", py_worker + ["torch-core"])]
if os.path.exists(libtorch):
    programs.append(("libtorch", [libtorch, str(a.steps), a.sizes]))
else:
    print("no %s (install libtorch-dev and rebuild): whole steps are not compared" % libtorch)
runs = {k: [] for k, _ in programs}
for r in range(a.runs):  # interleaved: the machine's drift hits each alike
    for mode, program in programs:
        runs[mode].append(job(program))


def med(mode, f):
    return statistics.median(f(t) for t in runs[mode])


def step(t):
    return t["ms_per_step"]


def step_cpu(t):
    return t["cpu_ms_per_step"]


def beyond_backward(t):
    return t["ms_per_step"] - t.get("backward_ms", 0)


def beyond_backward_cpu(t):
    return t["cpu_ms_per_step"] - t.get("backward_cpu_ms", 0)


def faults(t):
    return t.get("faults_per_step", float("nan"))


params = sum(int(s) for s in a.sizes.split(","))
result = {"bench": "python_overhead", "parameters": params, "runs": a.runs, "steps": a.steps}
print("Transfers (%d parameters, %d runs, medians per iteration; dsyncps.torch without its "
      "backward pass)" % (params, a.runs))
print("%-9s %9s %7s %9s %7s %8s   wall runs" % ("layer", "wall ms", "/ C++", "CPU ms", "/ C++",
                                                  "faults"))
base, base_cpu = med("cpp", beyond_backward), med("cpp", beyond_backward_cpu)
for k in ("cpp", "core", "torch"):
    wall, cpu = med(k, beyond_backward), med(k, beyond_backward_cpu)
    print("%-9s %9.3f %7.3f %9.3f %7.3f %8.1f   %s" % (
        k, wall, wall / base, cpu, cpu / base_cpu, med(k, faults),
        " ".join("%.2f" % beyond_backward(t) for t in runs[k])))
    result.update({k + "_ms": wall, k + "_cpu_ms": cpu, k + "_ratio": wall / base,
                   k + "_cpu_ratio": cpu / base_cpu, k + "_faults": med(k, faults)})
print("torch: zero_grad + backward alone %.3f ms (taken out)" %
      med("torch", lambda t: t["backward_ms"]))
if "libtorch" in runs:
    print("\nWhole steps, the same backward pass (libtorch's) on both sides")
    print("%-9s %9s %7s %9s %7s %10s %8s   wall runs" % (
        "worker", "step ms", "/ C++", "CPU ms", "/ C++", "backward", "faults"))
    lt, lt_cpu = med("libtorch", step), med("libtorch", step_cpu)
    # The C++ worker pushes in backward order, as the hooks do; its registration-order row
    # shows what the order alone is worth.
    rows = (("libtorch", "C++", step, step_cpu),
            ("libtorch", "C++ fwd", lambda t: t["forward_order_ms_per_step"],
             lambda t: t["forward_order_cpu_ms_per_step"]),
            ("torch", "Python", step, step_cpu),
            ("torch-core", "Py nohook", step, step_cpu))
    for k, label, f_wall, f_cpu in rows:
        wall, cpu = med(k, f_wall), med(k, f_cpu)
        print("%-9s %9.3f %7.3f %9.3f %7.3f %10.3f %8.1f   %s" % (
            label, wall, wall / lt, cpu, cpu / lt_cpu, med(k, lambda t: t["backward_ms"]),
            med(k, faults), " ".join("%.2f" % f_wall(t) for t in runs[k])))
    # Each run measured the C++ and the Python worker minutes apart at most: the median of
    # the per-run ratios is less at the mercy of the VM's drift than the ratio of medians.
    per_run = [step(t) / step(c) for t, c in zip(runs["torch"], runs["libtorch"])]
    paired = statistics.median(per_run)
    print("Python / C++ per run: %s; median %.3f" % (" ".join("%.2f" % r for r in per_run),
                                                     paired))
    result["step_ratio_paired"] = paired
    # What the layer adds beyond the backward pass, against what the C++ worker adds beyond
    # the same backward pass: each side's own backward taken out (Python's autograd front
    # end is slower than libtorch's with or without dsyncps). It leans on the backward pass
    # timed alone: page faults that inflate Python's (glibc's heap trimming) shrink it.
    added = med("torch", beyond_backward) - med("libtorch", beyond_backward)
    print("dsyncps.torch adds %.3f ms per step beyond the C++ worker's transfers "
          "(%.1f %% of its whole step)" % (added, 100 * added / lt))
    result.update({"libtorch_step_ms": lt, "torch_step_ms": med("torch", step),
                   "torch_core_step_ms": med("torch-core", step),
                   "libtorch_forward_order_step_ms":
                       med("libtorch", lambda t: t["forward_order_ms_per_step"]),
                   "step_ratio": med("torch", step) / lt,
                   "step_cpu_ratio": med("torch", step_cpu) / lt_cpu,
                   "libtorch_backward_ms": med("libtorch", lambda t: t["backward_ms"]),
                   "torch_backward_ms": med("torch", lambda t: t["backward_ms"]),
                   "layer_added_ms": added, "layer_added_fraction": added / lt,
                   "libtorch_faults": med("libtorch", faults)})
print("RESULT " + json.dumps(result))
