#!/bin/bash
# dsyncps against what users run instead: PyTorch DDP (gloo) training the same MLP with the
# same per-worker batch (64), momentum SGD and budget on 4 processes of this machine, once
# balanced and once with rank/worker 3 three times slower. Prints the time to 85 % test
# accuracy of each and the ratios.
#
#   bench/ddp_compare.sh [BUILD_DIR] [OUT_DIR]
#
# Installs Debian's python3-torch and libopenblas0 if missing (without OpenBLAS torch runs
# on the reference BLAS, ~15x slower). Both sides count seconds from their launch.
set -euo pipefail
build=${1:-build-rel}
out=${2:-ddp-out}
bin="$build/apps/dsyncps/dsyncps"
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$bin" ] || { echo "no $bin: build first (scripts/build.sh $build Release)" >&2; exit 1; }
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null || ! dpkg -s libopenblas0 >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-torch libopenblas0 >/dev/null
fi
mkdir -p "$out"
common=(--workers 4 --epochs 10 --compute-ms 5 --batch 64 --eval-interval 0.5)

# field NAME FORMAT < summary.json: one value, formatted, or - when absent.
field() { /usr/bin/python3 -c "import json,sys; v=json.loads(sys.stdin.read()).get('$1'); print('-' if v is None else format(v, '$2'))"; }
dsync_json() { grep '^@train ' | sed 's/^@train //'; }

run_pair() {  # name, dsyncps mode, straggler args for dsyncps, straggler args for ddp
  local name=$1 mode=$2 dargs=$3 pargs=$4
  "$bin" train --sync "$mode" --servers 2 "${common[@]}" $dargs --out "$out/$name-dsync" \
    | dsync_json > "$out/$name-dsync.json"
  /usr/bin/python3 "$here/ddp_mlp.py" "${common[@]}" $pargs > "$out/$name-ddp.json"
  local ds dd fs fd
  ds=$(field first_reach_s .1f < "$out/$name-dsync.json")
  dd=$(field first_reach_s .1f < "$out/$name-ddp.json")
  fs=$(field final_accuracy .4f < "$out/$name-dsync.json")
  fd=$(field final_accuracy .4f < "$out/$name-ddp.json")
  local ratio=-
  if [ "$ds" != - ] && [ "$dd" != - ]; then ratio=$(awk -v a="$ds" -v b="$dd" 'BEGIN{printf "%.2f", a/b}'); fi
  printf '%-22s %-12s %10s %10s %8s %9s %8s\n' "$name" "$mode" "$ds" "$dd" "$ratio" "$fs" "$fd"
  echo "@ddp_compare {\"scenario\":\"$name\",\"mode\":\"$mode\",\"dsyncps_reach_s\":\"$ds\",\"ddp_reach_s\":\"$dd\",\"ratio\":\"$ratio\"}" >> "$out/lines.txt"
}

: > "$out/lines.txt"
printf '%-22s %-12s %10s %10s %8s %9s %8s\n' scenario dsyncps dsync_85_s ddp_85_s ratio dsync_acc ddp_acc
run_pair balanced bsp "" ""
run_pair straggler-3x dsync:auto "--straggler 3=3" "--straggler 3 --straggler-factor 3"
run_pair straggler-3x-bsp bsp "--straggler 3=3" "--straggler 3 --straggler-factor 3"
cat "$out/lines.txt"
