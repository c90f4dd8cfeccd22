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
  timeouts marked ``INF_IS_NO_LIMIT`` take ``.inf``) and every range rule.

The scaling-out sections (``distributed``, ``data_parallel``, ``torchft``) live in
:mod:`.scaling` (re-exported here), the checks every section shares in :mod:`.rules`.

Field docstrings (the string under each field) are the reference documentation for each key.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from ..errors import ConfigError, brief
from . import redaction
from .rules import byte_text_file, check_choices, check_finite, require, torchrun_world_size
from .scaling import DataParallelConfig, DistributedConfig, TorchftConfig

#: Files every run writes in its run directory: no checkpoint folder may be made under them.
RUN_FILES = ("config.yaml", "metrics.jsonl", "loss.png")
#: Upper bound of ``run.num_threads``: above the core count of any host we know of, below what
#: libgomp and torch.set_num_threads survive (20000 failed to create threads, 100000 crashed).
MAX_THREADS = 1024

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
    "DataParallelConfig",
    "TorchftConfig",
    "SpeedtronicConfig",
]


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
        require(bool(self.name.strip()) and "/" not in self.name and self.name not in (".", ".."),
               f"{p}.name", f"must be a non-empty name without '/', got {brief(self.name)}")
        require(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        # torch.manual_seed takes a signed or unsigned 64-bit value and overflows past it
        require(-2**63 <= self.seed < 2**64, f"{p}.seed",
               f"must fit in 64 bits (-2**63 <= seed < 2**64), got {str(self.seed)[:40]}")
        if self.num_threads is not None:
            # 100000 segfaulted inside torch.set_num_threads, 20000 failed in libgomp
            require(0 < self.num_threads <= MAX_THREADS, f"{p}.num_threads",
                   f"must be in [1, {MAX_THREADS}] or null (= torch's default), got "
                   f"{str(self.num_threads)[:40]}")
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, f"{p}.peak_tflops",
                   f"must be > 0 or null, got {self.peak_tflops}")
        require(self.eval_every >= 0, f"{p}.eval_every", f"must be >= 0, got {self.eval_every}")
        require(self.eval_batches > 0, f"{p}.eval_batches", f"must be > 0, got {self.eval_batches}")
        require(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device) is not None, f"{p}.device",
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
                require(value > 0, f"{p}.{key}", f"must be > 0, got {value}")
        if self.n_kv_head is not None:
            require(self.n_kv_head > 0 and self.n_head % self.n_kv_head == 0, f"{p}.n_kv_head",
                   f"must be > 0 and divide n_head={self.n_head}, got {self.n_kv_head}")
        require(self.d_model % self.n_head == 0 and (self.d_model // self.n_head) % 2 == 0,
               f"{p}.d_model", f"must be divisible by n_head={self.n_head} with an even head "
               f"dim, got {self.d_model}")
        if self.d_ff is not None:
            require(self.d_ff > 0, f"{p}.d_ff", f"must be > 0, got {self.d_ff}")
        require(0.0 <= self.dropout < 1.0, f"{p}.dropout", f"must be in [0, 1), got {self.dropout}")
        require(self.rope_base > 0, f"{p}.rope_base", f"must be > 0, got {self.rope_base}")
        if self.hf_config is not None:
            require(self.name == "hf", f"{p}.hf_config", f"is only read with {p}.name: hf, got "
                   f"{p}.name {brief(self.name)}")
            require(isinstance(self.hf_config, (str, dict)), f"{p}.hf_config",
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
    """A Hugging Face dataset: a Hub name (online), a local folder of json/jsonl, csv or parquet
    files, or a ``save_to_disk`` copy (offline). Needs ``tokenizer``."""
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
        require(len(given) <= 1, p, f"set at most one of {', '.join(sources)} (got "
               + ", ".join(f"{k}={brief(v)}" for k, v in given.items()) + ")")
        if self.text_path is not None and self.tokenizer is None:
            byte_text_file(self.text_path)
        if self.tokenizer is not None:
            require(self.text_path is not None or self.hf_dataset is not None, f"{p}.tokenizer",
                   "needs a text source to tokenize: set data.text_path or data.hf_dataset "
                   "(for already tokenized ids use data.tokens_path alone)")
        require(self.hf_dataset is None or self.tokenizer is not None, f"{p}.hf_dataset",
               "needs data.tokenizer (a tokenizer.json path or a Hub name)")
        require(self.eval_tokens_path is None or self.tokens_path is not None,
               f"{p}.eval_tokens_path", "needs data.tokens_path")
        if self.prepare_workers is not None:
            require(self.prepare_workers > 0, f"{p}.prepare_workers",
                   f"must be > 0, got {self.prepare_workers}")
        require(self.stdlib_max_bytes > 0, f"{p}.stdlib_max_bytes", "must be > 0")
        require(0.0 < self.eval_fraction < 0.5, f"{p}.eval_fraction",
               f"must be in (0, 0.5), got {self.eval_fraction}")
        require(self.num_tokens > 0, f"{p}.num_tokens", f"must be > 0, got {self.num_tokens}")
        if self.block_size is not None:
            require(self.block_size > 0, f"{p}.block_size", f"must be > 0, got {self.block_size}")
        require(self.micro_batch_size > 0, f"{p}.micro_batch_size",
               f"must be > 0, got {self.micro_batch_size}")
        if self.target_batch_size is not None:
            require(self.target_batch_size >= self.micro_batch_size
                   and self.target_batch_size % self.micro_batch_size == 0,
                   f"{p}.target_batch_size", f"must be a positive multiple of "
                   f"micro_batch_size={self.micro_batch_size} (one optimizer step's samples), "
                   f"got {self.target_batch_size}")
        require(self.num_workers >= 0, f"{p}.num_workers", "must be >= 0")


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
    under ``compile`` with one log line). ``auto`` times 3 eager steps against 3 replays
    after the warm-up and keeps the faster. Off by default until a GPU run has measured it
    (benchmarks/gpu_check.sh); docs/optimizers.md lists what invalidates a capture."""
    cautious: bool = False
    """Cautious masking: drop update entries whose sign disagrees with the gradient (AdamW: the
    Adam direction; Muon: the orthogonalized update). Applies to both branches."""
    cautious_rescale: bool = True
    """Rescale kept entries by numel / (kept + 1) as in the Cautious Optimizers paper."""

    def validate(self, p: str = "optimizer") -> None:
        check_choices(self, p)  # build_optimizer validates this section on its own
        check_finite(self, p)
        for key in ("lr", "eps", "muon_lr", "muon_eps", "muon_norm_eps"):
            value = getattr(self, key)
            require(value > 0, f"{p}.{key}", f"must be > 0, got {value}")
        for key in ("weight_decay", "muon_weight_decay"):
            value = getattr(self, key)
            require(value >= 0, f"{p}.{key}", f"must be >= 0, got {value}")
        require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), f"{p}.betas",
               f"must be two values in [0, 1), got {list(self.betas)}")
        if self.grad_clip is not None:
            require(self.grad_clip > 0, f"{p}.grad_clip",
                   f"must be > 0 or null, got {self.grad_clip}")
        require(0.0 <= self.muon_momentum < 1.0, f"{p}.muon_momentum",
               f"must be in [0, 1), got {self.muon_momentum}")
        require(0 < self.muon_ns_steps < 100, f"{p}.muon_ns_steps",
               f"must be in [1, 100), got {str(self.muon_ns_steps)[:40]}")
        coeffs = self.muon_coefficients
        if isinstance(coeffs, str):
            require(coeffs in ("quintic", "polar_express"), f"{p}.muon_coefficients",
                   f"must be 'quintic', 'polar_express' or a list of floats, got {brief(coeffs)}")
        else:
            require(len(coeffs) in (3, 3 * self.muon_ns_steps), f"{p}.muon_coefficients",
                   f"a list must hold 3 or 3 x muon_ns_steps={3 * self.muon_ns_steps} floats, "
                   f"got {len(coeffs)}")
        require(not (self.fused and self.cautious), f"{p}.fused",
                "true cannot be combined with optimizer.cautious: true (torch's fused AdamW has "
                "no cautious mask); set fused: null or false")
        require(not self.muon_plus or self.name == "muon", f"{p}.muon_plus",
               f"requires optimizer.name: muon (got name: {self.name}); Muon+ normalizes "
               "orthogonalized updates, which AdamW does not produce")
        require(self.cuda_graph == "off" or self.name == "muon", f"{p}.cuda_graph",
               f"requires optimizer.name: muon (got name: {self.name}); it captures the Muon "
               "step (AdamW's fused step is already a few launches)")
        require(not self.muon_conv or self.name == "muon", f"{p}.muon_conv",
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
    """The cosine's floor as a fraction of the peak (cosine only), in [0, 1]: reached at step
    ``scheduler.max_steps``, one step after the last one a run of that length trains (which
    runs above it by sin^2(pi / (2 (max_steps - warmup))) of the range: 2.5e-6 with 1000 decay
    steps, 0.15 with 4)."""

    def validate(self, p: str = "scheduler") -> None:
        require(self.warmup_steps >= 0, f"{p}.warmup_steps",
               f"must be >= 0, got {self.warmup_steps}")
        if self.max_steps is not None:
            require(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"{p}.min_lr_ratio",
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
    """Folder, relative to the run directory and inside it (no absolute path, no ``..``): the
    run lock and the move-aside of an earlier run cover the run directory only, so a folder
    outside it let two runs overwrite, and resume from, each other's checkpoints."""
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
        parts = PurePosixPath(self.directory.replace("\\", "/")).parts
        require(bool(self.directory.strip()) and not self.directory.startswith(("/", "\\", "~"))
                and ".." not in parts and ":" not in self.directory,
                f"{p}.directory", f"must be a folder inside the run directory (a relative path "
                f"without '..', e.g. checkpoints), got {brief(self.directory)}; to keep "
                f"checkpoints on another disk, put the run there (run.output_dir)")
        require(not parts or parts[0] not in RUN_FILES, f"{p}.directory",
                f"must not be inside {parts[0] if parts else ''}, a file every run writes in "
                f"its directory ({', '.join(RUN_FILES)}); got {brief(self.directory)}")
        require(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        if self.every_seconds is not None:
            require(self.every_seconds > 0, f"{p}.every_seconds",
                   f"must be > 0 or null, got {self.every_seconds}")
        if self.keep_last is not None:
            require(self.keep_last > 0, f"{p}.keep_last",
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
        require(self.max_skipped_steps > 0, f"{p}.max_skipped_steps",
               f"must be > 0, got {self.max_skipped_steps}")
        import signal as _signal

        for name in self.preemption_signals:
            ok = isinstance(name, str) and name.startswith("SIG") and hasattr(_signal, name) \
                and name not in ("SIGKILL", "SIGSTOP") and not name.startswith("SIG_")
            require(ok, f"{p}.preemption_signals", f"{str(name)[:40]!r} is not a signal this "
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
        require(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        require(self.heartbeat_seconds >= 0, f"{p}.heartbeat_seconds",
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
            require(self.alignment > 0, f"{p}.alignment",
                   f"must be auto, none or a positive int, got {self.alignment}")


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
            self.data.target_batch_size = self.data.micro_batch_size * torchrun_world_size()
        if self.data.seed is None:
            self.data.seed = self.run.seed
        if self.model.vocab_size is None and self.data.tokenizer is None \
                and self.data.tokens_path is None:
            self.model.vocab_size = 256  # byte-level and synthetic data; the rest follows the data
        if self.scheduler.max_steps is None:
            self.scheduler.max_steps = self.run.max_steps
        self._name_diloco_run()
        self._torchft_from_env()
        self.data_parallel.resolve_timeout(self.distributed)
        if self.gradient_checkpointing or self.model.gradient_checkpointing:
            self.gradient_checkpointing = self.model.gradient_checkpointing = True
        check_finite(self)  # first: range rules below read inf as a valid large value
        check_choices(self, "")
        for name in _SECTIONS:
            check_choices(getattr(self, name), name)
            getattr(self, name).validate(name)
        require(1 <= self.ooo_streams <= 8, "ooo_streams",
               f"must be in 1..8, got {self.ooo_streams}")
        require(0 <= self.ooo_trial_pairs <= 100, "ooo_trial_pairs",
               f"must be in 0..100, got {self.ooo_trial_pairs}")
        require(self.data.block_size <= self.model.max_seq_len, "data.block_size",
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
        self.distributed.check_node_id()  # first: a bad id is its own error, not run.name's
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
            require(raw.isdigit(), "torchft.replica_group",
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
