#!/bin/bash
# A dsyncps job under Open MPI: rank 0 is the scheduler, the next $SERVERS ranks servers, the
# rest run your program as workers. The scheduler's address reaches the others through a
# file on a file system every host shares (the rendezvous), since mpirun has no node list.
#
#   examples/mpi/run.sh -np 8 --hostfile hosts -- python3 train.py
#
# Everything before -- goes to mpirun, the rest is the worker program. Set DSYNC_INTERFACE
# to the NIC of your fast network when the hosts have several; SERVERS (default 2), SYNC
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
DSYNC_INTERFACE=${DSYNC_INTERFACE:-}
export DSYNC_TOKEN DSYNC_RENDEZVOUS DSYNC_INTERFACE
rm -f "$DSYNC_RENDEZVOUS"

# -x passes the variables to every rank, on every host.
exec mpirun -x DSYNC_TOKEN -x DSYNC_RENDEZVOUS -x DSYNC_INTERFACE "${mpirun_args[@]}" \
  dsyncps launch --servers "${SERVERS:-2}" --sync "${SYNC:-dsync:2}" -- "$@"
