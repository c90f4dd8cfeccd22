"""``speedtronic prepare``'s tokenizing half: worker processes turn text blocks into ids, and
one shard buffer at a time is filled and written.

Each spawned worker builds its own tokenizer from the serialized form once, leaves Ctrl-C to
the parent (which stops the pool), and ends quietly when its parent is killed outright.
``workers=1`` tokenizes in this process instead, through the same ``_encode``.
"""

from __future__ import annotations

import multiprocessing.context
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from ..errors import first_line
from .token_files import write_shard

SHARD_TOKENS = 1 << 26
"""Tokens per output shard (128 MiB of uint16)."""


_worker_tokenizer: Any = None
_worker_eos: int | None = None
_worker_spec = ""


def _init_worker(serialized: str, eos: int | None, spec: str) -> None:
    global _worker_tokenizer, _worker_eos, _worker_spec
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_str(serialized)
    _worker_eos = eos
    _worker_spec = spec


def _init_pool_worker(serialized: str, eos: int | None, spec: str) -> None:
    """:func:`_init_worker` in a pool process, which leaves Ctrl-C to the parent: it reaches
    the whole process group, and each worker printed a KeyboardInterrupt traceback while the
    parent stopped the pool anyway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(serialized, eos, spec)


class _QuietWorker(multiprocessing.context.SpawnProcess):
    """A pool process that ends quietly once its parent is gone. A prepare killed outright
    (SIGKILL, or SIGTERM before it was handled) left each worker writing its next result into
    a pipe nobody reads: a BrokenPipeError traceback per worker. (SIGPIPE's default action
    instead would kill a worker inside the result queue's lock, and the next one waits on that
    lock forever.)"""

    def run(self) -> None:
        try:
            super().run()
        except BrokenPipeError:  # only the parent reads the results: nobody left to tell
            pass


class _QuietSpawn(multiprocessing.context.SpawnContext):
    Process = _QuietWorker


def _encode(task: tuple[str, str]) -> np.ndarray:
    where, text = task
    end = text.endswith("\x00EOD")
    if end:
        text = text[: -len("\x00EOD")]
    try:
        ids = _worker_tokenizer.encode(text, add_special_tokens=False).ids if text else []
    except Exception as exc:  # noqa: BLE001 - the tokenizer's own failures are plain Exception
        # A ConfigError (picklable: one message argument) crosses the worker pool as is, so the
        # CLI prints this one line whether or not workers were used.
        first = first_line(exc)
        raise ConfigError(f"data.tokenizer: {_worker_spec!r} failed to encode {where}: {first} "
                          "(use a tokenizer whose vocabulary covers every byte of the text or has "
                          "an unknown token, or remove the text it cannot represent)") from None
    if end and _worker_eos is not None:
        ids.append(_worker_eos)
    return np.asarray(ids, dtype=np.uint32)


def _write_shards(tmp: Path, texts: Iterator[tuple[str, str]], tokenizer: Any, eos: int | None,
                  spec: str, dtype: type[np.unsignedinteger], workers: int,
                  show: bool) -> tuple[dict[str, dict[str, int]], int]:
    """Tokenize ``texts`` in ``workers`` processes into shards in ``tmp``; (shards, tokens).

    Ids arrive as uint32 arrays, a block of text each, and are copied (cast) into one shard
    buffer of the shard's dtype; a full buffer is written and refilled. Peak memory is one
    shard plus one block: buffering a shard's blocks as uint32, then concatenating, then
    casting held ~6 shards' bytes (760 MiB growth for a 128 MiB uint16 shard)."""
    shards: dict[str, dict[str, int]] = {}
    shard = np.empty(SHARD_TOKENS, dtype)  # pages are touched as it fills: a tiny corpus pays
    filled = total = 0                     # for what it holds

    def write(n: int) -> None:
        part = shard[:n]
        name = f"shard_{len(shards):06d}.bin"
        write_shard(tmp / name, part)
        shards[name] = {"tokens": n, "max_id": int(part.max())}

    init = (tokenizer.to_str(), eos, spec)
    pool = _QuietSpawn().Pool(workers, _init_pool_worker, init) if workers > 1 else None
    if pool is None:
        _init_worker(*init)
    results = pool.imap(_encode, texts, chunksize=4) if pool else map(_encode, texts)
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(unit="tok", unit_scale=True, desc="prepare", file=None)
    ok = False
    try:
        for ids in results:
            start, size = 0, int(ids.size)
            while start < size:  # a document may straddle shards: its rest starts the next
                take = min(SHARD_TOKENS - filled, size - start)
                shard[filled:filled + take] = ids[start:start + take]  # cast to dtype, as astype
                filled += take
                start += take
                if filled == SHARD_TOKENS:
                    write(filled)
                    filled = 0
            total += size
            if bar is not None and size:
                bar.update(size)
        if filled:
            write(filled)
        ok = True
    finally:
        if pool is not None:
            if ok:
                pool.close()
            else:  # close() would wait for every queued block of a failed corpus first
                pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
    return shards, total
