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

This module is below ``train`` (the data layer uses it); the guard registers itself here.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

__all__ = ["WorkerShield", "guarded", "worker_signal"]

# (trainer pid, signals) while a PreemptionGuard is active in this process (the trainer), or,
# in a worker, the trainer it serves
_trainer: tuple[int, tuple[int, ...]] | None = None


def guarded(pid: int | None, signals: tuple[int, ...] = ()) -> None:
    """Called by the guard on entry (its pid and signals) and on exit (None)."""
    global _trainer
    _trainer = None if pid is None else (pid, tuple(signals))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (a reused pid): not ours
        return False
    return True


def worker_signal(signum: int, frame: FrameType | None) -> None:
    """A worker's handler: ignore this first signal while the trainer lives; the next one
    takes the default action (death)."""
    signal.signal(signum, signal.SIG_DFL)
    if _trainer is not None and _alive(_trainer[0]):
        return
    os.kill(os.getpid(), signum)  # orphaned: the default action now


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
