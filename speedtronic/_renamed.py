"""Old names that still import, with a DeprecationWarning that gives the new one."""

from __future__ import annotations

import warnings
from collections.abc import Callable


def renamed(module: str, old: str, new: str, value: object) -> Callable[[str], object]:
    """A module ``__getattr__`` serving ``old`` as ``value`` (now called ``new``) with a warning."""

    def __getattr__(name: str) -> object:
        if name == old:
            warnings.warn(f"{module}.{old} is now {new}", DeprecationWarning, stacklevel=2)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
