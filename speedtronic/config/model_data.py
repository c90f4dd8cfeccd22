"""The ``model`` and ``data`` sections: what is trained, and on what.

Kept together because they size each other: ``data.block_size`` defaults to
``model.max_seq_len``, and ``model.vocab_size`` follows ``data.tokenizer`` or
``data.tokens_path`` when left out (both filled by ``SpeedtronicConfig.finalize`` in
:mod:`.schema`, which also checks the one rule across them). Field docstrings are the reference
documentation of each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import brief
from .rules import byte_text_file, require

__all__ = ["DataConfig", "ModelConfig"]


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
        """Check sizes (n_head dividing d_model into an even head dim), dropout, rope_base and
        hf_config; raise ConfigError naming the key."""
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
    """A Hugging Face dataset: a Hub name (online); offline, a local json/jsonl, csv/tsv, parquet
    or arrow file (one split, ``train``; ``.gz``/``.zst``... compressed too), a folder of such
    files, or a ``save_to_disk`` copy. Needs ``tokenizer``."""
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
        """Check that at most one source is set (a byte-read ``text_path`` must exist), what a
        tokenizer needs, sizes and batch sizes; raise ConfigError naming the key."""
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
