"""The optional machinery the trainer switches on around the model, each decided once.

At construction :meth:`TrainerFeatures._configure_features` turns on gradient checkpointing (when
the model has the hook) and ``torch.compile`` (its decision from :mod:`.precision`, off under
FSDP2 for ``auto``), one log line each. At the top of ``fit``
:meth:`TrainerFeatures._start_features` runs the shape check, builds the out-of-order backprop
scheduler and its start-of-run trial, and the MFU meter; :meth:`TrainerFeatures._end_ooo_trial`
records the trial's outcome.

:class:`TrainerFeatures` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose
attributes (``model``, ``config``, ``device``, ``precision``, ``metrics``, ...) it reads.
"""

from __future__ import annotations

import logging

import torch

from ..ooo import scheduler as ooo
from ..ooo.trial import OOOTrial
from . import shapes
from .mfu import MfuMeter
from .precision import decide_compile

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["TrainerFeatures"]


class TrainerFeatures:
    """Gradient checkpointing, compile, shape check, out-of-order backprop, MFU: set up once."""

    def _configure_features(self) -> None:
        cfg = self.config
        if cfg.gradient_checkpointing:
            hook = getattr(self.model, "set_gradient_checkpointing", None)
            if callable(hook):
                hook(True)
                logger.info("gradient checkpointing: on")
            else:
                logger.warning("gradient checkpointing: off (%s has no "
                               "set_gradient_checkpointing(bool))", type(self.model).__name__)
        self.compile_on, why = decide_compile(cfg, self.device)
        if self._fsdp and self.compile_on:  # compile: true is refused at start (fsdp.py)
            self.compile_on, why = False, "auto: off under data_parallel.fsdp"
        if self.compile_on:
            self._forward = torch.compile(self._forward)  # a compiled DDP module under torchrun
            self._compile_pending = True  # real compilation happens on the first forward
            logger.info("torch.compile: on, %s (compiles on the first step; falls back to "
                        "eager if the compiler fails)", why)
        else:
            logger.info("torch.compile: off, %s", why)

    def _start_features(self) -> None:
        if self.config.shape_validation.enabled:
            self._shape_report = shapes.check_shapes(self.model, self.config, self.device,
                                                     self.precision.dtype)
            table = self._shape_report.format_table()
            if table:
                self.metrics.line(table)
            else:  # off (alignment: none, or CPU): the decision line, never a warning
                logger.info("shape check: off (%s)", self._shape_report.reason)
        self._ooo = ooo.build_ooo_scheduler(self.model, self.config, self.device)
        if self._ooo is not None:
            if self.config.ooo_trial_pairs > 0:
                self._ooo_trial = OOOTrial(self._ooo, self.device, self.config.ooo_trial_pairs)
                logger.info("ooo backprop: the first %d steps alternate it on and off; it stays "
                            "on only where it measures faster", len(self._ooo_trial.plan))
            else:
                logger.info("ooo backprop: stays on without a trial (ooo_trial_pairs: 0)")
        seq_len = getattr(self.data, "block_size", None) or self.config.data.block_size \
            or self.config.model.max_seq_len
        self._mfu = MfuMeter(self.model, int(seq_len), self.device, self.precision.mode,
                             self.config.run.peak_tflops)

    def _end_ooo_trial(self, trial: OOOTrial, step: int) -> None:
        """Record the out-of-order trial's outcome; a scheduler it closed is dropped."""
        self._ooo_trial = None
        self.metrics.emit("ooo_decision", {"step": step, **(trial.summary or {})})
        if trial.decided is False:
            self._ooo = None  # closed by the trial: every Linear has its own forward back
