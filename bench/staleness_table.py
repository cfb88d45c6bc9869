#!/usr/bin/python3
"""The staleness sweep's table: medians per cell (learning rate, added compute, scenario) and
mode of bench/staleness_sweep.sh's runs.jsonl, with each mode's "stays >= target" against
the baseline's (bsp, or ddp for bench/ddp_compare.sh) in the same cell. A run that never
stays above the target counts as infinitely late.

    /usr/bin/python3 bench/staleness_table.py [--baseline LABEL] [--markdown] runs.jsonl...

Several files (batches of the sweep) are read as one. --markdown prints the table as
docs/benchmarks.md shows it instead of the plain one and the @staleness lines. Each run is
listed with its rounds and, for dsync:auto where the run's log lies beside runs.jsonl, its
trials and how many were kept: "15.2 (2671) [1/1]".
"""
import argparse
import functools
import json
import math
import os
import re
import statistics
from collections import defaultdict


def median(values):
    finite = [v for v in values if v is not None]
    if len(finite) * 2 <= len(values):  # most runs never got there: the median is "never"
        return None
    return statistics.median([math.inf if v is None else v for v in values])


def text(v, fmt="{:.1f}"):
    return "never" if v is None or v == math.inf else fmt.format(v)


@functools.lru_cache(maxsize=None)
def log_trials(log):
    """Per mode label of a run's log: [trials started, delays kept]; None without the log."""
    # A decision line repeats its phase's reason while the allowances change within the
    # phase: a trial or a kept delay is counted where its lines begin.
    counts, label, phase = {}, None, None
    try:
        with open(log) as f:
            for line in f:
                m = re.match(r"=== dsyncps compare: (.*) \(\d+/\d+\) ===", line)
                if m:
                    label, phase = m.group(1), None
                    counts[label] = [0, 0]
                elif label and "dsync:auto from round" in line:
                    now = ("trial" if "trying it for" in line
                           else "kept" if "it pays" in line else None)
                    if now and now != phase:
                        counts[label][0 if now == "trial" else 1] += 1
                    phase = now
    except OSError:
        return None
    return counts


def trials(runs_path, r):
    """dsync:auto's trials in this run and how many were kept ("3/1"), from the run's log
    beside runs.jsonl (bench/staleness_sweep.sh writes it); None without one."""
    counts = log_trials(os.path.join(
        os.path.dirname(runs_path),
        f"lr{r['lr']:g}-c{r['compute_ms']:g}-{r['cell_scenario']}-run{r['run']}.log"))
    if counts is None or not r["sync"].startswith("dsync:auto"):
        return None
    tried, kept = counts.get(r["label"], (0, 0))
    return f"{tried}/{kept}"


def seconds(v):
    return text(v) if v in (None, math.inf) else text(v) + " s"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", default="bsp", help="the label each cell's modes are set against")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("runs", nargs="+")
    a = p.parse_args()
    base_label = a.baseline
    cells = defaultdict(lambda: defaultdict(list))
    machine = []
    for path in a.runs:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                r["trials"] = trials(path, r)
                cell = (r["lr"], r["compute_ms"], r["cell_scenario"])
                cells[cell][r["label"]].append(r)
    if a.markdown:
        print("| lr | ms | scenario | mode | stays ≥ target, each run (rounds) | median | ÷ "
              f"{base_label} | first reach | final acc | rounds |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print(f"{'lr':>5} {'ms':>3} {'scenario':<10} {'mode':<26} {'runs':>4} {'reach_s':>8} "
              f"{'stays_s':>8} {'stays/' + base_label:>9} {'final_acc':>9} {'rounds':>7}  "
              "stays (rounds), each run")
    for (lr, compute, scenario), modes in sorted(cells.items()):
        base = (median([r["stays_from_s"] for r in modes[base_label]])
                if base_label in modes else None)
        for label, rs in modes.items():
            stays = median([r["stays_from_s"] for r in rs])
            ratio = (stays / base if stays not in (None, math.inf) and base not in (None, math.inf)
                     else None)
            row = {
                "lr": lr, "compute_ms": compute, "scenario": scenario, "mode": label,
                "runs": len(rs),
                "reach_s": median([r["first_reach_s"] for r in rs]),
                "stays_s": stays,
                "stays_over_" + base_label: ratio,
                "final_accuracy": statistics.median(r["final_accuracy"] for r in rs),
                "rounds": median([r.get("final_version") for r in rs]),
            }
            # Each run with its rounds and, for dsync:auto with its log beside runs.jsonl, its
            # trials and delays kept ("[1/1]"): a dsync:auto run that closed bsp's rounds
            # delayed nobody; under churn the rounds vary with when the worker died.
            each = ", ".join(f"{text(r['stays_from_s'])} ({r.get('final_version', '?')})"
                             + (f" [{r['trials']}]" if r.get("trials") else "")
                             for r in rs)
            rounds = "-" if row["rounds"] is None else format(row["rounds"], "g")
            if a.markdown:
                print(f"| {lr:g} | {compute:g} | {scenario} | {label} | {each} | "
                      f"{seconds(stays)} | {text(ratio, '{:.2f}')} | {seconds(row['reach_s'])} | "
                      f"{100 * row['final_accuracy']:.2f} % | {rounds} |")
                continue
            print(f"{lr:>5g} {compute:>3g} {scenario:<10} {label:<26} {len(rs):>4} "
                  f"{text(row['reach_s']):>8} {text(stays):>8} {text(ratio, '{:.2f}'):>9} "
                  f"{100 * row['final_accuracy']:>8.2f}% {rounds:>7}  {each}")
            machine.append("@staleness " + json.dumps(
                {k: (None if v == math.inf else v) for k, v in row.items()}))
    if machine:
        print("\n".join(machine))


if __name__ == "__main__":
    main()
