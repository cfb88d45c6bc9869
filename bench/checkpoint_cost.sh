#!/usr/bin/env bash
# What a checkpoint of a 256 MiB model costs, beside what the disk allows: a job of
# `dsyncps local` (count model, one tensor of 64 Mi floats, sum optimizer, SERVERS servers,
# COPIES copies of each slice) writes its final checkpoint; the scheduler's log says how long
# the servers took (from the request to the manifest) and how many bytes they wrote. The
# anchor is a plain copy of one file of the same size into the same directory, flushed to
# disk (cp, then sync -f on the file). REPS runs, alternating; medians.
#
#   bench/checkpoint_cost.sh [BUILD] [REPS] [SERVERS] [COPIES]   (defaults: build 3 2 1)
# Output: a table, then one RESULT {json} line.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
reps=${2:-3}
servers=${3:-2}
copies=${4:-1}
bin=$build/apps/dsyncps/dsyncps
work=${DSYNC_BENCH_DIR:-/tmp/dsyncps-checkpoint-cost}
rm -rf "$work"
mkdir -p "$work"
elems=$((64 * 1024 * 1024))  # 256 MiB of float32
head -c $((elems * 4)) /dev/urandom > "$work/source.bin"

ckpt_s=() ckpt_bytes=() copy_s=()
for r in $(seq 1 "$reps"); do
  rm -rf "$work/ckpt" "$work/copy.bin"
  "$bin" local --timeout 300 --servers "$servers" --replicas "$copies" --workers 1 \
    --model count --optimizer sum --tensor-elems "$elems" --slice-bytes 64M --iters 2 \
    --checkpoint-dir "$work/ckpt" > "$work/job.log" 2>&1
  line=$(grep -o 'checkpoint of version [0-9]* complete: [0-9]* bytes from [0-9]* server(s) in [0-9.]* s' "$work/job.log" | tail -1)
  [ -n "$line" ] || { echo "no checkpoint in $work/job.log" >&2; exit 1; }
  ckpt_bytes+=("$(echo "$line" | awk '{print $6}')")
  ckpt_s+=("$(echo "$line" | awk '{print $(NF-1)}')")
  start=$(date +%s.%N)
  cp "$work/source.bin" "$work/copy.bin"
  sync -f "$work/copy.bin"
  end=$(date +%s.%N)
  copy_s+=("$(echo "$end - $start" | bc -l)")
done

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
mc=$(median "${ckpt_s[@]}")
mb=$(median "${ckpt_bytes[@]}")
mp=$(median "${copy_s[@]}")
ratio=$(echo "$mc / $mp" | bc -l)
printf 'checkpoint of a 256 MiB model (%s servers, %s copies), %s runs\n\n' "$servers" "$copies" "$reps"
printf '%-34s %12s %10s\n' "" "median s" "bytes"
printf '%-34s %12.3f %10s\n' "dsyncps checkpoint (all servers)" "$mc" "$mb"
printf '%-34s %12.3f %10s\n' "cp + sync of one 256 MiB file" "$mp" "$((elems * 4))"
printf '\nratio checkpoint / copy: %.2f (runs: checkpoint %s; copy %s)\n' "$ratio" \
  "${ckpt_s[*]}" "${copy_s[*]}"
printf 'RESULT {"bench":"checkpoint_cost","servers":%s,"replicas":%s,"reps":%s,"checkpoint_s":%s,"checkpoint_bytes":%s,"copy_s":%s,"ratio":%.3f}\n' \
  "$servers" "$copies" "$reps" "$mc" "$mb" "$mp" "$ratio"
