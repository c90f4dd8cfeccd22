"""Our hybrid optimizer under plain torch.distributed DDP (2 CPU processes, gloo): every rank
ends with bitwise-equal parameters, equal (to fp32 rounding) to one process on the global batch.
This is the loop a user writes today; ``speedtronic train`` itself is one process (issue #30)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer

STEPS, WORLD, B = 3, 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32),
                         nn.LayerNorm(32), nn.Linear(32, 64))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (B * WORLD, 9), generator=g) for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])  # (b, T, V)
    return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def _train(model: nn.Module, rank: int | None) -> dict[str, torch.Tensor]:
    opt = build_optimizer(model.module if rank is not None else model,
                          OptimizerConfig(name="muon", lr=1e-2, muon_lr=0.02))
    for x in _batches():
        part = x if rank is None else x[rank * B:(rank + 1) * B]  # this rank's half
        _loss(model, part).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = model.module if rank is not None else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def _rank(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        torch.save(_train(ddp, rank), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    from speedtronic.distributed.process_group import exit_after_distributed

    exit_after_distributed(0)  # only after success: a gloo rank can abort in finalization


@pytest.mark.skipif(not dist.is_available() or sys.platform == "win32",
                    reason="torch.distributed with gloo")
def test_hybrid_muon_under_ddp_matches_one_process_on_the_global_batch(tmp_path):
    torch.set_num_threads(1)
    init_file, out = str(tmp_path / "pg"), str(tmp_path / "params")
    mp.start_processes(_rank, args=(init_file, out), nprocs=WORLD, start_method="spawn",
                       join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(WORLD)]
    single = _train(_model(), None)
    for key, value in single.items():
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between ranks"
        assert torch.allclose(ranks[0][key], value, atol=2e-6, rtol=1e-5), key
