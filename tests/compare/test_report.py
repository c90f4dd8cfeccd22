"""Compare report maths (compare/report.py): mean and sample std, first reach of a target,
aggregation.
"""

from __future__ import annotations

import math

import pytest

from speedtronic.compare.report import aggregate, first_reach, markdown_table, stats


# ------------------------------------------------------------------------------ report maths
def _record(seed: int, evals: list[list[float]], **extra) -> dict:
    return {"seed": seed, "evals": evals, "final_eval_loss": evals[-1][1],
            "best_eval_loss": min(e[1] for e in evals), "final_train_loss": 1.0,
            "tokens_per_s": 100.0, "optimizer_step_ms": 1.0, "peak_memory_mib": 10.0,
            "train_time_s": evals[-1][2], "mean_stable_rank": 2.0, "mean_effective_rank": 3.0,
            "lr": 0.02, "lr_key": "optimizer.muon_lr", **extra}


def test_stats_mean_and_sample_std():
    s = stats([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == pytest.approx(1.0) and s["n"] == 3
    assert stats([5.0])["std"] == 0.0 and stats([None])["mean"] is None


def test_first_reach_uses_first_eval_at_or_below_target():
    evals = [[0, 5.0, 0.0], [10, 4.0, 1.5], [20, 3.0, 3.0], [30, 2.9, 4.5]]
    assert first_reach(evals, 3.0) == (20, 3.0)
    assert first_reach(evals, 1.0) is None
    assert first_reach([[0, math.nan, 0.0]], 1.0) is None
    # the untrained model's eval is no arrival (a baseline that ended above its start)
    assert first_reach([[0, 5.0, 0.0], [10, 5.2, 1.0]], 5.1) is None


def test_aggregate_targets_are_per_seed_and_table_shows_spread():
    records = {
        "base": [_record(0, [[0, 5, 0], [10, 3.0, 2]]), _record(1, [[0, 5, 0], [10, 3.2, 2]])],
        "fast": [_record(0, [[0, 5, 0], [5, 2.9, 1], [10, 2.5, 2]]),
                 _record(1, [[0, 5, 0], [5, 3.3, 1], [10, 3.1, 2]])],
    }
    summary = aggregate(records, "base")
    assert summary["fast"]["steps_to_baseline"]["mean"] == 7.5  # seed 0 at 5, seed 1 at 10
    assert summary["fast"]["reached_baseline"] == "2/2"
    assert summary["fast"]["final_eval_loss"]["mean"] == pytest.approx(2.8)
    table = markdown_table(summary, {"base": "base", "fast": "fast"}, "base")
    assert "| fast | 0.02 (muon_lr) |" in table and "2.8000 ± 0.4243" in table
    assert len(table.strip().splitlines()) == 4


def test_compile_time_is_recorded_apart_from_training_time(monkeypatch):
    """A torch.compile variant's compile was charged as training time (24 s "to adamw" on
    CPU against 0.0 s); the trainer's own ms/step leaves it out, and so does compare now."""
    from types import SimpleNamespace

    import torch

    import speedtronic.compare.recorder as recorder

    clock = [100.0]
    monkeypatch.setattr(recorder, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model = torch.nn.Linear(4, 4)
    trainer = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                              device="cpu", step=0, compile_seconds=0.0,
                              config=SimpleNamespace(run=SimpleNamespace(max_steps=10,
                                                                         eval_every=0),
                                                     checkpoint=SimpleNamespace(every_steps=100)))
    rec = recorder.CompareRecorder(spectra=False)
    rec.on_train_start(trainer)
    clock[0] += 25.0                 # step 1: 24 s of it compiling
    trainer.compile_seconds += 24.0
    rec.after_optimizer_step(trainer, 1)
    clock[0] += 2.0                  # step 2: plain training
    rec.after_optimizer_step(trainer, 2)
    assert rec.state["train_time_s"] == pytest.approx(3.0)
    assert rec.state["compile_time_s"] == pytest.approx(24.0)
