"""Running the variants of ``speedtronic compare``: run directories, done-files, resume, sweep.

Layout of ``--output-dir``::

    runs/<variant>-seed<k>/        one engine run dir each (checkpoints, metrics.jsonl, ...)
        compare_done.json          written when that run finished: its full record
    sweep/<variant>-<key>-<lr>/    the short learning-rate sweep runs (same layout)
    compare.md, compare.json, compare_loss.png, compare_spectrum.png

A run with a done-file is never trained again; one without resumes from its newest checkpoint.
A done-file or checkpoint made with a different config is refused instead of silently reused.
A run whose loss or weights turn non-finite is a result, not a failure of the comparison: its
done-file records ``diverged_at`` (no final losses) and the other variants still run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..config import SpeedtronicConfig
from ..errors import NonFiniteError, SpeedtronicError
from .recorder import CompareRecorder
from .report import write_json
from .spectrum import summarize_spectra
from .variants import Variant, resolve_variant

__all__ = ["RunSpec", "run_one", "data_fingerprint", "DONE_FILE"]

logger = logging.getLogger("speedtronic.compare")

DONE_FILE = "compare_done.json"
# Config parts that decide a run's numbers; a finished or checkpointed run is reused only if
# these match (logging, checkpoint cadence, output paths may change between invocations).
_RESULT_SECTIONS = ("model", "data", "optimizer", "scheduler", "precision")
_RESULT_ROOT = ("compile", "gradient_checkpointing", "ooo_backprop")


@dataclass
class RunSpec:
    """One training run of the comparison (a variant at a seed, or a sweep point)."""

    variant: Variant
    seed_index: int
    steps: int
    run_root: Path
    run_name: str
    eval_every: int
    extra_overrides: tuple[str, ...] = ()
    """E.g. the learning rate chosen by the sweep, or the sweep point's lr."""
    spectra: bool = True
    lr_key: str | None = None
    lr: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.run_root / self.run_name


def _run_overrides(spec: RunSpec, base: SpeedtronicConfig) -> list[str]:
    """What compare pins for every run: identity, seed, length, eval cadence, checkpoints."""
    seed = base.run.seed + spec.seed_index
    data_seed = (base.data.seed if base.data.seed is not None else base.run.seed) + spec.seed_index
    every = min(base.checkpoint.every_steps, max(1, spec.steps // 4))
    return [f"run.name={json.dumps(spec.run_name)}",
            f"run.output_dir={json.dumps(str(spec.run_root))}", f"run.seed={seed}",
            f"data.seed={data_seed}", f"run.max_steps={spec.steps}",
            f"scheduler.max_steps={spec.steps}", f"run.eval_every={spec.eval_every}",
            "checkpoint.enabled=true", f"checkpoint.every_steps={every}", "checkpoint.keep_last=2",
            "checkpoint.resume=false", "distributed.enabled=false"]


def resolve_run(source: Any, base_overrides: Sequence[str], base: SpeedtronicConfig,
                spec: RunSpec) -> SpeedtronicConfig:
    """The full config of one run (variant overrides, then the sweep/chosen lr, then compare's)."""
    variant = Variant(spec.variant.name, spec.variant.overrides + spec.extra_overrides,
                      spec.variant.preset, spec.variant.user_overrides)
    return resolve_variant(source, base_overrides, variant, _run_overrides(spec, base))


def result_config(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The parts of a resolved config that decide a run's numbers (see ``_RESULT_SECTIONS``)."""
    out = {sec: cfg_dict.get(sec) for sec in _RESULT_SECTIONS}
    out.update({k: cfg_dict.get(k) for k in _RESULT_ROOT})
    run = cfg_dict.get("run") or {}
    # The eval grid and the log interval decide the report's numbers too (steps-to-target is
    # read off the eval rows, the final train loss off the log rows): a rerun with another
    # --eval-every once reused every old run and labelled them with the new interval.
    out["run"] = {k: run.get(k) for k in ("seed", "max_steps", "eval_every", "eval_batches")}
    out["logging"] = {"every_steps": (cfg_dict.get("logging") or {}).get("every_steps")}
    return out


def _first_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            diff = _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return None if old == new else f"{prefix.rstrip('.')}: {old!r} -> {new!r}"


def _check_same_config(run_dir: Path, saved: dict[str, Any] | None, current: dict[str, Any],
                       what: str) -> None:
    if saved is None:
        return
    diff = _first_difference(result_config(saved), result_config(current))
    if diff:
        raise SpeedtronicError(f"{run_dir} holds a {what} made with a different config ({diff}); "
                               "use another --output-dir or delete that run directory")


def data_fingerprint(cfg: SpeedtronicConfig, micro_batches: int = 4) -> str:
    """SHA-256 of the first training micro-batches and of the eval batches, built exactly as the
    runtime builds them: equal fingerprints mean the same data order and the same eval set."""
    from ..data import build_data

    # The run builds the same data again and logs its line then; once per run is enough.
    data_logger = logging.getLogger("speedtronic.data")
    level = data_logger.level
    data_logger.setLevel(max(level, logging.WARNING))
    try:
        data = build_data(cfg, rank=0, world=1)
    finally:
        data_logger.setLevel(level)
    digest = hashlib.sha256()
    batches = [next(data.train) for _ in range(micro_batches)]
    for x, y in [*batches, *data.eval_batches(cfg.run.eval_batches)]:
        for t in (x, y):
            digest.update(t.contiguous().numpy().tobytes())
    close = getattr(data, "close", None)
    if callable(close):
        close()
    return digest.hexdigest()


def _load_done(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / DONE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("compare: ignoring unreadable %s (%s); the run will be resumed", path, exc)
        return None


def _saved_run_config(run_dir: Path) -> dict[str, Any] | None:
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _has_checkpoint(cfg: SpeedtronicConfig) -> bool:
    from ..train.checkpoint import CheckpointManager

    return bool(CheckpointManager(cfg.run_dir / cfg.checkpoint.directory).list())


def _nan_to_inf(value: float | None) -> float:
    return math.inf if value is None or math.isnan(value) else float(value)


def run_one(cfg: SpeedtronicConfig, spec: RunSpec, *, device: str | None,
            callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train one run (or load its done-file) and return its record."""
    run_dir = cfg.run_dir
    current = cfg.to_dict(redact=True)
    done = _load_done(run_dir)
    label = f"{spec.variant.name} seed {spec.seed_index}" if not spec.meta.get("sweep") else \
        f"{spec.variant.name} sweep {spec.lr_key}={spec.lr:.4g}"
    if done is not None:
        _check_same_config(run_dir, done.get("config"), current, "finished run")
        logger.info("compare: %s: finished earlier, not re-run (%s)", label, run_dir / DONE_FILE)
        done["reused"] = True
        return done
    resume = _has_checkpoint(cfg)
    if resume:
        _check_same_config(run_dir, _saved_run_config(run_dir), current, "checkpointed run")
        logger.info("compare: %s: resuming from the newest checkpoint in %s", label, run_dir)
    else:
        logger.info("compare: %s: training %d steps in %s", label, spec.steps, run_dir)
    fingerprint = data_fingerprint(cfg)

    from ..train.runtime import train_from_config

    rec = CompareRecorder(spectra=spec.spectra)
    try:
        result = train_from_config(cfg, resume=resume, device=device, hooks=[rec],
                                   callbacks=[rec, *callbacks], plot=False)
    except NonFiniteError as exc:
        # A diverging variant (or sweep point) once aborted the whole comparison with no
        # report, and a rerun diverged again at the same step.
        record = _diverged_record(cfg, spec, rec, exc, fingerprint, current)
        write_json(run_dir / DONE_FILE, record, strict=False)
        logger.warning("compare: %s: diverged at step %s (non-finite loss, gradient norm or "
                       "weights); recorded as diverged in %s, the comparison goes on", label,
                       record["diverged_at"], run_dir / DONE_FILE)
        return record
    if not rec.finished:
        raise SpeedtronicError(f"compare: {label} stopped at step {result.steps} of {spec.steps}")
    record = _record(cfg, spec, rec, result, fingerprint, current)
    write_json(run_dir / DONE_FILE, record, strict=False)  # read back by Python only
    logger.info("compare: %s: done, final eval loss %.4f, %.1f s training", label,
                record["final_eval_loss"], record["train_time_s"])
    return record


def _diverged_record(cfg: SpeedtronicConfig, spec: RunSpec, rec: CompareRecorder,
                     exc: NonFiniteError, fingerprint: str,
                     current: dict[str, Any]) -> dict[str, Any]:
    """The record of a run stopped by the non-finite guard: its evals and train losses up to
    the divergence, no final losses (the report shows "diverged"), ``diverged_at`` = the first
    non-finite step."""
    failed = exc.step if exc.step is not None else spec.steps
    trained = max(0, failed - 1)  # the steps before the first non-finite one
    tokens_per_step = cfg.data.target_batch_size * cfg.data.block_size
    partial = SimpleNamespace(steps=trained, tokens=trained * tokens_per_step)
    record = _record(cfg, spec, rec, partial, fingerprint, current)
    record.update(final_train_loss=None, final_eval_loss=None, diverged_at=int(failed),
                  error=str(exc))
    return record


def _record(cfg: SpeedtronicConfig, spec: RunSpec, rec: CompareRecorder, result: Any,
            fingerprint: str, current: dict[str, Any]) -> dict[str, Any]:
    s = rec.state
    evals = sorted(s["evals"])
    losses = sorted(s["train_losses"])
    # "Final train loss" = mean of the logged train losses over the last 10% of the steps: one
    # logged value is a short window and too noisy to rank variants by.
    tail = [loss for step, loss in losses if step > 0.9 * spec.steps] or \
        [loss for _, loss in losses[-1:]]
    eval_losses = [_nan_to_inf(row[1]) for row in evals]
    peak = s["peak_memory_bytes"]
    spectrum = rec.final_spectrum or {}
    return {
        "variant": spec.variant.name,
        "description": spec.variant.describe(),
        "seed_index": spec.seed_index,
        "seed": cfg.run.seed,
        "run_dir": str(cfg.run_dir),
        "lr_key": spec.lr_key,
        "lr": spec.lr,
        "steps": result.steps,
        "tokens": result.tokens,
        "init_hash": s["init_hash"],
        "final_hash": rec.final_hash,
        "data_hash": fingerprint,
        "resumed_from": list(s["resumed_from"]),
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "best_eval_loss": min(eval_losses) if eval_losses else None,
        "train_time_s": s["train_time_s"],
        "compile_time_s": s.get("compile_time_s", 0.0),
        "tokens_per_s": result.tokens / s["train_time_s"] if s["train_time_s"] > 0 else None,
        "optimizer_step_ms": rec.optimizer_step_ms(),
        "optimizer_steps_timed": len(s["optimizer_step_s"]),
        "peak_memory_mib": peak / 2**20 if peak else None,
        "memory_kind": s["memory_kind"],
        "diverged_at": None,
        "evals": evals,
        "train_losses": losses,
        "spectrum": spectrum,
        "init_spectrum": s["init_spectrum"],
        **{k: v for k, v in summarize_spectra(spectrum).items() if k != "matrices"},
        "device": str(rec.device),
        "config": current,
    }
