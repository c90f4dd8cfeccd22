"""Tiny configs, models and data shared by the engine tests (trainer, checkpoint, CLI, metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig, load_config


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far faster than two on a busy 2-core box
    (measured: an 8-step tiny run took 11.9 s with 2 threads under load, 2.9 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_raw(out: Path, name: str = "t", **sections: Any) -> dict[str, Any]:
    """A raw config dict for a ~20k-parameter reference model on a small stdlib slice."""
    raw: dict[str, Any] = {
        "run": {"name": name, "output_dir": str(out), "max_steps": 6, "eval_every": 3,
                "eval_batches": 2, "seed": 7},
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32},
        "data": {"micro_batch_size": 4, "stdlib_max_bytes": 300_000},
        "scheduler": {"warmup_steps": 2},
        "logging": {"every_steps": 2, "progress_bar": False},
        "checkpoint": {"every_steps": 3},
        "shape_validation": {"enabled": False},
    }
    for sec, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(sec, {}).update(values)
        else:
            raw[sec] = values
    return raw


def tiny_config(out: Path, name: str = "t", **sections: Any) -> SpeedtronicConfig:
    return load_config(tiny_raw(out, name, **sections))


class FixedData:
    """Stand-in DataBundle: a resumable cycle over fixed random batches."""

    def __init__(self, n: int = 16, B: int = 4, T: int = 8, vocab: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (n, B, T + 1), generator=g)
        self.batches = [(t[:, :-1].clone(), t[:, 1:].clone()) for t in tokens]
        self.train = _Cycle(self.batches)

    def eval_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches[:n]


class _Cycle:
    def __init__(self, batches: list) -> None:
        self.batches, self.pos = batches, 0

    def __iter__(self) -> _Cycle:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.pos % len(self.batches)]
        self.pos += 1
        return b

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class TinyLM(nn.Module):
    """Embedding -> Linear -> LayerNorm -> head: every parameter kind, a scalar CE loss."""

    def __init__(self, vocab: int = 32, d: int = 16, out: str = "tensor") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.hidden = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.out = out
        self.checkpointing = False

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        h = self.norm(torch.relu(self.hidden(self.emb(x))))  # (B, T, d)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
        if self.out == "dict":
            return {"loss": loss, "logits": None}
        if self.out == "tuple":
            return loss, h
        return loss
