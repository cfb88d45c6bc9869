#!/bin/bash
# dsyncps against what users run instead: PyTorch DDP (gloo) training the same MLP with the
# same per-worker batch (64), momentum SGD, budget and straggler model on 4 processes of this
# machine, balanced and with rank/worker 3 three times slower. Runs interleaved (each
# repetition runs every cell once); the table gives medians of the time to first reach and
# to stay at 85 % test accuracy, final accuracy, and each mode's "stays" against DDP's.
#
#   RUNS=3 STRAGGLER_MODES="bsp dsync:auto dsync:auto/inverse" bench/ddp_compare.sh [BUILD_DIR] [OUT_DIR]
#
# A mode may name a staleness policy after a slash (dsync:auto/inverse). Both sides count
# seconds from their launch and take model snapshots every 0.5 s that are evaluated after
# training; both slow the straggler alike: its added --compute-ms is 3x as long, and its
# gradient computation itself is not stretched (dsyncps's trainer does the same). Installs
# Debian's python3-torch and libopenblas0 if missing (without OpenBLAS torch runs on the
# reference BLAS, ~15x slower). The runs stay in OUT_DIR/runs.jsonl; the table can be recomputed with
#   /usr/bin/python3 bench/staleness_table.py --baseline ddp OUT_DIR/runs.jsonl
set -euo pipefail
build=${1:-build-rel}
out=${2:-ddp-out}
runs=${RUNS:-3}
read -r -a straggler_modes <<< "${STRAGGLER_MODES:-bsp dsync:auto dsync:auto/inverse}"
read -r -a balanced_modes <<< "${BALANCED_MODES:-bsp}"
bin="$build/apps/dsyncps/dsyncps"
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$bin" ] || { echo "no $bin: build first (scripts/build.sh $build Release)" >&2; exit 1; }
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null || ! dpkg -s libopenblas0 >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-torch libopenblas0 >/dev/null
fi
mkdir -p "$out"
: > "$out/runs.jsonl"
lr=0.02
compute=5
common=(--workers 4 --epochs 10 --compute-ms "$compute" --batch 64 --eval-interval 0.5)

# record LABEL SCENARIO RUN < one run's summary JSON: appends it to runs.jsonl with its cell.
record() {
  /usr/bin/python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
r.update({"label": sys.argv[1], "lr": float(sys.argv[2]), "compute_ms": float(sys.argv[3]),
          "cell_scenario": sys.argv[4], "run": int(sys.argv[5])})
print(json.dumps(r))' "$1" "$lr" "$compute" "$2" "$3" >> "$out/runs.jsonl"
}

for run in $(seq 1 "$runs"); do
  for scenario in balanced straggler; do
    if [ "$scenario" = straggler ]; then
      dargs=(--straggler 3=3); pargs=(--straggler 3 --straggler-factor 3); modes=("${straggler_modes[@]}")
    else
      dargs=(); pargs=(); modes=("${balanced_modes[@]}")
    fi
    /usr/bin/python3 "$here/ddp_mlp.py" "${common[@]}" --lr "$lr" "${pargs[@]}" \
      | record ddp "$scenario" "$run"
    for mode in "${modes[@]}"; do
      sync=${mode%%/*}
      policy=()
      [ "$sync" != "$mode" ] && policy=(--staleness-policy "${mode#*/}")
      "$bin" train --sync "$sync" "${policy[@]}" --servers 2 --lr "$lr" "${common[@]}" \
        "${dargs[@]}" --out "$out/$scenario-${mode//[:\/]/_}-$run" \
        | grep '^@train ' | sed 's/^@train //' | record "$mode" "$scenario" "$run"
    done
    echo "run $run, $scenario: done" >&2
  done
done
/usr/bin/python3 "$here/staleness_table.py" --baseline ddp "$out/runs.jsonl"
