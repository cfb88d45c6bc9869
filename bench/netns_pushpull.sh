#!/usr/bin/env bash
# Push+pull between two hosts of their own (network namespaces joined by a veth pair, as a
# cluster's hosts are joined by a link), beside the same job on one host's loopback and
# iperf3 over the same two paths, all in one run, interleaved.
#
#   bench/netns_pushpull.sh [BUILD_DIR] [SIZES_MIB] [REPS]     (defaults: build "4 64" 3)
#
# Host A runs the scheduler and a server on 10.77.0.1, host B one worker
# (bench_pushpull --join) that reaches them through the veth link; the loopback job runs
# all three inside host A on 127.0.0.1. GB/s = 2 x tensor bytes / median iteration (push +
# pull); iperf3 = one TCP stream for 3 s, GB/s = bits / 8e9. Needs root, iproute2, iperf3.
# Prints a table and a RESULT {json} line; figures are medians over REPS.
set -euo pipefail

build=${1:-build}
sizes=${2:-4 64}
reps=${3:-3}
dsyncps=$build/apps/dsyncps/dsyncps
bench=$build/bench/bench_pushpull
for f in "$dsyncps" "$bench"; do
  [ -x "$f" ] || { echo "netns_pushpull.sh: $f is missing: build first (scripts/build.sh)" >&2; exit 1; }
done
command -v iperf3 >/dev/null || { echo "netns_pushpull.sh: apt-get install iperf3" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "netns_pushpull.sh: needs root (network namespaces)" >&2; exit 1; }
dsyncps=$(realpath "$dsyncps")
bench=$(realpath "$bench")

a=dsb-a-$$
b=dsb-b-$$
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "va$$" type veth peer name "vb$$"
ip link set "va$$" netns "$a"
ip link set "vb$$" netns "$b"
ip -n "$a" addr add 10.77.0.1/24 dev "va$$"
ip -n "$b" addr add 10.77.0.2/24 dev "vb$$"
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
done
ip -n "$a" link set "va$$" up
ip -n "$b" link set "vb$$" up

export DSYNC_TOKEN=netns-bench
port=9571

# pushpull_veth SIZE -> GB/s (scheduler and server in A, the worker in B)
pushpull_veth() {
  local size=$1 out
  ip netns exec "$a" "$dsyncps" scheduler --interface 10.77.0.1 --scheduler-port $port \
    --num-servers 1 --num-workers 1 --log-level warn &
  pids+=($!)
  ip netns exec "$a" "$dsyncps" server --interface 10.77.0.1 --scheduler-uri 10.77.0.1 \
    --scheduler-port $port --log-level warn &
  pids+=($!)
  out=$(DSYNC_SCHEDULER_URI=10.77.0.1 DSYNC_SCHEDULER_PORT=$port \
    ip netns exec "$b" "$bench" --join --sizes "$size" --timeout 300)
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
  port=$((port + 1))
  sed -n 's/^RESULT //p' <<<"$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["gbps_per_worker"])'
}

# pushpull_loopback SIZE -> GB/s (all three in A on 127.0.0.1)
pushpull_loopback() {
  local size=$1
  ip netns exec "$a" "$dsyncps" launch --workers 1 --servers 1 --log-level warn -- \
    "$bench" --join --sizes "$size" --timeout 300 |
    sed -n 's/^\[worker 0\] RESULT //p' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["gbps_per_worker"])'
}

# iperf SERVER_NS CLIENT_NS ADDRESS -> GB/s
iperf() {
  local server=$1 client=$2 address=$3
  ip netns exec "$server" iperf3 -s -1 -B "$address" -p 5299 >/dev/null &
  local spid=$!
  sleep 0.3
  ip netns exec "$client" iperf3 -c "$address" -p 5299 -t 3 -J |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9)'
  wait "$spid" 2>/dev/null || true
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

declare -A got
for ((r = 0; r < reps; r++)); do
  for size in $sizes; do
    got[veth_$size]+=" $(pushpull_veth "$size")"
    got[lo_$size]+=" $(pushpull_loopback "$size")"
  done
  got[iperf_veth]+=" $(iperf "$a" "$b" 10.77.0.1)"
  got[iperf_lo]+=" $(iperf "$a" "$a" 127.0.0.1)"
done

iperf_veth=$(median <<<"${got[iperf_veth]}")
iperf_lo=$(median <<<"${got[iperf_lo]}")
echo "dsyncps push+pull between two network namespaces (veth, MTU 1500) and on loopback;"
echo "medians of $reps interleaved runs; iperf3 one TCP stream, 3 s"
printf '%-9s %8s %12s %12s %14s\n' path tensor "PS GB/s" "iperf3 GB/s" "PS / iperf3"
rows=""
for size in $sizes; do
  for path in veth lo; do
    ps=$(median <<<"${got[${path}_$size]}")
    ip=$([ "$path" = veth ] && echo "$iperf_veth" || echo "$iperf_lo")
    ratio=$(awk -v p="$ps" -v i="$ip" 'BEGIN {printf "%.3f", (i > 0 ? p / i : 0)}')
    printf '%-9s %4s MiB %12.3f %12.3f %14s\n' "$path" "$size" "$ps" "$ip" "$ratio"
    rows+="${rows:+,}{\"path\":\"$path\",\"tensor_mib\":$size,\"gbps\":$ps,\"iperf3_gbps\":$ip,\"ratio\":$ratio}"
  done
done
echo "RESULT {\"bench\":\"netns_pushpull\",\"reps\":$reps,\"iperf3_veth_gbps\":$iperf_veth,\"iperf3_loopback_gbps\":$iperf_lo,\"rows\":[$rows]}"
