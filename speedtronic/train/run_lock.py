"""One run per directory: an exclusive ``flock`` held for the life of a run.

The lock file sits beside the run directory, ``<output_dir>/.<run name>.lock``, not inside it: a
fresh run moves a finished run's folder aside, and a lock inside would move with it. It holds
the holder's pid, host and start time (JSON), so a refused run can name who has it, and it
exists only while a run holds it (the holder deletes it as it lets go).

``flock`` is released by the kernel when its holder dies, however it dies (SIGKILL, OOM), so
there is no stale lock to break by hand: a lock file left by a holder that is gone is simply
taken, with a log line naming the previous holder. Deleting a lock file races with a process
that opened it just before: after locking, the holder checks that its descriptor is still the
file at the path (same inode) and starts over if not.

Where ``fcntl`` does not exist (Windows) the lock file itself is the lock: created exclusively,
it names its holder, and a run finding one is refused, saying whether that pid still runs on
this host; a killed run's file stays until deleted by hand (taking it over automatically let
two runs starting at once both hold it). Without any lock a second run moved a live run's
folder aside and the two mixed their checkpoints (the live run's ``keep_last`` deleted the
newcomer's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from .._process import pid_alive
from ..errors import RunLockedError, SpeedtronicError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("speedtronic.runtime")

__all__ = ["RunLock", "RunLockedError", "held_by", "lock_path_for", "pid_alive"]


def lock_path_for(run_dir: Path) -> Path:
    """``<output_dir>/.<name>.lock`` for the run directory ``<output_dir>/<name>``."""
    return run_dir.with_name(f".{run_dir.name}.lock")


def held_by(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock right now (``pid 123 on host (train since ...)``), or None
    when no live run does: ``validate`` reports it, since ``train`` would be refused. Probes
    with a shared lock, released at once."""
    if fcntl is None:
        holder = _pid_file_holder(lock_path_for(Path(run_dir)))
        return _describe(holder) if holder is not None and _holder_may_live(holder) else None
    try:
        f = open(lock_path_for(Path(run_dir)), encoding="utf-8")  # noqa: SIM115
    except OSError:  # no lock file: no run holds it
        return None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _describe(_read_holder(f))
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


class RunLock:
    """An acquired run lock; :meth:`release` (or process exit) frees it.

    Args:
        run_dir: the run directory to lock (its parent is created if needed).
        purpose: what the holder does, written into the lock file (``train``, ``resume``).
    """

    def __init__(self, run_dir: Path, purpose: str = "train") -> None:
        self.run_dir = Path(run_dir)
        self.path = lock_path_for(self.run_dir)
        self._file: Any = None
        self._made_parent = False
        self._pid_file = False
        parent = self.path.parent
        self._made_parent = not parent.exists()  # removed again on release if still empty
        parent.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            self._take_pid_file(purpose)
            return
        while True:
            f = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run's life
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(f)
                f.close()
                raise RunLockedError(
                    f"run directory {self.run_dir} is in use by {_describe(holder)} (lock "
                    f"{self.path}); wait for that run to end or stop it, or train under another "
                    "run.name / run.output_dir") from None
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()  # the holder deleted it between our open and our lock: open it again
        previous = _read_holder(f)
        if previous:  # a clean release empties the file: this holder died without releasing
            logger.warning("run lock: taking over %s from %s, which is gone (its run ended "
                           "without releasing it)", self.path, _describe(previous))
        try:
            f.seek(0)
            f.truncate()
            f.write(_holder_json(purpose))
            f.flush()
        except OSError as exc:  # a full disk: one line naming the file, not a bare errno
            f.close()
            raise SpeedtronicError(f"run lock: cannot write {self.path} ({exc.strerror or exc}); "
                                 f"free space in {self.path.parent}") from None
        self._file = f

    def _take_pid_file(self, purpose: str) -> None:
        """No ``fcntl``: create the lock file exclusively (atomic, so two starters never both
        hold it); a file left by a run that was killed is not taken over automatically: two
        runs starting at once both took one over (each deleted the other's new lock), so the
        message says whether its holder still runs and to delete the file if not."""
        for _ in range(3):  # a holder that releases while we look: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _pid_file_holder(self.path)
                if holder is None:  # released meanwhile
                    continue
                state = ("in use by" if _holder_may_live(holder) else
                         "locked by a run that is gone:")
                raise RunLockedError(
                    f"run directory {self.run_dir} is {state} {_describe(holder)} (lock "
                    f"{self.path}, no fcntl on this platform: a killed run's lock stays); "
                    "wait for that run to end or stop it, or train under another run.name / "
                    "run.output_dir; if that run is gone, delete the lock file") from None
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(_holder_json(purpose))
            except OSError as exc:  # an empty lock file would refuse every later start
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise SpeedtronicError(f"run lock: cannot write {self.path} "
                                       f"({exc.strerror or exc}); free space in "
                                       f"{self.path.parent}") from None
            self._pid_file = True
            return
        raise RunLockedError(f"run directory {self.run_dir}: its lock {self.path} changed "
                             "hands while this run started; start it again")

    @property
    def held(self) -> bool:
        return self._file is not None or self._pid_file

    def release(self) -> None:
        """Delete the lock file and unlock it (idempotent)."""
        if self._pid_file:
            self._pid_file = False
            holder = _pid_file_holder(self.path)
            if holder is not None and holder.get("pid") == os.getpid():
                with contextlib.suppress(OSError):
                    self.path.unlink()
        f, self._file = self._file, None
        if f is None:
            self._remove_made_parent()
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: see the module docstring
        except OSError:
            pass
        finally:
            f.close()  # closing the descriptor releases the flock
        self._remove_made_parent()

    def _remove_made_parent(self) -> None:
        if self._made_parent:
            self._made_parent = False
            with contextlib.suppress(OSError):  # only if empty: a failed first start
                self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_json(purpose: str) -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S"), "purpose": purpose})


def _pid_file_holder(path: Path) -> dict[str, Any] | None:
    """The holder named by a lock file (no ``fcntl``), or None when there is no file."""
    try:
        with open(path, encoding="utf-8") as f:
            return _read_holder(f)
    except FileNotFoundError:
        return None
    except OSError:
        return {"unreadable": True}


def _holder_may_live(holder: dict[str, Any]) -> bool:
    """A pid-file holder is gone only when it is on this host and its pid is not running (a
    file being written, unreadable or half-written, counts as live)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    return pid == os.getpid() or pid_alive(pid)


def _read_holder(f: Any) -> dict[str, Any]:
    try:
        f.seek(0)
        text = f.read(4096)
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}


def _describe(holder: dict[str, Any]) -> str:
    if not holder or holder.get("unreadable"):
        return "another process (its lock file has no readable holder)"
    return (f"pid {holder.get('pid')} on host {str(holder.get('host'))[:64]} "
            f"({holder.get('purpose', 'train')} since {holder.get('since')})")
