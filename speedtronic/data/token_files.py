"""Pre-tokenized token files: flat token ids on disk, memory-mapped, never loaded whole.

Accepted per file (``data.tokens_path`` is one file, a glob, or a directory of them):

* ``.bin`` with the 1024-byte header of modded-nanogpt / llm.c shards: 256 int32, ``[0]`` the
  magic, ``[1]`` the version, ``[2]`` the token count. Magic 20240520 (modded-nanogpt, llm.c
  GPT-2): version 1 uint16 ids, version 2 uint32 ids (what :func:`write_shard` writes for large
  vocabularies); magic 20240801 (llm.c Llama-3): version 7, uint32 ids;
* ``.bin`` without that header: raw ids (nanoGPT's ``train.bin``), ``data.tokens_dtype``
  (``uint16`` unless set);
* ``.npy``: a 1-D uint16 or uint32 array (``np.save``).

Shards are read in sorted name order as one stream (:class:`TokenFileStore`); a window may span
two shards, as in nanoGPT's single file. A chunk of ``TOKEN_CHUNK`` tokens is copied out of the
memory map at a time, so the resident set stays small and the OS page cache does the rest.

Checking ids against the model's vocabulary needs the largest id of every file. It is read from
the ``meta.json`` that ``speedtronic prepare`` writes beside its shards; for other files it is
computed once (a streaming pass at ~1 GB/s) and cached in ``<cache>/token-stats.json`` keyed by
path, size, modification time and how the file was read (layout, id dtype, token count).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, SpeedtronicError
from .sources import TokenStore

__all__ = ["HEADER_MAGIC", "LLAMA3_MAGIC", "TOKEN_CHUNK", "TokenFile", "TokenFileStore",
           "DataChangedError", "expand_paths", "header_hint", "open_token_file",
           "raw_dtype_hint", "resolve_token_paths", "write_shard"]

logger = logging.getLogger("speedtronic.data")

HEADER_MAGIC = 20240520
LLAMA3_MAGIC = 20240801
HEADER_INTS = 256
# magic -> (what writes it, {version: id dtype}); llm.c's dev/data/data_common.py HEADERS_INFO.
_HEADERS: dict[int, tuple[str, dict[int, type[np.unsignedinteger]]]] = {
    HEADER_MAGIC: ("modded-nanogpt / llm.c GPT-2", {1: np.uint16, 2: np.uint32}),
    LLAMA3_MAGIC: ("llm.c Llama-3", {7: np.uint32}),
}
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKEN_CHUNK = 1 << 20
"""Tokens copied out of the memory map per training chunk (2-4 MiB)."""


class DataChangedError(SpeedtronicError):
    """A token file changed, shrank or failed to read while a run was reading it."""


@dataclass(frozen=True)
class TokenFile:
    """One shard: its ids as a read-only memory map, and where they came from."""

    path: Path
    tokens: np.ndarray  # (n,) uint16 or uint32, np.memmap
    layout: str  # "header", "raw" or "npy"
    stamp: tuple[int, int] = (-1, -1)  # (size, mtime_ns) when opened: a change is an error

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def byte_offset(self) -> int:
        """Where the ids start in the file (after a shard or .npy header)."""
        return int(getattr(self.tokens, "offset", 0))


def expand_paths(spec: str, key: str, suffixes: tuple[str, ...] | None = None,
                 recursive: bool = False) -> list[Path]:
    """The files ``spec`` names (a file, a glob or a directory), sorted; with ``suffixes`` only
    those kinds; a directory is read recursively when ``recursive``. Below a directory, hidden
    files and anything inside hidden folders (``.git/``, ``.cache/``) are skipped.
    Errors are ConfigErrors naming ``key``."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]  # skips dot names itself
    elif path.is_dir():
        # Only components below the root count: the root itself may live under a dot folder.
        found = [p for p in (path.rglob("*") if recursive else path.iterdir())
                 if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    elif path.is_file():
        found = [path]
    else:
        raise ConfigError(f"{key}: no such file or directory: {spec!r}")
    files = sorted(p for p in found if p.is_file() and (suffixes is None or p.suffix in suffixes))
    if not files:
        kinds = " or ".join(suffixes) + " token files" if suffixes else "files"
        raise ConfigError(f"{key}: {spec!r} matches no {kinds}")
    return files


def resolve_token_paths(spec: str, key: str) -> list[Path]:
    """The shards named by ``spec`` (a file, a glob or a directory), sorted; errors name ``key``."""
    return expand_paths(spec, key, suffixes=(".bin", ".npy"))


def split_token_paths(spec: str, eval_spec: str | None) -> tuple[list[Path], list[Path]]:
    """(training files, eval files) of ``data.tokens_path`` and ``data.eval_tokens_path``.

    A training folder or glob that also holds the eval files (fineweb_train_*.bin beside
    fineweb_val_*.bin, the val files as eval_tokens_path) once trained on the eval tokens too,
    without a word: they are left out of training, and a spec with nothing else is refused."""
    paths = resolve_token_paths(spec, "data.tokens_path")
    if eval_spec is None:
        return paths, []
    eval_paths = resolve_token_paths(eval_spec, "data.eval_tokens_path")
    held_out = {p.resolve() for p in eval_paths}
    kept = [p for p in paths if p.resolve() not in held_out]
    if not kept:
        raise ConfigError(f"data.tokens_path {spec!r}: every file it names is also in "
                          f"data.eval_tokens_path {eval_spec!r}; eval data is never trained "
                          "on: give training files of their own")
    if len(kept) < len(paths):
        logger.info("data: %d file(s) of data.tokens_path %r are data.eval_tokens_path's: left "
                    "out of training (eval data is never trained on)", len(paths) - len(kept),
                    spec)
    return kept, eval_paths


def open_token_file(path: Path, dtype: str, key: str) -> TokenFile:
    """Memory-map one shard, checking its layout; every problem is a ConfigError naming ``key``."""
    f = _open_token_file(path, dtype, key)
    st = path.stat()
    return TokenFile(f.path, f.tokens, f.layout, (st.st_size, st.st_mtime_ns))


def _open_token_file(path: Path, dtype: str, key: str) -> TokenFile:
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{key}: {str(path)!r} is empty")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{key}: {str(path)!r} is not a readable .npy file ({exc})") from None
        if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32):
            raise ConfigError(f"{key}: {str(path)!r} holds a {arr.dtype} array of shape "
                              f"{arr.shape}; expected 1-D uint16 or uint32 token ids")
        if arr.shape[0] == 0:
            raise ConfigError(f"{key}: {str(path)!r} holds no tokens")
        return TokenFile(path, arr, "npy")
    header = np.fromfile(path, dtype=np.int32, count=3) if size >= 12 else np.zeros(0, np.int32)
    if header.size == 3 and int(header[0]) in _HEADERS:
        magic, version, count = int(header[0]), int(header[1]), int(header[2])
        writer, versions = _HEADERS[magic]
        if version not in versions:
            known = ", ".join(f"{v} ({np.dtype(t).name} ids)" for v, t in versions.items())
            raise ConfigError(f"{key}: {str(path)!r} has a shard header of version {version} "
                              f"with the {writer} magic {magic}; known: {known}")
        np_dtype = versions[version]
        body = size - HEADER_INTS * 4
        if count <= 0 or body != count * np.dtype(np_dtype).itemsize:
            raise ConfigError(f"{key}: {str(path)!r} header says {count} tokens but the file "
                              f"holds {max(body, 0)} bytes after it (truncated or corrupt)")
        tokens = np.memmap(path, dtype=np_dtype, mode="r", offset=HEADER_INTS * 4,
                           shape=(count,))
        return TokenFile(path, tokens, "header")
    np_dtype = _DTYPES["uint16" if dtype == "auto" else dtype]
    itemsize = np.dtype(np_dtype).itemsize
    if size % itemsize:
        raise ConfigError(f"{key}: {str(path)!r} has {size} bytes, not a whole number of "
                          f"{np.dtype(np_dtype).name} ids; is data.tokens_dtype right?")
    return TokenFile(path, np.memmap(path, dtype=np_dtype, mode="r"), "raw")


def header_hint(f: TokenFile) -> str:
    """For a file read as raw ids whose first 1024 bytes look like a shard header with a magic
    we do not know: a clause saying so (for the vocabulary error and a warning); else ``""``.

    Raw ids are legal whatever their first bytes, so this only explains or warns, never rejects
    a file: a genuine raw uint16 file must keep working."""
    size = f.path.stat().st_size
    if f.layout != "raw" or size < HEADER_INTS * 4:
        return ""
    header = np.fromfile(f.path, dtype=np.int32, count=HEADER_INTS)  # (256,)
    magic, count = int(header[0]), int(header[2])
    body = size - HEADER_INTS * 4
    count_fits = count > 0 and body in (2 * count, 4 * count)
    # llm.c / modded-nanogpt magics are dates (YYYYMMDD) and their header is zero after [2].
    date_like = 20_000_000 <= magic < 30_000_000 and not header[3:].any()
    if not (count_fits or date_like):
        return ""
    known = ", ".join(f"{m} ({writer})" for m, (writer, _) in _HEADERS.items())
    return (f"; its first 1024 bytes look like a shard header with the unrecognised magic "
            f"{magic} (known: {known}), so the file may have an unrecognised header, read here "
            "as token ids")


def raw_dtype_hint(f: TokenFile) -> str:
    """For a raw file read as uint16 whose odd-numbered ids are almost all 0 while the others
    are not: a sentence saying it looks like uint32 ids (little-endian: the high halves of ids
    below 65536 are 0), so the run would train on interleaved zeros; else ``""``. Reads the
    first 64K ids only."""
    if f.layout != "raw" or f.tokens.dtype != np.uint16 or f.n < 64:
        return ""
    head = np.asarray(f.tokens[: min(f.n, 1 << 16) // 2 * 2]).reshape(-1, 2)  # (k, 2)
    low_zero = float((head[:, 0] == 0).mean())
    high_zero = float((head[:, 1] == 0).mean())
    if high_zero > 0.99 and low_zero < 0.5:
        return (f"{str(f.path)!r} looks like uint32 token ids read as uint16 ({high_zero:.0%} "
                "of every second id is 0): set data.tokens_dtype: uint32")
    return ""


def _stats_path() -> Path:
    root = Path(os.environ.get("SPEEDTRONIC_CACHE_DIR") or Path.home() / ".cache" / "speedtronic")
    return root / "token-stats.json"


def max_token_id(f: TokenFile) -> int:
    """Largest id in a shard: from ``meta.json`` beside it, the stats cache, or one pass."""
    meta = f.path.parent / "meta.json"
    if meta.is_file():
        try:
            shards = json.loads(meta.read_text()).get("shards", {})
            if f.path.name in shards:
                return int(shards[f.path.name]["max_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    st = f.path.stat()
    # Everything that changes the ids is in the key: the same bytes read as uint16 and as uint32
    # (data.tokens_dtype), or with and without a header, have different largest ids.
    how = f"{f.layout}:{f.tokens.dtype.name}:{f.n}"
    key = hashlib.sha256(f"{f.path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{how}".encode()
                         ).hexdigest()
    cache_file = _stats_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return int(cache[key])
    # Through the checked pread reader, not the memory map: a file truncated during this pass
    # died of SIGBUS (no message), and the mapped pages stayed in the run's RSS (+293 MB for a
    # 300 MB file).
    top, reader = 0, TokenFileStore([f])
    try:
        for a in range(0, f.n, 1 << 24):
            top = max(top, int(reader._read_file(0, a, min(f.n, a + (1 << 24))).max()))
    finally:
        reader.close()
    cache[key] = top
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:  # a read-only cache only costs the pass again next time
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a full disk left one per run
    return top


class TokenFileStore(TokenStore):
    """Shards ``files`` read as one stream of ``n`` ids, or the range ``[start, stop)`` of it.

    Reads go through ``os.pread``, not the memory map: a file truncated under a running job (a
    flaky network mount) made a memory-mapped read die of SIGBUS (exit 135, no message, nothing
    saved); a short read is an error naming the file and offset. Each read also checks the
    file's size and mtime against those it was opened with (one ``fstat``), and, with
    ``vocab_size``, every id of the chunk (one ``max``, ~0.3 ms per 1M uint16 ids): a file
    rewritten with ids beyond the vocabulary once raised an IndexError traceback (a device-side
    assert on CUDA). A file *replaced* by rename is not an error: the open descriptor keeps
    reading the old, consistent one.
    """

    def __init__(self, files: list[TokenFile], start: int = 0, stop: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.files = files
        self.offsets = np.cumsum([0] + [f.n for f in files])  # (len(files) + 1,)
        total = int(self.offsets[-1])
        self.start = start
        self.stop = total if stop is None else stop
        self.n = self.stop - self.start
        self.vocab_size = vocab_size
        self._fds: dict[int, int] = {}

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self.files[i].path, os.O_RDONLY)
        return fd

    def _read_file(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Ids ``[lo, hi)`` of shard ``i``, read and checked (see the class docstring)."""
        f = self.files[i]
        itemsize = f.tokens.dtype.itemsize
        where = f.byte_offset + lo * itemsize
        try:
            fd = self._fd(i)
            st = os.fstat(fd)
            if f.stamp[0] >= 0 and (st.st_size, st.st_mtime_ns) != f.stamp:
                raise DataChangedError(
                    f"token file {str(f.path)!r} changed while the run read it (size "
                    f"{f.stamp[0]} -> {st.st_size} bytes, modified again) at byte {where}; "
                    "the run stopped before training on it. Replace token files by writing a "
                    "new file and renaming it over the old one, never in place")
            ids = np.empty(hi - lo, dtype=f.tokens.dtype)  # read straight into the array
            got = os.preadv(fd, [memoryview(ids).cast("B")], where) if ids.size else 0
        except OSError as exc:
            raise DataChangedError(f"token file {str(f.path)!r}: read at byte {where} failed "
                                   f"({exc.strerror or exc})") from None
        if got != ids.nbytes:
            raise DataChangedError(f"token file {str(f.path)!r} is shorter than when the run "
                                   f"opened it: wanted {ids.nbytes} bytes at byte {where}, got "
                                   f"{got} (truncated under the run?)")
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            bad = int(np.argmax(ids >= self.vocab_size))
            raise DataChangedError(f"token file {str(f.path)!r} holds id {int(ids[bad])} at "
                                   f"token {lo + bad} (byte {where + bad * itemsize}), beyond "
                                   f"model.vocab_size {self.vocab_size}; the file checked at "
                                   "start did not: was it rewritten under the run?")
        return ids

    def read(self, a: int, b: int) -> np.ndarray:
        a, b = a + self.start, b + self.start
        first = int(np.searchsorted(self.offsets, a, side="right")) - 1
        parts = []
        i = first
        while a < b:
            lo = a - int(self.offsets[i])
            hi = min(b, int(self.offsets[i + 1])) - int(self.offsets[i])
            parts.append(self._read_file(i, lo, hi))
            a += hi - lo
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict:  # DataLoader workers (spawned) open their own
        state = self.__dict__.copy()
        state["_fds"] = {}
        return state

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        return np.stack([self.read(int(s), int(s) + length) for s in starts])  # (k, length)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write ids with the modded-nanogpt / llm.c header (version 1 for uint16, 2 for uint32)."""
    version = 1 if tokens.dtype == np.uint16 else 2
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (HEADER_MAGIC, version, tokens.shape[0])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))  # no copy (tobytes: one)
    os.replace(tmp, path)
