"""Host (CPU) memory: make glibc's malloc keep freed memory for a training process.

A CPU training step allocates every activation afresh (PyTorch's CPU allocator is plain
``posix_memalign``, no cache) and frees it in the backward. With glibc's defaults, freed memory
at the top of the heap beyond twice the (dynamic) mmap threshold goes back to the kernel, and
the next step page-faults it in again, zero-filled. For 60 steps of the short-run model on one
thread that was 123,526 minor page faults and 4.92 s; with :func:`tune_malloc` 17,341 faults and
4.76 s (0.97x; ``benchmarks/results/host_malloc_cpu.md``), and a whole ``speedtronic train`` run
of ``bench_short_run.py``'s YAML 13.53 s against 14.24 s (``short_run_cpu.md``).

:func:`tune_malloc` sets two fixed thresholds with ``mallopt`` (setting any threshold also
switches off glibc's dynamic adjustment, so both are set together):

* ``M_MMAP_THRESHOLD`` 32 MiB, glibc's own ceiling for its dynamic threshold: blocks below it come
  from the heap, which is reused, instead of a fresh ``mmap`` each time;
* ``M_TRIM_THRESHOLD`` 1 GiB: up to that much free memory stays in the heap between steps.

The cost is that the process's resident memory does not shrink after its peak, which a
training process reaches again every step anyway. Setting only the trim threshold is worse than
nothing: every block of 128 KiB or more is then ``mmap``-ed afresh (2.2 M faults, 1.55x the
time, same file).

It changes the whole process, so the library never calls it on import: the ``speedtronic train``
and ``compare`` commands do (one log line), and Python users may. ``SPEEDTRONIC_HOST_MALLOC=0``
keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

HOST_MALLOC_ENV = "SPEEDTRONIC_HOST_MALLOC"
M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: str | None = None


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


def tune_malloc() -> str:
    """Keep freed host memory in this process (see the module docstring); returns the decision
    as one line, ``"host malloc: ..."``, for the log. Safe to call more than once."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(HOST_MALLOC_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"host malloc: glibc defaults kept ({HOST_MALLOC_ENV}=0)"
    libc = _glibc()
    if libc is None:
        return f"host malloc: unchanged (not glibc: {sys.platform})"
    ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        return "host malloc: unchanged (mallopt refused the thresholds)"
    version = libc.gnu_get_libc_version().decode()
    _applied = (f"host malloc: glibc {version} keeps freed memory (mmap threshold 32 MiB, "
                f"trim threshold 1 GiB; {HOST_MALLOC_ENV}=0 keeps the defaults)")
    return _applied
