"""``build_data(cfg, rank=, world=) -> DataBundle``: the configured source behind a resumable
train iterator and fixed eval batches.

Sources, in order of precedence (the config allows at most one to be set):

* ``data.dataset``: a user ``Dataset``/``IterableDataset`` (see ``user.py``);
* ``data.tokens_path``: pre-tokenized shards, memory-mapped (:mod:`.token_files`); eval is
  ``data.eval_tokens_path`` or the last ``eval_fraction`` of the tokens;
* ``data.tokenizer`` with ``data.text_path`` or ``data.hf_dataset``: tokenized once into shards
  (:mod:`.prepare`), then read as token files;
* ``data.text_path``: a UTF-8 file as bytes, streamed in ~1 MiB chunks; the last
  ``eval_fraction`` of the file is held out;
* ``data.synthetic``: seeded uniform ids in ``[0, model.vocab_size)``, different per rank;
* default: the Python standard library's ``.py`` sources as bytes, split by file.

Every batch is ``(input_ids, labels)``, each ``(B, T)`` int64 on the CPU, with
``labels[:, t] == input_ids[:, t + 1]`` for raw token sources: the one and only shift.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config import ConfigError, SpeedtronicConfig
from ..config.rules import byte_text_file
from .checks import _token_paths, check_data
from .sampler import WindowIterator, eval_windows, split_batch
from .sources import (
    ArrayStore,
    TextFileStore,
    TokenStore,
    python_tag,
    stdlib_corpus,
    synthetic_tokens,
)
from .token_files import (
    TOKEN_CHUNK,
    TokenFileStore,
    open_token_file,
    split_token_paths,
)
from .user import (
    UserIterator,
    collate_tokens,
    holdout_split,
    resolve_user_dataset,
    user_eval_batches,
)

__all__ = ["DataBundle", "TrainIterator", "build_data", "check_data", "collate_tokens",
           "TEXT_CHUNK_BYTES", "BYTE_VOCAB"]

logger = logging.getLogger("speedtronic.data")

BYTE_VOCAB = 256
TEXT_CHUNK_BYTES = 1 << 20
"""Bytes of a text file held in memory at once (one chunk of training windows)."""

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainIterator(Protocol):
    """What ``DataBundle.train`` provides: infinite micro-batches and an exact position."""

    def __iter__(self) -> Iterator[Batch]: ...
    def __next__(self) -> Batch: ...
    def state_dict(self) -> dict[str, Any]:
        """The position after the last returned batch, as plain values a checkpoint can hold
        (loaded with ``weights_only``); its ``kind`` names the source that made it."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken; a state of another
        ``kind`` (another data source) raises SpeedtronicError."""


@dataclass
class DataBundle:
    """Training stream plus deterministic held-out batches.

    Attributes:
        train: infinite iterator of ``(input_ids, labels)`` micro-batches, with
            ``state_dict()``/``load_state_dict()`` (save it in checkpoints).
        description: one line saying what the data is (for logs).
        vocab_size: exclusive upper bound of the token ids, when known (256 for bytes).
        block_size: tokens per sample ``T``.
        micro_batch_size: samples per micro-batch ``B``.
        train_tokens: size of the training split, when known.
    """

    train: TrainIterator
    description: str
    vocab_size: int | None
    block_size: int
    micro_batch_size: int
    train_tokens: int | None
    _make_eval: Callable[[int], list[Batch]] = field(repr=False)
    _eval_cache: dict[int, list[Batch]] = field(default_factory=dict, repr=False)

    def eval_batches(self, n: int) -> list[Batch]:
        """``n`` held-out micro-batches; the same tensors on every call (computed once)."""
        if n <= 0:
            raise ValueError(f"eval_batches: n must be > 0, got {n}")
        if n not in self._eval_cache:
            self._eval_cache[n] = self._make_eval(n)
        return list(self._eval_cache[n])


@dataclass(frozen=True)
class _Names:
    """How errors about a source's size name it: the key/file of the train tokens, of the
    held-out tokens, and the fix for a held-out split that is too short."""

    train: str
    held: str
    held_fix: str = "raise data.eval_fraction or use more data"


#: Tokens of eval windows above which more windows than the eval split has distinct ones are
#: refused (2^26: 512 MiB as int64, held at once by each eval).
EVAL_TOKENS_CAP = 2**26


def _windows_bundle(train: TokenStore, held: TokenStore, description: str, vocab: int,
                    cfg: SpeedtronicConfig, T: int, B: int, seed: int, rank: int, world: int,
                    pin: bool, names: _Names,
                    chunk_samples: int | None = None) -> DataBundle:
    it = WindowIterator(train, T, B, seed, rank, world, chunk_samples=chunk_samples,
                        shuffle=cfg.data.shuffle, pin_memory=pin, name=names.train)
    # Fail now, not at the first eval, if the split is too small.
    eval_windows(held, T, 1, name=names.held, fix=names.held_fix)
    # A huge run.eval_batches once ran the machine out of memory (killed, no message) at the
    # first eval: its windows are held at once. Refused where they would also only repeat the
    # split's distinct windows and hold over 2^26 tokens (512 MiB as int64); a small split
    # read a few times over (a synthetic set's held-out part) is fine.
    distinct = held.n - T
    wanted = cfg.run.eval_batches * B
    if wanted > max(distinct, B) and wanted * (T + 1) > EVAL_TOKENS_CAP:
        raise ConfigError(
            f"run.eval_batches={cfg.run.eval_batches}: {cfg.run.eval_batches * B} eval "
            f"windows (x data.micro_batch_size={B}), but {names.held} has only {distinct} "
            f"distinct windows of block_size+1={T + 1} tokens; use run.eval_batches <= "
            f"{max(1, distinct // B)}")

    def make_eval(n: int) -> list[Batch]:
        windows = eval_windows(held, T, n * B, name=names.held, fix=names.held_fix)  # (n*B, T+1)
        return [split_batch(windows[i * B:(i + 1) * B]) for i in range(n)]

    return DataBundle(train=it, description=description, vocab_size=vocab, block_size=T,
                      micro_batch_size=B, train_tokens=train.n, _make_eval=make_eval)


def _node_seed(cfg: SpeedtronicConfig, seed: int, world: int) -> int:
    """DiLoCo nodes launched with one config and no rank/world would all read identical data
    (as in the v2.0 engine): mix the node id into the data seed so their orders differ."""
    dist = getattr(cfg, "distributed", None)
    if dist is None or not dist.enabled or world > 1:
        return seed
    if dist.node_id is None:
        logger.warning("data: distributed.node_id is unset, so every DiLoCo node reads the same "
                       "data order; set node_id (or pass rank/world to build_data)")
        return seed
    digest = hashlib.blake2b(f"{seed}:{dist.node_id}".encode(), digest_size=8).digest()
    logger.info("data: DiLoCo node %r: data order seeded by node id", dist.node_id)
    return int.from_bytes(digest, "big")


def _check_byte_vocab(cfg: SpeedtronicConfig, what: str) -> None:
    if cfg.model.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"model.vocab_size: {what} is byte-level (ids 0..255) and needs "
                          f"model.vocab_size >= {BYTE_VOCAB}, got {cfg.model.vocab_size}")



def build_data(cfg: SpeedtronicConfig, *, rank: int = 0, world: int = 1,
               device: str | torch.device | None = None) -> DataBundle:
    """Build the data of ``cfg`` (a :class:`~speedtronic.config.SpeedtronicConfig`).

    ``rank``/``world`` shard the training samples (DiLoCo nodes pass theirs, so nodes see
    disjoint data); eval batches are the same on every rank. ``device`` only decides pinned
    memory when ``data.pin_memory`` is None (pinned when it is a CUDA device).
    """
    if not (0 <= rank < world):
        raise ValueError(f"build_data: need 0 <= rank < world, got rank={rank}, world={world}")
    d = cfg.data
    T = d.block_size or cfg.model.max_seq_len
    B = d.micro_batch_size
    seed = d.seed if d.seed is not None else cfg.run.seed
    seed = _node_seed(cfg, seed, world)
    pin = d.pin_memory
    if pin is None:
        pin = device is not None and torch.device(device).type == "cuda"
    pin = bool(pin) and torch.cuda.is_available()
    shard = f", rank {rank}/{world}" if world > 1 else ""

    if d.dataset is not None:
        bundle = _user_bundle(cfg, T, B, seed, rank, world, pin)
    elif d.tokens_path is not None or d.tokenizer is not None:
        train, held, desc, names = _token_stores(cfg)
        bundle = _windows_bundle(train, held, f"{desc}{shard}", cfg.model.vocab_size, cfg, T, B,
                                 seed, rank, world, pin, names,
                                 chunk_samples=max(1, TOKEN_CHUNK // T))
    elif d.text_path is not None:
        _check_byte_vocab(cfg, f"data.text_path {d.text_path!r}")
        path = byte_text_file(d.text_path)
        size = path.stat().st_size
        split = int(size * (1.0 - d.eval_fraction))
        where = f"data.text_path {str(path)!r}"
        bundle = _windows_bundle(
            TextFileStore(path, 0, split), TextFileStore(path, split, size),
            f"text file {path} ({split / 1e6:.2f} MB train / {(size - split) / 1e6:.2f} MB "
            f"eval = the last {d.eval_fraction:.0%}, bytes{shard})",
            BYTE_VOCAB, cfg, T, B, seed, rank, world, pin,
            _Names(f"{where} (the first {1 - d.eval_fraction:.0%}, bytes)",
                   f"{where} (held-out split: the last {d.eval_fraction:.0%})"),
            chunk_samples=max(1, TEXT_CHUNK_BYTES // T))
    elif d.synthetic:
        vocab = cfg.model.vocab_size
        n_eval = max(int(d.num_tokens * d.eval_fraction), (T + 1) * B)
        bundle = _windows_bundle(
            ArrayStore(synthetic_tokens(d.num_tokens, vocab, seed, stream=1 + rank)),
            ArrayStore(synthetic_tokens(n_eval, vocab, seed, stream=0)),
            f"synthetic uniform tokens ({d.num_tokens:,} per rank, vocab {vocab}, "
            f"seed {seed}{shard})", vocab, cfg, T, B, seed, rank, world, pin,
            _Names("data.synthetic (data.num_tokens)", "data.synthetic held-out split",
                   "raise data.num_tokens or data.eval_fraction"))
    else:
        _check_byte_vocab(cfg, "the default stdlib corpus")
        corpus = stdlib_corpus(d.stdlib_max_bytes, d.eval_fraction)
        bundle = _windows_bundle(
            ArrayStore(corpus.train), ArrayStore(corpus.eval),
            f"python {python_tag()} stdlib source bytes ({len(corpus.train_paths)} files "
            f"{corpus.train.size / 1e6:.2f} MB train / {len(corpus.eval_paths)} files "
            f"{corpus.eval.size / 1e6:.2f} MB eval, held out by file; built in "
            f"{corpus.seconds:.2f} s{shard})", BYTE_VOCAB, cfg, T, B, seed, rank, world, pin,
            _Names("the stdlib corpus (data.stdlib_max_bytes)",
                   "the stdlib corpus's held-out files",
                   "raise data.stdlib_max_bytes or data.eval_fraction"))
    logger.info("data: %s; block %d, micro-batch %d", bundle.description, T, B)
    return bundle


def _user_bundle(cfg: SpeedtronicConfig, T: int, B: int, seed: int, rank: int, world: int,
                 pin: bool) -> DataBundle:
    d = cfg.data
    train_ds, eval_ds = resolve_user_dataset(d.dataset, cfg)
    iterable = isinstance(train_ds, torch.utils.data.IterableDataset)
    train_idx = eval_idx = None
    if eval_ds is not None:
        held_note = f"eval = a separate {type(eval_ds).__name__}"
    elif not iterable:
        train_idx, eval_idx = holdout_split(len(train_ds), d.eval_fraction)
        eval_ds = train_ds
        held_note = f"eval = the last {len(eval_idx)} items"
    else:
        eval_ds = train_ds
        held_note = "eval = the head of the stream (NOT held out: return (train, eval))"
        logger.warning("data: the IterableDataset has no eval set, so eval batches come from "
                       "the head of the training stream; return (train, eval) from the "
                       "factory to hold data out")
    it = UserIterator(train_ds, B, seed, rank, world, d.shuffle and not iterable,
                      d.num_workers, pin, indices=train_idx)
    desc = (f"user {type(train_ds).__name__} ({'iterable' if iterable else 'map-style'}, "
            f"{held_note}{f', rank {rank}/{world}' if world > 1 else ''})")
    return DataBundle(train=it, description=desc, vocab_size=None, block_size=T,
                      micro_batch_size=B,
                      train_tokens=None if iterable else len(it.indices) * T,
                      _make_eval=lambda n: user_eval_batches(eval_ds, n, B, eval_idx))


def _files_named(key: str, spec: str, paths: list[Path]) -> str:
    """``key 'file'`` for one file, ``key 'spec' (N files)`` for several: for error messages."""
    if len(paths) == 1:
        return f"{key} {str(paths[0])!r}"
    return f"{key} {spec!r} ({len(paths)} files)"


def _token_stores(cfg: SpeedtronicConfig) -> tuple[TokenFileStore, TokenFileStore, str, _Names]:
    d = cfg.data
    spec, eval_spec, what = _token_paths(cfg)
    # A prepared source's shards come from data.text_path / data.hf_dataset, not tokens_path.
    key = "data.tokens_path" if d.tokens_path is not None else (
        f"data.{'hf_dataset' if d.hf_dataset is not None else 'text_path'} (prepared shards)")
    paths, eval_paths = split_token_paths(spec, eval_spec)
    files = [open_token_file(p, d.tokens_dtype, "data.tokens_path") for p in paths]
    vocab = cfg.model.vocab_size  # settled by check_data; each chunk read is checked against it
    stream = TokenFileStore(files, vocab_size=vocab)
    train_name = _files_named(key, spec, paths)
    if eval_spec is not None:
        held = TokenFileStore([open_token_file(p, d.tokens_dtype, "data.eval_tokens_path")
                               for p in eval_paths], vocab_size=vocab)
        # eval_fraction plays no part here: the fix is a longer eval file.
        names = _Names(train_name, _files_named("data.eval_tokens_path", eval_spec, eval_paths),
                       "use a longer data.eval_tokens_path or a smaller data.block_size")
        return stream, held, f"{what} ({stream.n:,} train / {held.n:,} eval tokens)", names
    split = int(stream.n * (1.0 - d.eval_fraction))
    train = TokenFileStore(files, 0, split, vocab_size=vocab)
    held = TokenFileStore(files, split, stream.n, vocab_size=vocab)
    names = _Names(f"{train_name} (the first {1 - d.eval_fraction:.0%} of {stream.n} tokens)",
                   f"{train_name} (held-out split: the last {d.eval_fraction:.0%})",
                   "raise data.eval_fraction, set data.eval_tokens_path or use more data"
                   if d.tokens_path is not None else "raise data.eval_fraction or use more data")
    return train, held, (f"{what} ({train.n:,} train / {held.n:,} eval tokens = the last "
                         f"{d.eval_fraction:.0%})"), names


