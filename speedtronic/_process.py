"""Process liveness, shared by the layers that clean up after interrupted writers.

A writer names its temporary file or folder ``<name>.tmp-<pid>``; a later process removes one
whose writer is gone (``train``'s checkpoint folder, ``prepare``'s token cache). Layer 0: it
imports nothing from the package.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pid_alive", "temp_owner_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 probes without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def temp_owner_alive(tmp: Path) -> bool:
    """Whether the process that owns temp file or folder ``...tmp-<pid>`` (the pid after the
    last ``-``) still runs on this host. Our own pid counts as dead: a temp file of ours is from
    an earlier, failed write."""
    pid = tmp.name.rsplit("-", 1)[-1]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    return pid_alive(int(pid))
