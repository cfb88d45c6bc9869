#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (the device tool): builds
# in Release with the CUDA store, runs the store tests (their CUDA instances run only where a
# device is visible), the update kernel's benchmark and a short main job on the CUDA store;
# everything it prints is also written under ${OUT:-gpu-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  DSYNC_SKIP_RDMA_VM=1 scripts/deps.sh  # the GPU machine is offline: no kernel for the RDMA VM
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release && ninja -C build-gpu
  ctest --test-dir build-gpu --output-on-failure -R 'Store|Cuda|GpuMlp|MlpMath|LocalGpus|Trace' --timeout 300
  build-gpu/bench/bench_cuda_apply --scalar | tee "$out/bench_cuda_apply.txt"
  build-gpu/apps/dsyncps/dsyncps train --store cuda --workers 2 --epochs 2 --out "$out/train"
  build-gpu/apps/dsyncps/dsyncps train --store cuda --worker-math cuda --workers 2 --epochs 2 \
      --out "$out/train-worker-cuda"
} 2>&1 | tee "$out/gpu-check.log"
