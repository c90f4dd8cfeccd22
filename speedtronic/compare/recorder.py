"""The per-run recorder of ``speedtronic compare``: a trainer callback *and* a metrics hook.

It measures what the comparison table needs, and its state rides in the run's checkpoints (as
the callback named ``compare``), so a resumed run continues its curves and clocks:

* the hash of the initial weights (to prove every variant started from the same init);
* eval losses with the *training* wall time at which they were reached (time spent in eval and
  checkpoint writes is excluded, so a variant is not charged for the harness);
* logged train losses;
* the time of every ``optimizer.step`` (optimizer step pre/post hooks; CUDA events on GPU so
  the loop gains no host syncs);
* peak memory (CUDA allocator peak, or the process's peak RSS on CPU, reset at the run start);
* the singular-value spectra of the hidden matrices at init and after training.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..train.precision import max_memory_bytes, synchronize
from .spectrum import model_spectrum

__all__ = ["CompareRecorder", "state_hash"]

logger = logging.getLogger("speedtronic.compare")

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def state_hash(model: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, raw bytes), sorted by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _reset_peak_memory(device: torch.device) -> str:
    """Reset the peak-memory counter; returns what will be measured."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:  # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) of this process
        _PROC_CLEAR_REFS.write_text("5")
        return "process_peak_rss"
    except OSError:
        return "process_peak_rss_lifetime"  # not resettable: the peak since process start


def _peak_memory(device: torch.device) -> int | None:
    """CUDA allocator peak, or this process's peak RSS since the last reset (Linux VmHWM);
    elsewhere the lifetime peak RSS from :func:`speedtronic.train.precision.max_memory_bytes`."""
    if device.type != "cuda":
        try:
            for line in _PROC_STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
    return max_memory_bytes(device)


class CompareRecorder:
    """Attach with ``train_from_config(cfg, hooks=[rec], callbacks=[rec])``.

    Args:
        spectra: also compute the weight spectra at init and at the end of training.
    """

    name = "compare"

    def __init__(self, spectra: bool = True) -> None:
        self.spectra = spectra
        self.state: dict[str, Any] = {
            "init_hash": None, "init_spectrum": None, "evals": [], "train_losses": [],
            "train_time_s": 0.0, "compile_time_s": 0.0, "optimizer_step_s": [],
            "peak_memory_bytes": None,
            "memory_kind": None, "resumed_from": [],
        }
        self.final_spectrum: dict[str, Any] | None = None
        self.final_hash: str | None = None
        self.finished = False
        self._mark = 0.0
        self._compile_seen = 0.0  # trainer.compile_seconds already accounted for
        self._handles: list[Any] = []
        self._device = torch.device("cpu")
        self._pending_events: list[tuple[Any, Any]] = []
        self._t_pre = 0.0

    # --------------------------------------------------------------------- checkpointed state
    def state_dict(self) -> dict[str, Any]:
        self._drain_cuda_events()
        self.state["peak_memory_bytes"] = self._peak()
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.update(state)

    # --------------------------------------------------------------------- callback
    def on_train_start(self, trainer: Any) -> None:
        self._device = torch.device(trainer.device)
        if trainer.step == 0:
            self.state["init_hash"] = state_hash(trainer.model)
            if self.spectra:
                self.state["init_spectrum"] = model_spectrum(trainer.model)
        else:
            self.state["resumed_from"] = [*self.state["resumed_from"], int(trainer.step)]
        self.state["memory_kind"] = _reset_peak_memory(self._device)
        opt = trainer.optimizer
        self._handles = [opt.register_step_pre_hook(self._pre_step),
                         opt.register_step_post_hook(self._post_step)]
        self._mark = time.perf_counter()
        self._compile_seen = float(getattr(trainer, "compile_seconds", 0.0))

    def after_optimizer_step(self, trainer: Any, step: int) -> None:
        cfg = trainer.config
        boundary = (step >= cfg.run.max_steps or (cfg.run.eval_every and step % cfg.run.eval_every
                    == 0) or step % cfg.checkpoint.every_steps == 0)
        if boundary:
            # An eval or checkpoint follows and is excluded from the clock: let the queued
            # training work finish first so it is counted as training, not as eval.
            synchronize(self._device)
        now = time.perf_counter()
        # torch.compile's compile is not training time (the trainer's ms/step leaves it out
        # too): a compile variant once read 24 s "to adamw" on CPU against 0.0 s. It is
        # recorded apart, as compile_time_s.
        compiled = float(getattr(trainer, "compile_seconds", 0.0)) - self._compile_seen
        self._compile_seen += compiled
        self.state["compile_time_s"] = self.state.get("compile_time_s", 0.0) + compiled
        self.state["train_time_s"] += max(0.0, now - self._mark - compiled)
        self._mark = now

    def on_train_end(self, trainer: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._drain_cuda_events()
        self.state["peak_memory_bytes"] = self._peak()
        self.finished = trainer.step >= trainer.config.run.max_steps
        if self.finished:
            self.final_hash = state_hash(trainer.model)
            if self.spectra:
                self.final_spectrum = model_spectrum(trainer.model)

    # --------------------------------------------------------------------- metrics hook
    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        if event == "eval":
            rows = [r for r in self.state["evals"] if r[0] != payload["step"]]  # a redone eval
            self.state["evals"] = [*rows, [int(payload["step"]), float(payload["eval_loss"]),
                                           float(self.state["train_time_s"])]]
        elif event == "train_step":
            self.state["train_losses"] = [*self.state["train_losses"],
                                          [int(payload["step"]), float(payload["loss"])]]
        if event in ("eval", "checkpoint"):
            self._mark = time.perf_counter()  # the eval / checkpoint write is not training time

    # --------------------------------------------------------------------- optimizer timing
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending_events.append((start, None))
        else:  # MPS queues work: time it from an empty queue to an empty queue
            synchronize(self._device)
            self._t_pre = time.perf_counter()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending_events[-1] = (self._pending_events[-1][0], end)
        else:
            synchronize(self._device)
            self._add_step_times([time.perf_counter() - self._t_pre])

    def _add_step_times(self, seconds: list[float]) -> None:
        # Keep the newest 4096 samples: enough for a stable median, and the list rides in every
        # checkpoint, so it must not grow with the run length.
        self.state["optimizer_step_s"] = [*self.state["optimizer_step_s"], *seconds][-4096:]

    def _drain_cuda_events(self) -> None:
        done = [(a, b) for a, b in self._pending_events if b is not None]
        if done:
            done[-1][1].synchronize()
            self._add_step_times([a.elapsed_time(b) / 1000.0 for a, b in done])
        self._pending_events = []

    def _peak(self) -> int | None:
        current = _peak_memory(self._device)
        saved = self.state.get("peak_memory_bytes")
        return max(v for v in (current, saved) if v is not None) if (current or saved) else None

    # --------------------------------------------------------------------- summary
    @property
    def device(self) -> torch.device:
        """The device the run trained on (known after ``on_train_start``)."""
        return self._device

    def optimizer_step_ms(self) -> float | None:
        """Median optimizer step time in ms (the median resists the noise of a shared host)."""
        times = self.state["optimizer_step_s"]
        return 1000.0 * statistics.median(times) if times else None
