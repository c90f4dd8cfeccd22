"""Loss curves as a PNG from one or more runs' ``metrics.jsonl`` (``speedtronic plot``).

One line per run (train loss solid, eval loss dashed in the same colour), so several runs can be
compared in one picture. matplotlib is an optional extra (``speedtronic[plot]``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import SpeedtronicError
from .metrics import iter_metrics


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported, found without importing it (that costs 0.3-0.5 s)."""
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
    curves: dict[str, dict[int, float]] = {"train_step": {}, "eval": {}}
    for lineno, rec in iter_metrics(path):
        event = rec.get("event")
        loss = rec.get("loss" if event == "train_step" else "eval_loss")
        if event not in curves or not _is_number(loss):
            continue  # other events, and "nan"/"inf" losses (JSON has no non-finite numbers)
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise SpeedtronicError(f"{path}: line {lineno}: a {event} record needs an integer "
                                   f"'step', got {step!r}")
        curves[event][step] = float(loss)  # a resumed run re-logs steps; the later value wins
    return sorted(curves["train_step"].items()), sorted(curves["eval"].items())


def _runs_in(folder: Path) -> list[Path]:
    """``folder`` itself, or for a ``speedtronic compare`` output folder (no metrics.jsonl of
    its own) every run under its ``runs/``, sorted by name."""
    if (folder / "metrics.jsonl").is_file() or not (folder / "runs").is_dir():
        return [folder]
    runs = sorted(p for p in (folder / "runs").iterdir() if (p / "metrics.jsonl").is_file())
    return runs or [folder]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _output_path(out: str | Path | None, first_run: Path, formats: dict[str, str]) -> Path:
    """The file to write. matplotlib picks the format from the suffix and, without one, appends
    ``.png`` itself (``-o runs`` wrote ``runs.png``), so settle the name here and report it."""
    if out is None:
        return first_run / "loss.png"
    path = Path(out)
    if path.is_dir() or str(out).endswith(("/", os.sep)):
        return path / "loss.png"
    if not path.suffix:
        return path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in formats:
        raise SpeedtronicError(f"plot: cannot write {str(path)!r}: '{path.suffix}' is not an "
                               f"image type matplotlib writes (use .png, .svg, .pdf or a "
                               f"directory for <dir>/loss.png)")
    return path


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Plot train/eval loss of ``run_dirs`` into ``out`` and return the path written.

    ``out``: a file (no suffix = ``.png``), a directory (``<dir>/loss.png``) or None
    (``<first run>/loss.png``). A ``speedtronic compare`` output folder stands for its runs.
    """
    if not run_dirs:
        raise SpeedtronicError("plot: give at least one run directory")
    if not matplotlib_available():
        raise SpeedtronicError("plotting needs matplotlib: pip install 'speedtronic[plot]'")
    # The object API, not pyplot: no global figure registry, no GUI backend selection, and
    # half the import time (pyplot pulls in the backend machinery).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    given = [Path(d) for d in run_dirs]
    out_path = _output_path(out, given[0], FigureCanvasAgg.get_supported_filetypes())
    dirs = [run for d in given for run in _runs_in(d)]
    data = [(d, *_curves(d)) for d in dirs]
    if not any(train or evals for _, train, evals in data):
        raise SpeedtronicError("plot: no loss values in " + ", ".join(str(d) for d in dirs))
    blocked = next((p for p in out_path.parents if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise SpeedtronicError(f"plot: cannot write {str(out_path)!r}: {blocked} is a file, not a "
                               "folder; give -o a path in a folder")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (d, train, evals) in enumerate(data):
        color = f"C{i % 10}"
        label = d.resolve().name
        if train:
            # One logged step draws no line: a marker keeps it visible.
            ax.plot([s for s, _ in train], [v for _, v in train], color=color, lw=1.4,
                    marker="o" if len(train) == 1 else None, ms=4, label=f"{label} train")
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], color=color, lw=1.4,
                    ls="--", marker="o", ms=3, label=f"{label} eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Speedtronic loss" if len(dirs) == 1 else "Speedtronic loss: run comparison")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out_path)
    return out_path


def save_figure(fig: Any, path: Path, **kwargs: Any) -> None:
    """``fig.savefig`` into a temp file beside ``path``, then replace it: written in place, a
    full disk left a truncated PNG where the last good plot was. A failure names the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, **kwargs)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise SpeedtronicError(f"plot: cannot write {path}: {exc.strerror or exc} (the "
                               "previous plot, if any, is unchanged)") from None
    except BaseException:  # Ctrl-C mid-draw: svg/pdf had opened the temp file already
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
