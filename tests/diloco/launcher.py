"""Start DiLoCo test nodes as real OS processes without paying the torch import each time.

Every node of the fault tests used to be ``python tests/diloco/proc.py ...``: a fresh interpreter
importing torch (about 1.7 s of CPU each, 10 s of wall time on the shared 2-core host under load)
for a node whose own work is well under a second of CPU. Here the nodes are forked from a
multiprocessing *forkserver* that imported torch and the DiLoCo modules once. Each node is still
a separate OS process with its own pid, memory, threads, environment, log file and exit status:
it can be SIGKILLed mid-step, crash at a crash point with ``os._exit`` or be restarted, exactly as
before, so fault coverage is unchanged. The server forks from a single-threaded process that has
run no torch op, so no thread pool or lock state is inherited.

:class:`Node` mirrors the part of :class:`subprocess.Popen` the tests use.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _context() -> multiprocessing.context.BaseContext:
    if str(_HERE) not in sys.path:  # the server imports "proc" by this path
        sys.path.insert(0, str(_HERE))
    ctx = multiprocessing.get_context("forkserver")
    # proc imports torch and speedtronic.diloco; s3fs (+ aiobotocore) took ~5 s per s3 node to
    # import under load. A module that fails to import is skipped by the server (then the node
    # imports it itself, as before).
    ctx.set_forkserver_preload(["proc", "s3fs", "speedtronic.diloco.store_remote"])
    return ctx


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """Runs in the forked node: its own environment and log, then proc.main()."""
    os.environ.clear()
    os.environ.update(env)  # crash points, outage flag, AWS endpoint: all read at call time
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import proc  # already imported by the server: a dict lookup

    sys.argv = [str(_HERE / "proc.py"), *argv]
    proc.main()  # SystemExit(n) becomes the exit code, os._exit(n) too


class Node:
    """One node process; the subset of ``subprocess.Popen`` the fault tests call."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = Path(log_path)
        self._p = _context().Process(target=_child, args=(list(argv), dict(env),
                                                          str(self.log_path)), daemon=False)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"diloco node {self.pid}", timeout or 0.0)
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self._p.exitcode is None:
            self._p.kill()
