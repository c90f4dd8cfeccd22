"""A per-shape dispatch table with a fake timer, shared by the kernel-family tests
(tests/test_kernel_choice.py, tests/test_sym_gemm_dispatch.py)."""

from __future__ import annotations

from speedtronic import autotune


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
