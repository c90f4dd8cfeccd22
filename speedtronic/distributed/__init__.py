"""Data parallelism on torch.distributed: ``torchrun ... speedtronic train`` (layer 3).

:mod:`.process_group` joins the job torchrun started (NCCL on CUDA, gloo on CPU) and holds the
collectives the trainer needs; :mod:`.ddp` refuses what cannot run under DDP, wraps the model,
weights a step's tokens across ranks and carries each rank's data position and RNG into a
checkpoint. The trainer asks these modules; they never reach into the trainer. The sharded
Muon step itself lives with the optimizer (:mod:`speedtronic.optim.sharded`).
"""

from __future__ import annotations

from .process_group import DataParallel, init_data_parallel, launched_rank, torchrun_world_size

__all__ = ["DataParallel", "init_data_parallel", "launched_rank", "torchrun_world_size"]
