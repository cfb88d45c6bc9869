#!/usr/bin/env bash
# Sets up soft-RoCE (rdma_rxe) on a host whose kernel has it, so dsyncps can run with
# --transport rdma without RDMA hardware: loads the module, adds an rxe device on a network
# device, and checks it with ibv_devinfo. Run as root. Idempotent.
#
#   scripts/setup-rxe.sh [NETDEV] [RXE_NAME]     # default: the default route's netdev, rxe0
#   scripts/setup-rxe.sh --remove [RXE_NAME]
#
# Afterwards: dsyncps ... --transport rdma --bind <the netdev's IPv4 address>. The netdev needs
# an IPv4 address (RoCE v2 GIDs are derived from it) and must be up. Every node of a job needs
# an RDMA device (rxe talks RoCE v2 to rxe or to real RoCE NICs over plain Ethernet/UDP 4791).
# Packages (Debian/Ubuntu): rdma-core ibverbs-utils iproute2 kmod.
set -euo pipefail

die() { echo "setup-rxe.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (it loads a kernel module and adds a device)"
command -v rdma >/dev/null || die "the 'rdma' tool is missing: apt-get install iproute2"
command -v ibv_devinfo >/dev/null || die "ibv_devinfo is missing: apt-get install ibverbs-utils rdma-core"

if [ "${1:-}" = --remove ]; then
  name=${2:-rxe0}
  rdma link delete "$name" && echo "setup-rxe.sh: removed $name"
  exit 0
fi

netdev=${1:-$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit }}')}
name=${2:-rxe0}
[ -n "$netdev" ] || die "no netdev given and no default route to take one from: scripts/setup-rxe.sh <netdev>"
[ -e "/sys/class/net/$netdev" ] || die "no network device '$netdev' (ip -br link lists them)"

if ! modprobe rdma_rxe 2>/dev/null && [ ! -d /sys/module/rdma_rxe ]; then
  die "cannot load rdma_rxe: this kernel lacks soft-RoCE (CONFIG_RDMA_RXE). Use a kernel that has it, real RDMA hardware, or --transport tcp. (For tests without it, scripts/rxe-vm.sh runs them in a VM.)"
fi
modprobe rdma_ucm 2>/dev/null || true  # librdmacm's user-space connection manager

ip link set "$netdev" up
ipv4=$(ip -o -4 addr show dev "$netdev" | awk '{print $4; exit}')
[ -n "$ipv4" ] || die "$netdev has no IPv4 address; give it one (ip addr add A.B.C.D/N dev $netdev): RoCE v2 GIDs come from it"

if rdma link show "$name/1" >/dev/null 2>&1; then
  echo "setup-rxe.sh: $name already exists"
else
  rdma link add "$name" type rxe netdev "$netdev"
  echo "setup-rxe.sh: added $name on $netdev"
fi

# The port must be ACTIVE and carry a RoCE v2 GID for the IPv4 address.
for _ in $(seq 50); do
  ibv_devinfo -d "$name" 2>/dev/null | grep -q "PORT_ACTIVE" && break
  sleep 0.1
done
ibv_devinfo -d "$name" | grep -E "hca_id|state|active_mtu|link_layer"
ibv_devinfo -d "$name" | grep -q PORT_ACTIVE || die "$name's port is not active: is $netdev up with a carrier?"
limit=$(ulimit -l)
if [ "$limit" != unlimited ] && [ "$limit" -lt 65536 ]; then
  echo "setup-rxe.sh: note: this shell's locked-memory limit is ${limit} KiB; RDMA registers memory: raise it for dsyncps (ulimit -l unlimited, or LimitMEMLOCK=infinity under systemd)"
fi
echo "setup-rxe.sh: ready: dsyncps ... --transport rdma --bind ${ipv4%/*} (device $name)"
