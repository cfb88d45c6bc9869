#!/bin/bash
# Time to 85 % test accuracy per sync mode on the main job (Fashion-MNIST MLP, 4 workers,
# 2 servers, 10 epochs, momentum SGD), with worker 3 three times slower than its own compute
# time and without a straggler. Reproduces the table in docs/benchmarks.md.
#
#   bench/time_to_accuracy.sh [BUILD_DIR] [OUT_DIR]
#
# The workers' compute is the MLP's real gradient plus --compute-ms of simulated work (a
# bigger model): with the bare 1.5 ms MLP the job is bound by messaging on a 2-core machine
# and a straggler costs little. Each mode runs as its own job; expect about 5 minutes.
set -euo pipefail
build=${1:-build-rel}
out=${2:-tta-out}
bin="$build/apps/dsyncps/dsyncps"
[ -x "$bin" ] || { echo "no $bin: build first (scripts/build.sh $build Release)" >&2; exit 1; }
common=(--workers 4 --servers 2 --epochs 10 --compute-ms 5 --batch 64 --eval-interval 0.5)

echo "== straggler: worker 3 is 3x slower =="
"$bin" compare --modes "bsp,dsync:4,dsync:2,3,dsync:4,3,ssp:4,asp,dsync:auto" "${common[@]}" \
  --straggler 3=3 --out "$out/straggler" | grep -v '^\[' | sed -n '/^=== dsyncps compare: 4 workers/,$p'
echo
echo "== balanced: no straggler =="
"$bin" compare --modes "bsp,dsync:auto" "${common[@]}" --out "$out/balanced" \
  | grep -v '^\[' | sed -n '/^=== dsyncps compare: 4 workers/,$p'
