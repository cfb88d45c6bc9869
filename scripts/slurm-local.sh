#!/usr/bin/env bash
# A Slurm cluster of one node on this machine, for tests and for trying the Slurm examples
# without a cluster: munged, slurmctld and slurmd with a generated slurm.conf, all of their
# state, sockets and logs in DIR, on free ports (several can run side by side).
#
#   scripts/slurm-local.sh start DIR [CPUS]   # prints "export SLURM_CONF=DIR/slurm.conf"
#   scripts/slurm-local.sh stop DIR
#
# Needs root (slurmd starts job steps as their user) and the packages slurm-wlm and munge.
# The node claims CPUS processors (default 16) whatever the machine has, and the partition
# allows oversubscription: a job of 6 tasks runs on 2 cores.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR [CPUS]" >&2
  exit 2
fi

# Two different TCP ports nobody listens on now (Slurm needs fixed ports in its
# configuration; a daemon that finds its port taken after all fails to start, and says so).
free_ports() {
  python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])'
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local limit=$1 what=$2
  shift 2
  for _ in $(seq 1 $((limit * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "slurm-local.sh: $what did not happen within ${limit}s; logs in $dir" >&2
  return 1
}

stop() {
  if [ -f "$dir/slurm.conf" ]; then
    SLURM_CONF="$dir/slurm.conf" scontrol shutdown >/dev/null 2>&1 || true
  fi
  local pidfile pid name
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    name=$(basename "$pidfile" .pid)
    rm -f "$pidfile"
    # A stale file's number may belong to another process by now: only ours are signalled.
    [ "$(ps -p "$pid" -o comm= 2>/dev/null)" = "$name" ] || continue
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

case "$cmd" in
  stop)
    stop
    exit 0
    ;;
  start) ;;
  *)
    echo "usage: $0 start|stop DIR [CPUS]" >&2
    exit 2
    ;;
esac

cpus=${3:-16}
for tool in munged slurmctld slurmd srun; do
  command -v "$tool" >/dev/null || {
    echo "slurm-local.sh: $tool is missing: apt-get install slurm-wlm munge" >&2
    exit 1
  }
done
if [ "$(id -u)" -ne 0 ]; then
  echo "slurm-local.sh: slurmd must run as root" >&2
  exit 1
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
stop
# A start that fails half-way leaves nothing running.
trap 'stop' ERR
rm -rf "$dir/state" "$dir/spool" "$dir/munge"
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 700 "$dir/munge"
# munged checks that its key and folders belong to the user it runs as and are private.
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chmod 600 "$dir/munge/munge.key"
munged --force --socket="$dir/munge/munge.sock" --key-file="$dir/munge/munge.key" \
  --log-file="$dir/munge/munged.log" --pid-file="$dir/munge/munged.pid" \
  --seed-file="$dir/munge/munged.seed"
wait_for 10 "munged answering" munge -S "$dir/munge/munge.sock" -n

host=$(hostname -s)
read -r -a ports < <(free_ports)
cat >"$dir/slurm.conf" <<EOF
ClusterName=dsynclocal
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
node_idle() { sinfo -h -o %t | grep -q idle; }
wait_for 30 "the node becoming idle in slurmctld" node_idle
echo "export SLURM_CONF=$SLURM_CONF"
