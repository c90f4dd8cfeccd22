"""DataLoader workers and the trainer's preemption signals.

A Ctrl-C in a terminal, or SLURM's SIGTERM, reaches every process of the job: the trainer and
its DataLoader workers. A worker that died of it made torch raise "worker killed by signal"
inside the trainer's preemption save (no checkpoint, exit 2, measured with 2 workers). So while
a trainer's :class:`~speedtronic.train.preemption.PreemptionGuard` is active, a worker ignores
the first of those signals as long as the trainer process lives (the trainer saves, then stops
its workers through the DataLoader's shutdown queue) and dies of the next one: a DataLoader's
``terminate()`` of a stuck worker after that, or multiprocessing's at exit.

:class:`WorkerShield` is the DataLoader's ``worker_init_fn`` (it runs after torch installs its
own SIGTERM handler in the worker, which would die of a SIGTERM not sent by its parent). Forked
workers read the active guard they inherited; spawned and forkserver workers (the Linux default
from Python 3.14, macOS's spawn) get it pickled with the shield when they start.

Under torchrun a scheduler's signal often arrives twice: SLURM signals every process of the
job, and torchrun forwards its own copy to each rank's process group at once. A copy within
:data:`REPEAT_WINDOW_S` of the first counts as the same event, for workers here and for the
ranks' guard; with ``forkserver`` the server that forks the workers ignores the signals too
(:func:`start_forkserver_shielded`): it died of a group signal, and torch's worker watchdog then
ended every worker ("exited unexpectedly", no checkpoint, in 5 of 7 runs under torchrun).

This module is below ``train`` (the data layer uses it); the guard registers itself here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import FrameType
from typing import Any

from .._process import pid_alive

__all__ = ["FORKSERVER_IGNORES_ENV", "REPEAT_WINDOW_S", "WorkerShield", "guarded",
           "start_forkserver_shielded", "worker_signal"]

#: A signal within this many seconds of the first is its copy (torchrun forwards what a
#: scheduler sent every process of the job, milliseconds later), not a second request.
REPEAT_WINDOW_S = 2.0

# (trainer pid, signals) while a PreemptionGuard is active in this process (the trainer), or,
# in a worker, the trainer it serves
_trainer: tuple[int, tuple[int, ...]] | None = None
_first_signal_at: float | None = None  # in a worker: when the first signal came


def guarded(pid: int | None, signals: tuple[int, ...] = ()) -> None:
    """Called by the guard on entry (its pid and signals) and on exit (None)."""
    global _trainer
    _trainer = None if pid is None else (pid, tuple(signals))


def worker_signal(signum: int, frame: FrameType | None) -> None:
    """A worker's handler: ignore the first signal (and its copies within
    :data:`REPEAT_WINDOW_S`) while the trainer lives; a later one takes the default action."""
    global _first_signal_at
    now = time.monotonic()
    first = _first_signal_at is None
    if first:
        _first_signal_at = now
    # a copy of the first (within the window) only under torchrun, as for the ranks: a real
    # double Ctrl-C in one process ends the trainer at once, and its workers with it
    copy = ("TORCHELASTIC_RUN_ID" in os.environ
            and now - (_first_signal_at or now) < REPEAT_WINDOW_S)
    if _trainer is not None and pid_alive(_trainer[0]) and (first or copy):
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action now


#: How the trainer tells the forkserver which signals to ignore (read by forkserver_preload).
FORKSERVER_IGNORES_ENV = "SPEEDTRONIC_FORKSERVER_IGNORES"


def start_forkserver_shielded() -> None:
    """Under the ``forkserver`` start method, inside a guarded run: start the server so that
    it ignores the guard's signals while every process it forks gets them back at their
    default (:mod:`.forkserver_preload`, its preload module; the server still ends with the
    trainer, through its alive pipe). Ignoring them in the trainer around the start instead
    dropped a signal that came then, and every later child of the server inherited the
    ignoring (``Pool.__exit__`` hung). A no-op for fork and spawn, outside a guard, or when
    the server runs already."""
    # the method the DataLoader will use: the default context's (forkserver on Linux from
    # Python 3.14 without anyone setting it)
    if _trainer is None or multiprocessing.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver  # POSIX only, and only needed here

    preload = list(getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"])
    if "speedtronic.data.forkserver_preload" not in preload:  # first: before __main__'s
        # imports (torch: seconds), the server is not shielded yet
        forkserver.set_forkserver_preload(["speedtronic.data.forkserver_preload", *preload])
    # SIGINT: the server ignores it already, and restores it in its children itself
    os.environ[FORKSERVER_IGNORES_ENV] = ",".join(
        str(s) for s in _trainer[1] if s != signal.SIGINT)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(FORKSERVER_IGNORES_ENV, None)


class WorkerShield:
    """``worker_init_fn`` that installs :func:`worker_signal` for the trainer's preemption
    signals; a no-op outside a guarded run."""

    def __init__(self) -> None:
        self._pickled: tuple[int, tuple[int, ...]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # pickled in the trainer when a spawn/forkserver worker starts: the guard active now
        return {"trainer": _trainer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._pickled = state["trainer"]

    def __call__(self, worker_id: int) -> None:
        global _trainer
        trainer = self._pickled or _trainer  # pickled (spawn) or inherited (fork)
        if trainer is None or trainer[0] == os.getpid():
            return
        _trainer = trainer
        for signum in trainer[1]:
            try:
                signal.signal(signum, worker_signal)
            except (OSError, ValueError):
                continue
