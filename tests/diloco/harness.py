"""Shared helpers for the DiLoCo tests: a tiny model, a minimal training loop that drives the
same callback methods the Trainer calls, and end-of-test invariants."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic.config import DistributedConfig  # noqa: E402
from speedtronic.diloco import codec  # noqa: E402
from speedtronic.diloco.codec import POINTER_KEY, Pointer  # noqa: E402

PROC = Path(__file__).with_name("proc.py")


def make_cfg(store: str, **kw: Any) -> DistributedConfig:
    base = DistributedConfig(enabled=True, store=store, inner_steps=5, poll_interval=0.05,
                             lease_ttl=2.0, start_timeout=30.0, shutdown_timeout=30.0,
                             master_idle_timeout=30.0, keep_versions=1000,
                             delete_processed=False, expected_workers=None)
    cfg = replace(base, **kw)
    cfg.validate()
    return cfg


class TinyModel(torch.nn.Module):
    """(B, 8) -> (B, 4) MLP learning a fixed random teacher; ~400 parameters."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


TEACHER = torch.randn(8, 4, generator=torch.Generator().manual_seed(123))


def batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * shard + step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.tanh(x @ TEACHER)


def eval_loss(model: torch.nn.Module) -> float:
    x, y = batch(10**6, 999)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


class FakeTrainer:
    """What the DiLoCo callbacks use from the Trainer."""

    def __init__(self, model: torch.nn.Module, lr: float = 2e-3) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.config = None
        self.step = 0
        self.metrics: list[dict] = []

    def log_metrics(self, values: dict) -> None:
        self.metrics.append(dict(values))


def train(callback: Any, trainer: FakeTrainer, steps: int, shard: int = 0,
          on_step: Any = None) -> None:
    """The trainer's loop reduced to what DiLoCo sees: start, steps, end (also on error)."""
    callback.on_train_start(trainer)
    try:
        for _ in range(steps):
            x, y = batch(trainer.step, shard)
            loss = torch.nn.functional.mse_loss(trainer.model(x), y)
            trainer.optimizer.zero_grad()
            loss.backward()
            trainer.optimizer.step()
            trainer.step += 1
            callback.after_optimizer_step(trainer, trainer.step)
            if on_step is not None:
                on_step(trainer.step)
    finally:
        callback.on_train_end(trainer)


def initial_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in TinyModel(seed).named_parameters()}


def read_pointer(store: Any) -> Pointer:
    return Pointer.from_bytes(store.get(POINTER_KEY))


def chain(store: Any) -> list[dict]:
    """Master states from the current pointer back to v0 (following ``parent``)."""
    pointer = read_pointer(store)
    out = []
    path = pointer.state_path
    while path:
        _, meta = codec.decode(store.get(path))
        out.append(meta)
        parent = meta.get("parent")
        if not parent:
            break
        path = parent.replace("global/v", "master/state-v")
    return out[::-1]


def applied_keys(store: Any) -> list[str]:
    """Every delta key applied along the published chain (duplicates kept, to be asserted)."""
    return [k for meta in chain(store) for k in meta["applied"]]


def global_digests(store: Any) -> dict[int, str]:
    """version -> tensor digest of every global file still in the store."""
    from speedtronic.diloco.master import _version_of

    out: dict[int, str] = {}
    for key in store.list("global/v"):
        if _version_of(key) is None:
            continue  # a stray object a test planted, not a global
        tensors, meta = codec.decode(store.get(key))
        out[int(meta["version"])] = codec.tensor_digest(tensors)
    return out


def assert_consistent(store: Any, reports: list[dict]) -> None:
    """Every node at version v holds weights whose digest is that of the published v (the
    pointer's digest when v was current); final-synced nodes hold exactly those weights (a node
    that finished earlier may sit at an older version than the last pointer)."""
    pointer = read_pointer(store)
    digests = global_digests(store)
    assert digests[pointer.version] == pointer.weights_digest
    for r in reports:
        assert r["digest"] == digests[r["version"]], r
        assert r["weights_digest"] == r["digest"] or not r.get("final_synced"), r
        assert 0 <= r["version"] <= pointer.version, (r, pointer)


def read_report(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_DILOCO_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env
