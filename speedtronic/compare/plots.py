"""PNG figures of ``speedtronic compare``: eval loss curves and weight spectra.

matplotlib is optional (the ``plot`` extra). Without it the figures are skipped with one log
line; the table and the JSON are still written.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

from ..train.plot import save_figure

__all__ = ["plot_loss", "plot_spectrum", "matplotlib_available"]

logger = logging.getLogger("speedtronic.compare")


def matplotlib_available() -> bool:
    """True when matplotlib can be imported (it is then switched to the headless Agg backend)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    return True


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float],
                                                      list[float], list[float]]:
    """Per eval step over seeds: steps, mean loss, min loss, max loss, mean train time.

    Only steps every seed evaluated are kept (they are the same when seeds share a config).
    """
    by_step: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for step, loss, seconds in run["evals"]:
            by_step.setdefault(int(step), []).append((float(loss), float(seconds)))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
    mean = [statistics.fmean(x[0] for x in by_step[s]) for s in steps]
    low = [min(x[0] for x in by_step[s]) for s in steps]
    high = [max(x[0] for x in by_step[s]) for s in steps]
    secs = [statistics.fmean(x[1] for x in by_step[s]) for s in steps]
    return steps, mean, low, high, secs


def plot_loss(records: dict[str, list[dict[str, Any]]], target: float | None,
              path: str | Path, title: str = "") -> bool:
    """Two panels: eval loss vs optimizer steps and vs training wall time (eval and checkpoint
    time excluded), one line per variant (mean over seeds, band = min..max). Returns False if
    matplotlib is missing."""
    if not matplotlib_available():
        logger.info("compare plots: off (matplotlib not installed; pip install speedtronic[plot])")
        return False
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for name, runs in records.items():
        steps, mean, low, high, secs = _mean_curve(runs)
        if not steps:
            continue
        label = name if len(runs) == 1 else f"{name} ({len(runs)} seeds)"
        (line,) = ax_step.plot(steps, mean, marker=".", label=label)
        ax_time.plot(secs, mean, marker=".", color=line.get_color(), label=label)
        if len(runs) > 1:
            ax_step.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
            ax_time.fill_between(secs, low, high, color=line.get_color(), alpha=0.15)
    for ax, xlabel in ((ax_step, "optimizer step"), (ax_time, "training wall time (s)")):
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=0.8,
                       label="baseline final eval")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss (nats/token)")
        ax.grid(alpha=0.3)
        _zoom_y(ax, records)
    ax_step.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    try:
        save_figure(fig, path, dpi=110)  # replaced whole: a failed write keeps the last plot
    finally:
        plt.close(fig)
    return True


def _zoom_y(ax: Any, records: dict[str, list[dict[str, Any]]]) -> None:
    """Clip the y axis to the interesting part: the first eval is far above the rest and would
    flatten every difference at the end into one line."""
    # finite only: a diverged run's last eval may be NaN or inf
    losses = [row[1] for runs in records.values() for run in runs for row in run["evals"]
              if math.isfinite(row[1])]
    finals = [run["evals"][-1][1] for runs in records.values() for run in runs
              if run["evals"] and math.isfinite(run["evals"][-1][1])]
    if len(losses) < 3 or not finals:
        return
    low = min(losses)
    # Show everything below the median of all points or 1.5x the spread of final losses.
    losses_sorted = sorted(losses)
    top = min(losses_sorted[-1],
              max(losses_sorted[len(losses_sorted) // 2], max(finals) + (max(finals) - low) * 1.5))
    if top > low:
        ax.set_ylim(low - 0.05 * (top - low), top)


def plot_spectrum(spectra: dict[str, dict[str, dict[str, Any]]],
                  init: dict[str, dict[str, Any]] | None, path: str | Path) -> bool:
    """Small figure: per hidden matrix, stable rank / min(m, n) (left) and the largest singular
    value (right) for each variant's trained weights (first seed), with the shared initial
    weights as a dashed reference."""
    if not matplotlib_available():
        return False
    import matplotlib.pyplot as plt

    series = dict(spectra)
    fig, (ax_rank, ax_top) = plt.subplots(1, 2, figsize=(11, 3.6), constrained_layout=True)
    names: list[str] = []
    if init:
        names = list(init)
        x = range(len(names))
        ax_rank.plot(x, [init[n]["stable_rank"] / min(init[n]["shape"]) for n in names],
                     color="gray", linestyle="--", label="init")
        ax_top.plot(x, [init[n]["top_singular_values"][0] for n in names], color="gray",
                    linestyle="--", label="init")
    for name, spec in series.items():
        names = names or list(spec)
        keys = [n for n in names if n in spec]
        x = [names.index(n) for n in keys]
        ax_rank.plot(x, [spec[n]["stable_rank"] / min(spec[n]["shape"]) for n in keys],
                     marker=".", label=name)
        ax_top.plot(x, [spec[n]["top_singular_values"][0] for n in keys], marker=".",
                    label=name)
    short = [_short(n) for n in names]
    step = max(1, len(short) // 14)  # at most ~14 tick labels stay readable
    for ax, ylabel in ((ax_rank, "stable rank / min(m, n)"), (ax_top, "largest singular value")):
        ax.set_xticks(range(0, len(short), step))
        ax.set_xticklabels(short[::step], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_rank.set_ylim(bottom=0)
    fig.legend(*ax_rank.get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    ax_rank.set_title("hidden matrices: stable rank ||W||_F² / ||W||_2²", fontsize=9)
    ax_top.set_title("hidden matrices: top singular value", fontsize=9)
    try:
        save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
    return True


def _short(name: str) -> str:
    """``blocks.3.attn.q_proj.weight`` -> ``3.q_proj``."""
    parts = [p for p in name.split(".") if p not in ("weight", "blocks", "layers", "h", "attn",
                                                     "mlp", "ffn")]
    return ".".join(parts) or name
