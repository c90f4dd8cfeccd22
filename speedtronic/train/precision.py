"""Device, numeric-precision and compile decisions, made once at startup, one log line each.

Parameters and optimizer state always stay fp32; mixed precision only wraps the forward pass and
the loss in ``torch.autocast``. fp16 additionally needs a ``GradScaler`` (its 5-bit exponent
underflows small gradients), bf16 does not (same exponent range as fp32).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import SpeedtronicError

if TYPE_CHECKING:
    from ..config import SpeedtronicConfig

logger = logging.getLogger("speedtronic.precision")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionPlan:
    """What the trainer does for numerics on one device.

    Attributes:
        mode: the effective mode, ``bf16``, ``fp16`` or ``fp32`` (never ``auto``).
        requested: the configured mode (may be ``auto``).
        device_type: ``cpu``, ``cuda`` or ``mps``.
        reason: why ``mode`` was chosen (one short phrase, logged at startup).
    """

    mode: str
    requested: str
    device_type: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of autocast regions (fp32 = no autocast)."""
        return _DTYPES[self.mode]

    @property
    def autocast_enabled(self) -> bool:
        return self.mode != "fp32"

    @property
    def use_scaler(self) -> bool:
        """fp16 on CUDA needs loss scaling; bf16 and fp32 never do."""
        return self.mode == "fp16" and self.device_type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward + loss: ``torch.autocast`` in mixed modes, a no-op for fp32."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh ``GradScaler`` for fp16 on CUDA, else None."""
        return torch.amp.GradScaler("cuda") if self.use_scaler else None


def resolve_device(requested: str | torch.device | None) -> torch.device:
    """``auto``/None -> CUDA if available, else CPU. An unavailable explicit device is an error.

    MPS is never picked automatically: its autocast and fused-optimizer coverage is incomplete, so
    a user asks for it explicitly.
    """
    text = "auto" if requested is None else str(requested)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise SpeedtronicError(f"unknown device {text!r}; use auto, cpu, cuda, cuda:N or mps") \
            from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpeedtronicError(f"device {text!r} requested but CUDA is not available "
                                   f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SpeedtronicError(f"device {text!r} requested but only "
                                   f"{torch.cuda.device_count()} CUDA device(s) exist")
    if device.type == "mps" and not mps_available():
        raise SpeedtronicError(f"device {text!r} requested but MPS is not available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise SpeedtronicError(f"unsupported device type {device.type!r}; use cpu, cuda or mps")
    return device


def mps_available() -> bool:
    """Whether this torch has Apple's MPS backend and a device for it."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA, MPS; a no-op on CPU), before a wall-clock
    reading that must count it: MPS queues work as CUDA does, and the CUDA-only sync left its
    queued training inside the eval's or save's excluded time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _cuda_bf16_ok(device: torch.device) -> bool:
    try:
        with torch.cuda.device(device):
            return bool(torch.cuda.is_bf16_supported())
    except (RuntimeError, AssertionError):
        return False


def resolve_precision(mode: str, device: torch.device) -> PrecisionPlan:
    """Pick the effective precision for ``mode`` (auto|bf16|fp16|fp32) on ``device``.

    ``auto``: bf16 on CUDA that supports it (Ampere+), fp16 + GradScaler on older CUDA, fp32
    elsewhere. Explicit modes the device cannot run fall back with a warning:
    bf16 on CUDA without bf16 -> fp16; fp16 off CUDA -> fp32 (a GradScaler needs CUDA);
    bf16/fp16 on MPS -> fp32. bf16 on CPU is honoured (CPU autocast supports it).
    """
    dev = device.type
    if mode not in ("auto", "bf16", "fp16", "fp32"):
        raise SpeedtronicError(f"precision.mode must be auto, bf16, fp16 or fp32, got {mode!r}")
    if mode == "auto":
        if dev == "cuda":
            if _cuda_bf16_ok(device):
                return PrecisionPlan("bf16", mode, dev, "auto: CUDA supports bf16")
            return PrecisionPlan("fp16", mode, dev, "auto: CUDA without bf16, fp16 + GradScaler")
        return PrecisionPlan("fp32", mode, dev, f"auto: {dev} trains in fp32")
    if mode == "fp32":
        return PrecisionPlan("fp32", mode, dev, "requested")
    if dev == "cuda":
        if mode == "bf16" and not _cuda_bf16_ok(device):
            logger.warning("precision: bf16 requested but this GPU lacks bf16; using fp16 with a "
                           "GradScaler instead")
            return PrecisionPlan("fp16", mode, dev, "bf16 unsupported on this GPU")
        return PrecisionPlan(mode, mode, dev, "requested")
    if dev == "cpu" and mode == "bf16":
        return PrecisionPlan("bf16", mode, dev, "requested (CPU autocast)")
    logger.warning("precision: %s requested but unsupported on %s; using fp32 instead", mode, dev)
    return PrecisionPlan("fp32", mode, dev, f"{mode} unsupported on {dev}")


def max_memory_bytes(device: torch.device) -> int | None:
    """Peak memory of this process on ``device``: CUDA allocator peak, or host peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


AUTO_COMPILE_MIN_STEPS = 2000
"""``compile: auto`` compiles CUDA runs of at least this many steps: about 1.7x the break-even
measured on an H200 (see the ``compile`` config field)."""


def decide_compile(cfg: SpeedtronicConfig, device: torch.device) -> tuple[bool, str]:
    """``(compile?, why)`` for ``cfg.compile`` on ``device`` (one log line says both)."""
    if cfg.compile is True:
        return True, "compile: true"
    if cfg.compile is False:
        return False, "compile: false"
    if cfg.ooo_backprop:
        return False, ("auto: ooo_backprop: true was asked for, and the two are mutually "
                       "exclusive in this release")
    if device.type != "cuda":
        return False, (f"auto: no CUDA ({device.type}); compiling a CPU run costs more time "
                       "than it saves")
    if cfg.run.max_steps < AUTO_COMPILE_MIN_STEPS:
        return False, (f"auto: {cfg.run.max_steps} steps is shorter than the "
                       f"{AUTO_COMPILE_MIN_STEPS}-step threshold where compiling pays back; set "
                       "compile: true to compile anyway")
    return True, f"auto: a {cfg.run.max_steps}-step CUDA run"


def compile_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the compiler failed', not 'the model is wrong'.

    The trainer's compile fallback catches only these, so a model bug raised under
    ``torch.compile`` is raised again from the eager re-run instead of being hidden."""
    types: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import TorchDynamoException

        types.append(TorchDynamoException)
    except ImportError:
        pass
    try:
        from torch._inductor import exc as inductor_exc

        for name in ("InductorError", "CppCompileError", "CUDACompileError"):
            if isinstance(getattr(inductor_exc, name, None), type):
                types.append(getattr(inductor_exc, name))
    except ImportError:
        pass
    return tuple(types)
