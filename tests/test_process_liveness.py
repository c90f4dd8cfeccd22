"""speedtronic._process.pid_alive: the liveness probe behind stale-temp cleanup and run locks."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from speedtronic import _process


def test_a_running_process_is_alive_and_a_reaped_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _process.pid_alive(os.getpid())
    assert not _process.pid_alive(child.pid)
    assert not _process.pid_alive(0) and not _process.pid_alive(-5)


class _FakeKernel32:
    """The three Win32 calls, over a table of pid -> exit code (259 = STILL_ACTIVE)."""

    def __init__(self, exit_codes: dict[int, int], denied: set[int]) -> None:
        self.exit_codes, self.denied, self.error, self.open_handles = exit_codes, denied, 0, set()

    def OpenProcess(self, access: int, inherit: bool, pid: int) -> int:  # noqa: N802 - Win32
        assert access == 0x1000 and inherit is False
        if pid in self.denied:
            self.error = 5
            return 0
        if pid not in self.exit_codes:
            self.error = 87  # ERROR_INVALID_PARAMETER: no such process
            return 0
        self.open_handles.add(pid + 1000)
        return pid + 1000

    def GetExitCodeProcess(self, handle: int, out) -> int:  # noqa: N802
        ctypes.cast(out, ctypes.POINTER(ctypes.c_ulong))[0] = self.exit_codes[handle - 1000]
        return 1

    def CloseHandle(self, handle: int) -> int:  # noqa: N802
        self.open_handles.remove(handle)
        return 1


def test_windows_asks_for_a_query_handle_instead_of_sending_signal_0():
    """os.kill(pid, 0) is CTRL_C_EVENT on Windows, and a gone pid raised a plain OSError."""
    k32 = _FakeKernel32({10: 259, 11: 0, 12: 1}, denied={13})

    def alive(pid: int) -> bool:
        return _process._pid_alive_windows(pid, k32, lambda: k32.error)

    assert alive(10)                              # running
    assert not alive(11) and not alive(12)        # exited (with 0, with 1)
    assert not alive(99)                          # no such pid
    assert alive(13)                              # another user's: exists
    assert not k32.open_handles                   # every handle closed


def test_pid_alive_takes_the_windows_probe_on_windows(monkeypatch):
    asked = []
    monkeypatch.setattr(_process, "_pid_alive_windows", lambda pid: asked.append(pid) or True)
    monkeypatch.setattr(_process.os, "name", "nt")
    assert _process.pid_alive(4242) and asked == [4242]
