"""Weights in and out of run directories: a run's model rebuilt for ``sample`` and ``export``,
and ``model.init_from`` (a fresh run starting from trained weights).

:func:`load_run_model` reads ``<run dir>/config.yaml`` (what the run trained with, vocabulary
resolved), builds the model and loads the newest verified checkpoint (or the one given).
:func:`init_from` loads weights only (the optimizer starts fresh) from one of our checkpoints
(verified), a run directory (its newest), or a Hugging Face folder of safetensors: into a
``model.name: hf`` model as is, into the reference model from Llama names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, SpeedtronicConfig, load_config
from ..models import build_model
from .checkpoint import CheckpointManager, mismatch_details
from .resume import architecture_changes
from .v2_checkpoints import (
    V2_CHECKPOINT_ADVICE,
    find_v2_checkpoints,
    is_v2_checkpoint_file,
    latest_v2_checkpoint,
    load_v2_weights,
)

__all__ = ["init_from", "load_run_model", "run_checkpoint"]


def run_checkpoint(run_dir: str | Path, checkpoint: str | Path | None = None
                   ) -> tuple[SpeedtronicConfig, dict, Path]:
    """``(the run's config, a verified checkpoint state, its path)``: ``checkpoint`` or the
    run's newest. ConfigError for a folder that is no run, or a run without a checkpoint."""
    run = Path(run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        _refuse_v2(run, "")
        raise ConfigError(f"{str(run)!r} is not a run directory (no config.yaml); give the "
                          "folder `speedtronic train` wrote, e.g. runs/quickstart")
    cfg = load_config(cfg_path)
    _rebase_tokenizer(run, cfg)
    manager = CheckpointManager(run / cfg.checkpoint.directory, keep_last=None)
    if checkpoint is not None:
        return cfg, manager.load(Path(checkpoint)), Path(checkpoint)
    found = manager.load_latest()
    if found is None:
        raise ConfigError(f"{str(run)!r} has no checkpoint in {cfg.checkpoint.directory}/ "
                          "yet (checkpoint.enabled: false, or the run stopped before its "
                          "first save)")
    return cfg, found[0], found[1]


def _rebase_tokenizer(run: Path, cfg: SpeedtronicConfig) -> None:
    """A relative ``data.tokenizer`` in ``config.yaml`` is relative to where ``train`` ran;
    ``sample`` and ``export`` from any other folder failed with "file not found". That folder
    is the run directory less its relative ``run.output_dir`` / ``run.name`` parts."""
    spec = cfg.data.tokenizer
    out, name = Path(cfg.run.output_dir), Path(cfg.run.name)
    if (not spec or Path(spec).is_absolute() or Path(spec).exists() or out.is_absolute()
            or ".." in out.parts or ".." in name.parts):
        return
    # absolute without resolving links: a symlinked output_dir must not climb out of the
    # folder it is linked from; cfg.run_dir counts every level (a torchft replica_group_N too)
    trained_in = Path(os.path.abspath(run))
    for _ in range(len(cfg.run_dir.parts)):
        trained_in = trained_in.parent
    if (trained_in / spec).exists():  # a tokenizer.json, or a folder holding one
        cfg.data.tokenizer = str(trained_in / spec)


def _refuse_v2(folder: Path, prefix: str) -> None:
    """A ConfigError for a speedtronic 2.0 run folder (checkpoints, no config.yaml)."""
    legacy = find_v2_checkpoints(folder)
    if legacy is not None:
        raise ConfigError(f"{prefix}{str(folder)!r} holds speedtronic 2.0 checkpoints "
                          f"({legacy}): {V2_CHECKPOINT_ADVICE}")


def load_run_model(run_dir: str | Path, checkpoint: str | Path | None = None,
                   device: str = "cpu") -> tuple[nn.Module, SpeedtronicConfig, Path]:
    """``(model in eval mode on device, the run's config, the checkpoint loaded)``."""
    cfg, state, path = run_checkpoint(run_dir, checkpoint)
    cfg.model.gradient_checkpointing = False
    model = build_model(cfg.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise ConfigError(f"{path.name} does not fit the model of {run_dir}: "
                          f"{mismatch_details(exc)}") from None
    return model.to(torch.device(device)).eval(), cfg, path


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:

    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError("model.init_from: a Hugging Face folder needs the 'safetensors' "
                          "package: pip install safetensors") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"model.init_from: {str(folder)!r} holds neither model.safetensors "
                          "nor model.safetensors.index.json (only safetensors are read: a "
                          "pickle could run code)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


#: config.json keys of a Llama folder that shape-compatible tensors do not pin down.
#: (rms_norm_eps is left out: the reference model's is fixed at 1e-5, and a folder with 1e-6
#: differs by far less than a step of training.)
_LLAMA_ARCHITECTURE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim",
                            "rope_theta", "rope_type", "hidden_act", "attention_bias",
                            "mlp_bias", "tie_word_embeddings")


def _llama_changes(folder: Path, cfg: SpeedtronicConfig) -> str:
    """The folder's config.json against the Llama config of this reference model, for the keys
    whose mismatch loads without a shape error (n_head, rope_base, tied head, ...)."""

    from ..models.export import llama_config

    try:
        theirs = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""  # no readable config.json: only the tensors' names and shapes are checked
    theirs.update(_rope(theirs))
    mine = dict(llama_config(cfg.model), rope_type="default")
    changed = [k for k in _LLAMA_ARCHITECTURE_KEYS
               if theirs.get(k) is not None and theirs.get(k) != mine[k]]
    return "; ".join(f"config.json has {k}={theirs[k]!r} but this model {mine[k]!r}"
                     for k in changed)


#: config.json keys of a Hugging Face folder whose mismatch with the model being trained still
#: loads (same tensor shapes) but computes another function (``rope_type`` is derived).
_HF_ARCHITECTURE_KEYS = ("num_attention_heads", "num_key_value_heads", "n_head", "head_dim",
                         "rope_theta", "rope_type", "hidden_act", "activation_function",
                         "attention_bias", "mlp_bias", "partial_rotary_factor", "rotary_pct",
                         "sliding_window", "tie_word_embeddings")


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_type`` of a config.json, wherever its transformers version
    kept them (top level, ``rope_parameters`` or ``rope_scaling``)."""
    ropes = [r for r in (config.get("rope_parameters"), config.get("rope_scaling"))
             if isinstance(r, dict)]
    if any(isinstance(v, dict) for r in ropes for v in r.values()):
        # per layer type (Gemma 3: sliding and full attention each have their own): compared
        # whole, as transformers normalized them
        nested = {k: v for r in ropes for k, v in r.items() if isinstance(v, dict)}
        return {"rope_theta": None, "rope_type": json.dumps(nested, sort_keys=True)}
    theta = config.get("rope_theta")
    if theta is None:  # newer transformers keep it in rope_parameters only
        theta = next((r["rope_theta"] for r in ropes if "rope_theta" in r), None)
    # Llama 3.1/3.2's "llama3" (or linear, yarn, ...) scaling rescales the rotary frequencies:
    # it loaded without a word and changed the logits by ~14 on a tiny model. So did gelu.
    types = [r.get("rope_type") or r.get("type") for r in ropes]
    kind = next((k for k in types if k not in (None, "default")), "default" if types else None)
    return {"rope_theta": theta, "rope_type": kind}


def _hf_changes(folder: Path, config: Any) -> str:
    """The folder's config.json against the Hugging Face config being trained, for the keys
    whose mismatch loads without a shape error (a mapping ``hf_config`` with 8 heads took a
    4-head folder's tensors and its logits moved by 13)."""
    try:  # through transformers, as ``config`` was: it renames and nests some rope settings
        from transformers import AutoConfig

        theirs = AutoConfig.from_pretrained(str(folder)).to_dict()
    except Exception:  # noqa: BLE001 - no readable config.json: the tensors' shapes decide
        return ""
    mine = config.to_dict()
    theirs.update(_rope(theirs))
    mine.update(_rope(mine))
    changed = [k for k in _HF_ARCHITECTURE_KEYS if theirs.get(k) is not None
               and mine.get(k) is not None and theirs[k] != mine[k]]
    return "; ".join(f"config.json has {k}={theirs[k]!r} but this model {mine[k]!r}"
                     for k in changed)


def init_from(model: nn.Module, cfg: SpeedtronicConfig) -> str:
    """Load ``cfg.model.init_from``'s weights into ``model``; one line saying what was loaded.
    Shapes or names that do not fit are one ConfigError naming the first few."""
    from ..models.export import reference_state_from_llama
    from ..models.hf import HFCausalLM

    spec = Path(str(cfg.model.init_from)).expanduser()
    legacy = (spec if spec.is_file() and is_v2_checkpoint_file(spec) else
              latest_v2_checkpoint(spec) if spec.is_dir() and not (spec / "config.yaml").is_file()
              else None)
    if legacy is not None:  # speedtronic 2.0's checkpoint: its weights, renamed
        if isinstance(model, HFCausalLM):
            raise ConfigError(f"model.init_from: {legacy} is a speedtronic 2.0 checkpoint of "
                              "its reference model; set model.name: reference_transformer")
        tensors, saved = load_v2_weights(legacy)
        target, what = model, f"speedtronic 2.0 checkpoint {legacy} (converted names)"
        changes = architecture_changes(saved, cfg.to_dict()["model"], "the 2.0 checkpoint")
        if changes:  # before the shapes: 2.0's d_ff meant another width, say which to set
            raise ConfigError(f"model.init_from: {what} was trained as another architecture: "
                              f"{changes}. Set those model.* keys to the 2.0 run's (d_ff: the "
                              "width of its MLP tensors)")
    elif spec.is_file() or (spec.is_dir() and (spec / "config.yaml").is_file()):
        # one of our checkpoints, or a run directory's newest
        if spec.is_dir():
            _, state, path = run_checkpoint(spec)
        else:
            state, path = CheckpointManager(spec.parent).load(spec), spec
        tensors, target, what = state["model"], model, f"{path} (weights only)"
        changes = architecture_changes((state.get("config") or {}).get("model") or {},
                                       cfg.to_dict()["model"])
    elif spec.is_dir():
        tensors, changes = _safetensors(spec), ""
        if isinstance(model, HFCausalLM):
            target, what = model.hf, f"Hugging Face folder {spec}"
            changes = _hf_changes(spec, model.hf.config)
        else:
            tensors = reference_state_from_llama(tensors, cfg.model)
            target, what = model, f"Llama folder {spec} (converted names)"
            changes = _llama_changes(spec, cfg)
    else:
        raise ConfigError(f"model.init_from: {str(spec)!r} does not exist (give a run "
                          "directory, a checkpoint .pt, or a Hugging Face folder)")
    try:
        missing, unexpected = target.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        details = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()]
        raise ConfigError(f"model.init_from: {what} does not fit this model (did model.* "
                          f"change?): {'; '.join(details[:3])[:600]}") from None
    tied_ok = {"lm_head.weight"} if getattr(getattr(target, "config", None),
                                            "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied_ok]
    if missing or unexpected:
        raise ConfigError(f"model.init_from: {what} does not fit this model: missing "
                          f"{missing[:4]}, unexpected {list(unexpected)[:4]}")
    if changes:  # after the shapes (their error names the tensors): what still loads silently
        raise ConfigError(f"model.init_from: {what} was trained as another architecture: "
                          f"{changes}. The same tensors would compute another function; set "
                          "those model.* keys to the source's")
    return f"init_from: loaded {what}; the optimizer starts fresh"
