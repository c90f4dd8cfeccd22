"""Fused fp32 CPU kernels for eager runs: SwiGLU and RMSNorm, forward and backward.

The reference model spends a one-thread CPU step mostly in GEMMs (near the core's peak) and in
memory-bound elementwise passes over ``(B, T, hidden)`` tensors. torch runs SwiGLU as five such
passes (silu and mul forward; mul, silu_backward and mul backward) and RMSNorm as about ten; the
kernels in ``csrc/cpu/fused_cpu.cpp`` do one pass each way. On the short-run YAML's model
(``benchmarks/bench_short_run.py``) forward + backward took 66.9 ms with torch's ops and 59.5 ms
with the kernels, on one thread (``benchmarks/results/cpu_layers.md``).

The library includes no torch or Python header and is loaded with :mod:`ctypes`, so a plain
``pip install -e .`` (build isolation, no torch at build time) compiles it in about a second;
setup.py skips it when no C++ compiler works, and everything then runs the torch ops.

:func:`usable` is the single gate. The kernels run only where they are measured to win and are
exact enough to be invisible: eager mode (under ``torch.compile`` inductor fuses these ops
itself), with nothing intercepting torch calls (fx tracing, dispatch or torch-function modes,
functorch transforms, forward-mode AD), on plain contiguous fp32 CPU tensors, and at
most :data:`MAX_THREADS` intra-op threads: the kernels are single-threaded, and with many
threads torch's parallel elementwise ops overtake them. ``SPEEDTRONIC_CPU_KERNELS=0`` turns them
off at run time. The backward re-checks what it is handed (saved-tensor hooks, compiled
autograd, batched gradients) and otherwise, like a backward with ``create_graph=True``, uses
differentiable torch ops, so higher-order gradients stay exact.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

ENV = "SPEEDTRONIC_CPU_KERNELS"
LIBRARY = "speedtronic._cpu_kernels"
#: Must equal ``speedtronic_cpu_abi()`` in csrc/cpu/fused_cpu.cpp.
ABI = 2
#: Elements below which SwiGLU keeps torch's ops: the Function and ctypes cost a fixed ~40 us
#: that only a large tensor repays (forward + backward, one thread, cpu_layers.md: 16,384
#: elements 1.33x the time of torch's ops, 65,536 0.99x, (8, 128, 384) 0.66x). RMSNorm has no
#: floor: its torch path is a Python Function too, and the kernel wins from one row of 128.
SWIGLU_MIN_NUMEL = 65_536
#: Intra-op threads up to which the single-threaded kernels are used. The short-run model's
#: forward + backward (cpu_layers.md, a 2-core machine): 1 thread 66.9 -> 59.5 ms, 2 threads
#: 40.3 -> 38.7 ms. The gain shrinks as torch's elementwise ops parallelize; more threads were
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
    """The built library, preferring the ``.abi3`` name setup.py writes now: an older in-place
    build under the version-specific name would otherwise shadow it (it sorts first in
    ``EXTENSION_SUFFIXES``)."""
    try:
        package = importlib.util.find_spec("speedtronic")
        spec = importlib.util.find_spec(LIBRARY)
    except (ImportError, ValueError):
        return None
    name = LIBRARY.rpartition(".")[2]
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=lambda s: "abi3" not in s)
    for folder in (package.submodule_search_locations or []) if package else []:
        for suffix in suffixes:
            path = os.path.join(folder, name + suffix)
            if os.path.isfile(path):
                return path
    return spec.origin if spec is not None else None


def _switch() -> str | None:
    """``SPEEDTRONIC_CPU_KERNELS``: None when on (unset, 1/true/yes/on), else why off."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return None
    if value in ("0", "false", "no", "off"):
        return f"{ENV}={value}"
    return f"{ENV}={os.environ[ENV]!r} is not valid: use 1 (the default) or 0"


def bind(lib: ctypes.CDLL) -> tuple[int, str]:
    """Declare the library's C signatures; returns its (ABI number, instruction-set copy)."""
    lib.speedtronic_cpu_abi.restype = ctypes.c_int32
    lib.speedtronic_cpu_isa.restype = ctypes.c_char_p
    lib.speedtronic_swiglu_fwd.argtypes = [_P, _P, _P, _N]
    lib.speedtronic_swiglu_bwd.argtypes = [_P, _P, _P, _P, _P, _N]
    lib.speedtronic_rmsnorm_fwd.argtypes = [_P, _P, _P, _P, _N, _N, ctypes.c_float]
    lib.speedtronic_rmsnorm_bwd.argtypes = [_P, _P, _P, _P, _P, _P, _P, _N, _N]
    for fn in ("speedtronic_swiglu_fwd", "speedtronic_swiglu_bwd",
               "speedtronic_rmsnorm_fwd", "speedtronic_rmsnorm_bwd"):
        getattr(lib, fn).restype = None
    return lib.speedtronic_cpu_abi(), lib.speedtronic_cpu_isa().decode()


def _load() -> CpuKernelStatus:
    global _lib
    switched_off = _switch()
    if switched_off is not None:
        return CpuKernelStatus(False, switched_off)
    path = _find_library()
    if path is None:
        return CpuKernelStatus(False, "not built at install time (no working C++ compiler then, "
                                      f"or {ENV}=0); to build it: pip install --no-cache-dir "
                                      "--force-reinstall --no-deps speedtronic, or pip install "
                                      "-e . in a checkout")
    try:
        lib = ctypes.CDLL(path)
        abi, isa = bind(lib)
        if abi != ABI:
            return CpuKernelStatus(False, f"{path} has ABI {abi}, this package needs {ABI} "
                                          "(a stale build: reinstall)", path=path)
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
    """A dense, contiguous fp32 CPU tensor whose data_ptr is its values, nothing lazier: no
    subclass (FakeTensor, ...), no functorch or legacy-batched wrapper (vmap, batched grads), no
    lazy negation or efficient-zero tensor."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.dtype == torch.float32 and t.layout == torch.strided and not t.is_nested
            and t.is_contiguous()
            and not t.is_neg() and not t._is_zerotensor()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)
            and not torch._C._functorch.is_legacy_batchedtensor(t))


#: fx.symbolic_trace in progress (newer torch warns that ``is_fx_tracing`` also covers export).
_fx_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing",
                      torch.fx._symbolic_trace.is_fx_tracing)


def _only_cpu_device_modes() -> bool:
    """The active torch-function modes are all ``torch.device("cpu")`` contexts (what
    ``torch.set_default_device("cpu")`` pushes): harmless, the kernels' buffers are explicit."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return False
    return all(isinstance(mode, DeviceContext) and torch.device(mode.device).type == "cpu"
               for mode in _get_current_function_mode_stack())


def _plain_context() -> bool:
    """Eager execution with nothing intercepting torch calls: not compiling (forward or compiled
    autograd), tracing (fx, jit), under a dispatch or torch-function mode (FakeTensorMode, a
    ``torch.device("meta")`` context, ...), a functorch transform or forward-mode AD."""
    return not (torch.compiler.is_compiling() or _fx_tracing() or torch.jit.is_tracing()
                or torch.utils._python_dispatch._get_current_dispatch_mode() is not None
                or (torch._C._len_torch_function_stack() > 0 and not _only_cpu_device_modes())
                or torch._C._are_functorch_transforms_active()
                or torch.autograd.forward_ad._current_level >= 0)


def usable(*tensors: torch.Tensor, min_numel: int = 1) -> bool:
    """True when the fused kernels may run on these tensors now (see the module docstring);
    ``min_numel``: the first tensor's size below which torch's ops are faster."""
    # is_compiling first: dynamo folds it to a constant, while tracing get_num_threads (or the
    # other checks) would break the graph.
    if torch.compiler.is_compiling() or _fx_tracing():  # (fx: sizes are proxies)
        return False
    first = tensors[0]
    # Cheap refusals first: a CUDA step (launch-bound ones count microseconds) pays only these.
    if first.device.type != "cpu" or first.numel() < max(1, min_numel):
        return False
    if torch.get_num_threads() > MAX_THREADS or not _plain_context():
        return False
    return status().loaded and all(_plain_fp32(t) for t in tensors)


def _backward_ok(ctx: Any, *tensors: torch.Tensor) -> bool:
    """The backward may call C: a plain first-order backward, and the saved tensors (a
    saved-tensors hook may have changed them) and the gradient are still what the forward
    checked, with the forward's shapes."""
    return (not torch.is_grad_enabled() and _plain_context()
            and all(_plain_fp32(t) and t.shape == ctx.shape for t in tensors))


def _cpu_f32(shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32
             ) -> torch.Tensor:
    """A fresh contiguous CPU buffer, whatever the default device or dtype says."""
    return torch.empty(shape, dtype=dtype, device="cpu")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch ops (the path when the kernels are not usable); the mean square in fp32
    whatever the activation dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rms_norm_backward_torch(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of RMSNorm in differentiable torch ops, rstd rebuilt from ``x``:
    what a double backward (``create_graph=True``) or an unusual backward needs."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    xhat = x * rstd
    grad_xhat = grad_out * weight  # (..., C)
    grad_x = (grad_xhat - xhat * (grad_xhat * xhat).mean(-1, keepdim=True)) * rstd
    return grad_x, (grad_out * xhat).reshape(-1, x.shape[-1]).sum(0)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = _cpu_f32(gate.shape)  # (..., hidden)
        _lib.speedtronic_swiglu_fwd(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        ctx.shape = gate.shape
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if not _backward_ok(ctx, gate, up, grad_out):
            # create_graph=True, compiled autograd, batched or hooked tensors: torch's ops.
            sig = torch.sigmoid(gate)
            return (grad_out * up * sig * (1 + gate * (1 - sig)), grad_out * gate * sig)
        grad_gate, grad_up = _cpu_f32(gate.shape), _cpu_f32(up.shape)
        _lib.speedtronic_swiglu_bwd(grad_out.data_ptr(), gate.data_ptr(), up.data_ptr(),
                                    grad_gate.data_ptr(), grad_up.data_ptr(), gate.numel())
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the fused kernel when :func:`usable` (and at least
    :data:`SWIGLU_MIN_NUMEL` elements), else torch's ops."""
    if not _fx_tracing() and gate.shape != up.shape:  # (under fx the shapes are proxies)
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if not usable(gate, up, min_numel=SWIGLU_MIN_NUMEL):
        return torch.nn.functional.silu(gate) * up
    return fused_swiglu(gate, up)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused kernel itself, for a caller that has checked :func:`usable` on same-shaped
    tensors (the model's SwiGLU: one gate check per call, not two)."""
    return _SwiGLU.apply(gate, up)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        c = x.shape[-1]
        rows = x.numel() // c
        out = _cpu_f32(x.shape)  # (..., C)
        rstd = _cpu_f32((rows,))  # (rows,)
        _lib.speedtronic_rmsnorm_fwd(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                     rstd.data_ptr(), rows, c, eps)
        ctx.eps, ctx.shape, ctx.weight_shape = eps, x.shape, weight.shape
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        c = x.shape[-1]
        grad_out = grad_out.contiguous()
        if not (_backward_ok(ctx, x, grad_out) and _plain_fp32(weight) and _plain_fp32(rstd)
                and weight.shape == ctx.weight_shape and rstd.numel() == x.numel() // c):
            # create_graph=True, compiled autograd, batched or hooked tensors: torch's ops.
            return (*rms_norm_backward_torch(grad_out, x, weight, ctx.eps), None)
        grad_x = _cpu_f32(x.shape)
        want_w = ctx.needs_input_grad[1]
        grad_w64 = _cpu_f32((c,), torch.float64) if want_w else None
        scratch = _cpu_f32((2 * c,))
        _lib.speedtronic_rmsnorm_bwd(grad_out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                     rstd.data_ptr(), grad_x.data_ptr(),
                                     grad_w64.data_ptr() if want_w else None,
                                     scratch.data_ptr(), x.numel() // c, c)
        return grad_x, (grad_w64.float() if want_w else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: the fused kernel when :func:`usable`, else torch's ops."""
    if not _fx_tracing() and (x.dim() == 0 or weight.shape != (x.shape[-1],)):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the last dim "
                         f"of x {tuple(x.shape)}")
    if not usable(x, weight):
        return rms_norm_torch(x, weight, eps)
    return fused_rms_norm(x, weight, eps)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused kernel itself, for a caller that has checked :func:`usable` and that
    ``weight`` matches the last dim of ``x`` (the model's RMSNorm)."""
    return _RMSNorm.apply(x, weight, eps)
