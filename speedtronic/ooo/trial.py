"""Keep out-of-order backprop only where it is faster: a measured trial at the start of a run.

Deferring weight gradients to side streams pays where the GPU has idle gaps to fill and costs
host time per deferred layer everywhere (~28 us of Python per layer on the fake-stream harness,
``benchmarks/results/ooo_host_cpu.md``). On one H200 it slowed the reference model by 22.5% and
a many-branch model by 67.8% (``benchmarks/results/h200_first_run_2026-11-30.md``), so whether it
wins depends on the model, the batch and the GPU, and only a measurement can tell.

With ``ooo_backprop: true`` the trainer therefore times its first optimizer steps alternately with
deferral on and paused: one warm-up pair, then ``ooo_trial_pairs`` measured pairs in ABBA order
(on/off, off/on, ...), so that with an even number of pairs (the default, 4) a linear drift in
clock or load falls equally on both sides. Each step is timed from before its first micro-batch
to after the optimizer step, with the GPU drained at both ends (a host sync per mark, only during
the trial). Deferral stays on only if its median step is at least ``KEEP_IF_FASTER_BY``
shorter; otherwise the scheduler is closed (every ``nn.Linear`` gets its own forward back), so
the rest of the run pays nothing. One log line and one ``ooo_decision`` metrics event give both
medians. Gradients are the same either way (bitwise in fp32), so the trial changes how fast the
run goes, never what it computes.

The paused steps still go through the scheduler's forward wrapper (a few microseconds per layer
that the closed scheduler does not pay), so the comparison leans slightly towards deferral.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from .scheduler import OOOScheduler

__all__ = ["KEEP_IF_FASTER_BY", "OOOTrial"]

logger = logging.getLogger("speedtronic.ooo")

#: Deferral must beat the standard backward by this fraction of a step to stay on: below it the
#: difference is within run-to-run noise and the simpler path wins.
KEEP_IF_FASTER_BY = 0.01


class _Clock:
    """A step's wall time, with the GPU drained at both ends.

    Each mark synchronizes the run's device, so a step is charged for exactly its own work: with
    back-to-back CUDA events instead, a step that follows a GPU-bound one would start its timing
    late and be under-measured (host time overlapping the previous step's backlog). That is
    ``2 * len(plan)`` host syncs, all inside the trial.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None

    def mark(self) -> float:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return 1000.0 * (end - start)


class OOOTrial:
    """Alternates deferral on/off for the first ``2 * (1 + pairs)`` optimizer steps, then decides.

    Call :meth:`begin_step` before a step's first micro-batch and :meth:`end_step` after its
    optimizer step. ``end_step`` returns ``None`` while the trial runs, then once ``True`` (keep
    deferral) or ``False`` (the scheduler was closed), and ``None`` again afterwards.
    """

    def __init__(self, sched: OOOScheduler, device: torch.device | str, pairs: int,
                 clock: Any = None) -> None:
        if pairs < 1:
            raise ValueError(f"the trial needs at least one measured pair, got {pairs}")
        self.sched = sched
        self.pairs = pairs
        self.clock = clock or _Clock(torch.device(device))
        # One warm-up pair (allocator and kernel caches for both paths), then ABBA pairs.
        plan = [True, False]
        for i in range(pairs):
            plan += [True, False] if i % 2 == 0 else [False, True]
        self.plan = plan
        self.index = 0
        self.decided: bool | None = None
        self.summary: dict[str, Any] | None = None
        self._marks: list[tuple[bool, Any, Any]] = []  # (deferred?, start, end) per step
        self._start: Any = None

    @property
    def running(self) -> bool:
        """True until the decision is made."""
        return self.decided is None

    def begin_step(self) -> None:
        if not self.running:
            return
        self.sched._active = self.plan[self.index]
        self._start = self.clock.mark()

    def end_step(self) -> bool | None:
        if not self.running:
            return None
        deferred = self.plan[self.index]
        self._marks.append((deferred, self._start, self.clock.mark()))
        self.index += 1
        if self.index < len(self.plan):
            return None
        return self._decide()

    def abandon(self) -> None:
        """The run ended before the plan did: say so (the scheduler is closed by its owner)."""
        if self.running:
            self.summary = {"kept": None, "steps_run": self.index, "steps_planned": len(self.plan)}
            logger.info("ooo backprop: trial unfinished when the run ended (%d of %d steps); no "
                        "decision (a resumed run starts its own trial)", self.index, len(self.plan))

    def _decide(self) -> bool:
        measured = self._marks[2:]  # the warm-up pair is not compared
        on = [self.clock.elapsed_ms(s, e) for d, s, e in measured if d]
        off = [self.clock.elapsed_ms(s, e) for d, s, e in measured if not d]
        on_ms, off_ms = statistics.median(on), statistics.median(off)
        keep = on_ms <= off_ms * (1.0 - KEEP_IF_FASTER_BY)
        self.summary = {"kept": keep, "ooo_ms_per_step": on_ms, "standard_ms_per_step": off_ms,
                        "pairs": self.pairs, "layers": self.sched.num_layers}
        change = 100.0 * (on_ms / off_ms - 1.0)
        if keep:
            self.sched._active = True
            logger.info("ooo backprop: kept after measuring %.2f ms/step against %.2f ms with the "
                        "standard backward (%+.1f%%, median of %d steps each)", on_ms, off_ms,
                        change, self.pairs)
        else:
            self.sched.close()
            logger.info("ooo backprop: off after measuring %.2f ms/step against %.2f ms with the "
                        "standard backward (%+.1f%%, median of %d steps each; it stays on only "
                        "when >= %.0f%% faster); ooo_trial_pairs: 0 keeps it on unmeasured",
                        on_ms, off_ms, change, self.pairs, 100 * KEEP_IF_FASTER_BY)
        self.decided = keep
        return keep
