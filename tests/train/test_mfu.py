"""MFU arithmetic (speedtronic/train/mfu.py) and its place in the step lines and metrics.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.models import build_model
from speedtronic.train import mfu
from speedtronic.train.runtime import train_from_config


def test_reference_model_flops_follow_the_palm_formula():
    cfg = load_config({"model": {"n_layer": 2, "d_model": 64, "n_head": 4, "max_seq_len": 32}})
    model = build_model(cfg.model)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # 2 layers of q, k, v, o (4 d^2) and SwiGLU (3 d d_ff), plus the (tied) head d x V.
    d, d_ff, vocab = 64, model.blocks[0].mlp.gate_proj.out_features, 256
    assert linear == 2 * (4 * d * d + 3 * d * d_ff) + d * vocab
    assert model.flops_per_token(32) == 6 * linear + 12 * 2 * d * 32
    assert mfu.model_flops_per_token(model, 32) == model.flops_per_token(32)
    assert mfu.model_flops_per_token(torch.nn.Linear(2, 2), 32) is None


def test_peak_table_override_and_unknown_devices(monkeypatch):
    assert mfu.device_peak_tflops(torch.device("cpu"), "fp32", 2.5) == (2.5, "run.peak_tflops")
    assert mfu.device_peak_tflops(torch.device("cpu"), "fp32")[0] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, mode, peak in (("NVIDIA H100 80GB HBM3", "bf16", 989.0),
                             ("NVIDIA H100 PCIe", "bf16", 756.0),
                             ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),
                             ("NVIDIA A10", "fp16", 125.0), ("NVIDIA L40S", "bf16", 362.0),
                             # whole words: an L40 is not an L4, an H100 NVL not an SXM
                             ("NVIDIA L40", "bf16", 181.0), ("NVIDIA L4", "bf16", 121.0),
                             ("NVIDIA H100 NVL", "bf16", 835.5),
                             ("NVIDIA GH200 480GB", "bf16", 989.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, n=name: n)
        assert mfu.device_peak_tflops(torch.device("cuda"), mode)[0] == peak, name
    for unknown in ("Mystery GPU", "NVIDIA A10G"):  # an A10G is not an A10 (125 TFLOP/s)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, n=unknown: n)
        peak, why = mfu.device_peak_tflops(torch.device("cuda"), "bf16")
        assert peak is None and "run.peak_tflops" in why, unknown


def test_model_flops_follow_the_length_of_each_micro_batch():
    cfg = load_config({"model": {"n_layer": 2, "d_model": 64, "n_head": 4, "max_seq_len": 64}})
    model = build_model(cfg.model)
    meter = mfu.MfuMeter(model, 64, torch.device("cpu"), "fp32", peak_override=1.0)
    meter.count(torch.zeros(2, 8, dtype=torch.long))
    meter.count(torch.zeros(3, 64, dtype=torch.long))
    record: dict = {}
    meter.add(record, seconds=2.0)
    flops = 16 * model.flops_per_token(8) + 192 * model.flops_per_token(64)
    assert record["model_tflops"] == pytest.approx(flops / 2.0 / 1e12)
    assert record["mfu"] == pytest.approx(record["model_tflops"] / 1.0)
    meter.add(record, seconds=1.0)  # nothing counted since the last row
    assert record["model_tflops"] == 0.0
    row = {"tokens_per_sec": 1e6}  # the older call: tokens/s at the configured length
    meter.add(row)
    assert row["model_tflops"] == pytest.approx(1e6 * model.flops_per_token(64) / 1e12)


def test_mfu_of_a_dataset_shorter_than_the_context_uses_the_length_it_trains(tmp_path):
    """A user dataset of 17-token items under a 256-token model: attention is counted at 16."""

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(i))

    cfg = load_config({
        "run": {"name": "short", "output_dir": str(tmp_path), "max_steps": 2, "eval_every": 0,
                "device": "cpu", "peak_tflops": 1.0},
        "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "max_seq_len": 256},
        "data": {"micro_batch_size": 2}, "logging": {"every_steps": 1, "progress_bar": False},
        "checkpoint": {"enabled": False}, "shape_validation": {"enabled": False}})
    train_from_config(cfg, data=Items(), plot=False)
    rows = [json.loads(ln) for ln in (tmp_path / "short" / "metrics.jsonl").read_text()
            .splitlines()]
    model = build_model(cfg.model)
    for r in (r for r in rows if r["event"] == "train_step"):
        per_token = r["model_tflops"] * 1e12 / r["tokens_per_sec"]
        assert per_token == pytest.approx(model.flops_per_token(16), rel=1e-6)


def test_every_log_row_carries_tflops_and_mfu_and_the_end_gives_the_median(tmp_path, caplog):
    cfg = load_config({
        "run": {"name": "m", "output_dir": str(tmp_path), "max_steps": 4, "eval_every": 0,
                "device": "cpu", "peak_tflops": 0.5},
        "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "max_seq_len": 16},
        "data": {"micro_batch_size": 2, "stdlib_max_bytes": 100_000},
        "logging": {"every_steps": 1, "progress_bar": False}, "checkpoint": {"enabled": False}})
    with caplog.at_level("INFO", logger="speedtronic"):
        train_from_config(cfg, plot=False)
    rows = [json.loads(ln) for ln in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["event"] == "train_step"]
    assert len(steps) == 4
    fpt = build_model(cfg.model).flops_per_token(16)
    for r in steps:
        assert r["model_tflops"] == pytest.approx(r["tokens_per_sec"] * fpt / 1e12)
        assert r["mfu"] == pytest.approx(r["model_tflops"] / 0.5)
    end = rows[-1]
    assert end["event"] == "train_end"
    assert end["median_mfu"] == pytest.approx(sorted(r["mfu"] for r in steps)[1:3][0] / 2
                                              + sorted(r["mfu"] for r in steps)[1:3][1] / 2)
    assert "TFLOP/s | MFU " in caplog.text and "summary: median" in caplog.text
