"""Process liveness, shared by the layers that clean up after interrupted writers.

A writer names its temporary file or folder ``<name>.tmp-<pid>``; a later process removes one
whose writer is gone (``train``'s checkpoint folder, ``prepare``'s token cache). Layer 0: it
imports nothing from the package.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["pid_alive", "temp_owner_alive"]


#: Win32 constants of the liveness probe (winnt.h / winerror.h / minwinbase.h).
_PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
_ERROR_ACCESS_DENIED = 5
_STILL_ACTIVE = 259


def _pid_alive_windows(pid: int, kernel32: Any = None,
                       last_error: Callable[[], int] | None = None) -> bool:
    """Windows has no signal 0: ``os.kill(pid, 0)`` sends CTRL_C_EVENT there (0 is its value)
    and raises a plain OSError for a pid that is gone. Open the process for a query instead:
    refused access means it exists; otherwise it runs while its exit code is STILL_ACTIVE.
    ``kernel32`` / ``last_error``: the Win32 calls (tests pass stand-ins)."""
    import ctypes

    if kernel32 is None:
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        last_error = ctypes.get_last_error  # type: ignore[attr-defined]
        # HANDLE is pointer-sized: ctypes' default int result would cut a 64-bit handle
        kernel32.OpenProcess.restype = wintypes.HANDLE
        kernel32.OpenProcess.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.DWORD)
        kernel32.GetExitCodeProcess.argtypes = (wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD))
        kernel32.GetExitCodeProcess.restype = wintypes.BOOL
        kernel32.CloseHandle.argtypes = (wintypes.HANDLE,)
    handle = kernel32.OpenProcess(_PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
    if not handle:
        return last_error is not None and last_error() == _ERROR_ACCESS_DENIED
    try:
        code = ctypes.c_ulong(0)  # DWORD
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True  # it exists (a handle was given); its state is unknown
        return code.value == _STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 probes without sending;
    on Windows a query handle, see :func:`_pid_alive_windows`)."""
    if pid <= 0:
        return False
    if os.name == "nt":
        return _pid_alive_windows(pid)
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
