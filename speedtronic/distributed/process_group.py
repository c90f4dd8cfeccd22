"""The process group of a ``torchrun`` job, and the few collectives the trainer needs.

``torchrun`` (``torch.distributed.run``) starts one process per device and tells each, in its
environment, who it is: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address
(``MASTER_ADDR``/``MASTER_PORT``). :func:`init_data_parallel` reads that, joins the default
process group (NCCL on CUDA, gloo on CPU) and returns a :class:`DataParallel` handle; without
torchrun (or with one process) it returns None and nothing distributed is loaded.

Two groups:

* the default group (NCCL on CUDA) carries gradients, token counts and losses, on the device,
  queued on the stream like any kernel: no host sync;
* a gloo *control* group carries the few host-side agreements a step can need (is a time-based
  checkpoint due, did any rank receive SIGTERM, each rank's data position for a checkpoint).
  Rank-local decisions must never pick different code paths on different ranks (rank 0 saving
  at step s while rank 1 steps on hangs both until the timeout). One such agreement (an
  all-reduce of two ints) took a median 0.27 ms on loopback (2 gloo ranks on the 2-vCPU CI
  machine, p90 0.7 ms), and it never waits for the GPU, where reading an NCCL result back
  would wait for the whole queued step.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import SpeedtronicError

logger = logging.getLogger("speedtronic.distributed")

__all__ = ["DataParallel", "exit_after_distributed", "init_data_parallel", "launched_rank",
           "torchrun_world_size"]


def exit_after_distributed(code: int) -> NoReturn:
    """End a process that took part in a process group, skipping the interpreter's finalization.

    After ``destroy_process_group`` a gloo rank can still abort at exit: "terminate called
    without an active exception", SIGABRT, so torchrun (or ``mp.spawn``) reports a finished
    job as failed. It happened to 2 of ~1300 tests in one CI run (2026-12-06: an ``mp.spawn``
    rank and an accelerate job, both after their last collective). Torch's own discussion of it
    (pytorch/pytorch#179291): gloo's worker threads can still hold work objects whose tensors
    are freed during finalization, when the GIL they need is gone. Everything this process
    writes is closed by then (metrics, checkpoints, log handlers); stdio and logging are
    flushed here, then ``os._exit``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to flush into
            pass
    logging.shutdown()
    os._exit(code)


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when this process was not started by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SpeedtronicError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not an "
                               "integer; start the job with torchrun") from None


def launched_rank() -> int:
    """``RANK`` as torchrun sets it, before the process group exists (0 outside torchrun)."""
    if torchrun_world_size() <= 1:
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        raise SpeedtronicError(f"RANK={os.environ.get('RANK')!r} is not an integer; start "
                               "the job with torchrun") from None


@dataclass
class DataParallel:
    """This process's place in a data-parallel job (built by :func:`init_data_parallel`).

    Every rank holds a full replica; DDP averages gradients across ``world_size`` ranks."""

    rank: int
    """Global rank, 0..world_size-1; rank 0 alone writes the run directory."""
    world_size: int
    """Number of processes (GPUs) in the job."""
    local_rank: int
    """Rank within this machine; the CUDA device index."""
    device: torch.device
    """This rank's device (``cuda:<local_rank>``, or ``cpu``)."""
    backend: str
    """``nccl`` or ``gloo``."""
    control: Any = field(default=None, repr=False)
    """The gloo group for host-side agreements (the default group itself under gloo)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    # -- device collectives (default group, queued on the stream) --------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (no host read)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    # -- host agreements (control group) ---------------------------------------------------
    def agree_max(self, values: list[int]) -> list[int]:
        """Element-wise max of small host integers over ranks (a flag any rank raised)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return [int(v) for v in t.tolist()]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (picklable host values)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        """Wait for every rank (on the control group: no device work involved)."""
        dist.barrier(group=self.control)

    def close(self, together: bool = True) -> None:
        """Leave the process group (idempotent), all ranks together: a rank that tore its
        gloo connections down while rank 0 was still writing the last checkpoint was once
        aborted at exit ("terminate called without an active exception", CI).

        ``together=False`` (this rank failed on its own): leave at once. The others are inside
        a step's collectives, not at this barrier; waiting there held the failed rank, and the
        healthy one in its all-reduce, for ``data_parallel.timeout_s`` (600 s by default)
        before torchrun could stop the job. Leaving closes the connections, so the others'
        collectives fail now."""
        if dist.is_initialized():
            try:
                if together:
                    self.barrier()
            finally:
                dist.destroy_process_group()


def init_data_parallel(device: torch.device, timeout_s: float) -> DataParallel | None:
    """Join the torchrun job this process belongs to; None outside torchrun or with one rank.

    ``device`` is the run's resolved device: CUDA ranks move to ``cuda:<LOCAL_RANK>`` and use
    NCCL, CPU ranks use gloo. ``timeout_s`` bounds every collective, so a rank that dies or
    hangs ends the job with an error instead of a silent wait."""
    world = torchrun_world_size()
    if world <= 1:
        return None
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise SpeedtronicError(f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: "
                               "start data-parallel runs with torchrun, e.g. torchrun "
                               "--nproc-per-node 2 -m speedtronic train --config run.yaml")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SpeedtronicError(f"LOCAL_RANK {local_rank} but this machine has "
                                   f"{torch.cuda.device_count()} CUDA device(s): start at most "
                                   "one process per GPU (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise SpeedtronicError(f"data parallelism runs on CUDA (NCCL) or CPU (gloo), not on "
                               f"{device.type}; set run.device: cuda or cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    dp = DataParallel(rank=rank, world_size=world, local_rank=local_rank, device=device,
                      backend=backend, control=control)
    logger.info("data parallel: rank %d of %d (local rank %d), %s on %s, collective timeout "
                "%.0f s", rank, world, local_rank, backend, device, timeout_s)
    return dp
