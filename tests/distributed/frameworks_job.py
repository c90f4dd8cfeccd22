"""Our hybrid Muon optimizer inside other engines' data parallelism, run by ``torchrun`` with 2
ranks: Lightning (``strategy="ddp"``) or Hugging Face accelerate. Each rank writes its final
parameters; the test checks the ranks agree (the all-reduced gradients fed one replicated
step) and that the weights moved.

    torchrun --nproc-per-node 2 frameworks_job.py lightning|accelerate OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer

STEPS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 1))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
            for _ in range(STEPS)]


def run_lightning(rank: int) -> nn.Module:  # noqa: ARG001 - Lightning shards the data
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return build_optimizer(self.net, OptimizerConfig(name="muon", lr=1e-2))

    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # Lightning shards the loader itself (a DistributedSampler per rank)
    g = torch.Generator().manual_seed(10)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g),
                                          torch.randn(64, 1, generator=g))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=8))
    return module.net


def run_accelerate(rank: int) -> nn.Module:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = model()
    opt = build_optimizer(net, OptimizerConfig(name="muon", lr=1e-2))
    wrapped, opt = accelerator.prepare(net, opt)
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(wrapped(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return net


if __name__ == "__main__":
    torch.set_num_threads(1)
    which, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    net = {"lightning": run_lightning, "accelerate": run_accelerate}[which](rank)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
               out / f"{which}_rank{rank}.pt")
    import torch.distributed as dist

    from speedtronic.distributed.process_group import exit_after_distributed

    if dist.is_initialized():  # accelerate leaves its process group to the interpreter's exit
        dist.destroy_process_group()
    exit_after_distributed(0)  # a gloo rank can abort in finalization: see its docstring
