"""A per-shape dispatch table with a fake timer, shared by the kernel-family tests
(tests/kernels/test_choice.py, tests/kernels/test_sym_gemm_dispatch.py)."""

from __future__ import annotations

from speedtronic.kernels import autotune


def counting_dispatch(monkeypatch, kernel, kernel_ms: float) -> autotune.ShapeDispatch:
    """Install a CPU dispatch table whose timer says ``kernel_ms`` for any candidate that called
    ``kernel`` (it counts its ``calls``) and 1.0 ms for the baseline."""

    def timer(fn):
        before = kernel.calls
        fn()
        return kernel_ms if kernel.calls > before else 1.0

    dispatch = autotune.ShapeDispatch(None, timer, enabled=True, device_type="cpu")
    monkeypatch.setattr(autotune, "_active", dispatch)
    return dispatch


def run_orthogonalize(dtype):
    """One small Newton-Schulz call through the dispatcher: (2, 16, 40), 3 quintic steps."""
    import torch

    from speedtronic.kernels import newton_schulz as ns

    G = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0))
    return ns.orthogonalize(G, 3, list(ns.QUINTIC), 1e-7, dtype, "standard")


def choices(d: autotune.ShapeDispatch) -> dict[str, str]:
    """Shape key -> chosen path, from the dispatcher's table."""
    return {r["key"]: r["choice"] for r in d.table()}

