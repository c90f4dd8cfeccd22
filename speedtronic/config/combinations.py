"""Rules across config sections that only a whole config can check: what
``data_parallel.fsdp`` does not combine with. ``validate`` and ``train`` run them before anything
is built, in one process or under ``torchrun`` (one config means one thing either way)."""

from __future__ import annotations

from ..errors import ConfigError
from .schema import SpeedtronicConfig

__all__ = ["check_fsdp"]


def check_fsdp(cfg: SpeedtronicConfig) -> None:
    """Refuse what does not combine with ``data_parallel.fsdp`` (config only, no torch: ``train``
    and ``validate`` run it before anything is built, in one process or under torchrun)."""
    if not cfg.data_parallel.fsdp:
        return
    c = cfg
    rules = [  # (refused when true, the other setting, why and what to change)
        (c.data_parallel.zero1, "data_parallel.zero1: true",
         "FSDP2 already shards the optimizer state (with the parameters and gradients); set "
         "one of them to false"),
        (c.optimizer.cuda_graph != "off", f"optimizer.cuda_graph: {c.optimizer.cuda_graph}",
         "the DTensor Muon step all-gathers each matrix, which is not part of a captured "
         "graph; set optimizer.cuda_graph: off"),
        (c.ooo_backprop, "ooo_backprop: true",
         "FSDP2 reduce-scatters a unit's gradients when its backward ends, before the "
         "out-of-order scheduler has computed the deferred weight gradients; set "
         "ooo_backprop: false"),
        (c.torchft.mode != "off", f"torchft.mode: {c.torchft.mode}",
         "FSDP2 inside a torchft replica group (HSDP) is not built (a group of torchrun ranks "
         "runs DDP); set torchft.mode: off or data_parallel.fsdp: false"),
        (c.distributed.enabled, "distributed.enabled: true (hierarchical DiLoCo)",
         "the worker group's relay and outer step read and install whole parameters, not "
         "DTensor shards; set data_parallel.fsdp: false"),
        (c.compile is True, "compile: true",
         "compiling a fully_shard model is not tested in this engine; set compile: false or "
         "auto (auto stays off under FSDP2)"),
        (c.precision.mode == "fp16", "precision.mode: fp16",
         "GradScaler's unscale is not built for DTensor gradients; use precision.mode: bf16 "
         "or fp32"),
    ]
    for on, other, why in rules:
        if on:
            raise ConfigError(f"data_parallel.fsdp: true with {other}: {why}")
