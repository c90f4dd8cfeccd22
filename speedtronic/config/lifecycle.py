"""The sections about the run around the step: ``run`` (its name, seed, device and length),
``checkpoint`` (when it saves), ``train`` (what it does on a NaN/inf or a preemption signal),
``logging`` (what it reports) and ``shape_validation`` (the startup alignment warnings).

None of them changes the numbers a step computes; they decide where a run lives, when it
stops and what it leaves behind. Field docstrings are the reference documentation of each key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

from ..errors import brief
from .rules import require

__all__ = [
    "MAX_THREADS",
    "PORTABLE_SIGNALS",
    "PREEMPTION_SIGNALS",
    "RUN_FILES",
    "CheckpointConfig",
    "LoggingConfig",
    "RunConfig",
    "ShapeValidationConfig",
    "TrainConfig",
]

#: Files every run writes in its run directory: no checkpoint folder may be made under them.
RUN_FILES = ("config.yaml", "metrics.jsonl", "loss.png")
#: Upper bound of ``run.num_threads``: above the core count of any host we know of, below what
#: libgomp and torch.set_num_threads survive (20000 failed to create threads, 100000 crashed).
MAX_THREADS = 1024


@dataclass
class RunConfig:
    """Identity and length of a run."""

    name: str = "speedtronic-run"
    """Run name; the run directory is ``output_dir/name``."""
    seed: int = 1234
    """Seed for model init, data order and dropout (also the default ``data.seed``)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    max_steps: int = 1000
    """Number of optimizer steps (absolute: a resumed run stops at the same step)."""
    output_dir: str = "runs"
    """Base folder for run directories."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device, the denominator of MFU. None = NVIDIA's datasheet figure
    for the GPU (16-bit or TF32 by precision; see train/mfu.py), or no MFU when unknown."""
    num_threads: int | None = None
    """CPU threads for torch (``torch.set_num_threads``); None keeps torch's default (one per
    core). On a 2-core machine with the other core busy, 2 threads ran the quickstart ~9x slower
    than on an idle machine (64 s vs 7 s per 50 steps) because OpenMP threads wait on each other;
    1 thread degrades gracefully there."""
    eval_every: int = 100
    """Evaluate on the held-out split before the first step and every N optimizer steps, and
    always after the last (0 = only after the last)."""
    eval_batches: int = 8
    """Number of held-out micro-batches per evaluation (the same batches every time)."""

    def validate(self, p: str = "run") -> None:
        """Check name, steps, seed, threads, eval and device; raise ConfigError naming the key."""
        require(bool(self.name.strip()) and "/" not in self.name and self.name not in (".", ".."),
               f"{p}.name", f"must be a non-empty name without '/', got {brief(self.name)}")
        require(self.max_steps > 0, f"{p}.max_steps", f"must be > 0, got {self.max_steps}")
        # torch.manual_seed takes a signed or unsigned 64-bit value and overflows past it
        require(-2**63 <= self.seed < 2**64, f"{p}.seed",
               f"must fit in 64 bits (-2**63 <= seed < 2**64), got {str(self.seed)[:40]}")
        if self.num_threads is not None:
            # 100000 segfaulted inside torch.set_num_threads, 20000 failed in libgomp
            require(0 < self.num_threads <= MAX_THREADS, f"{p}.num_threads",
                   f"must be in [1, {MAX_THREADS}] or null (= torch's default), got "
                   f"{str(self.num_threads)[:40]}")
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, f"{p}.peak_tflops",
                   f"must be > 0 or null, got {self.peak_tflops}")
        require(self.eval_every >= 0, f"{p}.eval_every", f"must be >= 0, got {self.eval_every}")
        require(self.eval_batches > 0, f"{p}.eval_batches", f"must be > 0, got {self.eval_batches}")
        require(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device) is not None, f"{p}.device",
               f"must be auto, cpu, mps, cuda or cuda:N, got {brief(self.device)}")


@dataclass
class CheckpointConfig:
    """Atomic, resumable checkpoints in ``<run dir>/<directory>``."""

    enabled: bool = True
    """Write checkpoints."""
    directory: str = "checkpoints"
    """Folder, relative to the run directory and inside it (no absolute path, no ``..``): the
    run lock and the move-aside of an earlier run cover the run directory only, so a folder
    outside it let two runs overwrite, and resume from, each other's checkpoints."""
    every_steps: int = 500
    """Save every N optimizer steps (and at the end of the run)."""
    keep_last: int | None = 3
    """Keep the newest N checkpoints; None keeps all."""
    resume: bool = False
    """Resume from the newest valid checkpoint (same as ``train --resume``)."""
    every_seconds: float | None = None
    """Also save when this many seconds passed since the last save, at the next step boundary
    (a wall-clock bound on lost work, e.g. under a scheduler's time limit); None = steps only."""

    def validate(self, p: str = "checkpoint") -> None:
        """Check that ``directory`` stays inside the run directory and the counts are positive;
        raise ConfigError naming the key."""
        parts = PurePosixPath(self.directory.replace("\\", "/")).parts
        require(bool(self.directory.strip()) and not self.directory.startswith(("/", "\\", "~"))
                and ".." not in parts and ":" not in self.directory,
                f"{p}.directory", f"must be a folder inside the run directory (a relative path "
                f"without '..', e.g. checkpoints), got {brief(self.directory)}; to keep "
                f"checkpoints on another disk, put the run there (run.output_dir)")
        require(not parts or parts[0] not in RUN_FILES, f"{p}.directory",
                f"must not be inside {parts[0] if parts else ''}, a file every run writes in "
                f"its directory ({', '.join(RUN_FILES)}); got {brief(self.directory)}")
        require(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        if self.every_seconds is not None:
            require(self.every_seconds > 0, f"{p}.every_seconds",
                   f"must be > 0 or null, got {self.every_seconds}")
        if self.keep_last is not None:
            require(self.keep_last > 0, f"{p}.keep_last",
                   f"must be > 0 or null, got {self.keep_last}")


#: Signals a run turns into "save at the next step boundary, then exit" by default: SLURM's
#: preemption and ``--signal=USR1@90``, Kubernetes' and systemd's stop, Ctrl-C, a closed
#: terminal (SIGHUP), a CPU-time limit (SIGXCPU) and the user signal left for schedulers.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")
#: Names valid in any config, whether or not this platform has them: a run skips the ones it
#: lacks (Windows has only SIGTERM, SIGINT and SIGBREAK, its Ctrl-Break), so one config file
#: serves Linux, macOS and Windows; refusing them here stopped every run on Windows, the
#: defaults included.
PORTABLE_SIGNALS = PREEMPTION_SIGNALS + ("SIGBREAK",)


@dataclass
class TrainConfig:
    """What the training loop does when something goes wrong: a non-finite loss, a signal."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient norm. ``stop``: end the run with one line naming the step;
    nothing non-finite is saved (checked on the device, read at log steps and before every
    save: no extra host sync). ``skip``: drop that step's update and go on; this reads one flag
    per step (a host sync per step, as GradScaler's own skip does). fp16 steps that GradScaler
    skips are normal and count as neither."""
    max_skipped_steps: int = 10
    """With ``on_nonfinite: skip``: this many non-finite steps in a row stop the run anyway (a
    diverged run, not a bad batch)."""
    preemption_signals: list[str] = field(default_factory=lambda: list(PREEMPTION_SIGNALS))
    """Signals that save a checkpoint at the next step boundary and exit with 128 + the signal
    number (143 for SIGTERM, 130 for SIGINT); a second one exits at once. [] keeps Python's
    default handling. Names this platform lacks (Windows: all but SIGTERM, SIGINT, SIGBREAK)
    are skipped, so the defaults and one config file work everywhere."""
    requeue: bool = False
    """Inside a SLURM job (``SLURM_JOB_ID`` set): after a preemption save, run ``scontrol
    requeue $SLURM_JOB_ID`` and exit 0, so the job comes back and resumes (with
    ``checkpoint.resume: true``)."""

    def validate(self, p: str = "train") -> None:
        """Check ``max_skipped_steps`` and that each preemption signal can be caught here; raise
        ConfigError naming the key."""
        require(self.max_skipped_steps > 0, f"{p}.max_skipped_steps",
               f"must be > 0, got {self.max_skipped_steps}")
        import signal as _signal

        for name in self.preemption_signals:
            ok = isinstance(name, str) and (name in PORTABLE_SIGNALS or (
                name.startswith("SIG") and hasattr(_signal, name)
                and name not in ("SIGKILL", "SIGSTOP") and not name.startswith("SIG_")))
            require(ok, f"{p}.preemption_signals", f"{str(name)[:40]!r} is not a signal this "
                   "machine can catch; valid: " + ", ".join(PORTABLE_SIGNALS) + ", ...")


@dataclass
class LoggingConfig:
    """Console lines, metrics.jsonl (always written in the run directory) and integrations."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the ``speedtronic`` loggers."""
    every_steps: int = 10
    """Print and record train metrics every N optimizer steps."""
    heartbeat_seconds: float = 30.0
    """Print a "still running" line when nothing was printed for this many seconds (a long
    first step, eval or save); 0 = off."""
    file: str | None = None
    """Also write the text log to this file."""
    progress_bar: bool | None = None
    """tqdm progress bar; None = only when stdout is a terminal."""
    tensorboard: bool = False
    """Write TensorBoard scalars to ``<run dir>/tensorboard`` (needs the ``tensorboard`` extra)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the ``wandb`` extra)."""
    wandb_project: str | None = None
    """W&B project name; None = ``speedtronic``."""

    def validate(self, p: str = "logging") -> None:
        """Check ``every_steps`` and ``heartbeat_seconds``; raise ConfigError naming the key."""
        require(self.every_steps > 0, f"{p}.every_steps", f"must be > 0, got {self.every_steps}")
        require(self.heartbeat_seconds >= 0, f"{p}.heartbeat_seconds",
               f"must be >= 0 (0 = off), got {self.heartbeat_seconds}")


@dataclass
class ShapeValidationConfig:
    """Startup table of GEMM dimensions that are not multiples of the hardware's alignment."""

    enabled: bool = True
    """Run the check at startup (warnings only; never changes the model)."""
    alignment: Literal["auto", "none"] | int = "auto"
    """``auto``: 64 for bf16/fp16 on CUDA sm_80+ (128-byte tiles), 8 on older CUDA, 4 for
    fp32/tf32, 16 for fp8; ``none`` disables the check on every device; or a positive int."""
    check_batch: bool = True
    """Check micro-batch x sequence length (the GEMM M dim); a suggested micro-batch always
    divides ``data.target_batch_size``."""
    check_sequence: bool = True
    """Check the sequence length ``data.block_size`` (an inner dim of attention)."""
    check_model: bool = True
    """Check Linear / Embedding / attention dims."""
    check_vocab: bool = True
    """Check the vocabulary size (embedding rows and output head)."""
    warn_on_cpu: bool = False
    """Also warn on CPU (alignment matters little there)."""

    def validate(self, p: str = "shape_validation") -> None:
        """Check that an int ``alignment`` is positive; raise ConfigError naming the key."""
        if isinstance(self.alignment, int):
            require(self.alignment > 0, f"{p}.alignment",
                   f"must be auto, none or a positive int, got {self.alignment}")
