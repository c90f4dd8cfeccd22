"""Checkpoints: bitwise-exact resume (also after SIGKILL mid-save), corrupt-newest fallback,
atomic layout, pruning, safe loading, RNG round trip."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _engine_fixtures import one_thread, tiny_raw  # noqa: F401

from speedtronic.config import load_config
from speedtronic.train.checkpoint import (
    CRASH_ENV,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
)
from speedtronic.train.runtime import train_from_config

N = 8  # total steps of the exact-resume runs


def _exact_raw(out: Path, name: str, **over) -> dict:
    # Dropout exercises the RNG; accumulation 2 exercises the data position mid-step.
    return tiny_raw(out, name, run={"max_steps": N, "eval_every": 4},
                    model={"dropout": 0.1},
                    data={"micro_batch_size": 2, "target_batch_size": 4},
                    scheduler={"warmup_steps": 2, "max_steps": N},
                    checkpoint={"every_steps": 2, "keep_last": 2}, **over)


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    state = CheckpointManager(run_dir / "checkpoints").load_latest()[0]
    assert state["step"] == N
    return state["model"]


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32 or not a[k].is_floating_point()
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> dict[str, torch.Tensor]:
    """An uninterrupted run to step N."""
    out = tmp_path_factory.mktemp("ref")
    train_from_config(load_config(_exact_raw(out, "full")), plot=False)
    return _final_params(out / "full")


def test_stop_and_resume_is_bitwise_exact(tmp_path, reference_run):
    raw = _exact_raw(tmp_path, "split")
    raw["run"]["max_steps"] = 3  # stop at 3 (odd: the last save is a forced end-of-run save)
    train_from_config(load_config(raw), plot=False)
    raw["run"]["max_steps"] = N
    train_from_config(load_config(raw), resume=True, plot=False)
    _assert_bitwise_equal(reference_run, _final_params(tmp_path / "split"))


@pytest.mark.parametrize("point", ["mid_write", "before_rename", "before_pointer"])
def test_sigkill_during_checkpoint_write_then_resume_is_exact(tmp_path, reference_run, point):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_exact_raw(tmp_path, "killed")))
    env = {**os.environ, CRASH_ENV: f"6:{point}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config",
                           str(cfg_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpt_dir = tmp_path / "killed" / "checkpoints"
    leftovers = [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".")]
    if point in ("mid_write", "before_rename"):
        assert leftovers, "the kill should leave an unfinished temp file behind"
        assert (ckpt_dir / "latest").read_text().strip() == "step_00000004.pt"
    else:
        assert (ckpt_dir / "step_00000006.pt").exists()
    train_from_config(load_config(cfg_path), resume=True, plot=False)
    assert not any(p.name.startswith(".") for p in ckpt_dir.iterdir()), "temp files remain"
    _assert_bitwise_equal(reference_run, _final_params(tmp_path / "killed"))


def _save_three(directory: Path) -> CheckpointManager:
    mgr = CheckpointManager(directory, keep_last=None)
    for step in (1, 2, 3):
        mgr.save(step, {"step": step, "model": {"w": torch.full((64,), float(step))}})
    return mgr


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "bitflip_and_digest_deleted"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, damage):
    mgr = _save_three(tmp_path)
    newest = mgr.path_for(3)
    data = bytearray(newest.read_bytes())
    if damage.startswith("bitflip"):
        # inside the tensor payload (the file ends with the zip directory): still unpickles
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    newest.write_bytes(bytes(data))
    if damage.endswith("digest_deleted"):
        newest.with_suffix(".sha256").unlink()
    with caplog.at_level(logging.WARNING, logger="speedtronic.checkpoint"):
        state, path = mgr.load_latest()
    assert state["step"] == 2 and path == mgr.path_for(2)
    assert "step_00000003.pt" in caplog.text and "falling back to step_00000002.pt" in caplog.text


def test_a_latest_pointer_one_save_behind_does_not_lose_the_newest_checkpoint(tmp_path, caplog):
    """A crash between a committed save and its pointer update (or a hand edit) leaves
    ``latest`` naming an older step; the newest intact one is loaded."""
    mgr = _save_three(tmp_path)
    (tmp_path / "latest").write_text("step_00000002.pt\n")
    with caplog.at_level(logging.INFO, logger="speedtronic.checkpoint"):
        state, path = mgr.load_latest()
    assert state["step"] == 3 and path == mgr.path_for(3)
    assert "latest names step_00000002.pt, but step_00000003.pt is newer" in caplog.text


def test_all_corrupt_is_an_error_and_empty_is_none(tmp_path):
    assert CheckpointManager(tmp_path / "none").load_latest() is None
    mgr = _save_three(tmp_path)
    for _, p in mgr.list():
        p.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="all corrupt, unverifiable"):
        mgr.load_latest()


def test_layout_pointer_and_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10, 15):
        mgr.save(step, {"step": step, "model": {}})
    assert [s for s, _ in mgr.list()] == [15, 10]
    assert (tmp_path / "latest").read_text().strip() == "step_00000015.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000010.pt", "step_00000010.sha256", "step_00000015.pt",
        "step_00000015.sha256"]


def test_stale_temp_files_and_orphan_digests_are_removed_by_the_runs_owner_only(tmp_path):
    """A reader (sample, export, a resume lookup) deletes nothing: from another host or
    container a live writer's pid looks dead, and a reader once deleted its checkpoint
    mid-write. The owner (it holds the run lock) removes what interrupted saves left."""
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(3, {"step": 3, "model": {}})
    junk = [tmp_path / ".step_00000007.pt.tmp-123", tmp_path / "step_00000005.sha256"]
    for path in junk:  # a temp file of a dead writer; a digest whose prune was cut short
        path.write_bytes(b"half")
    CheckpointManager(tmp_path)
    assert all(path.exists() for path in junk)
    CheckpointManager(tmp_path, owner=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000003.pt", "step_00000003.sha256"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"step": 1, "model": {}, "payload": _Evil()}, path)
    with pytest.raises(CheckpointError, match="cannot be loaded") as info:
        CheckpointManager(tmp_path).load(path, verify=False)
    assert "weights_only" not in str(info.value)  # never the advice to run the file's code
    assert "posix.system" in str(info.value) or "system" in str(info.value)


def test_a_checkpoint_without_its_digest_is_not_trusted(tmp_path):
    mgr = _save_three(tmp_path)
    mgr.path_for(3).with_suffix(".sha256").unlink()
    with pytest.raises(CheckpointError, match="step_00000003.sha256 is missing"):
        mgr.load(mgr.path_for(3))
    assert mgr.load(mgr.path_for(3), verify=False)["step"] == 3
    for step in (1, 2):
        mgr.path_for(step).with_suffix(".sha256").unlink()
    with pytest.raises(CheckpointError, match="all corrupt, unverifiable"):
        mgr.load_latest()


def test_rng_state_round_trip():
    state = capture_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # move every generator on
    restore_rng_state(state)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_the_mps_generator_is_saved_and_restored_where_mps_exists(monkeypatch):
    """Resume is bitwise with dropout on CUDA and CPU; on a Mac the MPS generator (dropout
    masks there) was neither saved nor restored. No MPS here: its generator is stood in for."""
    from speedtronic.train import checkpoint as checkpoint_module

    generator = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(checkpoint_module, "_mps_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: generator["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: generator.update(state=s))
    state = capture_rng_state()
    generator["state"] = torch.tensor([9], dtype=torch.uint8)  # the generator moved on
    restore_rng_state(state)
    assert generator["state"].tolist() == [1, 2, 3]
    # a checkpoint from a Mac, resumed where there is no MPS: its stream is ignored
    monkeypatch.setattr(checkpoint_module, "_mps_available", lambda: False)
    restore_rng_state(state)
    assert "mps" not in capture_rng_state()


def test_a_garbage_latest_pointer_falls_back_to_scanning(tmp_path, caplog):
    import logging

    from speedtronic.train.checkpoint import CheckpointManager

    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, {"step": 1, "model": {}})
    mgr.save(2, {"step": 2, "model": {}})
    (tmp_path / "latest").write_bytes(b"\xffstep_00000002.pt\xfe")  # bit rot: not UTF-8
    with caplog.at_level(logging.WARNING, logger="speedtronic.checkpoint"):
        state, path = mgr.load_latest()
    assert state["step"] == 2 and path.name == "step_00000002.pt"
    assert "unreadable" in caplog.text


def test_a_full_disk_during_a_save_is_one_line_and_keeps_every_checkpoint(tmp_path):
    """A file-size limit (what a full disk or a quota looks like to the writer: EFBIG/ENOSPC)
    once ended in two raw tracebacks. Real process, real limit."""
    import hashlib
    import resource

    raw = tiny_raw(tmp_path, "full", run={"max_steps": 3, "eval_every": 0},
                   checkpoint={"every_steps": 3})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    train_from_config(load_config(cfg_path), plot=False)
    ckpt = tmp_path / "full" / "checkpoints"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
    limit = (ckpt / "step_00000003.pt").stat().st_size // 2

    def cap_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config",
                           str(cfg_path), "--resume", "--max-steps", "6"],
                          capture_output=True, text=True, timeout=300, preexec_fn=cap_file_size,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("speedtronic: error")]
    assert len(lines) == 1 and "saving the checkpoint of step 6" in lines[0]
    assert "File too large" in lines[0] and "step_00000003.pt, is intact" in lines[0]
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
    assert after == before  # no temp file, no stray digest, latest unchanged


def test_the_first_save_makes_its_new_folders_durable(tmp_path, monkeypatch):
    """Each folder the first save creates is fsynced into its parent (else a power cut can
    lose the folder entry and with it a checkpoint that was itself fsynced)."""
    from speedtronic.train import checkpoint as ckpt_module

    synced: list[Path] = []
    real = ckpt_module._fsync_dir
    monkeypatch.setattr(ckpt_module, "_fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints")
    mgr.save(1, {"step": 1, "model": {"w": torch.zeros(2)}})
    assert tmp_path in synced and tmp_path / "run" in synced  # parents of the two new folders


def test_a_failed_resave_of_a_saved_step_leaves_that_checkpoint_verifiable(tmp_path,
                                                                         monkeypatch):
    """A forced re-save (DiLoCo's final weights) writes the new digest before the rename; if
    the rename then fails, the old file must still verify."""
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, {"step": 1, "model": {"w": torch.zeros(8)}})

    real_replace = os.replace

    def no_room_for_the_checkpoint(src, dst, *args, **kwargs):
        if str(dst).endswith(".pt"):  # the digest goes in first, then this rename fails
            raise OSError(28, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", no_room_for_the_checkpoint)
    with pytest.raises(CheckpointError, match="No space left on device"):
        mgr.save(1, {"step": 1, "model": {"w": torch.ones(8)}})
    monkeypatch.undo()
    state = mgr.load(mgr.path_for(1))  # verifies the digest
    assert torch.equal(state["model"]["w"], torch.zeros(8))
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_text_write_that_fails_midway_keeps_the_old_file_whole(tmp_path, monkeypatch):
    """``latest`` and the ``.sha256`` digests go through atomic_write_text: a write that
    fails (a full disk, a kill) must leave the previous content, and no temp file."""
    from speedtronic.train.checkpoint import atomic_write_text

    target = tmp_path / "latest"
    atomic_write_text(target, "step_00000010.pt\n")

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, "step_00000020.pt\n")
    assert target.read_text() == "step_00000010.pt\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
