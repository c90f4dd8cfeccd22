"""Host (CPU) memory: make glibc's malloc keep freed memory for a CPU training process.

A CPU training step allocates every activation afresh (PyTorch's CPU allocator is plain
``posix_memalign``, no cache) and frees it in the backward. With glibc's defaults, freed memory
at the top of the heap beyond twice the (dynamic) mmap threshold goes back to the kernel, and
the next step page-faults it in again, zero-filled. For 60 steps of the short-run model on one
thread: with glibc's defaults 194,667 minor page faults and 5.73 s, with :func:`tune_malloc`
16,957 faults and 5.22 s (0.91x; 0.97x in the run at 4b677f7), peak resident memory 331 and
329 MiB, 323 and 329 MiB right after training (``benchmarks/results/host_malloc_cpu.md``); a
whole ``speedtronic train`` run of ``bench_short_run.py``'s YAML took 14.71 s against 15.54 s
(``short_run_cpu.md``).

:func:`tune_malloc` sets two fixed thresholds with ``mallopt`` (setting any threshold also
switches off glibc's dynamic adjustment, so both are set together):

* ``M_MMAP_THRESHOLD`` 32 MiB, glibc's own ceiling for its dynamic threshold: blocks below it come
  from the heap, which is reused, instead of a fresh ``mmap`` each time;
* ``M_TRIM_THRESHOLD`` 1 GiB: up to that much free memory stays in the heap between steps.

The cost is that the process's resident memory does not shrink after its peak, which a
training process reaches again every step anyway (the peak itself did not grow). Setting only
the trim threshold is worse than nothing: every block of 128 KiB or more is then ``mmap``-ed
afresh (2.2 M faults, 1.39x the time, same file).

It changes the whole process, so the library never does it by itself: the ``speedtronic train``
and ``compare`` commands run inside :func:`requested_for_cpu_runs`, and the run builder then
applies it once the device is known to be the CPU (one log line; ``compare`` repeats it only
when it changes). Python users may call :func:`tune_malloc`. It leaves malloc alone where it
cannot be sure what it changes: not glibc, another allocator preloaded (jemalloc, tcmalloc), or
malloc settings of the user's own in the environment. ``SPEEDTRONIC_HOST_MALLOC=0`` keeps
glibc's defaults.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator

HOST_MALLOC_ENV = "SPEEDTRONIC_HOST_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
#: Environment settings through which a user already tunes glibc's malloc; any of them wins.
USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                   "MALLOC_MMAP_MAX_")

_applied: str | None = None
_requested = False
_last_logged: str | None = None


def _enabled() -> bool:
    """``SPEEDTRONIC_HOST_MALLOC``: unset, 1/true/yes/on tune; 0/false/no/off keep defaults."""
    value = os.environ.get(HOST_MALLOC_ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{HOST_MALLOC_ENV}={os.environ[HOST_MALLOC_ENV]!r} is not valid: use 1 "
                     "(tune glibc malloc for CPU runs, the default) or 0 (keep its defaults)")


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (musl and others lack ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _malloc_is_interposed(libc: ctypes.CDLL) -> bool | None:
    """Whether the process's ``malloc`` is not glibc's (an ``LD_PRELOAD``-ed allocator); None if
    that cannot be told."""
    try:
        process = ctypes.CDLL(None)
        return (ctypes.cast(process.malloc, ctypes.c_void_p).value
                != ctypes.cast(libc.malloc, ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return None


def _user_settings() -> list[str]:
    names = [name for name in USER_MALLOC_ENV if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return names


def tune_malloc() -> str:
    """Keep freed host memory in this process (see the module docstring); returns the decision
    as one line, ``"host malloc: ..."``, for the log. Safe to call more than once.

    Raises ``ValueError`` for a ``SPEEDTRONIC_HOST_MALLOC`` value that is neither on nor off."""
    global _applied
    if _applied is not None:
        return _applied
    if not _enabled():
        return f"host malloc: glibc defaults kept ({HOST_MALLOC_ENV}=" \
               f"{os.environ[HOST_MALLOC_ENV].strip()})"
    libc = _glibc()
    if libc is None:
        return f"host malloc: unchanged (not glibc: {sys.platform})"
    interposed = _malloc_is_interposed(libc)
    if interposed is None:
        return "host malloc: unchanged (could not tell which malloc this process uses)"
    if interposed:
        return "host malloc: unchanged (malloc is not glibc's: a preloaded allocator)"
    own = _user_settings()
    if own:
        return f"host malloc: unchanged (your {', '.join(own)} setting is kept)"
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return "host malloc: unchanged (mallopt refused the mmap threshold)"
    version = libc.gnu_get_libc_version().decode()
    if libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        _applied = (f"host malloc: glibc {version}: mmap threshold 32 MiB set, trim threshold "
                    "refused (glibc's dynamic thresholds are now off)")
        return _applied
    _applied = (f"host malloc: glibc {version} keeps freed memory (mmap threshold 32 MiB, "
                f"trim threshold 1 GiB; {HOST_MALLOC_ENV}=0 keeps the defaults)")
    return _applied


@contextlib.contextmanager
def requested_for_cpu_runs() -> Iterator[None]:
    """Within the block, :func:`apply_for_device` tunes malloc for runs on the CPU (the CLI's
    policy; a library user's process is left alone unless it asks). Validates the opt-out
    variable first, so a bad value fails before anything runs."""
    global _requested, _last_logged
    _enabled()
    _requested, _last_logged = True, None
    try:
        yield
    finally:
        _requested = False


def apply_for_device(device_type: str) -> str | None:
    """The decision line for a run on ``device_type`` inside :func:`requested_for_cpu_runs`, or
    None (outside it, or the same line as the previous run's: ``compare`` builds many runs).
    Only CPU runs are tuned: the measurements are of CPU steps."""
    global _last_logged
    if not _requested:
        return None
    if device_type != "cpu":
        line = f"host malloc: not tuned for this run (device {device_type}; the thresholds are " \
               "for CPU steps)"
    else:
        line = tune_malloc()
    if line == _last_logged:
        return None
    _last_logged = line
    return line
