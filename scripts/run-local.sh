#!/usr/bin/env bash
# The main job: builds dsyncps and trains an MLP on Fashion-MNIST on a whole cluster on this
# machine (1 scheduler, 2 servers, 4 workers as separate processes on 127.0.0.1, TCP, CPU
# store) under dsync:auto, with worker 3 three times slower than its own compute time. Live
# progress while it runs; at the end the final test accuracy and the time to 85 %.
# Extra arguments go to `dsyncps train` (see `build/apps/dsyncps/dsyncps train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
build="${DSYNC_BUILD_DIR:-build}"
exec "$build/apps/dsyncps/dsyncps" train --sync dsync:auto --straggler 3=3 --compute-ms 5 "$@"
