"""The one door to the compiled CUDA extension ``speedtronic._C``.

Nothing else in the package imports ``speedtronic._C``. :func:`load` decides, once per process,
whether the hand-written CUDA kernels are used, and records why not when they are not:

* ``SPEEDTRONIC_DISABLE_KERNELS=1`` disables them (the pure-PyTorch ops in
  :mod:`speedtronic.kernels.ops` then run everywhere);
* a CPU-only torch, a missing build, a build for another torch version, or a GPU whose
  architecture is not in the binary all fall back instead of failing.

Importing the extension registers CUDA implementations of the ``speedtronic::*`` ops with
``TORCH_LIBRARY_IMPL(speedtronic, CUDA, m)``; the dispatcher then prefers them over the
pure-PyTorch default for CUDA tensors, so callers never branch on the kernels themselves.

Loading never raises: every failure becomes a ``fallback: <reason>`` status, logged as one line
on the ``speedtronic.kernels`` logger (``cuda kernels: loaded (sm_90)`` or
``cuda kernels: fallback: <reason>``). :func:`env_info` feeds ``speedtronic env``.

This module is a leaf: it imports nothing from the package. :mod:`speedtronic.kernels.ops` owns
the op list; it defines every schema first and then calls ``load(op_names=OP_NAMES)``, so the CUDA
implementations in the binary always attach to ops that exist. Until then :func:`status`
reports "not loaded" instead of importing the binary out of order.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("speedtronic.kernels")

DISABLE_ENV = "SPEEDTRONIC_DISABLE_KERNELS"
EXTENSION = "speedtronic._C"
#: Written next to the shared object by setup.py's build step; read *before* importing the
#: binary, because an extension built against another torch can abort the interpreter on
#: import (a crash no try/except can catch).
BUILD_INFO_NAME = "_C.build.json"

NOT_LOADED = ("not loaded yet: import speedtronic.kernels.ops (it defines the op schemas, then "
              "loads)")


@dataclass(frozen=True)
class KernelStatus:
    """What :func:`load` decided. ``active`` is True only when CUDA tensors will use our kernels."""

    active: bool
    reason: str = ""
    """Why the kernels are not active (empty when active)."""
    so_path: str | None = None
    """Path of the shared object, when one was found."""
    so_arches: tuple[str, ...] = ()
    """Architectures compiled into the binary, e.g. ``("sm_80", "sm_90", "compute_90")``."""
    device_arch: str | None = None
    """The current CUDA device's architecture, e.g. ``"sm_90"`` (None without a device)."""
    built_with_torch: str | None = None
    """torch version the extension was compiled against."""
    imported: bool = False
    """True when the binary was imported (its CUDA impls are registered with the dispatcher)."""
    registered_ops: tuple[str, ...] = field(default_factory=tuple)
    """Ops with a CUDA kernel registered, checked through the dispatcher after import."""

    def line(self) -> str:
        """The one capability line that is logged."""
        if self.active:
            return f"cuda kernels: loaded ({self.device_arch})"
        return f"cuda kernels: fallback: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_lock = threading.RLock()
_status: KernelStatus | None = None
#: The ops the extension must implement for CUDA, as handed over by speedtronic.kernels.ops.
_expected_ops: tuple[str, ...] = ()


def _find_extension() -> Path | None:
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin)


def read_build_info(so_path: Path) -> dict[str, Any]:
    """The JSON setup.py wrote beside the binary ({} when absent or unreadable)."""
    try:
        return json.loads((so_path.parent / BUILD_INFO_NAME).read_text())
    except (OSError, ValueError):
        return {}


def _torch_base(version: str) -> str:
    """``2.14.1+cu130`` -> ``2.14.1`` (local tags do not change the C++ ABI we depend on)."""
    return version.split("+", 1)[0]


def parse_arch_list(text: str) -> tuple[str, ...]:
    """Parse ``__CUDA_ARCH_LIST__``-style ``"800,900"`` or torch-style ``"8.0;9.0+PTX"``.

    Returns SASS entries as ``sm_XY`` and embedded PTX as ``compute_XY``.
    """
    out: list[str] = []
    for raw in text.replace(";", ",").replace(" ", ",").split(","):
        item = raw.strip()
        if not item:
            continue
        ptx = item.endswith("+PTX")
        item = item.removesuffix("+PTX")
        suffix = "a" if item.endswith("a") else ""
        item = item.removesuffix("a")
        if "." in item:
            major, minor = item.split(".", 1)
            num = f"{int(major)}{int(minor)}"
        elif item.isdigit() and len(item) >= 3:  # nvcc's 800, 900
            num = str(int(item) // 10)
        elif item.isdigit():
            num = item
        else:
            continue
        out.append(f"sm_{num}{suffix}")
        if ptx:
            out.append(f"compute_{num}{suffix}")
    return tuple(dict.fromkeys(out))


def arch_compatible(so_arches: tuple[str, ...], major: int, minor: int) -> bool:
    """True when the binary can run on a device of compute capability ``major.minor``.

    SASS for sm_XY runs on the same major with minor >= Y (``a`` variants only on exactly XY);
    PTX for compute_XY is JIT-compiled by the driver for any device >= XY.
    """
    dev = major * 10 + minor
    for arch in so_arches:
        kind, _, num = arch.partition("_")
        exact = num.endswith("a")
        value = int(num.removesuffix("a"))
        if kind == "sm":
            if exact and value == dev:
                return True
            if not exact and value // 10 == major and value <= dev:
                return True
        elif kind == "compute" and value <= dev and not exact:
            return True
    return False


def _so_arches(so_path: Path, info: dict[str, Any]) -> tuple[str, ...]:
    """SASS arches from the binary itself (exported C symbol), plus the PTX entries recorded in
    the build JSON (the symbol cannot tell whether PTX was embedded)."""
    from_json = parse_arch_list(str(info.get("arch_list", "")))
    try:
        lib = ctypes.CDLL(str(so_path))  # already loaded by the import: no second init
        fn = lib.speedtronic_cuda_arch_list
        fn.restype = ctypes.c_char_p
        text = fn().decode()
    except (OSError, AttributeError):
        text = ""
    if not text:
        return from_json
    return tuple(dict.fromkeys(parse_arch_list(text)
                               + tuple(a for a in from_json if a.startswith("compute_"))))


def expected_ops() -> tuple[str, ...]:
    """The ops that must have a CUDA kernel (empty until :mod:`.ops` has loaded)."""
    return _expected_ops


def registered_cuda_ops() -> tuple[str, ...]:
    """Names from :func:`expected_ops` that have a CUDA kernel in the dispatcher right now."""
    import torch

    found = []
    for name in _expected_ops:
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"speedtronic::{name}", "CUDA"):
                found.append(name)
        except RuntimeError:
            continue
    return tuple(found)


def _decide() -> KernelStatus:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return KernelStatus(False, f"disabled by {DISABLE_ENV}=1")
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        return KernelStatus(False, f"torch not importable ({exc})")
    if torch.version.cuda is None:
        return KernelStatus(False, f"torch {torch.__version__} is a CPU-only build")
    so_path = _find_extension()
    if so_path is None:
        return KernelStatus(
            False,
            "speedtronic._C is not built (needs nvcc; see README 'CUDA kernels': "
            "pip install --no-build-isolation .)",
        )
    info = read_build_info(so_path)
    built = info.get("torch_version")
    base = dict(so_path=str(so_path), built_with_torch=built)
    if built and _torch_base(built) != _torch_base(torch.__version__):
        return KernelStatus(
            False,
            f"speedtronic._C was built for torch {built} but torch {torch.__version__} is "
            "running; rebuild with pip install --no-build-isolation .",
            **base,
        )
    # Check the device against the arches recorded at build time *before* importing: once
    # imported, the CUDA impls are registered and would fail with "no kernel image".
    dev = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        dev = f"sm_{major}{minor}"
        info_arches = parse_arch_list(str(info.get("arch_list", "")))
        if info_arches and not arch_compatible(info_arches, major, minor):
            return KernelStatus(
                False,
                f"binary has {','.join(info_arches)} but the device is {dev}; rebuild with "
                f"TORCH_CUDA_ARCH_LIST={major}.{minor}",
                so_arches=info_arches, device_arch=dev, **base,
            )
    if not _expected_ops:  # the schemas do not exist yet: importing now would attach to nothing
        return KernelStatus(False, NOT_LOADED, **base)
    try:
        importlib.import_module(EXTENSION)
    except Exception as exc:  # noqa: BLE001 - any import failure means "fall back"
        return KernelStatus(False, f"importing speedtronic._C failed: {exc}", **base)
    common = dict(base, so_arches=_so_arches(so_path, info), imported=True,
                  registered_ops=registered_cuda_ops(), device_arch=dev)
    if dev is None:
        return KernelStatus(False, "no CUDA device visible (extension imported)", **common)
    so_arches = common["so_arches"]
    if so_arches and not parse_arch_list(str(info.get("arch_list", ""))):
        # No recorded list (TORCH_CUDA_ARCH_LIST unset): torch built the build machine's arch
        # and PTX of it, which the driver compiles for any newer device; the binary's own
        # symbol names the SASS only.
        newest = max((a for a in so_arches if a.startswith("sm_")),
                     key=lambda a: int(a[3:].removesuffix("a")), default=None)
        if newest is not None:
            so_arches = (*so_arches, "compute_" + newest[3:].removesuffix("a"))
    if so_arches and not arch_compatible(so_arches, major, minor):
        # The build JSON records no arches for a plain `pip install .` (TORCH_CUDA_ARCH_LIST
        # unset): the check before the import passed, and an sm_80/sm_90 binary reported
        # "loaded" on an sm_75 device. The registered kernels stay unused (ops.kernel_or_fallback
        # reads this status).
        return KernelStatus(False, f"binary has {','.join(so_arches)} but the device is {dev}; "
                            f"rebuild with TORCH_CUDA_ARCH_LIST={major}.{minor}", **common)
    ops = common["registered_ops"]
    missing = [n for n in _expected_ops if n not in ops]
    if missing:
        return KernelStatus(False, f"CUDA kernels missing for {', '.join(missing)}", **common)
    return KernelStatus(True, "", **common)


def load(force: bool = False, *, op_names: tuple[str, ...] | None = None) -> KernelStatus:
    """Decide (once) whether the CUDA kernels are used; log the decision; never raise.

    ``op_names`` is the op list of :mod:`speedtronic.kernels.ops`, passed once its schemas exist.
    Called before that, a decision that needs the binary is not cached: the status says "not loaded
    yet" until ``speedtronic.kernels.ops`` is imported.
    """
    global _status, _expected_ops
    with _lock:
        if op_names is not None:
            _expected_ops = tuple(op_names)
        if _status is not None and not force:
            return _status
        try:
            st = _decide()
        except Exception as exc:  # noqa: BLE001 - a loader bug must not break training
            st = KernelStatus(False, f"loader error: {type(exc).__name__}: {exc}")
        if st.reason == NOT_LOADED:
            return st
        _status = st
    logger.info(st.line())
    return st


def status() -> KernelStatus:
    """The cached decision (decides now if the op schemas are defined, else "not loaded")."""
    return _status if _status is not None else load()


def available() -> bool:
    """True when CUDA tensors will run through the hand-written kernels."""
    return status().active


def env_info() -> dict[str, Any]:
    """Facts for ``speedtronic env``: path, arches in the .so vs the device, and the decision."""
    st = status()
    return {
        "cuda_kernels": "loaded" if st.active else "fallback",
        "reason": st.reason or None,
        "extension": st.so_path,
        "extension_arches": ",".join(st.so_arches) or None,
        "device_arch": st.device_arch,
        "built_with_torch": st.built_with_torch,
        "cuda_ops_registered": (f"{len(st.registered_ops)}/{len(_expected_ops)}" if st.imported
                                else None),
    }
