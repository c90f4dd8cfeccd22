"""The non-finite guard (train.on_nonfinite): a NaN/inf loss stops the run naming its step, or
its update is skipped; nothing non-finite is ever saved, and finite checkpoints survive."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from _engine_fixtures import FixedData, TinyLM, one_thread, tiny_config, tiny_raw  # noqa: F401

from speedtronic.cli import main
from speedtronic.errors import NonFiniteError
from speedtronic.kernels.counting import DispatchCounter
from speedtronic.train.checkpoint import CheckpointManager
from speedtronic.train.metrics import read_metrics
from speedtronic.train.runtime import build_trainer, train_from_config


class NanAtCall(TinyLM):
    """TinyLM whose loss is NaN on the forward calls listed in ``bad`` (1-based)."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.bad, self.calls = bad, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().forward(x, y)
        if self.training:
            self.calls += 1
            if self.calls in self.bad:
                return loss * float("nan")
        return loss


def _all_finite(ckpt_dir: Path) -> list[int]:
    steps = []
    for step, path in CheckpointManager(ckpt_dir).list():
        state = CheckpointManager(ckpt_dir).load(path)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path
        steps.append(step)
    return steps


def test_a_nan_loss_stops_the_cli_with_one_line_naming_the_step(tmp_path, capsys):
    """lr=1e300 once trained on NaN weights, saved them, pruned every finite checkpoint and
    printed done: loss=nan with exit 0."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(tmp_path / "runs", run={"max_steps": 12,
                                                                    "eval_every": 0},
                                           checkpoint={"every_steps": 1, "keep_last": 2})))
    assert main(["train", "--config", str(cfg), "--set", "run.max_steps=4"]) == 0
    run = tmp_path / "runs" / "t"
    before = _all_finite(run / "checkpoints")
    capsys.readouterr()
    code = main(["train", "--config", str(cfg), "--resume", "--set", "optimizer.lr=1.0e+300"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and "step 5:" in err and "not finite" in err
    assert "optimizer.lr" in err  # what to try
    # nothing after the last finite step was written, and keep_last pruned nothing finite
    assert _all_finite(run / "checkpoints") == before == [4, 3]
    assert not any(p.name.startswith(".") for p in (run / "checkpoints").iterdir())


def test_stop_names_the_first_bad_step_between_log_steps(tmp_path):
    cfg = tiny_config(tmp_path, run={"max_steps": 8, "eval_every": 0},
                      logging={"every_steps": 4}, checkpoint={"every_steps": 100})
    trainer = build_trainer(cfg, model=NanAtCall({3}), data=FixedData())
    with pytest.raises(NonFiniteError, match=r"step 3: "):
        trainer.fit()
    trainer.release_run_lock()
    assert trainer.step == 4  # detected at the log step, the first read after it
    assert not (tmp_path / "t" / "checkpoints").exists() or \
        not CheckpointManager(tmp_path / "t" / "checkpoints").list()


def test_a_save_never_writes_a_non_finite_state(tmp_path):
    """The save checks the weights as well: a NaN there is refused even with a finite loss."""
    cfg = tiny_config(tmp_path, run={"max_steps": 2, "eval_every": 0},
                      checkpoint={"every_steps": 1})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer.fit()
    saved = CheckpointManager(tmp_path / "t" / "checkpoints").list()
    with torch.no_grad():
        trainer.model.hidden.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="a model weight"):
        trainer.save_checkpoint(force=True)
    trainer.release_run_lock()
    assert CheckpointManager(tmp_path / "t" / "checkpoints").list() == saved


def test_skip_drops_the_bad_step_and_trains_on(tmp_path):
    cfg = tiny_config(tmp_path, run={"max_steps": 6, "eval_every": 0},
                      train={"on_nonfinite": "skip"}, logging={"every_steps": 2},
                      checkpoint={"every_steps": 3})
    model = NanAtCall({3})
    result = train_from_config(cfg, model=model, data=FixedData(), plot=False)
    assert result.steps == 6 and result.final_loss is not None
    assert torch.isfinite(torch.tensor(result.final_loss))
    events = read_metrics(tmp_path / "t" / "metrics.jsonl")
    skips = [e for e in events if e["event"] == "nonfinite_skip"]
    assert [(e["step"], e["total"]) for e in skips] == [(3, 1)]
    losses = [e["loss"] for e in events if e["event"] == "train_step"]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert _all_finite(tmp_path / "t" / "checkpoints")


def test_a_skipped_last_step_keeps_the_last_real_loss(tmp_path):
    """An interval whose only step was skipped logs no loss (NaN in its row), but the run's
    last loss (checkpoint, train_end, the result) stays the last real one: it ended in nan."""
    cfg = tiny_config(tmp_path, run={"max_steps": 3, "eval_every": 0},
                      train={"on_nonfinite": "skip"}, logging={"every_steps": 1},
                      checkpoint={"every_steps": 3})
    result = train_from_config(cfg, model=NanAtCall({3}), data=FixedData(), plot=False)
    events = read_metrics(tmp_path / "t" / "metrics.jsonl")
    losses = {e["step"]: e["loss"] for e in events if e["event"] == "train_step"}
    assert result.final_loss == losses[2]  # step 3 was skipped: no loss of its own
    (end,) = [e for e in events if e["event"] == "train_end"]
    assert end["loss"] == losses[2]
    ckpt = CheckpointManager(tmp_path / "t" / "checkpoints")
    assert ckpt.load(ckpt.list()[0][1])["last_loss"] == losses[2]


class AlwaysNan(TinyLM):
    """TinyLM whose every loss, training and eval, is NaN."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x, y) * float("nan")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_a_run_whose_every_step_was_skipped_ends_without_an_error(tmp_path, caplog):
    """Every loss non-finite, fewer steps than max_skipped_steps: the run reaches its end and
    saves; the loss plot (nothing finite to draw) is skipped with a warning instead of failing
    the finished run."""
    cfg = tiny_config(tmp_path, run={"max_steps": 3, "eval_every": 0},
                      train={"on_nonfinite": "skip"}, logging={"every_steps": 1},
                      checkpoint={"every_steps": 3})
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        result = train_from_config(cfg, model=AlwaysNan(), data=FixedData(), plot=True)
    assert result.steps == 3
    assert [s for s, _ in CheckpointManager(tmp_path / "t" / "checkpoints").list()] == [3]
    assert "loss plot: not written" in caplog.text and "no loss values" in caplog.text


def test_a_skipped_first_step_does_not_trip_a_torch_schedulers_order_warning(tmp_path):
    """A torch scheduler given to the trainer warns when it steps before the optimizer ever
    did; a step skipped as non-finite does that on purpose (the engine's own schedule never
    checks the order)."""
    cfg = tiny_config(tmp_path, run={"max_steps": 2, "eval_every": 0},
                      train={"on_nonfinite": "skip"}, checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=NanAtCall({1}), data=FixedData())
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit()
    finally:
        trainer.metrics.close()
        trainer.release_run_lock()
    assert trainer.skipped_steps == 1
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]


def test_skip_gives_up_after_max_skipped_steps_in_a_row(tmp_path):
    cfg = tiny_config(tmp_path, run={"max_steps": 20, "eval_every": 0},
                      train={"on_nonfinite": "skip", "max_skipped_steps": 3})
    trainer = build_trainer(cfg, model=NanAtCall(set(range(2, 100))), data=FixedData())
    with pytest.raises(NonFiniteError, match=r"step 4: .*3 steps in a row"):
        trainer.fit()
    trainer.release_run_lock()
    assert trainer.skipped_steps == 3


def _fit_syncs(tmp_path: Path, steps: int, policy: str) -> int:
    cfg = tiny_config(tmp_path / f"{policy}{steps}", run={"max_steps": steps, "eval_every": 0},
                      logging={"every_steps": 100}, checkpoint={"enabled": False},
                      train={"on_nonfinite": policy})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    try:
        with DispatchCounter() as counter:
            trainer.fit()
    finally:
        trainer.release_run_lock()
    return counter.host_syncs


@pytest.mark.parametrize(("policy", "per_step"), [("stop", 0), ("skip", 1)])
def test_host_syncs_per_step_of_each_policy(tmp_path, policy, per_step):
    """stop: the guard is device ops read with the log step's loss, so 4 more steps add no
    host sync; skip reads one flag per step, as documented."""
    extra = _fit_syncs(tmp_path, 7, policy) - _fit_syncs(tmp_path, 3, policy)
    assert extra == 4 * per_step


def test_gradscaler_skips_are_not_counted_as_non_finite(tmp_path):
    """Under fp16 GradScaler an inf gradient norm is the scaler's normal skip, not an error;
    only the loss counts then."""
    cfg = tiny_config(tmp_path, run={"max_steps": 1, "eval_every": 0},
                      checkpoint={"enabled": False})
    trainer = build_trainer(cfg, model=TinyLM(), data=FixedData())
    trainer.release_run_lock()
    trainer._finite_steps = torch.zeros((), dtype=torch.int64)
    trainer._loss_sum = torch.tensor(2.0)
    trainer._count_finite_step(torch.tensor(float("inf")))
    assert int(trainer._finite_steps) == 0  # without a scaler: counted as bad
    trainer.scaler = object()  # any scaler: its skips are its business
    trainer._count_finite_step(torch.tensor(float("inf")))
    assert int(trainer._finite_steps) == 1
    trainer._loss_sum = torch.tensor(float("nan"))
    trainer._count_finite_step(torch.tensor(1.0))
    assert int(trainer._finite_steps) == 1  # a NaN loss is bad with a scaler too
