"""A run that fails to start leaves an earlier run alone; resume refuses what it cannot honour
and logs the same numbers as an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from _engine_fixtures import one_thread, tiny_config, tiny_raw  # noqa: F401

from speedtronic.cli import main
from speedtronic.train.checkpoint import CheckpointError
from speedtronic.train.runtime import train_from_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture()
def finished_run(tmp_path: Path) -> tuple[Path, Path]:
    """A 4-step run with checkpoints; returns (its YAML, its run dir)."""
    import yaml

    raw = tiny_raw(tmp_path / "runs", name="base", run={"max_steps": 4, "eval_every": 0})
    cfg_path = tmp_path / "base.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    train_from_config(tiny_config(tmp_path / "runs", name="base",
                                  run={"max_steps": 4, "eval_every": 0}), plot=False)
    return cfg_path, tmp_path / "runs" / "base"


_FAILED_STARTS = [["--set", "logging.file={cfg}/under_a_file.log"],
                  ["--set", "model.name=no_such_model"],
                  ["--set", "data.tokens_path=/no/such/tokens.bin"]]


@pytest.mark.parametrize("resume, bad", [
    *[(resume, bad) for resume in (False, True) for bad in _FAILED_STARTS],
    (True, ["--set", "model.n_head=4"]),  # a changed architecture: an error only on resume
])
def test_a_failed_start_changes_nothing_on_disk(finished_run, capsys, resume, bad):
    cfg_path, run_dir = finished_run
    before = _snapshot(run_dir)
    bad = [b.format(cfg=cfg_path) for b in bad]
    args = ["train", "--config", str(cfg_path), *bad] + (["--resume"] if resume else [])
    assert main(args) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert _snapshot(run_dir) == before  # config.yaml, checkpoints and metrics untouched
    assert [p.name for p in run_dir.parent.iterdir()] == ["base"]  # nothing moved aside


def test_resume_refuses_an_architecture_change_but_not_dropout(finished_run, capsys):
    cfg_path, run_dir = finished_run
    with pytest.raises(CheckpointError, match=r"model.n_head is 4 here but 2 in the checkpoint"):
        train_from_config(tiny_config(run_dir.parent, name="base", model={"n_head": 4},
                                      run={"max_steps": 6, "eval_every": 0}),
                          resume=True, plot=False)
    result = train_from_config(tiny_config(run_dir.parent, name="base", model={"dropout": 0.1},
                                           run={"max_steps": 6, "eval_every": 0}),
                               resume=True, plot=False)
    assert result.steps == 6
    # the values null stood for, spelled out, are the same architecture (once refused)
    same = train_from_config(tiny_config(run_dir.parent, name="base",
                                         model={"d_ff": 128, "n_kv_head": 2},
                                         run={"max_steps": 7, "eval_every": 0}),
                             resume=True, plot=False)
    assert same.steps == 7
    with pytest.raises(CheckpointError, match=r"model.d_ff is 192 here but 128"):
        train_from_config(tiny_config(run_dir.parent, name="base", model={"d_ff": 192},
                                      run={"max_steps": 8, "eval_every": 0}),
                          resume=True, plot=False)


def test_resume_beyond_max_steps_is_refused_and_a_finished_run_keeps_its_numbers(finished_run):
    _, run_dir = finished_run
    with pytest.raises(CheckpointError, match="at step 4, beyond run.max_steps 2"):
        train_from_config(tiny_config(run_dir.parent, name="base",
                                      run={"max_steps": 2, "eval_every": 0}),
                          resume=True, plot=False)
    again = train_from_config(tiny_config(run_dir.parent, name="base",
                                          run={"max_steps": 4, "eval_every": 0}),
                              resume=True, plot=False)
    assert again.steps == 4 and again.final_loss is not None  # restored, not n/a


def test_resuming_a_finished_run_with_a_changed_config_leaves_its_record_alone(tmp_path):
    """Nothing trains, so nothing is written: config.yaml once took values that never ran, and
    a final eval on other data was appended (and superseded the real one in plots)."""
    def cfg(**data):
        return tiny_config(tmp_path, name="done", data=data,
                           run={"max_steps": 4, "eval_every": 2})

    first = train_from_config(cfg(), plot=False)
    run_dir = tmp_path / "done"
    before = _snapshot(run_dir)
    again = train_from_config(cfg(synthetic=True), resume=True, plot=False)
    assert _snapshot(run_dir) == before
    assert again.steps == 4 and again.final_eval_loss == pytest.approx(first.final_eval_loss)
    assert again.metrics_path == run_dir / "metrics.jsonl"


def test_resume_without_a_checkpoint_moves_the_earlier_run_aside(tmp_path, caplog):
    """--resume with nothing to resume is a fresh run, and a fresh run never mixes with an old
    one (it once appended a second step-0 run to the old metrics.jsonl)."""
    def cfg():
        return tiny_config(tmp_path, name="r", checkpoint={"enabled": False},
                           run={"max_steps": 2, "eval_every": 0})

    train_from_config(cfg(), plot=False)
    old = _snapshot(tmp_path / "r")
    with caplog.at_level("WARNING", logger="speedtronic"):
        train_from_config(cfg(), resume=True, plot=False)
    assert "no checkpoint to resume from" in caplog.text
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("r.old-")]
    assert _snapshot(aside) == old
    rows = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert sum('"train_start"' in row for row in rows) == 1


class _StopAfter:
    """Interrupts the run after ``step`` (as Ctrl-C would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_optimizer_step(self, trainer, step: int) -> None:
        if step == self.step:
            raise KeyboardInterrupt


def _train_steps(metrics: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("event") == "train_step"}


def test_resume_between_log_steps_logs_the_uninterrupted_mean_loss(tmp_path):
    # Log every 4 steps, checkpoint every 3: the resume point (6) is inside the 5-8 interval.
    sections = dict(run={"max_steps": 8, "eval_every": 0}, logging={"every_steps": 4},
                    checkpoint={"every_steps": 3})
    straight = train_from_config(tiny_config(tmp_path, name="straight", **sections), plot=False)
    with pytest.raises(KeyboardInterrupt):
        train_from_config(tiny_config(tmp_path, name="cut", **sections),
                          callbacks=[_StopAfter(7)], plot=False)
    train_from_config(tiny_config(tmp_path, name="cut", **sections), resume=True, plot=False)
    want = _train_steps(straight.metrics_path)
    got = _train_steps(tmp_path / "cut" / "metrics.jsonl")
    assert want[8] == got[8]  # the mean over steps 5-8, not over 7-8 only


def test_a_checkpoint_of_another_model_names_the_mismatched_tensors(tmp_path):
    from _engine_fixtures import FixedData, TinyLM
    from torch import nn

    from speedtronic.errors import SpeedtronicError
    from speedtronic.train.runtime import build_trainer

    cfg = tiny_config(tmp_path, name="m", run={"max_steps": 2, "eval_every": 0})
    state = build_trainer(cfg, model=TinyLM(), data=FixedData()).state_dict()
    other = TinyLM()
    other.extra = nn.Linear(3, 3)  # one tensor more than the checkpoint holds
    trainer = build_trainer(cfg, model=other, data=FixedData())
    with pytest.raises(SpeedtronicError, match=r'Missing key\(s\) in state_dict: "extra.weight"'):
        trainer.load_state_dict(state)


@pytest.mark.parametrize("resume", [False, True])
def test_a_missing_metrics_package_is_reported_before_the_run_dir_changes(
        finished_run, capsys, monkeypatch, resume):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    cfg_path, run_dir = finished_run
    before = _snapshot(run_dir)
    args = ["train", "--config", str(cfg_path), "--set", "logging.tensorboard=true"]
    assert main(args + (["--resume", "--max-steps", "6"] if resume else [])) == 2
    assert "needs TensorBoard" in capsys.readouterr().err
    assert _snapshot(run_dir) == before
    assert [p.name for p in run_dir.parent.iterdir()] == ["base"]


def test_a_log_file_inside_the_run_dir_follows_the_new_run(tmp_path):
    run_dir = tmp_path / "runs" / "logged"
    for attempt in range(2):  # the second fresh run moves the first aside
        train_from_config(tiny_config(tmp_path / "runs", name="logged",
                                      run={"max_steps": 2, "eval_every": 0},
                                      logging={"file": str(run_dir / "train.log")}), plot=False)
        text = (run_dir / "train.log").read_text()
        assert "step 2/2" in text and "device: " in text, attempt  # build lines kept too
    moved = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("logged.old-")]
    assert len(moved) == 1 and (moved[0] / "train.log").read_text().count("step 2/2") == 1


def test_a_resume_runs_the_configs_hyper_parameters_and_says_so(tmp_path, caplog):
    """A changed lr / weight_decay / betas / muon_lr once silently kept the checkpoint's values
    while config.yaml recorded the new ones."""
    import math

    from speedtronic.train.runtime import build_trainer, lr_factor

    opt = {"name": "muon", "lr": 1e-3, "muon_weight_decay": 0.1, "betas": [0.9, 0.95],
           "muon_lr": 0.02, "muon_momentum": 0.95}
    train_from_config(tiny_config(tmp_path, run={"max_steps": 4, "eval_every": 0},
                                  optimizer=opt), plot=False)
    new = {**opt, "lr": 5e-4, "muon_weight_decay": 0.01, "betas": [0.8, 0.9], "muon_lr": 0.01,
           "muon_momentum": 0.9}
    cfg = tiny_config(tmp_path, run={"max_steps": 8, "eval_every": 0}, optimizer=new,
                      scheduler={"warmup_steps": 2, "max_steps": 8})
    trainer = build_trainer(cfg, resume=True)
    try:
        assert trainer.step == 4
        factor = lr_factor(4, 2, 8, "cosine", cfg.scheduler.min_lr_ratio)
        by_kind = {g["kind"]: g for g in trainer.optimizer.param_groups}
        assert math.isclose(float(by_kind["adamw"]["lr"]), 5e-4 * factor, rel_tol=1e-6)
        assert math.isclose(float(by_kind["muon"]["lr"]), 0.01 * factor, rel_tol=1e-6)
        assert math.isclose(float(by_kind["muon"]["momentum"]), 0.9, rel_tol=1e-6)
        assert math.isclose(float(by_kind["muon"]["weight_decay"]), 0.01, rel_tol=1e-6)
        assert all(tuple(g["betas"]) == (0.8, 0.9) for g in trainer.optimizer.param_groups
                   if g["kind"] == "adamw")
        assert [math.isclose(b, v, rel_tol=1e-6) for b, v in
                zip(trainer.scheduler.base_lrs, [float(g["initial_lr"]) for g in
                                                 trainer.optimizer.param_groups],
                    strict=True)] == [True] * len(trainer.optimizer.param_groups)
        assert trainer.optimizer.state  # the moments came from the checkpoint
        assert "optimizer.lr: 0.001 -> 0.0005" in caplog.text
        assert "optimizer.muon_momentum: 0.95 -> 0.9" in caplog.text
        trainer.fit()
        # every step after the resume ran the config's lr (the schedule once read the
        # checkpoint's base lrs again from the second step on)
        factor = lr_factor(8, 2, 8, "cosine", cfg.scheduler.min_lr_ratio)  # the next step's
        by_kind = {g["kind"]: g for g in trainer.optimizer.param_groups}
        assert math.isclose(float(by_kind["adamw"]["lr"]), 5e-4 * factor, rel_tol=1e-6)
        assert math.isclose(float(by_kind["muon"]["lr"]), 0.01 * factor, rel_tol=1e-6)
    finally:
        trainer.metrics.close()
        trainer.release_run_lock()
    saved = yaml.safe_load((tmp_path / "t" / "config.yaml").read_text())
    assert saved["optimizer"]["lr"] == 5e-4  # the config written is the one that ran


def test_a_resume_with_nothing_changed_stays_bitwise(tmp_path):
    """Re-applying is skipped when the config matches: the bitwise-resume guarantee holds."""
    from speedtronic.train.checkpoint import CheckpointManager

    full = tiny_config(tmp_path / "a", run={"max_steps": 6, "eval_every": 0},
                       optimizer={"name": "muon"}, scheduler={"max_steps": 6})
    train_from_config(full, plot=False)
    split = tiny_config(tmp_path / "b", run={"max_steps": 3, "eval_every": 0},
                        optimizer={"name": "muon"}, scheduler={"max_steps": 6})
    train_from_config(split, plot=False)
    split.run.max_steps = 6
    train_from_config(split, resume=True, plot=False)
    a = CheckpointManager(tmp_path / "a" / "t" / "checkpoints").load_latest()[0]["model"]
    b = CheckpointManager(tmp_path / "b" / "t" / "checkpoints").load_latest()[0]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_data_given_as_a_dataset_trains_and_a_loader_is_refused_before_anything_moves(tmp_path):
    """``data=`` takes a torch Dataset as ``data.dataset`` does; a DataLoader (or anything
    else) is one clear error before an earlier run is touched (a Dataset once failed in fit
    with an AttributeError after the earlier run had been moved aside)."""
    from torch.utils.data import DataLoader, Dataset

    class Sequences(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            return (torch.arange(33) + i) % 256          # (T + 1,) ids: input and shifted target

    def cfg():
        return tiny_config(tmp_path, name="d", run={"max_steps": 2, "eval_every": 0})

    result = train_from_config(cfg(), data=Sequences(), plot=False)
    assert result.steps == 2 and result.final_loss is not None
    before = _snapshot(tmp_path / "d")
    with pytest.raises(ValueError, match=r"data=: expected .* got DataLoader \(pass its "
                                         r"\.dataset"):
        train_from_config(cfg(), data=DataLoader(Sequences(), batch_size=4), plot=False)
    assert _snapshot(tmp_path / "d") == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("d")] == ["d"]


def test_with_a_progress_bar_the_log_file_still_gets_every_step_line(tmp_path, capsys):
    """The bar's lines went to the console only: logging.file held the start-up lines alone."""
    log = tmp_path / "train.log"
    train_from_config(tiny_config(tmp_path, name="bar", run={"max_steps": 2, "eval_every": 0},
                                  logging={"file": str(log), "progress_bar": True}), plot=False)
    text = log.read_text()
    assert "step 2/2" in text and "device: " in text
    assert "step 2/2" in capsys.readouterr().out  # shown above the bar as before


def test_a_resume_that_cannot_write_its_metrics_leaves_config_yaml_alone(finished_run, capsys):
    """config.yaml was rewritten (max_steps 4 -> 6) before the metrics file and the checkpoint
    folder were found unusable, for a run that never trained; the error was a bare OSError."""
    cfg_path, run_dir = finished_run
    metrics = run_dir / "metrics.jsonl"
    kept = metrics.read_bytes()
    metrics.unlink()
    metrics.mkdir()  # something that cannot be appended to
    before = _snapshot(run_dir)
    assert main(["train", "--config", str(cfg_path), "--resume", "--max-steps", "6"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "metrics file" in err and "metrics.jsonl" in err
    assert _snapshot(run_dir) == before
    metrics.rmdir()
    metrics.write_bytes(kept)
    assert main(["train", "--config", str(cfg_path), "--resume", "--max-steps", "6"]) == 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["max_steps"] == 6
