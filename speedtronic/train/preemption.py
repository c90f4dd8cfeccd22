"""Preemption: a signal asks the run to save at the next step boundary and exit.

Schedulers warn before they kill: SLURM sends SIGTERM (or, with ``--signal=USR1@90``, SIGUSR1
90 s ahead of the time limit) and SIGKILL after its grace period; Kubernetes sends SIGTERM and
waits ``terminationGracePeriodSeconds`` (30 s by default). Dying at once on the first signal
loses up to ``checkpoint.every_steps - 1`` steps; the handler here only sets a flag, and the
trainer, at the end of the step in flight, writes a checkpoint and raises
:class:`~speedtronic.errors.RunPreempted`.

A second signal (the user pressing Ctrl-C twice, or a scheduler out of patience) exits at once
with the same code: the checkpoint protocol renames a finished file into place, so an exit in
the middle of a save leaves every committed checkpoint intact.

Handlers are only installed from the main thread (Python's rule), and act only in the process
that installed them: a DataLoader worker gets the handling of
:mod:`speedtronic.data.worker_signals` (it ignores the first signal while the trainer lives, so
a signal to the whole process group does not kill it in the middle of the save).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ..data import worker_signals

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["PreemptionGuard", "requeue_slurm_job"]


class PreemptionGuard:
    """Context manager turning ``signals`` into a flag (:attr:`requested`) while it is active.

    Args:
        signals: signal names (``"SIGTERM"``); names this platform lacks are skipped.
    """

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.absent = [name for name in signals if not hasattr(signal, name)]
        """Names this platform lacks (Windows: SIGUSR1, SIGHUP, ...), skipped."""
        self.requested: int | None = None
        self._first_at = 0.0  # when the first signal came
        self._previous: dict[int, Any] = {}
        self._owner = os.getpid()
        self._registered = False

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                logger.info("preemption: signals not handled (the run is not on the main "
                            "thread); a signal stops it without a save")
            return self
        if self.absent:
            logger.info("preemption: %s not on this platform: not handled",
                        ", ".join(self.absent))
        for signum in self.signals:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (OSError, ValueError):  # e.g. a signal this OS refuses to let us catch
                continue
        worker_signals.guarded(self._owner, tuple(self._previous))
        self._registered = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._registered:  # entered on the main thread (a thread's guard registers nothing)
            worker_signals.guarded(None)
            self._registered = False
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous)
            except (OSError, ValueError, TypeError):
                pass
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:  # a forked child that inherited this handler
            worker_signals.worker_signal(signum, frame)
            return
        if (self.requested is not None and "TORCHELASTIC_RUN_ID" in os.environ
                and time.monotonic() - self._first_at < worker_signals.REPEAT_WINDOW_S):
            return  # torchrun's forwarded copy of the signal the scheduler sent every process
        if self.requested is not None:
            # Second signal: leave now. os.write, not logging: a handler may interrupt a
            # logging call that holds the handler's lock.
            os.write(2, f"speedtronic: second {signal.Signals(signum).name}: exiting now "
                        "(committed checkpoints are intact)\n".encode())
            os._exit(128 + signum)
        self.requested = signum
        self._first_at = time.monotonic()
        os.write(2, f"speedtronic: {signal.Signals(signum).name} received: saving a checkpoint "
                    "at the end of this step, then exiting (send it again to exit at once)\n"
                    .encode())


def requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; True if it succeeded (one log line either way)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        logger.warning("preemption: train.requeue is on but SLURM_JOB_ID is not set (not a "
                       "SLURM job): not requeued")
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        logger.warning("preemption: train.requeue: scontrol is not on PATH: job %s not "
                       "requeued", job)
        return False
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("preemption: scontrol requeue %s failed (%s)", job, exc)
        return False
    if done.returncode != 0:
        logger.warning("preemption: scontrol requeue %s failed (exit %d: %s)", job,
                       done.returncode, (done.stderr or done.stdout).strip()[:200])
        return False
    logger.info("preemption: SLURM job %s requeued", job)
    return True
