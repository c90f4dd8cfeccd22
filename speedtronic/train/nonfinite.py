"""The trainer's non-finite guard (``train.on_nonfinite``): a NaN/inf loss or gradient norm is
found without a host sync and never saved.

A loss of NaN once trained on, saved NaN weights, let ``keep_last`` prune every finite
checkpoint and ended in ``done: loss=nan`` with exit 0. Here, per step, three or four tiny device
ops count the steps of the open log interval whose loss and gradient norm were finite (a NaN in
the interval's loss sum sticks until the log step, so the count stops at the first bad step and
names it); the count is read with the loss at log steps and before every save, both of which read
device values anyway. ``skip`` must decide before the optimizer step, so it reads one flag per
step, as GradScaler's own skip does.

:class:`NonFiniteGuard` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose state
(``_loss_sum``, ``_finite_steps``, ``scaler``, ``params``, ...) it reads.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import NonFiniteError

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    """Checks of the trainer's loss, gradient norm and weights (see the module docstring)."""

    config: Any
    scaler: Any
    params: list[torch.Tensor]
    metrics: Any
    step: int
    checkpoints: Any
    _loss_sum: torch.Tensor
    _finite_steps: torch.Tensor
    _skip_nonfinite: bool
    _skipped_in_row: int
    skipped_steps: int
    _last_saved_step: int
    _interval_first_step: int

    def _count_finite_step(self, grad_norm: torch.Tensor | None) -> None:
        """Add this step to the device-side count of finite steps (no host read).

        A NaN in ``_loss_sum`` sticks until the log step zeroes it, so the count stops at the
        first bad step and names it. A non-finite gradient norm counts too, except under
        GradScaler, whose skipped fp16 steps are normal (their inf norm is why it skips)."""
        self._finite_steps += self._step_is_finite(grad_norm)

    def _step_is_finite(self, norm: torch.Tensor | None) -> torch.Tensor:
        """0-d bool on the device: the loss sum (and, without GradScaler, ``norm``) is finite.

        ``x * 0 == 0`` holds exactly for a finite ``x``, and a sum is finite only if both terms
        are: 2-3 ops where two ``isfinite`` calls and an ``&`` dispatched 9 (``isfinite`` is
        composite: eq, abs, ne, mul), counted per trainer step with DispatchCounter."""
        total = self._loss_sum
        if norm is not None and self.scaler is None:
            total = total + norm.to(total.device)  # loss sums and norms never near 1e38
        return (total * 0) == 0

    def _nonfinite_error(self, step: int, what: str) -> NonFiniteError:
        lr = self.config.optimizer.lr
        saved = (f"the newest checkpoint (step {self._last_saved_step}) is finite and nothing "
                 "after it was saved" if self.checkpoints is not None and
                 self._last_saved_step >= 0 else "nothing non-finite was saved")
        policy = (f"train.on_nonfinite: skip stops after train.max_skipped_steps="
                  f"{self.config.train.max_skipped_steps} in a row" if self._skip_nonfinite
                  else "train.on_nonfinite: stop")
        return NonFiniteError(
            f"step {step}: {what} is not finite (NaN or inf), so the run stopped ({policy}); "
            f"{saved}. Try a lower optimizer.lr (now {lr:g}), "
            + ("optimizer.grad_clip: 1.0, " if self.config.optimizer.grad_clip is None else "")
            + "precision.mode: bf16 or fp32"
            + ("" if self._skip_nonfinite else ", or train.on_nonfinite: skip to drop such steps")
            + "; then train again (--resume continues from the checkpoint with the new values)",
            step=step)

    def _refuse_nonfinite_state(self) -> None:
        """Before a save: the interval's loss, its finite-step count and every weight must be
        finite (one host read; the save reads every tensor anyway). A non-finite state is never
        written, so ``keep_last`` can never prune the last finite checkpoint away."""
        if not self.params:
            return
        # max |w| per tensor (ord=inf cannot overflow the way a 2-norm of large weights can)
        peaks = torch._foreach_norm([p.detach() for p in self.params], ord=float("inf"))
        weights_ok = torch.isfinite(torch.stack([t.float() for t in peaks])).all()
        loss_ok = torch.isfinite(self._loss_sum.to(weights_ok.device))
        finite_steps = self._finite_steps.to(weights_ok.device)
        loss_fine, weights_fine, counted = torch.stack([loss_ok, weights_ok,
                                                        finite_steps]).tolist()
        first_bad = self._interval_first_step + int(counted) + 1
        if not loss_fine or first_bad <= self.step:
            raise self._nonfinite_error(min(first_bad, self.step),
                                        "the training loss or gradient norm")
        if not weights_fine:
            raise self._nonfinite_error(self.step, "a model weight")

    def _skip_if_nonfinite(self, norm: torch.Tensor | None) -> bool:
        """``train.on_nonfinite: skip``: True (and the step's update dropped by the caller) when
        this step's loss or gradient norm is not finite. One host read per step."""
        if bool(self._step_is_finite(norm)):
            self._skipped_in_row = 0
            return False
        self._skipped_in_row += 1
        self.skipped_steps += 1
        step = self.step + 1
        if self._skipped_in_row >= self.config.train.max_skipped_steps:
            raise self._nonfinite_error(step, f"the loss or gradient norm of "
                                              f"{self._skipped_in_row} steps in a row")
        logger.warning("step %d: non-finite loss or gradient norm: update skipped "
                       "(train.on_nonfinite: skip; %d in a row, %d in this run)", step,
                       self._skipped_in_row, self.skipped_steps)
        self.metrics.emit("nonfinite_skip", {"step": step, "in_a_row": self._skipped_in_row,
                                             "total": self.skipped_steps})
        return True
