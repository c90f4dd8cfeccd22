"""The per-layer half of out-of-order backprop: what runs inside one ``nn.Linear``.

:class:`_Layer` replaces a layer's ``forward`` and decides, call by call, whether this forward
may be deferred; :class:`_DeferredLinear` is the autograd Function whose backward returns dX at
once and hands dW/db to the scheduler. :class:`_Slot` and :class:`_Batch` are the bookkeeping
the scheduler keeps per parameter and per backward pass, and :func:`_weight_grads` /
:func:`_weight_grads_into` / :func:`_accumulate` the arithmetic it runs on them, written to
give autograd's bits. The scheduler that installs, launches and folds all this is
:mod:`speedtronic.ooo.scheduler` (its docstring has the whole picture); this module does not
import it, since it imports this one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Slot:
    """Deferred-gradient target: one per unique parameter (a tied weight has one slot)."""

    __slots__ = ("param", "name", "stream")

    def __init__(self, param: nn.Parameter, name: str, stream: Any) -> None:
        self.param = param
        self.name = name
        self.stream = stream  # torch.cuda.Stream, or None on the CPU queue path


class _Batch:
    """Deferred work of one backward pass (one autograd graph task)."""

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.stash: dict[_Slot, torch.Tensor | None] = {}  # .grad before this pass
        self.local: dict[_Slot, torch.Tensor] = {}  # sum of this pass's deferred grads
        self.queue: list[tuple[Any, ...]] = []  # CPU path: (layer, X, dY, need_w, need_b)
        self.streams: set[Any] = set()  # CUDA path: side streams this pass launched work on
        self.keep: list[torch.Tensor] = []  # CUDA path: see _accumulate

    def touch(self, slot: _Slot) -> None:
        # Take .grad aside on first touch so the fold (OOOScheduler._finish) computes
        # prev + (this pass), the same association as autograd's InputBuffer + AccumulateGrad
        # (bitwise parity).
        if slot not in self.stash:
            self.stash[slot] = slot.param.grad
            slot.param.grad = None


class _Layer:
    """Replacement ``forward`` of one ``nn.Linear`` (installed as an instance attribute)."""

    def __init__(self, sched: Any, name: str, module: nn.Linear,
                 weight: _Slot, bias: _Slot | None) -> None:
        self.sched = sched  # the OOOScheduler that installed it (not imported: see above)
        self.name = name
        self.module = module
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w, b = m.weight, m.bias
        if not self._deferrable(x, w, b):
            return F.linear(x, w, b)
        compute_dtype = None
        if torch.is_autocast_enabled(x.device.type):
            # Cast like autocast would (a differentiable cast of x; W and b are cast inside the
            # Function so that the leaf weight, not its copy, is the Function's input).
            compute_dtype = torch.get_autocast_dtype(x.device.type)
            if x.dtype != compute_dtype:
                x = x.to(compute_dtype)
        elif x.dtype != w.dtype:
            return F.linear(x, w, b)  # let torch raise its usual dtype error
        self.sched._on_forward()
        if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
            return _DeferredLinear.apply(x, w, b, self, compute_dtype)  # the public path
        return _APPLY_DIRECT(x, w, b, self, compute_dtype)

    def _deferrable(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        if not (self.sched._active and torch.is_grad_enabled()):
            return False
        if torch._C._are_functorch_transforms_active():
            return False  # torch.func: the Function has no setup_context; F.linear is fine
        if w is not self.weight.param or b is not (self.bias.param if self.bias else None):
            self.sched._warn_once(f"{self.name}: parameters were replaced after setup; this "
                                  "layer now runs the standard backward")
            return False
        if x.dim() < 2 or x.dtype == torch.float64 or not x.is_floating_point():
            return False
        return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns dX now and defers dW/db to the scheduler."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: _Layer, compute_dtype: torch.dtype | None) -> torch.Tensor:
        w, b = weight, bias
        if compute_dtype is not None:  # autocast: the same casts autocast's linear makes
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
        ctx.layer = layer
        ctx.cast = compute_dtype is not None
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)  # the very op the standard path runs -> identical output

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        # Not @once_differentiable: its wrapper is host time on every layer (measured together
        # with the direct apply in benchmarks/results/ooo_host_cpu.md). Grad mode is on here
        # only under create_graph=True; that pass returns dW/db to autograd like the standard
        # backward, so a double backward (gradient penalty) matches it instead of raising.
        x, w = ctx.saved_tensors
        layer: _Layer = ctx.layer
        create_graph = torch.is_grad_enabled()
        if create_graph and ctx.cast:
            # The saved cast has no graph back to the weight: add one that is exactly zero in
            # value, so the forward-time values stay (as in autograd's own cast) and the
            # gradient reaches the leaf weight.
            recast = layer.weight.param.to(w.dtype)
            w = w + (recast - recast.detach())
        g2d = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        x2d = x.reshape(-1, x.shape[-1])  # (M, K)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # The expression autograd's mm backward uses for this layout (bitwise parity).
            if x2d.dim() == 2 and x2d.stride(0) == 1 and x2d.stride(1) == x2d.shape[0] > 1:
                grad_x = w.mm(g2d.t()).t().reshape(x.shape)  # column-major input
            else:
                grad_x = g2d.mm(w).reshape(x.shape)  # (M, K) -> x's shape
        needed = None if create_graph else layer.sched._needed(ctx)
        if needed is None:  # autograd.grad or create_graph: hand dW/db back to autograd
            dw, db = _weight_grads(layer, x2d, g2d, True, layer.bias is not None)
            return grad_x, dw, db, None, None
        if any(needed):
            layer.sched._defer(layer, x2d, g2d, *needed)
        return grad_x, None, None, None, None


# ``Function.apply`` without its Python prologue: the C++ apply of torch's Function base class,
# bound to _DeferredLinear. The prologue unwraps functorch wrappers left over from a finished
# torch.func transform; the call site takes the public ``apply`` for such an input and under
# torch.compile tracing (inside a running transform the layer is not deferred at all).
# benchmarks/results/ooo_host_cpu.md prices this together with the backward's change.
_APPLY_DIRECT = super(torch.autograd.Function, _DeferredLinear).apply


def _weight_grads(layer: _Layer, x2d: torch.Tensor, g2d: torch.Tensor, need_w: bool,
                  need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW = dY^T X (N, K) and db = sum_M dY (N,), in the parameters' dtypes (None if unneeded)."""
    dw = db = None
    if need_w:
        dw = g2d.t().mm(x2d)
        if dw.dtype != layer.weight.param.dtype:
            dw = dw.to(layer.weight.param.dtype)  # autocast: autograd's cast-back of the grad
    if need_b and layer.bias is not None:
        db = g2d.sum(0)
        if db.dtype != layer.bias.param.dtype:
            db = db.to(layer.bias.param.dtype)
    return dw, db


def _weight_grads_into(x2d: torch.Tensor, g2d: torch.Tensor, dw: torch.Tensor | None,
                       db: torch.Tensor | None) -> None:
    """:func:`_weight_grads` written into preallocated ``dw``/``db`` (the same kernels, so the
    same bits; a dtype cast is autocast's cast-back of the gradient)."""
    if dw is not None:
        if dw.dtype == g2d.dtype:
            torch.mm(g2d.t(), x2d, out=dw)
        else:
            dw.copy_(g2d.t().mm(x2d))
    if db is not None:
        if db.dtype == g2d.dtype:
            torch.sum(g2d, 0, out=db)
        else:
            db.copy_(g2d.sum(0))


def _accumulate(batch: _Batch, slot: _Slot, value: torch.Tensor) -> None:
    current = batch.local.get(slot)
    if current is None:
        batch.local[slot] = value
    else:
        current.add_(value)  # same order as autograd's InputBuffer: first + second + ...
        # On the CUDA path ``value`` belongs to the ambient stream's pool and the add above is
        # still queued on a side stream: keep it alive until the fold has waited for that.
        batch.keep.append(value)
