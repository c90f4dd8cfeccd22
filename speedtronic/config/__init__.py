"""The run configuration: the schema (:mod:`.schema`, its sections in :mod:`.model_data`,
:mod:`.optimization`, :mod:`.lifecycle` and :mod:`.scaling`), loading and overrides
(:mod:`.loading`), and redaction of secrets (:mod:`.redaction`).

Everything public is re-exported here, so ``from speedtronic.config import load_config,
SpeedtronicConfig`` is the one import users need. Field docstrings in the section modules are
the reference documentation of every key (rendered in ``docs/configuration.md``).
"""

from __future__ import annotations

from .._renamed import renamed
from ..errors import ConfigError
from .loading import load_config
from .redaction import redact, to_plain
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataParallelConfig,
    DistributedConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    ShapeValidationConfig,
    SpeedtronicConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataParallelConfig",
    "DistributedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedulerConfig",
    "ShapeValidationConfig",
    "SpeedtronicConfig",
    "TrainConfig",
    "load_config",
    "redact",
    "to_plain",
]

#: speedtronic 2.0's name for load_config, served with a DeprecationWarning
__getattr__ = renamed(__name__, "load_yaml_config", "load_config", load_config)
