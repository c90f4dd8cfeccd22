"""Config -> a running trainer: seeds, device, precision, model, data, optimizer, schedule,
checkpoints, metrics, callbacks. The one place where the parts are wired together.

Data flows one way: the CLI reads a config, this module builds the parts, the
:class:`~speedtronic.train.trainer.Trainer` runs them. Nothing in the package imports this module
except the CLI and ``compare``.

The parts themselves (device, model, data, optimizer, the data-parallel group) are built by
:mod:`speedtronic.train.run_parts`, before anything here touches the run directory; this module
owns the run directory around them (the lock, ``logging.file``, moving an old run aside,
``config.yaml``, ``metrics.jsonl`` and its hooks) and the run's end (workers, lock, loss plot).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import SpeedtronicConfig, load_config
from ..config.combinations import check_fsdp
from ..distributed import launched_rank
from ..errors import RunPreempted, SpeedtronicError
from .checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from .metrics import (
    Hook,
    MetricsLogger,
    PeerMetrics,
    TensorBoardHook,
    WandbHook,
    require_hook_packages,
)
from .preflight import check_run_dir
from .run_lock import RunLock
from .run_log import check_log_file, open_log_file, remove_log_handlers
from .run_parts import build_optimizer, build_parts
from .schedule import build_scheduler, lr_factor, seed_everything
from .trainer import Trainer, TrainerCallback, TrainResult
from .v2_checkpoints import find_v2_checkpoints

logger = logging.getLogger("speedtronic.runtime")

__all__ = ["build_trainer", "train_from_config", "build_scheduler", "build_optimizer",
           "lr_factor", "seed_everything"]


def _prepare_run_dir(run_dir: Path, resume: bool, asked_to_resume: bool = False) -> None:
    """A fresh run never mixes with an old one: a used run dir is moved aside, not deleted."""
    used = run_dir.is_dir() and any((run_dir / n).exists()
                                    for n in ("metrics.jsonl", "checkpoints", "config.yaml"))
    if used and not resume:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
        n = 1
        while aside.exists():
            aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
            n += 1
        os.replace(run_dir, aside)
        if find_v2_checkpoints(aside) is not None:  # --resume would not load them either
            why = "it holds speedtronic 2.0 checkpoints, which this version cannot load"
        elif asked_to_resume:
            why = "it has no checkpoint to resume from"
        else:
            why = "to continue a run instead: --resume, or resume=True from Python"
        logger.warning("run dir %s held an earlier run; moved it to %s (%s)", run_dir, aside,
                       why)
    run_dir.mkdir(parents=True, exist_ok=True)


def _metric_hooks(cfg: SpeedtronicConfig, run_dir: Path, start_step: int) -> list[Hook]:
    hooks: list[Hook] = []
    if cfg.logging.tensorboard:
        # A resumed run rewrites the steps after its checkpoint: TensorBoard drops the
        # interrupted run's events from start_step + 1 on (purge_step) instead of showing both.
        hooks.append(TensorBoardHook(run_dir / "tensorboard",
                                     purge_step=start_step + 1 if start_step else None))
    if cfg.logging.wandb:
        hooks.append(WandbHook(cfg.logging.wandb_project, cfg.run.name, cfg.to_dict(redact=True),
                               run_dir))
    return hooks


def build_trainer(config: SpeedtronicConfig | dict | str | Path, *, resume: bool = False,
                  device: str | torch.device | None = None, hooks: Iterable[Hook] = (),
                  callbacks: Sequence[TrainerCallback] = (), model: nn.Module | None = None,
                  data: Any = None) -> Trainer:
    """Build every part of a run and return a ready :class:`Trainer` (resumed if asked).

    ``model`` / ``data`` replace the registry model and the configured data (for Python users
    and tests); ``device`` overrides ``run.device``.

    Nothing in the run directory changes until every part is built and, with ``resume``, the
    checkpoint is loaded and accepted: a bad device, model, data source or checkpoint leaves an
    earlier run (its config.yaml, checkpoints and metrics) exactly as it was.
    """
    cfg = config if isinstance(config, SpeedtronicConfig) else load_config(config)
    hooks = list(hooks)  # read twice below
    resume = resume or cfg.checkpoint.resume
    run_dir = cfg.run_dir
    check_run_dir(run_dir)
    check_fsdp(cfg)  # as validate does: one config means one thing, torchrun or not
    level = getattr(logging, cfg.logging.level)
    logging.getLogger("speedtronic").setLevel(level)
    writer = launched_rank() == 0  # under torchrun only rank 0 writes the run directory
    # First: a second run (or --resume) into a live run's directory is refused before it reads
    # or moves anything there.
    lock = RunLock(run_dir, "resume" if resume else "train") if writer else None
    try:
        log_buffer = check_log_file(cfg, run_dir) if writer else None
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    own: list[logging.Handler] = [log_buffer] if log_buffer is not None else []
    try:
        trainer = build_parts(cfg, resume=resume, device=device, callbacks=callbacks,
                              model=model, data=data)
        trainer.run_lock = lock
        if not writer:  # a torchrun rank other than 0: takes part in saves, writes nothing
            trainer.saves_on_rank0 = cfg.checkpoint.enabled
            trainer.metrics = PeerMetrics(cfg.run.max_steps)
            return trainer
        require_hook_packages(tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb)
        resumed = resume and trainer.step > 0  # False: --resume found no checkpoint
        finished, last_eval = _nothing_left(trainer, run_dir) if resumed else (False, None)
        if finished:
            # Nothing trains or evaluates: the run's record (config.yaml, metrics.jsonl, the
            # final eval) stays as it was; a changed config once overwrote config.yaml with
            # values that never ran and appended an eval on other data.
            trainer.metrics = PeerMetrics(cfg.run.max_steps)
            trainer.metrics.path = run_dir / "metrics.jsonl"  # TrainResult names the record
            if last_eval is not None:
                # The hooks (compare's recorder) get the run's last eval, which the checkpoint,
                # saved just ahead of it, does not hold: compare once reported the eval before.
                for hook in hooks:
                    hook("eval", {k: v for k, v in last_eval.items() if k != "event"})
            remove_log_handlers(own)  # logging.file too: its held lines are not written
            return trainer
        # --resume without a checkpoint is a fresh run: an earlier run's files are moved aside
        # as for any fresh run (it once appended a second step-0 run to their metrics)
        _prepare_run_dir(run_dir, resumed, asked_to_resume=resume)
        if log_buffer is not None:
            own.append(open_log_file(log_buffer))
        if cfg.checkpoint.enabled:
            trainer.checkpoints = CheckpointManager(run_dir / cfg.checkpoint.directory,
                                                    keep_last=cfg.checkpoint.keep_last,
                                                    owner=True)
            trainer.checkpoints.probe_writable()
        _probe_metrics_file(run_dir / "metrics.jsonl")
        # Last: a resume that cannot write its checkpoints or metrics once rewrote config.yaml
        # with values that never ran.
        cfg.save(run_dir / "config.yaml")
        # The hooks (TensorBoard, wandb) are built after a resume restored the RNG streams:
        # keep whatever they draw out of the run's streams, or resume would not be bitwise.
        rng = capture_rng_state()
        trainer.metrics = MetricsLogger(run_dir / "metrics.jsonl", max_steps=cfg.run.max_steps,
                                        hooks=[*_metric_hooks(cfg, run_dir, trainer.step),
                                               *hooks],
                                        progress_bar=cfg.logging.progress_bar,
                                        start_step=trainer.step)
        restore_rng_state(rng)
    except BaseException:
        remove_log_handlers(own)  # a failed build leaves none of its handlers behind
        if lock is not None:
            lock.release()
        raise
    trainer.log_handlers = own[1:]  # the run's file handler: train_from_config removes it
    return trainer


def _probe_metrics_file(path: Path) -> None:
    """Open ``metrics.jsonl`` for appending (creating it, writing nothing) so a file that cannot
    be written stops the run before anything in its directory changes."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise SpeedtronicError(f"cannot write the run's metrics file {str(path)!r} "
                               f"({exc.strerror or exc}); it must be a writable file: fix its "
                               "permissions, move it away, or set run.output_dir / run.name "
                               "to another place") from None


def _nothing_left(trainer: Trainer, run_dir: Path) -> tuple[bool, dict[str, Any] | None]:
    """Whether a resumed single-process run is already at ``run.max_steps`` with its last eval
    done, and that eval's ``metrics.jsonl`` row when the checkpoint lacks it.

    A checkpoint written at the last step is saved ahead of that step's eval and so records it
    as pending; ``metrics.jsonl`` says whether it ran. Only where this process alone decides
    (no torchrun ranks, torchft groups or DiLoCo: their ranks must agree on evaluating)."""
    cfg = trainer.config
    if trainer.step < cfg.run.max_steps or trainer.dp is not None or \
            cfg.torchft.mode != "off" or cfg.distributed.enabled:
        return False, None
    if not trainer.eval_pending:
        return True, None
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            for line in f:
                if '"eval"' not in line:  # most rows: no parse
                    continue
                try:
                    row = json.loads(line)
                except ValueError:  # a torn last line
                    continue
                if row.get("event") == "eval" and row.get("step") == trainer.step:
                    trainer.eval_pending = False  # it ran after that save
                    trainer.last_eval_loss = row.get("eval_loss", trainer.last_eval_loss)
                    return True, row
    except OSError:
        pass
    return False, None


def train_from_config(config: SpeedtronicConfig | dict | str | Path, *, resume: bool = False,
                      device: str | torch.device | None = None, hooks: Iterable[Hook] = (),
                      callbacks: Sequence[TrainerCallback] = (), model: nn.Module | None = None,
                      data: Any = None, plot: bool = True) -> TrainResult:
    """Build the run from ``config`` and train to ``run.max_steps``.

    Leaves ``metrics.jsonl``, ``config.yaml`` (redacted), checkpoints and ``loss.png`` (when
    matplotlib is installed and ``plot``) in ``run.output_dir/run.name``.
    """
    trainer = build_trainer(config, resume=resume, device=device, hooks=hooks,
                            callbacks=callbacks, model=model, data=data)
    # Not beside DataLoader workers: they are forked, and forking while another thread holds an
    # import lock can leave a child waiting on it forever.
    plots = plot and (trainer.dp is None or trainer.dp.is_main)  # rank 0 alone plots
    preload = (_preload_plotting() if plots and trainer.config.data.num_workers == 0
               else None)
    alone = True  # a failure of this rank only, unless the ranks agreed to stop
    try:
        result = trainer.fit()
        alone = False
    except RunPreempted:
        alone = False  # every rank stops at the step they agreed on (the trainer's stop vote)
        raise
    finally:
        if preload is not None:
            # A daemon thread still inside matplotlib's C++ import when the interpreter exits
            # is unwound through noexcept frames: "terminate called without an active
            # exception", SIGABRT (seen at the end of short torchrun test jobs, where every
            # rank preloaded and the non-plotting ones exited first). Wait for it instead.
            preload.join(timeout=60)
        try:
            close_data = getattr(getattr(trainer.data, "train", None), "close", None)
            if close_data is not None:  # DataLoader workers, before interpreter exit
                try:
                    close_data()
                except Exception as exc:  # noqa: BLE001 - never in the way of the run's end
                    logger.warning("data: stopping the DataLoader workers failed: %s", exc)
            trainer.metrics.close()
            remove_log_handlers(trainer.log_handlers)
        finally:  # whatever failed above, the run directory is free again
            trainer.release_run_lock()
            if trainer.dp is not None:
                trainer.dp.close(together=not alone)
    if plots:
        _write_plot(result.run_dir)
    return result


def _preload_plotting() -> threading.Thread | None:
    """Import matplotlib on a background thread while the model trains (the ops of a training
    step release the GIL): the end-of-run plot then skips 0.3-0.5 s of imports. A failure here
    is ignored; the plot reports it itself."""
    from . import plot

    def run() -> None:
        try:
            plot.preload()
        except Exception:  # noqa: BLE001 - the plot at the end reports a broken matplotlib
            pass

    if not plot.matplotlib_available():
        return None
    thread = threading.Thread(target=run, name="speedtronic-plot-preload", daemon=True)
    thread.start()
    return thread


def _write_plot(run_dir: Path) -> None:
    from . import plot

    if not plot.matplotlib_available():
        logger.info("loss plot: skipped (matplotlib not installed; pip install "
                    "'speedtronic[plot]')")
        return
    try:
        out = plot.plot_runs([run_dir], run_dir / "loss.png")
    except (SpeedtronicError, OSError) as exc:  # e.g. every loss was non-finite, a full
        # disk: the run itself is done, and its exit code says so
        logger.warning("loss plot: not written (%s)", exc)
        return
    logger.info("loss plot: %s", out)

