"""The whole Muon step as one CUDA graph (``Muon(..., cuda_graph=True)``), replayed each step.

Why: the lean step is ~90-130 launches; on an H200 host each costs ~15 us to issue, so an eager
step cannot run faster than ~1.5-2 ms of host time however fast the GPU is. A replayed graph
issues them all in one call. Predicted, not measured (no GPU has run it yet):
``benchmarks/gpu_check.sh`` measures it beside the eager step.

What the capture relies on, and what ends it (the next step recaptures after a warm-up):

* **Static gradients.** The graph reads the gradient tensors it saw while capturing; each replay
  first copies the current ``p.grad`` into them (one multi-tensor copy), so
  ``zero_grad(set_to_none=True)`` is fine.
* **Hyper-parameters** are read from the group's 0-d tensors, so an LR scheduler (which fills
  them in place) needs no recapture. Assigning a *new* tensor or a float to ``group["lr"]``
  does: it is part of the key.
* **The matrix set and the settings** (the lean step's plan signature), and the momentum views:
  a new parameter, a parameter without a gradient, a changed setting, ``load_state_dict`` or
  ``reset_state`` drops the graph.
* Nothing in the step syncs with the host or allocates differently between steps
  (``tests/optim/test_step_budget.py`` checks both on CPU); autotuning and the per-shape kernel
  choice happen in the eager warm-up steps, never inside the capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("speedtronic.optim")

WARMUP_STEPS = 3
"""Eager steps before a capture: the first builds the banks, the next run the per-shape kernel
choice and autotune on the side stream the capture will use (torch's recipe asks for a few)."""


@dataclass
class GraphState:
    """One captured step and what it was captured against."""

    key: tuple | None = None
    warm: int = 0
    graph: Any = None
    static_grads: list[Tensor] = field(default_factory=list)
    logged: bool = False


def _key(groups: list[dict[str, Any]], params: list[Tensor]) -> tuple:
    hyper = tuple(id(g.get(k)) for g in groups for k in ("lr", "weight_decay", "momentum"))
    settings = tuple(sorted((k, repr(v)) for g in groups for k, v in g.items()
                            if k not in ("params", "lr", "weight_decay", "momentum")))
    return (tuple(id(p) for p in params), hyper, settings)


def why_not(params: list[Tensor]) -> str | None:
    """None when the step can be captured on this device, else the reason (one log line)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not params:
        return "no parameter has a gradient"
    if any(p.device.type != "cuda" for p in params):
        return "parameters are not all on CUDA"
    if torch.compiler.is_compiling():
        return "inside torch.compile (compile the step or graph it, not both)"
    if torch.cuda.is_current_stream_capturing():
        return "a CUDA graph capture is already running"
    return None


def graphed_step(state: GraphState, groups: list[dict[str, Any]],
                 eager: Callable[[], None], planted: Callable[[], bool]) -> None:
    """Run ``eager`` (the lean step) directly, as a warm-up, or as a captured graph's replay.

    ``planted`` says whether the step's momentum views are still the ones of its plan."""
    params = [p for g in groups for p in g["params"] if p.grad is not None]
    reason = why_not(params)
    if reason is not None:
        if not state.logged:
            logger.info("muon cuda graph: off (%s)", reason)
            state.logged = True
        eager()
        return
    key = _key(groups, params)
    if key != state.key or (state.graph is not None and not planted()):
        state.key, state.warm, state.graph, state.static_grads = key, 0, None, []
    if state.graph is not None:
        torch._foreach_copy_(state.static_grads, [p.grad for p in params])
        state.graph.replay()
        return
    if state.warm < WARMUP_STEPS:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()
        torch.cuda.current_stream().wait_stream(side)
        state.warm += 1
        return
    # Capture: the graph reads these gradient tensors from now on.
    user_grads = [p.grad for p in params]
    state.static_grads = [g.clone() for g in user_grads]
    for p, g in zip(params, state.static_grads, strict=True):
        p.grad = g
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    for p, g in zip(params, user_grads, strict=True):
        p.grad = g
    # The capture recorded the step without running it: run it once for this step's update.
    torch._foreach_copy_(state.static_grads, user_grads)
    graph.replay()
    state.graph = graph
    if not state.logged:
        logger.info("muon cuda graph: on (captured after %d eager steps; %d matrices)",
                    WARMUP_STEPS, len(params))
        state.logged = True
