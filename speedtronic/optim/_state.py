"""Keep fp32 optimizer state fp32 across ``load_state_dict``.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor (except ``step``) to
its parameter's dtype. For bf16 parameters that would silently turn Muon's fp32 momentum into
bf16 on resume; this mixin restores the saved values (cast to fp32, never through bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch


def run_closure(closure: Any) -> Any:
    """Re-evaluate the loss with autograd on, as torch optimizers' ``step(closure)`` does."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def checked_or_dropped(groups: list[dict[str, Any]],
                       check: Callable[[dict[str, Any]], None]) -> None:
    """Validate the group ``add_param_group`` just appended; a rejected group is removed again,
    so a failed ``add_param_group`` leaves the optimizer as it was (as torch's own do)."""
    try:
        check(groups[-1])
    except BaseException:
        groups.pop()
        raise


def fill_group_defaults(groups: list[dict[str, Any]],
                        defaults_for: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Give loaded param groups the keys they lack (a torch optimizer's or an older version's
    state dict), from ``defaults_for(group)``; keys the state dict has are kept."""
    for group in groups:
        for key, value in defaults_for(group).items():
            group.setdefault(key, value)


def _undecorated(name: str) -> Any:
    method = getattr(torch.optim.Optimizer, name)
    return getattr(method, "__wrapped__", method)


_EAGER_METHODS = {name: _undecorated(name) for name in
                  ("add_param_group", "zero_grad", "state_dict", "load_state_dict")}


class EagerMethodsMixin:
    """Skip a 0.75 s import that eager training never uses.

    torch wraps these ``Optimizer`` methods in ``torch._disable_dynamo``, whose first call
    imports ``torch._dynamo``: 0.75 s (``python -X importtime``), a twentieth of a 150-step CPU
    run (benchmarks/results/short_run_cpu.md). Outside ``torch.compile`` nothing needs it, so
    these call torch's undecorated methods; while compiling, the decorated ones."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return super().add_param_group(param_group)  # type: ignore[misc]
        return _EAGER_METHODS["add_param_group"](self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if torch.compiler.is_compiling():
            return super().zero_grad(set_to_none)  # type: ignore[misc]
        return _EAGER_METHODS["zero_grad"](self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if torch.compiler.is_compiling():
            return super().state_dict()  # type: ignore[misc]
        return _EAGER_METHODS["state_dict"](self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return super().load_state_dict(state_dict)  # type: ignore[misc]
        return _EAGER_METHODS["load_state_dict"](self, state_dict)


FP32_STATE_KEYS = frozenset({"momentum_buffer"})
"""State keys that are always float32 regardless of the parameter dtype."""

SAVED_FP32_KEYS = frozenset({"exp_avg", "exp_avg_sq"})
"""AdamW's moments: kept float32 on load for a float16 parameter where they were saved float32;
otherwise loaded as torch loads them (cast to the parameter's dtype)."""


class Fp32StateMixin:
    """Mixin for ``torch.optim.Optimizer`` subclasses; see the module docstring."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """torch's load, with the fp32 state put back in fp32 (torch casts it to the parameter
        dtype). Read and restored by hooks around the user's own: their edits are what loads
        (as in torch.optim), not the dict as it was passed."""
        keep: dict[int, dict[str, torch.Tensor]] = {}
        saved_ids: list[int] = []

        def capture(_opt: Any, sd: dict[str, Any]) -> None:  # after the user's pre-hooks
            saved_ids.extend(chain.from_iterable(g["params"] for g in sd.get("param_groups", [])))
            for pid, st in sd.get("state", {}).items():
                if isinstance(st, dict):
                    found = {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and (
                        k in FP32_STATE_KEYS
                        or (k in SAVED_FP32_KEYS and v.dtype == torch.float32))}
                    if found:
                        keep[pid] = found

        def restore(_opt: Any) -> None:  # before the user's post-hooks
            groups = self.param_groups  # type: ignore[attr-defined]
            params = list(chain.from_iterable(g["params"] for g in groups))
            id_map = dict(zip(saved_ids, params, strict=False))
            for pid, found in keep.items():
                p = id_map.get(pid)
                if p is None:
                    continue
                for key, value in found.items():
                    if key in SAVED_FP32_KEYS and p.dtype not in (torch.float16, torch.complex32):
                        continue  # other dtypes keep torch's rule: moments in the param's dtype
                    # a copy even where it is fp32 on the device already: a state dict of a
                    # live optimizer aliases its banks, and that optimizer's next step would
                    # move this one's momentum (the engine loads to the CPU first: on a GPU
                    # the move is the only copy)
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32,  # type: ignore[attr-defined]
                                                  copy=True)

        before = self.register_load_state_dict_pre_hook(capture)  # type: ignore[attr-defined]
        after = self.register_load_state_dict_post_hook(  # type: ignore[attr-defined]
            restore, prepend=True)
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            before.remove()
            after.remove()
