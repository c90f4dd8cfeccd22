"""The learning-rate schedule and the run's seeds.

One ``LambdaLR`` over every param group (:func:`build_scheduler`), so the Muon and AdamW
groups keep the ratio of their learning rates: linear warmup, then constant or a cosine down to
``scheduler.min_lr_ratio`` (:func:`lr_factor`). A schedule that cannot do what its config says
(a warmup longer than the run, a cosine that ends early) gets one warning naming both numbers.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import numpy as np
import torch

from ..config import SpeedtronicConfig

logger = logging.getLogger("speedtronic.schedule")

__all__ = ["FloatBaseLambdaLR", "build_scheduler", "lr_factor", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for reproducible init and data order."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def lr_factor(step: int, warmup: int, horizon: int, name: str, min_ratio: float) -> float:
    """Multiplier of the peak lr before optimizer step ``step`` (0-based).

    Linear warmup ``(step+1)/warmup`` for ``step < warmup``; then 1 (constant) or a cosine from 1
    down to ``min_ratio`` at ``horizon`` (held there after it).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, horizon - warmup)))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class FloatBaseLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` whose step computes each group's lr in Python floats and writes it once.

    Muon's lr is a 0-d device tensor (so a compiled step never recompiles); torch's step then
    costs 3 device ops per such group (``base_lr * factor``, ``fill_``, a ``clone`` for
    ``_last_lr``), 1 here (``fill_(float)``). The base lrs are read once, at construction and at
    ``load_state_dict``, never per step (a read would be a host sync). The state dict is
    LambdaLR's, so checkpoints of either load into either."""

    _base_floats: list[float] | None = None
    _base_source: list[Any] | None = None  # the base_lrs list the floats were read from

    def _float_base_lrs(self) -> None:
        self._base_floats = [float(b) for b in self.base_lrs]
        self._base_source = self.base_lrs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._float_base_lrs()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("_base_floats", None)  # derived from base_lrs; LambdaLR's keys only
        state.pop("_base_source", None)
        return state

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None:  # torch's deprecated form: its own path
            super().step(epoch)
            return
        if self._base_floats is None or self._base_source is not self.base_lrs:
            # the first step (from LambdaLR's __init__), or base_lrs replaced: a resume with a
            # changed lr sets the config's (train/resume.py); reading the old floats put the
            # checkpoint's lr back after one step
            self._float_base_lrs()
        self._step_count += 1
        self.last_epoch += 1
        values = [base * lmbda(self.last_epoch)
                  for base, lmbda in zip(self._base_floats, self.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = values


def build_scheduler(optimizer: torch.optim.Optimizer,
                    cfg: SpeedtronicConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """One LambdaLR over every param group, so per-group lrs (Muon vs AdamW) keep their ratio.

    The factor is a closure, not a callable object, so LambdaLR's state_dict stores only the
    step counter: a resumed run uses the schedule of *its* config.
    """
    s = cfg.scheduler
    horizon = s.max_steps or cfg.run.max_steps
    _warn_about_schedule(cfg, horizon)

    def factor(step: int) -> float:
        return lr_factor(step, s.warmup_steps, horizon, s.name, s.min_lr_ratio)

    return FloatBaseLambdaLR(optimizer, factor)


def _warn_about_schedule(cfg: SpeedtronicConfig, horizon: int) -> None:
    """A schedule that cannot do what it says gets one warning naming both numbers."""
    s, steps = cfg.scheduler, cfg.run.max_steps
    if s.warmup_steps > steps:  # lr_factor reaches 1.0 at step warmup_steps (1-based)
        logger.warning("scheduler: warmup_steps=%d > run.max_steps=%d, so the run never reaches "
                       "its peak learning rate (it ends at %.0f%% of it); set "
                       "scheduler.warmup_steps to at most %d, e.g. %d (10%% of the run)",
                       s.warmup_steps, steps, 100.0 * steps / max(1, s.warmup_steps), steps,
                       max(1, steps // 10))
    elif s.name == "cosine" and horizon < steps:
        logger.warning("scheduler: the cosine ends at scheduler.max_steps=%d but the run lasts "
                       "run.max_steps=%d, so the last %d steps stay at min_lr_ratio=%g; set "
                       "scheduler.max_steps to %d or null (= run.max_steps)", horizon, steps,
                       # a horizon at or below the warmup: the first step after warmup is
                       # still the peak (progress 0), so one step fewer sits at the floor
                       steps - max(horizon, s.warmup_steps + 1), s.min_lr_ratio, steps)
