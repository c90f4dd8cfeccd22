"""Data checks that need no torch: the token files a config names open and fit its vocabulary.

Shared by the run builder (``check_data``, before the model is built) and ``speedtronic
validate`` (which must not import torch). ``_token_paths`` prepares a text source first; the
data builder reads the same paths.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import ConfigError, SpeedtronicConfig
from .token_files import (
    header_hint,
    max_token_id,
    open_token_file,
    raw_dtype_hint,
    split_token_paths,
)

logger = logging.getLogger("speedtronic.data")

__all__ = ["check_data"]


def _token_paths(cfg: SpeedtronicConfig) -> tuple[str, str | None, str]:
    """(train spec, eval spec or None, what) for token files, preparing text sources first."""
    d = cfg.data
    if d.tokens_path is not None:
        return d.tokens_path, d.eval_tokens_path, f"token files {d.tokens_path}"
    from .prepare import prepare

    meta = prepare(cfg)
    return str(meta.directory), None, (f"{meta['tokens']:,} tokens of {d.hf_dataset or d.text_path}"
                                       f" (tokenizer {d.tokenizer}, prepared in {meta.directory})")


def check_data(cfg: SpeedtronicConfig) -> None:
    """Fail early, before the model is built: prepare a text source if needed, open every token
    file, and settle ``model.vocab_size`` against the data (set from the tokenizer when None;
    otherwise it must exceed every id). Raises ConfigError naming the key and both numbers."""
    d = cfg.data
    if d.tokens_path is None and d.tokenizer is None:
        return
    spec, eval_spec, _ = _token_paths(cfg)  # prepares a tokenizer source (meta.json: its vocab)
    train_paths, eval_paths = split_token_paths(spec, eval_spec)
    paths = ([("data.tokens_path", p) for p in train_paths]
             + [("data.eval_tokens_path", p) for p in eval_paths])
    meta = Path(spec) / "meta.json"
    vocab_from_data: int | None = None
    if meta.is_file():
        vocab_from_data = int(json.loads(meta.read_text()).get("vocab_size") or 0) or None
    top, where, hint = -1, "", ""
    for key, path in paths:
        f = open_token_file(path, d.tokens_dtype, key)
        top_here, hint_here = max_token_id(f), header_hint(f)
        dtype_hint = raw_dtype_hint(f)
        if dtype_hint:
            logger.warning("data: %s %s", key, dtype_hint)
        if hint_here:  # the ids may fit the vocabulary and still be a header read as tokens
            logger.warning("data: %s %r is read as raw %s ids%s", key, str(path),
                           f.tokens.dtype.name, hint_here)
        if top_here > top:
            top, where, hint = top_here, f"{key} {str(path)!r}", hint_here
    if cfg.model.vocab_size is None:
        if vocab_from_data is None:
            raise ConfigError(f"model.vocab_size: required for token files without a tokenizer; "
                              f"the largest id in the data is {top} ({where}{hint}), so it must "
                              f"be at least {top + 1}")
        cfg.model.vocab_size = vocab_from_data
        logger.info("data: model.vocab_size = %d (from the tokenizer)", vocab_from_data)
    # the tokenizer's vocabulary first: the ids of its shards only bound it from below (a
    # vocab of 100 against a 500-id tokenizer once asked for 446, then for 500)
    if vocab_from_data is not None and cfg.model.vocab_size < vocab_from_data:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary of {vocab_from_data} ({d.tokenizer}); set it "
                          f">= {vocab_from_data} or leave it null (= the tokenizer's)")
    if top >= cfg.model.vocab_size:
        # two uint16 ids read as one uint32 give ~ next_id * 65536: far above any real vocab
        if not hint and top >= 1 << 24 and d.tokens_dtype == "uint32":
            hint = (" (ids this large usually mean uint16 ids read as uint32: try "
                    "data.tokens_dtype: uint16 or auto)")
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is too small for the data: "
                          f"{where} holds token id {top}{hint}; set model.vocab_size >= "
                          f"{top + 1}")
