"""A finished (or running) run's model, rebuilt from its directory: for ``sample`` and ``export``.

Reads ``<run dir>/config.yaml`` (what the run trained with, vocabulary resolved), builds the
model and loads the newest verified checkpoint (or the one given). Nothing is written.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError, SpeedtronicConfig, load_config
from ..models import build_model
from .checkpoint import CheckpointManager

__all__ = ["load_run_model"]


def load_run_model(run_dir: str | Path, checkpoint: str | Path | None = None,
                   device: str = "cpu") -> tuple[nn.Module, SpeedtronicConfig, Path]:
    """``(model in eval mode on device, the run's config, the checkpoint loaded)``."""
    run = Path(run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"{str(run)!r} is not a run directory (no config.yaml); give the "
                          "folder `speedtronic train` wrote, e.g. runs/quickstart")
    cfg = load_config(cfg_path)
    manager = CheckpointManager(run / cfg.checkpoint.directory, keep_last=None)
    if checkpoint is not None:
        path = Path(checkpoint)
        state = manager.load(path)
    else:
        found = manager.load_latest()
        if found is None:
            raise ConfigError(f"{str(run)!r} has no checkpoint in {cfg.checkpoint.directory}/ "
                              "yet (checkpoint.enabled: false, or the run stopped before its "
                              "first save)")
        state, path = found
    cfg.model.gradient_checkpointing = False
    model = build_model(cfg.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{path.name} does not fit the model of {cfg_path}: {first}") from None
    return model.to(torch.device(device)).eval(), cfg, path
