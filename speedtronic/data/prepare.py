"""``speedtronic prepare``: text (files or a Hugging Face dataset) -> token shards, once.

A real subword tokenizer (``data.tokenizer``: a local ``tokenizer.json`` or, online, a Hub name
for :meth:`tokenizers.Tokenizer.from_pretrained`) turns the source into ids, in parallel worker
processes, with a progress bar. Output: ``shard_000000.bin`` ... (the modded-nanogpt header, see
:mod:`.token_files`) and a ``meta.json`` with the vocabulary size, the tokenizer and source
fingerprints and the largest id of every shard, in
``data.prepare_dir`` (default ``<cache>/tokens/<key>``). The key hashes the tokenizer's
serialized form and the source (paths, sizes and modification times; or the dataset's name,
config, split and field, plus its files' paths, sizes and modification times when it is a local
folder), so a second run, or a training run, finds the shards instead of tokenizing again.
``speedtronic train`` prepares automatically on first use. A failed or interrupted prepare
(Ctrl-C, or SIGTERM: it raises :class:`~speedtronic.errors.Terminated` on the main thread while
a prepare runs, unless someone else handles SIGTERM) removes its temporary folder
``<key>.tmp-<host>-<pid>``; one left by a prepare killed outright (SIGKILL, a second SIGTERM) is
removed by the next prepare under the same folder, once its process is gone.

Documents are separated by the tokenizer's end-of-text token when it has one (``<|endoftext|>``,
``</s>``, ``<eos>``, ``[SEP]``); a text file is one document, a dataset row is one document.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import multiprocessing.context
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._process import temp_owner_alive
from ..config import ConfigError, SpeedtronicConfig
from ..errors import Terminated, brief
from .token_files import expand_paths, write_shard

__all__ = ["PreparedTokens", "load_tokenizer", "prepare", "prepared_dir", "text_files"]

logger = logging.getLogger("speedtronic.data")

SHARD_TOKENS = 1 << 26
"""Tokens per output shard (128 MiB of uint16)."""
_TEXT_BLOCK = 1 << 20
"""Characters of a text file tokenized per task (split at a line end)."""
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""End-of-document tokens, first found wins: GPT-2 / Qwen, Llama 3 (its base models' document
end; ``<|eot_id|>`` ends a chat turn), Llama 2 / Mistral, Gemma, BERT."""


class PreparedTokens(dict):
    """``meta.json`` of a prepared directory (a dict), plus its path."""

    @property
    def directory(self) -> Path:
        return Path(self["directory"])


def load_tokenizer(spec: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a local file/directory or a Hub name; ConfigError if not."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer needs the 'tokenizers' package: pip install "
                          "'speedtronic[data]'") from None
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer: folder {spec!r} holds no tokenizer.json (give "
                              "the tokenizer.json file, or a folder that has one)")
        path = path / "tokenizer.json"
    try:
        if path.is_file():
            return Tokenizer.from_file(str(path))
        if path.suffix == ".json" or os.sep in spec:
            raise ConfigError(f"data.tokenizer: file not found: {spec!r}")
        return Tokenizer.from_pretrained(spec)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loader failure is the user's input
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.tokenizer: cannot load {spec!r}: {first} (a local "
                          "tokenizer.json works offline)") from None


def _prepends(tokenizer: Any) -> bool:
    """Whether the tokenizer's normalizer prepends to every call (Llama 2 / Mistral style
    ``Prepend("▁")``): then each block of a file starts with one, where the whole file has one
    only at its start."""
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "Prepend" or any(walk(v) for v in node.values())
        return isinstance(node, list) and any(walk(v) for v in node)

    try:
        return walk(json.loads(tokenizer.to_str()).get("normalizer"))
    except (AttributeError, ValueError):  # not a tokenizers.Tokenizer: nothing to say
        return False


def eos_id(tokenizer: Any) -> int | None:
    for name in _EOS_NAMES:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


def text_files(spec: str, exclude: Path | None = None) -> list[Path]:
    """The UTF-8 files named by ``data.text_path``: a file, a glob, or a directory (recursive),
    leaving out anything under ``exclude`` (the prepared-token folder: inside ``text_path`` its
    own shards were read back as text, a new, larger corpus on every run)."""
    files = expand_paths(spec, "data.text_path", recursive=True)
    if exclude is None:
        return files
    root = exclude.expanduser().resolve()
    kept = [p for p in files if root not in p.resolve().parents]
    if not kept:
        raise ConfigError(f"data.text_path: every file under {spec!r} is inside the prepared-token "
                          f"folder {str(root)!r}; point text_path at the text itself")
    return kept


def prepared_root(cfg: SpeedtronicConfig) -> Path:
    """The folder prepared tokens go under: ``data.prepare_dir`` or the cache's ``tokens/``."""
    if cfg.data.prepare_dir:
        return Path(cfg.data.prepare_dir).expanduser()
    root = Path(os.environ.get("SPEEDTRONIC_CACHE_DIR") or Path.home() / ".cache" / "speedtronic")
    return root / "tokens"


def _file_stamps(files: list[Path]) -> list[list[Any]]:
    stamps: list[list[Any]] = []
    for p in files:
        st = p.stat()
        stamps.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return stamps


def _source_fingerprint(cfg: SpeedtronicConfig) -> dict[str, Any]:
    d = cfg.data
    if d.hf_dataset is not None:
        fp: dict[str, Any] = {"hf_dataset": d.hf_dataset, "config": d.hf_config,
                              "split": d.hf_split, "text_field": d.text_field,
                              "empty_rows": "skipped"}  # were one end-of-text token each
        local = Path(str(d.hf_dataset)).expanduser()
        if local.exists():  # a local folder/file: edited files must make new shards
            fp["files"] = _file_stamps(expand_paths(str(local), "data.hf_dataset",
                                                    recursive=True))
        return fp
    return {"text_files": _file_stamps(text_files(str(d.text_path), prepared_root(cfg)))}


def prepared_dir(cfg: SpeedtronicConfig, tokenizer: Any) -> tuple[Path, str]:
    """Where the shards of this tokenizer + source live, and the cache key."""
    blob = json.dumps({"tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
                       "source": _source_fingerprint(cfg), "format": 1}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return prepared_root(cfg) / key, key


def _check_saved_split(ds: Any, name: Any, split: str, config: str | None) -> None:
    """A ``save_to_disk`` copy of one Dataset has no splits to choose from: ``hf_split`` must be
    the split it was saved from (``train`` when it records none), and ``hf_config`` unset. Both
    were ignored: ``hf_split: validation`` tokenized the train rows, and the log said
    ``[validation]``."""
    saved = getattr(ds, "split", None)
    saved = None if saved is None else str(saved)
    if config is not None:
        raise ConfigError(f"data.hf_config: {name!r} is one saved Dataset, which has no "
                          f"configurations; leave hf_config unset (got {config!r})")
    if (saved or "train") != split:
        what = f"the {saved!r} split" if saved else "no split (read as 'train')"
        raise ConfigError(f"data.hf_split: {name!r} is one saved Dataset, of {what}, not "
                          f"{split!r}; point data.hf_dataset at the DatasetDict folder to choose "
                          f"a split, or set hf_split: {saved or 'train'}")


def _hf_rows(cfg: SpeedtronicConfig) -> Iterator[tuple[str, str]]:
    """(where, text) for each row of the dataset; ``where`` names the row for errors."""
    d = cfg.data
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.hf_dataset needs the 'datasets' package: pip install "
                          "'speedtronic[data]'") from None
    path = Path(str(d.hf_dataset)).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists()
                              or (path / "state.json").exists()
                              or (path / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(path))  # a save_to_disk() copy
            if isinstance(ds, datasets.DatasetDict):
                if d.hf_split not in ds:
                    raise ConfigError(f"data.hf_split: {d.hf_split!r} is not a split of "
                                      f"{d.hf_dataset!r}; it has {sorted(ds)}")
                ds = ds[d.hf_split]
            else:
                _check_saved_split(ds, d.hf_dataset, d.hf_split, d.hf_config)
        else:  # a Hub name, or a local folder of json/csv/parquet files ("~" expanded)
            ds = datasets.load_dataset(str(path) if path.exists() else str(d.hf_dataset),
                                       d.hf_config, split=d.hf_split, streaming=d.hf_streaming)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - report what the library said, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.hf_dataset: cannot load {d.hf_dataset!r} (split "
                          f"{d.hf_split!r}): {first}") from None
    columns = getattr(ds, "column_names", None)
    if columns is not None and d.text_field not in columns:
        raise ConfigError(f"data.text_field: {d.text_field!r} is not a column of "
                          f"{d.hf_dataset!r}; columns: {sorted(columns)}")
    empty = 0
    for i, row in enumerate(ds):
        if d.text_field not in row:
            raise ConfigError(f"data.text_field: {d.text_field!r} is not a field of "
                              f"{d.hf_dataset!r}; fields: {sorted(row)}")
        where = f"data.hf_dataset {str(d.hf_dataset)!r} [{d.hf_split}] row {i}"
        value = row[d.text_field]
        # str(None) once trained on the word "None", once per null row; an empty row was a
        # lone end-of-text token (a third of WikiText's rows: runs of them)
        if value is None or value == "":
            empty += 1
            continue
        if not isinstance(value, str):
            raise ConfigError(f"data.text_field: {where} holds a {type(value).__name__}, not "
                              f"text ({brief(value)}); name a column of strings")
        text = value
        limit = _FORCED_CUT_BLOCKS * _TEXT_BLOCK
        while len(text) > limit:  # one huge row must not be one tokenizer call (see below)
            cut = _block_cut(text[:limit], any_newline=True) or limit
            logger.debug("data: %s: a cut at character %d bounds memory", where, cut)
            yield where, text[:cut]
            text = text[cut:]
        yield where, text + "\x00EOD"
    if empty:
        logger.warning("data: %d row(s) of %r with a null or empty %s were skipped", empty,
                       str(d.hf_dataset), d.text_field)


# Where byte-level BPE (GPT-2 and cl100k style patterns) and SentencePiece-style Metaspace all
# split text into the same pieces on both sides of a cut, whatever comes after the cut.
_SAFE_CUTS = (
    re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])"),  # before the one space between two letters
    re.compile(r"(?<=\S)\n(?=\S)"),              # after a newline standing alone
)


def _last_match(pattern: re.Pattern[str], text: str, floor: int) -> int:
    """End of the last match of ``pattern`` in ``text[floor:]`` (0 for none), searching back
    from the end in growing windows: one C-speed scan of the tail in the common case."""
    window = 1 << 16
    while True:
        start = max(floor, len(text) - window)
        end = 0
        for m in pattern.finditer(text, start):  # lookbehinds still see text before start
            end = m.end()
        if end or start == floor:
            return end
        window *= 8


def _block_cut(text: str, any_newline: bool, searched: int = 0) -> int:
    """Where to end a block of ``text`` (0: read on), so that tokenizing the blocks one by one
    gives the ids of the whole file: before the last single space between two letters, else
    after the last newline between two non-space characters (text without spaces), else, if
    ``any_newline``, after the last newline.

    A cut inside a whitespace run did not keep the ids: a block ending in ``"\\n\\n"`` gave one
    token where the whole file has two (2 tokens off in 3 MB of code). ``text[:searched]`` is
    known to hold no safe cut (the text read on from)."""
    floor = max(0, searched - 2)  # a match needs the character after it, unseen back then
    for pattern in _SAFE_CUTS:
        cut = _last_match(pattern, text, floor)
        if cut:
            return cut - 1 if pattern is _SAFE_CUTS[0] else cut
    return text.rfind("\n") + 1 if any_newline else 0


#: Text read on without any cut point before a cut is forced. One tokenizer call holds ~200
#: bytes per character of text without spaces (byte-level BPE, 1 MiB of letters: +196 MiB
#: peak RSS, 4 MiB: +810 MiB), so a 40 MB minified line once peaked at 7.6 GB; 8 blocks bound
#: a call near 1.6 GB whatever the line length.
_FORCED_CUT_BLOCKS = 8


class _Utf8Counter:
    """``errors=`` handler for text files: replaces undecodable bytes with U+FFFD, as before,
    and counts them so ``prepare`` can say so (the replacement used to be silent)."""

    name = "speedtronic-count-replace"

    def __init__(self) -> None:
        self.bad = 0
        codecs.register_error(self.name, self)

    def __call__(self, exc: UnicodeError) -> tuple[str, int]:
        if not isinstance(exc, UnicodeDecodeError):
            raise exc
        self.bad += exc.end - exc.start
        return "\ufffd", exc.end


_UTF8 = _Utf8Counter()


def _file_blocks(files: list[Path]) -> Iterator[tuple[str, str]]:
    """Each file in blocks of about 1 MiB (see :func:`_block_cut`), as (where, text); a file's
    last block ends its document."""
    for path in files:
        where = f"data.text_path file {str(path)!r}"
        bad_before, forced = _UTF8.bad, 0
        with open(path, encoding="utf-8", errors=_UTF8.name) as fh:
            carry, seen = "", False
            while True:
                chunk = fh.read(_TEXT_BLOCK)
                if not chunk:
                    break
                text = carry + chunk
                # Without a clean cut, read on (up to 8 blocks: a file of only indented lines
                # must not become one block), then cut at any newline.
                long = len(text) >= _FORCED_CUT_BLOCKS * _TEXT_BLOCK
                cut = _block_cut(text, any_newline=long, searched=len(carry))
                if cut <= 0 and long:  # not even a newline: force one, memory stays bounded
                    space = max(text.rfind(" "), text.rfind("\t"))
                    cut = space + 1 if space > 0 else len(text)
                    forced += 1
                if cut <= 0:
                    carry = text
                    continue
                seen = True
                yield where, text[:cut]
                carry = text[cut:]
            if seen or carry:  # an empty file is no document (no end-of-text token either)
                yield where, carry + "\x00EOD"  # marker: end of this document
        if forced:
            logger.warning("data: %s has %d stretch(es) of %d MiB without a newline; cut there "
                           "anyway to bound memory (the few ids at such a cut may differ from "
                           "tokenizing the whole line)", where, forced,
                           _FORCED_CUT_BLOCKS * _TEXT_BLOCK >> 20)
        if _UTF8.bad > bad_before:
            logger.warning("data: %s is not valid UTF-8: %d byte(s) were replaced by U+FFFD "
                           "(re-encode it as UTF-8 to keep them)", where, _UTF8.bad - bad_before)


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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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


def _host() -> str:
    """This host's name as it may stand in a folder name (a shared cache sees several)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


_TEMP_RE = re.compile(r"[0-9a-f]{16}\.tmp-(?:(?P<host>.*)-)?\d+")
"""``<key>.tmp-<host>-<pid>``: a prepare's folder while it writes (``<key>.tmp-<pid>`` before
the host was part of the name)."""


def _remove_stale_temps(root: Path) -> None:
    """Remove the temporary folders under ``root`` whose prepare is gone (killed outright:
    SIGKILL, the OOM killer, a second signal). Only this host's: a cache shared with other
    hosts holds their live ones, whose pids mean nothing here."""
    try:
        entries = list(root.iterdir())
    except OSError:  # no cache folder yet, or none we may read
        return
    host = _host()
    for path in entries:
        match = _TEMP_RE.fullmatch(path.name)
        if match is None or match["host"] not in (None, host) or not path.is_dir():
            continue
        if temp_owner_alive(path):  # a prepare running now, in another process
            continue
        if path.name.endswith(f"-{os.getpid()}"):  # this process's: another thread's, live
            continue
        logger.info("prepare: removing %s (left by an interrupted prepare, pid %s)", path,
                    path.name.rsplit("-", 1)[-1])
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises :class:`Terminated` on the main thread, as Ctrl-C raises
    KeyboardInterrupt, so the cleanup that removes the temporary folder runs (SIGTERM's default
    action ended the process at once and left the folder, and the pool's workers printed
    BrokenPipeError tracebacks). Only where SIGTERM has its default action: a handler someone
    else installed (a training run's PreemptionGuard, a program that calls prepare) is left
    alone, and so is a thread other than the main one, where Python runs no handler. A second
    SIGTERM, during the cleanup, ends the process at once (the next prepare removes the
    folder); the previous handler is back when the block ends."""
    term = getattr(signal, "SIGTERM", None)
    if (term is None or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(term) is not signal.SIG_DFL):
        yield
        return
    previous = signal.getsignal(term)

    def handle(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise Terminated(signum)

    signal.signal(term, handle)
    try:
        yield
    finally:
        signal.signal(term, previous)


def prepare(cfg: SpeedtronicConfig, *, workers: int | None = None,
            progress: bool | None = None) -> PreparedTokens:
    """Tokenize ``cfg``'s text source into shards (or find them); returns their ``meta.json``."""
    d = cfg.data
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers <= 0):
        raise ConfigError(f"prepare: workers must be a positive integer (tokenizer processes), "
                          f"got {workers!r}")
    if d.tokenizer is None:
        raise ConfigError("data.tokenizer: prepare needs a tokenizer (a tokenizer.json path or a "
                          "Hub name)")
    if d.text_path is None and d.hf_dataset is None:
        raise ConfigError("data: prepare needs data.text_path or data.hf_dataset to tokenize")
    tokenizer = load_tokenizer(d.tokenizer)
    out, key = prepared_dir(cfg, tokenizer)
    _remove_stale_temps(out.parent)
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = PreparedTokens(json.loads(meta_path.read_text()))
        logger.info("prepare: %s tokens already in %s", f"{meta['tokens']:,}", out)
        return meta
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    eos = eos_id(tokenizer)
    if eos is None:
        logger.warning("prepare: the tokenizer has none of the end-of-text tokens %s: documents "
                       "are joined without a separator, and sample has no stop token",
                       ", ".join(_EOS_NAMES))
    if d.hf_dataset is not None:
        texts: Iterator[tuple[str, str]] = _hf_rows(cfg)
        what = f"dataset {d.hf_dataset} [{d.hf_split}].{d.text_field}"
    else:
        files = text_files(str(d.text_path), prepared_root(cfg))
        texts = _file_blocks(files)
        big = sum(1 for f in files if f.stat().st_size > _TEXT_BLOCK)
        if big and _prepends(tokenizer):
            logger.warning("prepare: the tokenizer's normalizer prepends to every call (Llama 2 "
                           "/ Mistral style), and %d file(s) are tokenized in ~1 MiB blocks: "
                           "each block after a file's first starts with one extra piece (about "
                           "one token per MiB more than the whole file would give)", big)
        what = f"{len(files)} text file(s) under {d.text_path}"
    workers = workers or d.prepare_workers or max(1, (os.cpu_count() or 1))
    show = progress if progress is not None else (cfg.logging.progress_bar and
                                                  os.isatty(2))
    tmp = out.with_name(f"{out.name}.tmp-{_host()}-{os.getpid()}")
    with _sigterm_raises():
        return _prepare_into(tmp, out, key, cfg, texts, tokenizer, eos, vocab, dtype, what,
                             workers, show)


def _prepare_into(tmp: Path, out: Path, key: str, cfg: SpeedtronicConfig,
                  texts: Iterator[tuple[str, str]], tokenizer: Any, eos: int | None, vocab: int,
                  dtype: type[np.unsignedinteger], what: str, workers: int,
                  show: bool) -> PreparedTokens:
    """:func:`prepare`'s writing half: shards into ``tmp``, renamed to ``out`` when whole."""
    d = cfg.data
    meta_path = out / "meta.json"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only cache: name the key
        where = "data.prepare_dir" if d.prepare_dir else "the token cache (SPEEDTRONIC_CACHE_DIR)"
        raise ConfigError(f"{where}: cannot create {str(out.parent)!r} ({exc.strerror or exc}); "
                          "give a folder that can be written") from None
    t0 = time.perf_counter()
    try:
        shards, total = _write_shards(tmp, texts, tokenizer, eos, str(d.tokenizer), dtype,
                                      workers, show)
        if total == 0:
            raise ConfigError(f"data: the tokenizer produced no tokens from {what}; is the "
                              "source empty?")
        seconds = time.perf_counter() - t0
        meta = PreparedTokens(
            format=1, key=key, directory=str(out), tokenizer=str(d.tokenizer), vocab_size=vocab,
            eos_id=eos, dtype=np.dtype(dtype).name, source=_source_fingerprint(cfg),
            tokens=total, shards=shards, seconds=round(seconds, 2), workers=workers,
            tokens_per_second=round(total / max(seconds, 1e-9)))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, out)  # the directory appears whole or not at all
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return PreparedTokens(json.loads(meta_path.read_text()))
    except BaseException:  # any failure, Ctrl-C and SIGTERM included: leave no half-written
        shutil.rmtree(tmp, ignore_errors=True)  # folder behind
        raise
    logger.info("prepare: %s -> %s tokens in %d shard(s) at %s (%.1f s, %s tok/s, %d worker(s))",
                what, f"{total:,}", len(shards), out, seconds,
                f"{meta['tokens_per_second']:,}", workers)
    return meta
