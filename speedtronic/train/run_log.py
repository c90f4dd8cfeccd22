"""``logging.file``: the run's log lines in a file, checked before anything is written.

:func:`check_log_file` refuses a path that cannot be appended to before an earlier run is moved
aside, and holds the build's log lines in memory; :func:`open_log_file` writes them to the file
once the run directory is prepared (a file inside the run directory must follow the new run)
and hands over to a file handler. :func:`remove_log_handlers` detaches a run's handlers only.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import sys
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError, SpeedtronicConfig
from .metrics import RUN_LOG_HANDLER

__all__ = ["HeldLogLines", "check_log_file", "open_log_file", "remove_log_handlers"]


class HeldLogLines(logging.handlers.MemoryHandler):
    """The build's log lines, held until ``path`` can be opened (see :func:`check_log_file`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(capacity=100_000, flushLevel=logging.CRITICAL + 1)
        self.path = path
        self.set_name(RUN_LOG_HANDLER)


def check_log_file(cfg: SpeedtronicConfig, run_dir: Path) -> HeldLogLines | None:
    """``logging.file``, checked before anything is written, with a handler that holds the
    build's log lines in memory until :func:`open_log_file` (after the run dir is prepared)
    writes them to the file: a file inside the run dir must follow the new run, and the file
    should still hold the device, model and resume lines.

    A file outside the run dir is opened (for appending) right away, so a path that cannot be
    written fails before an earlier run is moved aside."""
    if not cfg.logging.file:
        return None
    path = Path(cfg.logging.file)
    try:
        parent = path.parent.resolve()
        inside_run = parent == run_dir.resolve() or run_dir.resolve() in parent.parents
        problem = ("it is a directory" if path.is_dir() else
                   "its folder does not exist" if not parent.is_dir() and not inside_run else None)
        if problem is None and not inside_run:
            with open(path, "a", encoding="utf-8"):
                pass
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem:
        raise ConfigError(f"logging.file: cannot append to {str(path)[:300]} ({problem}); give "
                          "a writable file path in an existing folder or in the run directory")
    buffer = HeldLogLines(path)
    logging.getLogger("speedtronic").addHandler(buffer)
    return buffer


def open_log_file(buffer: HeldLogLines) -> logging.Handler:
    """Open ``logging.file`` for appending, write the held build lines to it in order and replace
    the holding handler with the file handler, which is returned. An unopenable path raises
    ConfigError naming ``logging.file``."""
    path = buffer.path
    path.parent.mkdir(parents=True, exist_ok=True)  # a folder inside the run directory
    try:
        handler = _RunLogFile(path, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"logging.file: cannot open {path} for appending "
                          f"({exc.strerror or exc}); give a writable file path") from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.set_name(RUN_LOG_HANDLER)
    root = logging.getLogger("speedtronic")
    root.removeHandler(buffer)  # first: a line logged while replaying must not land in it
    buffer.setTarget(handler)
    buffer.flush()  # the build's lines, in order, then the file handler takes over
    buffer.close()
    root.addHandler(handler)
    return handler


class _RunLogFile(logging.FileHandler):
    """``logging.file``: a write that fails (a full disk) says so once and writes nothing more
    there; the console and metrics.jsonl go on. logging's default printed a traceback for every
    later line (97 in a 100-step run), and the close at the end turned a finished run into
    exit 2."""

    _failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._failed:  # closed after a failed write (reopening would fail again)
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):  # a bad format in one call: logging's own report
            super().handleError(record)
            return
        self._failed = True  # stays attached: removing it here skipped the next handler
        with contextlib.suppress(OSError, ValueError):
            self.close()
        logging.getLogger("speedtronic.runtime").warning(
            "logging.file: writing %s failed (%s); the rest of this run is not logged there "
            "(the console and metrics.jsonl go on)", self.baseFilename, exc.strerror or exc)


def remove_log_handlers(handlers: Sequence[logging.Handler]) -> None:
    """Detach and close these handlers (only these: another run's log file keeps its own)."""
    root = logging.getLogger("speedtronic")
    for handler in handlers:
        root.removeHandler(handler)
        with contextlib.suppress(OSError):  # a full disk: the run itself is done
            handler.close()
