"""One optimizer step: its micro-batches' forward and backward, then clip, update, schedule.

:meth:`OptimizerStep._accumulate_step` runs the step's micro-batches, token-weighted (see
:mod:`.accumulation`); under ``torchrun`` every rank runs every micro-batch and the gradient
all-reduce happens once, at the last. The first forward of a compiled model falls back to eager
if the *compiler* fails. :meth:`OptimizerStep._clip_and_step` then flushes deferred gradients,
unscales, clips, steps the optimizer (or drops a non-finite step in ``on_nonfinite: skip``) and
advances the schedule; it reads nothing from the device, except under fp16: torch's
``GradScaler.step`` reads its found-inf flag (one host sync per step; our optimizers do not
take the scaler's device-side skip, ``_step_supports_amp_scaling``).

:class:`OptimizerStep` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose attributes
(``model``, ``optimizer``, ``precision``, ``dp``, ...) it reads.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..distributed import ddp as dp_step
from ..distributed import fsdp as fsdp_step
from ..errors import first_line
from ..models.loss import extract_loss
from .accumulation import StepWeights, counted_tokens
from .precision import compile_error_types

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["OptimizerStep", "clip_scaled_grad_norm_"]


def norm_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    """fp32 for the gradient norm (16-bit gradients summed in fp32), fp64 when any gradient is
    fp64: ``_foreach_norm`` refuses to narrow a double (a float64 model crashed at clipping)."""
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def clip_scaled_grad_norm_(params: list[torch.nn.Parameter], max_norm: float,
                           factor: float) -> torch.Tensor:
    """``clip_grad_norm_`` of the gradients times ``factor``, with the factor folded into the
    clip's multiply: the gradients end as ``factor * g * min(1, max_norm / (factor |g| + 1e-6))``
    (torch's clip of ``factor * g``) after one read and one write of each, not two writes.
    Returns the norm of ``factor * g`` (a device tensor, not read here)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if len({g.device for g in grads}) > 1:  # torch's clip handles devices; keep it simple
        torch._foreach_mul_(grads, factor)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = torch._foreach_norm(grads, 2.0, dtype=norm_dtype(grads))
    total = torch.linalg.vector_norm(torch.stack(norms)) * factor
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) * factor  # 0-d, on the device
    torch._foreach_mul_(grads, coef)
    return total


class OptimizerStep:
    """Forward + backward of one optimizer step's micro-batches, then the update."""

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.device.type == "cuda"
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, rel: float = 1.0,
                    scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached loss (on device).

        ``rel``: this micro-batch's counted tokens relative to the step's first (see
        :meth:`fit`); 1.0 backpropagates ``loss / accumulation_steps`` exactly as plain
        averaging does. ``scale`` (data parallel) replaces ``rel / k``: the micro-batch's share
        of the step's tokens over all ranks, times the world size."""
        with self.precision.autocast():
            loss = extract_loss(self._forward(x, y))
        k = self.accumulation_steps
        if scale is not None:
            scaled = loss * scale
        elif rel != 1.0:
            scaled = loss * (rel / k)
        elif k > 1:
            scaled = loss / k
        else:  # loss / 1 is exact, but it dispatched a div forward and one backward
            scaled = loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach().float()

    def _first_compiled_micro_step(self, x: torch.Tensor, y: torch.Tensor, rel: float = 1.0,
                                   scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """Run the first compiled forward; on a *compiler* failure, fall back to eager.

        Only compiler exceptions are caught: a model bug raises again from the eager re-run, so
        it is never hidden. The RNG is rewound so the eager re-run sees the same dropout masks.
        """
        self._compile_pending = False
        rng = torch.get_rng_state()
        t0 = time.perf_counter()
        try:
            loss = self._micro_step(x, y, rel, scale)
            logger.info("torch.compile: compiled in %.1f s (first forward + backward)",
                        time.perf_counter() - t0)
            return loss
        except compile_error_types() as exc:
            return self._compile_failed(exc, rng, x, y, rel, scale)
        finally:
            # kept out of the log interval's timing, as evals and saves are: a 17 s compile
            # once read as 17353 ms/step and a wrong eta on the first line
            self._compile_seconds = time.perf_counter() - t0
            self.compile_seconds += self._compile_seconds

    def _compile_failed(self, exc: BaseException, rng: torch.Tensor, x: torch.Tensor,
                        y: torch.Tensor, rel: float,
                        scale: torch.Tensor | float | None) -> torch.Tensor:
        """Say why the compiler failed, then run the micro-batch eagerly from the same RNG."""
        reason = first_line(exc)
        logger.warning("torch.compile: off (compiler failed, running eager: %s: %s)",
                       type(exc).__name__, reason[:300])
        # train_start said compile: true before the first forward; the record says it ended
        self.compile_on = False
        self.metrics.emit("compile_off", {"step": self.step, "reason":
                                          f"{type(exc).__name__}: {reason[:300]}"})
        self._forward = self._ddp if self._ddp is not None else self.model
        self.optimizer.zero_grad(set_to_none=True)
        torch.set_rng_state(rng)
        return self._micro_step(x, y, rel, scale)

    def _clip_and_step(self, need_norm: bool, update: bool = True) -> torch.Tensor | None:
        """Flush deferred grads, unscale, clip, step, zero grads, advance the schedule.

        Returns the global grad norm (a device tensor, not read here): from clipping, or computed
        only when ``need_norm`` (a log step) if clipping is off. ``update=False`` (a step whose
        micro-batches were all padding: no gradient) only advances the schedule.
        """
        if not update:
            if self._owned_muon:  # backward hooks started its reduce-scatters: end them
                self.optimizer.finish_gradients()  # type: ignore[attr-defined]
            if need_norm:
                self._lr_used = self.optimizer.param_groups[0]["lr"]
            self.optimizer.zero_grad(set_to_none=True)
            self._advance_schedule(stepped=False)
            return None
        if self._ooo is not None:
            self._ooo.flush()  # deferred weight gradients must land before they are read
        # Token weighting of an accumulated step (see fit) multiplies every gradient by the
        # step's factor. With plain clipping it rides on the clip's own multiply instead: one
        # pass over the gradients fewer (58 -> 38 ms per step on GPT-2 small's 124M fp32
        # gradients, 1 CPU thread, medians of 8 back to back).
        factor, self._grad_factor = self._grad_factor, 1.0
        clip = self.config.optimizer.grad_clip
        fold = (factor != 1.0 and clip is not None and self.scaler is None and not self._fsdp
                and not self._owned_muon)
        if factor != 1.0 and not fold:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], factor)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self._fsdp:  # DTensor gradients: the norm all-reduced into a plain device scalar
            if clip is not None or need_norm or self._skip_nonfinite:
                norm = fsdp_step.grad_norm(self.params, clip)
        elif self._owned_muon:  # each rank holds its share of the Muon gradients
            self.optimizer.finish_gradients()  # type: ignore[attr-defined]
            if clip is not None or need_norm or self._skip_nonfinite:
                norm = self.optimizer.clip_grad_norm_(clip)  # type: ignore[attr-defined]
        elif fold:
            norm = clip_scaled_grad_norm_(self.params, clip, factor)
        elif clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        elif need_norm or self._skip_nonfinite:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:  # one foreach op, not one norm per parameter (110 ops on GPT-2 small)
                norm = torch.linalg.vector_norm(
                    torch.stack(torch._foreach_norm(grads, 2.0, dtype=norm_dtype(grads))))
        if need_norm:  # the lr this step uses, for its log row (the schedule moves it below)
            lr = self.optimizer.param_groups[0]["lr"]
            self._lr_used = lr.clone() if isinstance(lr, torch.Tensor) else lr
        stepped = True
        if self._skip_nonfinite and self._skip_if_nonfinite(norm):
            stepped = False
            if self.scaler is not None:
                self.scaler.update()  # unscale_ ran: the scaler needs its update to go on
            self._loss_sum.copy_(self._loss_before_step)  # the dropped step is not logged
            self._micro_since_log = self._micro_before_step
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._advance_schedule(stepped)
        return norm

    def _advance_schedule(self, stepped: bool) -> None:
        """One schedule step. A step without ``optimizer.step()`` (all padding, or skipped as
        non-finite) is on purpose: torch's warning about the call order would mislead."""
        if self.scheduler is None:
            return
        if stepped:
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    def _accumulate_step(self, it: Iterator[Any]) -> bool:
        """Forward + backward of one optimizer step's micro-batches, token-weighted (see
        :mod:`.accumulation`); False when every micro-batch was padding (no gradient).
        """
        if self.dp is not None:
            return self._accumulate_step_data_parallel(it)
        k = self.accumulation_steps
        weigh = k > 1
        weights = StepWeights(k)
        step_losses: list[torch.Tensor] = []
        ran = 0
        for _ in range(k):
            x, y = next(it)
            # counted at k = 1 too: an all-padding batch there once reached the loss as NaN and
            # stopped the run (or counted as a skipped non-finite step) instead of being skipped
            n = counted_tokens(y)
            self._micro_since_log += 1
            # tokens read, the same at every world size (under torchrun every rank runs every
            # micro-batch, and the job's count is world x a rank's)
            self.tokens += x.numel()
            self.samples += x.shape[0]
            if n == 0:
                continue  # all padding: nothing to learn, and its mean loss is NaN
            if self._mfu is not None:
                self._mfu.count(x)  # model FLOPs of what ran: a skipped batch inflated MFU
            rel = weights.weight(n)
            ran += 1
            x, y = self._to_device(x, y)
            if self._compile_pending:
                loss = self._first_compiled_micro_step(x, y, rel)
            else:
                loss = self._micro_step(x, y, rel)
            loss = loss if rel == 1.0 else loss * rel
            self._loss_sum += loss
            if weigh:
                step_losses.append(loss)  # summed only if the factor is not 1
        factor = weights.gradient_factor()
        if factor != 1.0:
            self._grad_factor = factor
            # the log's mean is per token too
            self._loss_sum += torch.stack(step_losses).sum() * (factor - 1.0)
        if not ran:  # every micro-batch was padding: no loss to log either
            self._micro_since_log -= k
        return ran > 0

    def _accumulate_step_data_parallel(self, it: Iterator[Any]) -> bool:
        """One step's local micro-batches under DDP, weighted by the step's tokens over all
        ranks (see :mod:`speedtronic.distributed.ddp`); one gradient all-reduce, at the last.

        Every rank runs every micro-batch, padding included, so the collectives line up."""
        assert self.dp is not None and (self._ddp is not None or self._fsdp)
        sync_context = fsdp_step.sync_context if self._fsdp else dp_step.sync_context
        sync_module = self.model if self._fsdp else self._ddp
        k, world = self.accumulation_steps, self.world_size
        batches = [next(it) for _ in range(k)]
        counts = [counted_tokens(y) for _, y in batches]
        scales = dp_step.step_scales(counts, self.dp)
        for i, ((x, y), n) in enumerate(zip(batches, counts, strict=True)):
            self._micro_since_log += 1
            self.tokens += x.numel()
            self.samples += x.shape[0]
            if self._mfu is not None:
                self._mfu.count(x)  # every micro-batch runs here, padding included
            if n == 0:
                y = dp_step.one_token_labels(y)  # scale 0: runs only to keep DDP in step
            x, y = self._to_device(x, y)
            with sync_context(sync_module, sync=i == k - 1):
                if self._compile_pending:
                    loss = self._first_compiled_micro_step(x, y, scale=scales.scales[i])
                else:
                    loss = self._micro_step(x, y, scale=scales.scales[i])
            # this rank's share of the step's global mean loss, times k: the log divides the
            # all-reduced sum by the local micro-batch count
            self._loss_sum += loss * (scales.scales[i] * (k / world))
        return scales.has_gradient()
