"""``speedtronic compare``: variant parsing, report maths, spectra, and tiny end-to-end runs
(CLI, identical init and data, resume of an interrupted compare, lr sweep, clear errors)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from speedtronic.cli import main
from speedtronic.compare import PRESETS, parse_variant, parse_variants, run_compare
from speedtronic.compare.api import _check_same_start
from speedtronic.compare.recorder import state_hash
from speedtronic.compare.report import aggregate, first_reach, markdown_table, stats
from speedtronic.compare.runner import DONE_FILE, data_fingerprint
from speedtronic.compare.spectrum import hidden_matrices, matrix_spectrum
from speedtronic.config import ConfigError, load_config
from speedtronic.errors import SpeedtronicError

TINY = {
    "run": {"seed": 3, "eval_batches": 2},
    "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32},
    "data": {"micro_batch_size": 4, "stdlib_max_bytes": 200_000},
    "scheduler": {"warmup_steps": 1},
    "logging": {"every_steps": 1, "progress_bar": False},
    "shape_validation": {"enabled": False},
}
FAST_ADAMW = "fast:optimizer.lr=3e-3"  # an AdamW variant that clearly beats the 3e-4 default


@pytest.fixture(autouse=True)
def _fresh_cli_logging():
    """The CLI binds its console handler to the sys.stdout of its first call; capsys swaps
    stdout per test, so drop the handler after each test."""
    yield
    root = logging.getLogger("speedtronic")
    for handler in [h for h in root.handlers if getattr(h, "_speedtronic_console", False)]:
        root.removeHandler(handler)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared CI host oversubscribed
    torch threads made these runs several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(TINY), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ variants
def test_bare_preset_and_preset_with_overrides():
    v = parse_variant("muon")
    assert v.preset == "muon" and v.overrides == PRESETS["muon"]
    v = parse_variant("muon_plus:optimizer.muon_lr=0.05")
    assert v.overrides[-1] == "optimizer.muon_lr=0.05" and v.overrides[:-1] == PRESETS["muon_plus"]


def test_custom_variant_keeps_brackets_and_maps_shorthands():
    v = parse_variant("mine:optimizer.name=muon,optimizer.betas=[0.9, 0.99],cautious=true")
    assert v.preset is None
    assert v.overrides == ("optimizer.name=muon", "optimizer.betas=[0.9, 0.99]",
                           "optimizer.cautious=true")
    cfg = load_config(TINY, list(v.overrides))
    assert cfg.optimizer.betas == (0.9, 0.99) and cfg.optimizer.cautious


def test_no_variant_means_all_presets_adamw_first():
    names = [v.name for v in parse_variants(None)]
    assert names == list(PRESETS) and names[0] == "adamw"
    assert set(names) == {"adamw", "muon", "muon_plus", "cautious_adamw", "cautious_muon"}


def test_presets_resolve_to_the_intended_optimizer():
    for name, (opt, plus, cautious) in {
            "adamw": ("adamw", False, False), "muon": ("muon", False, False),
            "muon_plus": ("muon", True, False), "cautious_adamw": ("adamw", False, True),
            "cautious_muon": ("muon", False, True)}.items():
        # The base says cautious: true; a preset must not inherit it.
        o = load_config({**TINY, "cautious": True}, list(PRESETS[name])).optimizer
        assert (o.name, o.muon_plus, o.cautious) == (opt, plus, cautious), name


@pytest.mark.parametrize("spec, message", [
    ("nosuch", "unknown preset; presets: adamw, muon, muon_plus, cautious_adamw, cautious_muon"),
    ("x:model.n_layer=2", "key 'model.n_layer' cannot vary"),
    ("x:seed=4", "key 'seed' cannot vary"),
    ("x:optimizer.lr=1,optimizer.lr=2", "given twice"),
    ("x:optimizer.lr", "expected key=value"),
    ("x:optimizer.betas=[0.9", "unbalanced"),
    ("bad/name:optimizer.lr=1", "the name must be"),
])
def test_bad_variant_specs_are_clear(spec, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_variant(spec)


def test_duplicate_variant_names_refused():
    with pytest.raises(ConfigError, match="duplicate variant name"):
        parse_variants(["muon", "muon:optimizer.muon_lr=0.05"])


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


# ------------------------------------------------------------------------------ spectra
def test_matrix_spectrum_known_values():
    s = matrix_spectrum(torch.diag(torch.tensor([3.0, 1.0])))
    assert s["stable_rank"] == pytest.approx(10 / 9)
    assert s["top_singular_values"] == pytest.approx([3.0, 1.0])
    assert matrix_spectrum(torch.eye(5))["effective_rank"] == pytest.approx(5.0)
    assert matrix_spectrum(torch.ones(4, 3))["stable_rank"] == pytest.approx(1.0)


def test_hidden_matrices_exclude_embeddings_heads_and_vectors():
    from speedtronic.models import build_model

    model = build_model(load_config(TINY))
    names = [n for n, _ in hidden_matrices(model)]
    assert names and all(p.ndim == 2 for _, p in hidden_matrices(model))
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in names)
    assert len(hidden_matrices(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)))) == 1


# ------------------------------------------------------------------------------ end to end
def test_cli_compare_two_variants_two_seeds_same_init_and_data(tiny_yaml, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--variant", "muon",
               "--steps", "3", "--seeds", "2", "--output-dir", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
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
    from speedtronic.runtime import seed_everything

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


# ------------------------------------------------------------------------------ CLI errors
def test_unknown_variant_key_exits_2_naming_the_key(tiny_yaml, tmp_path, capsys):
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "adamw", "--variant",
               "mine:optimizer.muon_lrr=0.05", "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("speedtronic: error: --variant mine: unknown config key "
                          "'optimizer.muon_lrr'") and "optimizer.muon_lr" in err
    assert not (tmp_path / "c" / "runs").exists()  # validated before any training


def test_unknown_preset_exits_2_listing_presets(tiny_yaml, tmp_path, capsys):
    rc = main(["compare", "--config", str(tiny_yaml), "--variant", "lion",
               "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'lion': unknown preset; presets: adamw, muon, muon_plus, cautious_adamw, " \
           "cautious_muon" in err
