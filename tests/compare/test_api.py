"""``speedtronic compare`` end to end (compare/api.py): identical init and data, refusal of a
mismatched start, resume, lr sweep.
"""

from __future__ import annotations

import json

import pytest
from _compare_fixtures import FAST_ADAMW, TINY

from speedtronic.cli import main
from speedtronic.compare import run_compare
from speedtronic.compare.api import _check_same_start
from speedtronic.compare.recorder import state_hash
from speedtronic.compare.runner import DONE_FILE, data_fingerprint
from speedtronic.config import load_config
from speedtronic.errors import SpeedtronicError


# ------------------------------------------------------------------------------ end to end
def test_cli_compare_two_variants_two_seeds_same_init_and_data(tiny_yaml, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--variant", "muon",
               "--steps", "3", "--seeds", "2", "--output-dir", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    # one data line per run (the fingerprint's own data build once logged a second)
    data_lines = [ln for ln in (captured.out + captured.err).splitlines()
                  if " data: " in ln and "micro-batch" in ln]
    assert len(data_lines) == 4, data_lines
    assert "| adamw |" in printed and "| muon |" in printed and " ± " in printed
    report = json.loads((out / "compare.json").read_text())
    assert list(report["variants"]) == ["adamw", "muon"]
    runs = {name: v["runs"] for name, v in report["variants"].items()}
    a, m = runs["adamw"], runs["muon"]
    assert m[0]["lr_key"] == "optimizer.muon_lr" and a[0]["lr_key"] == "optimizer.lr"
    for run in a + m:
        assert run["steps"] == 3 and [e[0] for e in run["evals"]] == [0, 1, 2, 3]
        assert run["optimizer_steps_timed"] == 3 and run["optimizer_step_ms"] > 0
        assert run["tokens_per_s"] > 0 and run["peak_memory_mib"] > 0
        assert run["spectrum"] and run["mean_stable_rank"] > 0
        assert (out / "runs" / f"{run['variant']}-seed{run['seed_index']}" / DONE_FILE).is_file()
    for seed in (0, 1):
        # Same init and data for every variant at a seed; training moved the weights apart.
        assert a[seed]["init_hash"] == m[seed]["init_hash"]
        assert a[seed]["data_hash"] == m[seed]["data_hash"]
        assert a[seed]["seed"] == m[seed]["seed"] == 3 + seed
        assert a[seed]["evals"][0][1] == m[seed]["evals"][0][1]  # same start, same eval batches
        assert a[seed]["final_hash"] != m[seed]["final_hash"]
    assert a[0]["init_hash"] != a[1]["init_hash"] and a[0]["data_hash"] != a[1]["data_hash"]
    assert report["variants"]["muon"]["summary"]["final_eval_loss"]["n"] == 2
    # The hashes are of the model the runtime builds for that seed and of the batches the data
    # builder yields for it (first micro-batches + eval batches), not of some stand-in.
    from speedtronic.models import build_model
    from speedtronic.train.runtime import seed_everything

    seed_everything(4)
    assert state_hash(build_model(load_config(TINY))) == a[1]["init_hash"]
    assert data_fingerprint(load_config(TINY, ["data.seed=4"])) == a[1]["data_hash"]
    assert "| adamw |" in (out / "compare.md").read_text()
    for png in ("compare_loss.png", "compare_spectrum.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mismatched_start_is_refused():
    records = {"adamw": [{"init_hash": "a" * 64, "data_hash": "d" * 64}]}
    with pytest.raises(SpeedtronicError, match="different initial weights"):
        _check_same_start(records, "adamw", "muon", 0, {"init_hash": "b" * 64,
                                                        "data_hash": "d" * 64})


class _Interrupt:
    """Raises after optimizer step ``at`` of the run named ``run_name`` (a killed process)."""

    name = "interrupt"

    def __init__(self, run_name: str, at: int) -> None:
        self.run_name, self.at = run_name, at

    def after_optimizer_step(self, trainer, step: int) -> None:
        if trainer.run_dir.name == self.run_name and step == self.at:
            raise KeyboardInterrupt("simulated interruption")


def test_interrupted_compare_resumes_and_skips_finished_variants(tiny_yaml, tmp_path):
    out = tmp_path / "cmp"
    kwargs = dict(steps=8, output_dir=out, overrides=["checkpoint.every_steps=2"])
    with pytest.raises(KeyboardInterrupt):
        run_compare(tiny_yaml, ["adamw", FAST_ADAMW], callbacks=[_Interrupt("fast-seed0", 5)],
                    **kwargs)
    done_a = out / "runs" / "adamw-seed0" / DONE_FILE
    assert done_a.is_file() and not (out / "runs" / "fast-seed0" / DONE_FILE).exists()
    stamp = done_a.stat().st_mtime_ns

    result = run_compare(tiny_yaml, ["adamw", FAST_ADAMW], **kwargs)
    a, b = result.records["adamw"][0], result.records["fast"][0]
    assert a.get("reused") and done_a.stat().st_mtime_ns == stamp  # not re-run
    assert b["resumed_from"] == [4] and b["steps"] == 8  # newest checkpoint before step 5
    assert [e[0] for e in b["evals"]] == sorted({e[0] for e in b["evals"]})  # no duplicates

    # The resumed run matches an uninterrupted one exactly.
    fresh = run_compare(tiny_yaml, [FAST_ADAMW], steps=8, output_dir=tmp_path / "fresh",
                        overrides=["checkpoint.every_steps=2"]).records["fast"][0]
    assert fresh["final_hash"] == b["final_hash"]
    assert [e[:2] for e in fresh["evals"]] == [e[:2] for e in b["evals"]]

    # Changing the config for the same output dir is refused, not silently mixed.
    with pytest.raises(SpeedtronicError, match="different config .*weight_decay"):
        run_compare(tiny_yaml, ["adamw"], **{**kwargs, "overrides": [
            "checkpoint.every_steps=2", "optimizer.weight_decay=0.0"]})
    # So is another eval grid or log interval: the report's numbers are read off those rows.
    for changed, key in (("run.eval_batches=1", "eval_batches"),
                         ("logging.every_steps=3", "every_steps")):
        with pytest.raises(SpeedtronicError, match=f"different config .*{key}"):
            run_compare(tiny_yaml, ["adamw"], **{**kwargs, "overrides": [
                "checkpoint.every_steps=2", changed]})


def test_a_run_stopped_after_its_last_save_reports_its_last_eval(tiny_yaml, tmp_path):
    """Stopped between the final checkpoint (saved ahead of its eval) and the done-file, a run
    is finished on the rerun without training: its record still ends at the logged final eval
    (it once reported the eval before it, as "final")."""
    out = tmp_path / "cmp"
    kwargs = dict(steps=4, output_dir=out, overrides=["checkpoint.every_steps=2"])
    first = run_compare(tiny_yaml, ["adamw"], **kwargs).records["adamw"][0]
    (out / "runs" / "adamw-seed0" / DONE_FILE).unlink()
    again = run_compare(tiny_yaml, ["adamw"], **kwargs).records["adamw"][0]
    assert [e[:2] for e in again["evals"]] == [e[:2] for e in first["evals"]]
    assert again["evals"][-1][0] == 4
    assert again["final_eval_loss"] == first["final_eval_loss"]


def test_lr_sweep_picks_best_and_reports_it(tiny_yaml, tmp_path):
    out = tmp_path / "cmp"
    result = run_compare(tiny_yaml, ["adamw"], steps=4, lr_sweep=True, sweep_fraction=0.5,
                         lr_factors=(1.0, 10.0), output_dir=out)
    sweep = json.loads((out / "compare.json").read_text())["sweep"]["adamw"]
    assert sweep["key"] == "optimizer.lr" and [p["lr"] for p in sweep["points"]] == \
        pytest.approx([3e-4, 3e-3])
    best = min(sweep["points"], key=lambda p: p["final_eval_loss"])
    assert sweep["chosen"] == best["lr"] == pytest.approx(3e-3)  # 10x is far better at 2 steps
    run = result.records["adamw"][0]
    assert run["lr"] == pytest.approx(3e-3)
    assert load_config(run["config"]).optimizer.lr == pytest.approx(3e-3)
    assert "Learning-rate sweep" in (out / "compare.md").read_text()


@pytest.mark.parametrize("warmup, warned", [(2, False), (3, True)])
def test_warmup_warning_only_when_the_runs_never_reach_the_peak(tiny_yaml, tmp_path, caplog,
                                                                 warmup, warned):
    """Like the trainer: warmup equal to the step count reaches the peak at the last step."""
    import logging

    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        run_compare(tiny_yaml, ["adamw"], steps=2, output_dir=tmp_path / f"w{warmup}",
                    overrides=[f"scheduler.warmup_steps={warmup}"])
    lines = [r.getMessage() for r in caplog.records if "warming up" in r.getMessage()]
    assert bool(lines) == warned, lines
    if warned:
        assert "set scheduler.warmup_steps to at most 2" in lines[0]


BOOM = "boom:optimizer.lr=1e6,optimizer.grad_clip=null"  # NaN within a few steps


def test_a_diverging_variant_is_reported_and_the_others_still_run(tiny_yaml, tmp_path, capsys):
    """A variant the non-finite guard stops once aborted the whole comparison (exit 2, no
    report, the variants after it never ran); a rerun diverged again at the same step."""
    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--variant", BOOM,
            "--variant", "muon", "--steps", "4", "--output-dir", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "compare.json").read_text())
    assert list(report["variants"]) == ["adamw", "boom", "muon"]
    boom = report["variants"]["boom"]["runs"][0]
    assert 1 <= boom["diverged_at"] <= 4 and boom["final_eval_loss"] is None
    assert "not finite" in boom["error"]
    for name in ("adamw", "muon"):
        run = report["variants"][name]["runs"][0]
        assert run["diverged_at"] is None and run["steps"] == 4
        assert run["final_eval_loss"] is not None
    table = (out / "compare.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| boom"))
    assert f"diverged (step {boom['diverged_at']})" in row
    done = out / "runs" / "boom-seed0" / DONE_FILE
    stamp = done.stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0  # the rerun reuses the recorded divergence instead of training again
    assert done.stat().st_mtime_ns == stamp


def test_lr_sweep_drops_a_diverging_point(tiny_yaml, tmp_path):
    out = tmp_path / "cmp"
    result = run_compare(tiny_yaml, ["adamw:optimizer.grad_clip=null"], steps=4, lr_sweep=True,
                         sweep_fraction=0.5, lr_factors=(1.0, 1e9), output_dir=out)
    sweep = json.loads((out / "compare.json").read_text())["sweep"]["adamw"]
    diverged = [p for p in sweep["points"] if p["diverged_at"] is not None]
    assert [p["factor"] for p in diverged] == [1e9]
    assert sweep["chosen"] == pytest.approx(3e-4)
    assert result.records["adamw"][0]["diverged_at"] is None
    assert "diverged at step" in (out / "compare.md").read_text()


def test_a_rerun_with_other_variants_keeps_the_earlier_report(tiny_yaml, tmp_path):
    out = tmp_path / "cmp"
    run_compare(tiny_yaml, ["adamw", "muon"], steps=2, output_dir=out)
    first = (out / "compare.json").read_text()
    run_compare(tiny_yaml, ["adamw", "muon"], steps=2, output_dir=out)  # same comparison
    assert not list(out.glob("compare.old-*"))  # refreshed in place, the runs reused
    run_compare(tiny_yaml, ["muon"], steps=2, output_dir=out)
    kept = list(out.glob("compare.old-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["variants"].keys() == \
        json.loads(first)["variants"].keys() == {"adamw", "muon"}
    assert list(out.glob("compare.old-*.md"))
    assert list(json.loads((out / "compare.json").read_text())["variants"]) == ["muon"]
