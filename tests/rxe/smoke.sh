#!/bin/sh
# Smoke check of the soft-RoCE VM harness (scripts/rxe-vm.sh), run inside the VM: the rxe
# device is up, and real verbs traffic (perftest RDMA WRITE bandwidth/latency, librdmacm's
# rping) passes over it in loopback. Also works on any host with an RDMA device: set
# DSYNC_RDMA_DEVICE, DSYNC_RXE_GID_INDEX and DSYNC_RXE_IP. Checks pass/fail only: speeds
# under emulation vary a lot, so they are printed, never asserted.
set -u
dev=${DSYNC_RDMA_DEVICE:?}
gid=${DSYNC_RXE_GID_INDEX:?}
ip=${DSYNC_RXE_IP:?}
fail=0

# The client fails if it starts before its server listens: wait for the TCP port (perftest's
# out-of-band exchange) or the rdma_cm listener (rping).
tcp_listens() { netstat -ltn 2>/dev/null | grep -q "[:.]$1 "; }
cm_listens() { rdma resource show cm_id 2>/dev/null | grep -Eq "LISTEN.*:$1( |$)"; }
wait_for() {
  i=0
  while [ $i -lt 200 ]; do "$@" && return 0; sleep 0.1; i=$((i + 1)); done
  echo "smoke: timed out waiting for: $*" >&2; return 1
}
# check NAME WAIT-FUNC PORT SERVER-CMD... -- CLIENT-CMD...: server in the background, client in
# front; both must succeed. (Arguments contain no spaces: the server command is split on them.)
check() {
  name=$1 waitf=$2 port=$3; shift 3
  srv=""
  while [ "$1" != "--" ]; do srv="$srv $1"; shift; done; shift
  echo "=== smoke: $name"
  timeout 120 $srv >"/tmp/$name.server.log" 2>&1 &
  spid=$!
  if wait_for "$waitf" "$port"; then
    timeout 120 "$@" >"/tmp/$name.client.log" 2>&1; crc=$?
    cat "/tmp/$name.client.log"
  else
    crc=1
  fi
  wait $spid; src=$?
  if [ $crc = 0 ] && [ $src = 0 ]; then
    echo "=== smoke: $name PASS"
  else
    echo "=== smoke: $name FAIL (client rc=$crc, server rc=$src); server output:"
    cat "/tmp/$name.server.log"; fail=1
  fi
}

echo "=== smoke: ibv_devinfo"
if ibv_devinfo -d "$dev" | tee /tmp/devinfo.log | grep -q 'state:.*PORT_ACTIVE'; then
  grep -E 'hca_id|transport|active_mtu|state' /tmp/devinfo.log
else
  cat /tmp/devinfo.log; echo "=== smoke: $dev port not active FAIL"; fail=1
fi

check ib_write_bw tcp_listens 18515 ib_write_bw -d "$dev" -x "$gid" -F -- \
  ib_write_bw -d "$dev" -x "$gid" -F "$ip"
# perftest's latency tests calibrate the TSC against gettimeofday; a preempted vCPU can spoil
# that (they then print "inf"): retry a few times, since the numbers are wanted for benchmarks.
for try in 1 2 3; do
  check ib_write_lat tcp_listens 18516 ib_write_lat -d "$dev" -x "$gid" -F -p 18516 -- \
    ib_write_lat -d "$dev" -x "$gid" -F -p 18516 "$ip"
  grep -q ' inf ' /tmp/ib_write_lat.client.log || break
  echo "=== smoke: ib_write_lat clock calibration failed (emulation noise), try $try of 3"
done
# librdmacm: address and route resolution, connection setup over rdma_cm.
check rping cm_listens 7174 rping -s -a "$ip" -C 10 -- rping -c -a "$ip" -C 10

if [ $fail = 0 ]; then echo "=== smoke: PASS"; else echo "=== smoke: FAIL"; fi
exit $fail
