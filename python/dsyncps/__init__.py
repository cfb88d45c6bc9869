"""dsyncps: a parameter server with delayed synchronization.

A process started by ``dsyncps launch -- python3 train.py`` (or ``dsyncps join``) finds the
job in its ``DSYNC_*`` environment. ``dsyncps.init()`` joins it as a worker; the worker then
registers tensors, pushes gradients and pulls the model (``dsyncps.torch`` does all of that
for a ``torch.nn.Module``). ``dsyncps.observe()`` joins read-only, for evaluation and saving.
"""
import atexit
import os
import signal
import threading

from ._core import Error, Request, Worker, heap_state

__all__ = ["Error", "Request", "Worker", "init", "initialized", "worker", "shutdown", "observe",
           "rank", "stop_requested", "heap_state"]

_worker = None
_lock = threading.Lock()


def init(settings=None):
    """Joins the job as a worker (once per process; later calls return the same worker).

    ``settings`` maps ``DSYNC_*`` names to values over the environment. The worker leaves the
    job when the process exits normally, on an uncaught exception, on Ctrl-C and on SIGTERM
    (the gradients it committed are applied; the iteration in hand is committed too).
    It also pins glibc's heap thresholds, so that the memory a training step frees serves the
    next one instead of being faulted in again (``heap_state()`` says what was done;
    ``DSYNC_PIN_HEAP=0`` or a ``MALLOC_*_`` variable of your own leaves glibc's defaults).
    """
    global _worker
    with _lock:
        if _worker is not None and not _worker.closed:
            return _worker
        if not settings and not any(k.startswith(("DSYNC_", "DMLC_")) for k in os.environ):
            raise RuntimeError("this process is not part of a dsyncps job (no DSYNC_* variable "
                               "is set): start it with `dsyncps launch --workers N -- python3 "
                               "SCRIPT`, or add it to a running job with `dsyncps join -- "
                               "python3 SCRIPT`")
        _worker = Worker.start({str(k): str(v) for k, v in (settings or {}).items()})
        atexit.register(shutdown)
        _leave_on_sigterm()
        return _worker


def initialized():
    return _worker is not None and not _worker.closed


def worker():
    """The worker init() started; RuntimeError if there is none."""
    if _worker is None:
        raise RuntimeError("dsyncps.init() has not been called: call it once, before training, "
                           "to join the job (the process must run under `dsyncps launch` or "
                           "`dsyncps join`, or have DSYNC_* set)")
    if _worker.closed:
        raise RuntimeError("this process has left the dsyncps job (dsyncps.shutdown()); "
                           "call dsyncps.init() to join it again")
    return _worker


def shutdown():
    """Leaves the job gracefully (what was pushed is committed first). Idempotent."""
    global _worker
    w = _worker
    if w is not None and not w.closed:
        w.leave()


def observe(settings=None):
    """Joins read-only: pulls return the newest model at once and never hold a round."""
    return Worker.start({str(k): str(v) for k, v in (settings or {}).items()}, observer=True)


def rank():
    """This worker's rank among those the launcher started (0 for a joiner without one)."""
    return int(os.environ.get("DSYNC_WORKER_RANK", "0"))


def stop_requested():
    """The job's gradient budget is spent: finish this iteration and leave."""
    return initialized() and _worker.stop_requested


def _leave_on_sigterm():
    # Launchers and schedulers end processes with SIGTERM, which by default kills Python
    # without running atexit: turn it into SystemExit so the worker leaves gracefully.
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)
