#!/usr/bin/python3
"""examples/pytorch/fmnist_cnn.py under dsyncps (bsp, dsync:auto) and under DDP (gloo), side
by side on this machine: balanced, and with one worker 3x slower on its compute. Runs are
interleaved (each repetition runs every cell once); the table shows medians of the time to
first reach and to stay at the target test accuracy, the final accuracy and the job time,
and the ratios to DDP. Prints a table and a RESULT {json} line; the runs' folders stay in OUT
(`dsyncps compare --runs` plots any of them).

    bench/python/cnn_vs_ddp.py BUILD_DIR [--runs 3] [--epochs 4] [--workers 4] [--out DIR]
                               [--eval-interval S] [--modes ddp,bsp,dsync:auto/inverse]
                               [--scenarios balanced,straggler]

A dsyncps mode may name a staleness policy after a slash (MODE/POLICY, as `dsyncps compare`
takes it): dsync:auto/inverse runs `--sync dsync:auto --staleness-policy inverse`.

dsyncps.init() pins glibc's heap thresholds in its workers (docs/python.md), which takes a
small CNN's steps on CPU from page-fault bound to compute bound; DDP's processes get the same
thresholds (--ddp-heap pinned, the default) so that the comparison is of synchronization.

With both scenarios run, it also prints the machine's limit for a delayed job: the fastest
balanced dsyncps job over DDP's straggler job. Where the processes outnumber the cores, the
straggler's idle core serves the others on both sides, and delay cannot beat that ratio.

Most of a run's wall time beyond training is rank 0 evaluating its model copies (one per
--eval-interval seconds, each on the 10000 test images) after training: a longer interval
makes the runs shorter and the times to the target coarser by as much.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("build")
p.add_argument("--runs", type=int, default=3)
p.add_argument("--epochs", type=float, default=4)
p.add_argument("--workers", type=int, default=4)
p.add_argument("--servers", type=int, default=2)
p.add_argument("--target", type=float, default=0.90)
p.add_argument("--out", default="cnn-vs-ddp")
p.add_argument("--eval-interval", type=float, default=1.0,
               help="seconds between the model copies rank 0 evaluates (the example's default: 1)")
p.add_argument("--modes", default="ddp,bsp,dsync:auto",
               help="ddp and dsyncps modes, MODE or MODE/POLICY; ddp is the baseline, always run")
p.add_argument("--scenarios", default="balanced,straggler")
p.add_argument("--ddp-heap", choices=("pinned", "glibc"), default="pinned",
               help="pinned: DDP's processes get the heap thresholds dsyncps.init() pins in its "
               "workers, so the comparison is of synchronization, not of the allocator; glibc: "
               "DDP as a script runs by default")
a = p.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
example = os.path.join(here, "..", "..", "examples", "pytorch", "fmnist_cnn.py")
dsyncps = os.path.join(a.build, "apps", "dsyncps", "dsyncps")
env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))
all_scenarios = {"balanced": [],
                 "straggler": ["--slow-rank", str(a.workers - 1), "--slow-factor", "3"]}
scenarios = {}
for sc in a.scenarios.split(","):
    if sc not in all_scenarios:
        p.error("unknown scenario '%s' (known: %s)" % (sc, ", ".join(all_scenarios)))
    scenarios[sc] = all_scenarios[sc]
modes = ["ddp"] + [m for m in a.modes.split(",") if m and m != "ddp"]
width = max(11, max(len(m) for m in modes))  # the mode column, in the run lines and the table


def run(mode, scenario, rep):
    folder = os.path.join(a.out, "%s-%s-%d" % (scenario, mode.replace(":", "_").replace("/", "-"),
                                                rep))
    args = ["--epochs", str(a.epochs), "--target", str(a.target), "--out", folder, "--label",
            mode, "--eval-interval", str(a.eval_interval)] + scenarios[scenario]
    if mode == "ddp":
        cmd = [sys.executable, example, "--ddp", "--nproc", str(a.workers)] + args
        if a.ddp_heap == "pinned":
            cmd = ["env"] + ["%s=%s" % kv for kv in pinned_heap_env().items()] + cmd
    else:
        # The job's budget is the gradients of the epochs (DDP's total): every worker trains
        # until it is spent, so fast workers take on what a straggler leaves.
        budget = int(a.epochs * 60000 / (64 * a.workers)) * a.workers
        sync, _, policy = mode.partition("/")
        cmd = [dsyncps, "launch", "--workers", str(a.workers), "--servers", str(a.servers),
               "--sync", sync, "--max-gradients", str(budget), "--timeout", "1500",
               # Rank 0 evaluates its copies after training, minutes for a long job: the
               # launcher's default 300 s after the scheduler's end would kill it.
               "--exit-grace", "1200"]
        if policy:
            cmd += ["--staleness-policy", policy]
        cmd += ["--", sys.executable, example] + args
    out = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=1600).stdout
    path = os.path.join(folder, "summary.json")
    if not os.path.exists(path):
        raise SystemExit("%s wrote no summary:\n%s" % (" ".join(cmd), out[-3000:]))
    with open(path) as f:
        s = json.load(f)
    print("  %-9s %-*s rep %d: reach %s s, stays %s s, final %.4f, %.1f s" % (
        scenario, width, mode, rep, fmt(s["first_reach_s"]), fmt(s["stays_from_s"]),
        s["final_accuracy"], s["seconds"]), flush=True)
    return s


def pinned_heap_env():
    """The MALLOC_*_ values dsyncps.init() pins, from the package in the build tree."""
    sys.path.insert(0, os.path.join(a.build, "python"))
    from dsyncps import _core
    return _core.PINNED_HEAP_ENV


def fmt(v):
    return "-" if v is None else "%.1f" % v


def med(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if len(vals) == len(values) and vals else None


results = {(sc, m): [] for sc in scenarios for m in modes}
for rep in range(a.runs):
    for sc in scenarios:
        for m in modes:
            results[(sc, m)].append(run(m, sc, rep))

print("\n%d workers, %g epochs, target %.0f %%, medians of %d runs" % (
    a.workers, a.epochs, 100 * a.target, a.runs))
print("%-10s %-*s %8s %8s %9s %8s %10s %10s" % ("scenario", width, "mode", "reach_s", "stays_s",
                                                  "final_acc", "time_s", "stays/ddp", "time/ddp"))
summary = {}
for sc in scenarios:
    base = results[(sc, "ddp")]
    for m in modes:
        rs = results[(sc, m)]
        reach = med([r["first_reach_s"] for r in rs])
        stays = med([r["stays_from_s"] for r in rs])
        final = statistics.median(r["final_accuracy"] for r in rs)
        secs = statistics.median(r["seconds"] for r in rs)
        bstays = med([r["stays_from_s"] for r in base])
        bsecs = statistics.median(r["seconds"] for r in base)
        ratio = stays / bstays if stays and bstays else None
        print("%-10s %-*s %8s %8s %9.4f %8.1f %10s %10.2f" % (
            sc, width, m, fmt(reach), fmt(stays), final, secs,
            "-" if ratio is None else "%.2f" % ratio, secs / bsecs))
        summary["%s/%s" % (sc, m)] = {"reach_s": reach, "stays_s": stays, "final_acc": final,
                                      "seconds": secs, "stays_vs_ddp": ratio}
# Where the processes outnumber the cores, a straggler's idle time is taken by the others on
# both sides, and a job that leaves it out of its rounds can at best run at the balanced pace:
# the fastest a delayed job can be against DDP's straggler, on this machine.
cores = os.cpu_count() or 1
limit = None
if "balanced" in scenarios and "straggler" in scenarios:
    fastest = min(statistics.median(r["seconds"] for r in results[("balanced", m)])
                  for m in modes if m != "ddp") if len(modes) > 1 else None
    if fastest:
        limit = fastest / statistics.median(r["seconds"] for r in results[("straggler", "ddp")])
print("\n%d cores for %d workers and %d servers%s" % (
    cores, a.workers, a.servers,
    "" if limit is None else "; a delayed job's best against DDP's straggler here: the fastest "
    "balanced dsyncps job / DDP's straggler job = %.2f" % limit))
if cores < a.workers + a.servers:
    print("fewer cores than processes: the straggler's idle core serves the others on both "
          "sides, so its cost to DDP and delay's gain are both smaller than on a cluster")
print("RESULT " + json.dumps({"bench": "cnn_vs_ddp", "workers": a.workers, "epochs": a.epochs,
                              "target": a.target, "runs": a.runs, "cores": cores,
                              "servers": a.servers, "delayed_limit_vs_ddp": limit,
                              "cells": summary}))
