"""AdamW branch: torch's fused/foreach AdamW, or Speedtronic's cautious AdamW op.

State per parameter uses torch.optim.AdamW's keys and dtypes on both paths (``step`` as a 0-d
float32 tensor, ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype), so a checkpoint written
with ``cautious: false`` loads with ``cautious: true`` and vice versa, with or without the CUDA
kernels. One exception: float16 parameters keep float32 moments. In float16, ``(1 - beta2) g^2``
is 0 for ``|g|`` below ~7.7e-3 at beta2 = 0.999, and the step divides by eps: a 5e-3 gradient
moved a weight by 250 in one step (torch's unfused AdamW gives inf, its fused one overshoots).
The cost is 4 more bytes per float16 parameter; such parameters take the foreach op, which
reads float32 moments beside float16 weights (torch's fused kernel wants one dtype). A float16
state (a torch.optim.AdamW checkpoint) is upcast at its next step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from ..kernels import ops
from ._state import (
    EagerMethodsMixin,
    Fp32StateMixin,
    checked_or_dropped,
    fill_group_defaults,
    run_closure,
)

__all__ = ["AdamW", "adamw_step", "ADAMW_DEFAULTS", "fused_supported", "refuse_sparse_grads"]

logger = logging.getLogger("speedtronic.optim")

ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "fused": None,
    "cautious": False,
    "cautious_rescale": True,
}
"""Per-group defaults (torch.optim.AdamW's values for the shared keys)."""

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_supported(params: Iterable[Tensor]) -> bool:
    """True when torch's fused AdamW kernel accepts every tensor (CPU or CUDA, float dtypes)."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES for p in params)


def _check_group(group: dict[str, Any]) -> None:
    if not 0.0 <= float(group["lr"]):
        raise ValueError(f"AdamW lr must be >= 0, got {group['lr']}")
    betas = tuple(group["betas"])
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamW betas must be two values in [0, 1), got {list(betas)}")
    group["betas"] = betas
    if not group["eps"] > 0.0:
        raise ValueError(f"AdamW eps must be > 0, got {group['eps']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"AdamW weight_decay must be >= 0, got {group['weight_decay']}")
    if group["fused"] and group["cautious"]:  # it was ignored without a word
        raise ValueError("AdamW fused=True cannot be combined with cautious=True: torch's fused "
                         "kernel has no cautious mask; set fused=None (automatic) or False")


def _use_fused(group: dict[str, Any], params: list[Tensor]) -> bool:
    if group["cautious"]:
        return False
    fused = group["fused"]
    if fused is None:
        return fused_supported(params)
    if fused and not fused_supported(params):
        raise ValueError("optimizer.fused: true, but torch's fused AdamW does not support these "
                         f"parameters (devices {sorted({p.device.type for p in params})}, dtypes "
                         f"{sorted({str(p.dtype) for p in params})}); set fused: null or false")
    return bool(fused)


def _fusable(p: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
    """Whether torch's fused kernel updates ``p`` right: one dtype, and parameter and moments
    in one dense layout. Three C calls for the common all-contiguous case: 24 us more host
    time per 100 parameters than the dtype test alone (2-vCPU Xeon, torch 2.13, one thread)."""
    if exp_avg.dtype != p.dtype:
        return False
    if p.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous():
        return True
    return _dense(p) and _same_layout(exp_avg, p) and _same_layout(exp_avg_sq, p)


def _dense(t: Tensor) -> bool:
    """Its elements fill one block of memory without gaps or overlaps, in some dim order
    (contiguous, channels_last, a transpose); ``big[::2]`` is not."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Same memory layout (strides of size-1 dims do not matter); two contiguous tensors are
    the common case and cost two C calls."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    return all(sa == sb for n, sa, sb in zip(b.shape, a.stride(), b.stride(), strict=True)
               if n > 1)


#: Moment dtypes that differ from the parameter's: float16 underflows (the module docstring);
#: a complex32 parameter's real and imaginary parts are float16 too.
_MOMENTS = {torch.float16: torch.float32, torch.complex32: torch.complex64}


def refuse_sparse_grads(groups: list[dict[str, Any]]) -> None:
    """Raise before any update if a parameter of ``groups`` has a sparse gradient."""
    for group in groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"AdamW does not support sparse gradients (parameter shape "
                                   f"{tuple(p.shape)}); nothing was updated this step")


def adamw_step(state: dict, group: dict[str, Any]) -> None:
    """One AdamW step on one param group (keys of :data:`ADAMW_DEFAULTS`).

    Complex parameters are updated as their real and imaginary parts (``torch.view_as_real``),
    like ``torch.optim.AdamW``; a cautious mask then compares signs per part."""
    owners, params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"AdamW does not support sparse gradients (parameter shape "
                               f"{tuple(p.shape)})")
        st = state[p]
        moments = _MOMENTS.get(p.dtype, p.dtype)  # see the module docstring
        if "step" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, dtype=moments,
                                             memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=moments,
                                                memory_format=torch.preserve_format)
        elif st["exp_avg_sq"].dtype != moments and p.dtype in _MOMENTS:
            st["exp_avg"], st["exp_avg_sq"] = (st["exp_avg"].to(moments),
                                               st["exp_avg_sq"].to(moments))
        owners.append(p)
        if p.is_complex():
            params.append(torch.view_as_real(p))
            grads.append(torch.view_as_real(p.grad))
            exp_avgs.append(torch.view_as_real(st["exp_avg"]))
            exp_avg_sqs.append(torch.view_as_real(st["exp_avg_sq"]))
        else:
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
        steps.append(st["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    if torch.compiler.is_compiling():
        # Under torch.compile: torch's fused kernel is compiler-disabled (a graph break) and the
        # op below needs each step as a Python int (.item(), another break). Trace the same math
        # per parameter with its step tensor instead; inductor fuses it. A tensor lr stays a
        # tensor: float() of it broke the graph and recompiled on every scheduler step.
        lr_traced = group["lr"]
        for i, p in enumerate(params):
            steps[i] = state[owners[i]]["step"] = steps[i] + 1
            ops.adamw_traceable([p], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]], lr_traced,
                                float(beta1), float(beta2), float(group["eps"]),
                                float(group["weight_decay"]), steps[i], bool(group["cautious"]),
                                bool(group["cautious_rescale"]))
        return
    lists = (state, group, owners, params, grads, exp_avgs, exp_avg_sqs, steps)
    every = range(len(params))
    if not _use_fused(group, params):
        _adamw_step_parts(*lists, list(every), fused=False)
        return
    # torch's fused kernel wants one dtype per tensor (float16 weights keep float32 moments)
    # and walks parameter and moments as one flat, dense layout: a parameter with gaps
    # (big[::2]) or moments laid out unlike it (a model moved to channels_last after its
    # first steps, a checkpoint's contiguous moments) were updated up to 2.6 lr off. Those
    # take the op; the rest stays fused.
    fusable = [i for i in every if _fusable(params[i], exp_avgs[i], exp_avg_sqs[i])]
    _adamw_step_parts(*lists, fusable, fused=True)
    _adamw_step_parts(*lists, sorted(set(every) - set(fusable)), fused=False)


def _adamw_step_parts(state: dict, group: dict[str, Any], owners: list[Tensor],
                     params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                     exp_avg_sqs: list[Tensor], steps: list[Tensor], which: list[int],
                     fused: bool) -> None:
    """The eager step of the parameters ``which`` (indices into the lists) on one path."""
    if not which:
        return
    owners, params, grads, exp_avgs, exp_avg_sqs, steps = (
        [xs[i] for i in which] for xs in (owners, params, grads, exp_avgs, exp_avg_sqs, steps))
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])  # eager: a CPU scalar for the kernels below
    if fused:
        # torch's fused kernel wants each step on its parameter's device.
        for i, p in enumerate(params):
            if steps[i].device != p.device:
                steps[i] = state[owners[i]]["step"] = steps[i].to(p.device)
            if not _same_layout(grads[i], p):
                # The fused kernel reads a gradient laid out unlike its parameter (a transposed
                # view) as if it were laid out the same: a (4, 6) parameter's update was 2 lr
                # off. One copy into the parameter's layout; autograd's gradients have it.
                grads[i] = torch.empty_like(p).copy_(grads[i])
        _torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True,
                    decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        return
    # Speedtronic op path (cautious, or fused disabled). Steps are bucketed by value: params
    # that first got a gradient later have a smaller step.
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(owners):
        # A new tensor, not add_: a loaded state_dict may share its step tensors with the saver.
        steps[i] = state[p]["step"] = steps[i] + 1
        by_step[int(steps[i].item())].append(i)
    adamw_op = ops.kernel_or_fallback("cautious_adamw_step_", params[0].device,
                                      sorted({p.dtype for p in params} | {g.dtype for g in grads},
                                             key=str))
    for step, idx in by_step.items():
        adamw_op([params[i] for i in idx], [grads[i] for i in idx],
                                 [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx],
                                 lr, float(beta1), float(beta2), float(group["eps"]),
                                 float(group["weight_decay"]), step, bool(group["cautious"]),
                                 bool(group["cautious_rescale"]))


class AdamW(Fp32StateMixin, EagerMethodsMixin, torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with an optional cautious mask.

    ``cautious=False`` runs torch's own fused kernel when available (``fused=None``), else the
    foreach ``cautious_adamw_step_`` op; ``cautious=True`` masks the Adam direction where it
    disagrees in sign with the gradient (C-AdamW, arXiv 2411.16085), rescaled by
    ``numel / (kept + 1)`` unless ``cautious_rescale=False``. Weight decay is never masked."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, fused: bool | None = None,
                 cautious: bool = False, cautious_rescale: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                        cautious=cautious, cautious_rescale=cautious_rescale)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's own values are checked (torch.optim.AdamW checks only its
        constructor's arguments): lr, betas, eps, weight_decay, and fused with cautious refused.
        A rejected group is removed again, so the optimizer stays as it was; ``betas`` is stored
        as a tuple."""
        super().add_param_group(param_group)
        checked_or_dropped(self.param_groups, _check_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A torch.optim.AdamW state dict has no cautious / cautious_rescale keys. Its maximize
        # and amsgrad change the update: loaded, they were kept and never read (refused before
        # anything is replaced, so the optimizer stays as it was).
        for i, group in enumerate(state.get("param_groups", ())):
            on = [key for key in ("maximize", "amsgrad") if group.get(key)]
            if on:
                raise ValueError(f"AdamW.load_state_dict: param group {i} has "
                                 f"{' and '.join(f'{k}=True' for k in on)} (a torch.optim.AdamW "
                                 f"state); Speedtronic's AdamW implements neither maximize nor "
                                 f"amsgrad. Load it into torch.optim.AdamW, or set them to False "
                                 f"in the state dict")
        super().__setstate__(state)
        fill_group_defaults(self.param_groups, lambda group: self.defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step."""
        loss = run_closure(closure)
        if len(self.param_groups) > 1:  # a sparse grad in a later group: no half-applied step
            refuse_sparse_grads(self.param_groups)
        for group in self.param_groups:
            adamw_step(self.state, group)
        return loss
