"""Model FLOPs utilization: how close a run is to the hardware.

``MFU = achieved model FLOP/s / peak dense FLOP/s of the device``, where the achieved rate is
the model FLOPs of the micro-batches run in a log interval (tokens x FLOPs per token at each
one's own length) over the interval's time. Model FLOPs count the work the model needs, not what the
run does: a training token costs 3x its forward FLOPs (forward, and backward for activations
and for weights), so recomputation under gradient checkpointing is not counted (that would be
hardware FLOPs utilization), and neither is the optimizer step. For a decoder-only transformer
this is the PaLM formula (Chowdhery et al. 2022, appendix B):

    FLOPs per token = 6 N + 12 L d T

* ``N``: parameters that multiply activations: every linear layer and the output head (tied or
  not, the head's matmul happens); not the embedding lookup or the norms;
* ``12 L d T``: attention scores and the weighted sum of values, 2 x 2 x d x T per layer
  forward, x 3 for training; causal masking is not discounted (the PaLM convention).

A model declares its FLOPs with a ``flops_per_token(seq_len) -> float`` method (the reference
transformer does); without one, step lines show tokens/s only. Peak rates are NVIDIA's dense
(no sparsity) tensor-core figures from the product datasheets, for 16-bit precision and TF32
(fp32 runs on CUDA are measured against TF32, which matmuls use when enabled); ``run.peak_tflops``
overrides them, e.g. for other GPUs or for a CPU.
"""

from __future__ import annotations

import logging
import re
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "MfuMeter", "device_peak_tflops", "median", "model_flops_per_token",
           "transformer_flops_per_token"]

logger = logging.getLogger("speedtronic.mfu")

#: Dense peak TFLOP/s per GPU: (16-bit, TF32). A key matches whole words of the device name
#: (words split at spaces and dashes), first hit: "L4" is not "NVIDIA L40", nor "A10" an "A10G".
#: The NVL rows are the datasheets' sparse figures (1,671 / 835) halved.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 989.0, 494.0),
    ("H200 NVL", 835.5, 417.5),
    ("H200", 989.0, 494.0),
    ("H100 NVL", 835.5, 417.5),
    ("H100 PCIe", 756.0, 378.0),
    ("H100", 989.0, 494.0),       # SXM
    ("A100", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 60.0),
    ("A10", 125.0, 62.5),
    ("RTX 4090", 165.2, 82.6),    # fp16/bf16 with fp32 accumulation
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),        # fp16 tensor cores; no TF32 (fp32 CUDA-core rate)
    ("T4", 65.0, 8.1),
)


def transformer_flops_per_token(matmul_params: int, n_layer: int, d_model: int,
                                seq_len: int) -> float:
    """``6 N + 12 L d T`` training FLOPs per token (see the module docstring)."""
    return 6.0 * matmul_params + 12.0 * n_layer * d_model * seq_len


def model_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """The model's declared training FLOPs per token at ``seq_len``, or None."""
    fn = getattr(model, "flops_per_token", None)
    if not callable(fn):
        return None
    value = float(fn(seq_len))
    return value if value > 0 else None


def device_peak_tflops(device: torch.device, precision_mode: str,
                       override: float | None = None) -> tuple[float | None, str]:
    """``(peak TFLOP/s, where it came from)``; None when unknown (CPU, unlisted GPU)."""
    if override is not None:
        return float(override), "run.peak_tflops"
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, f"no peak for {device.type} (set run.peak_tflops)"
    name = torch.cuda.get_device_name(device)
    words = " " + " ".join(re.split(r"[\s-]+", name)) + " "
    for key, half, tf32 in PEAK_TFLOPS:
        if f" {key} " in words:
            sixteen = precision_mode in ("bf16", "fp16")
            return (half if sixteen else tf32), f"{name}, {'16-bit' if sixteen else 'TF32'} dense"
    return None, f"{name} is not in the peak table (set run.peak_tflops)"


def median(values: Sequence[float]) -> float | None:
    """The median of ``values``; None for none."""
    return statistics.median(values) if values else None


class MfuMeter:
    """Adds model TFLOP/s and MFU to a run's log rows and keeps them for the summary.

    The device's peak is decided once per run; the model FLOPs are counted per micro-batch at
    the sequence length it has (:meth:`count`), so a dataset of items shorter than
    ``model.max_seq_len`` is not credited with attention over positions it never had (a
    2048-token model trained on 128-token items read 4.2x too high when the length was fixed at
    the start). One log line states the decision (or why MFU is off)."""

    def __init__(self, model: nn.Module, seq_len: int, device: torch.device,
                 precision_mode: str, peak_override: float | None = None) -> None:
        self._model = model
        #: FLOPs per token at the configured sequence length (the start-of-run log line)
        self.flops_per_token = model_flops_per_token(model, seq_len)
        self._per_token: dict[int, float] = {seq_len: self.flops_per_token or 0.0}
        self._flops = 0.0  # model FLOPs of the micro-batches counted since the last add
        self.peak_tflops, source = device_peak_tflops(device, precision_mode, peak_override)
        self.tflops_history: list[float] = []
        self.mfu_history: list[float] = []
        if self.flops_per_token is None:
            logger.info("mfu: off (%s declares no flops_per_token(seq_len))",
                        type(model).__name__)
        elif self.peak_tflops is None:
            logger.info("mfu: model TFLOP/s only (%.3g GFLOP per token); %s",
                        self.flops_per_token / 1e9, source)
        else:
            logger.info("mfu: %.3g GFLOP per token against a peak of %.0f TFLOP/s (%s)",
                        self.flops_per_token / 1e9, self.peak_tflops, source)

    def count(self, batch: torch.Tensor) -> None:
        """Add the model FLOPs of one micro-batch the model ran, ``batch`` its ``(B, T)``
        input: ``B * T`` tokens at ``flops_per_token(T)``."""
        if self.flops_per_token is None:
            return
        seq_len = int(batch.shape[-1])
        per_token = self._per_token.get(seq_len)
        if per_token is None:
            per_token = self._per_token[seq_len] = (
                model_flops_per_token(self._model, seq_len) or 0.0)
        self._flops += batch.numel() * per_token

    def add(self, record: dict[str, Any], seconds: float | None = None) -> None:
        """Set ``record["model_tflops"]`` (and ``["mfu"]`` with a known peak): this device's
        FLOPs counted since the last row over the interval's ``seconds`` (under torchrun the
        peak is one GPU's, and so is the count). Without ``seconds``: the row's tokens/s at the
        configured sequence length."""
        if self.flops_per_token is None:
            return
        if seconds is None:
            per_device = record.get("tokens_per_sec_per_rank", record["tokens_per_sec"])
            tflops = per_device * self.flops_per_token / 1e12
        else:
            tflops = self._flops / max(seconds, 1e-9) / 1e12
        self._flops = 0.0
        record["model_tflops"] = tflops
        self.tflops_history.append(tflops)
        if self.peak_tflops is not None:
            record["mfu"] = tflops / self.peak_tflops
            self.mfu_history.append(record["mfu"])

    def summary(self) -> dict[str, float | None]:
        """The medians over every row :meth:`add` saw (the ``train_end`` fields)."""
        return {"median_model_tflops": median(self.tflops_history),
                "median_mfu": median(self.mfu_history)}

    def summary_line(self) -> str | None:
        """``summary: median ... model TFLOP/s, MFU ...%`` or None without FLOPs."""
        summary = self.summary()
        tflops, mfu = summary["median_model_tflops"], summary["median_mfu"]
        if tflops is None:
            return None
        mfu_text = f", MFU {100 * mfu:.1f}%" if mfu is not None else ""
        return (f"summary: median {tflops:.3g} model TFLOP/s{mfu_text} over "
                f"{len(self.tflops_history)} log steps")
