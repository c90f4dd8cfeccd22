"""Startup check: GEMM dimensions that are not multiples of the tensor-core alignment.

Tensor cores run fastest when the matrix dimensions are multiples of 16 bytes (8 bf16/fp16
elements, 4 tf32) and, on A100-class and newer GPUs, 128 bytes (64 bf16/fp16 elements) - NVIDIA's
"Matrix Multiplication Background" guide, Table 1. nanoGPT measured ~25% from padding the vocab
50257 -> 50304. An odd *inner* dimension (``in_features``, ``out_features``, vocab, head dim)
costs far more than an odd batch (M) dimension, so model dims are the main rows.

How ``alignment: auto`` picks (``resolve_alignment``):

====================  =====================  =================================================
device / dtype        alignment              why
====================  =====================  =================================================
CUDA sm_80+, 16-bit   64                     128-byte tiles (A100 row of Table 1; Hopper too)
CUDA < sm_80, 16-bit  8                      16-byte minimum for tensor cores
CUDA fp32 (tf32)      4                      16-byte minimum for tf32
fp8                   16                     FP8 GEMMs require 16
CPU / MPS             off                    unless ``warn_on_cpu`` (then the 16-byte minimum)
====================  =====================  =================================================

Head dim is checked against ``min(alignment, 8)``: SDPA's flash/memory-efficient kernels pad head
dim to a multiple of 8 internally, so 32 or 96 run at full speed. The check only reports; it never
changes the model or the config. Suggested micro-batch sizes always divide ``target_batch_size``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import ShapeValidationConfig, SpeedtronicConfig

__all__ = ["ShapeRow", "ShapeReport", "check_shapes", "resolve_alignment"]

logger = logging.getLogger("speedtronic.shapes")

_HEAD_DIM_CAP = 8
# Metadata keys that are counts or lengths, not GEMM dims (the sequence is checked from the data).
_NOT_GEMM_KEYS = {"n_layer", "n_layers", "num_layers", "n_head", "n_heads", "num_heads",
                  "n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "seq_len",
                  "max_seq_len", "block_size", "max_position_embeddings"}
_SIXTEEN_BIT = {torch.bfloat16, torch.float16}
_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
                "tf32": torch.float32}


@dataclass
class ShapeRow:
    """One consolidated warning: a dimension (possibly repeated ``count`` times across layers)."""

    name: str
    """Where it first occurs, e.g. ``blocks.*.mlp.up_proj.out_features``."""
    kind: str
    """``linear``, ``embedding``, ``vocab``, ``head_dim``, ``conv``, ``sequence``, ``tokens``
    or ``custom`` (from ``speedtronic_shape_metadata()``)."""
    value: int
    """Current size."""
    padded: int | None
    """Suggested size (next aligned value, or a valid batch layout); None if none is valid."""
    extra_params: int | None
    """Parameters the padding would add, summed over the repeats; None when not a parameter."""
    count: int = 1
    """How many module dimensions have this kind and value."""
    note: str = ""
    """Extra advice (e.g. which config key to change)."""
    where: list[str] = field(default_factory=list)
    """Every place (module pattern + attribute) with this kind and value; ``name`` is the first.
    ``extra_params`` sums each place padded alone (a matrix padded on both sides adds a little
    more)."""


@dataclass
class ShapeReport:
    """Result of :func:`check_shapes`; ``rows`` is empty when the check is off or clean."""

    alignment: int | None
    """Alignment used (None = check off)."""
    reason: str
    """How the alignment was chosen, or why the check is off."""
    device: str
    dtype: str
    rows: list[ShapeRow] = field(default_factory=list)
    total_params: int = 0

    @property
    def warning_count(self) -> int:
        """Number of table rows (each row may cover several layers)."""
        return len(self.rows)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe summary (for metrics / the ``train_start`` payload)."""
        return {"alignment": self.alignment, "reason": self.reason, "device": self.device,
                "dtype": self.dtype, "warning_count": self.warning_count,
                "rows": [asdict(r) for r in self.rows]}

    def format_table(self) -> str:
        """The one consolidated table; "" when the check is off, one line when all is aligned."""
        if self.alignment is None:
            return ""
        head = (f"shape check ({self.device}, {self.dtype}, alignment {self.alignment}: "
                f"{self.reason})")
        if not self.rows:
            return f"{head}: all checked dimensions are aligned"
        table = [("dimension", "kind", "value", "padded", "extra params", "note")]
        for r in self.rows:
            name = r.name if len(r.where) < 2 else f"{r.name} +{len(r.where) - 1} more"
            if r.count > 1:
                name += f" (x{r.count})"
            padded = "-" if r.padded is None else str(r.padded)
            if r.extra_params is None:
                extra = "-"
            else:
                pct = 100.0 * r.extra_params / max(1, self.total_params)
                extra = f"+{r.extra_params:,} ({pct:.2f}%)"
            table.append((name, r.kind, str(r.value), padded, extra, r.note))
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        lines = [f"{head}: {len(self.rows)} dimension(s) not aligned"]
        for row in table:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                     row[3].rjust(widths[3]), row[4].rjust(widths[4]), row[5]]
            lines.append("  " + "  ".join(cells).rstrip())
        return "\n".join(lines)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown compute dtype {dtype!r}; valid: "
                         f"{sorted(_DTYPE_NAMES)}") from None


def resolve_alignment(sv: ShapeValidationConfig, device: torch.device | str,
                      dtype: torch.dtype | str,
                      capability: tuple[int, int] | None = None) -> tuple[int | None, str]:
    """(alignment or None, reason) for this device and compute dtype (see the module table)."""
    device, dtype = torch.device(device), _as_dtype(dtype)
    if not sv.enabled:
        return None, "shape_validation.enabled: false"
    if sv.alignment == "none":
        return None, "shape_validation.alignment: none"
    # A GPU config's explicit alignment stays quiet on a CPU, where the alignment costs nothing;
    # warn_on_cpu previews it.
    if device.type != "cuda" and not sv.warn_on_cpu:
        return None, (f"{device.type}: not applicable "
                      "(shape_validation.warn_on_cpu: true previews it)")
    if isinstance(sv.alignment, int):
        return sv.alignment, "explicit"
    fp8 = dtype.is_floating_point and dtype.itemsize == 1
    if fp8:
        return 16, "auto: fp8 GEMMs need multiples of 16"
    if device.type != "cuda":
        return (8 if dtype in _SIXTEEN_BIT else 4), "auto: 16-byte minimum (CPU preview)"
    if dtype not in _SIXTEEN_BIT:
        return 4, "auto: tf32 16-byte minimum"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) >= (8, 0):
        return 64, f"auto: 128-byte tiles on sm_{capability[0]}{capability[1]}"
    return 8, f"auto: 16-byte minimum on sm_{capability[0]}{capability[1]}"


def _next_multiple(value: int, a: int) -> int:
    return -(-value // a) * a


def _pattern(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


class _Collector:
    """Consolidates warnings: one row per (kind, value), listing every place it occurs."""

    def __init__(self, alignment: int) -> None:
        self.a = alignment
        self.rows: dict[tuple[str, int], ShapeRow] = {}

    def add(self, name: str, kind: str, value: int, extra_per_unit: int | None,
            align: int | None = None, note: str = "") -> None:
        a = align or self.a
        if value <= 0 or value % a == 0:
            return
        padded = _next_multiple(value, a)
        extra = None if extra_per_unit is None else (padded - value) * extra_per_unit
        pattern = _pattern(name)
        row = self.rows.get((kind, value))
        if row is None:
            self.rows[(kind, value)] = ShapeRow(pattern, kind, value, padded, extra, 1, note,
                                                [pattern])
            return
        row.count += 1
        if pattern not in row.where:
            row.where.append(pattern)
        if extra is not None:
            row.extra_params = (row.extra_params or 0) + extra


def _vocab_size(model: nn.Module, meta: dict[str, int], cfg: SpeedtronicConfig) -> int:
    if "vocab_size" in meta:
        return meta["vocab_size"]
    value = getattr(model, "vocab_size", None)
    return value if isinstance(value, int) else cfg.model.vocab_size


def _metadata(model: nn.Module) -> dict[str, int]:
    fn = getattr(model, "speedtronic_shape_metadata", None)
    if not callable(fn):
        return {}
    try:
        raw = fn()
    except Exception as exc:  # advisory feature: a broken hook must not stop training
        logger.warning("shape check: %s.speedtronic_shape_metadata() raised %s: %s; ignored",
                       type(model).__name__, type(exc).__name__, exc)
        return {}
    meta: dict[str, int] = {}
    for key, value in dict(raw or {}).items():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            meta[str(key)] = value
        else:
            logger.warning("shape check: speedtronic_shape_metadata()[%r] = %r is not a positive "
                           "int; ignored", key, value)
    return meta


def _head_dim_extra(module: nn.Module, head_dim: int) -> int | None:
    """Parameters added per unit of head-dim padding: each projection sized in heads grows.

    Counts the module's direct ``nn.Linear`` children by their head-sized side (q/k/v/fused qkv
    by output, o by input; square projections give n_head x d_model either way)."""
    per_unit = 0
    if isinstance(module, nn.MultiheadAttention):
        per_unit += 3 * module.num_heads * module.embed_dim  # in_proj_weight (3E, E)
    for child in module.children():
        if isinstance(child, nn.Linear):
            if child.out_features % head_dim == 0:
                per_unit += child.out_features // head_dim * child.in_features
            elif child.in_features % head_dim == 0:
                per_unit += child.in_features // head_dim * child.out_features
    return per_unit or None


def _vocab_heads(model: nn.Module, vocab: int) -> set[int]:
    """ids of the Linear layers that are output heads. Every Linear with ``vocab`` outputs is
    one (several heads: multi-token prediction) unless some Linear also takes ``vocab`` inputs:
    then that width is also an MLP's hidden width, and only the heads tied to a vocab-sized
    embedding and the last such Linear (heads are registered after the blocks) count. Such an
    MLP was once reported under ``vocab`` (or dropped with ``check_vocab: false``)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    outputs = [m for m in linears if m.out_features == vocab]
    if not any(m.in_features == vocab for m in linears):
        return {id(m) for m in outputs}
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, nn.Embedding) and m.num_embeddings == vocab}
    heads = {id(m) for m in outputs if id(m.weight) in embeddings}
    if outputs:
        heads.add(id(outputs[-1]))
    return heads


def _check_model(model: nn.Module, col: _Collector, vocab: int, sv: ShapeValidationConfig) -> None:
    counted: list[tuple[torch.Tensor, int]] = []

    def once(weight: torch.Tensor, axis: int, per_unit: int) -> int:
        """Extra parameters of padding ``axis`` of ``weight``, counted once per tensor axis: a
        tied head and embedding are one (V, d) tensor, so its V and its d are each padded once
        (the head's in_features and the embedding's dim were both charged before)."""
        if any(weight is w and axis == ax for w, ax in counted):
            return 0
        counted.append((weight, axis))
        return per_unit

    heads = _vocab_heads(model, vocab)
    for name, m in model.named_modules():
        name = name or type(m).__name__
        if isinstance(m, nn.Linear):
            bias = 1 if m.bias is not None else 0
            if id(m) in heads:
                if sv.check_vocab:
                    col.add(f"{name}.out_features", "vocab", vocab,
                            once(m.weight, 0, m.in_features + bias))
            elif sv.check_model:
                col.add(f"{name}.out_features", "linear", m.out_features,
                        once(m.weight, 0, m.in_features + bias))
            if sv.check_model:
                col.add(f"{name}.in_features", "linear", m.in_features,
                        once(m.weight, 1, m.out_features))
        elif isinstance(m, nn.Embedding):
            if m.num_embeddings == vocab and sv.check_vocab:
                col.add(f"{name}.num_embeddings", "vocab", vocab,
                        once(m.weight, 0, m.embedding_dim))
            if sv.check_model:
                col.add(f"{name}.embedding_dim", "embedding", m.embedding_dim,
                        once(m.weight, 1, m.num_embeddings))
        elif isinstance(m, nn.modules.conv._ConvNd) and sv.check_model:
            k = 1
            for s in m.kernel_size:
                k *= s
            cin, cout = m.in_channels // m.groups, m.out_channels
            if m.groups == 1:  # depthwise/grouped convs do not run as one GEMM over channels
                col.add(f"{name}.in_channels", "conv", cin, cout * k)
                col.add(f"{name}.out_channels", "conv", cout, cin * k)
        if sv.check_model and m is not model:  # a root-level head_dim has no single owner
            head_dim = getattr(m, "head_dim", None)
            if isinstance(m, nn.MultiheadAttention):
                head_dim = m.embed_dim // m.num_heads
            if isinstance(head_dim, int) and not isinstance(head_dim, bool):
                col.add(f"{name}.head_dim", "head_dim", head_dim, _head_dim_extra(m, head_dim),
                        align=min(col.a, _HEAD_DIM_CAP))


def _suggest_width(col: _Collector, meta: dict[str, int], alignment: int) -> None:
    """A head_dim row gets the d_model that aligns both: with head_dim = d_model / n_head,
    padding each on its own (d_model 100 -> 104, head_dim 50 -> 56 at n_head 2) names two
    sizes no model has."""
    n_head, d_model = meta.get("n_head"), meta.get("d_model")
    if not n_head or not d_model or meta.get("head_dim", d_model // n_head) != d_model // n_head:
        return  # head_dim is not d_model / n_head here: no single width fixes both
    head_align = min(alignment, _HEAD_DIM_CAP)
    step = math.lcm(alignment, n_head * head_align)
    width = _next_multiple(d_model, step)
    for (kind, _value), row in col.rows.items():
        if kind == "head_dim" and width != d_model:
            row.note = (f"model.d_model={width} aligns it and d_model (head_dim = d_model / "
                        f"n_head={n_head})")


def _batch_suggestion(micro: int, target: int, seq: int, max_seq: int,
                      a: int) -> tuple[int | None, str]:
    """A micro-batch dividing ``target`` (never one that breaks it) or a block size, aligning
    micro x seq; nearest to the current micro-batch, ties to the smaller (less memory)."""
    options = [m for m in range(1, target + 1)
               if target % m == 0 and m != micro and (m * seq) % a == 0]
    if options:
        best = min(options, key=lambda m: (abs(m - micro), m))
        return best * seq, f"data.micro_batch_size={best} (divides target_batch_size={target})"
    aligned_seq = _next_multiple(seq, a)  # fixes the sequence row too, when the model allows it
    for t in [aligned_seq] if aligned_seq <= max_seq else range(seq + 1, max_seq + 1):
        if (micro * t) % a == 0:
            return micro * t, f"data.block_size={t} (no micro-batch dividing {target} aligns)"
    return None, f"no micro_batch_size dividing target_batch_size={target} aligns; minor cost"


def check_shapes(model: nn.Module, cfg: SpeedtronicConfig, device: torch.device | str,
                 dtype: torch.dtype | str, *,
                 capability: tuple[int, int] | None = None) -> ShapeReport:
    """Walk the model once and report dimensions that miss the alignment (never modifies).

    ``dtype`` is the compute dtype (``torch.bfloat16``/``"bf16"``...); ``capability`` overrides
    the CUDA compute capability (for tests, or to preview another GPU).
    """
    sv = cfg.shape_validation
    device = torch.device(device)
    dt = _as_dtype(dtype)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt).replace(
        "torch.", ""))
    alignment, reason = resolve_alignment(sv, device, dt, capability)
    report = ShapeReport(alignment, reason, str(device), dtype_name)
    if alignment is None:
        return report
    report.total_params = sum(p.numel() for p in model.parameters())
    meta = _metadata(model)
    col = _Collector(alignment)
    vocab = _vocab_size(model, meta, cfg)
    _check_model(model, col, vocab, sv)
    flagged = {r.value for r in col.rows.values()}
    for key, value in meta.items():
        if key in _NOT_GEMM_KEYS or value in flagged:
            continue  # counts, or a size the module walk already reported with its cost
        if key == "vocab_size":
            if sv.check_vocab:
                col.add("vocab_size", "vocab", value, None)
        elif key == "head_dim":
            if sv.check_model:
                col.add("head_dim", "head_dim", value, None, align=min(alignment, _HEAD_DIM_CAP))
        elif sv.check_model:
            col.add(key, "custom", value, None)
    _suggest_width(col, meta, alignment)
    seq = cfg.data.block_size or cfg.model.max_seq_len
    if sv.check_sequence:
        note = ""
        padded = _next_multiple(seq, alignment)
        if padded > cfg.model.max_seq_len:
            note = f"needs model.max_seq_len >= {padded}"
        col.add("data.block_size", "sequence", seq, None, note=note)
    rows = list(col.rows.values())
    micro = cfg.data.micro_batch_size
    if sv.check_batch and (micro * seq) % alignment:
        target = cfg.data.target_batch_size or micro
        tokens, note = _batch_suggestion(micro, target, seq, cfg.model.max_seq_len, alignment)
        if tokens is not None:  # the fix may shrink the tokens per micro-batch: not a padding
            note = f"{note}: {tokens} tokens"
        rows.append(ShapeRow("micro_batch_size x block_size", "tokens", micro * seq, None,
                             None, 1, note))
    report.rows = rows
    return report
