"""A data-parallel job for tests/distributed: run by ``torchrun`` (each rank trains its share)
or as one process (the reference over the same global batches). Writes final weights.

    python dp_job.py OUT_DIR     # one process, every micro-batch, accumulation over the world
    torchrun --nproc-per-node 2 dp_job.py OUT_DIR

The global micro-batch stream ``g_0, g_1, ...`` is fixed (seeded); step ``s`` of a W-rank job
gives rank ``r`` the micro-batch ``g_{W s + r}`` and one process takes ``g_{W s} .. g_{W s +
W - 1}`` as its accumulation, so both train on the same tokens. Some micro-batches are padded:
``g_1`` entirely (rank 1's first one), ``g_2`` half (token weighting must weigh it by half).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared fixtures
from _engine_fixtures import _Cycle  # noqa: E402

WORLD = 2
B, T, VOCAB = 2, 8, 64


def global_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
        x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        if i == 1:
            y[:] = -100  # all padding
        elif i == 2:
            y[:, T // 2:] = -100  # half
        out.append((x, y))
    return out


class Data:
    """This rank's training stream; the same held-out batches on every rank."""

    def __init__(self, batches: list, held_out: list) -> None:
        self.train = _Cycle(batches)  # resumable: its position is checkpointed
        self.eval = held_out

    def eval_batches(self, n: int) -> list:
        return self.eval[:n]


class FailAt:
    """A callback that raises after optimizer step ``step`` (a rank that fails mid-run)."""

    name = "fail"

    def __init__(self, step: int) -> None:
        self.step = step

    def after_optimizer_step(self, trainer, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"planted failure on rank {os.environ.get('RANK')}")


def main(out: Path) -> None:
    from speedtronic.train import build_trainer

    steps = 4
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    stream = global_batches(WORLD * steps)
    mine = stream if world == 1 else stream[rank::world]
    torch.set_num_threads(1)
    cfg = {
        "run": {"name": "job", "output_dir": str(out), "max_steps": steps, "eval_every": 2,
                "eval_batches": 4, "seed": 5, "device": "cpu"},
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": T,
                  "vocab_size": VOCAB},
        "data": {"micro_batch_size": B, "target_batch_size": B * WORLD},
        "optimizer": {"name": "muon", "lr": 3e-3, "grad_clip": 1.0},
        "logging": {"every_steps": 1, "progress_bar": False},
        "checkpoint": {"enabled": False},
        "shape_validation": {"enabled": False},
    }
    if os.environ.get("DP_JOB_FAIL_RANK"):
        cfg["data_parallel"] = {"timeout_s": 60}
    callbacks = [FailAt(2)] if os.environ.get("DP_JOB_FAIL_RANK") == str(rank) else []
    trainer = build_trainer(cfg, data=Data(mine, stream[2:6]), callbacks=callbacks)
    try:
        result = trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.release_run_lock()
    torch.save({"weights": trainer.model.state_dict(), "final_loss": result.final_loss,
                "eval_loss": result.final_eval_loss, "tokens": result.tokens},
               out / f"weights_rank{rank}.pt")
    if trainer.dp is not None:
        trainer.dp.close()
        from speedtronic.distributed.process_group import exit_after_distributed

        exit_after_distributed(0)  # a gloo rank can abort in finalization: see its docstring


if __name__ == "__main__":
    main(Path(sys.argv[1]))
