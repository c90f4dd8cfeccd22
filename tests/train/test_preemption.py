"""Preemption and the run lock, with real processes and real signals: a signal saves at the
step boundary and exits 128 + signum, a resume afterwards is bitwise equal to an uninterrupted
run, a second signal exits at once without damaging a checkpoint, and a live run's directory
is refused to a second run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _engine_fixtures import one_thread, tiny_raw  # noqa: F401
from _process_fixtures import launch_cli, resume_run, wait_for_pause

from speedtronic.config import ConfigError, load_config
from speedtronic.train import run_lock
from speedtronic.train.checkpoint import CheckpointManager
from speedtronic.train.metrics import read_metrics
from speedtronic.train.run_lock import RunLock, RunLockedError, held_by, lock_path_for
from speedtronic.train.runtime import train_from_config

N = 8

def _raw(out: Path, name: str) -> dict:
    # dropout (RNG) and accumulation (data position inside a step) make bitwise resume strict
    return tiny_raw(out, name, run={"max_steps": N, "eval_every": 4}, model={"dropout": 0.1},
                    data={"micro_batch_size": 2, "target_batch_size": 4},
                    scheduler={"warmup_steps": 2, "max_steps": N},
                    checkpoint={"every_steps": 4, "keep_last": None})


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    state, _ = CheckpointManager(run_dir / "checkpoints").load_latest()
    assert state["step"] == N
    return state["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref")
    train_from_config(load_config(_raw(out, "full")), plot=False)
    return _final(out / "full")


def _launch(tmp_path: Path, name: str, at: int, *extra: str, stdin=None, **env: str):
    cfg = tmp_path / f"{name}.yaml"
    if not cfg.exists():
        cfg.write_text(yaml.safe_dump(_raw(tmp_path, name)))
    return launch_cli(tmp_path, cfg, at, *extra, stdin=stdin, **env)


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130),
                                           ("SIGUSR1", 128 + signal.SIGUSR1)])
def test_a_signal_saves_at_the_step_boundary_and_resume_is_bitwise(tmp_path, reference, sig,
                                                                   code):
    proc = _launch(tmp_path, "pre", 5, SIG=sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and f"stopped by {sig} at step 5" in err
    steps = [s for s, _ in CheckpointManager(tmp_path / "pre" / "checkpoints").list()]
    assert steps == [5, 4]  # step 5 was saved although every_steps is 4
    events = read_metrics(tmp_path / "pre" / "metrics.jsonl")
    assert [e["signal"] for e in events if e["event"] == "preempted"] == [sig]
    train_from_config(load_config(tmp_path / "pre.yaml"), resume=True, plot=False)
    final = _final(tmp_path / "pre")
    for k in reference:
        assert torch.equal(reference[k], final[k]), k


_DATASET = """
import torch
from torch.utils.data import Dataset

class Items(Dataset):
    def __init__(self):
        self.t = torch.randint(0, 256, (40, 17), generator=torch.Generator().manual_seed(5))
    def __len__(self):
        return len(self.t)
    def __getitem__(self, i):
        return self.t[i]

def make(cfg):
    return Items()
"""


@pytest.mark.parametrize(("sig", "start", "torchrun"),
                         [("SIGTERM", "fork", False), ("SIGINT", "fork", False),
                          ("SIGTERM", "forkserver", False), ("SIGTERM", "spawn", False),
                          ("SIGTERM", "fork", True)])
def test_a_signal_to_the_process_group_with_dataloader_workers_saves_and_resumes_bitwise(
        tmp_path, sig, start, torchrun, monkeypatch):
    """Ctrl-C in a terminal and SLURM's SIGTERM reach the DataLoader workers too: a worker
    died of it and torch raised inside the preemption save (no checkpoint, exit 2), under every
    start method (forkserver is Linux's default from Python 3.14, spawn macOS's). Dropout makes
    the resume strict: each iter() of the loader drew its workers' seed from the global RNG, so
    a resumed run's dropout masks differed. Under torchrun the signal comes twice (SLURM sends
    it to every process, torchrun forwards its copy): the copy was taken for a second signal,
    and the rank exited at once without its checkpoint, its workers killed by the copy."""
    (tmp_path / "pg_items.py").write_text(_DATASET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))

    def raw(name: str) -> dict:
        cfg = _raw(tmp_path, name)
        cfg["data"] = {"dataset": "pg_items:make", "num_workers": 2, "micro_batch_size": 2,
                       "target_batch_size": 4}
        cfg["model"].update(max_seq_len=16)
        return cfg

    train_from_config(load_config(raw("full")), plot=False)
    reference = _final(tmp_path / "full")
    cfg = tmp_path / "pg.yaml"
    cfg.write_text(yaml.safe_dump(raw("pg")))
    extra = {"REPEAT": "1", "TORCHELASTIC_RUN_ID": "test"} if torchrun else {}
    proc = launch_cli(tmp_path, cfg, 5, SIG=sig, PGROUP="1", START_METHOD=start, **extra)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + getattr(signal, sig), err[-2000:]
    # sent at the end of step 5; a group signal may reach this thread a step later
    stopped = re.search(rf"stopped by {sig} at step (\d+)", err)
    assert "Traceback" not in err and stopped and int(stopped[1]) in (5, 6), err[-2000:]
    steps = [s for s, _ in CheckpointManager(tmp_path / "pg" / "checkpoints").list()]
    assert steps == [int(stopped[1]), 4]
    train_from_config(load_config(cfg), resume=True, plot=False)
    final = _final(tmp_path / "pg")
    for k in reference:
        assert torch.equal(reference[k], final[k]), k


def test_a_forkserver_started_in_a_guarded_run_ignores_the_signals_its_children_do_not():
    """The workers' parent is the forkserver, in the trainer's process group: it died of a
    group signal and torch's watchdog then ended every worker in the middle of the step. Its
    children must not inherit the ignoring: a Pool after the run hung in terminate()."""
    script = """
import multiprocessing, os, signal, time
multiprocessing.set_start_method("forkserver")
from multiprocessing import forkserver
from speedtronic.data.worker_signals import start_forkserver_shielded
from speedtronic.train.preemption import PreemptionGuard

def ignored(pid):
    mask = int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigIgn"))
               .split()[1], 16)
    return [bool(mask >> (s - 1) & 1) for s in (signal.SIGTERM, signal.SIGUSR1)]

with PreemptionGuard(["SIGTERM", "SIGINT", "SIGUSR1"]) as guard:
    start_forkserver_shielded()
    server, deadline = forkserver._forkserver._forkserver_pid, time.monotonic() + 60
    while not all(ignored(server)) and time.monotonic() < deadline:
        time.sleep(0.01)  # its preload runs after ensure_running returns: poll for it
    print("server", *ignored(server))
    assert guard.requested is None
child = multiprocessing.Process(target=time.sleep, args=(60,))
child.start()
time.sleep(0.5)
print("child", *ignored(child.pid))
child.terminate()
child.join(10)
print("exit", child.exitcode)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["server", "True", "True", "child", "False", "False",
                                   "exit", str(-signal.SIGTERM)], done.stderr[-2000:]


def test_a_python_api_run_with_dataloader_workers_exits(tmp_path):
    """build_trainer + fit, then the interpreter exits: workers that ignore a first signal
    while their trainer lives made multiprocessing's exit (terminate, then join) wait for them
    forever; the loader stops them first."""
    (tmp_path / "pg_items.py").write_text(_DATASET)
    cfg = _raw(tmp_path, "api")
    cfg["data"] = {"dataset": "pg_items:make", "num_workers": 2, "micro_batch_size": 2,
                   "target_batch_size": 4}
    cfg["model"].update(max_seq_len=16)
    cfg["run"]["max_steps"] = 3
    (tmp_path / "api.yaml").write_text(yaml.safe_dump(cfg))
    script = f"""
from speedtronic.config import ConfigError, load_config
from speedtronic.train.runtime import build_trainer
trainer = build_trainer(load_config({str(tmp_path / "api.yaml")!r}))
trainer.fit()
trainer.metrics.close()
trainer.release_run_lock()
print("fit done", flush=True)
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)  # the hang never ended: a bound it cannot meet
    assert done.returncode == 0 and "fit done" in done.stdout, done.stderr[-2000:]


def test_a_second_signal_exits_at_once_and_committed_checkpoints_survive(tmp_path, reference):
    proc = _launch(tmp_path, "twice", 5, TWICE="1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    assert "second SIGTERM: exiting now" in err
    ckpt = tmp_path / "twice" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000004.pt"  # 5 never committed
    train_from_config(load_config(tmp_path / "twice.yaml"), resume=True, plot=False)
    final = _final(tmp_path / "twice")
    for k in reference:
        assert torch.equal(reference[k], final[k]), k


def test_requeue_calls_scontrol_and_exits_zero(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    proc = _launch(tmp_path, "rq", 3, "--set", "train.requeue=true", SIG="SIGUSR1",
                   SLURM_JOB_ID="4242", PATH=f"{bin_dir}:{os.environ['PATH']}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert log.read_text().split() == ["requeue", "4242"]
    assert "requeued" in err


def test_checkpoint_every_seconds_saves_by_the_clock(tmp_path):
    raw = _raw(tmp_path, "clock")
    raw["checkpoint"].update(every_steps=1000, every_seconds=1e-6)
    train_from_config(load_config(raw), plot=False)
    steps = [s for s, _ in CheckpointManager(tmp_path / "clock" / "checkpoints").list()]
    assert steps == list(range(N, 0, -1))


def test_the_default_signals_work_where_some_do_not_exist(tmp_path, monkeypatch, caplog):
    """Windows has no SIGUSR1/SIGUSR2/SIGHUP/SIGXCPU: validation refused the default list, so
    every run there stopped with exit 2 before training. Simulated by removing them here."""
    for name in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU"):
        monkeypatch.delattr(signal, name)
    raw = tiny_raw(tmp_path, "nosig", run={"max_steps": 2, "eval_every": 2},
                   checkpoint={"every_steps": 2})
    cfg = load_config(raw)  # the defaults, all six names
    assert "SIGUSR1" in cfg.train.preemption_signals
    load_config({**raw, "train": {"preemption_signals": ["SIGTERM", "SIGBREAK"]}})
    with caplog.at_level("INFO", logger="speedtronic"):
        assert train_from_config(cfg, plot=False).steps == 2
    assert "SIGUSR1, SIGUSR2, SIGHUP, SIGXCPU not on this platform: not handled" in caplog.text
    with pytest.raises(ConfigError, match="train.preemption_signals: 'SIGNOPE'"):
        load_config({**raw, "train": {"preemption_signals": ["SIGNOPE"]}})


# ----------------------------------------------------------------------------- the run lock
def test_a_live_runs_directory_is_refused_to_a_second_run_and_resume(tmp_path):
    holder = _launch(tmp_path, "live", 2, PAUSE="1", stdin=subprocess.PIPE)
    try:
        wait_for_pause(holder)  # it holds the lock, mid-run
        run_dir = tmp_path / "live"
        before = sorted(p.name for p in tmp_path.iterdir())
        for extra in ((), ("--resume",)):
            second = subprocess.run([sys.executable, "-m", "speedtronic", "train", "--config",
                                     str(tmp_path / "live.yaml"), *extra], capture_output=True,
                                    text=True, timeout=300,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert second.returncode == 2, second.stderr[-2000:]
            assert "Traceback" not in second.stderr
            assert f"in use by pid {holder.pid}" in second.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing moved aside
        assert run_dir.is_dir()
    finally:
        _, err = resume_run(holder)
    assert holder.returncode == 0, err[-2000:]
    assert [s for s, _ in CheckpointManager(run_dir / "checkpoints").list()] == [8, 4]
    assert not lock_path_for(run_dir).exists()  # released, and removed with it


def test_a_killed_holders_lock_is_taken_over_with_a_log_line(tmp_path, caplog):
    holder = _launch(tmp_path, "dead", 2, PAUSE="1", stdin=subprocess.PIPE)
    wait_for_pause(holder)
    holder.kill()  # SIGKILL: no release, the lock file stays with its pid in it
    holder.communicate(timeout=60)
    assert lock_path_for(tmp_path / "dead").exists()
    result = train_from_config(load_config(tmp_path / "dead.yaml"), resume=True, plot=False)
    assert result.steps == N
    assert f"from pid {holder.pid}" in caplog.text and "which is gone" in caplog.text


def test_one_process_cannot_take_a_lock_twice(tmp_path):
    with RunLock(tmp_path / "r"):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path / "r")
    with RunLock(tmp_path / "r") as again:  # released: free again
        assert again.held


def test_without_fcntl_the_lock_file_refuses_while_its_holder_lives(tmp_path, monkeypatch):
    """Windows has no fcntl: runs were not locked, and a second run moved a live run's folder
    aside (the two then mixed checkpoints). The lock file itself is the lock there."""
    monkeypatch.setattr(run_lock, "fcntl", None)
    run_dir, host = tmp_path / "r", socket.gethostname()
    lock = lock_path_for(run_dir)

    def name_holder(pid: int, on: str = host) -> None:
        lock.write_text(json.dumps({"pid": pid, "host": on, "since": "then", "purpose": "train"}))

    with RunLock(run_dir) as mine:
        assert mine.held and json.loads(lock.read_text())["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(run_dir)
        assert held_by(run_dir).startswith(f"pid {os.getpid()} on host")
    assert not lock.exists() and held_by(run_dir) is None
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        name_holder(live.pid)
        with pytest.raises(RunLockedError, match=f"pid {live.pid} .*delete the lock file"):
            RunLock(run_dir)
        (run_dir / "checkpoints").mkdir(parents=True)  # the live run's folder
        raw = tiny_raw(tmp_path, "r", run={"max_steps": 2, "eval_every": 2})
        with pytest.raises(RunLockedError, match=f"in use by pid {live.pid}"):
            train_from_config(load_config(raw), plot=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".r.lock", "r"]  # nothing moved
        name_holder(os.getpid(), on="another-host")  # its pids cannot be checked from here
        with pytest.raises(RunLockedError, match="on host another-host"):
            RunLock(run_dir)
    finally:
        live.communicate(b"", timeout=60)
    name_holder(live.pid)  # gone now: still refused (two starters both took one over),
    with pytest.raises(RunLockedError, match=f"a run that is gone: pid {live.pid} .*delete"):
        RunLock(run_dir)  # saying so
    assert held_by(run_dir) is None  # validate: no live holder
    lock.unlink()
    with RunLock(run_dir) as taken:
        assert taken.held and json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_temp_files_of_a_live_writer_are_left_alone(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    try:
        live = tmp_path / f".step_00000007.pt.tmp-{sleeper.pid}"
        live.write_bytes(b"in progress")
        dead = tmp_path / f".step_00000006.pt.tmp-{os.getpid()}"  # ours: a failed save
        dead.write_bytes(b"half")
        CheckpointManager(tmp_path, owner=True)
        assert live.exists() and not dead.exists()
    finally:
        sleeper.communicate(b"")


def test_a_preempted_diloco_node_saves_uploads_whole_objects_and_resumes(tmp_path):
    """A DiLoCo master-that-trains gets SIGTERM mid-round: it saves, stops its master thread,
    sends its partial round as one complete delta (no torn object in the store) and exits 143;
    --resume re-installs the newest global and finishes."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    raw = tiny_raw(tmp_path / "runs", "m", run={"max_steps": 10, "eval_every": 0},
                   checkpoint={"every_steps": 4})
    raw["distributed"] = {"enabled": True, "role": "master", "node_id": "m0",
                          "store": f"file://{tmp_path / 'store'}", "inner_steps": 3,
                          "poll_interval": 0.2, "lease_ttl": 5, "expected_workers": 1,
                          "master_idle_timeout": 2, "shutdown_timeout": 30,
                          # keep applied deltas: the check below reads them, and on a loaded CI
                          # machine the master thread once applied (and deleted) them all
                          # before the SIGTERM landed
                          "delete_processed": False}
    cfg = tmp_path / "m.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    proc = launch_cli(tmp_path, cfg, 5, SIG="SIGTERM")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    run_dir = tmp_path / "runs" / "m"
    assert [s for s, _ in CheckpointManager(run_dir / "checkpoints").list()] == [5, 4]
    objects = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert not [p for p in objects if ".tmp" in p.name], "a torn upload was left in the store"
    deltas = [p for p in objects if p.parent.parent.name == "m0" and p.suffix == ".safetensors"]
    assert deltas and all(load_file(str(p)) for p in deltas)
    result = train_from_config(load_config(cfg), resume=True, plot=False)
    assert result.steps == 10
