#!/usr/bin/env bash
# RDMA across two hosts: two QEMU VMs (scripts/rxe-vm.sh), each with soft-RoCE (rxe0) on a NIC
# joined to the other's by a link (UDP datagrams between two ports of this host's loopback).
#   1. ib_write_bw from VM B to VM A: the RDMA path works, and what it carries.
#   2. a job over RDMA across them: VM A (10.9.0.1) runs the scheduler and a server, VM B
#      (10.9.0.2) a server and two workers (every node on its own NIC, --interface picking the
#      RDMA device); the model must be what the same job over TCP makes: with the count model
#      and the sum optimizer, every element equals the gradients committed (2 x ITERS).
#   3. push+pull of one worker in B against a server in A (bench_pushpull --join), beside
#      ib_write_bw's figure, printed as a RESULT line.
# Called by scripts/test.sh after scripts/test-rdma.sh; expects scripts/build.sh to have run.
# Environment: DSYNC_BUILD_DIR (default build), DSYNC_RDMA_VM_TIMEOUT (each VM, s, default
# 600), DSYNC_RXE_ACCEL (see scripts/rxe-vm.sh). Logs: $build/rxe-two-vms/.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DSYNC_BUILD_DIR:-build}
[[ $build == /* ]] || build=$PWD/$build
out=$build/rxe-two-vms
rm -rf "$out"
mkdir -p "$out"
dsyncps=$build/apps/dsyncps/dsyncps
bench=$build/bench/bench_pushpull
[ -x "$dsyncps" ] || { echo "test-rdma-two-vms.sh: $dsyncps is missing: run scripts/build.sh" >&2; exit 1; }
have_bench=1
[ -x "$bench" ] || have_bench=0
iters=10
elems=30000
timeout=${DSYNC_RDMA_VM_TIMEOUT:-600}

# Two UDP ports nobody uses now, one per end of the link.
read -r port_a port_b < <(python3 -c '
import socket
s = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')

# What runs in each VM (busybox sh). Every node waits for its peers up to the connect
# timeout: the two VMs boot at their own pace.
common="mkdir -p /tmp/dump
export DSYNC_TOKEN=two-vms DSYNC_CONNECT_TIMEOUT_MS=240000 DSYNC_TRANSPORT=rdma
export DSYNC_SCHEDULER_URI=10.9.0.1 DSYNC_SCHEDULER_PORT=9100
bw() { ib_write_bw -d rxe0 -x \$DSYNC_RXE_GID_INDEX -s 1048576 -n 20 -F --report_gbits \"\$@\"; }
dump() { for f in /tmp/dump/*.json; do echo \"DUMP \$(tr -d '\\n' <\$f)\"; done; }"
cmd_a="$common
set -e
echo '== A: ib_write_bw (server side)'
bw
echo '== A: the scheduler and server 1 of the job'
$dsyncps scheduler --interface 10.9.0.1 --num-servers 2 --num-workers 2 --optimizer sum --sync bsp &
s=\$!
$dsyncps server --interface 10.9.0.1 --dump-model /tmp/dump &
v=\$!
wait \$s
wait \$v
dump
if [ $have_bench = 1 ]; then
  echo '== A: scheduler and server for the push+pull benchmark'
  export DSYNC_SCHEDULER_PORT=9101
  $dsyncps scheduler --interface 10.9.0.1 --num-servers 1 --num-workers 1 &
  s=\$!
  $dsyncps server --interface 10.9.0.1 &
  v=\$!
  wait \$s
  wait \$v
fi
echo '== A: done'"
cmd_b="$common
set -e
echo '== B: ib_write_bw to A (retried until A listens)'
ok=0
for i in \$(seq 120); do
  if bw 10.9.0.1 >/tmp/bw 2>&1; then ok=1; break; fi
  sleep 1
done
cat /tmp/bw
[ \$ok = 1 ]
echo '== B: server 2 and two workers of the job'
$dsyncps server --interface 10.9.0.2 --dump-model /tmp/dump &
v=\$!
$dsyncps worker --interface 10.9.0.2 --model count --iters $iters --tensor-elems $elems &
w1=\$!
$dsyncps worker --interface 10.9.0.2 --model count --iters $iters --tensor-elems $elems &
w2=\$!
wait \$w1
wait \$w2
wait \$v
dump
if [ $have_bench = 1 ]; then
  echo '== B: one worker timing push+pull against A'
  DSYNC_SCHEDULER_PORT=9101 DSYNC_INTERFACE=10.9.0.2 $bench --join --sizes 1 --iters 5 --warmup 1 --timeout 300
fi
echo '== B: done'"

files=(--include "$dsyncps")
[ $have_bench = 0 ] || files+=(--include "$bench")
echo "test-rdma-two-vms.sh: VM A 10.9.0.1 (link port $port_a), VM B 10.9.0.2 (link port $port_b)"
# Each VM's exit status lands in a file: the other is stopped as soon as one fails.
run_vm() {  # run_vm NAME IP LINK COMMAND
  local name=$1 ip=$2 link=$3 cmd=$4 rc=0 pid
  # A process group of its own (setsid): stopping it stops rxe-vm.sh and its QEMU together.
  setsid -w scripts/rxe-vm.sh --ip "$ip" --link "$link" --cpus 2 --timeout "$timeout" \
    --log "$out/$name-console.log" "${files[@]}" --run "$cmd" >"$out/$name.out" 2>&1 &
  pid=$!
  echo $pid >"$out/$name.pid"
  wait $pid || rc=$?
  echo $rc >"$out/$name.rc"
}
stop_vms() {
  local v
  for v in a b; do
    [ -e "$out/$v.pid" ] && [ ! -e "$out/$v.rc" ] && kill -TERM -- "-$(cat "$out/$v.pid")" 2>/dev/null
  done
  return 0
}
run_vm a 10.9.0.1 "$port_a:$port_b" "$cmd_a" &
pid_a=$!
run_vm b 10.9.0.2 "$port_b:$port_a" "$cmd_b" &
pid_b=$!
# Neither VM outlives this script, and when one fails the other is stopped, not waited for.
trap stop_vms EXIT
while [ ! -e "$out/a.rc" ] || [ ! -e "$out/b.rc" ]; do
  for v in a b; do
    if [ -e "$out/$v.rc" ] && [ "$(cat "$out/$v.rc")" != 0 ]; then stop_vms; fi
  done
  sleep 1
done
wait $pid_a $pid_b 2>/dev/null || true
rc_a=$(cat "$out/a.rc")
rc_b=$(cat "$out/b.rc")
for v in a b; do
  rc=$rc_a
  [ $v = a ] || rc=$rc_b
  echo "---- VM ${v^^} (exit $rc) ----"
  sed -n '/init: running/,$p' "$out/$v.out" | grep -v '^\[qemu *[0-9.]*s\] *$' | tail -60
done
if [ $rc_a != 0 ] || [ $rc_b != 0 ]; then
  echo "test-rdma-two-vms.sh: FAILED (VM A exit $rc_a, VM B exit $rc_b; logs in $out)"
  exit 1
fi

# Both servers' slices: every element of every slice is 2 x iters (the count model under sum).
python3 - "$out/a.out" "$out/b.out" "$((2 * iters))" "$elems" <<'EOF'
import json, re, sys
a, b, expected, elems = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
slices = []
for path in (a, b):
    for line in open(path, errors="replace"):
        m = re.search(r"DUMP (\{.*\})", line)
        if m:
            slices += json.loads(m.group(1))["slices"]
if not slices:
    sys.exit("test-rdma-two-vms.sh: no model dump came back from the VMs")
bad = [s for s in slices if s["min"] != expected or s["max"] != expected]
print(f"model across the two VMs: {len(slices)} slices, every element {expected:g}: "
      f"{'yes' if not bad else 'NO'}")
if bad:
    sys.exit(f"test-rdma-two-vms.sh: FAILED: slices off the TCP job's model: {bad[:3]}")
EOF

# ib_write_bw's client line, after the console's "[qemu T]" prefix: "#bytes #iterations
# BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]"; the average.
ib_gbits=$(awk '$3 == "1048576" && $4 == "20" {print $6}' "$out/b.out" | tail -1)
ps_gbps=$(sed -n 's/.*RESULT \({"bench":"pushpull_join".*\)$/\1/p' "$out/b.out" | tail -1 |
  python3 -c 'import json,sys; t=sys.stdin.read().strip(); print(json.loads(t)["gbps_per_worker"] if t else "")')
echo "ib_write_bw B -> A, 1 MiB messages: ${ib_gbits:-?} Gbit/s; push+pull 1 MiB, one worker in B, server in A: ${ps_gbps:-?} GB/s"
echo "RESULT {\"bench\":\"rdma_two_vms\",\"ib_write_bw_gbits\":${ib_gbits:-null},\"pushpull_gbps\":${ps_gbps:-null}}"
echo "test-rdma-two-vms.sh: ok"
