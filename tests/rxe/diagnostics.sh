#!/bin/sh
# Inside the soft-RoCE VM (scripts/test-rdma.sh runs it last: it takes the link down): the
# RDMA mistakes users make most get actionable messages from dsyncps, and
# scripts/setup-rxe.sh accepts the device the VM set up.
# Usage: diagnostics.sh DSYNCPS_BINARY REPO_DIR
set -u
bin=$1 repo=$2
ip=${DSYNC_RXE_IP:?} dev=${DSYNC_RDMA_DEVICE:?} netdev=${DSYNC_RXE_NETDEV:-eth0}
fail=0
# Every node needs the job's token (or --insecure); these runs are about RDMA mistakes.
export DSYNC_TOKEN=diagnostics
# expect NAME WANT-TEXT CMD...: CMD must fail, printing WANT-TEXT.
expect() {
  name=$1 want=$2; shift 2
  out=$("$@" 2>&1)
  rc=$?
  if [ $rc -ne 0 ] && printf '%s' "$out" | grep -qF -- "$want"; then
    echo "=== diagnostics: $name PASS (exit $rc)"
  else
    echo "=== diagnostics: $name FAIL (exit $rc, wanted \"$want\"):"; printf '%s\n' "$out" | tail -5
    fail=1
  fi
}
srv() { timeout 30 "$bin" server --scheduler-uri "$ip" --scheduler-port 1 --connect-timeout-ms 500 "$@"; }
expect "unknown device" "RDMA device 'mlx5_9' not found (devices here: $dev)" \
  srv --transport rdma --bind "$ip" --rdma-device mlx5_9
expect "GID without IPv4" "the RDMA transport needs a RoCE v2 GID holding an IPv4 address" \
  srv --transport rdma --bind "$ip" --gid-index 0
expect "loopback" "listen on the IP of an RDMA netdev ($ip on $netdev" \
  srv --transport rdma --bind 127.0.0.1
expect "peer unreachable" "cannot connect to $ip:1 over RDMA" \
  srv --transport rdma --bind "$ip"
# The memlock limit binds only without CAP_IPC_LOCK, so as nobody (the VM runs as root),
# with the 64 KiB some distributions still default to.
as_nobody_64k() {
  sh -c 'ulimit -l 64 && exec /usr/bin/setpriv --reuid=65534 --regid=65534 --clear-groups "$@"' \
    sh "$@"
}
expect "memlock warning" "RDMA: the locked-memory limit is 64 KiB" \
  as_nobody_64k "$bin" server --scheduler-uri "$ip" --scheduler-port 1 --connect-timeout-ms 500 \
  --transport rdma --bind "$ip"
expect "memlock registration" "the locked-memory limit is 64 KiB, too low for RDMA: raise it (ulimit -l unlimited" \
  as_nobody_64k "$bin" server --scheduler-uri "$ip" --scheduler-port 1 --connect-timeout-ms 500 \
  --transport rdma --bind "$ip"
# Nodes with other ring settings: the connecting side names the variables that must agree,
# the accepting side's log what differs.
"$bin" scheduler --transport rdma --bind "$ip" --scheduler-port 9391 --num-servers 1 \
  --num-workers 1 --start-timeout-ms 60000 >/tmp/mismatch.log 2>&1 &
sched=$!
i=0; while ! grep -q "scheduler listening" /tmp/mismatch.log && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
expect "other ring settings" "it runs with other DSYNC_RDMA_SLOTS, DSYNC_RDMA_SLOT_BYTES or DSYNC_RDMA_MAX_RENDEZVOUS" \
  env DSYNC_RDMA_SLOTS=64 timeout 30 "$bin" server --scheduler-uri "$ip" --scheduler-port 9391 \
  --connect-timeout-ms 1000 --transport rdma --bind "$ip"
kill "$sched"; wait "$sched" 2>/dev/null
if grep -qF "the peer uses 64 slots of 8192 bytes and 16 CTS entries, this node 32 of 8192 and 16: run every node with the same DSYNC_RDMA_SLOTS" /tmp/mismatch.log; then
  echo "=== diagnostics: other ring settings, accepting side PASS"
else
  echo "=== diagnostics: other ring settings, accepting side FAIL:"; tail -5 /tmp/mismatch.log; fail=1
fi
if /usr/bin/bash "$repo/scripts/setup-rxe.sh" "$netdev" "$dev" >/tmp/setup.log 2>&1 &&
   grep -q "ready: dsyncps ... --transport rdma --bind $ip" /tmp/setup.log; then
  echo "=== diagnostics: setup-rxe.sh PASS"
else
  echo "=== diagnostics: setup-rxe.sh FAIL:"; cat /tmp/setup.log; fail=1
fi
ip link set "$netdev" down
i=0; while ibv_devinfo -d "$dev" | grep -q PORT_ACTIVE && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
expect "port down" "bring its netdev $netdev up" srv --transport rdma --bind "$ip"
ip link set "$netdev" up
exit $fail
