#!/bin/bash
# A dsyncps job under Open MPI: rank 0 is the scheduler, the next $SERVERS ranks servers, the
# rest run your program as workers. The scheduler's address reaches the others through a
# file on a file system every host shares (the rendezvous), since mpirun has no node list.
#
#   examples/mpi/run.sh -np 8 --hostfile hosts -- python3 train.py
#
# Everything before -- goes to mpirun, the rest is the worker program. DSYNC_INTERFACE: the
# NIC of your fast network (ib0, eth1); default 0.0.0.0, every address (each server then
# tells the others the address that routes to the scheduler). SERVERS (default 2), SYNC
# (default dsync:2) and RENDEZVOUS (default a file in the current folder) as you need.
set -euo pipefail

mpirun_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  mpirun_args+=("$1")
  shift
done
if [ $# -lt 2 ]; then
  echo "usage: $0 [MPIRUN ARGS] -- PROGRAM [ARGS]" >&2
  exit 2
fi
shift

DSYNC_TOKEN=${DSYNC_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
DSYNC_RENDEZVOUS=${RENDEZVOUS:-$PWD/dsyncps-scheduler.$$}
DSYNC_INTERFACE=${DSYNC_INTERFACE:-0.0.0.0}
export DSYNC_TOKEN DSYNC_RENDEZVOUS DSYNC_INTERFACE
rm -f "$DSYNC_RENDEZVOUS"
# The scheduler removes the file when it ends; not when it is killed.
trap 'rm -f "$DSYNC_RENDEZVOUS"' EXIT

# -x passes the variables to every rank, on every host.
mpirun -x DSYNC_TOKEN -x DSYNC_RENDEZVOUS -x DSYNC_INTERFACE "${mpirun_args[@]}" \
  dsyncps launch --servers "${SERVERS:-2}" --sync "${SYNC:-dsync:2}" -- "$@"
