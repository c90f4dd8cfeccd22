"""The training loop: steps, eval, checkpoints, preemption signals, callbacks.

The loop never reads a device value per micro-batch: losses are summed into a device tensor and
read only at log/eval steps, so a CUDA run queues work ahead of the host. What one optimizer step
does (micro-batches, clipping, the update) is in :mod:`.step`, the log row in :mod:`.step_log`,
the checkpoint content in :mod:`.trainer_state`, the optional features (compile, shape check,
out-of-order backprop, MFU) in :mod:`.trainer_features`, and the eval, agreed stops and torchft
step moves in :mod:`.step_boundary`; all five are mixed into :class:`Trainer`.
Everything the loop needs is built by :mod:`speedtronic.train.runtime`; the :class:`Trainer` can
also be constructed directly around any model whose forward is ``model(input_ids, labels) ->
loss``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..config import SpeedtronicConfig
from ..distributed import DataParallel
from ..distributed import ddp as dp_step
from ..distributed import fsdp as fsdp_step
from ..errors import SpeedtronicError
from ..models.loss import extract_loss
from ..ooo.trial import OOOTrial
from .accumulation import IGNORE_INDEX
from .checkpoint import CheckpointManager
from .metrics import Heartbeat, MetricsLogger, format_step_line
from .mfu import MfuMeter
from .precision import PrecisionPlan, synchronize
from .preemption import PreemptionGuard
from .step import OptimizerStep
from .step_boundary import StepBoundary
from .step_log import LogInterval, StepLog
from .trainer_features import TrainerFeatures
from .trainer_state import DEFAULT_CALLBACK_NAME, TrainerState

logger = logging.getLogger("speedtronic.trainer")

__all__ = ["IGNORE_INDEX", "Trainer", "TrainerCallback", "TrainResult", "loss_from_output",
           "trainable_parameters"]


@runtime_checkable
class TrainerCallback(Protocol):
    """Plug-in attached to a :class:`Trainer` (DiLoCo's worker/master use this).

    Subclass it to inherit the no-op defaults; any object with some of these methods also works.
    ``state_dict()`` is saved in checkpoints under ``name`` and handed back on resume.
    """

    name: str = DEFAULT_CALLBACK_NAME
    """The key of this callback's state in checkpoints (the default: the class name)."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Called once before the first step of ``fit`` (after a resume is applied)."""

    def after_optimizer_step(self, trainer: Trainer, step: int) -> None:
        """Called after every optimizer + scheduler step; ``step`` is the new step count."""

    def on_train_end(self, trainer: Trainer) -> None:
        """Called once when ``fit`` ends (also after an exception)."""

    def state_dict(self) -> dict:
        """State to checkpoint (tensors and plain Python values only)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


@dataclass
class TrainResult:
    """Outcome of a run (counters are cumulative over resumes)."""

    steps: int
    tokens: int
    final_loss: float | None
    final_eval_loss: float | None
    run_dir: Path
    metrics_path: Path


#: The trainer's name for :func:`speedtronic.models.extract_loss` (the same function).
loss_from_output = extract_loss


class Trainer(OptimizerStep, StepLog, TrainerState, TrainerFeatures, StepBoundary):
    """Runs optimizer steps until ``config.run.max_steps`` (an absolute step target).

    Args:
        model: the module to train (already on ``device``).
        optimizer: one optimizer over every trainable parameter.
        data: an object with ``.train`` (iterator of ``(input_ids, labels)`` micro-batches with
            ``state_dict``/``load_state_dict``) and ``.eval_batches(n)``.
        config: the resolved config.
        device: where the model lives.
        precision: from :func:`speedtronic.train.precision.resolve_precision`.
        scheduler: LR scheduler stepped once per optimizer step (None = constant lr).
        checkpoints: None disables checkpointing.
        metrics: the metrics fan-out (None = metrics.jsonl in ``run_dir`` without a bar).
        callbacks: :class:`TrainerCallback` objects.
        run_dir: the run directory.
        data_parallel: this rank's place in a ``torchrun`` job (None: one process). The model
            is then wrapped in DDP, ``data`` must be this rank's shard, and the config's batch
            is the global batch (see :mod:`speedtronic.distributed.ddp`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Any,
                 config: SpeedtronicConfig, *, device: torch.device, precision: PrecisionPlan,
                 scheduler: Any = None, checkpoints: CheckpointManager | None = None,
                 metrics: MetricsLogger | None = None, callbacks: Sequence[Any] = (),
                 run_dir: str | Path | None = None,
                 data_parallel: DataParallel | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.config = config
        self.device = device
        self.precision = precision
        self.scheduler = scheduler
        self.checkpoints = checkpoints
        self.run_dir = Path(run_dir) if run_dir is not None else config.run_dir
        self.metrics = metrics or MetricsLogger(self.run_dir / "metrics.jsonl",
                                                max_steps=config.run.max_steps, progress_bar=False)
        self.callbacks = list(callbacks)
        self.step = 0
        self.tokens = 0
        self.samples = 0
        self.dp = data_parallel
        self.world_size = 1 if data_parallel is None else data_parallel.world_size
        """Processes in the job; ``tokens`` and ``samples`` count this rank's share."""
        self.accumulation_steps = (config.accumulation_steps if data_parallel is None else
                                   dp_step.local_accumulation_steps(config,
                                                                    data_parallel.world_size))
        # DDP around the model; self.model stays the plain module (its state_dict has no
        # "module." prefix, so checkpoints load in a one-process run and back). Under FSDP2
        # the runtime sharded the model itself (before building the optimizer over its
        # DTensor parameters): self.model is the FSDP module and the forward goes through it.
        self._fsdp = data_parallel is not None and config.data_parallel.fsdp
        if self._fsdp and not fsdp_step.is_sharded(model):
            raise SpeedtronicError(
                "data_parallel.fsdp: true but the model is not sharded: build the run with "
                "build_trainer, or call speedtronic.distributed.fsdp.wrap_model_fsdp on the "
                "model before building its optimizer")
        # reduce_scatter_muon: the optimizer moves the Muon gradients itself (DDP ignores them)
        self._owned_muon = hasattr(optimizer, "finish_gradients")
        ignore = (optimizer.ddp_ignored_names(model, optimizer)  # type: ignore[attr-defined]
                  if self._owned_muon else ())
        self._ddp = (dp_step.wrap_model(model, data_parallel, config, ignore=ignore)
                     if data_parallel is not None and not self._fsdp else None)
        if self._owned_muon:
            optimizer.attach(self._ddp)  # type: ignore[attr-defined]
        self.replicas: Any = None
        """torchft ``ddp`` replica groups (:class:`~speedtronic.distributed.torchft_groups.
        ReplicaGroups`; set by the runtime): a quorum started before each step, gradients
        averaged over the live groups and a commit vote before the update."""
        self.saves_on_rank0 = False
        """True on a data-parallel rank other than 0 of a checkpointing run: it takes part in
        every save (its data position and RNG go into rank 0's file) but writes nothing."""
        self.scaler = precision.grad_scaler()
        self.last_loss: float | None = None
        self.last_eval_loss: float | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._eval_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._eval_total_weight = 0.0  # label tokens of the held-out batches over all ranks
        self._eval_weights: list[float] = []  # per cached batch: its label tokens (0: none)
        self._forward = self._ddp if self._ddp is not None else model
        self._compile_pending = False
        self._compile_seconds = 0.0  # the first compiled micro-step's time (see fit)
        self.compile_seconds = 0.0
        """Seconds this process spent in torch.compile's first compiled micro-step(s), in total
        (kept out of the log interval's timing; ``speedtronic compare`` reads it too)."""
        self._ooo = None
        self._ooo_trial: OOOTrial | None = None
        self._shape_report = None
        self._mfu: MfuMeter | None = None
        self._last_saved_step = -1
        self._last_save_time = time.perf_counter()  # checkpoint.every_seconds counts from here
        # Non-finite guard (train.on_nonfinite): steps of the open log interval whose loss and
        # gradient norm were finite, counted on the device (3-4 tiny ops a step, no host read);
        # read with the loss at log steps and before every save.
        self._finite_steps = torch.zeros((), dtype=torch.int64)  # a device tensor in fit
        self._skip_nonfinite = config.train.on_nonfinite == "skip"
        self._skipped_in_row = 0
        self._loss_before_step = torch.zeros(())  # set each step in skip mode (see fit)
        self._micro_before_step = 0
        self._interval_first_step = 0  # the step the open log interval started after
        self._step_jump = 0  # steps jump_to_step added in the open step
        self._counter_jump = (0, 0)  # tokens and samples it added
        self.skipped_steps = 0
        """Steps whose update ``train.on_nonfinite: skip`` dropped (cumulative in this fit)."""
        self._eval_pending = False  # set while a checkpoint is written ahead of its step's eval
        self._resume_eval = False   # a resumed checkpoint had that eval still to run
        self._skipped_seen: dict[tuple[int, int], int] = {}  # fp16 guard hits already reported
        self._replaced: str | None = None
        self.replacements = 0
        """How many times a callback replaced the weights (hierarchical DiLoCo relays them)."""
        # The open log interval: the summed micro-batch losses (fp32 on device) and their count
        # since the last logged step. Checkpointed, so a run resumed between two log steps logs
        # the same mean loss there as an uninterrupted one.
        self._loss_sum = torch.zeros(())  # replaced by a device tensor in fit
        self._micro_since_log = 0
        self._restored_window: tuple[float, int] = (0.0, 0)
        self._lr_used: Any = 0.0  # the lr of the last log step (read before the schedule moves)
        self._grad_factor = 1.0  # token weighting of the current accumulated step (see fit)
        self.log_handlers: list[logging.Handler] = []  # the run's logging.file (runtime sets it)
        self.run_lock: Any = None
        """The run directory's lock (:class:`~speedtronic.train.run_lock.RunLock`) when built by
        ``build_trainer``; :meth:`release_run_lock` frees it (``train_from_config`` does)."""
        self.stopped_by: BaseException | None = None
        """The exception (KeyboardInterrupt included) that ended ``fit`` early; None after a
        run that reached its target. Set before ``on_train_end`` is called."""
        self._check_callback_names()
        self._configure_features()

    def log_metrics(self, values: dict[str, Any]) -> None:
        """Record extra values (e.g. from a callback) as a ``train_step``-style event."""
        self.metrics.emit("metrics", {"step": self.step, **values})

    # ----------------------------------------------------------------------------- state
    def release_run_lock(self) -> None:
        """Let another run use this run directory (idempotent)."""
        lock, self.run_lock = self.run_lock, None
        if lock is not None:
            lock.release()

    def weights_replaced(self, reason: str) -> None:
        """Tell the trainer a callback replaced the model's weights (DiLoCo installs a global).

        When that happens inside ``on_train_end`` (DiLoCo's final sync), ``fit`` evaluates the
        new weights and checkpoints them, so the run's last eval and checkpoint are of what it
        ends with."""
        self._replaced = reason
        self.replacements += 1

    # ----------------------------------------------------------------------------- loop
    def _call(self, method: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, method, None)
            if callable(fn):
                fn(self, *args)

    def fit(self) -> TrainResult:
        """Train from ``self.step`` to ``config.run.max_steps``; returns the result."""
        cfg = self.config
        target = cfg.run.max_steps
        log_every, eval_every = cfg.logging.every_steps, cfg.run.eval_every
        ckpt_every = cfg.checkpoint.every_steps
        self.stopped_by = None
        self._start_features()
        report = self._shape_report
        self.metrics.emit("train_start", {
            "step": self.step, "target_step": target, "device": str(self.device),
            "precision": self.precision.mode, "accumulation_steps": self.accumulation_steps,
            "parameters": sum(p.numel() for p in self.params),
            "shape_alignment": getattr(report, "alignment", None),
            "shape_warning_count": getattr(report, "warning_count", None),
            "compile": self.compile_on, "ooo_backprop": self._ooo is not None,
        })
        self._call("on_train_start")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        it = iter(self.data.train)
        if self.step == 0 and self.step < target and eval_every:
            self.evaluate()  # baseline: the loss of the untrained model (eval_every: 0 skips it)
        elif self._resume_eval:  # the checkpoint was written just before its step's eval
            self.evaluate()
        self._resume_eval = False
        self._loss_sum = torch.zeros((), device=self.device)  # fp32, summed on device
        self._loss_sum.fill_(self._restored_window[0])  # exact: an fp32 value read back
        self._micro_since_log = self._restored_window[1]
        self._restored_window = (0.0, 0)  # used once: a second fit() starts a fresh interval
        self._finite_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self._last_save_time = time.perf_counter()
        every_seconds = cfg.checkpoint.every_seconds
        interval = LogInterval(time.perf_counter(), self.step, self.tokens, self.samples)
        self._interval_first_step = self.step
        # Installed here, after on_train_start (a DiLoCo node may wait minutes for its first
        # global): a signal before the first step has no work to save and stops at once.
        preemption = PreemptionGuard(cfg.train.preemption_signals)
        heartbeat = Heartbeat(self.metrics, cfg.logging.heartbeat_seconds)
        try:
            preemption.__enter__()
            heartbeat.__enter__()
            while self.step < target:
                self.metrics.doing = f"step {self.step + 1}/{target}"
                trial = self._ooo_trial
                if trial is not None:
                    trial.begin_step()
                if self._skip_nonfinite or self.replicas is not None:  # restored if this
                    self._loss_before_step = self._loss_sum.clone()  # step's update is dropped
                    self._micro_before_step = self._micro_since_log
                if self.replicas is not None:
                    self.replicas.begin_step()
                has_gradient = self._accumulate_step(it)
                if self.replicas is not None:  # may heal this group: self.step can move
                    if not self.replicas.commit(self.params):
                        self._drop_uncommitted_step()
                        continue
                    has_gradient = True  # the live groups' average
                last = self.step + 1 == target
                log_now = (self.step + 1) % log_every == 0 or last
                grad_norm = self._clip_and_step(need_norm=log_now, update=has_gradient)
                if self._step_jump or self._counter_jump != (0, 0):  # healed (jump_to_step)
                    interval.steps += self._step_jump
                    interval.tokens += self._counter_jump[0]  # the peer's, not this interval's
                    interval.samples += self._counter_jump[1]
                    self._step_jump, self._counter_jump = 0, (0, 0)
                # skip mode drops bad steps itself (their loss leaves _loss_sum)
                self._count_finite_step(None if self._skip_nonfinite else grad_norm)
                if trial is not None and trial.end_step() is not None:
                    self._end_ooo_trial(trial, self.step + 1)
                self.step += 1
                self._call("after_optimizer_step", self.step)
                if log_now:
                    record = self._log_record(interval, time.perf_counter, grad_norm)
                    self.metrics.emit("train_step", record)
                    self.metrics.line(format_step_line(record, target))
                    self.metrics.advance(self.step - interval.steps,
                                         {"loss": f"{record['loss']:.3f}"})
                    self._loss_sum.zero_()
                    self._micro_since_log = 0
                    self._interval_first_step = self.step
                    interval = LogInterval(time.perf_counter(), self.step, self.tokens,
                                            self.samples)
                eval_due = bool(eval_every and self.step % eval_every == 0) or last
                signum, time_due = self._agree_on_stops(
                    preemption.requested, every_seconds is not None
                    and time.perf_counter() - self._last_save_time >= every_seconds)
                save_due = (self.checkpoints is not None or self.saves_on_rank0) and (
                    self.step % ckpt_every == 0 or last or signum is not None or time_due)
                if eval_due or save_due:
                    # Training work still queued belongs to the interval; the eval's or save's
                    # own read would wait for it inside the excluded time below.
                    synchronize(self.device)
                t_pause = time.perf_counter()
                if save_due:  # before the eval: an eval that fails must not cost the checkpoint
                    self.metrics.doing = f"saving the checkpoint of step {self.step}"
                    self._eval_pending = eval_due
                    self.save_checkpoint()
                    self._eval_pending = False
                if eval_due:
                    self.metrics.doing = f"evaluating at step {self.step}"
                    self.evaluate()
                # Evaluations and checkpoints are not training steps: keep them out of the
                # interval's ms/step, tokens/s and MFU (an eval once put 93 against 77 ms/step).
                interval.start += time.perf_counter() - t_pause
                # the first compiled forward + backward too (its step still counts: the
                # first interval's ms/step is then a little low, not 100x high)
                interval.start += self._compile_seconds
                self._compile_seconds = 0.0
                if signum is not None and not last:
                    self._stop_for_preemption(signum)
        except BaseException as exc:
            self.stopped_by = exc  # callbacks' on_train_end tell an interrupted run from a done one
            raise
        finally:
            heartbeat.__exit__(None, None, None)
            preemption.__exit__(None, None, None)
            if self._ooo_trial is not None:  # the run ended before the trial did
                self._ooo_trial.abandon()
                self._end_ooo_trial(self._ooo_trial, self.step)
            if self._ooo is not None:
                self._ooo.close()
            self._replaced = None
            self._call("on_train_end")
        if self._replaced is not None:  # e.g. DiLoCo's final sync installed the last global
            logger.info("final weights replaced by %s: evaluating and checkpointing them",
                        self._replaced)
            self.evaluate()
            self.save_checkpoint(force=True)
        return self._finish()

    def _finish(self) -> TrainResult:
        """The ``train_end`` row, the MFU summary line and the result."""
        assert self._mfu is not None  # set by _start_features at the top of fit
        world = self.world_size
        self.metrics.emit("train_end", {"step": self.step, "tokens": world * self.tokens,
                                        "loss": self.last_loss, "eval_loss": self.last_eval_loss,
                                        **self._mfu.summary()})
        line = self._mfu.summary_line()
        if line:
            self.metrics.line(line)
        return TrainResult(steps=self.step, tokens=world * self.tokens,
                           final_loss=self.last_loss,
                           final_eval_loss=self.last_eval_loss, run_dir=self.run_dir,
                           metrics_path=self.metrics.path)


def trainable_parameters(model: nn.Module) -> Iterable[nn.Parameter]:
    """Every parameter with ``requires_grad`` (what the optimizer must cover)."""
    return (p for p in model.parameters() if p.requires_grad)
