#!/usr/bin/env bash
# Installs what dsyncps needs to build and test on Debian 12, idempotently: when every
# package is already there (and apt knows the kernel package that rxe-vm.sh downloads) it changes
# nothing and does not touch the network.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  # credentials and push receipts (src/ps/keys.cc)
  libsodium-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev zlib1g-dev
  libopenblas-dev dataset-fashion-mnist gnuplot-nox
  # scripts/sanitize.sh: clang, its sanitizer and libFuzzer runtimes, llvm-symbolizer
  clang-14 libclang-rt-14-dev llvm-14
  # the RDMA transport (src/rdma)
  libibverbs-dev librdmacm-dev
  # scripts/rxe-vm.sh (RDMA tests in a soft-RoCE QEMU VM): the emulator, the VM's userland,
  # and the tools that unpack the kernel package and compute its module closure
  qemu-system-x86 busybox-static cpio kmod xz-utils
  rdma-core ibverbs-utils ibverbs-providers rdmacm-utils perftest iproute2
  # tests/launch_test.cc: jobs under mpirun and under a one-node Slurm (scripts/slurm-local.sh)
  openmpi-bin slurm-wlm munge
  # the Python package (python/): Debian's own python3 with PyTorch, pybind11, DLPack, pytest
  python3-dev pybind11-dev libdlpack-dev python3-numpy python3-pytest python3-torch
  python3-torchvision
  # bench/python/overhead.py's whole-step C++ baseline (bench/python/torch_step_worker.cc)
  libtorch-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# scripts/rxe-vm.sh fetches Debian's kernel with apt-get download: apt's package lists must
# know linux-image-amd64 (container images often come without lists).
# DSYNC_SKIP_RDMA_VM=1 (no VM wanted, e.g. an offline GPU machine): no need for them.
lists_ok=1
if [ "${DSYNC_SKIP_RDMA_VM:-0}" != 1 ]; then
  apt-cache show linux-image-amd64 >/dev/null 2>&1 || lists_ok=0
fi
if [ ${#missing[@]} -eq 0 ] && [ $lists_ok -eq 1 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo="sudo"; else
    echo "deps.sh: missing packages (${missing[*]}) and not root; run as root or install sudo" >&2
    exit 1
  fi
fi
[ ${#missing[@]} -eq 0 ] || echo "deps.sh: installing ${missing[*]}"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
