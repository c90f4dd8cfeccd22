"""What a trainer checkpoint holds and how a run comes back from one.

:meth:`TrainerState.state_dict` is everything needed to continue bit-exactly: weights, optimizer,
schedule, GradScaler, the data position and every RNG stream (per rank under torchrun, gathered
to rank 0), the callbacks' own state, the open log window and whether this step's eval is still
due. :meth:`TrainerState.load_state_dict` restores it, refusing a world-size change and a
checkpoint that does not fit the model or the optimizer with a message that says what to do.
:meth:`TrainerState.save_checkpoint` refuses non-finite weights first (the guard), then writes
on rank 0. Under FSDP2 the plain one-process format is gathered on save and re-sharded on load.

:class:`TrainerState` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose attributes
(``model``, ``optimizer``, ``data``, ``dp``, ``checkpoints``, ...) it reads.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..distributed import ddp as dp_step
from ..distributed import fsdp as fsdp_step
from ..errors import SpeedtronicError
from .checkpoint import capture_rng_state, mismatch_details, restore_rng_state
from .nonfinite import NonFiniteGuard

__all__ = ["DEFAULT_CALLBACK_NAME", "TrainerState"]

DEFAULT_CALLBACK_NAME = "callback"
""":class:`~speedtronic.train.trainer.TrainerCallback`'s default ``name``."""


class TrainerState(NonFiniteGuard):
    """The trainer's checkpoint content: save, restore, refuse what cannot resume."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly (see :mod:`speedtronic.train.checkpoint`)."""
        self._check_callback_names()  # also those appended after the trainer was built
        train = getattr(self.data, "train", None)
        rng = capture_rng_state()
        ranks = None
        if self.dp is not None:  # a collective: every rank calls state_dict at the same step
            ranks = self.dp.gather_objects(dp_step.rank_state(train, rng))
        return {
            "format": 1,
            "world_size": self.world_size,
            "ranks": ranks,  # per rank: data position and RNG streams (None: one process)
            "step": self.step,
            "tokens": self.tokens,
            "samples": self.samples,
            "model": (fsdp_step.full_model_state(self.model, keep=self.dp.is_main)
                      if self._fsdp and self.dp is not None else self.model.state_dict()),
            "optimizer": self._full(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng,
            "data": train.state_dict() if hasattr(train, "state_dict") else None,
            "callbacks": {self._cb_name(cb): cb.state_dict() for cb in self.callbacks
                          if callable(getattr(cb, "state_dict", None))},
            "config": self.config.to_dict(redact=True),
            # One host read per checkpoint (the save reads every tensor anyway).
            "log_window": {"loss_sum": float(self._loss_sum),
                           "micro_batches": self._micro_since_log},
            "last_loss": self.last_loss,
            "last_eval_loss": self.last_eval_loss,
            # Saved before this step's eval (see fit): a resume runs that eval first.
            "eval_pending": self._eval_pending,
        }

    def _full(self, state: Any) -> Any:
        """Under FSDP2: ``state`` with its DTensor shards gathered whole (a collective every rank
        joins), kept on rank 0 only, which writes the plain one-process format."""
        if not self._fsdp:
            return state
        assert self.dp is not None
        return fsdp_step.full_state(state, keep=self.dp.is_main)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict`."""
        own = self._own_rank_state(state)  # first: a world-size change loads nothing
        model_state, optimizer_state = state["model"], state["optimizer"]
        if self._fsdp:  # the plain format: each rank keeps its rows (no communication)
            model_state = fsdp_step.shard_model_state(self.model, model_state)
            optimizer_state = fsdp_step.shard_optimizer_state(self.optimizer, optimizer_state)
        try:
            self.model.load_state_dict(model_state)
        except RuntimeError as exc:
            raise SpeedtronicError("checkpoint does not fit this model (did model.* change?): "
                                   + mismatch_details(exc)) from None
        try:
            self.optimizer.load_state_dict(optimizer_state)
        except ValueError as exc:
            raise SpeedtronicError(f"the checkpoint's optimizer state does not fit this "
                                   f"optimizer ({exc}); did the model, its routing or "
                                   "optimizer.name change?") from None
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        train = getattr(self.data, "train", None)
        if own.get("data") is not None and hasattr(train, "load_state_dict"):
            train.load_state_dict(own["data"])
        saved_cb = state.get("callbacks") or {}
        # a checkpoint written before the class-name key holds one "callback" entry: it is
        # whose only where one callback keeps the default name
        defaults = [cb for cb in self.callbacks
                    if getattr(cb, "name", None) == DEFAULT_CALLBACK_NAME]
        for cb in self.callbacks:
            name = self._cb_name(cb)
            if name not in saved_cb and len(defaults) == 1 and cb is defaults[0]:
                name = DEFAULT_CALLBACK_NAME
            if name in saved_cb and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(saved_cb[name])
        self.step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.samples = int(state.get("samples", 0))
        self._last_saved_step = self.step
        self.last_loss = state.get("last_loss")
        self.last_eval_loss = state.get("last_eval_loss")
        self._resume_eval = bool(state.get("eval_pending", False))
        window = state.get("log_window") or {}
        self._restored_window = (float(window.get("loss_sum", 0.0)),
                                 int(window.get("micro_batches", 0)))
        restore_rng_state(own["rng"])

    @property
    def eval_pending(self) -> bool:
        """The loaded checkpoint was written ahead of its step's eval (the first thing ``fit``
        then runs); set it False where that eval is known to have run."""
        return self._resume_eval

    @eval_pending.setter
    def eval_pending(self, value: bool) -> None:
        self._resume_eval = bool(value)

    def _refuse_nonfinite_state(self) -> None:
        """The guard's check before a save; under FSDP2 each rank holds only its shards of the
        weights, so the guard sees one stand-in that is NaN when any rank has a non-finite
        weight (one all-reduce: every rank then refuses the save alike)."""
        if not self._fsdp or not self.params:
            return super()._refuse_nonfinite_state()
        assert self.dp is not None
        ok = fsdp_step.all_finite(self.params, self.dp)
        stand_in = torch.where(ok, 0.0, float("nan")).reshape(1)
        params, self.params = self.params, [stand_in]
        try:
            super()._refuse_nonfinite_state()
        finally:
            self.params = params

    def _own_rank_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's data position and RNG streams in ``state`` (refused when the checkpoint
        was written by another number of ranks)."""
        if self.dp is not None:
            return dp_step.pick_rank_state(state, self.dp, "the checkpoint")
        saved = int(state.get("world_size", 1) or 1)
        if saved != 1:
            raise SpeedtronicError(
                f"cannot resume: the checkpoint was written by a run of {saved} ranks (torchrun) "
                "and this run is one process; each rank's data position and RNG streams are in "
                f"it. Resume under torchrun with {saved} processes, or start a new run.name "
                "from its weights (model.init_from)")
        return {"data": state.get("data"), "rng": state["rng"]}

    @staticmethod
    def _cb_name(cb: Any) -> str:
        """The key of a callback's state in a checkpoint: its ``name``, or its class name where
        it kept :class:`TrainerCallback`'s default (two such subclasses once shared the key
        "callback", and on resume one got the other's state)."""
        name = getattr(cb, "name", None)
        return type(cb).__name__ if name in (None, DEFAULT_CALLBACK_NAME) else str(name)

    def _check_callback_names(self) -> None:
        """Two callbacks with state under one key would overwrite each other's: refused."""
        seen: dict[str, Any] = {}
        for cb in self.callbacks:
            if not callable(getattr(cb, "state_dict", None)):
                continue
            name = self._cb_name(cb)
            if name in seen:
                raise SpeedtronicError(
                    f"callbacks {type(seen[name]).__name__} and {type(cb).__name__} both save "
                    f"their state under {name!r}; give each a distinct `name` attribute")
            seen[name] = cb

    def save_checkpoint(self, force: bool = False) -> Path | None:
        """Write a checkpoint of the current step (no-op if checkpointing is off, or if this
        step is already saved unless ``force``)."""
        writes = self.checkpoints is not None
        if not (writes or self.saves_on_rank0) or (self._last_saved_step == self.step
                                                    and not force):
            return None
        self._refuse_nonfinite_state()
        state = self.state_dict()  # under torchrun: gathers every rank's data position and RNG
        if not writes:  # a rank other than 0: rank 0 writes the file
            self._last_saved_step = self.step
            self._last_save_time = time.perf_counter()
            return None
        assert self.checkpoints is not None
        path = self.checkpoints.save(self.step, state)
        self._last_saved_step = self.step
        self._last_save_time = time.perf_counter()
        self.metrics.emit("checkpoint", {"step": self.step, "path": str(path)})
        return path
