#!/usr/bin/env bash
# Builds dsyncps and runs every test (unit, multi-process, fault and bad-input tests), then the
# RDMA tests in a soft-RoCE VM and across two (scripts/test-rdma.sh, scripts/test-rdma-two-vms.sh;
# DSYNC_SKIP_RDMA_VM=1 skips them), then
# the suites under sanitizers and the fuzzers (scripts/sanitize.sh; DSYNC_SKIP_SANITIZE=1
# skips them). Installs its build dependencies first (Debian 12, idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build="${DSYNC_BUILD_DIR:-build}"
# Tests start clusters of threads and processes on 127.0.0.1; they run one at a time so that
# their timing-based scenarios (stragglers, heartbeat timeouts) see a quiet machine.
ctest --test-dir "$build" --output-on-failure --timeout 180 "$@"
# RDMA tests need an RDMA device: they run in a soft-RoCE QEMU VM (about a minute on 2 cores),
# then across two such VMs joined by a link (scripts/test-rdma-two-vms.sh, about two).
if [ "${DSYNC_SKIP_RDMA_VM:-0}" = 1 ]; then
  echo "test.sh: RDMA tests in the soft-RoCE VMs SKIPPED (DSYNC_SKIP_RDMA_VM=1, for quick local loops; CI runs them)"
else
  scripts/test-rdma.sh
  scripts/test-rdma-two-vms.sh
fi
# The suites again under ASan+UBSan and TSan, then every fuzzer for DSYNC_FUZZ_SECONDS, each
# stage in a build folder of its own (about 15 minutes on 2 cores).
if [ "${DSYNC_SKIP_SANITIZE:-0}" = 1 ]; then
  echo "test.sh: sanitizer and fuzz runs SKIPPED (DSYNC_SKIP_SANITIZE=1, for quick local loops; CI runs them)"
else
  scripts/sanitize.sh
fi
