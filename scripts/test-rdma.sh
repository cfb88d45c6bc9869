#!/usr/bin/env bash
# Runs the RDMA tests against a real soft-RoCE device inside a QEMU VM (scripts/rxe-vm.sh),
# on machines without RDMA hardware or kernel support. Called by scripts/test.sh after ctest;
# expects scripts/build.sh to have run. Every command below runs, in order; the run fails if
# any fails. Console log: ${DSYNC_BUILD_DIR:-build}/rxe-vm/console.log.
# Environment: DSYNC_RDMA_VM_TIMEOUT (whole VM run, s, default 600), DSYNC_RXE_ACCEL (auto, kvm
# or tcg: QEMU's accelerator, see scripts/rxe-vm.sh); extra arguments are passed to
# scripts/rxe-vm.sh (e.g. --keep DIR, --cpus N).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
build=${DSYNC_BUILD_DIR:-build}
[[ $build == /* ]] || build=$repo/$build

# ---- What runs in the VM -------------------------------------------------------------------
# vm_files: files/dirs copied into the VM at the same absolute paths (ELF programs bring their
# shared libraries). vm_commands: shell command lines run there, cwd = the repository root,
# with DSYNC_RDMA_DEVICE, DSYNC_RXE_GID_INDEX, DSYNC_RXE_IP set (see scripts/rxe-vm.sh).
vm_files=("$repo/tests/rxe" "$build/tests/transport_test" "$build/tests/rdma_cluster_test"
          "$build/apps/dsyncps/dsyncps" "$repo/scripts/setup-rxe.sh" /usr/bin/bash
          /usr/bin/setpriv)  # util-linux's: busybox's cannot change the user
vm_commands=(
  "tests/rxe/smoke.sh"
  # The Transport conformance suite on real verbs (the TCP instances ran outside already).
  "$build/tests/transport_test --gtest_filter='*/rdma' --gtest_brief=1"
  # A whole job over RDMA: 1 scheduler, 2 servers, 2 workers; the model must equal TCP's.
  "$build/tests/rdma_cluster_test --gtest_brief=1"
  # The same as separate processes, launched by the dsyncps program.
  "$build/apps/dsyncps/dsyncps local --transport rdma --bind \$DSYNC_RXE_IP --servers 2 --workers 2 --model linreg --iters 40"
  # Clear messages for the usual mistakes, and scripts/setup-rxe.sh (last: it takes the
  # link down and up again).
  "tests/rxe/diagnostics.sh $build/apps/dsyncps/dsyncps $repo"
)
# ---------------------------------------------------------------------------------------------

for f in "${vm_files[@]}"; do
  [ -e "$f" ] || { echo "test-rdma.sh: $f missing (run scripts/build.sh first)" >&2; exit 1; }
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dsync-test-rdma.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# A runner for the VM's busybox sh: each command in a subshell, all of them run, a summary.
sq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }
{
  echo 'failed=""'
  i=0
  for c in "${vm_commands[@]}"; do
    i=$((i + 1)); label=$(sq "[$i/${#vm_commands[@]}] $c")
    echo "echo \"=== test-rdma \"$label"
    echo "( $c ) || { rc=\$?; failed=\"\$failed $i\"; echo \"=== test-rdma FAILED (rc=\$rc) \"$label; }"
  done
  echo 'if [ -z "$failed" ]; then echo "=== test-rdma: all passed"; exit 0; fi'
  echo 'echo "=== test-rdma: FAILED commands:$failed"; exit 1'
} >"$tmp/run.sh"

args=(--timeout "${DSYNC_RDMA_VM_TIMEOUT:-600}" --log "$build/rxe-vm/console.log" --include "$tmp/run.sh")
for f in "${vm_files[@]}"; do args+=(--include "$f"); done
echo "test-rdma.sh: running ${#vm_commands[@]} command(s) in the soft-RoCE VM"
scripts/rxe-vm.sh "${args[@]}" "$@" --run "sh $tmp/run.sh"
