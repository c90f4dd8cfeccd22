"""Token files that change under a running job: truncated (a flaky mount) or rewritten in place.
Each is one clear error naming the file and offset, never a SIGBUS death or an IndexError, and
no checkpoint written after it. Also the raw-.bin dtype heuristic."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from _engine_fixtures import one_thread  # noqa: F401
from _process_fixtures import launch_cli, resume_run, wait_for_pause

from speedtronic.config import load_config
from speedtronic.data import check_data
from speedtronic.data.token_files import DataChangedError, TokenFileStore, open_token_file
from speedtronic.train.checkpoint import CheckpointManager


def _raw_tokens(path: Path, n: int = 40_000, vocab: int = 256, dtype=np.uint16) -> Path:
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, n).astype(dtype).tofile(path)
    return path


def _cfg(tmp_path: Path, tokens: Path) -> Path:
    raw = {"run": {"name": "live", "output_dir": str(tmp_path), "max_steps": 12,
                   "eval_every": 0, "seed": 3},
           "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32,
                     "vocab_size": 256},
           "data": {"tokens_path": str(tokens), "micro_batch_size": 4},
           "logging": {"every_steps": 2, "progress_bar": False},
           "checkpoint": {"every_steps": 2}, "shape_validation": {"enabled": False}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_a_token_file_changed_under_a_live_run_is_one_line_exit_2(tmp_path, change):
    """Truncated: the memory-mapped read died of SIGBUS (exit 135, no message, nothing
    saved). Rewritten with ids >= vocab: an IndexError traceback."""
    tokens = _raw_tokens(tmp_path / "train.bin")
    proc = launch_cli(tmp_path, _cfg(tmp_path, tokens), 4, stdin=__import__("subprocess").PIPE,
                      PAUSE="1", TOKEN_CHUNK="256")
    wait_for_pause(proc)
    if change == "truncate":
        os.truncate(tokens, tokens.stat().st_size // 8)
    else:
        np.full(40_000, 60_000, np.uint16).tofile(tokens)  # same size, in place
    _, err = resume_run(proc)
    assert proc.returncode == 2, err[-2000:]
    assert "Traceback" not in err and "train.bin" in err
    assert ("shorter than when the run opened it" in err or "changed while the run read it"
            in err) and "byte" in err
    ckpts = CheckpointManager(tmp_path / "live" / "checkpoints")
    state, path = ckpts.load_latest()  # every committed checkpoint verifies and loads
    assert state["step"] <= 12 and path.exists()


def test_ids_beyond_the_vocabulary_are_caught_per_chunk(tmp_path):
    """A rewrite that keeps size and mtime (a restore from a copy, say) still cannot feed an
    out-of-range id to the embedding: each chunk's largest id is checked."""
    tokens = _raw_tokens(tmp_path / "t.bin")
    f = open_token_file(tokens, "auto", "data.tokens_path")
    store = TokenFileStore([f], vocab_size=256)
    assert store.read(0, 100).max() < 256
    stamp = tokens.stat()
    ids = np.fromfile(tokens, dtype=np.uint16)
    ids[5000] = 999
    ids.tofile(tokens)
    os.utime(tokens, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    with pytest.raises(DataChangedError, match=r"holds id 999 at token 5000 .*model.vocab_size"):
        store.read(4096, 8192)


def test_a_file_replaced_by_rename_keeps_reading_the_old_one(tmp_path):
    tokens = _raw_tokens(tmp_path / "t.bin")
    store = TokenFileStore([open_token_file(tokens, "auto", "k")], vocab_size=256)
    before = store.read(0, 1000).copy()
    new = _raw_tokens(tmp_path / "new.bin", n=100)
    os.replace(new, tokens)  # the safe way to update a token file
    assert np.array_equal(store.read(0, 1000), before)


def test_uint32_ids_read_as_uint16_are_warned_about(tmp_path, caplog):
    """A raw uint32 .bin read as the default uint16 trained on interleaved zeros silently."""
    tokens = _raw_tokens(tmp_path / "wide.bin", n=20_000, vocab=256, dtype=np.uint32)
    cfg = load_config({"model": {"vocab_size": 256},
                       "data": {"tokens_path": str(tokens)},
                       "run": {"output_dir": str(tmp_path)}})
    with caplog.at_level(logging.WARNING, "speedtronic"):
        check_data(cfg)
    assert "looks like uint32 token ids read as uint16" in caplog.text
    assert "data.tokens_dtype: uint32" in caplog.text
    caplog.clear()
    narrow = _raw_tokens(tmp_path / "narrow.bin", n=20_000, vocab=256)
    cfg.data.tokens_path = str(narrow)
    with caplog.at_level(logging.WARNING, "speedtronic"):
        check_data(cfg)
    assert "looks like uint32" not in caplog.text
