#!/usr/bin/env bash
# dsyncps over RDMA beside perftest, in one soft-RoCE VM boot (scripts/rxe-vm.sh): perftest's
# ib_write_lat (2 B) and ib_write_bw (64 KiB, 4 MiB) on rxe0, then bench_transport over rdma
# and over tcp on the same VM, and the ratios. Emulated rxe is slow and noisy (tens of MB/s,
# a loaded host preempts the VM's CPUs): compare the ratios, and only within one run.
#
#   bench/rdma_vs_perftest.sh [BUILD_DIR]      (default build-rel, then build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-}
if [ -z "$build" ]; then build=build-rel; [ -x "$build/bench/bench_transport" ] || build=build; fi
[[ $build == /* ]] || build=$PWD/$build
bench="$build/bench/bench_transport"
[ -x "$bench" ] || { echo "rdma_vs_perftest.sh: $bench missing (build first)" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dsync-rdma-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/inside.sh" <<'INSIDE'
#!/bin/sh
# Runs in the VM: $1 = bench_transport.
set -u
bench=$1
dev=$DSYNC_RDMA_DEVICE gid=$DSYNC_RXE_GID_INDEX ip=$DSYNC_RXE_IP
listening() { netstat -ltn 2>/dev/null | grep -q "[:.]18515 "; }
# perftest NAME ARGS...: server in the background, client in front, client's output kept.
perftest() {
  name=$1; shift
  timeout 300 "$@" -d "$dev" -x "$gid" -F >/tmp/$name.server 2>&1 &
  i=0; while ! listening && [ $i -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
  timeout 300 "$@" -d "$dev" -x "$gid" -F "$ip" >/tmp/$name.client 2>&1
  wait
  cat /tmp/$name.client
}
# First data line after perftest's header: the row with the figures.
row() { awk '/^ *#bytes/ {getline; print; exit}' "/tmp/$1.client"; }
perftest lat ib_write_lat -s 2 -n 2000 >/dev/null
perftest bw64 ib_write_bw -s 65536 -n 4000 >/dev/null
perftest bw4m ib_write_bw -s 4194304 -n 64 >/dev/null
lat=$(row lat | awk '{print $5}')      # t_typical [usec]
bw64=$(row bw64 | awk '{print $4}')    # BW average [MB/sec]
bw4m=$(row bw4m | awk '{print $4}')
echo "perftest: ib_write_lat typical $lat us; ib_write_bw 64 KiB $bw64 MB/s, 4 MiB $bw4m MB/s"
"$bench" --transport rdma --host "$ip" --bw-kib 64,4096 --ps-kib 4,4096 >/tmp/rdma.out 2>&1 || { cat /tmp/rdma.out; exit 1; }
"$bench" --transport tcp --host "$ip" --bw-kib 64,4096 --ps-kib 4,4096 >/tmp/tcp.out 2>&1 || { cat /tmp/tcp.out; exit 1; }
cat /tmp/rdma.out
m() { awk -v k="$2" '$1 == "METRIC" && $2 == k {print $3}' "/tmp/$1.out"; }
echo
echo "=== dsyncps over rxe beside perftest on rxe0 (same VM boot; perftest MB = 2^20 bytes)"
awk -v lat="$lat" -v bw64="$bw64" -v bw4m="$bw4m" \
    -v rl="$(m rdma latency_us)" -v r64="$(m rdma bw_mibs_64)" -v r4m="$(m rdma bw_mibs_4096)" \
    -v tl="$(m tcp latency_us)" -v t64="$(m tcp bw_mibs_64)" -v t4m="$(m tcp bw_mibs_4096)" \
    -v p4="$(m rdma ps_us_4)" -v pb="$(m rdma ps_mibs_4096)" -v pr="$(m rdma ps_mibs_4096_registered)" \
    -v q4="$(m tcp ps_us_4)" -v qb="$(m tcp ps_mibs_4096)" 'BEGIN {
  printf "%-38s %12s %12s %12s %10s\n", "measure", "perftest", "dsync rdma", "dsync tcp", "rdma/perf"
  printf "%-38s %9.2f us %9.2f us %9.2f us %10.2f\n", "one-way latency (2 B)", lat, rl, tl, rl / lat
  printf "%-38s %7.1f MB/s %7.1f MB/s %7.1f MB/s %10.2f\n", "bandwidth, 64 KiB messages", bw64, r64, t64, r64 / bw64
  printf "%-38s %7.1f MB/s %7.1f MB/s %7.1f MB/s %10.2f\n", "bandwidth, 4 MiB messages", bw4m, r4m, t4m, r4m / bw4m
  printf "%-38s %12s %9.1f us %9.1f us %10.2f\n", "PS push+pull, 4 KiB tensor (iteration)", "-", p4, q4, p4 / (2 * lat)
  printf "%-38s %12s %7.1f MB/s %7.1f MB/s %10.2f\n", "PS push+pull, 4 MiB tensor", "-", pb, qb, pb / bw4m
  printf "%-38s %12s %7.1f MB/s %12s %10.2f\n", "  the same, Worker::RegisterBuffer", "-", pr, "-", pr / bw4m
  printf "RESULT {\"bench\":\"rdma_vs_perftest\",\"perftest_lat_us\":%s,\"perftest_bw64_mbs\":%s,\"perftest_bw4m_mbs\":%s,\"rdma_lat_us\":%s,\"rdma_bw64_mibs\":%s,\"rdma_bw4m_mibs\":%s,\"tcp_lat_us\":%s,\"tcp_bw64_mibs\":%s,\"tcp_bw4m_mibs\":%s,\"rdma_ps4k_us\":%s,\"rdma_ps4m_mibs\":%s,\"rdma_ps4m_registered_mibs\":%s,\"tcp_ps4k_us\":%s,\"tcp_ps4m_mibs\":%s}\n", lat, bw64, bw4m, rl, r64, r4m, tl, t64, t4m, p4, pb, pr, q4, qb
}'
INSIDE
chmod +x "$tmp/inside.sh"
scripts/rxe-vm.sh --timeout 900 --include "$tmp/inside.sh" --include "$bench" --run "sh $tmp/inside.sh $bench"
