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

This module owns the flow and its bookkeeping: the tokenizer, the cache key, the temporary
folder (stale ones, SIGTERM) and ``meta.json``. Reading and cutting the text is
:mod:`.prepare_sources`; the worker pool and the shard buffer are :mod:`.prepare_shards`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PureWindowsPath
from typing import Any

import numpy as np

from .._process import temp_owner_alive
from ..config import ConfigError, SpeedtronicConfig
from ..errors import Terminated, first_line
from . import prepare_sources
from .prepare_shards import SHARD_TOKENS, _write_shards  # noqa: F401 - SHARD_TOKENS: re-export
from .prepare_sources import _file_blocks, _hf_rows, text_files
from .token_files import expand_paths

__all__ = ["PreparedTokens", "load_tokenizer", "prepare", "prepared_dir", "text_files"]

logger = logging.getLogger("speedtronic.data")

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
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - any loader failure is the user's input
            raise ConfigError(f"data.tokenizer: cannot load {spec!r}: {first_line(exc)}") \
                from None
    if _names_a_local_tokenizer(spec):
        raise ConfigError(f"data.tokenizer: file not found: {spec!r}")
    try:
        return Tokenizer.from_pretrained(spec)
    except Exception as exc:  # noqa: BLE001 - the Hub's answer names what is wrong
        raise ConfigError(f"data.tokenizer: cannot load {spec!r}: no local file or folder of "
                          f"that name, and the Hub gave: {first_line(exc)} (a local "
                          "tokenizer.json works offline; HF_HUB_OFFLINE=1 reads the Hugging "
                          "Face cache without the Hub's retries)") from None


def _names_a_local_tokenizer(spec: str) -> bool:
    """Whether a ``data.tokenizer`` that is no existing file or folder can only have meant a
    local path. A Hub id is ``name`` or ``owner/name``: never absolute, never more than one
    ``/``, never a backslash, never a ``.json`` file. (Testing ``os.sep in spec`` refused every
    ``owner/name`` id on Linux and macOS and let ``C:\\tok`` through to the Hub on Windows.)"""
    return (spec.startswith(("/", "./", "../", "~", ".\\", "..\\"))
            or PureWindowsPath(spec).is_absolute() or "\\" in spec or spec.count("/") > 1
            or Path(spec).suffix == ".json")


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
        if local.is_file():  # one data file: its own name, never a glob ("train[1].jsonl")
            fp["files"] = _file_stamps([local])
        elif local.exists():  # a local folder: edited files must make new shards
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


_SAID_CACHED: set[Path] = set()
"""Prepared folders whose "already in" line this process has logged."""


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
        # said once per process: train's preflight and its data build both ask (twice in a log)
        (logger.debug if out in _SAID_CACHED else logger.info)(
            "prepare: %s tokens already in %s", f"{meta['tokens']:,}", out)
        _SAID_CACHED.add(out)
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
        # (read through the module: a test shrinks the block there)
        big = sum(1 for f in files if f.stat().st_size > prepare_sources._TEXT_BLOCK)
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
        except OSError:
            if not meta_path.is_file():  # not a lost race: the real error, not "no meta.json"
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: theirs
            return PreparedTokens(json.loads(meta_path.read_text()))
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # name the folder
            raise ConfigError(f"data.prepare_dir: writing the prepared tokens into "
                              f"{out.parent} failed: {exc.strerror} (free space there, or set "
                              "data.prepare_dir / SPEEDTRONIC_CACHE_DIR elsewhere)") from None
        raise
    except BaseException:  # any failure, Ctrl-C and SIGTERM included: leave no half-written
        shutil.rmtree(tmp, ignore_errors=True)  # folder behind
        raise
    logger.info("prepare: %s -> %s tokens in %d shard(s) at %s (%.1f s, %s tok/s, %d worker(s))",
                what, f"{total:,}", len(shards), out, seconds,
                f"{meta['tokens_per_second']:,}", workers)
    return meta
