#!/usr/bin/env bash
# The main job: builds dsyncps and runs a whole cluster on this machine (1 scheduler,
# 2 servers, 4 workers as separate processes on 127.0.0.1) training an MLP on Fashion-MNIST
# under dsync:2,3 with one worker 3x slower; prints test accuracy as it goes and at the end.
# Extra arguments go to `dsyncps local` (see `build/apps/dsyncps/dsyncps local --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build="${DSYNC_BUILD_DIR:-build}"
exec "$build/apps/dsyncps/dsyncps" local --servers 2 --workers 4 --sync dsync:2,3 \
  --model mlp --iters 600 --lr 0.1 --log-every 200 --compute-ms 2 --worker-flags '3=--slow 3' "$@"
