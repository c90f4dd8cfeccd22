"""DDP wiring for ``torchrun speedtronic train``: what is refused, how the model is wrapped,
how one step's tokens are weighted across ranks, and what each rank adds to a checkpoint.

**The batch in the config is the global batch.** ``data.target_batch_size`` samples per step
over all ranks; each rank runs ``target / (micro_batch_size * world)`` micro-batches, and the
data is sharded by sample (rank ``r`` takes every ``world``-th window of the same seeded
permutation; :mod:`speedtronic.data.sampler`), so the union of the ranks' micro-batches of one
step is the batch one process would take, and a config trains the same function at any world
size (fp32 rounding aside; ``tests/distributed`` checks 2 ranks against 1 process).

**Token weighting is global.** A step's loss is the mean over every counted label token of
every rank: micro-batch ``i`` of ``n_i`` tokens is backpropagated with the scale
``n_i * world / N`` (``N``: the step's tokens over all ranks), and DDP's average over ranks
divides the ``world`` back out. ``N`` is one all-reduce per step of a device scalar, queued
like a kernel: no host sync, and no factor is applied after the gradient all-reduce (a factor
there made ranks diverge by 1.2e-5 in 4 steps). Every rank runs every micro-batch, so DDP's
collectives line up: an all-padding one runs with scale 0 on labels that count one token (its
mean loss over no token would be NaN, and 0 * NaN is NaN).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, SpeedtronicConfig
from .process_group import DataParallel

__all__ = ["check_supported", "local_accumulation_steps", "wrap_model", "sync_context",
           "StepScales", "step_scales", "one_token_labels", "rank_state", "pick_rank_state"]


def check_supported(cfg: SpeedtronicConfig, dp: DataParallel) -> None:
    """Refuse (before anything is built) what does not run correctly under DDP, with why."""
    if cfg.ooo_backprop:
        raise ConfigError(
            "ooo_backprop: true cannot run under torchrun (DDP): DDP's reducer takes a weight "
            "gradient when its AccumulateGrad hook fires and writes the averaged .grad back in "
            "its final callback, so weight gradients the out-of-order scheduler defers to side "
            "streams would be reduced as zeros (14 of 20 were, measured with gloo). Set "
            "ooo_backprop: false for data-parallel runs")
    from .fsdp import check_fsdp

    check_fsdp(cfg)
    if cfg.distributed.enabled:  # hierarchical DiLoCo: this torchrun group is one worker
        from .hierarchical import check_hierarchical

        check_hierarchical(cfg)
    from .zero import check_zero1

    check_zero1(cfg)
    from .muon_owners import check_reduce_scatter_muon

    check_reduce_scatter_muon(cfg)
    if cfg.optimizer.cuda_graph != "off" and cfg.data_parallel.shard_muon:
        raise ConfigError(
            f"optimizer.cuda_graph: {cfg.optimizer.cuda_graph} with data_parallel.shard_muon: "
            "true: a captured all-gather is not tested; set optimizer.cuda_graph: off or "
            "data_parallel.shard_muon: false")
    local_accumulation_steps(cfg, dp.world_size)  # raises when the global batch does not divide


def local_accumulation_steps(cfg: SpeedtronicConfig, world: int) -> int:
    """Micro-batches per rank per step: ``target_batch_size / (micro_batch_size * world)``."""
    d = cfg.data
    target = d.target_batch_size or d.micro_batch_size
    per_step = d.micro_batch_size * world
    if target % per_step:
        options = sorted({per_step * max(1, target // per_step),
                          per_step * (target // per_step + 1)})
        keep = ""
        if target % world == 0:  # a smaller micro-batch keeps this global batch
            per_rank = target // world
            micro = max(m for m in range(1, min(d.micro_batch_size, per_rank) + 1)
                        if per_rank % m == 0)
            keep = f", or data.micro_batch_size: {micro} (keeps the global batch of {target})"
        raise ConfigError(
            f"data.target_batch_size: {target} is the global batch (samples per step over all "
            f"ranks); with {world} ranks of data.micro_batch_size {d.micro_batch_size} it must "
            f"be a multiple of {per_step}: set data.target_batch_size: "
            f"{' or '.join(map(str, options))}{keep}")
    return target // per_step


def wrap_model(model: nn.Module, dp: DataParallel, cfg: SpeedtronicConfig,
               ignore: Sequence[str] = ()) -> nn.Module:
    """``DistributedDataParallel`` around ``model`` (already on ``dp.device``).

    ``static_graph`` stays off: the trainer accumulates under ``no_sync``, which static graphs
    do not support. Buffers are not broadcast each forward (the reference model's are constant
    and every rank builds them alike), which saves one collective per micro-batch. ``ignore``:
    parameter names DDP leaves alone (the owned Muon matrices of ``reduce_scatter_muon``,
    whose gradients travel in the optimizer's reduce-scatter)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if ignore:  # torch's (underscored, long-standing) switch for this; read at construction
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))

    ids = [dp.local_rank] if dp.device.type == "cuda" else None
    # torch 2.13 renamed the per-forward buffer broadcast (and warns on the old name); 2.11,
    # the H200's, only has the old one. Buffers are still broadcast once, at construction.
    params = inspect.signature(DDP.__init__).parameters
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                      else {"broadcast_buffers": False})
    return DDP(model, device_ids=ids, **no_buffer_sync,
               find_unused_parameters=cfg.data_parallel.find_unused_parameters,
               bucket_cap_mb=cfg.data_parallel.bucket_cap_mb, gradient_as_bucket_view=True)


def sync_context(ddp: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``ddp.no_sync()`` for every micro-batch but a step's last (one all-reduce per step)."""
    return contextlib.nullcontext() if sync else ddp.no_sync()  # type: ignore[operator]


class StepScales:
    """One step's backprop scales (see the module docstring) and the host facts about it."""

    def __init__(self, scales: Sequence[torch.Tensor | float], local_tokens: int | None,
                 total: torch.Tensor | None) -> None:
        self.scales = list(scales)
        """Per micro-batch: what its mean loss is multiplied by before backward."""
        self.local_tokens = local_tokens
        """This rank's counted tokens (None: labels not countable on the host)."""
        self.total = total
        """The step's counted tokens over all ranks (a device scalar; None: not counted)."""

    def has_gradient(self) -> bool:
        """False only when no rank counted a token: the step then leaves the weights alone.

        Every rank agrees without a sync in the usual case: a rank with tokens knows the total
        is positive; only a rank without any reads the total (then every such rank does)."""
        if self.local_tokens is None or self.local_tokens > 0:
            return True
        assert self.total is not None
        return bool(self.total.item() > 0)  # rare: a whole local step of padding


def step_scales(counts: Sequence[int | None], dp: DataParallel) -> StepScales:
    """The scales of one step's local micro-batches with counted tokens ``counts``."""
    k = len(counts)
    if any(n is None for n in counts):  # labels on the device or not ids: plain averaging
        return StepScales([1.0 / k] * k, None, None)
    local = int(sum(counts))  # type: ignore[arg-type]
    # a fill kernel, not a host-to-device copy; fp32 counts exactly up to 2**24 tokens a step
    total = torch.full((), float(local), dtype=torch.float32, device=dp.device)
    dp.all_reduce_sum(total)  # queued on the stream like a kernel; read only if local == 0
    inv = dp.world_size / total.clamp_min(1.0)
    return StepScales([inv * float(n) for n in counts], local, total)  # type: ignore[arg-type]


def one_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` of an all-padding micro-batch with one token counted (its loss is scaled by
    0, so the token only keeps the loss finite; its gradient is exactly 0)."""
    out = labels.clone()
    out.view(-1)[0] = 0
    return out


def rank_state(data: Any, rng: dict[str, Any]) -> dict[str, Any]:
    """What one rank contributes to a checkpoint: its data position and RNG streams."""
    return {"data": data.state_dict() if hasattr(data, "state_dict") else None, "rng": rng}


def pick_rank_state(state: dict[str, Any], dp: DataParallel, path: str) -> dict[str, Any]:
    """This rank's entry of a data-parallel checkpoint; a different world size is refused."""
    saved = state.get("world_size", 1)
    ranks = state.get("ranks")
    if saved != dp.world_size or not isinstance(ranks, list) or len(ranks) != dp.world_size:
        raise ConfigError(
            f"cannot resume from {path}: it was written by a run of {saved} rank(s) and this "
            f"one has {dp.world_size}. Each rank's data position and RNG streams are part of "
            "the checkpoint, and re-sharding them is not built: resume with "
            f"--nproc-per-node {saved} (x nodes), or start a new run.name from its weights "
            "(model.init_from)")
    return ranks[dp.rank]
