"""Per-shape choice between two implementations of one operation, made by timing both once on
the user's GPU and remembered on disk.

Where two paths compute the same thing (standard vs Gram Newton-Schulz today; a hand-written
kernel vs cuBLAS next), which one is faster depends on the shape, the GPU, the driver and the
build, so no fixed rule is right everywhere (the H200 run: Gram won 2048x8192 by 1.5x and lost
2048x2048 by 1.16x). At the first use of a shape on CUDA :meth:`ShapeDispatch.choose` times every
candidate on the real buffers (CUDA events, median of 3 after a warm-up), keeps the default
unless another candidate is at least 5% faster (so the choice can only make things faster, never
flip on noise), and writes the table to
``$SPEEDTRONIC_CACHE_DIR`` (default ``~/.cache/speedtronic``)``/autotune-<fingerprint>.json``,
one file per GPU / driver / CUDA / torch / extension build. ``SPEEDTRONIC_AUTOTUNE=0`` turns it
off: the static rule of each caller decides. ``speedtronic env`` prints the table.

A candidate that raises is dropped for that shape with one log line; CPU runs and CUDA-graph
capture never time anything (the caller's default is used).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["DISABLE_ENV", "ShapeDispatch", "active_dispatch", "cuda_event_timer", "fingerprint"]

logger = logging.getLogger("speedtronic.autotune")

DISABLE_ENV = "SPEEDTRONIC_AUTOTUNE"
CACHE_ENV = "SPEEDTRONIC_CACHE_DIR"
MIN_GAIN = 0.05
"""A non-default candidate must be at least this much faster (5%) to be chosen."""

Timer = Callable[[Callable[[], object]], float]


def cuda_event_timer(fn: Callable[[], object], warmup: int = 1, repeat: int = 3) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _extension_build_id() -> str:
    """Size and mtime of the loaded ``speedtronic._C`` (a rebuild invalidates the table)."""
    from . import extension as kernels

    so = kernels.status().so_path
    if not so:
        return "none"
    try:
        st = os.stat(so)
    except OSError:
        return "none"
    return f"{st.st_size}-{int(st.st_mtime)}"


def fingerprint() -> dict[str, str]:
    """What a timing table is valid for: device, driver, CUDA, torch, extension build."""
    from .. import __version__

    info = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
            "speedtronic": __version__, "extension": _extension_build_id()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["device"] = f"{props.name} sm_{props.major}{props.minor}"
        driver = getattr(torch.cuda, "driver_version", None)
        info["driver"] = str(driver()) if callable(driver) else "unknown"
    else:
        info["device"] = "cpu"
    return info


def _default_path(info: dict[str, str]) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "speedtronic")
    digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"autotune-{digest}.json"


class ShapeDispatch:
    """A remembered ``key -> chosen candidate`` table for one device.

    Args:
        path: the JSON file (None: memory only).
        timer: ``timer(fn) -> milliseconds`` (default: CUDA events).
        enabled: time candidates at all (default: a CUDA device is present and
            ``SPEEDTRONIC_AUTOTUNE`` is not ``0``).
        info: the fingerprint stored with the table.
        device_type: the tensors whose calls are timed (``"cuda"``; tests use ``"cpu"`` with a
            fake ``timer``).
    """

    def __init__(self, path: Path | None = None, timer: Timer | None = None,
                 enabled: bool | None = None, info: dict[str, str] | None = None,
                 device_type: str = "cuda") -> None:
        if enabled is None:
            enabled = (torch.cuda.is_available()
                       and os.environ.get(DISABLE_ENV, "1").strip().lower() not in
                       ("0", "false", "no", "off"))
        self.enabled = enabled
        self.device_type = device_type
        self.path = path
        self.timer = timer or cuda_event_timer
        self.info = info or {}
        self._lock = threading.Lock()
        self.entries: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return dict(data.get("entries", {}))
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("autotune: ignoring unreadable table %s (%s)", self.path, exc)
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        tmp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            payload = json.dumps({"fingerprint": self.info, "entries": self.entries}, indent=1)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".autotune-")
            with os.fdopen(fd, "w") as fh:
                fh.write(payload)
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only home must not stop training
            if tmp is not None:  # a full disk left one .autotune-* file per attempt
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            logger.warning("autotune: could not write %s (%s); keeping the table in memory",
                           self.path, exc)

    def choose(self, key: str, candidates: Mapping[str, Callable[[], object]],
               default: str) -> str:
        """The candidate to use for ``key`` (timing them now if this key is new)."""
        if default not in candidates:
            raise ValueError(f"autotune: default {default!r} is not a candidate of {key!r}")
        cached = self.entries.get(key)
        if cached is not None and cached.get("choice") in candidates:
            return str(cached["choice"])
        if not self.enabled or len(candidates) < 2 or _capturing():
            return default
        times: dict[str, float] = {}
        for name, fn in candidates.items():
            try:
                times[name] = float(self.timer(fn))
            except Exception as exc:  # noqa: BLE001 - a failing path is simply not chosen
                logger.warning("autotune: %s failed for %s (%s: %s); not using it", name, key,
                               type(exc).__name__, exc)
        if default not in times:
            choice = min(times, key=times.__getitem__) if times else default
        else:
            best = min(times, key=times.__getitem__)
            choice = best if times[best] <= (1.0 - MIN_GAIN) * times[default] else default
        with self._lock:
            self.entries[key] = {"choice": choice, "ms": {k: round(v, 4) for k, v in
                                                         times.items()}}
            self._save()
        logger.info("autotune: %s -> %s (%s)", key, choice,
                    ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
        return choice

    def table(self) -> list[dict[str, Any]]:
        """Rows ``{"key", "choice", "ms"}`` sorted by key (for ``speedtronic env``)."""
        return [{"key": k, **v} for k, v in sorted(self.entries.items())]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_active: ShapeDispatch | None = None
_active_lock = threading.Lock()


def active_dispatch() -> ShapeDispatch:
    """The process-wide table for the current device (created on first use)."""
    global _active
    with _active_lock:
        if _active is None:
            info = fingerprint()
            _active = ShapeDispatch(_default_path(info), info=info)
        return _active
