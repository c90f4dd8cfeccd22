"""``run_compare``: train every variant on the same init, data and seeds, then report.

Order of work: validate every variant against the base config (fail before any training) ->
optional learning-rate sweep per variant -> the main runs, seed-major (all variants at seed 0
first, so an interrupted compare already holds one full comparison) -> checks that every
variant started from the same weights and saw the same batches -> table, JSON and PNGs.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, SpeedtronicConfig, load_config
from ..errors import SpeedtronicError
from .plots import plot_loss, plot_spectrum
from .report import aggregate, markdown_table, write_json
from .runner import RunSpec, resolve_run, run_one
from .variants import Variant, parse_variants, sweep_key

__all__ = ["CompareResult", "run_compare", "DEFAULT_LR_FACTORS"]

logger = logging.getLogger("speedtronic.compare")

DEFAULT_LR_FACTORS = (0.5, 1.0, 2.0)
"""Sweep points as multiples of the variant's own lr: three runs that bracket the default on
both sides. A pick on the grid's edge is flagged; widen the grid with ``lr_factors`` then."""


@dataclass
class CompareResult:
    """What :func:`run_compare` produced."""

    summary: dict[str, Any]
    """Per variant: statistics over seeds (see :func:`speedtronic.compare.report.aggregate`)."""
    records: dict[str, list[dict[str, Any]]]
    """Per variant: one run record per seed."""
    files: dict[str, Path]
    """``table``, ``json`` and, with matplotlib, ``loss_png`` / ``spectrum_png``."""
    table: str
    """The markdown table."""


def _lr_of(cfg: SpeedtronicConfig) -> tuple[str, float]:
    key = sweep_key(cfg)
    return key, float(getattr(cfg.optimizer, key.split(".")[1]))


def _default_eval_every(base: SpeedtronicConfig, steps: int) -> int:
    """The config's interval if it gives at least 10 evals, else steps // 10: the steps-to-
    baseline column is only as fine as the eval interval."""
    every = base.run.eval_every
    if every and steps // every >= 10:
        return every
    return max(1, steps // 10)


def run_compare(config: str | Path | Mapping[str, Any], variants: Sequence[str] | None = None,
                *, overrides: Sequence[str] = (), steps: int | None = None, seeds: int = 1,
                output_dir: str | Path = "compare-runs", lr_sweep: bool = False,
                sweep_fraction: float = 0.25,
                lr_factors: Sequence[float] = DEFAULT_LR_FACTORS, eval_every: int | None = None,
                device: str | None = None, callbacks: Sequence[Any] = (),
                command: str | None = None) -> CompareResult:
    """Compare optimizer variants on one base config.

    Args:
        config: the base config (file or dict); every variant starts from it.
        variants: ``--variant`` specs (``NAME`` or ``NAME:key=value,...``); None = all presets.
            The first is the baseline of the "steps/time to baseline" columns.
        overrides: ``--set`` overrides applied to the base config for every variant.
        steps: optimizer steps per run (default ``run.max_steps``).
        seeds: runs per variant; seed k is ``run.seed + k`` (and ``data.seed + k``) for all.
        output_dir: where run dirs, the table, the JSON and the PNGs go.
        lr_sweep: first run ``len(lr_factors)`` short runs per variant and keep the best lr.
        sweep_fraction: length of a sweep run as a fraction of ``steps``.
        lr_factors: sweep points as multiples of the variant's lr.
        eval_every: eval interval (default: the config's if it gives >= 10 evals, else steps//10).
        device: overrides ``run.device``.
        callbacks: extra trainer callbacks attached to every run.
        command: the command line, recorded in the report.
    """
    if seeds < 1:
        raise ConfigError(f"--seeds: must be >= 1, got {seeds}")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {steps}")
    if not 0.0 < sweep_fraction <= 1.0:
        raise ConfigError(f"--sweep-fraction: must be in (0, 1], got {sweep_fraction}")
    if not lr_factors or any(not 0 < f < math.inf for f in lr_factors):
        raise ConfigError(f"--lr-factors: need finite positive numbers, got {list(lr_factors)}")
    if eval_every is not None and eval_every < 1:
        raise ConfigError(f"--eval-every: must be >= 1, got {eval_every}")
    if not str(output_dir).strip():  # "" once wrote every run into the working directory
        raise ConfigError("--output-dir: empty; give a folder path (default: compare-runs)")
    base = load_config(config, overrides)
    steps = steps or base.run.max_steps
    eval_every = eval_every or _default_eval_every(base, steps)
    parsed = parse_variants(variants)
    out = Path(output_dir)

    def spec(v: Variant, seed_index: int, extra: tuple[str, ...] = ()) -> RunSpec:
        return RunSpec(v, seed_index, steps, out / "runs", f"{v.name}-seed{seed_index}",
                       eval_every, extra)

    # Validate every variant before any training, so a typo in the last one costs nothing.
    resolved = {v.name: resolve_run(config, overrides, base, spec(v, 0)) for v in parsed}
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission: name the option
        raise ConfigError(f"--output-dir: cannot create {str(out)!r} ({exc.strerror or exc}); "
                          "give a folder path that can be created") from None
    logger.info("compare: %d variant(s) x %d seed(s), %d steps each, eval every %d steps, "
                "baseline %s, output %s", len(parsed), seeds, steps, eval_every, parsed[0].name,
                out)
    if base.scheduler.warmup_steps > steps:  # at equal values the last step reaches the peak
        logger.warning("compare: scheduler.warmup_steps=%d > %d steps: every run is still "
                       "warming up at its end; set scheduler.warmup_steps to at most %d, e.g. %d",
                       base.scheduler.warmup_steps, steps, steps, max(1, steps // 10))

    sweep: dict[str, Any] = {}
    chosen: dict[str, tuple[str, ...]] = {}
    if lr_sweep:
        for v in parsed:
            sweep[v.name] = _sweep_variant(config, overrides, base, v, resolved[v.name], out,
                                           max(1, round(steps * sweep_fraction)), lr_factors,
                                           device, callbacks)
            chosen[v.name] = (f"{sweep[v.name]['key']}={sweep[v.name]['chosen']!r}",)

    records: dict[str, list[dict[str, Any]]] = {v.name: [] for v in parsed}
    for seed_index in range(seeds):
        for v in parsed:
            run = spec(v, seed_index, chosen.get(v.name, ()))
            cfg = resolve_run(config, overrides, base, run)
            run.lr_key, run.lr = _lr_of(cfg)
            record = run_one(cfg, run, device=device, callbacks=callbacks)
            _check_same_start(records, parsed[0].name, v.name, seed_index, record)
            records[v.name].append(record)

    return _write_outputs(out, base, parsed, records, sweep, dict(
        command=command, steps=steps, seeds=seeds, eval_every=eval_every, lr_sweep=lr_sweep,
        sweep_fraction=sweep_fraction if lr_sweep else None,
        lr_factors=list(lr_factors) if lr_sweep else None))


def _check_same_start(records: dict[str, list[dict[str, Any]]], baseline: str, name: str,
                      seed_index: int, record: dict[str, Any]) -> None:
    """Every variant at seed k must start from the baseline's weights and see its batches."""
    if name == baseline:
        return
    ref = records[baseline][seed_index]
    for key, what in (("init_hash", "initial weights"), ("data_hash", "training/eval batches")):
        if record[key] != ref[key]:
            raise SpeedtronicError(
                f"compare: {name} seed {seed_index} has different {what} than {baseline} "
                f"({key} {record[key][:12]} vs {ref[key][:12]}); the comparison would be "
                "unfair. Did a variant change the model or data, or a custom model init use "
                "an unseeded RNG?")


def _sweep_variant(config: str | Path | Mapping[str, Any], overrides: Sequence[str],
                   base: SpeedtronicConfig, v: Variant,
                   cfg0: SpeedtronicConfig, out: Path, steps: int, factors: Sequence[float],
                   device: str | None, callbacks: Sequence[Any]) -> dict[str, Any]:
    key, center = _lr_of(cfg0)
    leaf = key.split(".")[1]
    points = []
    for factor in factors:
        lr = float(f"{center * factor:.6g}")
        run = RunSpec(v, 0, steps, out / "sweep", f"{v.name}-{leaf}-{lr:.4g}", steps,
                      (f"{key}={lr!r}",), spectra=False, lr_key=key, lr=lr,
                      meta={"sweep": True})
        record = run_one(resolve_run(config, overrides, base, run), run, device=device,
                         callbacks=callbacks)
        loss = record["final_eval_loss"]
        points.append({"lr": lr, "factor": factor, "final_eval_loss": loss,
                       "diverged_at": record.get("diverged_at"),
                       "run_dir": record["run_dir"]})
    finite = [p for p in points if p["final_eval_loss"] is not None
              and math.isfinite(p["final_eval_loss"])]
    if not finite:
        raise SpeedtronicError(f"compare: every sweep run of {v.name} diverged ({key} in "
                               f"{[p['lr'] for p in points]}); lower the base {key}")
    best = min(finite, key=lambda p: p["final_eval_loss"])
    at_edge = best["factor"] in (min(factors), max(factors)) and len(factors) > 1
    logger.info("compare: %s: sweep chose %s=%.4g (eval %.4f)%s", v.name, key, best["lr"],
                best["final_eval_loss"],
                "; at the edge of the grid, a wider sweep may find a better lr" if at_edge else "")
    return {"key": key, "default": center, "steps": steps, "points": points,
            "chosen": best["lr"], "at_edge": at_edge}


def _described(v: Variant, swept: dict[str, Any] | None) -> str:
    """The variant's one-liner; after an lr sweep its own override of the swept key is shown
    replaced by the chosen value (the label once kept the value the sweep replaced)."""
    if not swept:
        return v.describe()
    key = swept["key"]
    kept = tuple(o for o in v.user_overrides if o.split("=", 1)[0].strip() != key)
    chosen = f"{key}={swept['chosen']:.4g} (swept)"
    return replace(v, user_overrides=(*kept, chosen)).describe()


def _write_outputs(out: Path, base: SpeedtronicConfig, parsed: list[Variant],
                   records: dict[str, list[dict[str, Any]]], sweep: dict[str, Any],
                   settings: dict[str, Any]) -> CompareResult:
    baseline = parsed[0].name
    summary = aggregate(records, baseline)
    descriptions = {v.name: _described(v, sweep.get(v.name)) for v in parsed}
    table = markdown_table(summary, descriptions, baseline)
    first = records[baseline][0]
    meta = {
        **settings, "baseline": baseline, "date": time.strftime("%Y-%m-%d"),
        "device": first.get("device"), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "python": platform.python_version(),
        "machine": platform.machine(), "identical_init_and_data": True,
        "tokens_per_step": base.data.target_batch_size * base.data.block_size,
    }
    files = {"table": out / "compare.md", "json": out / "compare.json"}
    _keep_other_report(out, [v.name for v in parsed], settings)
    target = summary[baseline]["final_eval_loss"]["mean"]
    title = f"{settings['steps']} steps, {settings['seeds']} seed(s), device {meta['device']}"
    if plot_loss(records, target, out / "compare_loss.png", title):
        files["loss_png"] = out / "compare_loss.png"
    spectra = {name: runs[0]["spectrum"] for name, runs in records.items() if runs[0]["spectrum"]}
    if spectra and plot_spectrum(spectra, first.get("init_spectrum"),
                                 out / "compare_spectrum.png"):
        files["spectrum_png"] = out / "compare_spectrum.png"
    payload = {
        "meta": meta,
        "base_config": base.to_dict(redact=True),
        "variants": {v.name: {"description": descriptions[v.name], "overrides": list(v.overrides),
                              "summary": summary[v.name], "runs": records[v.name]}
                     for v in parsed},
        "sweep": sweep,
        "init_spectrum": first.get("init_spectrum"),
    }
    write_json(files["json"], payload)
    from ..train.checkpoint import atomic_write_text

    # replaced whole: a rerun whose write failed once cut the previous report to 200 bytes
    atomic_write_text(files["table"], _markdown(meta, table, sweep, files))
    logger.info("compare: wrote %s", ", ".join(str(p) for p in files.values()))
    return CompareResult(summary=summary, records=records, files=files, table=table)


def _sweep_loss(point: dict[str, Any]) -> str:
    loss = point["final_eval_loss"]
    if loss is None or not math.isfinite(loss):
        at = point.get("diverged_at")
        return "diverged" + (f" at step {at}" if at is not None else "")
    return f"{loss:.4f}"


#: The report files one comparison writes into its --output-dir.
REPORT_FILES = ("compare.md", "compare.json", "compare_loss.png", "compare_spectrum.png")


def _keep_other_report(out: Path, names: list[str], settings: dict[str, Any]) -> None:
    """An output dir whose report covers other variants, seeds or steps keeps that report: its
    files are renamed ``compare.old-<time>.md`` etc. before the new one is written (a rerun
    with another variant list once replaced it silently; the run dirs stay shared, reused by
    name). The same comparison again just refreshes its report."""
    try:
        old = json.loads((out / "compare.json").read_text(encoding="utf-8"))
        old_meta = old["meta"]
        same = (list(old["variants"]) == names
                and all(old_meta.get(k) == settings[k] for k in ("steps", "seeds")))
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError):
        same = False  # unreadable: keep it, the new report must not destroy it
    if same:
        return
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    while any(out.glob(f"compare*.old-{stamp}.*")):  # two reruns in one second
        n += 1
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    moved = []
    for name in REPORT_FILES:
        path = out / name
        if path.exists():
            aside = path.with_name(f"{path.stem}.old-{stamp}{path.suffix}")
            path.replace(aside)
            moved.append(aside.name)
    logger.warning("compare: %s held the report of another comparison; kept it as %s",
                   out, ", ".join(moved))


def _markdown(meta: dict[str, Any], table: str, sweep: dict[str, Any],
              files: dict[str, Path]) -> str:
    lines = [f"# speedtronic compare ({meta['date']})", ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    lines += [f"{meta['steps']} steps x {meta['seeds']} seed(s) per variant, eval every "
              f"{meta['eval_every']} steps, {meta['tokens_per_step']} tokens/step, device "
              f"{meta['device']}, {meta['threads']} threads, torch {meta['torch']}. Every "
              "variant starts from the same initial weights and sees the same batches "
              "(checked by hash).", "", table, ""]
    lines += [
        "Columns: losses in nats/token (mean ± sample std over seeds); *final train loss* = "
        "mean of the logged train losses over the last 10% of steps; *steps/time to "
        f"{meta['baseline']}* = first eval at or below the baseline's final eval loss (same "
        "seed), at eval-interval resolution; time = training wall time without eval, compile and "
        "checkpoint writes; *opt step* = median time of `optimizer.step()`; *peak mem* = CUDA "
        "allocator peak, or the process's peak RSS on CPU; *stable rank* = mean over hidden "
        "matrices of ||W||_F² / ||W||_2² after training.", ""]
    if sweep:
        lines += ["Learning-rate sweep (seed 0, "
                  f"{next(iter(sweep.values()))['steps']} steps each, best final eval loss):", "",
                  "| variant | key | tried (eval loss) | chosen |", "|---|---|---|---:|"]
        for name, s in sweep.items():
            tried = ", ".join(f"{p['lr']:.4g} ({_sweep_loss(p)})" for p in s["points"])
            edge = " (grid edge)" if s["at_edge"] else ""
            lines.append(f"| {name} | {s['key']} | {tried} | {s['chosen']:.4g}{edge} |")
        lines.append("")
    for key in ("loss_png", "spectrum_png"):
        if key in files:
            lines += [f"![{key}]({files[key].name})", ""]
    return "\n".join(lines)
