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
