"""Token stores: random access to a flat token stream, in memory or in a file on disk.

A store is a half-open range of tokens with ``read(a, b) -> np.ndarray`` (a view or a small
copy) and ``gather(starts, length) -> (k, length)``. The samplers in ``sampler.py`` only ever
ask for contiguous ranges (one chunk at a time) or a handful of eval windows, so a multi-GB text
file is never loaded whole.

Sources built here:

* :func:`stdlib_corpus`: the Python standard library's own ``.py`` files as bytes (vocab 256),
  split into train/eval *by file* (a hash of the relative path), so eval text is truly held out.
  Building it reads ~8 MB and takes ~0.15 s on a 2-core machine, so there is no disk cache.
* :class:`TextFileStore`: a byte range of a UTF-8 file, read with seek + read.
* :func:`synthetic_tokens`: seeded uniform random ids, different for every rank.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._renamed import renamed
from ..errors import SpeedtronicError

__all__ = ["TokenStore", "ArrayStore", "TextFileStore", "StdlibCorpus", "stdlib_corpus",
           "synthetic_tokens"]

# Directories whose files are not representative source text (tests are huge, repetitive data
# tables) or not part of the standard library proper.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})


class TokenStore:
    """A flat stream of ``n`` token ids with random access."""

    n: int

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` as a 1-D integer array."""
        raise NotImplementedError

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Windows ``[s, s + length)`` for each start, as a ``(len(starts), length)`` array."""
        raise NotImplementedError


class ArrayStore(TokenStore):
    """Tokens held in a numpy array (uint8 bytes or int32 ids)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.n = int(tokens.shape[0])

    def read(self, a: int, b: int) -> np.ndarray:
        return self.tokens[a:b]  # a view, no copy

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        idx = starts[:, None] + np.arange(length)  # (k, length)
        return self.tokens[idx]


class TextFileStore(TokenStore):
    """Bytes ``[start, stop)`` of a file, read on demand (never the whole file)."""

    def __init__(self, path: str | Path, start: int, stop: int) -> None:
        self.path = Path(path)
        self.start = start
        self.n = stop - start
        self._fh = None

    def _file(self):
        if self._fh is None:
            self._fh = open(self.path, "rb")  # noqa: SIM115 (kept open across reads)
        return self._fh

    def read(self, a: int, b: int) -> np.ndarray:
        fh = self._file()
        fh.seek(self.start + a)
        data = fh.read(b - a)
        if len(data) != b - a:
            raise SpeedtronicError(f"data.text_path: {str(self.path)!r} shrank while reading "
                                   f"(wanted {b - a} bytes at {self.start + a}, got {len(data)})")
        return np.frombuffer(data, dtype=np.uint8)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        # One seek + read per window: only used for the (few) eval windows.
        return np.stack([self.read(int(s), int(s) + length) for s in starts])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict:  # picklable for DataLoader workers: reopen lazily
        state = self.__dict__.copy()
        state["_fh"] = None
        return state


@dataclass(frozen=True)
class StdlibCorpus:
    """The stdlib byte corpus: train and eval tokens (uint8) and where they came from."""

    train: np.ndarray
    eval: np.ndarray
    train_paths: tuple[str, ...]
    """Relative paths (under ``root``) of the train files, in corpus order."""
    eval_paths: tuple[str, ...]
    root: str
    seconds: float


def _path_fraction(rel: str) -> float:
    """A stable pseudo-random number in [0, 1) for a relative path (same on every machine)."""
    digest = hashlib.blake2b(rel.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _stdlib_files(root: str) -> list[str]:
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                rels.append(rel.replace(os.sep, "/"))
    return sorted(rels)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int, eval_fraction: float) -> StdlibCorpus:
    """Concatenate stdlib ``.py`` files (sorted relative paths) up to ``max_bytes`` in total.

    A file goes to eval when the hash of its relative path falls below ``eval_fraction``, so
    the split depends only on file names, not on the cap or the machine. Cached per process.
    """
    t0 = time.perf_counter()
    root = sysconfig.get_paths()["stdlib"]
    rels = _stdlib_files(root) if os.path.isdir(root) else []
    if not rels:
        raise SpeedtronicError(f"no Python source files found under the standard library "
                               f"{root!r} (an embedded or zipped Python?); set data.text_path "
                               "to a UTF-8 text file instead")
    train_parts: list[bytes] = []
    eval_parts: list[bytes] = []
    train_paths: list[str] = []
    eval_paths: list[str] = []
    total = 0
    for rel in rels:
        if total >= max_bytes:
            break
        try:
            data = Path(root, rel).read_bytes()[: max_bytes - total]
        except OSError:  # unreadable file (permissions, broken link): skip it
            continue
        total += len(data)
        held = _path_fraction(rel) < eval_fraction
        (eval_parts if held else train_parts).append(data)
        (eval_paths if held else train_paths).append(rel)
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
    held_out = np.frombuffer(b"".join(eval_parts), dtype=np.uint8)
    if train.size == 0 or held_out.size == 0:
        raise SpeedtronicError(f"stdlib corpus too small to split: {len(train_parts)} train / "
                               f"{len(eval_parts)} eval files within data.stdlib_max_bytes="
                               f"{max_bytes}; raise data.stdlib_max_bytes or data.eval_fraction")
    return StdlibCorpus(train=train, eval=held_out, train_paths=tuple(train_paths),
                        eval_paths=tuple(eval_paths), root=root,
                        seconds=time.perf_counter() - t0)


def synthetic_tokens(n: int, vocab_size: int, seed: int, stream: int) -> np.ndarray:
    """``n`` uniform ids in ``[0, vocab_size)`` from the seeded stream number ``stream``.

    Each (seed, stream) pair is an independent generator; ranks use different streams, so
    DiLoCo nodes do not train on identical data (the v2.0 engine gave every node the same order).
    """
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    rng = np.random.default_rng([_u64(seed), stream, 0x5EED])
    return rng.integers(0, vocab_size, size=n, dtype=dtype)


def _u64(seed: int) -> int:
    """Map any Python int (possibly negative) to a valid numpy seed word."""
    return seed % 2**64


def python_tag() -> str:
    """``3.11`` etc., for log lines."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


# Renamed in 2.1: ``FileStore`` was also the name of DiLoCo's file:// back end.
__getattr__ = renamed(__name__, "FileStore", "TextFileStore", TextFileStore)
