"""Optional GEMM kernels that Newton-Schulz may use instead of torch's cuBLAS call, per shape.

A :class:`MeasuredKernel` is one family of alternatives (the Hopper ``sym_gemm``, the cuBLASLt
``poly_lt``). For a given shape it is used only when all of these hold:

* the family is on: its environment variable (``=1`` / ``=0``) or, unset, its default;
* the extension is loaded and registers the op, and the device supports it;
* the first result for this shape matched the baseline (16-bit tolerance; exactly symmetric
  where the family promises it), checked once, outside CUDA-graph capture;
* the per-shape measurement (:mod:`speedtronic.kernels.autotune`) found it at least
  :data:`speedtronic.kernels.autotune.MIN_GAIN` faster than the baseline on this GPU.

Any exception from the family's op switches the whole family off for the process with one log
line, and the baseline runs: a kernel that no GPU has measured can cost a warning, never a run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["MeasuredKernel", "TOLERANCE_16BIT", "debug_op"]

logger = logging.getLogger("speedtronic.newton_schulz")

TOLERANCE_16BIT = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
"""Max |kernel - baseline| / max |baseline| accepted at the first check (a few 16-bit ulps of the
largest entry: two correct fp32-accumulating GEMMs differ by their rounding order only)."""

_OFF = ("0", "false", "no", "off")


def debug_op(name: str) -> Callable[[], Callable[..., Tensor] | None]:
    """A loader for ``torch.ops.speedtronic_debug.<name>`` (None without the extension)."""

    def load() -> Callable[..., Tensor] | None:
        from . import extension as kernels

        if not kernels.available():
            return None
        try:
            return getattr(torch.ops.speedtronic_debug, name)
        except (AttributeError, RuntimeError):
            return None

    return load


class MeasuredKernel:
    """One family of optional kernels; see the module docstring.

    Args:
        name: for log lines, e.g. ``"sym_gemm (Hopper kernel)"``.
        label: the candidate's name in the per-shape table (``speedtronic env``).
        env: environment switch; ``1`` opts in, ``0`` opts out.
        default_on: whether the family is tried when ``env`` is unset.
        load: returns the op, or None when it is not built / not loadable.
        symmetric: the op's outputs must be exactly symmetric.
        device_ok: whether the op can run on this tensor's device (e.g. sm_90 only).
    """

    def __init__(self, name: str, label: str, env: str, default_on: bool,
                 load: Callable[[], Callable[..., Tensor] | None], *, symmetric: bool = False,
                 device_ok: Callable[[Tensor], bool] = lambda X: True) -> None:
        self.name = name
        self.label = label
        self.env = env
        self.default_on = default_on
        self.load = load
        self.symmetric = symmetric
        self.device_ok = device_ok
        self.disabled: str | None = None  # why the family was switched off, if it was
        self.rejected: set[str] = set()  # shapes whose first result did not match
        self._loaded: tuple[Callable[..., Tensor] | None] | None = None  # load(), once

    def op(self) -> Callable[..., Tensor] | None:
        """The op when the family may be tried at all (by default: one environment lookup)."""
        env = os.environ.get(self.env, "").strip().lower()
        if env in _OFF or (env == "" and not self.default_on) or self.disabled is not None:
            return None
        if self._loaded is None:  # the extension loads at import: its answer does not change
            self._loaded = (self.load(),)
        return self._loaded[0]

    def disable(self, exc: BaseException) -> None:
        if self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            logger.warning("%s disabled for this process after an error: %s; cuBLAS is used",
                           self.name, self.disabled)

    def run(self, key: str, X: Tensor, baseline: Callable[[], Tensor],
            call: Callable[[Callable[..., Tensor]], Tensor]) -> Tensor:
        """``baseline()``, unless this shape measured ``call(op)`` faster and correct here."""
        if X.dtype not in TOLERANCE_16BIT:  # first: fp32 steps pay no environment lookup
            return baseline()
        op = self.op()
        if op is None or key in self.rejected:
            return baseline()
        from . import autotune

        dispatch = autotune.active_dispatch()
        if not dispatch.enabled or X.device.type != dispatch.device_type:
            return baseline()
        if not self.device_ok(X):
            return baseline()
        if key not in dispatch.entries and autotune._capturing():
            return baseline()  # no checks or timing inside a CUDA-graph capture

        def kernel() -> Tensor:
            try:
                return call(op)
            except Exception as exc:  # noqa: BLE001 - any failure: the family is off
                self.disable(exc)
                raise

        if key not in dispatch.entries:  # first sight of this shape: check before timing
            try:
                out, ref = kernel(), baseline()
            except Exception:  # noqa: BLE001 - already logged and disabled
                return baseline()
            err = ((out.float() - ref.float()).abs().max()
                   / ref.float().abs().max().clamp_min(1e-30)).item()
            symmetric = not self.symmetric or torch.equal(out, out.mT)
            if not symmetric or not err <= TOLERANCE_16BIT[X.dtype]:
                self.rejected.add(key)
                logger.warning("%s: %s rejected (relative error %.3g, symmetric %s); cuBLAS is "
                               "used", self.name, key, err, symmetric)
                return ref
        choice = dispatch.choose(key, {"cublas": baseline, self.label: kernel}, "cublas")
        if choice == self.label and self.disabled is None:
            try:
                return kernel()
            except Exception:  # noqa: BLE001 - logged and disabled in kernel()
                pass
        return baseline()
