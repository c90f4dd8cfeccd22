"""The configuration schema: one dataclass per section, with a docstring under every field.

A run is described by one :class:`SpeedtronicConfig`. It is built from YAML, JSON or a dict by
:func:`speedtronic.config.load_config` (in :mod:`speedtronic.config.loading`), which

* expands the accepted shorthands (``optimizer: muon``, ``precision: bf16``, root ``name`` /
  ``seed`` / ``device`` / ``max_steps`` / ``output_dir`` / ``log_every`` / ``muon_plus`` /
  ``cautious``, ``compile: {enabled: ...}``) and refuses two spellings that disagree;
* applies ``--set section.key=value`` overrides (values parsed as YAML);
* rejects unknown keys with the full dotted name and the closest valid key;
* checks every value's type against the field annotation (the string ``"false"`` is not a bool;
  an int is accepted where a float is expected), that every float is finite (only the wait
  timeouts marked ``_INF_IS_NO_LIMIT`` take ``.inf``) and every range rule.

Field docstrings (the string under each field) are the reference documentation for each key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError, brief
from . import redaction

__all__ = [
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "PrecisionConfig",
    "CheckpointConfig",
    "TrainConfig",
    "LoggingConfig",
    "ShapeValidationConfig",
    "DistributedConfig",
    "SpeedtronicConfig",
]


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


# Field metadata of the few floats where YAML ``.inf`` has a meaning: a wait without a limit.
_INF_IS_NO_LIMIT = {"inf_is_no_limit": True}


def _torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it; 1 outside torchrun (or when it is not a number: the
    data-parallel setup reports that)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _check_finite(section: Any, prefix: str = "") -> None:
    """Refuse inf and NaN in every float field and float-list item of ``section`` (recursively).

    One check here instead of one per field: ``lr > 0`` is true for inf, and NaN slips past any
    rule written as ``not (x < 0)`` or on list items, and either ends a run in NaN losses.
    """
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(section, f.name)
        if f.type == "Any":  # user objects (data.dataset), not numbers we interpret
            continue
        if dataclasses.is_dataclass(value):
            _check_finite(value, key)
            continue
        no_limit = bool(f.metadata.get("inf_is_no_limit"))
        is_list = isinstance(value, (list, tuple))
        for item in value if is_list else (value,):
            if isinstance(item, float) and not math.isfinite(item) \
                    and not (no_limit and item == math.inf):
                rule = "a finite number or .inf (no limit)" if no_limit else "a finite number"
                _check(False, key, f"{'every item ' if is_list else ''}must be {rule}, "
                       f"got {brief(list(value) if is_list else value)}")


def _check_choices(section: Any, prefix: str) -> None:
    """Refuse a value outside its ``Literal[...]`` choices in the fields of one section.

    The YAML loader checks these while parsing; this covers configs built in Python (e.g.
    ``OptimizerConfig(name="Muon")`` handed to ``build_optimizer``, which once built an
    all-AdamW optimizer without a word). Fields whose type mixes a Literal with other types
    (``compile: bool | "auto"``), and values that are not strings, are left to the section's own
    rules and to the code that reads them."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        hint = hints.get(f.name)
        if typing.get_origin(hint) is not Literal:
            continue
        choices = typing.get_args(hint)
        value = getattr(section, f.name)
        # Strings only: other values (a torch dtype for muon_ns_dtype, None) go to consumers
        # that accept or refuse them themselves, as before this check existed.
        if isinstance(value, str) and value not in choices:
            key = f"{prefix}.{f.name}" if prefix else f.name
            _check(False, key, f"must be one of {', '.join(repr(c) for c in choices)}, "
                   f"got {brief(value)}")


@dataclass
class RunConfig:
    """Identity and length of a run."""

    name: str = "speedtronic-run"
    """Run name; the run directory is ``output_dir/name``."""
    seed: int = 1234
    """Seed for model init, data order and dropout (also the default ``data.seed``)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    max_steps: int = 1000
    """Number of optimizer steps (absolute: a resumed run stops at the same step)."""
    output_dir: str = "runs"
    """Base folder for run directories."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device, the denominator of MFU. None = NVIDIA's datasheet figure
    for the GPU (16-bit or TF32 by precision; see train/mfu.py), or no MFU when unknown."""
    num_threads: int | None = None
    """CPU threads for torch (``torch.set_num_threads``); None keeps torch's default (one per
    core). On a 2-core machine with the other core busy, 2 threads ran the quickstart ~9x slower
    than on an idle machine (64 s vs 7 s per 50 steps) because OpenMP threads wait on each other;
    1 thread degrades gracefully there."""
    eval_every: int = 100
    """Evaluate on the held-out split before the first step and every N optimizer steps, and
    always after the last (0 = only after the last)."""
    eval_batches: int = 8
    """Number of held-out micro-batches per evaluation (the same batches every time)."""

    def validate(self, p: str = "run") -> None:
        _check(bool(self.name.strip()) and "/" not in self.name and self.name not in (".", ".."),
               f"{p}.name", f"must be a non-empty name without '/', got {brief(self.name)}")
        _check(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        # torch.manual_seed takes a signed or unsigned 64-bit value and overflows past it
        _check(-2**63 <= self.seed < 2**64, f"{p}.seed",
               f"must fit in 64 bits (-2**63 <= seed < 2**64), got {str(self.seed)[:40]}")
        if self.num_threads is not None:
            _check(self.num_threads > 0, f"{p}.num_threads",
                   f"must be > 0 or null, got {self.num_threads}")
        if self.peak_tflops is not None:
            _check(self.peak_tflops > 0, f"{p}.peak_tflops",
                   f"must be > 0 or null, got {self.peak_tflops}")
        _check(self.eval_every >= 0, f"{p}.eval_every", f"must be >= 0, got {self.eval_every}")
        _check(self.eval_batches > 0, f"{p}.eval_batches", f"must be > 0, got {self.eval_batches}")
        _check(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device) is not None, f"{p}.device",
               f"must be auto, cpu, mps, cuda or cuda:N, got {brief(self.device)}")


@dataclass
class ModelConfig:
    """Which model to build and its size (the reference GPT's hyper-parameters)."""

    name: str = "reference_transformer"
    """Registered model name (see ``speedtronic.models.register_model``)."""
    vocab_size: int | None = 256
    """Vocabulary size; 256 matches the bundled byte-level data. In a config file that sets
    ``data.tokenizer`` or ``data.tokens_path`` and leaves this out, it follows the data: the
    tokenizer's vocabulary (or a prepared directory's); other token files need it set, above
    their largest id. None = follow the data in the same way."""
    max_seq_len: int = 128
    """Longest sequence the model accepts (RoPE table size); default ``data.block_size``."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 8
    """Number of query heads."""
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention; must divide ``n_head``. None = ``n_head``."""
    d_model: int = 256
    """Residual width; must be divisible by ``n_head`` with an even head dim (RoPE)."""
    d_ff: int | None = None
    """SwiGLU hidden width. None = 8/3 * d_model rounded up to a multiple of 64."""
    dropout: float = 0.0
    """Dropout probability in [0, 1)."""
    tie_weights: bool = True
    """Share the token embedding with the output head."""
    rope_base: float = 10000.0
    """RoPE frequency base (> 0)."""
    hf_config: Any = None
    """With ``name: hf``: a Hugging Face model config, as a local folder holding
    ``config.json`` or a mapping ``{model_type: llama, hidden_size: 64, ...}``; the model is
    built by ``transformers`` with fresh weights, its vocab from ``vocab_size`` unless the mapping
    sets one (docs/models.md)."""
    init_from: str | None = None
    """Start a fresh run from trained weights (the optimizer starts fresh): a run directory
    (its newest checkpoint), one of our checkpoint files, or a Hugging Face folder of
    safetensors (Llama names convert into the reference model). Ignored by ``--resume``, whose
    checkpoint holds the weights."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward (same as root ``gradient_checkpointing``)."""

    def validate(self, p: str = "model") -> None:
        for key in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, key)
            if value is not None or key != "vocab_size":
                _check(value > 0, f"{p}.{key}", f"must be > 0, got {value}")
        if self.n_kv_head is not None:
            _check(self.n_kv_head > 0 and self.n_head % self.n_kv_head == 0, f"{p}.n_kv_head",
                   f"must be > 0 and divide n_head={self.n_head}, got {self.n_kv_head}")
        _check(self.d_model % self.n_head == 0 and (self.d_model // self.n_head) % 2 == 0,
               f"{p}.d_model", f"must be divisible by n_head={self.n_head} with an even head "
               f"dim, got {self.d_model}")
        if self.d_ff is not None:
            _check(self.d_ff > 0, f"{p}.d_ff", f"must be > 0, got {self.d_ff}")
        _check(0.0 <= self.dropout < 1.0, f"{p}.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(self.rope_base > 0, f"{p}.rope_base", f"must be > 0, got {self.rope_base}")
        if self.hf_config is not None:
            _check(self.name == "hf", f"{p}.hf_config", f"is only read with {p}.name: hf, got "
                   f"{p}.name {brief(self.name)}")
            _check(isinstance(self.hf_config, (str, dict)), f"{p}.hf_config",
                   "must be a folder path or a mapping with model_type, got "
                   f"{type(self.hf_config).__name__}")


@dataclass
class DataConfig:
    """Where batches come from. Default: the bundled real-text byte corpus (stdlib source)."""

    text_path: str | None = None
    """A UTF-8 text file, streamed in blocks (never loaded whole), byte-level tokens. With
    ``tokenizer``: a file, a glob or a directory of text files, tokenized once into shards."""
    tokens_path: str | None = None
    """Pre-tokenized ids, memory-mapped: a ``.bin`` (raw, or with the modded-nanogpt / llm.c
    header) or ``.npy`` file of uint16/uint32 ids, a glob, or a directory of such shards."""
    eval_tokens_path: str | None = None
    """Held-out ids for eval, same formats. None = the last ``eval_fraction`` of the tokens."""
    tokens_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Id width of raw ``.bin`` files without a header (auto = uint16, nanoGPT's layout)."""
    tokenizer: str | None = None
    """A Hugging Face ``tokenizer.json`` (or its directory), or a Hub name when online: the
    source (``text_path`` or ``hf_dataset``) is tokenized once by ``speedtronic prepare``
    (also run on first use) and cached; ``model.vocab_size`` follows it when not set."""
    hf_dataset: str | None = None
    """A Hugging Face dataset: a Hub name (online), a local data directory or files, or a
    ``save_to_disk`` copy (offline). Needs ``tokenizer``."""
    hf_config: str | None = None
    """The dataset's configuration name, when it has several."""
    hf_split: str = "train"
    """The split to tokenize."""
    text_field: str = "text"
    """The column holding the text."""
    hf_streaming: bool = False
    """Stream the dataset while tokenizing instead of downloading it whole first."""
    prepare_dir: str | None = None
    """Where prepared shards go (a subfolder per tokenizer + source). None =
    ``$SPEEDTRONIC_CACHE_DIR/tokens`` (default ``~/.cache/speedtronic/tokens``)."""
    prepare_workers: int | None = None
    """Tokenizer processes for ``prepare``. None = one per CPU core."""
    synthetic: bool = False
    """Random tokens, for benchmarks (no learning signal)."""
    dataset: Any = None
    """A user dataset: ``"package.module:factory"`` (called with the config, returns a
    ``Dataset``/``IterableDataset``) or, from Python, a live dataset object."""
    stdlib_max_bytes: int = 8_000_000
    """Size cap of the bundled stdlib corpus (files taken in sorted order)."""
    eval_fraction: float = 0.05
    """Share of the corpus held out for evaluation (a deterministic split)."""
    num_tokens: int = 1_000_000
    """Length of the synthetic token stream."""
    block_size: int | None = None
    """Tokens per sample. None = ``model.max_seq_len``."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass (per process under torchrun)."""
    target_batch_size: int | None = None
    """Samples per optimizer step over all processes (a multiple of ``micro_batch_size`` times
    the torchrun world size); None = one micro-batch per process (``micro_batch_size`` x
    ``WORLD_SIZE`` under torchrun), and the resolved value is what config.yaml records."""
    num_workers: int = 0
    """DataLoader worker processes for user map-style datasets."""
    pin_memory: bool | None = None
    """Pin host memory; None = when training on CUDA."""
    shuffle: bool = True
    """Seeded random sample order; false reads windows / items sequentially (an
    ``IterableDataset`` is always read in its own order)."""
    seed: int | None = None
    """Data-order seed; None = ``run.seed``."""

    def validate(self, p: str = "data") -> None:
        sources = {"text_path": self.text_path, "synthetic": self.synthetic or None,
                   "dataset": self.dataset, "tokens_path": self.tokens_path,
                   "hf_dataset": self.hf_dataset}
        given = {k: v for k, v in sources.items() if v is not None}
        _check(len(given) <= 1, p, f"set at most one of {', '.join(sources)} (got "
               + ", ".join(f"{k}={brief(v)}" for k, v in given.items()) + ")")
        if self.text_path is not None and self.tokenizer is None:
            path = Path(self.text_path)
            _check(path.is_file(), f"{p}.text_path", f"file not found: {str(path)!r}")
        if self.tokenizer is not None:
            _check(self.text_path is not None or self.hf_dataset is not None, f"{p}.tokenizer",
                   "needs a text source to tokenize: set data.text_path or data.hf_dataset "
                   "(for already tokenized ids use data.tokens_path alone)")
        _check(self.hf_dataset is None or self.tokenizer is not None, f"{p}.hf_dataset",
               "needs data.tokenizer (a tokenizer.json path or a Hub name)")
        _check(self.eval_tokens_path is None or self.tokens_path is not None,
               f"{p}.eval_tokens_path", "needs data.tokens_path")
        if self.prepare_workers is not None:
            _check(self.prepare_workers > 0, f"{p}.prepare_workers",
                   f"must be > 0, got {self.prepare_workers}")
        _check(self.stdlib_max_bytes > 0, f"{p}.stdlib_max_bytes", "must be > 0")
        _check(0.0 < self.eval_fraction < 0.5, f"{p}.eval_fraction",
               f"must be in (0, 0.5), got {self.eval_fraction}")
        _check(self.num_tokens > 0, f"{p}.num_tokens", f"must be > 0, got {self.num_tokens}")
        if self.block_size is not None:
            _check(self.block_size > 0, f"{p}.block_size", f"must be > 0, got {self.block_size}")
        _check(self.micro_batch_size > 0, f"{p}.micro_batch_size",
               f"must be > 0, got {self.micro_batch_size}")
        if self.target_batch_size is not None:
            _check(self.target_batch_size >= self.micro_batch_size
                   and self.target_batch_size % self.micro_batch_size == 0,
                   f"{p}.target_batch_size", f"must be a multiple of micro_batch_size="
                   f"{self.micro_batch_size}, got {self.target_batch_size}")
        _check(self.num_workers >= 0, f"{p}.num_workers", "must be >= 0")


@dataclass
class OptimizerConfig:
    """The optimizer. ``adamw`` trains every parameter with AdamW; ``muon`` routes hidden 2-D
    matrices to Muon and everything else (embeddings, head, norms, biases) to AdamW."""

    name: Literal["adamw", "muon"] = "adamw"
    """``adamw`` or ``muon`` (hybrid Muon + AdamW)."""
    lr: float = 3e-4
    """AdamW learning rate (peak, before the schedule)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; see ``decay_embeddings``/``decay_norms``)."""
    decay_embeddings: bool = False
    """Apply weight decay to embeddings and the (tied) output head too."""
    decay_norms_and_biases: bool = False
    """Apply weight decay to norm gains and biases too."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    fused: bool | None = None
    """Use a fused AdamW implementation when available; None = automatic."""
    muon_lr: float = 0.02
    """Muon learning rate (Muon's updates are orthogonal, so its lr is not AdamW's)."""
    muon_weight_decay: float = 0.01
    """Muon decoupled weight decay."""
    muon_momentum: float = 0.95
    """Muon momentum in [0, 1)."""
    muon_nesterov: bool = True
    """Nesterov-style momentum for Muon."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_coefficients: str | list[float] = "quintic"
    """Newton-Schulz polynomial: ``quintic`` (3.4445, -4.7750, 2.0315), ``polar_express``
    (a per-iteration schedule), or an explicit list of 3 (or 3 x ns_steps) floats."""
    muon_eps: float = 1e-7
    """Epsilon of the Frobenius pre-normalization before Newton-Schulz."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """Shape-dependent lr scale: ``original`` = sqrt(max(1, rows/cols)) (torch.optim.Muon's
    default), ``match_rms_adamw`` = 0.2 * sqrt(max(rows, cols))."""
    muon_ns_dtype: Literal["auto", "fp16", "bf16", "fp32", "fp64"] = "auto"
    """Newton-Schulz matmul dtype: auto = fp16 on CUDA (3-7x more accurate than bf16,
    benchmarks/results/gram_restarts.md; overflow-free after normalization), fp32 on CPU (~6000x
    closer to a float64 evaluation than bf16, benchmarks/results/optimizer_cpu.md). On CPUs with
    native bf16 GEMM (AVX512-BF16, AMX) ``bf16`` is faster. ``fp64`` works everywhere (PyTorch path
    on CUDA)."""
    muon_conv: bool = False
    """Also train convolution kernels larger than 1x1 with Muon, each flattened to
    ``(out, in * kh * kw)`` (pointwise 1x1 convolutions always go to Muon: they are a Linear over
    channels; grouped and depthwise ones always stay on AdamW). Requires ``name: muon``."""
    muon_plus: bool = False
    """Muon+: normalize rows then columns after orthogonalization (requires name: muon)."""
    muon_norm_eps: float = 1e-8
    """Epsilon inside the square root of the Muon+ normalization."""
    cuda_graph: Literal["off", "on", "auto"] = "off"
    """The Muon step as one captured CUDA graph, replayed each step (CUDA only; off on CPU and
    under ``train.compile`` with one log line). ``auto`` times 3 eager steps against 3 replays
    after the warm-up and keeps the faster. Off by default until a GPU run has measured it
    (benchmarks/gpu_check.sh); docs/optimizers.md lists what invalidates a capture."""
    cautious: bool = False
    """Cautious masking: drop update entries whose sign disagrees with the gradient (AdamW: the
    Adam direction; Muon: the orthogonalized update). Applies to both branches."""
    cautious_rescale: bool = True
    """Rescale kept entries by numel / (kept + 1) as in the Cautious Optimizers paper."""

    def validate(self, p: str = "optimizer") -> None:
        _check_choices(self, p)  # build_optimizer validates this section on its own
        _check_finite(self, p)
        for key in ("lr", "eps", "muon_lr", "muon_eps", "muon_norm_eps"):
            value = getattr(self, key)
            _check(value > 0, f"{p}.{key}", f"must be > 0, got {value}")
        for key in ("weight_decay", "muon_weight_decay"):
            value = getattr(self, key)
            _check(value >= 0, f"{p}.{key}", f"must be >= 0, got {value}")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), f"{p}.betas",
               f"must be two values in [0, 1), got {list(self.betas)}")
        if self.grad_clip is not None:
            _check(self.grad_clip > 0, f"{p}.grad_clip",
                   f"must be > 0 or null, got {self.grad_clip}")
        _check(0.0 <= self.muon_momentum < 1.0, f"{p}.muon_momentum",
               f"must be in [0, 1), got {self.muon_momentum}")
        _check(self.muon_ns_steps > 0, f"{p}.muon_ns_steps",
               f"must be > 0, got {self.muon_ns_steps}")
        coeffs = self.muon_coefficients
        if isinstance(coeffs, str):
            _check(coeffs in ("quintic", "polar_express"), f"{p}.muon_coefficients",
                   f"must be 'quintic', 'polar_express' or a list of floats, got {brief(coeffs)}")
        else:
            _check(len(coeffs) in (3, 3 * self.muon_ns_steps), f"{p}.muon_coefficients",
                   f"a list must hold 3 or 3 x muon_ns_steps={3 * self.muon_ns_steps} floats, "
                   f"got {len(coeffs)}")
        _check(not self.muon_plus or self.name == "muon", f"{p}.muon_plus",
               f"requires optimizer.name: muon (got name: {self.name}); Muon+ normalizes "
               "orthogonalized updates, which AdamW does not produce")
        _check(self.cuda_graph == "off" or self.name == "muon", f"{p}.cuda_graph",
               f"requires optimizer.name: muon (got name: {self.name}); it captures the Muon "
               "step (AdamW's fused step is already a few launches)")
        _check(not self.muon_conv or self.name == "muon", f"{p}.muon_conv",
               f"requires optimizer.name: muon (got name: {self.name}); it routes convolution "
               "kernels to Muon")


@dataclass
class SchedulerConfig:
    """Learning-rate schedule, applied to every parameter group (keeps the Muon/AdamW ratio)."""

    name: Literal["cosine", "constant"] = "cosine"
    """``cosine`` (linear warmup, cosine decay to min_lr_ratio) or ``constant`` (warmup, flat)."""
    warmup_steps: int = 100
    """Linear warmup length in optimizer steps."""
    max_steps: int | None = None
    """Horizon of the cosine decay; None = ``run.max_steps``."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (cosine only), in [0, 1]."""

    def validate(self, p: str = "scheduler") -> None:
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps",
               f"must be >= 0, got {self.warmup_steps}")
        if self.max_steps is not None:
            _check(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"{p}.min_lr_ratio",
               f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class PrecisionConfig:
    """Numeric precision of forward/backward (parameters and optimizer state stay fp32)."""

    mode: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """``auto``: bf16 on CUDA that supports it, fp16 + GradScaler on other CUDA, fp32 on CPU.
    An explicit mode the device cannot run falls back with a warning."""

    def validate(self, p: str = "precision") -> None:
        pass


@dataclass
class CheckpointConfig:
    """Atomic, resumable checkpoints in ``<run dir>/<directory>``."""

    enabled: bool = True
    """Write checkpoints."""
    directory: str = "checkpoints"
    """Folder, relative to the run directory."""
    every_steps: int = 500
    """Save every N optimizer steps (and at the end of the run)."""
    keep_last: int | None = 3
    """Keep the newest N checkpoints; None keeps all."""
    resume: bool = False
    """Resume from the newest valid checkpoint (same as ``train --resume``)."""
    every_seconds: float | None = None
    """Also save when this many seconds passed since the last save, at the next step boundary
    (a wall-clock bound on lost work, e.g. under a scheduler's time limit); None = steps only."""

    def validate(self, p: str = "checkpoint") -> None:
        _check(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        if self.every_seconds is not None:
            _check(self.every_seconds > 0, f"{p}.every_seconds",
                   f"must be > 0 or null, got {self.every_seconds}")
        if self.keep_last is not None:
            _check(self.keep_last > 0, f"{p}.keep_last",
                   f"must be > 0 or null, got {self.keep_last}")


#: Signals a run turns into "save at the next step boundary, then exit" by default: SLURM's
#: preemption and ``--signal=USR1@90``, Kubernetes' and systemd's stop, Ctrl-C, a closed
#: terminal (SIGHUP), a CPU-time limit (SIGXCPU) and the user signal left for schedulers.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")


@dataclass
class TrainConfig:
    """What the training loop does when something goes wrong: a non-finite loss, a signal."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient norm. ``stop``: end the run with one line naming the step;
    nothing non-finite is saved (checked on the device, read at log steps and before every
    save: no extra host sync). ``skip``: drop that step's update and go on; this reads one flag
    per step (a host sync per step, as GradScaler's own skip does). fp16 steps that GradScaler
    skips are normal and count as neither."""
    max_skipped_steps: int = 10
    """With ``on_nonfinite: skip``: this many non-finite steps in a row stop the run anyway (a
    diverged run, not a bad batch)."""
    preemption_signals: list[str] = field(default_factory=lambda: list(PREEMPTION_SIGNALS))
    """Signals that save a checkpoint at the next step boundary and exit with 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT); a second one exits at once. [] keeps Python's
    default handling."""
    requeue: bool = False
    """Inside a SLURM job (``SLURM_JOB_ID`` set): after a preemption save, run ``scontrol
    requeue $SLURM_JOB_ID`` and exit 0, so the job comes back and resumes (with
    ``checkpoint.resume: true``)."""

    def validate(self, p: str = "train") -> None:
        _check(self.max_skipped_steps > 0, f"{p}.max_skipped_steps",
               f"must be > 0, got {self.max_skipped_steps}")
        import signal as _signal

        for name in self.preemption_signals:
            ok = isinstance(name, str) and name.startswith("SIG") and hasattr(_signal, name) \
                and name not in ("SIGKILL", "SIGSTOP") and not name.startswith("SIG_")
            _check(ok, f"{p}.preemption_signals", f"{str(name)[:40]!r} is not a signal this "
                   "machine can catch; valid: " + ", ".join(PREEMPTION_SIGNALS) + ", ...")


@dataclass
class LoggingConfig:
    """Console lines, metrics.jsonl (always written in the run directory) and integrations."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the ``speedtronic`` loggers."""
    every_steps: int = 10
    """Print and record train metrics every N optimizer steps."""
    heartbeat_seconds: float = 30.0
    """Print a "still running" line when nothing was printed for this many seconds (a long
    first step, eval or save); 0 = off."""
    file: str | None = None
    """Also write the text log to this file."""
    progress_bar: bool | None = None
    """tqdm progress bar; None = only when stdout is a terminal."""
    tensorboard: bool = False
    """Write TensorBoard scalars to ``<run dir>/tensorboard`` (needs the ``tensorboard`` extra)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the ``wandb`` extra)."""
    wandb_project: str | None = None
    """W&B project name; None = ``speedtronic``."""

    def validate(self, p: str = "logging") -> None:
        _check(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        _check(self.heartbeat_seconds >= 0, f"{p}.heartbeat_seconds",
               f"must be >= 0 (0 = off), got {self.heartbeat_seconds}")


@dataclass
class ShapeValidationConfig:
    """Startup table of GEMM dimensions that are not multiples of the hardware's alignment."""

    enabled: bool = True
    """Run the check at startup (warnings only; never changes the model)."""
    alignment: Literal["auto", "none"] | int = "auto"
    """``auto``: 64 for bf16/fp16 on CUDA sm_80+ (128-byte tiles), 8 on older CUDA, 4 for
    fp32/tf32, 16 for fp8; ``none`` disables the check on every device; or a positive int."""
    check_batch: bool = True
    """Check micro-batch x sequence length (the GEMM M dim); a suggested micro-batch always
    divides ``data.target_batch_size``."""
    check_sequence: bool = True
    """Check the sequence length ``data.block_size`` (an inner dim of attention)."""
    check_model: bool = True
    """Check Linear / Embedding / attention dims."""
    check_vocab: bool = True
    """Check the vocabulary size (embedding rows and output head)."""
    warn_on_cpu: bool = False
    """Also warn on CPU (alignment matters little there)."""

    def validate(self, p: str = "shape_validation") -> None:
        if isinstance(self.alignment, int):
            _check(self.alignment > 0, f"{p}.alignment",
                   f"must be auto, none or a positive int, got {self.alignment}")


@dataclass
class DistributedConfig:
    """DiLoCo-style asynchronous multi-node training over a shared store."""

    enabled: bool = False
    """Turn DiLoCo on."""
    role: Literal["master", "worker"] = "worker"
    """``master`` applies outer steps and publishes globals; ``worker`` trains and sends deltas."""
    node_id: str | None = None
    """This node's id (letters, digits, ``-_.``); None = hostname-pid."""
    store: str | None = None
    """Store URL: ``file:///path``, ``s3://bucket/prefix`` or ``hf://user/repo``. Credentials
    come only from the environment and are never written to disk."""
    inner_steps: int = 500
    """H: inner optimizer steps between deltas."""
    poll_interval: float = 60.0
    """Seconds between a worker's background polls of the global pointer (and the master's
    listings when ``master_poll_interval`` is null). Keep it under ~1/4 of a round: a worker
    warns when it is longer. About 1/20 of a round measured better still: a poll is one small
    GET, and a global is downloaded only once per new version (bench_diloco_async.md, M=4,
    outer 0.7/0.5: 1.028x -> 1.012x lock-step)."""
    master_poll_interval: float | None = None
    """Seconds between the master's listings of new deltas; null = ``poll_interval`` capped at
    1 s. The master should apply a delta within a small part of a round: in the simulated
    schedule (bench_diloco_async.md, M=3) listing once per round ended 6.3% above lock-step
    DiLoCo, every 1/20 of a round 3.3% (without carry_lookahead)."""
    grace_window: float = 0.0
    """Seconds the master waits after a listing finds new deltas, before aggregating, so that
    near-simultaneous arrivals land in one update (0 = apply at once)."""
    consistent_base: bool = True
    """At each round boundary install ``G - c * (own deltas G does not hold yet)``, with ``c``
    the total weight the master gives a delta (published in the pointer with each session's
    high-water mark), instead of a G missing this worker's own recent rounds
    (docs/diloco.md#consistent-base)."""
    carry_lookahead: float = 0.25
    """Carry ``c * (1 + carry_lookahead * (M - 1))`` instead of ``c``: the other workers' rounds
    in flight, which the global also lacks, extrapolated from this worker's own delta (workers'
    deltas point the same way). 0.25: each other worker is half a round into its own, and that
    work lands halfway through this worker's next round. 0 = the exact algebra. In the
    simulated schedule 0.25 beat 0 in every pair (bench_diloco_async.md: M=3 +1.6%/+0.3%
    above lock-step against +3.3%/+1.1%, M=4 +2.7% against +5.3%)."""
    rebase_within_round: bool = True
    """With ``consistent_base``: a newer global that arrives mid-round is absorbed at once
    (the weights move by new base - old base, the round's own progress kept) instead of at the
    next boundary, so the other workers' deltas reach this worker within a poll. One pass over
    the parameters per new global (about M per round). In the simulated schedule (M=4, 1200
    steps, bench_diloco_async.md) it took the mean over lock-step DiLoCo from 1.027 to 1.023
    with the master listing every 1/20 round, and from 1.052 to 1.034 listing once a round."""
    max_unapplied: int = 4
    """Most own deltas a worker keeps for its consistent base (each a host fp32 copy of the
    model). Beyond it, two deltas that both still wait for the store are sent as one; when the
    master is what lags, the worker waits up to ``unapplied_wait`` and then stops carrying the
    oldest, with a warning."""
    unapplied_wait: float = field(default=30.0, metadata=_INF_IS_NO_LIMIT)
    """Seconds a worker waits at a boundary when ``max_unapplied`` deltas are outstanding."""
    adaptive_inner_steps: bool = False
    """Scale this worker's H by its measured speed: ``inner_steps * fastest / own`` seconds per
    step (the fastest recent worker's, published by the master), at least ``inner_steps / 8``,
    so a slow worker's rounds last as long as the others' and its deltas are not staler."""
    push_pull_timeout: float = 0.0
    """Push-pull: wait up to this many seconds at each boundary for a global that holds this
    worker's delta, and install it without carry (Liu et al. 2024); 0 = off. Off by default:
    it idles the worker while the master applies, and ended above the carry in the simulated
    schedule (bench_diloco_async.md, M=3: 1.404 against 1.393)."""
    outer_lr: float = 0.7
    """Outer learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum in [0, 1)."""
    outer_optimizer: Literal["eager_nesterov", "delayed_nesterov", "nesterov", "sgd"] = \
        "eager_nesterov"
    """Master update rule. ``eager_nesterov`` (default): each arriving delta's own Nesterov share
    ``lr (1 + eager_share * mu) / M`` applied at once, the rest of it, the old momentum's share
    and the refresh once per round of ``expected_workers`` deltas - ``nesterov`` when a round
    arrives together; with arrivals spread over the round it measured closer to lock-step than
    delayed Nesterov (M=4, 1200 steps, share 0.5: 1.011-1.019x against 1.022-1.023x;
    docs/diloco.md#outer-optimizer).
    ``delayed_nesterov`` (Liu et al. 2024): momentum-free steps as deltas arrive, the whole
    momentum step at the round's last arrival; the same round total.
    ``nesterov``: torch SGD-Nesterov on the mean of each poll's deltas (synchronous DiLoCo).
    ``sgd``: momentum-free, each delta weighted 1/M (outer_lr 1 = plain parameter averaging)."""
    eager_share: float = 0.5
    """``eager_nesterov`` only: the part of each delta's momentum share ``lr mu / M`` applied on
    arrival, the rest at the round's close (1: all of it; 0: delayed Nesterov; every value gives
    the same round total). 0.5: in the simulated schedule 1 had the best mean but one bad
    timing seed at M=3 (1.030x lock-step, a 3.3% spread), 0.5 kept every pair within 1.02x on
    the mean and 2% in spread (docs/diloco.md#outer-optimizer)."""
    expected_workers: int | None = None
    """Deltas per round (M) for delayed Nesterov, and how many finished nodes a master waits
    for before it stops; None = nodes that sent a delta recently / every node it has seen."""
    max_staleness: int = 8
    """Master drops (quarantines) deltas whose base is more than this many versions older than
    the version at which the master first listed them (time a delta waits in the master's own
    queue does not count)."""
    staleness_weighting: Literal["none", "inverse", "inverse_sqrt"] = "none"
    """Scale of a delta s versions stale: 1, 1/(1+s) or 1/sqrt(1+s)."""
    max_delta_norm: float | None = None
    """Master rejects deltas whose L2 norm exceeds this (None = no bound)."""
    min_deltas: int = 1
    """Master publishes only when at least this many valid deltas are waiting."""
    max_deltas_per_round: int = 16
    """Master applies at most this many deltas per published version (the rest wait for the
    next round): a backlog after an outage is worked off in bounded memory, one delta at a time
    in memory beside the running sum."""
    max_object_mb: float | None = None
    """Largest delta or global a node downloads; larger objects are quarantined unread. None =
    1.25x the model's fp32 size plus 1 MiB (what a legitimate object can be)."""
    compression: Literal["none", "bf16", "int8"] = "none"
    """Delta wire format: fp32, bf16 (2x smaller) or int8 with per-chunk scales (4x smaller);
    the quantization error is kept and sent with the next delta."""
    reset_inner_optimizer: bool = True
    """Reset the inner optimizer state after each confirmed delta upload."""
    start_timeout: float = field(default=600.0, metadata=_INF_IS_NO_LIMIT)
    """Seconds a node waits at start for the first published global (``.inf`` = no limit)."""
    shutdown_timeout: float = field(default=120.0, metadata=_INF_IS_NO_LIMIT)
    """Seconds a node waits at the end for its last deltas to upload (``.inf`` = no limit)."""
    final_sync_timeout: float = field(default=0.0, metadata=_INF_IS_NO_LIMIT)
    """Seconds a worker waits at the end for a global containing its last delta and installs
    it (0 = end with local weights, ``.inf`` = no limit)."""
    master_idle_timeout: float = field(default=600.0, metadata=_INF_IS_NO_LIMIT)
    """A master node keeps aggregating after its own training until every node it has seen is
    done, or this many seconds pass without a new delta (``.inf`` = no limit)."""
    lease_ttl: float = 300.0
    """Seconds without renewal after which a standby master takes the lease over."""
    keep_versions: int = 4
    """Published globals kept in the store (older ones and orphans are deleted)."""
    delete_processed: bool = True
    """Master deletes deltas once the version that consumed (or rejected) them is published."""
    shard: int = 0
    """This node's data shard: give every node its own so nodes train on disjoint samples."""
    num_shards: int = 1
    """Number of data shards (>= number of nodes for disjoint data)."""
    endpoint_url: str | None = None
    """S3 endpoint (MinIO, R2, HF buckets' S3 gateway); None = AWS_ENDPOINT_URL or AWS."""

    @property
    def master_poll(self) -> float:
        """The master's listing interval in seconds (``master_poll_interval`` or
        ``poll_interval``)."""
        if self.master_poll_interval is None:
            return min(self.poll_interval, 1.0)
        return self.master_poll_interval

    def validate(self, p: str = "distributed") -> None:
        if self.enabled:
            _check(self.store is not None, f"{p}.store",
                   "is required when distributed.enabled is true (file:///..., s3://..., hf://...)")
        if self.node_id is not None:
            _check(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.node_id) is not None,
                   f"{p}.node_id", f"must be 1-64 of [A-Za-z0-9_.-] not starting with '.', "
                   f"got {brief(self.node_id)}")
        _check(self.inner_steps > 0, f"{p}.inner_steps", f"must be > 0, got {self.inner_steps}")
        _check(self.poll_interval > 0, f"{p}.poll_interval", "must be > 0")
        if self.master_poll_interval is not None:
            _check(self.master_poll_interval > 0, f"{p}.master_poll_interval",
                   "must be > 0 or null")
        _check(self.grace_window >= 0, f"{p}.grace_window", "must be >= 0")
        _check(self.max_unapplied >= 1, f"{p}.max_unapplied", "must be >= 1")
        _check(0 <= self.carry_lookahead <= 1, f"{p}.carry_lookahead", "must be in [0, 1]")
        _check(0 <= self.eager_share <= 1, f"{p}.eager_share",
               f"must be in [0, 1], got {self.eager_share}")
        _check(self.unapplied_wait >= 0, f"{p}.unapplied_wait", "must be >= 0")
        _check(self.push_pull_timeout >= 0, f"{p}.push_pull_timeout", "must be >= 0")
        _check(self.outer_lr > 0, f"{p}.outer_lr", f"must be > 0, got {self.outer_lr}")
        _check(0.0 <= self.outer_momentum < 1.0, f"{p}.outer_momentum",
               f"must be in [0, 1), got {self.outer_momentum}")
        if self.expected_workers is not None:
            _check(self.expected_workers > 0, f"{p}.expected_workers", "must be > 0 or null")
        _check(self.max_staleness >= 0, f"{p}.max_staleness", "must be >= 0")
        if self.max_delta_norm is not None:
            _check(self.max_delta_norm > 0, f"{p}.max_delta_norm", "must be > 0 or null")
        _check(self.max_deltas_per_round >= max(1, self.min_deltas),
               f"{p}.max_deltas_per_round", f"must be >= 1 and >= min_deltas={self.min_deltas} "
               f"(a round could never publish), got {self.max_deltas_per_round}")
        if self.max_object_mb is not None:
            _check(self.max_object_mb > 0, f"{p}.max_object_mb",
                   f"must be > 0, got {self.max_object_mb}")
        _check(self.min_deltas >= 1, f"{p}.min_deltas", "must be >= 1")
        for key in ("start_timeout", "shutdown_timeout", "lease_ttl"):
            _check(getattr(self, key) > 0, f"{p}.{key}", "must be > 0")
        for key in ("final_sync_timeout", "master_idle_timeout"):
            _check(getattr(self, key) >= 0, f"{p}.{key}", "must be >= 0")
        _check(self.lease_ttl > 2 * self.master_poll, f"{p}.lease_ttl",
               f"must exceed 2 x the master's poll interval={self.master_poll} (the master "
               f"renews once per poll), got {self.lease_ttl}")
        _check(self.keep_versions >= 2, f"{p}.keep_versions", "must be >= 2 (nodes may still "
               "be downloading the previous version)")
        _check(0 <= self.shard < self.num_shards, f"{p}.shard",
               f"must be in [0, num_shards={self.num_shards}), got {self.shard}")
        if self.store is not None:
            _check(self.store.split("://", 1)[0] in ("file", "s3", "hf"), f"{p}.store",
                   f"must be file:///path, s3://bucket/prefix or hf://user/repo, "
                   f"got scheme {brief(self.store.split('://', 1)[0])}")


@dataclass
class DataParallelConfig:
    """``torchrun`` data parallelism (DDP): read only when the run is started by torchrun with
    more than one process; ``data.target_batch_size`` is then the global batch."""

    timeout_s: float = 600.0
    """Seconds any collective may wait: a rank that died or hangs ends the job with an error
    after this long instead of a silent wait (torchrun itself stops the others when a rank
    exits with an error)."""
    shard_muon: bool = True
    """Each rank orthogonalizes 1/world of the Muon matrices and all-gathers the results
    (bitwise equal to every rank doing all of them). Newton-Schulz FLOPs per rank drop to
    1/world; the all-gather adds (world-1)/world of the Muon parameters' bytes on top of DDP's
    gradient all-reduce."""
    zero1: bool = False
    """ZeRO stage 1 (torch's ``ZeroRedundancyOptimizer``): each rank keeps the optimizer state
    of about 1/world of the parameters, steps only those (its Newton-Schulz too, so
    ``shard_muon`` is implied) and broadcasts them after the step. Saves ~(world-1)/world of
    the optimizer state (Muon: 4 bytes per matrix element, AdamW: 8 per element) per rank and
    costs one parameter broadcast per step, about half of DDP's all-reduce traffic again:
    for a model whose state does not fit, not for speed. Checkpoints keep the plain format
    (a run resumes with it on or off). speedtronic/distributed/zero.py has the details."""
    reduce_scatter_muon: bool = False
    """Each Muon matrix gets one owning rank: its gradients are reduce-scattered to the owner
    (they leave DDP's all-reduce), which alone keeps its momentum and steps it, and the updated
    matrices are all-gathered. The step sends DDP's all-reduce bytes (not 1.17x, as
    ``shard_muon``), every Muon pass (not only Newton-Schulz) runs on 1/world of the matrices,
    Muon momentum per rank drops to ~1/world, for one extra fp32 buffer of the Muon
    parameters. Supersedes ``shard_muon``; not combined with ``zero1``, ``fsdp``, fp16,
    ``optimizer.cuda_graph`` or torchft. speedtronic/distributed/
    muon_owners.py has the details."""
    find_unused_parameters: bool = False
    """DDP's search for parameters a forward did not use (costs a graph walk per step; turn on
    only for models with such parameters: DDP then says so in its error)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (torch's default): larger buckets mean fewer all-reduce
    launches, smaller ones start the communication earlier in backward."""
    fsdp: bool = False
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of DDP: every transformer block
    is one unit, the root another. Parameters, gradients and optimizer state are sharded, ~1/world
    of each per rank; costs one all-gather of each unit's parameters in forward and again in
    backward, and a reduce-scatter of its gradients (DDP: one all-reduce). Muon all-gathers each
    matrix's fp32 blend for Newton-Schulz and splits that work over the ranks itself, so
    ``shard_muon`` does not apply. Checkpoints keep the plain one-process format. Not combined
    with ``zero1``, ``optimizer.cuda_graph``, ``ooo_backprop``, torchft, hierarchical DiLoCo,
    ``compile: true`` or fp16 (docs/scaling.md#fsdp2)."""

    def validate(self, p: str = "data_parallel") -> None:
        _check(self.timeout_s > 0, f"{p}.timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        _check(self.bucket_cap_mb > 0, f"{p}.bucket_cap_mb",
               f"must be > 0 MiB, got {self.bucket_cap_mb}")


@dataclass
class TorchftConfig:
    """Fault-tolerant replica groups on torchft (``pip install 'speedtronic[ft]'``): each group
    is one ``speedtronic train`` process or one torchrun job (DDP inside the group); a torchft
    Lighthouse admits the groups alive at each step (``ddp``) or round (``diloco``), a group
    that dies is dropped and one that (re)starts is healed from a live peer over HTTP.
    docs/scaling.md#torchft has the commands."""

    mode: Literal["off", "ddp", "diloco"] = "off"
    """``ddp``: gradients averaged over the live groups every step, a step committed only when
    every group in the quorum finished it. ``diloco``: synchronous DiLoCo, ``inner_steps``
    local steps, then the groups' pseudo-gradients are averaged for one outer Nesterov step."""
    lighthouse: str | None = None
    """The Lighthouse's address, e.g. ``http://10.0.0.1:29510``; null = ``$TORCHFT_LIGHTHOUSE``."""
    replica_group: int | None = None
    """This group's id, 0..replica_groups-1 (its data shard and run sub-directory); null =
    ``$REPLICA_GROUP_ID``."""
    replica_groups: int = 2
    """Groups the job is started with: the number of data shards, and the bound for
    ``min_replica_size``."""
    min_replica_size: int = 1
    """Fewest groups that may commit a step. A group alone with fewer live peers never commits
    (torchft raises nothing): here it stops after ``max_commit_failures`` with an error."""
    max_commit_failures: int = 50
    """Consecutive steps that may fail to commit before the run ends with an error."""
    timeout_s: float = 60.0
    """Seconds a gradient all-reduce, a commit vote or a healing transfer may take."""
    quorum_timeout_s: float = 300.0
    """Seconds a group waits for a quorum (the Lighthouse's ``--min_replicas`` groups)."""
    manager_port: int = 0
    """Port of this group's torchft Manager server (0 = any free port). It listens on every
    interface (torchft binds ``[::]``); the healing HTTP server does too."""
    hostname: str | None = None
    """Address the other groups reach this one at (its Manager and healing server); null = this
    machine's host name. Tests use 127.0.0.1."""
    inner_steps: int = 100
    """``diloco``: local optimizer steps between outer steps."""
    outer_lr: float = 0.7
    """``diloco``: the outer Nesterov-SGD learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """``diloco``: the outer Nesterov momentum."""

    def validate(self, p: str = "torchft") -> None:
        if self.mode == "off":
            return
        _check(self.replica_groups >= 1, f"{p}.replica_groups",
               f"must be >= 1, got {self.replica_groups}")
        _check(1 <= self.min_replica_size <= self.replica_groups, f"{p}.min_replica_size",
               f"must be in 1..replica_groups={self.replica_groups}, got "
               f"{self.min_replica_size}: with fewer groups than that alive no step can ever "
               "commit")
        _check(self.replica_group is not None, f"{p}.replica_group",
               "is required with torchft.mode on (or set REPLICA_GROUP_ID), e.g. 0 for the "
               "first group")
        assert self.replica_group is not None
        _check(0 <= self.replica_group < self.replica_groups, f"{p}.replica_group",
               f"must be in [0, replica_groups={self.replica_groups}), got "
               f"{self.replica_group}")
        _check(self.lighthouse is not None, f"{p}.lighthouse",
               "is required with torchft.mode on (or set TORCHFT_LIGHTHOUSE), e.g. "
               "http://127.0.0.1:29510 (start it with: torchft_lighthouse --min_replicas 1 "
               "--bind [::]:29510)")
        _check(self.max_commit_failures >= 1, f"{p}.max_commit_failures", "must be >= 1")
        for key in ("timeout_s", "quorum_timeout_s", "outer_lr"):
            _check(getattr(self, key) > 0, f"{p}.{key}", "must be > 0")
        _check(0 <= self.manager_port < 65536, f"{p}.manager_port", "must be in 0..65535")
        _check(self.inner_steps >= 1, f"{p}.inner_steps", "must be >= 1")
        _check(0.0 <= self.outer_momentum < 1.0, f"{p}.outer_momentum", "must be in [0, 1)")


_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "data_parallel": DataParallelConfig,
    "torchft": TorchftConfig,
    "shape_validation": ShapeValidationConfig,
}


@dataclass
class SpeedtronicConfig:
    """The whole run: one section per concern plus four root switches."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    torchft: TorchftConfig = field(default_factory=TorchftConfig)
    shape_validation: ShapeValidationConfig = field(default_factory=ShapeValidationConfig)
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with ``torch.compile`` (falls back to eager, with the reason logged).
    ``auto``: on for CUDA runs of at least 2000 steps, where compiling pays back (an 85M GPT on
    an H200 compiled in ~24 s and then stepped 50 -> 29 ms, a break-even near 1150 steps,
    benchmarks/results/h200_first_run_2026-11-30.md); off on CPU and for shorter runs."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (same as model.gradient_checkpointing)."""
    ooo_backprop: bool = False
    """Out-of-order backprop: defer weight gradients to side CUDA streams (opt-in). It stays on
    only if a trial at the start of the run measures it faster (see ``ooo_trial_pairs``)."""
    ooo_streams: int = 4
    """Side streams for out-of-order backprop, 1..8."""
    ooo_trial_pairs: int = 4
    """With ``ooo_backprop``: the first ``2 * (1 + n)`` steps alternate deferral on and off (every
    run, resumed ones included); it stays on only if its median step is >= 1% shorter. An even
    n balances a drift over the trial. 0 keeps it on without measuring; 0..100."""

    def finalize(self) -> SpeedtronicConfig:
        """Fill cross-section defaults, then validate every section. Returns self."""
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.target_batch_size is None:  # one micro-batch per torchrun process
            self.data.target_batch_size = self.data.micro_batch_size * _torchrun_world_size()
        if self.data.seed is None:
            self.data.seed = self.run.seed
        if self.model.vocab_size is None and self.data.tokenizer is None \
                and self.data.tokens_path is None:
            self.model.vocab_size = 256  # byte-level and synthetic data; the rest follows the data
        if self.scheduler.max_steps is None:
            self.scheduler.max_steps = self.run.max_steps
        self._name_diloco_run()
        self._torchft_from_env()
        if self.gradient_checkpointing or self.model.gradient_checkpointing:
            self.gradient_checkpointing = self.model.gradient_checkpointing = True
        _check_finite(self)  # first: range rules below read inf as a valid large value
        _check_choices(self, "")
        for name in _SECTIONS:
            _check_choices(getattr(self, name), name)
            getattr(self, name).validate(name)
        _check(1 <= self.ooo_streams <= 8, "ooo_streams",
               f"must be in 1..8, got {self.ooo_streams}")
        _check(0 <= self.ooo_trial_pairs <= 100, "ooo_trial_pairs",
               f"must be in 0..100, got {self.ooo_trial_pairs}")
        _check(self.data.block_size <= self.model.max_seq_len, "data.block_size",
               f"must be <= model.max_seq_len={self.model.max_seq_len}, got {self.data.block_size}")
        return self

    def _name_diloco_run(self) -> None:
        """``{node_id}`` in ``run.name`` becomes ``distributed.node_id`` (the host name when
        unset), and a DiLoCo run left at the default name is ``diloco-<role>-<node id>``: two
        workers started from one folder with the documented command must not share a run
        directory (the second is refused by the run lock; before it, it moved the first's
        folder aside)."""
        if "{node_id}" not in self.run.name and not (
                self.distributed.enabled and self.run.name == RunConfig.name):
            return
        import socket

        node = self.distributed.node_id or re.sub(r"[^A-Za-z0-9_.-]", "-",
                                                  socket.gethostname())[:40] or "node"
        if "{node_id}" in self.run.name:
            self.run.name = self.run.name.replace("{node_id}", node)
        else:
            self.run.name = f"diloco-{self.distributed.role}-{node}"

    def _torchft_from_env(self) -> None:
        """torchft's launch conventions fill what the config leaves null: the group id from
        ``REPLICA_GROUP_ID``, the Lighthouse from ``TORCHFT_LIGHTHOUSE``."""
        ft = self.torchft
        if ft.mode == "off":
            return
        if ft.replica_group is None and os.environ.get("REPLICA_GROUP_ID", "").strip():
            raw = os.environ["REPLICA_GROUP_ID"].strip()
            _check(raw.isdigit(), "torchft.replica_group",
                   f"REPLICA_GROUP_ID={raw!r} is not a group number (0, 1, ...)")
            ft.replica_group = int(raw)
        if ft.lighthouse is None and os.environ.get("TORCHFT_LIGHTHOUSE"):
            ft.lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        target = self.data.target_batch_size or self.data.micro_batch_size
        return target // self.data.micro_batch_size

    @property
    def run_dir(self) -> Path:
        """``run.output_dir / run.name`` (``.../replica_group_<g>`` for a torchft group: the
        groups of one job may share a folder and a config)."""
        base = Path(self.run.output_dir) / self.run.name
        if self.torchft.mode != "off" and self.torchft.replica_group is not None:
            return base / f"replica_group_{self.torchft.replica_group}"
        return base

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """A JSON/YAML-safe nested dict; with ``redact``, secrets are replaced by ``<redacted>``."""
        out = redaction.to_plain(self)
        return redaction.redact(out) if redact else out

    def save(self, path: str | Path) -> None:
        """Write the resolved config (always redacted) as YAML (.yaml/.yml) or JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict(redact=True)
        if path.suffix in (".yaml", ".yml"):
            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        path.write_text(text, encoding="utf-8")


Config = SpeedtronicConfig
