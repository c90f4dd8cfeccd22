"""A disk that fills (ENOSPC) part-way through a write: one line naming the file, nothing already
saved damaged, no temp file left behind. The write is made to fail after part of its bytes,
as a full disk does, by patching the one call that writes."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from _engine_fixtures import tiny_raw

from speedtronic.config import load_config
from speedtronic.errors import SpeedtronicError


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_config_rewrite_on_a_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    """--resume rewrites config.yaml; written in place, a full disk cut it to 100 bytes, and
    sample, export and compare could no longer read the run."""
    cfg = load_config(tiny_raw(tmp_path, "c"))
    path = tmp_path / "config.yaml"
    cfg.save(path)
    before = path.read_bytes()
    real = Path.write_text

    def half_then_full(self: Path, text: str, *args, **kwargs):
        real(self, text[:100], *args, **kwargs)
        _full()

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(SpeedtronicError, match=f"cannot write {path}: No space left"):
        cfg.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_plot_on_a_full_disk_keeps_the_last_one_and_a_finished_run_exits_0(tmp_path,
                                                                           monkeypatch, caplog):
    """savefig wrote in place: a full disk left a truncated PNG where the last good plot was,
    and the end-of-run plot failing turned a finished run into exit 2."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from speedtronic.train import plot
    from speedtronic.train.runtime import train_from_config

    raw = tiny_raw(tmp_path, "p", run={"max_steps": 4, "eval_every": 2})
    result = train_from_config(load_config(raw))
    png = tmp_path / "p" / "loss.png"
    before = png.read_bytes()

    def half_then_full(fig, fname, *args, **kwargs):
        Path(fname).write_bytes(before[:50])
        _full()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full)
    with pytest.raises(SpeedtronicError, match=f"plot: cannot write {png}: No space left"):
        plot.plot_runs([tmp_path / "p"])
    assert png.read_bytes() == before
    assert not [p for p in png.parent.iterdir() if ".tmp-" in p.name]
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        again = train_from_config(load_config(raw), resume=True)  # the plot fails at the end
    assert again.steps == result.steps and "loss plot: not written" in caplog.text


def test_a_log_file_on_a_full_disk_says_so_once_and_the_run_goes_on(tmp_path, capsys):
    """logging.file: each line after the disk filled printed a logging traceback (97 in 100
    steps), and closing the file at the end made a finished run exit 2."""
    from speedtronic.train.run_log import _RunLogFile, remove_log_handlers

    handler = _RunLogFile(tmp_path / "run.log", encoding="utf-8")
    root = logging.getLogger("speedtronic")
    root.addHandler(handler)
    log = logging.getLogger("speedtronic.runtime")
    try:
        log.warning("before the disk filled")
        handler.stream.write = _full  # the disk is full from here on
        for i in range(5):
            log.warning("line %d", i)
        remove_log_handlers([handler])  # closing it again does not raise
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("logging.file: writing") <= 1
    assert (tmp_path / "run.log").read_text().count("before the disk filled") == 1


def test_a_log_file_on_a_disk_full_from_the_start_fails_once(tmp_path):
    """/dev/full at the start: replaying the held start-up lines failed, its warning landed in
    the same held lines, and the loop ended in a RecursionError after 200,000 warnings."""
    import subprocess
    import sys

    import yaml

    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")
    raw = tiny_raw(tmp_path, "full", run={"max_steps": 2, "eval_every": 2},
                   logging={"file": "/dev/full"})
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config",
                           str(tmp_path / "a.yaml")], capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-2000:]
    assert out.count("logging.file: writing /dev/full failed") == 1, out[-2000:]
    assert "Traceback" not in out and "Logging error" not in out


def test_a_store_put_on_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    """ENOSPC is retried as transient, and each attempt left its partial .tmp-* file: the space
    never came back."""
    import os

    from speedtronic.diloco.store import StoreError, open_store
    from speedtronic.diloco.store_file import DirectoryStore

    store = DirectoryStore(tmp_path / "store")
    monkeypatch.setattr(os, "fsync", _full)
    with pytest.raises(StoreError):
        store.put("nodes/w0/s/delta-1", b"x" * 100_000, if_absent=True)
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    monkeypatch.undo()
    open_store(f"file://{tmp_path}/store").put("nodes/w0/s/delta-1", b"ok", if_absent=True)


def test_a_full_disk_at_the_latest_pointer_says_the_step_is_saved(tmp_path, monkeypatch):
    """Only the 'latest' pointer's write failed, and the error said the save of that step
    failed while naming it as the intact newest one: it is saved, and --resume loads it."""
    import torch

    from speedtronic.train import checkpoint
    from speedtronic.train.checkpoint import CheckpointError, CheckpointManager

    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, {"step": 1, "model": {"w": torch.ones(2)}})
    real = checkpoint.atomic_write_text

    def pointer_fails(path: Path, text: str) -> None:
        if path.name == "latest":
            _full()
        real(path, text)

    monkeypatch.setattr(checkpoint, "atomic_write_text", pointer_fails)
    with pytest.raises(CheckpointError, match=r"step 2 is saved \(step_00000002.pt\), but "
                                              r"updating .*latest failed: No space left"):
        mgr.save(2, {"step": 2, "model": {"w": torch.full((2,), 2.0)}})
    monkeypatch.undo()
    state, path = CheckpointManager(tmp_path, keep_last=None).load_latest()
    assert state["step"] == 2 and path.name == "step_00000002.pt"
