"""Old names that still import, with a DeprecationWarning that gives the new one.

Two kinds, both served from here so there is one deprecation path to test and later remove
(plus speedtronic 2.0's names that are gone, each with an error saying what replaced it):

* an attribute renamed inside a module (:func:`renamed`, a module ``__getattr__``);
* a module that moved to a package (:data:`MOVED_MODULES`): ``import speedtronic.trainer``
  still works and returns the very module object ``speedtronic.train.trainer`` (so a
  ``monkeypatch`` through either name patches the same thing), after one warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable

#: Modules that moved when the top level became the layer map (release 2.1): old -> new.
MOVED_MODULES: dict[str, str] = {
    "speedtronic.cpu_kernels": "speedtronic.kernels.cpu",
    "speedtronic.ops": "speedtronic.kernels.ops",
    "speedtronic.newton_schulz": "speedtronic.kernels.newton_schulz",
    "speedtronic.kernel_choice": "speedtronic.kernels.choice",
    "speedtronic.autotune": "speedtronic.kernels.autotune",
    "speedtronic.trainer": "speedtronic.train.trainer",
    "speedtronic.runtime": "speedtronic.train.runtime",
    "speedtronic.accumulation": "speedtronic.train.accumulation",
    "speedtronic.precision": "speedtronic.train.precision",
    "speedtronic.checkpoint": "speedtronic.train.checkpoint",
    "speedtronic.metrics": "speedtronic.train.metrics",
    "speedtronic.mfu": "speedtronic.train.mfu",
    "speedtronic.plot": "speedtronic.train.plot",
    "speedtronic.host_memory": "speedtronic.train.host_memory",
    "speedtronic.shapes": "speedtronic.train.shapes",
    "speedtronic.ooo_trial": "speedtronic.ooo.trial",
    "speedtronic.env": "speedtronic.cli.env",
}

#: Old modules whose name is now a package: their public attributes are served from the
#: module that holds them now (``speedtronic.kernels.status`` -> ``.kernels.extension``).
MOVED_INTO_PACKAGE: dict[str, str] = {
    "speedtronic.kernels": "speedtronic.kernels.extension",
    "speedtronic.ooo": "speedtronic.ooo.scheduler",
}


#: speedtronic 2.0's top-level names that live on under the same name and role: served from
#: their module with a DeprecationWarning naming it (2.0 exported ~40 names at the top level;
#: ``from speedtronic import HybridOptimizer`` was an ImportError here).
V2_TOP_LEVEL: dict[str, str] = {
    **dict.fromkeys(["Config", "CheckpointConfig", "DataConfig", "DistributedConfig",
                     "LoggingConfig", "ModelConfig", "OptimizerConfig", "PrecisionConfig",
                     "RunConfig", "SchedulerConfig", "ShapeValidationConfig"],
                    "speedtronic.config"),
    "TrainResult": "speedtronic.train",
    "build_model": "speedtronic.models",
    "register_model": "speedtronic.models",
    "ReferenceTransformer": "speedtronic.models",
}

#: speedtronic 2.0's top-level names with no successor of the same name and contract: the
#: ImportError says what replaced each (an ImportError, not an AttributeError, so that
#: ``from speedtronic import X`` shows this text instead of a bare "cannot import name").
V2_GONE_NAMES: dict[str, str] = {
    "CautiousOptimizer": "cautious masking is an option of each optimizer: Muon(..., "
                         "cautious=True), AdamW(..., cautious=True), optimizer.cautious: true",
    "ParameterRouting": "speedtronic.optim.route_parameters returns ParameterRoutes (muon, "
                        "adamw_decay, adamw_no_decay lists)",
    "route_parameters": "speedtronic.optim.route_parameters returns ParameterRoutes (muon, "
                        "adamw_decay, adamw_no_decay lists), not 2.0's ParameterRouting",
    "post_polar_normalize": "Muon+ is an option: Muon(..., muon_plus=True); the op is "
                            "speedtronic.kernels.ops.muon_plus_normalize",
    "StageInfo": "out-of-order backprop is the root config switch ooo_backprop: true "
                 "(speedtronic.ooo.OOOScheduler)",
    "StageStreamScheduler": "out-of-order backprop is the root config switch ooo_backprop: "
                            "true (speedtronic.ooo.OOOScheduler)",
    **dict.fromkeys(["ShapeProfile", "ShapeReport", "ShapeWarning", "resolve_shape_profile",
                     "validate_startup_shapes"],
                    "the trainer checks shapes itself (config section shape_validation; "
                    "speedtronic.train.shapes)"),
    "ModelRegistry": "speedtronic.models.register_model / build_model / registered_models",
    "registry": "speedtronic.models.register_model / build_model / registered_models",
    "load_yaml_config": "speedtronic.load_config (a YAML or JSON path, or a dict)",
    "set_gradient_checkpointing": "the config key model.gradient_checkpointing (or the root "
                                  "gradient_checkpointing: true)",
    "GPT": "speedtronic.models.ReferenceTransformer (model.name: reference_transformer)",
    "GPTConfig": "speedtronic.config.ModelConfig",
    **dict.fromkeys(["DumbDiLoCo", "DumbDiLoCoCoordinator", "HubClient"],
                    "DiLoCo is configured, not constructed: the distributed config section "
                    "with a store URL (docs/diloco.md); the code is speedtronic.diloco"),
}

#: speedtronic 2.0's modules with no module of that name now -> where their contents went.
V2_GONE_MODULES: dict[str, str] = {
    "speedtronic.optimizers": "speedtronic.optim (Muon, AdamW, HybridOptimizer, "
                              "build_optimizer, route_parameters)",
    "speedtronic.model": "speedtronic.models (ReferenceTransformer, build_model)",
    "speedtronic.registry": "speedtronic.models (register_model, build_model)",
    "speedtronic.hooks": "speedtronic.train (TrainerCallback)",
    "speedtronic.profiling": "speedtronic.train.metrics and speedtronic.train.mfu",
    "speedtronic.scheduling": "speedtronic.ooo (out-of-order backprop)",
    "speedtronic.module_utils": "the config key model.gradient_checkpointing",
    "speedtronic.integrations": "speedtronic.train.metrics (TensorBoard, W&B: logging.*)",
    **dict.fromkeys(["speedtronic.distributed.diloco", "speedtronic.distributed.hub",
                     "speedtronic.distributed.outer", "speedtronic.distributed.tensors"],
                    "speedtronic.diloco (configured by the distributed section: docs/diloco.md)"),
}


def v2_gone_name(name: str) -> ImportError | None:
    """The error for a 2.0 top-level name that is gone, or None."""
    advice = V2_GONE_NAMES.get(name)
    if advice is None:
        return None
    return ImportError(f"speedtronic.{name} was speedtronic 2.0's; now: {advice} "
                       "(docs/upgrading.md)", name="speedtronic")


def renamed(module: str, old: str, new: str, value: object) -> Callable[[str], object]:
    """A module ``__getattr__`` serving ``old`` as ``value`` (now called ``new``) with a warning."""

    def __getattr__(name: str) -> object:
        if name == old:
            warnings.warn(f"{module}.{old} is now {new}", DeprecationWarning, stacklevel=2)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def moved_into_package(package: str) -> Callable[[str], object]:
    """A package ``__getattr__`` serving the public names of the module that used to be called
    ``package`` (before it became a package) from where they live now, with a warning."""
    target = MOVED_INTO_PACKAGE[package]

    def __getattr__(name: str) -> object:
        if not name.startswith("_"):
            module = importlib.import_module(target)
            if hasattr(module, name):
                warnings.warn(f"{package}.{name} is now {target}.{name}", DeprecationWarning,
                              stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # A placeholder: exec_module swaps in the real module, so the real one's __spec__ and
        # __name__ are never overwritten with the old name.
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} is now {self.new}", DeprecationWarning, stacklevel=2)
        # The import system returns whatever sys.modules holds under the old name after this.
        sys.modules[module.__name__] = importlib.import_module(self.new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        gone = V2_GONE_MODULES.get(fullname)
        if gone is not None:
            raise ModuleNotFoundError(f"{fullname} was speedtronic 2.0's module; its contents "
                                      f"are in {gone} (docs/upgrading.md)", name=fullname)
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new))


def install_module_aliases() -> None:
    """Make the old module names importable (idempotent; called by ``speedtronic/__init__``)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
