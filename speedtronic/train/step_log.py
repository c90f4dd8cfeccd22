"""The ``train_step`` log row: the trainer's one host read per log step.

At a log step :meth:`StepLog._log_record` reads, in one ``tolist()``, the open interval's summed
loss, the gradient norm, the lr, the lean Muon step's fp16 guard counters and the count of
finite steps, so a bf16 or fp32 CUDA run never waits on the device between log steps (fp16:
GradScaler reads one flag per step, see :mod:`.step`). A non-finite loss or
gradient norm in the interval raises there (``train.on_nonfinite: raise``).

:class:`StepLog` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose attributes
(``metrics``, ``optimizer``, ``dp``, ...) it reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .precision import max_memory_bytes

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["LogInterval", "StepLog", "guard_counters", "restart_nonfinite_momentum"]


@dataclass
class LogInterval:
    """Where the open log interval started: clock (minus pauses), step and counters."""

    start: float
    steps: int
    tokens: int
    samples: int


def _step_cache(optimizer: Any) -> Any:
    """The lean Muon step's cache of ``optimizer`` (this rank's share under ZeRO-1), or None
    for an optimizer without one; never builds it."""
    optimizer = getattr(optimizer, "local", optimizer)
    return getattr(optimizer, "__dict__", {}).get("_muon_cache")


def guard_counters(optimizer: Any) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """``(shape, device counter)`` of the lean Muon step's fp16 guard, if the optimizer has it."""
    cache = _step_cache(optimizer)
    return [] if cache is None else cache.guard_counters()


def restart_nonfinite_momentum(optimizer: Any) -> None:
    """Restart the momentum the fp16 guard keeps skipping (see :func:`guard_counters`)."""
    cache = _step_cache(optimizer)
    if cache is not None:
        cache.restart_nonfinite_momentum()


class StepLog:
    """The trainer's ``train_step`` row of each log interval."""

    def _log_record(self, interval: LogInterval, clock: Callable[[], float],
                    grad_norm: torch.Tensor | None) -> dict[str, Any]:
        """The ``train_step`` row of the interval ending at this step."""
        world = self.world_size
        # The loop's only host sync: one read of (loss, grad norm, lr, the Muon step's fp16
        # guard counters) per log step.
        loss_sum = self._loss_sum.detach().float().reshape(())
        if self.dp is not None:  # the global mean: every rank added its share
            loss_sum = self.dp.all_reduce_sum(loss_sum.clone())
        reads = [loss_sum]
        if grad_norm is not None:
            reads.append(grad_norm.detach().float().reshape(()))
        lr_t = self._lr_used if isinstance(self._lr_used, torch.Tensor) else None
        if lr_t is not None:
            reads.append(lr_t.detach().float().reshape(()).to(reads[0].device))
        guards = guard_counters(self.optimizer)
        reads.extend(t.float().reshape(()).to(reads[0].device) for _, t in guards)
        reads.append(self._finite_steps.float().reshape(()).to(reads[0].device))
        values = torch.stack(reads).tolist()
        # read after the sync: it waited for the interval's queued device work
        dt = max(clock() - interval.start, 1e-9)
        finite_steps = int(values.pop())
        loss_value = values.pop(0)
        norm_value = values.pop(0) if grad_norm is not None else None
        lr_value = values.pop(0) if lr_t is not None else float(self._lr_used)
        if finite_steps < self.step - interval.steps or not math.isfinite(loss_value):
            # the count stops at the first step whose loss or grad norm was not finite
            raise self._nonfinite_error(interval.steps + finite_steps + 1,
                                        "the training loss or gradient norm")
        self._finite_steps.zero_()
        self._report_skipped_updates([(shape, int(v)) for (shape, _), v in zip(guards, values,
                                                                               strict=True)])
        # NaN for an interval without a counted micro-batch (all padding, or every step
        # skipped as non-finite): no token had a loss. last_loss (the checkpoint's, train_end's)
        # keeps the last real one: a skipped last step once ended the run with loss nan.
        interval_loss = (loss_value / self._micro_since_log
                         if self._micro_since_log else float("nan"))
        if self._micro_since_log:
            self.last_loss = interval_loss
        record = {
            "step": self.step,
            "loss": interval_loss,
            "lr": lr_value,
            "lr_group": self.optimizer.param_groups[0].get("name"),
            "grad_norm": norm_value,
            # global under torchrun: every rank runs micro-batches of one shape
            "tokens_per_sec": world * (self.tokens - interval.tokens) / dt,
            "samples_per_sec": world * (self.samples - interval.samples) / dt,
            "step_ms": 1000.0 * dt / max(1, self.step - interval.steps),
            "tokens": world * self.tokens,
            "memory_bytes": max_memory_bytes(self.device),
        }
        if self.dp is not None:
            record["ranks"] = world
            record["tokens_per_sec_per_rank"] = record["tokens_per_sec"] / world
        if self._mfu is not None:
            self._mfu.add(record, dt)
        return record

    def _report_skipped_updates(self, counts: list[tuple[tuple[int, int], int]]) -> None:
        """One warning per shape group with a non-finite 16-bit Newton-Schulz result since the
        last log step (the Muon step skipped those matrices' updates on the device), and the
        skipped matrices' momentum restarted so they train again."""
        seen = self._skipped_seen
        grew = False
        for shape, count in counts:
            if count > seen.get(shape, 0):
                logger.warning("muon: %d update(s) of %dx%d matrices up to step %d had a "
                               "non-finite 16-bit Newton-Schulz result and were skipped (%d so "
                               "far); their momentum restarts now. A non-finite gradient is the "
                               "cause: lower optimizer.lr, or set train.on_nonfinite: skip to "
                               "drop such steps",
                               count - seen.get(shape, 0), shape[0], shape[1], self.step, count)
                seen[shape] = count
                grew = True
        if grew:
            restart_nonfinite_momentum(self.optimizer)
