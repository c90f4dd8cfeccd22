"""The trainers users already run, through the examples they would copy: a Hugging Face
``Trainer`` (examples/hf_trainer.py) and a Lightning module (examples/lightning_module.py), each
with gradient accumulation, clipping and bf16 autocast. Our optimizer must step exactly once per
accumulated batch and the loss must fall."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _adamw_steps(optimizer) -> set[float]:
    """The AdamW ``step`` counters (one per AdamW tensor): how often the optimizer stepped."""
    return {float(st["step"]) for st in optimizer.state.values() if "step" in st}


def _muon_buffers(optimizer) -> int:
    return sum("momentum_buffer" in st for st in optimizer.state.values())


@pytest.mark.parametrize("bf16", [False, True])
def test_hugging_face_trainer(tmp_path, bf16):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    trainer = _load("hf_trainer").run(str(tmp_path), max_steps=12, d_model=32, seq_len=32,
                                      batch_size=4, accumulation=2, bf16=bf16)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    assert type(optimizer).__name__ == "HybridOptimizer"
    assert trainer.state.global_step == 12
    assert _adamw_steps(optimizer) == {12.0}        # once per accumulated batch, not per micro
    assert _muon_buffers(optimizer) == 8            # GPT-2's Conv1D matrices are on Muon
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_configure_optimizers(precision):
    pytest.importorskip("lightning")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    module = _load("lightning_module").run(max_steps=12, seq_len=32, batch_size=4,
                                           accumulation=2, precision=precision)
    optimizer = module.trainer.optimizers[0]
    optimizer = getattr(optimizer, "optimizer", optimizer)
    assert type(optimizer).__name__ == "HybridOptimizer"
    assert len(module.losses) == 24                 # 12 steps x 2 micro-batches
    assert _adamw_steps(optimizer) == {12.0}
    assert _muon_buffers(optimizer) == 8            # in_proj (split:3), out_proj, 2 MLP per layer
    assert sum(module.losses[-4:]) < sum(module.losses[:4])
