#!/bin/bash
# The staleness sweep: time to first reach and to stay >= 85 % test accuracy, final accuracy
# and rounds of the main job (Fashion-MNIST MLP, 4 workers, 2 servers, momentum SGD, 10
# epochs) per sync mode and staleness policy, over learning rates x added compute x
# scenarios, several runs each; prints the medians per cell and mode.
#
#   bench/staleness_sweep.sh [BUILD_DIR] [OUT_DIR]
#
# Environment (defaults: the whole sweep, which takes hours on a 2-core machine):
#   LRS="0.01 0.02 0.1"  COMPUTE="0 5"  SCENARIOS="balanced straggler churn"  RUNS=3
#   MODES="bsp,dsync:4,3,dsync:4,3/inverse,dsync:4,3/exp:0.5,dsync:auto,dsync:auto/inverse,dsync:auto/exp:0.5"
# Scenarios: balanced; straggler (worker 3 three times slower); churn (worker 2 killed at
# round 780 and a fifth worker joining at round 1170: a third and a half of bsp's 2345).
# Runs of one cell are interleaved (run 1 of every mode, then run 2, ...), so that a slow
# spell of the machine does not land on one mode only. Run k uses --seed k+SEED0 (model
# initialization and data order; SEED0=0 by default) for every mode: with one seed, bsp is
# the same trajectory in every run (each round sums one gradient of each worker, in worker
# order), and its runs would differ only in when the evaluations land, while a mode that
# perturbs the order draws a new trajectory each run; the medians would then compare one
# trajectory of bsp, lucky or not, with a spread of the others. A second batch into the same
# OUT_DIR needs SEED0=<the first batch's RUNS> (and overwrites its per-run directories).
# Every job's @train line goes to OUT_DIR/runs.jsonl, each run's whole output (dsync:auto's
# decisions and their reasons among it) to OUT_DIR/CELL.log; the table is computed from
# runs.jsonl and can be recomputed, over several batches at once, with
#   /usr/bin/python3 bench/staleness_table.py [--markdown] OUT_DIR/runs.jsonl [MORE.jsonl...]
set -euo pipefail
build=${1:-build}
out=${2:-staleness-out}
bin="$build/apps/dsyncps/dsyncps"
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$bin" ] || { echo "no $bin: build first (scripts/build.sh)" >&2; exit 1; }
lrs=${LRS:-0.01 0.02 0.1}
computes=${COMPUTE:-0 5}
scenarios=${SCENARIOS:-balanced straggler churn}
runs=${RUNS:-3}
modes=${MODES:-bsp,dsync:4,3,dsync:4,3/inverse,dsync:4,3/exp:0.5,dsync:auto,dsync:auto/inverse,dsync:auto/exp:0.5}
mkdir -p "$out"

for lr in $lrs; do
  for compute in $computes; do
    for scenario in $scenarios; do
      case $scenario in
        balanced) sargs=(--workers 4) ;;
        straggler) sargs=(--workers 4 --straggler 3=3) ;;
        churn) sargs=(--workers 5 --kill 2=780 --join 4=1170) ;;
        *) echo "unknown scenario '$scenario' (balanced, straggler, churn)" >&2; exit 2 ;;
      esac
      for run in $(seq 1 "$runs"); do
        seed=$((run + ${SEED0:-0}))
        [ "$seed" -ge 0 ] || { echo "SEED0=${SEED0:-0} gives seed $seed: seeds are >= 0" >&2; exit 2; }
        cell="lr$lr-c$compute-$scenario-run$run"
        echo "== $cell: $modes" >&2
        "$bin" compare --modes "$modes" --servers 2 --epochs 10 --batch 64 --eval-interval 0.5 \
          --lr "$lr" --compute-ms "$compute" --seed "$seed" "${sargs[@]}" \
          --out "$out/$cell" \
          | tee "$out/$cell.log" | grep '^@train ' | sed 's/^@train //' \
          | /usr/bin/python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    r.update({"lr": float(sys.argv[1]), "compute_ms": float(sys.argv[2]),
              "cell_scenario": sys.argv[3], "run": int(sys.argv[4]), "seed": int(sys.argv[5])})
    print(json.dumps(r))' "$lr" "$compute" "$scenario" "$run" "$seed" \
          >> "$out/runs.jsonl"
      done
    done
  done
done
/usr/bin/python3 "$here/staleness_table.py" "$out/runs.jsonl"
