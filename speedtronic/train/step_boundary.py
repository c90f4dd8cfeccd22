"""What ``fit`` does at a step boundary besides the log row and the checkpoint.

The held-out evaluation (:meth:`StepBoundary.evaluate`, token-weighted, its batches fixed and
cached on the device); the stops every rank must agree on under ``torchrun`` (a preemption
signal, a time-based save) and the preemption stop itself; and torchft's healing: a step the
quorum did not commit is dropped, a peer's step is jumped to. The log row is :mod:`.step_log`,
the checkpoint :mod:`.trainer_state`.

:class:`StepBoundary` is mixed into :class:`~speedtronic.train.trainer.Trainer`, whose attributes
(``model``, ``data``, ``dp``, ``metrics``, ``config``, ...) it reads.
"""

from __future__ import annotations

import torch

from ..errors import RunPreempted
from ..models.loss import extract_loss
from .accumulation import counted_tokens
from .preemption import requeue_slurm_job

__all__ = ["StepBoundary"]


class StepBoundary:
    """Evaluation, agreed stops, the preemption stop and torchft's step moves."""

    def evaluate(self) -> float:
        """Mean loss per label token over the fixed held-out batches (the same every call).

        Token-weighted like training: each batch's mean loss counts by its label tokens, and a
        batch of nothing but padding counts for nothing (its mean is NaN, which once made every
        eval_loss of the run NaN). Labels that cannot be counted on the host weigh 1 per batch."""
        if self._eval_cache is None:
            batches = list(self.data.eval_batches(self.config.run.eval_batches))
            counts = [counted_tokens(y) for _, y in batches]
            weights = [1.0 if n is None else float(n) for n in counts]
            self._eval_total_weight = sum(weights)  # over every rank's share
            if self.dp is not None:  # each rank evaluates its share; the sum is all-reduced
                world = self.dp.world_size
                mine, weights = batches[self.dp.rank::world], weights[self.dp.rank::world]
                if self._fsdp and batches:
                    # an FSDP2 forward is a collective: every rank runs as many batches, a
                    # rank short of its share re-runs the first one with weight 0
                    pad = -(-len(batches) // world) - len(mine)
                    mine, weights = mine + [batches[0]] * pad, weights + [0.0] * pad
                batches = mine
            self._eval_cache = [(x.to(self.device), y.to(self.device)) for x, y in batches]
            self._eval_weights = weights
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for (x, y), w in zip(self._eval_cache, self._eval_weights, strict=True):
                with self.precision.autocast():
                    loss = extract_loss(self.model(x, y)).float()
                if w:  # 0: all padding (a NaN mean), or an FSDP2 filler
                    total += loss * w
        self.model.train(was_training)
        if self.dp is not None:
            self.dp.all_reduce_sum(total)
        value = (float(total.item()) / self._eval_total_weight if self._eval_total_weight
                 else float("nan"))
        self.last_eval_loss = value
        self.metrics.emit("eval", {"step": self.step, "eval_loss": value})
        self.metrics.line(f"eval step {self.step} | eval_loss {value:.4f}")
        return value

    def jump_to_step(self, step: int, tokens: int | None = None,
                     samples: int | None = None) -> None:
        """Continue from ``step`` (and the peer's ``tokens`` / ``samples`` counters): another
        replica's state was just loaded (torchft healing). The open log interval keeps counting
        this process's own steps and tokens only."""
        delta = step - self.step
        self.step = step
        self._interval_first_step += delta
        self._step_jump += delta
        jumps = (0 if tokens is None else tokens - self.tokens,
                 0 if samples is None else samples - self.samples)
        self.tokens += jumps[0]
        self.samples += jumps[1]
        self._counter_jump = (self._counter_jump[0] + jumps[0], self._counter_jump[1] + jumps[1])

    def _drop_uncommitted_step(self) -> None:
        """A torchft step the quorum did not commit: no update, no schedule move, not counted,
        not logged (the next batches retry it)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._grad_factor = 1.0
        self._loss_sum.copy_(self._loss_before_step)
        self._micro_since_log = self._micro_before_step

    def _agree_on_stops(self, signum: int | None, time_due: bool) -> tuple[int | None, bool]:
        """Under torchrun, the step boundary's rank-local triggers made common: a signal any
        rank received, a time-based save any rank's clock calls for. Every rank must save (a
        collective) and stop at the same step, or the others wait in a collective until the
        timeout. One host all-reduce of two ints on the gloo control group (0.27 ms median on
        loopback, 2 ranks), only when a signal or checkpoint.every_seconds is configured."""
        if self.dp is None or not (self.config.train.preemption_signals
                                   or self.config.checkpoint.every_seconds is not None):
            return signum, time_due
        agreed_signal, agreed_time = self.dp.agree_max([signum or 0, int(time_due)])
        return (agreed_signal or None), bool(agreed_time)

    def _stop_for_preemption(self, signum: int) -> None:
        """The step boundary after a preemption signal: the checkpoint is written (the loop's
        save ran this step), the job is requeued if asked, and :class:`RunPreempted` ends
        ``fit``."""
        import signal as _signal

        name = _signal.Signals(signum).name
        if self.checkpoints is None and not self.saves_on_rank0:
            where = "checkpointing is off: nothing saved"
        else:
            where = f"checkpoint of step {self.step} saved; --resume continues from it"
        # one requeue per job: rank 0 asks SLURM
        requeued = self.config.train.requeue and (self.dp is None or self.dp.is_main) \
            and requeue_slurm_job()
        self.metrics.emit("preempted", {"step": self.step, "signal": name,
                                        "requeued": requeued})
        raise RunPreempted(signum, f"stopped by {name} at step {self.step} ({where})"
                           + ("; the SLURM job is requeued" if requeued else ""),
                           requeued=requeued)

