"""Train from Python: your own model, a config dict, a metrics hook and a trainer callback.

    python examples/train_from_python.py

Runs in a few seconds on a CPU and leaves runs/example-bigram/ (metrics.jsonl, config.yaml,
checkpoints, loss.png).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from speedtronic import load_config
from speedtronic.models import register_model
from speedtronic.train.runtime import train_from_config
from speedtronic.train.trainer import TrainerCallback


@register_model("bigram_mlp")
class BigramMLP(nn.Module):
    """Predicts the next byte from the current one; labels arrive shifted (y[t] = x[t+1])."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.emb(input_ids))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class StopIfDiverged(TrainerCallback):
    """A callback sees the trainer after every optimizer step (DiLoCo plugs in the same way)."""

    name = "stop_if_diverged"

    def after_optimizer_step(self, trainer, step: int) -> None:
        if step % 50 == 0 and not torch.isfinite(next(trainer.model.parameters())).all():
            raise RuntimeError(f"non-finite parameters at step {step}")


def print_evals(event: str, payload: dict) -> None:
    """A metrics hook gets every event: train_start, train_step, eval, checkpoint, train_end."""
    if event == "eval":
        print(f"[hook] step {payload['step']}: eval loss {payload['eval_loss']:.3f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # show the progress lines
    cfg = load_config({
        "run": {"name": "example-bigram", "max_steps": 150, "eval_every": 50},
        "model": {"name": "bigram_mlp", "d_model": 64, "max_seq_len": 64},
        "data": {"micro_batch_size": 16, "stdlib_max_bytes": 1_000_000},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 10},
        "logging": {"every_steps": 25},
    })
    result = train_from_config(cfg, hooks=[print_evals], callbacks=[StopIfDiverged()])
    print(f"final eval loss {result.final_eval_loss:.3f}; run dir {result.run_dir}")
