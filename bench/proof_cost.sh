#!/usr/bin/env bash
# What node identity and proved commits cost, measured against the release before them in
# one run: bench_pushpull (push+pull GB/s per worker at 4 and 64 MiB, 1 and 2 workers) and
# bench_rounds (bsp rounds/s with tiny gradients, 4 and 16 workers), the two releases'
# programs alternating, medians of REPS runs of each. Both are built in Release without
# CUDA in their own build folders; the earlier release is checked out from this repository's
# history into a scratch worktree (bench_rounds.cc uses only the public API, so the same
# file is built against both).
#
#   bench/proof_cost.sh [REV] [REPS]     (REV: the release before proofs, default e29c925)
# Output: a table of medians and after/before ratios, then one RESULT {json} line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rev=${1:-e29c925}
reps=${2:-3}
work=${DSYNC_BENCH_DIR:-/tmp/dsyncps-proof-cost}
mkdir -p "$work"

build() {  # build SRC DIR: the two benchmarks, Release, no CUDA
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=OFF \
    -DDSYNC_BUILD_TESTS=OFF >/dev/null
  ninja -C "$2" bench/bench_pushpull bench/bench_rounds >/dev/null
}

if [ ! -d "$work/old-src" ]; then
  git worktree add --detach "$work/old-src" "$rev" >/dev/null
fi
cp bench/bench_rounds.cc "$work/old-src/bench/"
grep -q bench_rounds "$work/old-src/bench/CMakeLists.txt" ||
  echo 'dsync_add_bench(bench_rounds)' >>"$work/old-src/bench/CMakeLists.txt"
echo "proof_cost.sh: building $rev (before) and $(git rev-parse --short HEAD) (after)"
build "$work/old-src" "$work/old"
build "$repo" "$work/new"

: >"$work/results.jsonl"
for rep in $(seq 1 "$reps"); do
  for side in old new; do
    echo "proof_cost.sh: run $rep/$reps, $side"
    "$work/$side/bench/bench_pushpull" --sizes 4,64 --workers 1,2 | grep '^RESULT ' |
      sed "s/^RESULT /{\"side\":\"$side\",\"result\":/; s/\$/}/" >>"$work/results.jsonl"
    "$work/$side/bench/bench_rounds" --workers 4,16 --reps 1 | grep '^RESULT ' |
      sed "s/^RESULT /{\"side\":\"$side\",\"result\":/; s/\$/}/" >>"$work/results.jsonl"
  done
done

python3 - "$work/results.jsonl" "$rev" <<'EOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    res = r["result"]
    for row in res["rows"]:
        if res.get("bench") == "rounds":
            key = f"rounds/s, {row['workers']} workers"
            value = row["rounds_per_s"]
        else:
            if row.get("error"):
                continue
            key = f"push+pull GB/s per worker, {row['tensor_mib']} MiB, {row['workers']} worker(s)"
            value = row["gbps_per_worker"]
        rows.setdefault(key, {"old": [], "new": []})[r["side"]].append(value)
print(f"{'figure':58} {'before':>9} {'after':>9} {'after/before':>13}")
out = []
for key, v in rows.items():
    before, after = statistics.median(v["old"]), statistics.median(v["new"])
    print(f"{key:58} {before:9.3f} {after:9.3f} {after / before:13.3f}")
    out.append({"figure": key, "before": before, "after": after, "ratio": after / before,
                "before_runs": v["old"], "after_runs": v["new"]})
print("RESULT " + json.dumps({"bench": "proof_cost", "before": sys.argv[2], "rows": out}))
EOF
