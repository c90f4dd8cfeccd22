"""Where ``speedtronic prepare``'s text comes from, cut into tokenizer-sized blocks.

Each source yields ``(where, text)`` pairs for :mod:`.prepare_shards`: ``where`` names the file
or dataset row for error messages, and a text ending in ``"\x00EOD"`` ends its document. Text
files are read in ~1 MiB blocks cut only where the tokenizer splits anyway, so the ids equal
those of the whole file; a Hugging Face dataset gives one document per row, a huge row cut the
same way. The cutting rules live here, with the memory numbers that set them.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import importlib.util
import json
import logging
import lzma
import re
from collections.abc import Iterator
from pathlib import Path, PureWindowsPath
from typing import Any

from ..config import ConfigError, SpeedtronicConfig
from ..errors import brief, first_line
from .token_files import expand_paths

logger = logging.getLogger("speedtronic.data")

_TEXT_BLOCK = 1 << 20
"""Characters of a text file tokenized per task (split at a line end)."""


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


def _empty_parts(path: Path) -> list[str]:
    """The parts of a local ``hf_dataset`` that hold no rows, named for an error: an empty
    data file (compressed too), or a ``save_to_disk`` Dataset (or split of a DatasetDict) saved
    with none. ``datasets`` fails on each with a bare ``IndexError`` ("list index out of range")
    or ``StopIteration``, which said nothing about the cause."""
    if not path.exists():
        return []
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))  # .gitkeep
    empty = []
    for f in files:
        name = "the file" if f == path else str(f.relative_to(path))
        if f.name == "state.json":
            try:
                state = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(state, dict) and state.get("_data_files") == []:
                empty.append("the saved Dataset" if f.parent == path else
                             f"its saved split {f.parent.name!r}")
        elif f.name not in ("dataset_info.json", "dataset_dict.json") and _holds_no_bytes(f):
            empty.append(name)
    return empty


def _holds_no_bytes(f: Path) -> bool:
    """``f`` is 0 bytes long, or decompresses to 0 bytes (gz, bz2, xz)."""
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(f.suffix)
    try:
        if opener is None:
            return f.stat().st_size == 0
        with opener(f, "rb") as fh:
            return fh.read(1) == b""
    except (OSError, EOFError, lzma.LZMAError):
        return False


#: Data files ``data.hf_dataset`` may name by themselves, by suffix (before a compression
#: suffix), and the ``datasets`` builder that reads each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv",
                      ".parquet": "parquet", ".arrow": "arrow"}
#: Compression suffixes ``datasets`` reads, and the package each needs beyond the standard
#: library (the ``data`` extra installs neither: "Compression type zstd not supported" named
#: no package).
_COMPRESSION_SUFFIXES = {".gz": None, ".bz2": None, ".xz": None, ".zst": "zstandard",
                         ".lz4": "lz4"}


def _names_a_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path: a typo'd path was sent to the Hub, and the
    error said the Hub could not be reached (offline) or had no such dataset. Hub ids are never
    absolute, on any system (``C:\\data`` included)."""
    suffixes = [s for s in Path(name).suffixes if s not in _COMPRESSION_SUFFIXES]
    return (name.startswith(("/", "./", "../", "~", ".\\", "..\\"))
            or PureWindowsPath(name).is_absolute()
            or bool(suffixes and suffixes[-1] in DATA_FILE_BUILDERS))


def _load_data_file(datasets: Any, path: Path, config: str | None, split: str,
                    streaming: bool) -> Any:
    """One local data file as a dataset (``load_dataset`` took only folders and Hub names: a
    lone ``train.jsonl`` was looked up on the Hub). A file holds one split, ``train``."""
    suffixes = [s for s in path.suffixes if s not in _COMPRESSION_SUFFIXES]
    builder = DATA_FILE_BUILDERS.get(suffixes[-1] if suffixes else "")
    if suffixes and suffixes[-1] == ".txt":  # datasets' text builder: a document per line
        raise ConfigError(f"data.hf_dataset: {str(path)!r} is plain text: set data.text_path "
                          "to it instead (with data.tokenizer), which reads it as one stream; "
                          "hf_dataset would make every line a document")
    if builder is None:
        raise ConfigError(f"data.hf_dataset: {str(path)!r} is not a data file this reads; "
                          f"name a {', '.join(DATA_FILE_BUILDERS)} file (optionally "
                          "compressed), a folder of them, or a save_to_disk copy")
    if config is not None:
        raise ConfigError(f"data.hf_config: {str(path)!r} is one data file, which has no "
                          f"configurations; leave hf_config unset (got {config!r})")
    if split != "train":
        raise ConfigError(f"data.hf_split: {str(path)!r} is one data file, read as the "
                          f"'train' split, not {split!r}; set hf_split: train (or keep each "
                          "split in its own file and name that file)")
    package = _COMPRESSION_SUFFIXES.get(path.suffix)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"data.hf_dataset: {str(path)!r} is {path.suffix}-compressed, which "
                          f"needs the {package!r} package: pip install {package}")
    extra = {"delimiter": "\t"} if suffixes[-1] == ".tsv" else {}
    # escaped: data_files is a glob pattern, and "train[1].jsonl" matched nothing
    return datasets.load_dataset(builder, data_files=glob.escape(str(path)), split="train",
                                 streaming=streaming, **extra)


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
        elif path.is_file():
            ds = _load_data_file(datasets, path, d.hf_config, d.hf_split, d.hf_streaming)
        else:  # a Hub name, or a local folder of json/csv/parquet files ("~" expanded)
            if not path.exists() and _names_a_local_path(str(d.hf_dataset)):
                raise ConfigError(f"data.hf_dataset: no such file or folder: "
                                  f"{d.hf_dataset!r} (give a data file, a folder of them, a "
                                  "save_to_disk copy, or a Hub name such as 'owner/name')")
            ds = datasets.load_dataset(str(path) if path.exists() else str(d.hf_dataset),
                                       d.hf_config, split=d.hf_split, streaming=d.hf_streaming)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - report what the library said, in one line
        empty = _empty_parts(path) if isinstance(exc, (IndexError, StopIteration)) else []
        if empty:
            raise ConfigError(f"data.hf_dataset: cannot load {d.hf_dataset!r}: "
                              f"{', '.join(empty)} {'holds' if len(empty) == 1 else 'hold'} no "
                              f"rows, which the datasets library fails on "
                              f"({type(exc).__name__}); remove or fill it") from None
        first = first_line(exc)
        offline = "" if path.exists() else (
            " (offline: HF_HUB_OFFLINE=1 reads the Hugging Face cache without the Hub's "
            "retries; a local data file or folder needs no network)")
        raise ConfigError(f"data.hf_dataset: cannot load {d.hf_dataset!r} (split "
                          f"{d.hf_split!r}): {first}{offline}") from None
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
