"""Pre-tokenized token files (data/token_files.py): formats, memory maps, sharded streams, exact
resume mid-shard, and every bad-input case as a ConfigError before the model is built."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _data_fixtures import assert_same, take

from speedtronic.cli import main
from speedtronic.config import ConfigError, load_config
from speedtronic.data import build_data, check_data
from speedtronic.data.token_files import (
    HEADER_MAGIC,
    LLAMA3_MAGIC,
    TokenFileStore,
    expand_paths,
    max_token_id,
    open_token_file,
    resolve_token_paths,
    write_shard,
)

MODEL = {"max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16}


def cfg(tmp_path, data: dict, **model):
    return load_config({"model": {**MODEL, **model}, "data": {"micro_batch_size": 4, **data},
                        "run": {"output_dir": str(tmp_path / "runs"), "name": "t",
                                "max_steps": 2, "eval_every": 0, "device": "cpu"},
                        "checkpoint": {"enabled": False}, "logging": {"progress_bar": False}})


def ids(n: int, start: int = 0, vocab: int = 1000) -> np.ndarray:
    return ((np.arange(start, start + n) * 7) % vocab).astype(np.uint16)


@pytest.mark.parametrize("layout", ["raw", "header", "npy", "header_uint32"])
def test_every_layout_reads_back_the_same_ids_as_a_memory_map(tmp_path, layout):
    tokens = ids(5000)
    if layout == "raw":
        path = tmp_path / "train.bin"
        tokens.tofile(path)
    elif layout == "npy":
        path = tmp_path / "train.npy"
        np.save(path, tokens)
    else:
        path = tmp_path / "shard.bin"
        write_shard(path, tokens.astype(np.uint32) if layout == "header_uint32" else tokens)
        assert np.fromfile(path, np.int32, 1)[0] == HEADER_MAGIC
    f = open_token_file(path, "auto", "data.tokens_path")
    assert isinstance(f.tokens, np.memmap) and f.n == 5000
    np.testing.assert_array_equal(np.asarray(f.tokens), tokens)


def test_shards_form_one_stream_and_windows_cross_shard_boundaries(tmp_path):
    parts = [ids(1000, 0), ids(700, 1000), ids(1300, 1700)]
    for i, p in enumerate(parts):
        write_shard(tmp_path / f"s_{i:03d}.bin", p)
    files = [open_token_file(p, "auto", "k") for p in resolve_token_paths(str(tmp_path), "k")]
    whole = np.concatenate(parts)
    store = TokenFileStore(files)
    assert store.n == 3000
    np.testing.assert_array_equal(store.read(950, 1750), whole[950:1750])
    tail = TokenFileStore(files, 2500, 3000)
    np.testing.assert_array_equal(tail.read(0, 500), whole[2500:])
    np.testing.assert_array_equal(store.gather(np.array([990, 1690]), 20),
                                  np.stack([whole[990:1010], whole[1690:1710]]))


def test_training_batches_shift_once_and_resume_exactly_mid_shard(tmp_path, monkeypatch):
    import speedtronic.data.build as build_mod

    monkeypatch.setattr(build_mod, "TOKEN_CHUNK", 256)  # several chunks per shard
    for i in range(3):
        write_shard(tmp_path / f"train_{i:03d}.bin", ids(2000, 2000 * i))
    c = cfg(tmp_path, {"tokens_path": str(tmp_path / "train_*.bin")}, vocab_size=1000)
    bundle = build_data(c)
    first = take(bundle.train, 7)
    for x, y in first:
        assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    state = bundle.train.state_dict()
    after = take(bundle.train, 9)
    again = build_data(c)
    again.train.load_state_dict(state)
    assert_same(take(again.train, 9), after)
    eval_a, eval_b = bundle.eval_batches(2), build_data(c).eval_batches(2)
    assert_same(eval_a, eval_b)


def test_separate_eval_file(tmp_path):
    np.save(tmp_path / "train.npy", ids(4000))
    np.save(tmp_path / "val.npy", ids(600, 123))
    c = cfg(tmp_path, {"tokens_path": str(tmp_path / "train.npy"),
                       "eval_tokens_path": str(tmp_path / "val.npy")}, vocab_size=1000)
    bundle = build_data(c)
    assert bundle.train.store.n == 4000 and "600 eval" in bundle.description


def test_ids_beyond_the_vocabulary_fail_before_the_model_is_built(tmp_path, capsys):
    tokens = ids(3000)
    tokens[1234] = 999
    np.save(tmp_path / "train.npy", tokens)
    c = cfg(tmp_path, {"tokens_path": str(tmp_path / "train.npy")}, vocab_size=500)
    with pytest.raises(ConfigError, match=r"model.vocab_size: 500 .* token id 999; set "
                                          r"model.vocab_size >= 1000"):
        check_data(c)
    unset = cfg(tmp_path, {"tokens_path": str(tmp_path / "train.npy")})
    with pytest.raises(ConfigError, match="required for token files without a tokenizer; the "
                                          "largest id in the data is 999"):
        check_data(unset)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{vocab_size: 500, max_seq_len: 16, n_layer: 1, n_head: 2, "
                      f"d_model: 16}}\ndata: {{tokens_path: {tmp_path / 'train.npy'}}}\n"
                      f"run: {{output_dir: {tmp_path / 'cli'}, max_steps: 1}}\n")
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr()
    assert "token id 999" in err.err and "Traceback" not in err.err
    assert "model: reference_transformer" not in err.out  # refused before the model was built


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file or directory"),
    ("empty", "is empty"),
    ("float_npy", "expected 1-D uint16 or uint32"),
    ("truncated_header", "truncated or corrupt"),
    ("odd_bytes", "not a whole number of uint32 ids"),
    ("no_match", "matches no .bin or .npy"),
    ("bad_version", "header of version 9"),
])
def test_bad_token_files_are_one_clear_error(tmp_path, case, message):
    path = tmp_path / "t.bin"
    dtype = "auto"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "float_npy":
        path = tmp_path / "t.npy"
        np.save(path, np.zeros(10, np.float32))
    elif case == "truncated_header":
        write_shard(path, ids(100))
        path.write_bytes(path.read_bytes()[:-10])
    elif case == "odd_bytes":
        path.write_bytes(b"\x00" * 10)
        dtype = "uint32"
    elif case == "no_match":
        path = tmp_path / "nothing_*.bin"
    elif case == "bad_version":
        header = np.zeros(256, np.int32)
        header[:3] = (HEADER_MAGIC, 9, 4)
        path.write_bytes(header.tobytes() + b"\x00" * 8)
    c = cfg(tmp_path, {"tokens_path": str(path), "tokens_dtype": dtype}, vocab_size=1000)
    with pytest.raises(ConfigError, match=message) as info:
        check_data(c)
    assert "data.tokens_path" in str(info.value)


def test_uint16_ids_read_as_uint32_get_the_dtype_hint(tmp_path):
    """The error asked for model.vocab_size >= 1310674463 and no more."""
    path = tmp_path / "t.bin"
    (np.arange(4000, dtype=np.uint16) % 300 + 1).tofile(path)  # raw uint16, read as uint32
    c = cfg(tmp_path, {"tokens_path": str(path), "tokens_dtype": "uint32"}, vocab_size=1000)
    with pytest.raises(ConfigError, match="uint16 ids read as uint32: try data.tokens_dtype: "
                                          "uint16"):
        check_data(c)


def test_sources_are_exclusive_and_eval_tokens_needs_tokens():
    with pytest.raises(ConfigError, match="set at most one of"):
        load_config({"data": {"tokens_path": "a.bin", "synthetic": True}})
    with pytest.raises(ConfigError, match="data.eval_tokens_path: needs data.tokens_path"):
        load_config({"data": {"eval_tokens_path": "v.bin"}})


def test_every_shipped_data_config_is_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("data_tokens.yaml", "data_text_tokenizer.yaml", "data_hf_dataset.yaml"):
        c = load_config(root / name)
        assert sum(v is not None for v in (c.data.tokens_path, c.data.text_path,
                                           c.data.hf_dataset)) == 1, name


def test_a_run_trains_from_token_files_and_resumes_mid_shard(tmp_path):
    from speedtronic.train.runtime import train_from_config

    for i in range(2):
        write_shard(tmp_path / f"train_{i:03d}.bin", ids(3000, 3000 * i, vocab=500))
    data = {"tokens_path": str(tmp_path / "train_*.bin")}
    first = train_from_config(cfg(tmp_path, data, vocab_size=512), plot=False)
    assert first.steps == 2 and first.final_loss is not None
    c = load_config({**cfg(tmp_path, data, vocab_size=512).to_dict(redact=False),
                     "checkpoint": {"enabled": True, "every_steps": 1},
                     "logging": {"every_steps": 1, "progress_bar": False}})
    c.run.max_steps = 2
    c.run.name = "resume"
    train_from_config(c, plot=False)
    c.run.max_steps = 4
    resumed = train_from_config(c, resume=True, plot=False)
    straight = load_config(c.to_dict(redact=False))
    straight.run.name = "straight"
    reference = train_from_config(straight, plot=False)
    assert resumed.steps == reference.steps == 4
    # Same batches after the resume: the last step's loss and the final weights agree exactly.
    assert resumed.final_loss == reference.final_loss
    assert resumed.final_eval_loss == reference.final_eval_loss


def llmc_file(path, magic: int, version: int, tokens: np.ndarray) -> None:
    """An llm.c shard: 256 int32 (magic, version, count, zeros), then the ids."""
    header = np.zeros(256, np.int32)
    header[:3] = (magic, version, tokens.size)
    path.write_bytes(header.tobytes() + tokens.tobytes())


def test_a_file_truncated_before_the_largest_id_pass_is_an_error_not_a_sigbus(tmp_path):
    """The start-up pass read the memory map: a file cut short under it (another job writing
    it in place) killed the process with SIGBUS, no message. In a child process: a SIGBUS
    would take pytest down with it."""
    import subprocess
    import sys

    path = tmp_path / "train.bin"
    ids(100_000).tofile(path)
    script = f"""
import os
from speedtronic.data.token_files import max_token_id, open_token_file
from speedtronic.errors import SpeedtronicError
from pathlib import Path
f = open_token_file(Path({str(path)!r}), "uint16", "data.tokens_path")
os.truncate({str(path)!r}, 4096)
try:
    max_token_id(f)
except SpeedtronicError as exc:
    print("error:", exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ,
                                            "SPEEDTRONIC_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("error: token file") and "train.bin" in done.stdout


def test_largest_id_cache_tells_apart_reads_of_one_file_as_uint16_and_uint32(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.bin"
    tokens = np.arange(4000, dtype=np.uint32) % 300
    tokens[17] = 70_000  # as uint16 halves: 4464 and 1
    tokens.tofile(path)
    as16 = open_token_file(path, "uint16", "data.tokens_path")
    assert max_token_id(as16) == 4464
    as32 = open_token_file(path, "uint32", "data.tokens_path")
    assert max_token_id(as32) == 70_000  # was the cached uint16 answer
    assert max_token_id(open_token_file(path, "uint16", "data.tokens_path")) == 4464
    check_data(cfg(tmp_path, {"tokens_path": str(path), "tokens_dtype": "uint16"},
                   vocab_size=65_536))
    with pytest.raises(ConfigError, match=r"token id 70000; set model.vocab_size >= 70001"):
        check_data(cfg(tmp_path, {"tokens_path": str(path), "tokens_dtype": "uint32"},
                       vocab_size=65_536))


def test_llmc_llama3_shards_are_read_as_uint32_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_CACHE_DIR", str(tmp_path / "cache"))
    tokens = (np.arange(3000, dtype=np.uint32) * 37) % 128_256  # Llama-3 ids reach past 2**16
    path = tmp_path / "fineweb_train_000001.bin"
    llmc_file(path, LLAMA3_MAGIC, 7, tokens)
    f = open_token_file(path, "auto", "data.tokens_path")
    assert f.layout == "header" and f.tokens.dtype == np.uint32 and f.n == 3000
    np.testing.assert_array_equal(np.asarray(f.tokens), tokens)
    check_data(cfg(tmp_path, {"tokens_path": str(path)}, vocab_size=128_256))
    llmc_file(path, LLAMA3_MAGIC, 1, tokens)
    with pytest.raises(ConfigError, match=r"header of version 1 with the llm.c Llama-3 magic "
                                          r"20240801; known: 7 \(uint32 ids\)"):
        open_token_file(path, "auto", "data.tokens_path")


def test_a_header_with_an_unknown_magic_is_named_when_its_ids_do_not_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDTRONIC_CACHE_DIR", str(tmp_path / "cache"))
    tokens = ids(4000, vocab=500)
    odd = tmp_path / "odd.bin"
    llmc_file(odd, 20240521, 1, tokens)  # a typo'd magic: read as raw uint16 ids
    with pytest.raises(ConfigError, match="unrecognised magic 20240521") as info:
        check_data(cfg(tmp_path, {"tokens_path": str(odd)}, vocab_size=1000))
    assert "may have an unrecognised header" in str(info.value)
    # Genuine raw uint16 ids of the same size still read, and a real vocabulary overflow in
    # them says nothing about headers.
    raw = tmp_path / "raw.bin"
    big = ids(4000 + 512, vocab=500)
    big.tofile(raw)
    check_data(cfg(tmp_path, {"tokens_path": str(raw)}, vocab_size=500))
    big[100] = 900
    big.tofile(raw)
    with pytest.raises(ConfigError, match="token id 900") as info:
        check_data(cfg(tmp_path, {"tokens_path": str(raw)}, vocab_size=500))
    assert "unrecognised" not in str(info.value)


def test_directories_skip_hidden_files_and_everything_in_hidden_folders(tmp_path):
    root = tmp_path / ".corpora" / "texts"  # a dot folder above the root is the user's choice
    for rel in ("a.txt", "sub/b.txt", ".notes.txt", ".git/HEAD", ".git/objects/x.txt",
                "sub/.cache/c.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    found = expand_paths(str(root), "data.text_path", recursive=True)
    assert [p.relative_to(root).as_posix() for p in found] == ["a.txt", "sub/b.txt"]
    (root / ".hidden.bin").write_bytes(b"\x00\x00")
    (root / "t.bin").write_bytes(b"\x00\x00")
    assert [p.name for p in resolve_token_paths(str(root), "data.tokens_path")] == ["t.bin"]
