"""Seeded, resumable window sampling over a token store.

Training order (one *epoch* = one pass over the train tokens):

* sample ``j`` of epoch ``e`` is the window ``tokens[o + j*T : o + j*T + T + 1]`` where the
  offset ``o`` in ``[0, T)`` is drawn per epoch, so sample boundaries move between epochs; the
  stride is ``T`` (windows share one token), so every adjacent token pair is a training target
  once per epoch (v2.0's non-overlapping blocks never trained the transitions between blocks);
* samples are grouped in chunks of ``chunk_samples`` consecutive windows (a whole in-memory
  array is one chunk; a text file uses ~1 MiB chunks so only one chunk is in memory); chunk
  order and the order inside each chunk are seeded permutations;
* rank ``r`` of ``world`` takes every ``world``-th sample of each chunk's permutation, so ranks
  see disjoint samples;
* a micro-batch is the next ``B`` samples of this stream (it may span chunks and epochs).

The position ``(epoch, chunk_pos, within)`` is the whole state: ``load_state_dict`` rebuilds
the same permutations from the seed, so a resumed run sees exactly the batches an
uninterrupted run would. Per batch the cost is one vectorized numpy gather of ``B*(T+1)``
tokens; permutations are made once per chunk.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np
import torch

from ..errors import SpeedtronicError
from .sources import TokenStore, _u64

__all__ = ["WindowIterator", "split_batch", "eval_windows", "min_train_tokens"]

logger = logging.getLogger("speedtronic.data")

Batch = tuple[torch.Tensor, torch.Tensor]

SAMPLE_WINDOWS = 64
"""Windows of the train tokens whose digest identifies the data in a resume position."""
SAMPLE_LENGTH = 32
"""Ids per sampled window."""


def split_batch(windows: np.ndarray, pin: bool = False) -> Batch:
    """``(B, T+1)`` windows -> ``(input_ids, labels)``, each ``(B, T)`` int64: the one shift."""
    t = torch.from_numpy(np.ascontiguousarray(windows)).to(torch.int64)  # (B, T+1)
    x = t[:, :-1].contiguous()  # (B, T)
    y = t[:, 1:].contiguous()  # (B, T); y[:, i] = x[:, i + 1]
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class WindowIterator:
    """Infinite iterator of ``(input_ids, labels)`` micro-batches with an exact resume position.

    Args:
        store: train tokens.
        block_size: ``T``, tokens per sample.
        batch_size: ``B``, samples per micro-batch.
        seed: data-order seed (the same on every rank, so shards are disjoint).
        rank, world: this process's shard.
        chunk_samples: windows per chunk; None = the whole store is one chunk.
        shuffle: permute chunks and samples (False: sequential windows, offset 0, for debugging).
        pin_memory: return batches in pinned memory.
        name: the data key/file(s) of ``store``, for the error when it is too short.
    """

    def __init__(self, store: TokenStore, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1, chunk_samples: int | None = None,
                 shuffle: bool = True, pin_memory: bool = False, name: str = "data") -> None:
        self.store = store
        self.T = block_size
        self.B = batch_size
        self.seed = _u64(seed)
        self.rank = rank
        self.world = world
        self.shuffle = shuffle
        self.pin_memory = pin_memory
        self.max_offset = min(self.T - 1, store.n - self.T - 1) if shuffle else 0
        min_samples = (store.n - self.max_offset - 1) // self.T
        if store.n < self.T + 1 or min_samples < world:
            need = min_train_tokens(self.T, world, shuffle)
            raise SpeedtronicError(
                f"{name}: only {store.n} train tokens, too few for block_size={self.T} on "
                f"{world} rank(s) (need at least {need} train tokens); use more data or a "
                "smaller data.block_size")
        # A chunk must hold >= world windows, else some rank could get nothing from any chunk.
        self.S = max(chunk_samples or min_samples + 1, world)
        self._arange = np.arange(self.T + 1)
        self.epoch = 0
        self.chunk_pos = 0
        self.within = 0
        self.samples_seen = 0
        self._epoch_cache: tuple[int, int, int, np.ndarray] | None = None
        self._chunk_cache: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None
        self._sample_digest: str | None = None

    # -- epoch / chunk layout (pure functions of seed, epoch, chunk) -------------------------
    def _epoch_layout(self, epoch: int) -> tuple[int, int, np.ndarray]:
        """(offset, n_samples, chunk order) of an epoch."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                offset = int(rng.integers(0, self.max_offset + 1))
            else:
                rng, offset = None, 0
            n_samples = (self.store.n - offset - 1) // self.T
            n_chunks = -(-n_samples // self.S)
            order = rng.permutation(n_chunks) if rng is not None else np.arange(n_chunks)
            self._epoch_cache = (epoch, offset, n_samples, order)
        return self._epoch_cache[1:]

    def _chunk(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens of the current chunk, this rank's window starts in it, relative)."""
        key = (self.epoch, self.chunk_pos)
        if self._chunk_cache is None or self._chunk_cache[0] != key:
            offset, n_samples, order = self._epoch_layout(self.epoch)
            c = int(order[self.chunk_pos])
            first = c * self.S
            count = min(self.S, n_samples - first)
            if self.shuffle:
                local = np.random.default_rng([self.seed, self.epoch, c, 1]).permutation(count)
            else:
                local = np.arange(count)
            local = local[self.rank::self.world]
            start = offset + first * self.T
            tokens = self.store.read(start, start + count * self.T + 1)
            self._chunk_cache = (key, tokens, local * self.T)
        return self._chunk_cache[1], self._chunk_cache[2]

    def _advance_chunk(self) -> None:
        self.within = 0
        self.chunk_pos += 1
        if self.chunk_pos >= len(self._epoch_layout(self.epoch)[2]):
            self.epoch += 1
            self.chunk_pos = 0

    # -- iterator protocol -------------------------------------------------------------------
    def __iter__(self) -> WindowIterator:
        return self

    def __next__(self) -> Batch:
        parts = []
        need = self.B
        while need:
            tokens, starts = self._chunk()
            take = starts[self.within:self.within + need]
            if take.size:
                parts.append(tokens[take[:, None] + self._arange])  # (k, T+1)
                self.within += take.size
                need -= take.size
            if self.within >= starts.size:
                self._advance_chunk()
        self.samples_seen += self.B
        windows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return split_batch(windows, self.pin_memory)

    # -- exact resume ------------------------------------------------------------------------
    def _meta(self) -> dict[str, int | str]:
        return {"tokens": self.store.n, "block_size": self.T, "seed": self.seed,
                "rank": self.rank, "world": self.world, "chunk_samples": self.S,
                "shuffle": int(self.shuffle), "tokens_sample": self.tokens_sample()}

    def tokens_sample(self) -> str:
        """A digest of ``SAMPLE_WINDOWS`` short windows spread evenly over the train tokens:
        the data's identity in the resume position. The token count alone let a resume onto
        edited or re-tokenized data of the same length pass without a word. Reading 64 x 32
        ids costs one small gather (64 reads of a text file), once per run."""
        if self._sample_digest is None:
            length = min(SAMPLE_LENGTH, self.store.n)
            starts = np.unique(np.linspace(0, self.store.n - length, num=SAMPLE_WINDOWS)
                               .round().astype(np.int64))
            ids = np.ascontiguousarray(self.store.gather(starts, length), dtype=np.int64)
            self._sample_digest = hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()
        return self._sample_digest

    def state_dict(self) -> dict[str, Any]:
        """The position after the last returned batch (plain ints: safe for weights_only)."""
        return {"kind": "windows", "epoch": self.epoch, "chunk_pos": self.chunk_pos,
                "within": self.within, "samples_seen": self.samples_seen, "meta": self._meta()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        if state.get("kind") != "windows":
            raise SpeedtronicError(f"data state is of kind {state.get('kind')!r}, expected "
                                   "'windows' (was the checkpoint made with another data source?)")
        meta = state.get("meta", {})
        # a key the saved position lacks (a checkpoint from before it existed) is not a change
        changed = {k: (meta[k], v) for k, v in self._meta().items()
                   if k in meta and meta[k] != v}
        if changed:
            logger.warning("data: resuming a position saved with different data or data settings "
                           "(%s); the resumed order will not match the original run",
                           ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()))
        self.epoch = int(state["epoch"])
        self.chunk_pos = int(state["chunk_pos"])
        self.within = int(state["within"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self._chunk_cache = None
        if self.chunk_pos >= len(self._epoch_layout(self.epoch)[2]):  # settings changed
            self.epoch, self.chunk_pos, self.within = self.epoch + 1, 0, 0


def min_train_tokens(block_size: int, world: int, shuffle: bool = True) -> int:
    """The fewest train tokens :class:`WindowIterator` accepts: every rank needs a window in
    every epoch, whatever offset the epoch draws.

    With shuffling, a store of at least ``2T`` tokens draws offsets up to ``T - 1``, leaving
    ``(n - T) // T`` windows; a shorter one (from ``T + 1``) keeps exactly one window. So one rank
    needs ``T + 1`` tokens and ``w >= 2`` ranks ``(w + 1) * T``. Without shuffling the offset is
    0 and ``w * T + 1`` tokens give ``w`` windows."""
    if not shuffle or world == 1:
        return world * block_size + 1
    return (world + 1) * block_size


def eval_windows(store: TokenStore, block_size: int, count: int, name: str = "held-out split",
                 fix: str = "raise data.eval_fraction or use more data") -> np.ndarray:
    """``count`` windows of ``T+1`` tokens, evenly spaced over the whole eval store; ``name``
    (the key/file of the store) and ``fix`` word the error when it is shorter than one window."""
    last = store.n - block_size - 1
    if last < 0:
        raise SpeedtronicError(f"{name}: only {store.n} eval tokens, fewer than "
                               f"block_size+1={block_size + 1}; {fix}")
    starts = np.linspace(0, last, num=count).round().astype(np.int64)
    return store.gather(starts, block_size + 1)
