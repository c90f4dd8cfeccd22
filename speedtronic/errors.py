"""Exception types shared by every Speedtronic module.

The CLI turns any :class:`SpeedtronicError` into one ``speedtronic: error: ...`` line and exit
code 2, so raising one of these is how a module reports a problem the *user* can fix.
"""

from __future__ import annotations


class SpeedtronicError(Exception):
    """Base class for user-facing errors (bad input, unusable files, unmet requirements)."""


class ConfigError(SpeedtronicError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    Subclasses ``ValueError`` so code that validates arguments generically still catches it.
    """


class NonFiniteError(SpeedtronicError):
    """The loss, a gradient norm or a weight became NaN or infinite (``train.on_nonfinite``).

    Raised before anything non-finite is written: every committed checkpoint stays finite."""


class RunLockedError(SpeedtronicError):
    """Another live process holds the run directory's lock (one run per directory)."""


class RunPreempted(Exception):  # noqa: N818 - a stop that was asked for, not a failure
    """A preemption signal (SIGTERM, SIGINT, SIGUSR1, ...) stopped the run at a step boundary
    after its checkpoint was saved. Not a :class:`SpeedtronicError`: the CLI exits with
    :attr:`exit_code` (128 + the signal number, as a shell reports a killed command: 143 for
    SIGTERM, 130 for SIGINT), or 0 when the job was requeued."""

    def __init__(self, signum: int, message: str, *, requeued: bool = False) -> None:
        super().__init__(message)
        self.signum = signum
        self.requeued = requeued

    @property
    def exit_code(self) -> int:
        return 0 if self.requeued else 128 + self.signum
