"""Hierarchical DiLoCo: a ``torchrun`` group that is one DiLoCo worker.

Inside the group the ranks train with DDP (every step); only rank 0 runs the DiLoCo worker
callback and talks to the store. Whatever that worker does to the model or the inner optimizer
must reach every rank, or the replicas drift apart and DDP averages gradients of different
models. :class:`GroupRelay` runs on every rank, after the worker on rank 0:

* at start, after rank 0 installed the first global, rank 0's parameters are broadcast;
* after every optimizer step the ranks agree (one host all-reduce of two ints on the gloo
  control group, 0.27 ms median on loopback) on whether rank 0 replaced its weights (a global
  or a consistent base installed) or reset the inner optimizer this step; a replacement is a
  broadcast of the parameters from rank 0 (once per round), a reset is done on every rank;
* at the end, after rank 0's final sync, the same, and a replaced model is reported to every
  rank's trainer, so the closing eval and checkpoint (collectives) run on all of them.

Rank 0's waits (the first global, the final sync) hold the other ranks in a collective, so the
group's ``data_parallel.timeout_s`` must exceed them: checked at start.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError, SpeedtronicConfig
from .process_group import DataParallel

__all__ = ["GroupRelay", "check_hierarchical"]


def check_hierarchical(cfg: SpeedtronicConfig) -> None:
    """Refuse what a torchrun group cannot be in DiLoCo, before anything is built."""
    d = cfg.distributed
    if d.role != "worker":
        raise ConfigError("distributed.role: master under torchrun: the master is one process "
                          "(python -m speedtronic.diloco master, or one speedtronic train with "
                          "role: master); only a worker can be a torchrun group")
    # Rank 0's longest wait on the store while the other ranks sit in a collective (the round
    # boundary's waits were left out: a 40 s push-pull wait under a 15 s timeout_s was
    # accepted and ended in a gloo timeout).
    which, longest = max(d.store_waits().items(), key=lambda item: item[1])
    if longest >= cfg.data_parallel.timeout_s:
        raise ConfigError(
            f"data_parallel.timeout_s: {cfg.data_parallel.timeout_s:g} s, but rank 0 of this "
            f"DiLoCo worker group may wait up to {longest:g} s for the store ({which}) while "
            "the other ranks wait for it in a collective; set data_parallel.timeout_s above "
            f"{longest:g}" + (" or lower those waits" if math.isinf(longest) else ""))


class GroupRelay:
    """Keeps every rank of a DiLoCo worker group on rank 0's weights and optimizer resets.

    ``worker``: rank 0's DiLoCo worker callback (None on the other ranks); it must run before
    this callback in the trainer's list."""

    name = "diloco_group"

    def __init__(self, dp: DataParallel, worker: Any = None) -> None:
        self.dp = dp
        self.worker = worker
        self._seen_replacements = 0
        self._seen_resets = 0

    # -- rank 0's facts, agreed by every rank ----------------------------------------------
    def _agree(self, trainer: Any) -> tuple[bool, bool]:
        replaced = reset = 0
        if self.dp.is_main:
            replacements = getattr(trainer, "replacements", 0)
            resets = int(self.worker.m.get("resets", 0)) if self.worker is not None else 0
            replaced = int(replacements != self._seen_replacements)
            reset = int(resets != self._seen_resets)
            self._seen_replacements, self._seen_resets = replacements, resets
        agreed = self.dp.agree_max([replaced, reset])
        return bool(agreed[0]), bool(agreed[1])

    @torch.no_grad()
    def _broadcast_weights(self, trainer: Any) -> None:
        for p in trainer.model.parameters():  # one broadcast per tensor, once per round
            dist.broadcast(p.data, src=0)

    def _sync(self, trainer: Any, *, at_end: bool = False) -> None:
        replaced, reset = self._agree(trainer)
        if replaced:
            self._broadcast_weights(trainer)
            if at_end and not self.dp.is_main:  # rank 0's worker told its own trainer
                trainer.weights_replaced("DiLoCo global (from rank 0)")
        if reset and not self.dp.is_main:  # rank 0's worker reset its own optimizer
            opt = trainer.optimizer
            if hasattr(opt, "reset_state"):
                opt.reset_state()
            else:
                opt.state.clear()

    # -- trainer callback ------------------------------------------------------------------
    def on_train_start(self, trainer: Any) -> None:
        if self.dp.is_main:
            self._seen_replacements = getattr(trainer, "replacements", 0) - 1  # force one
        self._sync(trainer)

    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        self._sync(trainer)

    def on_train_end(self, trainer: Any) -> None:
        # A run that stopped early (an error, a signal) ends without a final sync on rank 0,
        # and an error is rank-local: waiting in a collective here would keep the failed rank
        # from exiting, and torchrun from stopping the others.
        if getattr(trainer, "stopped_by", None) is None:
            self._sync(trainer, at_end=True)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
