#!/usr/bin/env bash
# rxe-vm.sh — runs a command against a real soft-RoCE (rdma_rxe) device inside a throw-away
# QEMU VM, for machines (developers', CI) whose kernel has no RDMA support.
#
# Usage:
#   scripts/rxe-vm.sh [options] --run 'shell command line'
#   scripts/rxe-vm.sh [options] -- program [args...]
# Options:
#   --include PATH   copy PATH (file or directory) into the VM at the same absolute path;
#                    repeatable. ELF programs and libraries (also those found inside
#                    directories: executable files and *.so*) get every shared library they
#                    need. Symlinks inside directories are copied as links.
#   --env NAME=VAL   export NAME=VAL to the command; repeatable.
#   --timeout S      bound on the whole run, boot included (default 600, $DSYNC_RXE_VM_TIMEOUT).
#   --cmd-timeout S  bound on the command inside the VM (default: --timeout minus 90 s).
#   --log FILE       console log, timestamped (default ${DSYNC_BUILD_DIR:-build}/rxe-vm/console.log).
#   --keep DIR       keep the work dir (rootfs, initrd, log copy) in DIR instead of a temp dir.
#   --cache DIR      kernel cache (default $DSYNC_RXE_VM_CACHE or
#                    ${XDG_CACHE_HOME:-/var/tmp}/dsyncps-rxe-vm); reused between runs.
#   --cpus N         vCPUs (default: host cores, at most 4).   --mem SIZE   (default 2G)
#   --ip ADDR        eth0's IPv4 address, /24 (default 10.0.2.15).
#   --link L:R       eth0 on a link to another VM instead of QEMU's private user network:
#                    UDP datagrams between host ports 127.0.0.1:L (this VM) and :R (the
#                    other VM, started with --link R:L and another --ip of the same /24).
#   --accel A        auto, kvm or tcg (default $DSYNC_RXE_ACCEL, else auto). auto: KVM when
#                    /dev/kvm opens, falling back to TCG (software emulation, multi-threaded)
#                    when the KVM guest prints nothing within KVM_FIRST_OUTPUT_S seconds or
#                    QEMU ends before it printed (a /dev/kvm that opens but cannot run guests,
#                    as under some nested virtualization); one line says so. kvm: KVM or a
#                    clear failure, no fallback. tcg: never tries KVM.
# Environment: DSYNC_RXE_KERNEL_PKG pins the kernel package (default: what linux-image-amd64
# depends on; with no apt lists, the kernel cached last). DSYNC_RXE_ACCEL: see --accel.
# DSYNC_RXE_TEST_HANGING_KVM=1 is a test hook for that fallback: /dev/kvm counts as usable and
# the KVM attempt runs a stand-in that prints nothing and never ends (`sleep`) instead of QEMU.
#
# Inside the VM (busybox userland + rdma-core, perftest, iproute2), before the command runs:
# modules rdma_rxe and rdma_ucm are loaded, eth0 (virtio-net, MTU 9000) has 10.0.2.15/24 (or
# --ip), lo is up, rxe0 sits on eth0, RLIMIT_MEMLOCK is unlimited, the working directory is
# the host's $PWD (created if it was not included), and these are exported:
#   DSYNC_RDMA_DEVICE=rxe0  DSYNC_RXE_GID_INDEX=<index of the RoCE v2 GID ::ffff:<its IP>>
#   DSYNC_RXE_IP=<its IP>  DSYNC_RXE_NETDEV=eth0  DSYNC_RXE_VM=1
# Tools there: ibv_devices, ibv_devinfo, ibv_rc_pingpong, ib_{write,read,send}_{bw,lat}, rping,
# rdma, ip. Files the command writes stay in the VM (RAM) and are lost: print what matters.
#
# Exit status: the command's own status (printed by the VM as "RXE-VM EXIT <rc>");
# 124 if the command or the whole run timed out; 125 if the harness failed (kernel download,
# boot, rxe setup, missing marker); 2 on bad usage.
#
# Host needs (scripts/deps.sh installs them): qemu-system-x86 busybox-static cpio kmod
# rdma-core ibverbs-utils ibverbs-providers rdmacm-utils perftest iproute2, and apt package
# lists that know linux-image-amd64. This script installs nothing: the kernel package is only
# downloaded (apt-get download) and unpacked (dpkg -x) into the cache.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
prog=rxe-vm.sh

die() { echo "$prog: $*" >&2; exit 125; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }
# Single-quote a string for the VM's POSIX sh.
sq() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }

includes=() envs=() cmd="" cmd_timeout="" keep="" log="" vm_ip=10.0.2.15 link=""
timeout=${DSYNC_RXE_VM_TIMEOUT:-600}
cache=${DSYNC_RXE_VM_CACHE:-${XDG_CACHE_HOME:-/var/tmp}/dsyncps-rxe-vm}
cpus=$(nproc); [ "$cpus" -gt 4 ] && cpus=4
mem=2G
accel=${DSYNC_RXE_ACCEL:-auto} accel_src="DSYNC_RXE_ACCEL=${DSYNC_RXE_ACCEL:-}"
[ -n "${DSYNC_RXE_ACCEL:-}" ] || accel_src="the default (auto)"
# A KVM guest that works prints its first line (init, once the kernel has unpacked the
# initramfs) about a second after QEMU starts; under TCG that takes 10-20 s. A KVM guest still
# silent after this bound is taken for a /dev/kvm that opens but cannot run guests. It is well
# above a working KVM's time even on a loaded host, and small next to a TCG run (1-2 minutes).
KVM_FIRST_OUTPUT_S=15
while [ $# -gt 0 ]; do
  case $1 in
    --include|-i) [ $# -ge 2 ] || usage; includes+=("$2"); shift 2 ;;
    --env) [ $# -ge 2 ] || usage; [[ $2 == [A-Za-z_]*=* ]] || usage; envs+=("$2"); shift 2 ;;
    --run) [ $# -ge 2 ] || usage; cmd=$2; shift 2 ;;
    --timeout) [ $# -ge 2 ] || usage; timeout=$2; shift 2 ;;
    --cmd-timeout) [ $# -ge 2 ] || usage; cmd_timeout=$2; shift 2 ;;
    --log) [ $# -ge 2 ] || usage; log=$2; shift 2 ;;
    --keep) [ $# -ge 2 ] || usage; keep=$2; shift 2 ;;
    --cache) [ $# -ge 2 ] || usage; cache=$2; shift 2 ;;
    --cpus) [ $# -ge 2 ] || usage; cpus=$2; shift 2 ;;
    --mem) [ $# -ge 2 ] || usage; mem=$2; shift 2 ;;
    --accel) [ $# -ge 2 ] || usage; accel=$2; accel_src="--accel $2"; shift 2 ;;
    --ip) [ $# -ge 2 ] || usage; vm_ip=$2; shift 2 ;;
    --link) [ $# -ge 2 ] || usage; link=$2; shift 2 ;;
    --) shift; [ $# -gt 0 ] || usage; cmd=""; for a in "$@"; do cmd+="$(sq "$a") "; done; break ;;
    -h|--help) usage ;;
    *) echo "$prog: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$cmd" ] || usage
[[ $timeout =~ ^[0-9]+$ ]] || usage
[ -n "$cmd_timeout" ] || cmd_timeout=$(( timeout > 180 ? timeout - 90 : timeout / 2 ))
[[ $cmd_timeout =~ ^[0-9]+$ ]] || usage
[[ $vm_ip =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] ||
  { echo "$prog: --ip $vm_ip is not an IPv4 address" >&2; exit 2; }
# The IPv4-mapped GID's last 32 bits as /sys shows them (10.0.2.15 -> 0a00:020f).
vm_gid_tail=$(printf '%02x%02x:%02x%02x' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" \
  "${BASH_REMATCH[3]}" "${BASH_REMATCH[4]}")
# Two VMs on one link need MACs of their own: the address's last three bytes.
vm_mac="52:54:00:${vm_gid_tail:2:2}:${vm_gid_tail:5:2}:${vm_gid_tail:7:2}"
if [ -n "$link" ]; then
  [[ $link =~ ^[0-9]+:[0-9]+$ ]] || { echo "$prog: --link $link is not LOCAL_PORT:REMOTE_PORT" >&2; exit 2; }
fi
case $accel in
  auto|kvm|tcg) ;;
  *) echo "$prog: $accel_src: unknown accelerator '$accel' (expected auto, kvm or tcg)" >&2; exit 2 ;;
esac
[ "$(dpkg --print-architecture 2>/dev/null)" = amd64 ] || die "needs a Debian amd64 host"
for t in qemu-system-x86_64 busybox cpio depmod modprobe ldd ldconfig apt-get dpkg flock; do
  command -v "$t" >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v "$t" >/dev/null ||
    die "'$t' not found: run scripts/deps.sh"
done
export PATH=$PATH:/usr/sbin:/sbin   # depmod/ldconfig live in sbin, absent from users' PATH

# Opening /dev/kvm only shows that the module is loaded and we may use it: under some nested
# virtualization it opens, yet guests never run (QEMU aborts, or the guest stays silent). Only
# a guest's output proves KVM works, so boot_vm (below) checks for it (the probe).
kvm_opens() {
  [ "${DSYNC_RXE_TEST_HANGING_KVM:-0}" = 1 ] && return 0
  [ -w /dev/kvm ] && (exec 3<>/dev/kvm) 2>/dev/null
}
case $accel in
  auto) if kvm_opens; then attempts=(kvm tcg); else attempts=(tcg); fi ;;
  kvm) kvm_opens || die "$accel_src: /dev/kvm is missing or cannot be opened read-write by $(id -un); use DSYNC_RXE_ACCEL=tcg (or auto)"
       attempts=(kvm) ;;
  tcg) attempts=(tcg) ;;
esac

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }   # no fork per call
T0=$(now_ms)
stamp() { local d=$(( $(now_ms) - T0 )); printf '[host %4d.%03ds] %s\n' $((d / 1000)) $((d % 1000)) "$*"; }

# ---------------------------------------------------------------- work dir, cleanup
pipe_pid=""
if [ -n "$keep" ]; then
  # Reuse only a dir this script made (marker file) or an empty one: never wipe a user's dir.
  mkdir -p "$keep"
  if [ ! -e "$keep/.rxe-vm-work" ] && [ -n "$(ls -A "$keep")" ]; then
    echo "$prog: --keep $keep: not empty and not a previous --keep dir" >&2; exit 2
  fi
  work=$(cd "$keep" && pwd); touch "$work/.rxe-vm-work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
fi
cleanup() {
  # QEMU runs under timeout(1) in a background pipeline; the pid file of that timeout lets an
  # interrupted run stop QEMU (timeout passes the TERM on, and sends KILL 10 s later), and the
  # pipeline must end before the work dir goes (it still writes there).
  if [ -f "$work/timeout.pid" ]; then kill "$(cat "$work/timeout.pid")" 2>/dev/null || true; fi
  if [ -n "$pipe_pid" ]; then wait "$pipe_pid" 2>/dev/null || true; fi
  if [ -z "$keep" ]; then rm -rf "$work" || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -z "$log" ]; then
  log=${DSYNC_BUILD_DIR:-build}; [[ $log == /* ]] || log=$repo/$log
  log=$log/rxe-vm/console.log
fi
mkdir -p "$(dirname "$log")"

# ---------------------------------------------------------------- 1. kernel (cached)
# Modules the VM loads (with their dependencies). crc32_generic: rxe asks the crypto API for
# "crc32", which would otherwise need modprobe in the VM.
MODS="virtio_pci virtio_net crc32_generic rdma_rxe rdma_ucm"
kdir=""
prepare_kernel() {
  mkdir -p "$cache"
  exec 9>"$cache/lock"
  flock -w 900 9 || die "cache $cache is locked by another run"
  local kpkg=${DSYNC_RXE_KERNEL_PKG:-}
  [ -n "$kpkg" ] || kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
                           awk '/Depends: linux-image-[0-9]/{print $2; exit}') || true
  if [ -z "$kpkg" ]; then
    # Offline or no package lists: any kernel prepared earlier does the job.
    kdir=$(ls -d "$cache"/kernel/*/ready 2>/dev/null | tail -1) || true
    [ -n "$kdir" ] || die "apt does not know linux-image-amd64 and no kernel is cached in $cache; run scripts/deps.sh (or apt-get update)"
    kdir=$(dirname "$kdir"); stamp "apt does not know linux-image-amd64; using cached $(basename "$kdir")"
    return
  fi
  local kver=${kpkg#linux-image-}
  kdir=$cache/kernel/$kver
  if [ -f "$kdir/ready" ] && [ "$(cat "$kdir/mods")" = "$MODS" ]; then
    stamp "kernel $kver (cached)"; return
  fi
  stamp "preparing kernel $kpkg in $cache"
  mkdir -p "$cache/deb"
  local deb
  deb=$(ls "$cache/deb/${kpkg}_"*.deb 2>/dev/null | tail -1) || true
  if [ -z "$deb" ]; then
    # apt-get download writes into the current dir; a root run may warn about the _apt sandbox.
    (cd "$cache/deb" && rm -f ./*.deb && apt-get download -q "$kpkg") || die "apt-get download $kpkg failed"
    deb=$(ls "$cache/deb/${kpkg}_"*.deb | tail -1)
  fi
  local x=$cache/unpack.$$
  rm -rf "$x" "$kdir.new"; mkdir -p "$kdir.new/modules"
  dpkg -x "$deb" "$x"                                  # unpack only, never install
  depmod -b "$x" "$kver"                               # dpkg -x does not run depmod
  : > "$kdir.new/load-order"
  local m ko b
  for m in $MODS; do
    modprobe -d "$x" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}' >"$x/deps" ||
      die "modprobe --show-depends $m failed"
    while read -r ko; do
      b=$(basename "$ko"); b=${b%.xz}; b=${b%.zst}; b=${b%.gz}
      grep -qxF "$b" "$kdir.new/load-order" && continue
      case $ko in
        *.ko.xz) xz -dc "$ko" >"$kdir.new/modules/$b" ;;
        *.ko.zst) zstd -qdc "$ko" >"$kdir.new/modules/$b" ;;
        *.ko.gz) gzip -dc "$ko" >"$kdir.new/modules/$b" ;;
        *) cp "$ko" "$kdir.new/modules/$b" ;;
      esac
      echo "$b" >>"$kdir.new/load-order"
    done <"$x/deps"
  done
  cp "$x/boot/vmlinuz-$kver" "$kdir.new/vmlinuz"
  echo "$MODS" >"$kdir.new/mods"
  touch "$kdir.new/ready"
  rm -rf "$x" "$kdir"; mv "$kdir.new" "$kdir"
  # Keep the cache bounded: only the current kernel (and its .deb, for offline rebuilds).
  find "$cache/kernel" -mindepth 1 -maxdepth 1 ! -path "$kdir" -exec rm -rf {} +
  find "$cache/deb" -name '*.deb' ! -path "$deb" -delete
  stamp "kernel $kver ready ($(tr '\n' ' ' <"$kdir/load-order"))"
}
prepare_kernel
# Copy out while holding the lock, so that a concurrent run updating the cache cannot pull it away.
cp "$kdir/vmlinuz" "$work/vmlinuz"
R=$work/root
rm -rf "$R"
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib,usr/lib64,usr/libexec/busybox,etc,proc,sys,dev,tmp,run,root,rxe-vm}
cp -r "$kdir/modules" "$R/rxe-vm/modules"
cp "$kdir/load-order" "$R/rxe-vm/load-order"
exec 9>&-

# ---------------------------------------------------------------- 2. initramfs
ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"
chmod 1777 "$R/tmp"

elfs=()          # files whose shared libraries must come along
is_elf() { local m; LC_ALL=C read -r -n 4 m <"$1" 2>/dev/null && [ "$m" = $'\177ELF' ]; }
put() {          # put SRC [DST]: copy a file (dereferenced) to the same path in the rootfs
  local dst=${2:-$1}
  [ -e "$R$dst" ] && return 0
  [ -d "$R${dst%/*}" ] || mkdir -p "$R${dst%/*}"    # expansions, not dirname: forks are slow here
  cp -L "$1" "$R$dst"
}
put_tool() {     # a host program, by name, plus its libraries
  local p; p=$(command -v "$1") || die "'$1' not found on the host: run scripts/deps.sh"
  put "$p"; elfs+=("$p")
}

b=$(command -v busybox); cp -L "$b" "$R/usr/bin/busybox"; elfs+=("$b")
ln -s busybox "$R/usr/bin/sh"
for t in rdma ip ibv_devices ibv_devinfo ibv_rc_pingpong rping \
         ib_write_bw ib_write_lat ib_read_bw ib_read_lat ib_send_bw ib_send_lat; do
  put_tool "$t"
done
# libibverbs dlopen()s its provider (named in /etc/libibverbs.d); only rxe is needed here.
# glibc dlopen()s libgcc_s.so.1 for thread exit/cancel. ldd sees neither.
for f in /usr/lib/*/libibverbs/librxe-rdmav*.so \
         "$(ldconfig -p | awk '/libgcc_s\.so\.1 .*x86-64/{print $NF; exit}')"; do
  [ -f "$f" ] || die "missing $f (rdma-core/ibverbs-providers, libgcc-s1)"
  put "$f"; elfs+=("$f")
done
put /etc/libibverbs.d/rxe.driver

# The caller's files, at their absolute paths.
for inc in "${includes[@]}"; do
  [ -e "$inc" ] || die "--include $inc: no such file or directory"
  abs=$(realpath -s "$inc")
  if [ -d "$inc" ]; then
    mkdir -p "$R$abs"; cp -a "$abs/." "$R$abs/"
    while IFS= read -r -d '' f; do is_elf "$f" && elfs+=("$f"); done \
      < <(find -H "$abs" -type f \( -perm -u+x -o -name '*.so*' \) -print0)
  else
    put "$abs"; is_elf "$abs" && elfs+=("$abs")
  fi
done

# Shared-library closure (ldd resolves transitively, RUNPATH and LD_LIBRARY_PATH included);
# libraries keep their host paths.
libdirs=()
for f in "${elfs[@]}"; do
  out=$(ldd "$f" 2>/dev/null) || continue          # static programs, object files
  if grep -q 'not found' <<<"$out"; then
    die "$f: shared libraries not found on the host: $(grep 'not found' <<<"$out" | tr -s '\t\n' ' ')"
  fi
  while read -r lib; do
    [ -n "$lib" ] || continue
    put "$lib"; libdirs+=("${lib%/*}")
  done < <(awk '/=>/ && $3 ~ /^\// {print $3} /^[ \t]*\/[^ ]*ld-linux/ {print $1}' <<<"$out")
done
# A loader cache for libraries outside the default dirs (found via LD_LIBRARY_PATH on the host).
printf '%s\n' "${libdirs[@]}" | sort -u >"$R/etc/ld.so.conf"
ldconfig -X -r "$R" 2>/dev/null || stamp "warning: ldconfig -r failed; relying on RUNPATH/default dirs"

echo "root:x:0:0:root:/root:/bin/sh" >"$R/etc/passwd"
echo "root:x:0:" >"$R/etc/group"
printf '127.0.0.1 localhost\n%s rxe-vm\n' "$vm_ip" >"$R/etc/hosts"
printf 'passwd: files\ngroup: files\nhosts: files\n' >"$R/etc/nsswitch.conf"
echo rxe-vm >"$R/etc/hostname"

# What /init runs: the command, its environment, its working dir and its time limit.
{
  for e in "${envs[@]}"; do echo "export ${e%%=*}=$(sq "${e#*=}")"; done
} >"$R/rxe-vm/env"
printf '%s\n' "$cmd" >"$R/rxe-vm/cmd"
printf '%s\n' "$PWD" >"$R/rxe-vm/cwd"
printf 'VM_IP=%s\nVM_GID_TAIL=%s\n' "$vm_ip" "$vm_gid_tail" >"$R/rxe-vm/net"
mkdir -p "$R$PWD"
echo "$cmd_timeout" >"$R/rxe-vm/cmd-timeout"

cat >"$R/init" <<'EOF'
#!/bin/busybox sh
# PID 1 of the rxe VM (written by scripts/rxe-vm.sh). Applets go last in PATH so that the
# real iproute2/rdma-core programs win over busybox's namesakes.
/bin/busybox --install -s /usr/libexec/busybox
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/usr/libexec/busybox
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/shm /dev/pts; mount -t tmpfs -o mode=1777 shm /dev/shm; mount -t devpts pts /dev/pts
hostname rxe-vm
log() { read -r up _ </proc/uptime; echo "[vm $up s] $*"; }
fail() { log "RXE-VM SETUP FAILED: $*"; dmesg | tail -30; poweroff -f; sleep 10; exit 1; }
log "init: loading modules"
for m in $(cat /rxe-vm/load-order); do
  insmod "/rxe-vm/modules/$m" || fail "insmod $m"
done
ip link set lo up
. /rxe-vm/net
for i in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
[ -e /sys/class/net/eth0 ] || fail "no eth0 (virtio-net)"
# MTU 9000 lets rxe use a 4096-byte path MTU (about 1.5x the bandwidth of 1024).
ip link set eth0 mtu 9000 && ip link set eth0 up && ip addr add $VM_IP/24 dev eth0 || fail "eth0 setup"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0"
# The IPv4-mapped RoCE v2 GID (::ffff:$VM_IP) appears asynchronously. One grep over the
# table: a shell loop over its many empty slots costs tens of seconds under emulation.
GIDX=""
port=/sys/class/infiniband/rxe0/ports/1
for i in $(seq 100); do
  for c in $(cd $port/gids && grep -l "0000:0000:0000:0000:0000:ffff:$VM_GID_TAIL" * 2>/dev/null); do
    read -r t <$port/gid_attrs/types/$c && [ "$t" = "RoCE v2" ] && GIDX=$c
  done
  [ -n "$GIDX" ] && break; sleep 0.1
done
[ -n "$GIDX" ] || fail "no RoCE v2 GID for $VM_IP on rxe0"
read -r state <$port/state
log "init: rxe0 on eth0, port state '$state', RoCE v2 GID index $GIDX"
export DSYNC_RDMA_DEVICE=rxe0 DSYNC_RXE_GID_INDEX=$GIDX DSYNC_RXE_IP=$VM_IP \
       DSYNC_RXE_NETDEV=eth0 DSYNC_RXE_VM=1 HOME=/root TMPDIR=/tmp
. /rxe-vm/env
ulimit -l unlimited    # registered memory is pinned; tests must not hit RLIMIT_MEMLOCK
cd "$(cat /rxe-vm/cwd)" || fail "cd"
T=$(cat /rxe-vm/cmd-timeout)
log "init: running (timeout ${T}s): $(cat /rxe-vm/cmd)"
sh /rxe-vm/cmd </dev/null &
pid=$!
# Watchdog: the VM powers off right after, so stray grandchildren need no cleanup.
( sleep "$T"; : >/run/timed-out; log "RXE-VM command timed out after ${T}s"; kill -TERM $pid
  sleep 5; kill -KILL $pid ) 2>/dev/null &
wait $pid; rc=$?
[ -e /run/timed-out ] && rc=124
log "init: command finished"
echo "RXE-VM EXIT $rc"
poweroff -f
EOF
chmod 755 "$R/init"

# Uncompressed: the emulated kernel unpacks it faster than it would gunzip it.
(cd "$R" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$work/initrd.cpio"
stamp "initramfs built: $(du -h "$work/initrd.cpio" | cut -f1), ${#elfs[@]} programs/libraries scanned"

# ---------------------------------------------------------------- 3. boot
kvm_log=${log%.log}.kvm.log   # the console log of a KVM attempt that failed the probe
rm -f "$kvm_log"

# Reads QEMU's side of the console (QEMU's own messages and the shell's arrive tagged with
# \037, the guest's serial output untagged), timestamps each line into the console log (fd 3)
# and onto stdout, and creates $1 at the guest's first line. With $2 = probe, QEMU's own lines
# before that go to the log only: if the guest never prints, one line sums up the failed KVM
# attempt instead of a QEMU error dump followed by a retry.
console_reader() {
  local flag=$1 hold=$2 line own seen="" held=() d
  while IFS= read -r line || [ -n "$line" ]; do
    d=$(( $(now_ms) - TQ )); own=""
    if [[ $line == $'\037'* ]]; then own=1; line=${line#$'\037'}; fi
    printf -v line '[qemu %4d.%03ds] %s' $((d / 1000)) $((d % 1000)) "${line%$'\r'}"
    printf '%s\n' "$line" >&3
    if [ -z "$own" ] && [ -z "$seen" ]; then
      seen=1; : >"$flag"
      [ ${#held[@]} -eq 0 ] || printf '%s\n' "${held[@]}"
    fi
    if [ -n "$own" ] && [ -z "$seen" ] && [ "$hold" = probe ]; then held+=("$line"); else printf '%s\n' "$line"; fi
  done
}

# boot_vm ACCEL LIMIT [probe]: one QEMU run under ACCEL (kvm or tcg), bounded by LIMIT s; sets
# qrc to QEMU's exit status. With probe, sets probe_failure to the reason if the guest printed
# nothing before QEMU ended or within KVM_FIRST_OUTPUT_S (QEMU is then stopped). Its status
# means nothing (the caller reads probe_failure), so that it is not tested: set -e would not
# apply inside it then.
probe_failure=""
boot_vm() {
  local a=$1 limit=$2 probe=${3:-} qaccel=tcg,thread=multi cpu=max first deadline
  [ "$a" = kvm ] && qaccel=kvm cpu=host
  local netdev=user,id=n0,restrict=on
  if [ -n "$link" ]; then
    netdev="dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=${link%%:*},remote.type=inet,remote.host=127.0.0.1,remote.port=${link##*:}"
  fi
  # -netdev user,restrict=on: the VM reaches nothing outside (rxe traffic to its own IP loops
  # in the kernel). romfile=: no iPXE option ROM needed (and ipxe-qemu may be absent).
  # shellcheck disable=SC2054  # the commas are inside QEMU's option values
  local qemu=(qemu-system-x86_64 -machine q35 -accel "$qaccel" -cpu "$cpu" -m "$mem"
      -smp "$cpus" -nodefaults -display none -monitor none -serial stdio -no-reboot
      -kernel "$work/vmlinuz" -initrd "$work/initrd.cpio"
      -netdev "$netdev" -device "virtio-net-pci,netdev=n0,romfile=,mac=$vm_mac"
      -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off")
  if [ "$a" = kvm ] && [ "${DSYNC_RXE_TEST_HANGING_KVM:-0}" = 1 ]; then
    qemu=(sleep "$limit"); stamp "test hook DSYNC_RXE_TEST_HANGING_KVM=1: a silent 'sleep' stands in for QEMU under KVM"
  fi
  stamp "starting qemu (-accel $qaccel -smp $cpus -m $mem, timeout ${limit}s, command timeout ${cmd_timeout}s)"
  rm -f "$work/qemu.rc" "$work/guest-output" "$work/timeout.pid"
  TQ=$(now_ms)
  # The pipeline runs in the background so that a signal to this script is handled at once
  # (cleanup stops QEMU through timeout's pid file) instead of after QEMU ends, and so that
  # the probe can watch it.
  (
    rc=0
    timeout -k 10 "$limit" "${qemu[@]}" </dev/null &
    echo $! >"$work/timeout.pid"
    wait $! || rc=$?
    echo "$rc" >"$work/qemu.rc.new" && mv "$work/qemu.rc.new" "$work/qemu.rc"
  ) 2> >(while IFS= read -r l || [ -n "$l" ]; do printf '\037%s\n' "$l"; done) |
    console_reader "$work/guest-output" "$probe" 3>"$log" &
  pipe_pid=$!
  if [ "$probe" = probe ]; then
    # Wait for the guest's first line, for QEMU's end, or for KVM_FIRST_OUTPUT_S.
    deadline=$(( TQ + KVM_FIRST_OUTPUT_S * 1000 ))
    while [ ! -e "$work/guest-output" ] && [ ! -e "$work/qemu.rc" ] && [ "$(now_ms)" -lt "$deadline" ]; do
      sleep 0.1
    done
    if [ ! -e "$work/guest-output" ] && [ ! -e "$work/qemu.rc" ]; then
      first=$(sed -n '1s/^\[qemu [ 0-9.]*s\] //p' "$log")
      probe_failure="the guest printed nothing within ${KVM_FIRST_OUTPUT_S}s (QEMU stopped${first:+; it said: $first})"
      # Stop it: timeout passes the TERM on to QEMU and sends KILL 10 s later.
      kill "$(cat "$work/timeout.pid")" 2>/dev/null || true
      deadline=$(( $(now_ms) + 15000 ))
      while [ ! -e "$work/qemu.rc" ] && [ "$(now_ms)" -lt "$deadline" ]; do sleep 0.1; done
      if [ ! -e "$work/qemu.rc" ]; then
        pipe_pid=""   # cleanup must not wait for it either
        die "QEMU under KVM did not end within 15 s of TERM (and KILL after 10 s); giving up"
      fi
    fi
  fi
  # QEMU has ended here, or runs bounded by timeout -k 10 LIMIT: the reader ends after it.
  wait "$pipe_pid" || true
  pipe_pid=""
  rm -f "$work/timeout.pid"
  qrc=$(cat "$work/qemu.rc" 2>/dev/null || echo "?")
  if [ "$probe" = probe ] && [ ! -e "$work/guest-output" ]; then
    if [ -z "$probe_failure" ]; then
      first=$(sed -n '1s/^\[qemu [ 0-9.]*s\] //p' "$log")
      probe_failure="QEMU exited with status $qrc before the guest printed anything${first:+ ($first)}"
    fi
    mv "$log" "$kvm_log"
  fi
}

TB=$(now_ms)
for a in "${attempts[@]}"; do
  limit=$(( timeout - ($(now_ms) - TB) / 1000 ))
  if [ "$limit" -lt 1 ]; then
    stamp "FAIL: the VM ran past --timeout ${timeout}s (console log: $kvm_log)"; exit 124
  fi
  probe=""; [ "$a" = kvm ] && probe=probe
  probe_failure=""
  boot_vm "$a" "$limit" $probe
  [ -n "$probe_failure" ] || break
  if [ "$accel" = kvm ]; then
    stamp "FAIL: KVM does not run the VM here: $probe_failure; no fallback to TCG with $accel_src (use DSYNC_RXE_ACCEL=tcg or auto; console log: $kvm_log)"
    exit 125
  fi
  stamp "KVM does not run the VM here: $probe_failure; retrying under TCG software emulation (slower; DSYNC_RXE_ACCEL=tcg skips the KVM try; its console log: $kvm_log)"
done
[ -z "$keep" ] || cp "$log" "$work/console.log"

rc=$(sed -n 's/^\[qemu [ 0-9.]*s\] RXE-VM EXIT \([0-9]\{1,3\}\)$/\1/p' "$log" | tail -1)
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
  stamp "FAIL: the VM ran past --timeout ${timeout}s (console log: $log)"; exit 124
elif [ -z "$rc" ]; then
  grep -q 'RXE-VM SETUP FAILED' "$log" && stamp "FAIL: $(grep -o 'RXE-VM SETUP FAILED.*' "$log" | tail -1)"
  stamp "FAIL: no 'RXE-VM EXIT' marker (qemu rc=$qrc; console log: $log)"; exit 125
fi
stamp "command exit status $rc (console log: $log)"
exit "$rc"
