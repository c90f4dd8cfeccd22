"""The parts of a run, built from its config: threads, seed, device, precision, the data-parallel
group (torchrun, FSDP, torchft, DiLoCo callbacks), model, data, optimizer, schedule and the
:class:`~speedtronic.train.trainer.Trainer` itself, resumed if asked.

Everything here can fail on bad input, and all of it runs before the run directory is touched:
:mod:`speedtronic.train.runtime` (the only caller) takes the lock, moves an old run aside and
opens the run's files only once :func:`build_parts` returned. The capability lines a run starts
with (data parallel, malloc, device / precision / threads, CPU kernels) are logged from here,
under the ``speedtronic.runtime`` logger as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import optim
from ..config import ConfigError, SpeedtronicConfig
from ..data import DataBundle, build_data, check_data
from ..distributed import DataParallel, init_data_parallel
from ..kernels import cpu as cpu_kernels
from ..models import build_model
from ..models.hf import adapt_model, check_forward
from . import host_memory
from .precision import resolve_device, resolve_precision
from .preflight import check_model_size
from .resume import resume_trainer
from .run_model import init_from
from .schedule import build_scheduler, seed_everything
from .trainer import Trainer, TrainerCallback

logger = logging.getLogger("speedtronic.runtime")

__all__ = ["build_optimizer", "build_parts"]


def build_optimizer(model: nn.Module, cfg: SpeedtronicConfig,
                    dp: DataParallel | None = None) -> torch.optim.Optimizer:
    """One optimizer over every trainable parameter (``speedtronic.optim.build_optimizer``);
    under torchrun with ``data_parallel.shard_muon`` each rank orthogonalizes its share, with
    ``data_parallel.zero1`` each rank keeps the state of and steps its share (ZeRO-1), with
    ``data_parallel.reduce_scatter_muon`` each Muon matrix has one owning rank."""
    if dp is not None and cfg.data_parallel.zero1:  # each rank steps its share of everything
        from ..distributed.zero import zero1_optimizer

        return zero1_optimizer(optim.build_optimizer(model, cfg.optimizer))
    if dp is not None and cfg.data_parallel.reduce_scatter_muon:  # one owner per matrix
        from ..distributed.muon_owners import owner_sharded_optimizer

        return owner_sharded_optimizer(optim.build_optimizer(model, cfg.optimizer),
                                       bucket_cap_mb=cfg.data_parallel.bucket_cap_mb)
    group = None
    # under FSDP2 the DTensor Muon step splits the Newton-Schulz itself (shard_muon does not
    # apply) and refuses a process_group
    if (dp is not None and cfg.data_parallel.shard_muon and cfg.optimizer.name == "muon"
            and not cfg.data_parallel.fsdp):
        import torch.distributed as dist

        group = dist.group.WORLD
    return optim.build_optimizer(model, cfg.optimizer, process_group=group)


def _build_data(cfg: SpeedtronicConfig, device: torch.device,
                dp: DataParallel | None = None) -> DataBundle:
    d = cfg.distributed
    # DiLoCo nodes each read their own shard of the training samples (eval is shared); so do
    # torchrun ranks: rank r takes every world-th sample, so one step's micro-batches over all
    # ranks are the samples one process would take (speedtronic.distributed.ddp).
    rank, world = (d.shard, d.num_shards) if d.enabled else (0, 1)
    if cfg.torchft.mode != "off":  # each torchft replica group reads its own shard
        rank, world = cfg.torchft.replica_group or 0, cfg.torchft.replica_groups
    if dp is not None:  # a DiLoCo worker group splits its shard again, rank by rank: rank r
        # takes every (n W)-th sample from shard + n r, so the group's ranks together read
        # exactly shard `shard` of n (what one process would), each every W-th sample of it
        rank, world = rank + world * dp.rank, world * dp.world_size
    return build_data(cfg, rank=rank, world=world, device=device)


def _as_data_bundle(cfg: SpeedtronicConfig, data: Any) -> None:
    """``data=`` that is not a DataBundle: a torch Dataset / IterableDataset, a (train, eval)
    pair or a ``{"train": ..., "eval": ...}`` dict goes through ``data.dataset`` (built like
    one named in the config; returns None so the config path builds it). Anything else is
    refused before the run directory changes: a Dataset once failed in ``fit``, after an
    earlier run had been moved aside."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    if isinstance(data, (Dataset, IterableDataset, tuple, dict)):
        d = cfg.data  # it replaces whatever source the config names, as data= always did
        d.dataset, d.text_path, d.tokens_path, d.eval_tokens_path = data, None, None, None
        d.hf_dataset, d.tokenizer, d.synthetic = None, None, False
        return None
    hint = " (pass its .dataset: the engine batches it itself)" \
        if isinstance(data, DataLoader) else ""
    raise ConfigError(f"data=: expected a DataBundle (with .train and .eval_batches), a torch "
                      f"Dataset or IterableDataset, a (train, eval) pair or a dict with "
                      f"'train' and 'eval', got {type(data).__name__}{hint}")


def build_parts(cfg: SpeedtronicConfig, *, resume: bool, device: str | torch.device | None,
                callbacks: Sequence[TrainerCallback], model: nn.Module | None,
                data: Any) -> Trainer:
    """Device, model, data, optimizer, schedule, callbacks and trainer (resumed if asked):
    everything that can fail on bad input, before the run directory is touched."""
    run_dir = cfg.run_dir
    if data is not None and not hasattr(data, "train"):
        data = _as_data_bundle(cfg, data)
    if cfg.run.num_threads is not None:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.run.seed)
    dev = resolve_device(device if device is not None else cfg.run.device)
    if cfg.torchft.mode != "off":  # before torchrun's group: a torchft group is one process
        from ..distributed import torchft_groups

        torchft_groups.check_supported(cfg)
    dp = init_data_parallel(dev, cfg.data_parallel.timeout_s)
    if dp is not None:
        from ..distributed import ddp

        dev = dp.device
        ddp.check_supported(cfg, dp)
        if not dp.is_main:  # one copy of the build's decision lines: rank 0's
            quiet = max(getattr(logging, cfg.logging.level), logging.WARNING)
            logging.getLogger("speedtronic").setLevel(quiet)
        logger.info("data parallel: global batch %d = %d ranks x %d micro-batch(es) of %d "
                    "samples", cfg.data.target_batch_size, dp.world_size,
                    ddp.local_accumulation_steps(cfg, dp.world_size), cfg.data.micro_batch_size)
    malloc_line = host_memory.apply_for_device(dev.type)  # None unless the CLI asked
    if malloc_line is not None:
        logger.info(malloc_line)
    plan = resolve_precision(cfg.precision.mode, dev)
    fsdp = dp is not None and cfg.data_parallel.fsdp
    if fsdp and plan.use_scaler:  # precision.mode: auto picked fp16 on this GPU
        raise ConfigError(f"data_parallel.fsdp: true with precision {plan.mode} "
                          f"({plan.reason}): GradScaler's unscale is not built for DTensor "
                          "gradients; set precision.mode: bf16 or fp32")
    logger.info("device: %s | precision: %s (%s) | threads: %d", dev, plan.mode, plan.reason,
                torch.get_num_threads())
    if dev.type == "cpu":
        logger.info(cpu_kernels.status().line())
    if data is None:
        # Bad data fails here, before the model is built: missing or corrupt token files, ids
        # beyond model.vocab_size, a tokenizer that does not load (and a text source is
        # tokenized now, on first use); model.vocab_size follows the tokenizer when unset.
        check_data(cfg)
    if model is None:
        check_model_size(cfg, dev.type)  # closed form: a 10^12-parameter typo fails here
        model = build_model(cfg.model)
        check_forward(model, cfg.model.name)
        if cfg.model.init_from and not resume:
            logger.info(init_from(model, cfg))
        elif cfg.model.init_from:
            logger.info("init_from: skipped (--resume loads the checkpoint's weights)")
    else:
        # a Hugging Face model passed in is wrapped as a factory's is: called positionally it
        # took the labels as its attention_mask and returned no loss
        model = adapt_model(model)
    model = model.to(dev)
    if fsdp:  # before the optimizer: it must hold the sharded (DTensor) parameters
        from ..distributed.fsdp import wrap_model_fsdp

        assert dp is not None
        model = wrap_model_fsdp(model, dp, cfg)
    if data is None:
        data = _build_data(cfg, dev, dp)
    optimizer = build_optimizer(model, cfg, dp)
    scheduler = build_scheduler(optimizer, cfg)
    callbacks = list(callbacks)
    if cfg.distributed.enabled:
        # Imported only for DiLoCo runs: single-node runs never load the store back ends.
        from ..diloco import build_callbacks

        # Under torchrun the group is one worker: rank 0 talks to the store, a relay on every
        # rank keeps the others on its weights (speedtronic.distributed.hierarchical).
        diloco = build_callbacks(cfg) if dp is None or dp.is_main else []
        callbacks.extend(diloco)
        if dp is not None:
            from ..distributed.hierarchical import GroupRelay

            worker = next((cb for cb in diloco if hasattr(cb, "m")), None)
            callbacks.append(GroupRelay(dp, worker))
    ckpt_dir = run_dir / cfg.checkpoint.directory
    # The trainer is built before the run directory is touched; its default metrics logger
    # opens no file until a first record, and build_trainer attaches the real one (with hooks).
    trainer = Trainer(model, optimizer, data, cfg, device=dev, precision=plan,
                      scheduler=scheduler, checkpoints=None, callbacks=callbacks, run_dir=run_dir,
                      data_parallel=dp)
    if cfg.torchft.mode != "off":  # before the resume: the checkpoint holds its state
        from ..distributed.torchft_groups import ReplicaGroups

        groups = ReplicaGroups(cfg, trainer)
        trainer.callbacks.append(groups)
        if groups.mode == "ddp":
            trainer.replicas = groups
    if resume:
        resume_trainer(trainer, ckpt_dir)
    return trainer
