#!/usr/bin/env bash
# Builds dsyncps and runs every test (unit, multi-process, fault and bad-input tests).
# Installs its build dependencies first (Debian 12, idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build="${DSYNC_BUILD_DIR:-build}"
# Tests start clusters of threads and processes on 127.0.0.1; they run one at a time so that
# their timing-based scenarios (stragglers, heartbeat timeouts) see a quiet machine.
ctest --test-dir "$build" --output-on-failure --timeout 180 "$@"
