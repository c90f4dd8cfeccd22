"""Resuming a run: the checkpoint that fits, and the config's hyper-parameters over it.

A resume refuses what it cannot honour before anything on disk changes (a changed architecture,
a checkpoint beyond ``run.max_steps``). What it can honour, it runs: a changed ``optimizer.*`` or
``scheduler.*`` value once silently kept the checkpoint's lr and weight decay while
``config.yaml`` recorded the new ones; now the config's values are put back over the loaded
param groups (moments and counters stay the checkpoint's) and one warning lists each change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..models.builtin import architecture_changes
from .checkpoint import CheckpointError, CheckpointManager
from .trainer import Trainer
from .v2_checkpoints import V2_CHECKPOINT_ADVICE, find_v2_checkpoints, is_v2_checkpoint_file

logger = logging.getLogger("speedtronic.runtime")

__all__ = ["architecture_changes", "resume_trainer"]


def resume_trainer(trainer: Trainer, directory: Path) -> bool:
    """Load the newest usable checkpoint of ``directory`` into ``trainer``; True if one was.

    Raises (before anything is written) when the checkpoint does not fit this run."""
    manager = CheckpointManager(directory, keep_last=None)
    legacy = None
    if not [p for _, p in manager.list() if not is_v2_checkpoint_file(p)]:
        # 2.0 kept checkpoints in <output_dir>/checkpoints, one folder above this version's
        # run directory: --resume of a 2.0 run started a fresh one without naming them
        legacy = find_v2_checkpoints(directory, directory.parent.parent)
        if legacy == directory:  # 2.0's files where this run's would go: nothing to start on
            raise CheckpointError(f"--resume: {legacy} holds speedtronic 2.0 checkpoints: "
                                  f"{V2_CHECKPOINT_ADVICE} (under another run.name, or "
                                  "without --resume)")
    found = manager.load_latest()
    if found is None:
        # A job that always passes --resume starts fresh (the documented rule), 2.0 files or not
        logger.warning("resume: no checkpoint in %s; starting a fresh run from step 0%s",
                       directory, "" if legacy is None else
                       f" ({legacy} holds speedtronic 2.0 checkpoints: {V2_CHECKPOINT_ADVICE})")
        return False
    state, path = found
    saved = state.get("config") or {}
    current = trainer.config.to_dict(redact=True)
    what = architecture_changes(saved.get("model") or {}, current.get("model") or {})
    if what:
        raise CheckpointError(f"cannot resume from {path}: {what}. A resumed run keeps the "
                              "model's architecture: set those keys back, or train a fresh run "
                              "(without --resume, or under another run.name)")
    step, target = int(state["step"]), trainer.config.run.max_steps
    if step > target:
        raise CheckpointError(f"cannot resume from {path}: it is at step {step}, beyond "
                              f"run.max_steps {target}; set --max-steps (run.max_steps) above "
                              f"{step} to train further")
    changed = [f"{sec}.{k}: {_short(v)} -> {_short((current.get(sec) or {}).get(k))}"
               for sec in ("optimizer", "scheduler", "model", "data", "train")
               for k, v in (saved.get(sec) or {}).items()
               if (current.get(sec) or {}).get(k) != v]
    fresh = _hyper_parameters(trainer)
    trainer.load_state_dict(state)
    if changed:
        # The config's values are the ones that run (and config.yaml records them): the loaded
        # optimizer groups and schedule get them back; the state (moments, step) is kept.
        _reapply_hyper_parameters(trainer, fresh)
        logger.warning("resume: the config differs from the checkpoint's; running with the "
                       "config's values (the run will not match an uninterrupted one): %s",
                       "; ".join(changed[:12]) + ("; ..." if len(changed) > 12 else ""))
    logger.info("resume: loaded %s (step %d of %d)%s", path, trainer.step, target,
                "; nothing left to train (raise run.max_steps to continue)"
                if step == target else "")
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


#: Param-group entries that are bookkeeping, not hyper-parameters of the config.
_GROUP_BOOKKEEPING = frozenset({"params", "initial_lr", "lr"})


def _hyper_parameters(trainer: Trainer) -> tuple[list[dict[str, Any]], list[float] | None]:
    """The freshly built optimizer's per-group hyper-parameters (from this config) and the
    schedule's base lrs, taken before a checkpoint's values replace them."""
    groups = [{k: (float(v) if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
               for k, v in g.items() if k not in _GROUP_BOOKKEEPING}
              for g in trainer.optimizer.param_groups]
    base = list(trainer.scheduler.base_lrs) if trainer.scheduler is not None else \
        [float(g["lr"]) for g in trainer.optimizer.param_groups]
    return groups, [float(b) for b in base]


def _reapply_hyper_parameters(trainer: Trainer,
                              fresh: tuple[list[dict[str, Any]], list[float] | None]) -> None:
    """Put this config's hyper-parameters back over a loaded checkpoint's: every group value
    (weight decay, betas, eps, momentum, ...), the schedule's base lrs and the lr of the
    current step from this config's schedule. 0-d tensor values are filled in place, as the
    schedulers do (the Muon step keeps its hyper-parameters as device tensors)."""
    groups, base = fresh
    opt, sched = trainer.optimizer, trainer.scheduler
    for group, values, base_lr in zip(opt.param_groups, groups, base or [], strict=False):
        for key, value in values.items():
            _set_group_value(group, key, value)
        if "initial_lr" in group:
            _set_group_value(group, "initial_lr", base_lr)
        factor = sched.lr_lambdas[0](sched.last_epoch) if sched is not None else 1.0
        _set_group_value(group, "lr", base_lr * factor)
    if sched is not None:
        sched.base_lrs = list(base or sched.base_lrs)
        sched._last_lr = [g["lr"] for g in opt.param_groups]  # what get_last_lr() reports


def _set_group_value(group: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(group.get(key), torch.Tensor) and group[key].dim() == 0 \
            and isinstance(value, (int, float)):
        group[key].fill_(value)  # in place: the step may hold this tensor
    else:
        group[key] = value
