"""Aggregation over seeds, the markdown table and the JSON report of ``speedtronic compare``.

Input: one *run record* per (variant, seed) — the dict a finished run writes to its done-file
(see :mod:`speedtronic.compare.runner`). Output: per-variant statistics (mean, sample standard
deviation, min, max over seeds), the steps and training time each variant needs to reach the
baseline's final eval loss, and the files ``compare.md`` / ``compare.json``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["stats", "first_reach", "aggregate", "markdown_table", "write_json"]

# Scalar fields of a run record that are averaged over seeds.
_SCALARS = ("final_train_loss", "final_eval_loss", "best_eval_loss", "tokens_per_s",
            "optimizer_step_ms", "peak_memory_mib", "train_time_s", "mean_stable_rank",
            "mean_effective_rank")


def stats(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std (0 for one value), min and max of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "std": std, "min": min(vals), "max": max(vals),
            "n": len(vals)}


def first_reach(evals: Sequence[Sequence[float]], target: float) -> tuple[int, float] | None:
    """First ``(step, train_time_s)`` whose eval loss is <= ``target``; None if never.

    ``evals`` rows are ``[step, eval_loss, train_time_s]`` in step order. The resolution is the
    eval interval: a variant that crosses the target between two evals is credited at the later.
    The step-0 eval (the untrained model) never counts: where the baseline ended above its own
    start, every variant once "reached" it at step 0.
    """
    for step, loss, seconds in evals:
        if step > 0 and loss is not None and not math.isnan(loss) and loss <= target:
            return int(step), float(seconds)
    return None


def aggregate(records: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, Any]:
    """Per-variant statistics. ``records[variant]`` holds one record per seed (same seed order
    for every variant); the target for seed ``s`` is the baseline's final eval loss at seed s."""
    targets = {r["seed"]: r["final_eval_loss"] for r in records[baseline]}
    out: dict[str, Any] = {}
    for name, runs in records.items():
        row: dict[str, Any] = {key: stats([r.get(key) for r in runs]) for key in _SCALARS}
        reached = [(r["seed"], first_reach(r["evals"], targets[r["seed"]])) for r in runs
                   if targets.get(r["seed"]) is not None]
        hits = [hit for _, hit in reached if hit is not None]
        row["steps_to_baseline"] = stats([h[0] for h in hits])
        row["time_to_baseline_s"] = stats([h[1] for h in hits])
        row["reached_baseline"] = f"{len(hits)}/{len(reached)}"
        # Runs stopped by the non-finite guard have no final losses (stats skip them): the
        # table says how many diverged and where, instead of averaging over the rest silently.
        row["diverged_at"] = [int(r["diverged_at"]) for r in runs
                              if r.get("diverged_at") is not None]
        row["lr"] = runs[0].get("lr")
        row["lr_key"] = runs[0].get("lr_key")
        row["seeds"] = [r["seed"] for r in runs]
        out[name] = row
    return out


def _fmt(s: dict[str, Any], digits: int, scale: float = 1.0) -> str:
    if s["mean"] is None or (isinstance(s["mean"], float) and math.isnan(s["mean"])):
        return "—" if s["mean"] is None else "nan"
    text = f"{s['mean'] * scale:.{digits}f}"
    if s["n"] > 1:
        text += f" ± {s['std'] * scale:.{digits}f}"
    return text


def markdown_table(summary: dict[str, Any], variants: dict[str, str], baseline: str) -> str:
    """The comparison table; ``variants`` maps name -> description (preset + overrides)."""
    head = ("| variant | lr | final train loss | final eval loss | best eval loss | "
            f"steps to {baseline} | time to {baseline} (s) | tokens/s | opt step (ms) | "
            "peak mem (MiB) | stable rank |")
    lines = [head, "|" + "|".join(["---"] + ["---:"] * (head.count("|") - 2)) + "|"]
    for name, row in summary.items():
        lr = "—" if row["lr"] is None else f"{row['lr']:.3g}"
        if row["lr_key"]:
            lr += f" ({row['lr_key'].split('.')[-1]})"
        reached = row["reached_baseline"]
        n_hit, n_all = (int(x) for x in reached.split("/"))
        steps = _fmt(row["steps_to_baseline"], 0) if n_hit else "not reached"
        secs = _fmt(row["time_to_baseline_s"], 1) if n_hit else "—"
        if 0 < n_hit < n_all:
            steps += f" ({reached} seeds)"
        label = name if variants.get(name) in (None, name) else f"{name} ({variants[name]})"
        final_eval = _fmt(row["final_eval_loss"], 4)
        diverged = row.get("diverged_at") or []
        if diverged and len(diverged) == len(row["seeds"]):
            final_eval = f"diverged (step {min(diverged)})"
        elif diverged:
            final_eval += f" ({len(diverged)}/{len(row['seeds'])} seeds diverged)"
        lines.append("| " + " | ".join([
            label, lr, _fmt(row["final_train_loss"], 4), final_eval,
            _fmt(row["best_eval_loss"], 4), steps, secs, _fmt(row["tokens_per_s"], 0),
            _fmt(row["optimizer_step_ms"], 2), _fmt(row["peak_memory_mib"], 0),
            _fmt(row["mean_stable_rank"], 1)]) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str | Path, payload: dict[str, Any], strict: bool = True) -> None:
    """Write ``payload`` as JSON, durably and atomically (a done-file is never half written).

    ``strict``: non-finite floats become strings (valid JSON for any reader); otherwise
    NaN/Infinity are kept so Python's json reads them back as floats.
    """
    from ..train.checkpoint import atomic_write_text
    from ..train.metrics import _jsonable

    data = _jsonable(payload) if strict else payload
    atomic_write_text(Path(path), json.dumps(data, indent=1, default=str) + "\n")
