"""Where training numbers go: one console line per log step, ``metrics.jsonl``, hooks, TB/W&B.

``metrics.jsonl`` (one JSON object per event, flushed per line) is the source of truth; the
console line, the tqdm bar, TensorBoard and W&B are views of the same events. Hooks are plain
callables ``hook(event, payload)``; a failing hook is reported once and never stops training.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from ..errors import SpeedtronicError

logger = logging.getLogger("speedtronic.metrics")
#: The name of the handler that writes ``logging.file`` (runtime.py opens it).
RUN_LOG_HANDLER = "speedtronic-run-file"

Hook = Callable[[str, dict[str, Any]], None]
EVENTS = ("train_start", "train_step", "eval", "checkpoint", "train_end")


def _fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def format_step_line(m: dict[str, Any], max_steps: int) -> str:
    """``step 50/500 | loss 2.3456 | lr 3.00e-04 | gnorm 0.84 | 12.3k tok/s | ...``."""
    parts = [f"step {m['step']}/{max_steps}", f"loss {m['loss']:.4f}"]
    if m.get("lr") is not None:  # the first param group's (Muon's in a hybrid optimizer)
        group = f" ({m['lr_group']})" if m.get("lr_group") else ""
        parts.append(f"lr {m['lr']:.2e}{group}")
    if m.get("grad_norm") is not None:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    parts.append(f"{_fmt_count(m['tokens_per_sec'])} tok/s")
    parts.append(f"{m['samples_per_sec']:.1f} samples/s")
    parts.append(f"{m['step_ms']:.0f} ms/step")
    if m.get("model_tflops") is not None:
        parts.append(f"{m['model_tflops']:.3g} TFLOP/s")
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if m.get("memory_bytes") is not None:
        parts.append(f"mem {m['memory_bytes'] / 2**30:.2f} GiB")
    left = max_steps - int(m["step"])
    if left > 0 and m.get("step_ms"):
        parts.append(f"eta {_fmt_duration(left * m['step_ms'] / 1000.0)}")
    return " | ".join(parts)


def _fmt_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h14m`` (time left at this interval's ms/step)."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible instead of crashing
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _drop_torn_tail(path: Path) -> None:
    """A crash mid-write leaves half a record after the last newline: cut it off, or the next
    record joins it (and is lost), and every later read would report it as damaged. Only bytes
    after the last complete line go, and only if they are not a whole JSON record (one that
    lost just its newline is ended instead)."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            block = f.read(step)
            cut = block.rfind(b"\n")
            if cut >= 0:
                pos = pos - step + cut + 1
                break
            pos -= step
        if pos < end:
            f.seek(pos)
            tail = f.read(end - pos) if end - pos < (1 << 20) else b""
            try:
                whole = isinstance(json.loads(tail), dict)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                whole = False
            if whole:
                f.seek(end)
                f.write(b"\n")
            else:
                f.truncate(pos)


class MetricsLogger:
    """Fans every event out to metrics.jsonl, the console, the progress bar and the hooks.

    Args:
        path: the ``metrics.jsonl`` file (appended to, so a resumed run continues it; opened
            at the first record, so building a logger writes nothing).
        max_steps: the step target (for the console line and the bar).
        hooks: ``(event, payload)`` callables.
        progress_bar: tqdm bar; None = only when stdout is a terminal.
        start_step: the step the run starts from (the bar's initial position).
    """

    def __init__(self, path: str | Path, *, max_steps: int, hooks: Iterable[Hook] = (),
                 progress_bar: bool | None = None, start_step: int = 0) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None  # opened by the first emit()
        self.max_steps = max_steps
        self.hooks: list[Hook] = list(hooks)
        self._failed_hooks: set[int] = set()
        self._t0 = time.time()
        self.last_line = time.monotonic()  # read by Heartbeat
        self.doing = "starting"
        """What the run is doing now (``step 12/300``, ``eval at step 50``), for Heartbeat."""
        use_bar = sys.stdout.isatty() if progress_bar is None else progress_bar
        self._bar = None
        if use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=sys.stdout)

    def line(self, text: str) -> None:
        """Print one human-readable line (above the bar when one is shown)."""
        self.last_line = time.monotonic()
        if self._bar is None:
            logger.info(text)
            return
        if not logger.isEnabledFor(logging.INFO):  # logging.level holds with a bar too
            return
        self._bar.write(f"{time.strftime('%H:%M:%S')} {text}")
        # The console got it above the bar; logging.file gets it too (with a bar it once held
        # only the start-up lines: no step, eval or summary line)
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, text, None, None)
        for handler in logging.getLogger("speedtronic").handlers:
            if handler.get_name() == RUN_LOG_HANDLER:
                handler.handle(record)

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        """Record ``event`` in metrics.jsonl and pass it to every hook."""
        record = {"event": event, "time": round(time.time() - self._t0, 3), **payload}
        try:
            if self._file is None:
                self._file = self._open()
            self._file.write(json.dumps(_jsonable(record)) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk said "[Errno 28] No space left on device", no file
            name = errno.errorcode.get(exc.errno or 0, "")
            raise SpeedtronicError(
                f"writing {str(self.path)!r} failed: {exc.strerror or exc}"
                f"{f' ({name})' if name else ''}; committed checkpoints are untouched: free "
                "space (or fix the folder) and train again with --resume") from None
        for hook in self.hooks:
            try:
                hook(event, payload)
            except Exception as exc:  # a metrics sink must never kill a training run
                if id(hook) not in self._failed_hooks:
                    self._failed_hooks.add(id(hook))
                    logger.warning("metrics hook %r failed on %r: %s: %s (reported once; "
                                   "training continues)", hook, event, type(exc).__name__, exc)

    def _open(self) -> TextIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        return open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def advance(self, steps: int = 1, postfix: dict[str, Any] | None = None) -> None:
        """Move the progress bar (no-op without one)."""
        if self._bar is not None:
            self._bar.update(steps)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for hook in self.hooks:
            close = getattr(hook, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as exc:  # a sink that cannot close (wandb.finish, a full disk)
                # once ended a finished run with its error and left the run directory locked
                logger.warning("metrics hook %r failed to close: %s: %s (the run's own "
                               "metrics.jsonl is complete)", hook, type(exc).__name__, exc)
        if self._file is not None and not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the write that failed was reported; its buffer is lost
                pass


class PeerMetrics(MetricsLogger):
    """The metrics logger of a data-parallel rank other than 0: it writes and prints nothing
    (rank 0 records the run; its rows hold the global loss and tokens/s)."""

    def __init__(self, max_steps: int) -> None:
        super().__init__(Path(os.devnull), max_steps=max_steps, progress_bar=False)

    def line(self, text: str) -> None:
        self.last_line = time.monotonic()

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        return None


class Heartbeat:
    """A console line when nothing was printed for ``every`` seconds: a long first step (a large
    model on a CPU, a compile), a slow eval or save would otherwise look like a hang. Host-side
    only (a daemon thread reading two attributes); it never touches a device.

    Args:
        metrics: the logger whose ``line`` / ``doing`` it watches.
        every: seconds of silence before a line (and between two of them); <= 0 is off.
    """

    def __init__(self, metrics: MetricsLogger, every: float) -> None:
        self.metrics, self.every = metrics, every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    def __enter__(self) -> Heartbeat:
        if self.every > 0:
            self._thread = threading.Thread(target=self._run, name="speedtronic-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.every / 4)):
            quiet = time.monotonic() - self.metrics.last_line
            if quiet >= self.every:
                self.metrics.line(f"... {self.metrics.doing}: still running ({quiet:.0f} s since "
                                  f"the last line, {time.monotonic() - self._t0:.0f} s into "
                                  "the run)")


def iter_metrics(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every JSON-object line of a metrics.jsonl file.

    Damaged lines (not UTF-8, not JSON, or JSON that is not an object) are skipped, so a file
    torn by a crash still reads. Skips other than a torn last line are logged once, with the
    file and line numbers: they mean something else damaged or wrote into the file.
    """
    damaged: list[str] = []
    lineno, data = 0, b"\n"
    with open(path, "rb") as f:  # bytes: a crash can tear a multi-byte character too
        for lineno, data in enumerate(f, 1):
            try:
                text = data.decode("utf-8").strip()
                record = json.loads(text) if text else None
            except UnicodeDecodeError:
                damaged.append(f"line {lineno}: not UTF-8")
                continue
            except ValueError:  # JSONDecodeError, and int() limits on huge numbers
                damaged.append(f"line {lineno}: not valid JSON")
                continue
            if text and not isinstance(record, dict):
                damaged.append(f"line {lineno}: a JSON {type(record).__name__}, not an object")
            elif text:
                yield lineno, record
    if damaged and not data.endswith(b"\n") and damaged[-1].startswith(f"line {lineno}:"):
        damaged.pop()  # the torn last line of a crashed run: expected, not worth a warning
    if damaged:
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        logger.warning("%s: skipped %d damaged line(s) (%s%s)", path, len(damaged),
                       "; ".join(damaged[:3]), more)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, damaged lines skipped (see :func:`iter_metrics`)."""
    return [record for _, record in iter_metrics(path)]


_TENSORBOARD_MISSING = ("logging.tensorboard: true needs TensorBoard; install it with "
                        "pip install 'speedtronic[tensorboard]'")
_WANDB_MISSING = "logging.wandb: true needs wandb; install it with pip install 'speedtronic[wandb]'"


def require_hook_packages(*, tensorboard: bool, wandb: bool) -> None:
    """Raise a hook's missing-package error now, without importing it: the runtime checks
    before it touches the run directory, and builds the hooks only after."""
    from importlib.util import find_spec

    if tensorboard and find_spec("tensorboard") is None:
        raise SpeedtronicError(_TENSORBOARD_MISSING)
    if wandb and find_spec("wandb") is None:
        raise SpeedtronicError(_WANDB_MISSING)


class TensorBoardHook:
    """Writes numeric payload values as ``<event>/<key>`` scalars at ``payload['step']``."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SpeedtronicError(_TENSORBOARD_MISSING) from None
        # purge_step: a resumed run drops the interrupted run's events from that step on.
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        step = payload.get("step")
        if step is None or event not in ("train_step", "eval"):
            return
        for key, value in payload.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{event}/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbHook:
    """Logs numeric values of ``train_step``/``eval`` events to Weights & Biases."""

    def __init__(self, project: str | None, run_name: str, config: dict[str, Any],
                 run_dir: str | Path) -> None:
        try:
            import wandb
        except ImportError:
            raise SpeedtronicError(_WANDB_MISSING) from None
        self._wandb = wandb
        self._run = wandb.init(project=project or "speedtronic", name=run_name, config=config,
                               dir=str(run_dir))

    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        step = payload.get("step")
        if step is None or event not in ("train_step", "eval"):
            return
        data = {f"{event}/{k}": v for k, v in payload.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()
