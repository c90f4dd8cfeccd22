"""``speedtronic prepare`` stopped part way, and the memory its shard writer holds.

A SIGTERM (a scheduler's stop, ``kill``) once ended prepare at once: its temporary folder
``<key>.tmp-<pid>`` stayed in the token cache for good and each tokenizer worker printed a
BrokenPipeError traceback. The shard writer held a shard's ids as uint32 blocks, then their
concatenation, then a cast copy: ~6 shards' bytes at its peak."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from _data_fixtures import byte_level_bpe  # noqa: E402

import speedtronic.data.prepare as prepare_module  # noqa: E402
import speedtronic.data.prepare_shards as prepare_shards  # noqa: E402
from speedtronic.config import load_config  # noqa: E402
from speedtronic.data.prepare import prepare  # noqa: E402
from speedtronic.data.sources import stdlib_corpus  # noqa: E402
from speedtronic.data.token_files import open_token_file  # noqa: E402
from speedtronic.errors import Terminated  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

# `speedtronic prepare` over a source that never ends (the first file, again and again), with
# small shards: it writes shards into its temporary folder until a signal stops it.
# (Under __main__: spawned workers import this script too.)
ENDLESS = textwrap.dedent("""
    import itertools, sys
    import speedtronic.data.prepare as P
    import speedtronic.data.prepare_shards as S

    def endless(files):
        text = files[0].read_text()
        for _ in itertools.count():
            yield "endless", text + "\\x00EOD"

    if __name__ == "__main__":
        S.SHARD_TOKENS = 1 << 14
        P._file_blocks = endless
        from speedtronic.cli import main
        sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer.json, a folder of text): a 300-id byte-level BPE trained right here."""
    text = bytes(stdlib_corpus(120_000, 0.1).train).decode("utf-8", errors="replace")
    root = tmp_path_factory.mktemp("corpus")
    byte_level_bpe([text[i:i + 2000] for i in range(0, 60_000, 2000)], 300,
                   root / "tokenizer.json")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text(text[:40_000])
    return root / "tokenizer.json", root / "text"


def _config(tmp_path: Path, corpus: tuple[Path, Path], workers: int = 2) -> Path:
    tokenizer, text = corpus
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "model": {"max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"tokenizer": str(tokenizer), "text_path": str(text), "micro_batch_size": 4,
                 "prepare_workers": workers, "prepare_dir": str(tmp_path / "prepared")},
        "run": {"output_dir": str(tmp_path / "runs"), "name": "t", "device": "cpu"},
        "logging": {"progress_bar": False}}))
    return path


def _endless_prepare(tmp_path: Path, cfg: Path) -> tuple[subprocess.Popen, Path]:
    """The endless prepare, started; returns once its temporary folder holds a shard."""
    driver = tmp_path / "endless.py"
    driver.write_text(ENDLESS)
    proc = subprocess.Popen(
        [sys.executable, str(driver), "prepare", "--config", str(cfg)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        tmps = list((tmp_path / "prepared").glob("*.tmp-*"))
        if tmps and (tmps[0] / "shard_000000.bin").exists():
            return proc, tmps[0]
        time.sleep(0.02)  # polling for the folder, with a deadline
    proc.kill()
    out, err = proc.communicate(timeout=60)
    raise AssertionError(f"prepare wrote no shard (exit {proc.returncode}): {err[-2000:]}")


@posix_only
def test_sigterm_removes_the_temporary_folder_and_exits_143(tmp_path, corpus):
    proc, tmp = _endless_prepare(tmp_path, _config(tmp_path, corpus))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)  # EOF: the workers (who share stderr) are gone too
    assert proc.returncode == 143, err[-3000:]
    assert "speedtronic: terminated (SIGTERM)" in err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    assert not tmp.exists()
    assert list((tmp_path / "prepared").iterdir()) == []


@posix_only
def test_a_killed_prepare_leaves_quiet_workers_and_the_next_prepare_removes_its_folder(
        tmp_path, corpus, caplog):
    """SIGKILL runs no cleanup: the workers end without a traceback (their next result hits a
    pipe nobody reads), and the next prepare under the same folder removes the dead one's."""
    cfg = _config(tmp_path, corpus)
    proc, tmp = _endless_prepare(tmp_path, cfg)
    proc.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    assert tmp.is_dir()  # nothing could remove it
    with caplog.at_level("INFO", logger="speedtronic.data"):
        meta = prepare(load_config(str(cfg)), workers=1)
    assert not tmp.exists() and "interrupted prepare" in caplog.text
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == [meta["key"]]


def test_only_temporary_folders_of_dead_local_prepares_are_removed(tmp_path, corpus):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    host, root = prepare_module._host(), tmp_path / "prepared"
    names = {
        "dead_here": f"0123456789abcdef.tmp-{host}-{dead.pid}",
        "dead_old_style": f"0123456789abcdef.tmp-{dead.pid}",  # before the host was in it
        "live_here": f"0123456789abcdef.tmp-{host}-{os.getppid()}",
        # this process's own: another thread's prepare, writing now (pid checks call it dead)
        "this_process": f"fedcba9876543210.tmp-{host}-{os.getpid()}",
        "other_host": f"0123456789abcdef.tmp-{host}x-{dead.pid}",  # its pids mean nothing here
        "not_ours": f"notakey.tmp-{dead.pid}",
    }
    for name in names.values():
        (root / name).mkdir(parents=True)
        (root / name / "shard_000000.bin").write_bytes(b"x")
    prepare(load_config(str(_config(tmp_path, corpus))), workers=1)
    left = {k for k, name in names.items() if (root / name).exists()}
    assert left == {"live_here", "this_process", "other_host", "not_ours"}


def test_terminated_uncaught_in_a_script_exits_143_quietly():
    """A Python-API prepare stopped by SIGTERM: a BaseException there was a traceback and exit
    1, a failure to a scheduler; the signal itself would have been 143."""
    done = subprocess.run([sys.executable, "-c", "from speedtronic.errors import Terminated; "
                           "raise Terminated(15)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr


@posix_only
def test_sigterm_in_process_cleans_up_and_restores_the_handler(tmp_path, corpus, monkeypatch):
    """Raised as Terminated on the main thread while prepare writes; SIGTERM's default action
    is back afterwards (the handler is prepare's only while it runs)."""
    seen = []
    write = prepare_module._write_shards

    def write_then_sigterm(tmp, *args):
        seen.append(tmp)
        write(tmp, *args)
        # (without a handler of prepare's, SIGTERM would end the test process itself)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "no SIGTERM handler"
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop prepare")

    monkeypatch.setattr(prepare_module, "_write_shards", write_then_sigterm)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Terminated) as info:
            prepare(load_config(str(_config(tmp_path, corpus))), workers=1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.exit_code == 143
    assert len(seen) == 1 and not seen[0].exists()


@posix_only
def test_a_training_runs_sigterm_handler_is_left_alone(tmp_path, corpus, monkeypatch):
    """Where someone else handles SIGTERM (the trainer's PreemptionGuard) prepare keeps out."""
    from speedtronic.train.preemption import PreemptionGuard

    during = []
    write = prepare_module._write_shards

    def record(*args):
        during.append(signal.getsignal(signal.SIGTERM))
        return write(*args)

    monkeypatch.setattr(prepare_module, "_write_shards", record)
    with PreemptionGuard(["SIGTERM"]) as guard:
        prepare(load_config(str(_config(tmp_path, corpus))), workers=1)
        assert signal.getsignal(signal.SIGTERM) == guard._handle
    assert during == [guard._handle]


# ----------------------------------------------------------------------------- memory
class _Tok:
    def to_str(self) -> str:
        return ""


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_the_shard_writer_holds_about_one_shard(tmp_path, monkeypatch, dtype):
    """Peak traced memory of the writer is about one shard (it was ~6 shards' bytes with
    uint16), and the shards hold the arriving ids in order, cut every SHARD_TOKENS ids
    whatever the block sizes (a document's ids continue in the next shard)."""
    shard_tokens = 1 << 16
    rng = np.random.default_rng(0)
    sizes = [int(n) for n in rng.integers(0, 3000, 230)] + [0, 1, 5000]
    blocks = [rng.integers(0, 60_000, n).astype(np.uint32) for n in sizes]
    feed = iter(blocks)
    monkeypatch.setattr(prepare_shards, "SHARD_TOKENS", shard_tokens)
    monkeypatch.setattr(prepare_shards, "_init_worker", lambda *a: None)
    monkeypatch.setattr(prepare_shards, "_encode", lambda task: next(feed).copy())
    tracemalloc.start()
    try:
        shards, total = prepare_shards._write_shards(
            tmp_path, iter([("x", "t")] * len(blocks)), _Tok(), None, "t", dtype, 1, False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    shard_bytes = shard_tokens * np.dtype(dtype).itemsize
    assert peak < 2.5 * shard_bytes, f"peak {peak / shard_bytes:.2f} shards"
    expected = np.concatenate(blocks).astype(dtype)
    assert total == expected.size and len(shards) == -(-total // shard_tokens) >= 4
    got = []
    for i, name in enumerate(sorted(shards)):
        ids = np.asarray(open_token_file(tmp_path / name, "auto", "test").tokens)
        assert ids.dtype == dtype
        assert shards[name] == {"tokens": ids.size, "max_id": int(ids.max())}
        assert ids.size == (shard_tokens if i < len(shards) - 1 else total % shard_tokens)
        got.append(ids)
    assert np.array_equal(np.concatenate(got), expected)
