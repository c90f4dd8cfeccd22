"""Imported by multiprocessing's forkserver as a preload module when a guarded training run
starts it (:func:`speedtronic.data.worker_signals.start_forkserver_shielded`).

The server forks the DataLoader workers and is in the trainer's process group: a group signal
(SLURM's SIGTERM) killed it, and torch's worker watchdog then ended every worker in the middle
of the step ("exited unexpectedly", no checkpoint). So the server ignores the signals named in
``SPEEDTRONIC_FORKSERVER_IGNORES`` (it still ends with the trainer, through its alive pipe), and
every process it forks gets them back at their default action before anything else runs there.
Imported anywhere else (the variable unset) it does nothing.
"""

from __future__ import annotations

import os
import signal

_IGNORED = tuple(int(s) for s in os.environ.get("SPEEDTRONIC_FORKSERVER_IGNORES", "").split(",")
                 if s.strip().isdigit())


def _defaults_in_child() -> None:
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_DFL)


if _IGNORED:
    for _signum in _IGNORED:
        signal.signal(_signum, signal.SIG_IGN)
    os.register_at_fork(after_in_child=_defaults_in_child)
