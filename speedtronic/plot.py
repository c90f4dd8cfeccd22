"""Loss curves as a PNG from one or more runs' ``metrics.jsonl`` (``speedtronic plot``).

One line per run (train loss solid, eval loss dashed in the same colour), so several runs can be
compared in one picture. matplotlib is an optional extra (``speedtronic[plot]``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from .errors import SpeedtronicError
from .metrics import read_metrics


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def preload() -> None:
    """Import the plotting modules (0.3-0.5 s) now; ``speedtronic train`` runs this on a
    background thread while the model trains, so the plot at the end does not wait for it."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401


def _curves(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SpeedtronicError(f"no metrics.jsonl in {str(run_dir)!r} (is it a run directory?)")
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for rec in read_metrics(path):
        # A resumed run re-logs steps after its checkpoint; the later value wins.
        if rec.get("event") == "train_step" and isinstance(rec.get("loss"), (int, float)):
            train[int(rec["step"])] = float(rec["loss"])
        elif rec.get("event") == "eval" and isinstance(rec.get("eval_loss"), (int, float)):
            evals[int(rec["step"])] = float(rec["eval_loss"])
    return sorted(train.items()), sorted(evals.items())


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Plot train/eval loss of ``run_dirs`` into ``out`` (default ``<first run>/loss.png``)."""
    if not run_dirs:
        raise SpeedtronicError("plot: give at least one run directory")
    if not matplotlib_available():
        raise SpeedtronicError("plotting needs matplotlib: pip install 'speedtronic[plot]'")
    # The object API, not pyplot: no global figure registry, no GUI backend selection, and
    # half the import time (pyplot pulls in the backend machinery).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dirs = [Path(d) for d in run_dirs]
    data = [(d, *_curves(d)) for d in dirs]
    if not any(train or evals for _, train, evals in data):
        raise SpeedtronicError("plot: no loss values in " + ", ".join(str(d) for d in dirs))
    out_path = Path(out) if out is not None else dirs[0] / "loss.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (d, train, evals) in enumerate(data):
        color = f"C{i % 10}"
        label = d.resolve().name
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], color=color, lw=1.4,
                    label=f"{label} train")
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], color=color, lw=1.4,
                    ls="--", marker="o", ms=3, label=f"{label} eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Speedtronic loss" if len(dirs) == 1 else "Speedtronic loss: run comparison")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    return out_path
