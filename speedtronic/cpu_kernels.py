"""Fused fp32 CPU kernels for eager runs: SwiGLU and RMSNorm, forward and backward.

The reference model spends a one-thread CPU step mostly in GEMMs (near the core's peak) and in
memory-bound elementwise passes over ``(B, T, hidden)`` tensors. torch runs SwiGLU as five such
passes (silu and mul forward; mul, silu_backward and mul backward) and RMSNorm as about ten; the
kernels in ``csrc/cpu/fused_cpu.cpp`` do one pass each way. On the short-run YAML's model
(``benchmarks/bench_short_run.py``) forward + backward took 63.2 ms with torch's ops and 55.3 ms
with the kernels, on one thread (``benchmarks/results/cpu_layers.md``).

The library includes no torch or Python header and is loaded with :mod:`ctypes`, so a plain
``pip install -e .`` (build isolation, no torch at build time) compiles it in about a second;
setup.py skips it when no C++ compiler works, and everything then runs the torch ops.

:func:`usable` is the single gate. The kernels run only where they are measured to win and are
exact enough to be invisible: eager mode (under ``torch.compile`` inductor fuses these ops
itself), plain contiguous fp32 CPU tensors (no functorch transform, no tensor subclass), and at
most :data:`MAX_THREADS` intra-op threads: the kernels are single-threaded, and with many
threads torch's parallel elementwise ops overtake them. ``SPEEDTRONIC_CPU_KERNELS=0`` turns them
off at run time. A backward with ``create_graph=True`` (double backward) uses differentiable
torch ops instead, so higher-order gradients stay exact.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

ENV = "SPEEDTRONIC_CPU_KERNELS"
LIBRARY = "speedtronic._cpu_kernels"
#: Must equal ``speedtronic_cpu_abi()`` in csrc/cpu/fused_cpu.cpp.
ABI = 1
#: Intra-op threads up to which the single-threaded kernels are used. The short-run model's
#: forward + backward (cpu_layers.md, a 2-core machine): 1 thread 63.2 -> 55.3 ms, 2 threads
#: 36.5 -> 34.7 ms. The gain shrinks as torch's elementwise ops parallelize; more threads were
#: not measurable here, so the kernels stay out of their way.
MAX_THREADS = 2

_P = ctypes.c_void_p
_N = ctypes.c_int64


@dataclass(frozen=True)
class CpuKernelStatus:
    """Whether the library is loaded; ``reason`` says why not, ``isa`` which copy runs."""

    loaded: bool
    reason: str = ""
    isa: str = ""
    path: str | None = None

    def line(self) -> str:
        """The capability line, given the run's intra-op thread count."""
        if not self.loaded:
            return f"cpu kernels: off ({self.reason})"
        threads = torch.get_num_threads()
        if threads > MAX_THREADS:
            return (f"cpu kernels: loaded ({self.isa}) but idle: {threads} threads, and the "
                    f"fused kernels are single-threaded (used up to {MAX_THREADS})")
        return f"cpu kernels: loaded ({self.isa}; fused SwiGLU and RMSNorm for fp32 eager)"


_lock = threading.Lock()
_status: CpuKernelStatus | None = None
_lib: Any = None


def _find_library() -> str | None:
    try:
        spec = importlib.util.find_spec(LIBRARY)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _load() -> CpuKernelStatus:
    global _lib
    if os.environ.get(ENV, "").strip() == "0":
        return CpuKernelStatus(False, f"{ENV}=0")
    path = _find_library()
    if path is None:
        return CpuKernelStatus(False, "not built at install time (no working C++ compiler then, "
                                      f"or {ENV}=0); to build it: pip install --no-cache-dir "
                                      "--force-reinstall --no-deps speedtronic, or pip install "
                                      "-e . in a checkout")
    try:
        lib = ctypes.CDLL(path)
        lib.speedtronic_cpu_abi.restype = ctypes.c_int32
        lib.speedtronic_cpu_isa.restype = ctypes.c_char_p
        abi = lib.speedtronic_cpu_abi()
        if abi != ABI:
            return CpuKernelStatus(False, f"{path} has ABI {abi}, this package needs {ABI} "
                                          "(a stale build: reinstall)", path=path)
        lib.speedtronic_swiglu_fwd.argtypes = [_P, _P, _P, _N]
        lib.speedtronic_swiglu_bwd.argtypes = [_P, _P, _P, _P, _P, _N]
        lib.speedtronic_rmsnorm_fwd.argtypes = [_P, _P, _P, _P, _N, _N, ctypes.c_float]
        lib.speedtronic_rmsnorm_bwd.argtypes = [_P, _P, _P, _P, _P, _P, _P, _N, _N]
        for fn in ("speedtronic_swiglu_fwd", "speedtronic_swiglu_bwd",
                   "speedtronic_rmsnorm_fwd", "speedtronic_rmsnorm_bwd"):
            getattr(lib, fn).restype = None
        isa = lib.speedtronic_cpu_isa().decode()
    except (OSError, AttributeError) as exc:
        return CpuKernelStatus(False, f"loading {path} failed: {exc}", path=path)
    _lib = lib
    return CpuKernelStatus(True, isa=isa, path=path)


def status() -> CpuKernelStatus:
    """Load the library once per process and return the decision (never raises)."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
    return _status


def _plain_fp32(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
            and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def usable(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels may run on these tensors now (see the module docstring)."""
    if torch.compiler.is_compiling() or torch.get_num_threads() > MAX_THREADS:
        return False
    if not status().loaded or torch._C._are_functorch_transforms_active():
        return False
    return all(_plain_fp32(t) for t in tensors) and tensors[0].numel() > 0


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)  # (..., hidden)
        _lib.speedtronic_swiglu_fwd(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled() or not _plain_fp32(grad_out := grad_out.contiguous()):
            # create_graph=True (or an unusual gradient): differentiable torch ops.
            sig = torch.sigmoid(gate)
            return (grad_out * up * sig * (1 + gate * (1 - sig)), grad_out * gate * sig)
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _lib.speedtronic_swiglu_bwd(grad_out.data_ptr(), gate.data_ptr(), up.data_ptr(),
                                    grad_gate.data_ptr(), grad_up.data_ptr(), gate.numel())
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the fused kernel when :func:`usable`, else torch's ops."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if not usable(gate, up):
        return torch.nn.functional.silu(gate) * up
    return _SwiGLU.apply(gate, up)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        c = x.shape[-1]
        rows = x.numel() // c
        out = torch.empty_like(x)  # (..., C)
        rstd = torch.empty(rows, dtype=torch.float32)  # (rows,)
        _lib.speedtronic_rmsnorm_fwd(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                     rstd.data_ptr(), rows, c, eps)
        ctx.eps = eps
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        c = x.shape[-1]
        if torch.is_grad_enabled() or not _plain_fp32(grad_out := grad_out.contiguous()):
            # create_graph=True (or an unusual gradient): rebuild rstd with differentiable ops.
            rstd_d = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)  # (..., 1)
            xhat = x * rstd_d
            grad_xhat = grad_out * weight
            grad_x = (grad_xhat - xhat * (grad_xhat * xhat).mean(-1, keepdim=True)) * rstd_d
            grad_w = (grad_out * xhat).reshape(-1, c).sum(0)
            return grad_x, grad_w, None
        grad_x = torch.empty_like(x)
        want_w = ctx.needs_input_grad[1]
        grad_w64 = torch.empty(c, dtype=torch.float64) if want_w else None
        scratch = torch.empty(2 * c, dtype=torch.float32)
        _lib.speedtronic_rmsnorm_bwd(grad_out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                     rstd.data_ptr(), grad_x.data_ptr(),
                                     grad_w64.data_ptr() if want_w else None,
                                     scratch.data_ptr(), x.numel() // c, c)
        return grad_x, (grad_w64.float() if want_w else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: the fused kernel when :func:`usable`, else torch's ops."""
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the last dim "
                         f"of x {tuple(x.shape)}")
    if not usable(x, weight):
        xf = x.float()  # mean square in fp32 whatever the activation dtype
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return _RMSNorm.apply(x, weight, eps)
