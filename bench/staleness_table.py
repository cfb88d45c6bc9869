#!/usr/bin/python3
"""The staleness sweep's table: medians per cell (learning rate, added compute, scenario) and
mode of bench/staleness_sweep.sh's runs.jsonl, with each mode's "stays >= target" against
the baseline's (bsp, or ddp for bench/ddp_compare.sh) in the same cell. A run that never
stays above the target counts as infinitely late.

    /usr/bin/python3 bench/staleness_table.py [--baseline LABEL] runs.jsonl
"""
import argparse
import json
import math
import statistics
from collections import defaultdict


def median(values):
    finite = [v for v in values if v is not None]
    if len(finite) * 2 <= len(values):  # most runs never got there: the median is "never"
        return None
    return statistics.median([math.inf if v is None else v for v in values])


def text(v, fmt="{:.1f}"):
    return "never" if v is None or v == math.inf else fmt.format(v)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", default="bsp", help="the label each cell's modes are set against")
    p.add_argument("runs")
    a = p.parse_args()
    base_label = a.baseline
    cells = defaultdict(lambda: defaultdict(list))
    machine = []
    with open(a.runs) as f:
        for line in f:
            r = json.loads(line)
            cell = (r["lr"], r["compute_ms"], r["cell_scenario"])
            cells[cell][r["label"]].append(r)
    print(f"{'lr':>5} {'ms':>3} {'scenario':<10} {'mode':<20} {'runs':>4} {'reach_s':>8} "
          f"{'stays_s':>8} {'stays/' + base_label:>9} {'final_acc':>9} {'rounds':>7}  stays (each run)")
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
            each = ", ".join(text(r["stays_from_s"]) for r in rs)
            print(f"{lr:>5g} {compute:>3g} {scenario:<10} {label:<20} {len(rs):>4} "
                  f"{text(row['reach_s']):>8} {text(stays):>8} {text(ratio, '{:.2f}'):>9} "
                  f"{100 * row['final_accuracy']:>8.2f}% {'-' if row['rounds'] is None else format(row['rounds'], 'g'):>7}  {each}")
            machine.append("@staleness " + json.dumps(
                {k: (None if v == math.inf else v) for k, v in row.items()}))
    print("\n".join(machine))


if __name__ == "__main__":
    main()
