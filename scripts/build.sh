#!/usr/bin/env bash
# Configures and builds dsyncps into build/ (or $DSYNC_BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${DSYNC_BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${DSYNC_BUILD_TYPE:-RelWithDebInfo}" \
  -DDSYNC_WERROR=ON "$@" >/dev/null
ninja -C "$build"
