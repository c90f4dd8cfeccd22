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
MEASURE_STEPS = 3
"""``cuda_graph="auto"``: eager steps timed after the warm-up, and replays timed after the
capture; the graph stays only if its median is lower (one host sync, at that decision)."""


def auto_keeps_graph(eager_ms: list[float], replay_ms: list[float]) -> bool:
    """The ``auto`` decision: keep the graph when its median step beats the eager median."""
    def median(v: list[float]) -> float:
        s = sorted(v)
        return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])

    return bool(eager_ms) and bool(replay_ms) and median(replay_ms) < median(eager_ms)


@dataclass
class GraphState:
    """One captured step and what it was captured against."""

    key: tuple | None = None
    warm: int = 0
    graph: Any = None
    static_grads: list[Tensor] = field(default_factory=list)
    logged: bool = False
    mode: str = "on"           # "on", or "auto": measure, then keep the faster
    eager_events: list[tuple[Any, Any]] = field(default_factory=list)
    replay_events: list[tuple[Any, Any]] = field(default_factory=list)
    decided_off: str = ""      # auto chose eager: why (the measured medians)


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
    reason = why_not(params) or state.decided_off or None
    if reason is not None:
        if not state.logged:
            logger.info("muon cuda graph: off (%s)", reason)
            state.logged = True
        eager()
        return
    key = _key(groups, params)
    if key != state.key or (state.graph is not None and not planted()):
        state.key, state.warm, state.graph, state.static_grads = key, 0, None, []
        state.eager_events, state.replay_events = [], []
    if state.graph is not None:
        with _timed(state.replay_events, state.mode == "auto" and
                    len(state.replay_events) < MEASURE_STEPS):
            torch._foreach_copy_(state.static_grads, [p.grad for p in params])
            state.graph.replay()
        if state.mode == "auto" and len(state.replay_events) == MEASURE_STEPS:
            _decide(state)
        return
    if state.mode == "auto" and WARMUP_STEPS <= state.warm < WARMUP_STEPS + MEASURE_STEPS:
        with _timed(state.eager_events, True):  # on the current stream, as training runs it
            eager()
        state.warm += 1
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
    if not state.logged and state.mode != "auto":
        logger.info("muon cuda graph: on (captured after %d eager steps; %d matrices)",
                    WARMUP_STEPS, len(params))
        state.logged = True


class _timed:
    """Record a CUDA event pair around the block into ``into`` (when ``on``)."""

    def __init__(self, into: list[tuple[Any, Any]], on: bool) -> None:
        self.into, self.on = into, on

    def __enter__(self) -> None:
        if self.on:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.into.append((self.start, end))


def _decide(state: GraphState) -> None:
    """``auto``: compare the timed eager steps with the timed replays (the one host sync)."""
    torch.cuda.synchronize()
    eager = [a.elapsed_time(b) for a, b in state.eager_events]
    replay = [a.elapsed_time(b) for a, b in state.replay_events]
    state.replay_events.append((None, None))  # decided: stop timing
    figures = (f"eager {sorted(eager)[len(eager) // 2]:.3f} ms, graph "
               f"{sorted(replay)[len(replay) // 2]:.3f} ms per step")
    if auto_keeps_graph(eager, replay):
        logger.info("muon cuda graph: auto -> on (%s)", figures)
    else:
        state.graph, state.static_grads = None, []
        state.decided_off = f"auto measured the eager step faster: {figures}"
        logger.info("muon cuda graph: auto -> off (%s)", figures)
    state.logged = True
