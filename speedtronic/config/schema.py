"""The configuration schema: the root :class:`SpeedtronicConfig`, with one dataclass per section
and a docstring under every field.

A run is described by one :class:`SpeedtronicConfig`. It is built from YAML, JSON or a dict by
:func:`speedtronic.config.load_config` (in :mod:`speedtronic.config.loading`), which

* expands the accepted shorthands (``optimizer: muon``, ``precision: bf16``, root ``name`` /
  ``seed`` / ``device`` / ``max_steps`` / ``output_dir`` / ``log_every`` / ``muon_plus`` /
  ``cautious``, ``compile: {enabled: ...}``) and refuses two spellings that disagree;
* applies ``--set section.key=value`` overrides (values parsed as YAML);
* rejects unknown keys with the full dotted name and the closest valid key;
* checks every value's type against the field annotation (the string ``"false"`` is not a bool;
  an int is accepted where a float is expected), that every float is finite (only the wait
  timeouts marked ``INF_IS_NO_LIMIT`` take ``.inf``) and every range rule.

This module holds the root (its switches, the cross-section defaults and ``finalize``); the
sections live beside it, one concern per module, and are re-exported here:
:mod:`.model_data` (``model``, ``data``), :mod:`.optimization` (``optimizer``, ``scheduler``,
``precision``), :mod:`.lifecycle` (``run``, ``checkpoint``, ``train``, ``logging``,
``shape_validation``) and :mod:`.scaling` (``distributed``, ``data_parallel``, ``torchft``).
The checks every section shares are in :mod:`.rules`.

Field docstrings (the string under each field) are the reference documentation for each key.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError, SpeedtronicError
from . import redaction
from .lifecycle import (  # the constants: re-exported, their sections moved to lifecycle
    MAX_THREADS,  # noqa: F401
    PREEMPTION_SIGNALS,  # noqa: F401
    RUN_FILES,  # noqa: F401
    CheckpointConfig,
    LoggingConfig,
    RunConfig,
    ShapeValidationConfig,
    TrainConfig,
)
from .model_data import DataConfig, ModelConfig
from .optimization import OptimizerConfig, PrecisionConfig, SchedulerConfig
from .rules import check_choices, check_finite, require, torchrun_world_size
from .scaling import DataParallelConfig, DistributedConfig, TorchftConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "PrecisionConfig",
    "CheckpointConfig",
    "TrainConfig",
    "LoggingConfig",
    "ShapeValidationConfig",
    "DistributedConfig",
    "DataParallelConfig",
    "TorchftConfig",
    "SpeedtronicConfig",
]


_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
    "data_parallel": DataParallelConfig,
    "torchft": TorchftConfig,
    "shape_validation": ShapeValidationConfig,
}


#: ``load_config``, put here by :mod:`.loading` when it is imported (it builds this module's
#: classes, so this module cannot import it back): what ``from_dict`` / ``from_yaml`` call.
LOADER: list[Any] = []


@dataclass
class SpeedtronicConfig:
    """The whole run: one section per concern plus four root switches."""

    run: RunConfig = field(default_factory=RunConfig)
    """Identity and length of the run: name, seed, device, steps, output folder, eval schedule,
    CPU threads (docs/training.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to build and its size (docs/models.md)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where batches come from (text, token files, a tokenizer, Hugging Face datasets) and the
    micro and target batch sizes (docs/data.md)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW or hybrid Muon + AdamW, with Muon+ and cautious masking (docs/optimizers.md)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Warmup and decay of the learning rate (docs/training.md#the-loop)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Autocast mode of forward/backward (docs/training.md#precision)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept and whether the run resumes from the
    newest (docs/training.md#checkpoints)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """What the loop does on a non-finite loss and on a preemption signal
    (docs/reliability.md)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console lines, ``metrics.jsonl``, TensorBoard and W&B (docs/training.md#metrics)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """DiLoCo multi-node training over a shared store (docs/diloco.md)."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    """``torchrun`` data parallelism: DDP, sharded Muon, ZeRO-1, FSDP2
    (docs/scaling.md#torchrun)."""
    torchft: TorchftConfig = field(default_factory=TorchftConfig)
    """Fault-tolerant replica groups on torchft (docs/scaling.md#torchft-replica-groups)."""
    shape_validation: ShapeValidationConfig = field(default_factory=ShapeValidationConfig)
    """The startup check of GEMM dimensions against the hardware's alignment
    (docs/ooo-and-shapes.md#shape-validation)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with ``torch.compile`` (falls back to eager, with the reason logged).
    ``auto``: on for CUDA runs of at least 2000 steps, where compiling pays back (an 85M GPT on
    an H200 compiled in ~24 s and then stepped 50 -> 29 ms, a break-even near 1150 steps,
    benchmarks/results/h200_first_run_2026-11-30.md); off on CPU and for shorter runs."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (same as model.gradient_checkpointing)."""
    ooo_backprop: bool = False
    """Out-of-order backprop: defer weight gradients to side CUDA streams (opt-in). It stays on
    only if a trial at the start of the run measures it faster (see ``ooo_trial_pairs``)."""
    ooo_streams: int = 4
    """Side streams for out-of-order backprop, 1..8."""
    ooo_trial_pairs: int = 4
    """With ``ooo_backprop``: the first ``2 * (1 + n)`` steps alternate deferral on and off (every
    run, resumed ones included); it stays on only if its median step is >= 1% shorter. An even
    n balances a drift over the trial. 0 keeps it on without measuring; 0..100."""

    def finalize(self) -> SpeedtronicConfig:
        """Fill cross-section defaults, then validate every section. Returns self."""
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.target_batch_size is None:  # one micro-batch per torchrun process
            self.data.target_batch_size = self.data.micro_batch_size * torchrun_world_size()
        if self.data.seed is None:
            self.data.seed = self.run.seed
        if self.model.vocab_size is None and self.data.tokenizer is None \
                and self.data.tokens_path is None:
            self.model.vocab_size = 256  # byte-level and synthetic data; the rest follows the data
        if self.scheduler.max_steps is None:
            self.scheduler.max_steps = self.run.max_steps
        self._name_diloco_run()
        self._torchft_from_env()
        self.data_parallel.resolve_timeout(self.distributed)
        if self.gradient_checkpointing or self.model.gradient_checkpointing:
            self.gradient_checkpointing = self.model.gradient_checkpointing = True
        check_finite(self)  # first: range rules below read inf as a valid large value
        check_choices(self, "")
        for name in _SECTIONS:
            check_choices(getattr(self, name), name)
            getattr(self, name).validate(name)
        require(1 <= self.ooo_streams <= 8, "ooo_streams",
               f"must be in 1..8, got {self.ooo_streams}")
        require(0 <= self.ooo_trial_pairs <= 100, "ooo_trial_pairs",
               f"must be in 0..100, got {self.ooo_trial_pairs}")
        require(self.data.block_size <= self.model.max_seq_len, "data.block_size",
               f"must be <= model.max_seq_len={self.model.max_seq_len}, got {self.data.block_size}")
        return self

    def _name_diloco_run(self) -> None:
        """``{node_id}`` in ``run.name`` becomes ``distributed.node_id`` (the host name when
        unset), and a DiLoCo run left at the default name is ``diloco-<role>-<node id>``: two
        workers started from one folder with the documented command must not share a run
        directory (the second is refused by the run lock; before it, it moved the first's
        folder aside)."""
        if "{node_id}" not in self.run.name and not (
                self.distributed.enabled and self.run.name == RunConfig.name):
            return
        self.distributed.check_node_id()  # first: a bad id is its own error, not run.name's
        import socket

        node = self.distributed.node_id or re.sub(r"[^A-Za-z0-9_.-]", "-",
                                                  socket.gethostname())[:40] or "node"
        if "{node_id}" in self.run.name:
            self.run.name = self.run.name.replace("{node_id}", node)
        else:
            self.run.name = f"diloco-{self.distributed.role}-{node}"

    def _torchft_from_env(self) -> None:
        """torchft's launch conventions fill what the config leaves null: the group id from
        ``REPLICA_GROUP_ID``, the Lighthouse from ``TORCHFT_LIGHTHOUSE``."""
        ft = self.torchft
        if ft.mode == "off":
            return
        if ft.replica_group is None and os.environ.get("REPLICA_GROUP_ID", "").strip():
            raw = os.environ["REPLICA_GROUP_ID"].strip()
            require(raw.isdigit(), "torchft.replica_group",
                   f"REPLICA_GROUP_ID={raw!r} is not a group number (0, 1, ...)")
            ft.replica_group = int(raw)
        if ft.lighthouse is None and os.environ.get("TORCHFT_LIGHTHOUSE"):
            ft.lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        target = self.data.target_batch_size or self.data.micro_batch_size
        return target // self.data.micro_batch_size

    @property
    def run_dir(self) -> Path:
        """``run.output_dir / run.name`` (``.../replica_group_<g>`` for a torchft group: the
        groups of one job may share a folder and a config)."""
        base = Path(self.run.output_dir) / self.run.name
        if self.torchft.mode != "off" and self.torchft.replica_group is not None:
            return base / f"replica_group_{self.torchft.replica_group}"
        return base

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeedtronicConfig:
        """A checked config from a plain nested dict (the inverse of ``to_dict(redact=False)``):
        ``load_config(values)``, with its shorthands, checks and errors."""
        return LOADER[0](values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SpeedtronicConfig:
        """A checked config from a YAML (or JSON) file: ``load_config(path)``."""
        return LOADER[0](Path(path))

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """A JSON/YAML-safe nested dict; with ``redact``, secrets are replaced by ``<redacted>``."""
        out = redaction.to_plain(self)
        return redaction.redact(out) if redact else out

    def save(self, path: str | Path) -> None:
        """Write the resolved config (always redacted) as YAML (.yaml/.yml) or JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict(redact=True)
        if path.suffix in (".yaml", ".yml"):
            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        # Replaced whole: a --resume rewrites config.yaml, and a full disk once cut it to 100
        # bytes, after which sample, export and compare could not read the run.
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if not isinstance(exc, OSError):
                raise
            raise SpeedtronicError(f"cannot write {path}: {exc.strerror or exc} (the previous "
                                   "file, if any, is unchanged)") from None


Config = SpeedtronicConfig
