"""The start-of-run trial that keeps out-of-order backprop only where it measures faster."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from _ooo_fixtures import _force_cpu_queue
from torch import nn

import speedtronic.ooo.trial as trial_mod
from speedtronic.config import load_config
from speedtronic.ooo.scheduler import OOOScheduler
from speedtronic.ooo.trial import KEEP_IF_FASTER_BY, OOOTrial


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class ModelClock:
    """Fake step clock: a step takes ``on_ms`` when the scheduler deferred, else ``off_ms``.

    ``mark`` snapshots whether the scheduler is active (the trial sets that before the start
    mark), and ``elapsed_ms`` prices the step from that snapshot."""

    def __init__(self, sched_of, on_ms: float, off_ms: float) -> None:
        self.sched_of, self.on_ms, self.off_ms = sched_of, on_ms, off_ms
        self.reads = 0

    def mark(self) -> bool:
        return bool(self.sched_of()._active)

    def elapsed_ms(self, start: bool, end: bool) -> float:
        self.reads += 1
        return self.on_ms if start else self.off_ms


def _sched() -> tuple[nn.Module, OOOScheduler]:
    model = TwoLayers()
    return model, OOOScheduler(model, "cpu")


def _trainer(tmp_path, name: str, max_steps: int, **root):
    """A 2-layer reference model on fixed LM batches, trained on CPU with the given root keys."""
    from _ooo_fixtures import _FixedLMData, _lm_batches

    from speedtronic.train.runtime import build_trainer

    cfg = load_config({
        "run": {"name": name, "output_dir": str(tmp_path), "max_steps": max_steps,
                "eval_every": 0, "eval_batches": 1, "seed": 3, "device": "cpu"},
        "model": {"vocab_size": 61, "d_model": 32, "n_head": 4, "n_layer": 2, "max_seq_len": 16},
        "data": {"micro_batch_size": 3}, "precision": "fp32", "logging": {"progress_bar": False},
        "checkpoint": {"enabled": False}, **root})
    return build_trainer(cfg, data=_FixedLMData(_lm_batches(12, 61))), cfg


def _events(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_plan_is_a_warmup_pair_then_abba_pairs() -> None:
    _, sched = _sched()
    trial = OOOTrial(sched, "cpu", pairs=3, clock=ModelClock(lambda: sched, 1.0, 1.0))
    assert trial.plan == [True, False, True, False, False, True, True, False]
    with pytest.raises(ValueError, match="at least one measured pair"):
        OOOTrial(sched, "cpu", pairs=0)
    sched.close()


@pytest.mark.parametrize(("on_ms", "off_ms", "keep"), [
    (9.0, 10.0, True),  # 10% faster: kept
    (10.0 * (1 - KEEP_IF_FASTER_BY / 2), 10.0, False),  # within the noise margin: off
    (12.25, 10.0, False),  # slower (the H200's +22.5% on the reference model): off
])
def test_decision_keeps_deferral_only_when_measurably_faster(caplog, on_ms, off_ms,
                                                             keep) -> None:
    model, sched = _sched()
    clock = ModelClock(lambda: sched, on_ms, off_ms)
    trial = OOOTrial(sched, "cpu", pairs=2, clock=clock)
    x = torch.randn(4, 8)
    seen_active = []
    results = []
    with caplog.at_level(logging.INFO, logger="speedtronic.ooo"):
        for _ in trial.plan:
            trial.begin_step()
            seen_active.append(sched._active)
            model(x).square().mean().backward()
            sched.flush()
            results.append(trial.end_step())
    assert seen_active == trial.plan  # each step ran the variant the plan named
    assert results[:-1] == [None] * (len(trial.plan) - 1) and results[-1] is keep
    assert clock.reads == 2 * 2  # the warm-up pair is not read
    assert trial.summary == {"kept": keep, "ooo_ms_per_step": pytest.approx(on_ms),
                             "standard_ms_per_step": pytest.approx(off_ms), "pairs": 2,
                             "layers": 2}
    assert trial.end_step() is None and not trial.running  # decided once
    if keep:
        assert sched._active and "forward" in model.a.__dict__
        assert "ooo backprop: kept after measuring" in caplog.text
    else:
        assert all("forward" not in m.__dict__ for m in model.modules())  # closed
        assert "ooo backprop: off after measuring" in caplog.text
    sched.close()


def test_trainer_runs_the_trial_and_closes_a_slower_scheduler(tmp_path, monkeypatch) -> None:
    """End to end on the forced CPU queue: the first 2 * (1 + 2) steps alternate, a slower
    deferral is closed, the decision is in metrics.jsonl, and the weights equal a standard run
    (the trial changes speed, never arithmetic)."""
    built = _force_cpu_queue(monkeypatch)
    monkeypatch.setattr(trial_mod, "_Clock", lambda device: ModelClock(lambda: built[-1],
                                                                       13.0, 10.0))
    finals = []
    for on in (False, True):
        trainer, cfg = _trainer(tmp_path, f"trial{on}", 8, ooo_backprop=on, ooo_trial_pairs=2)
        trainer.fit()
        trainer.metrics.close()
        finals.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    decision = [e for e in _events(cfg) if e["event"] == "ooo_decision"]
    assert len(decision) == 1 and decision[0]["step"] == 6 and decision[0]["kept"] is False
    assert decision[0]["ooo_ms_per_step"] == 13.0 and decision[0]["standard_ms_per_step"] == 10.0
    assert trainer._ooo is None and trainer._ooo_trial is None
    assert all("forward" not in m.__dict__ for m in trainer.model.modules())
    # Exactly the 3 "on" steps of the plan deferred (each folds every deferred parameter once);
    # the "off" steps and the 2 steps after the decision ran the standard backward.
    assert len(built) == 1 and built[0].deferred_total == 3 * built[0].num_params > 0
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name


def test_trial_pairs_zero_keeps_deferral_on_without_measuring(tmp_path, monkeypatch,
                                                              caplog) -> None:
    built = _force_cpu_queue(monkeypatch)
    trainer, cfg = _trainer(tmp_path, "untried", 2, ooo_backprop=True, ooo_trial_pairs=0)
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        trainer.fit()
    trainer.metrics.close()
    assert "stays on without a trial (ooo_trial_pairs: 0)" in caplog.text
    assert trainer._ooo_trial is None
    assert len(built) == 1 and built[0].deferred_total == 2 * built[0].num_params > 0
    assert not [e for e in _events(cfg) if e["event"] == "ooo_decision"]


def test_a_run_shorter_than_the_trial_says_it_did_not_decide(tmp_path, monkeypatch,
                                                            caplog) -> None:
    _force_cpu_queue(monkeypatch)
    trainer, cfg = _trainer(tmp_path, "short", 3, ooo_backprop=True, ooo_trial_pairs=2)
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        trainer.fit()
    trainer.metrics.close()
    assert "trial unfinished when the run ended (3 of 6 steps)" in caplog.text
    decision = [e for e in _events(cfg) if e["event"] == "ooo_decision"]
    assert decision == [{**decision[0], "step": 3, "kept": None, "steps_run": 3,
                         "steps_planned": 6}]
    assert trainer._ooo_trial is None
    assert all("forward" not in m.__dict__ for m in trainer.model.modules())


def test_trial_pairs_is_validated() -> None:
    from speedtronic.config import ConfigError

    with pytest.raises(ConfigError, match="ooo_trial_pairs"):
        load_config({"ooo_trial_pairs": -1})


def test_cuda_clock_drains_the_run_device_at_each_mark(monkeypatch) -> None:
    """On CUDA each mark synchronizes the run's own device (cuda:1 here, not the current one),
    so a step is charged its own GPU work; on CPU nothing is synchronized."""
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    clock = trial_mod._Clock(torch.device("cuda", 1))
    start = clock.mark()
    end = clock.mark()
    assert synced == [torch.device("cuda", 1)] * 2 and clock.elapsed_ms(start, end) >= 0.0
    synced.clear()
    trial_mod._Clock(torch.device("cpu")).mark()
    assert synced == []
