"""The CLI's console: log lines on stdout (warnings on stderr while a command prints output a
program may read), one stamp per line, and a quiet exit once stdout's reader is gone."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = ["console_for_output", "setup_logging", "stdout_to_devnull"]


class _ConsoleFormatter(logging.Formatter):
    """``HH:MM:SS message`` for info, ``HH:MM:SS WARNING message`` for anything louder."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, "%H:%M:%S")
        level = "" if record.levelno <= logging.INFO else f"{record.levelname} "
        return f"{stamp} {level}{record.getMessage()}"


class _CurrentStdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is *now*: ``main()`` may run several times in one
    process (tests, notebooks) with stdout swapped in between, and a handler bound to the first
    stream then writes to a closed file."""

    to_stderr = False
    """Set by :func:`console_for_output`: stdout holds a command's output (JSON, YAML, text)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr if self.to_stderr else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        # `speedtronic train | head`: once the reader is gone, the run goes on without a console
        # (its metrics.jsonl and log file still get everything) instead of a traceback per line.
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            stdout_to_devnull()
            return
        super().handleError(record)


def stdout_to_devnull() -> None:
    """Point stdout at /dev/null once its reader is gone: later writes, and the interpreter's
    final flush, then succeed quietly instead of raising BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@contextlib.contextmanager
def console_for_output() -> Iterator[None]:
    """While a command prints what a program may read (``validate``'s config, ``env --json``,
    ``sample``'s text): info lines are dropped and warnings go to stderr. A warning once landed
    at the top of ``validate --format json``'s stdout, which then did not parse."""
    root = logging.getLogger("speedtronic")
    handlers = [h for h in root.handlers if isinstance(h, _CurrentStdoutHandler)]
    level = root.level
    root.setLevel(logging.WARNING)
    for h in handlers:
        h.to_stderr = True
    try:
        yield
    finally:
        root.setLevel(level)
        for h in handlers:
            h.to_stderr = False


def setup_logging(debug: bool) -> None:
    """Send ``speedtronic`` log lines to the current stdout, one ``HH:MM:SS`` stamp each, at
    DEBUG with ``debug`` else INFO. Safe to call again: the console handler is added once, and
    the logger does not propagate, so a handler on the root logger never prints a line twice."""
    root = logging.getLogger("speedtronic")
    if not any(getattr(h, "_speedtronic_console", False) for h in root.handlers):
        handler = _CurrentStdoutHandler()
        handler.setFormatter(_ConsoleFormatter())
        handler._speedtronic_console = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
