"""Deterministic crash points for the fault tests.

``SPEEDTRONIC_DILOCO_CRASH_AT=<name>`` makes the process ``os._exit(CRASH_EXIT_CODE)`` the
``SPEEDTRONIC_DILOCO_CRASH_COUNT``-th time (default 1st) it reaches ``crash_point(<name>)``: no
cleanup, no flush, exactly like a SIGKILL at that line. Unset, a crash point costs one dict
lookup. Names used: ``after_apply``, ``after_weights_written``, ``after_pointer_written``
(master) and ``store_tmp_written``, ``before_delta_put`` (worker upload).
"""

from __future__ import annotations

import os
import sys

CRASH_EXIT_CODE = 77

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Exit immediately here if the environment asks for a crash at ``name``."""
    if os.environ.get("SPEEDTRONIC_DILOCO_CRASH_AT") != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(os.environ.get("SPEEDTRONIC_DILOCO_CRASH_COUNT", "1")):
        sys.stderr.write(f"speedtronic.diloco: crash point {name!r} reached, exiting\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)
