"""Checks a run can make before it touches a device, shared by ``train`` and ``validate``.

Nothing here imports torch: ``validate`` runs every check in ~0.3 s.

``speedtronic validate`` once returned 0 for configs ``train`` refused at once (a missing token
file, an unknown ``model.name``) or could never run (``n_layer: 100000`` spent minutes building
a model that could not fit). Both commands now call :func:`preflight`:

* the model name resolves (a built-in, a registered model, or a module that can be found), and
  a built-in model's size, in closed form (so a 10^12-parameter typo is refused in
  microseconds, not after minutes of module construction), fits;
* the training memory floor (fp32 weights + gradients + optimizer state: 16 bytes per
  parameter with AdamW) fits this machine's RAM for a CPU run; a CUDA device is not probed
  here (that would initialize it), so only the sane bound applies;
* the data: token files exist, open and fit the vocabulary; a tokenizer loads; text files
  exist (``validate`` does not tokenize a text source; ``train`` prepares it as before).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import ConfigError, SpeedtronicConfig
from ..config.combinations import check_fsdp
from ..errors import RunLockedError
from .metrics import require_hook_packages
from .run_lock import held_by

logger = logging.getLogger("speedtronic.runtime")

__all__ = ["MAX_PARAMETERS", "check_model_size", "check_run_dir", "machine_memory_bytes",
           "preflight", "training_bytes"]

#: More parameters than any single-machine run of this engine can hold (a 1T-parameter model
#: needs 16 TB for weights, gradients and AdamW state in fp32).
MAX_PARAMETERS = 10**12
#: Bytes per parameter of a training step's floor: fp32 weight, fp32 gradient, and the
#: optimizer's state (AdamW: two moments; Muon: one momentum buffer, so this is the upper one).
BYTES_PER_PARAMETER = 16
_BUILTIN = ("reference_transformer", "gpt")


def machine_memory_bytes() -> int | None:
    """Physical RAM, or the cgroup v2 limit when lower (containers); None where unknown."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        total = None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def training_bytes(parameters: int) -> int:
    """The memory floor of training ``parameters`` (activations come on top)."""
    return parameters * BYTES_PER_PARAMETER


def _require_module(key: str, spec: str) -> None:
    """The module of ``spec`` (``"package.module:attr"``) can be found: found, not imported
    (importing a user's module would load torch)."""
    import importlib.util

    module = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{key}: cannot import module {module!r} from {spec!r}: no such "
                          "module found (the module must be importable: installed, in the "
                          "working directory, or on PYTHONPATH)")


def _check_model_name(cfg: SpeedtronicConfig) -> None:
    """``model.name`` names a built-in, a registered model or an importable module; the paths
    ``model.init_from`` and ``model.hf_config`` name exist (train refused them at once, while
    validate said ok)."""
    import sys

    from ..models.builtin import BUILTIN_MODELS, unknown_model_error

    m = cfg.model
    # (a resumed run loads its checkpoint instead, so init_from is not read then)
    if m.init_from is not None and not cfg.checkpoint.resume and \
            not Path(str(m.init_from)).expanduser().exists():
        raise ConfigError(f"model.init_from: {str(m.init_from)!r} does not exist (give a run "
                          "directory, a checkpoint .pt, or a Hugging Face folder)")
    if m.name == "hf" and isinstance(m.hf_config, str) and \
            not (Path(m.hf_config).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.hf_config: {m.hf_config!r} has no config.json (give a local "
                          "folder; nothing is downloaded)")
    name = m.name
    registry = sys.modules.get("speedtronic.models.registry")
    registered = set(getattr(registry, "_REGISTRY", {}))
    if name in BUILTIN_MODELS or name in registered:
        return
    if ":" in name:
        _require_module("model.name", name)
        return
    raise unknown_model_error(name, registered)


def _check_size(parameters: int, cfg: SpeedtronicConfig, device: str, how: str) -> str:
    need = training_bytes(parameters)
    if parameters > MAX_PARAMETERS:
        raise ConfigError(f"model: {how} {parameters:.3g} parameters (model.n_layer="
                          f"{cfg.model.n_layer}, model.d_model={cfg.model.d_model}), beyond "
                          f"any single-machine run ({MAX_PARAMETERS:.0e}); check those sizes")
    memory = machine_memory_bytes() if device == "cpu" else None
    if memory is not None and need > memory:
        raise ConfigError(f"model: {how} {parameters:,} parameters need at least "
                          f"{need / 2**30:.1f} GiB to train in fp32 (weights, gradients, "
                          f"optimizer state: {BYTES_PER_PARAMETER} bytes each) but this "
                          f"machine has {memory / 2**30:.1f} GiB; lower model.n_layer / "
                          "model.d_model")
    where = f"{memory / 2**30:.0f} GiB RAM" if memory else "device memory not probed"
    return f"model {cfg.model.name}: {how} {parameters:,} parameters, " \
           f">= {need / 2**30:.2f} GiB to train ({where})"


def check_model_size(cfg: SpeedtronicConfig, device: str) -> str:
    """Refuse a built-in model that cannot be trained here (see the module docstring); one line
    of what was checked. ``device`` is the device type (``cpu``, ``cuda``, ``mps``)."""
    from ..models.builtin import builtin_parameters

    estimate = builtin_parameters(cfg.model)
    if estimate is None:
        return f"model {cfg.model.name}: size not known before it is built"
    return _check_size(estimate, cfg, device, "about")


def _device_type(cfg: SpeedtronicConfig) -> str:
    """``run.device`` without touching a device or importing torch (``auto``: CUDA when an
    NVIDIA driver is present)."""
    name = cfg.run.device.split(":")[0]
    if name != "auto":
        return name
    return "cuda" if Path("/proc/driver/nvidia/version").exists() else "cpu"


def _check_requested_device(cfg: SpeedtronicConfig) -> None:
    """An explicit ``run.device`` other than cpu exists here (train's own check, run early):
    ``validate`` passed ``device: cuda`` on a machine without CUDA, which ``train`` then
    refused. Only such a config imports torch (``auto`` and ``cpu`` never fail)."""
    if cfg.run.device in ("auto", "cpu"):
        return
    from .precision import resolve_device  # imports torch

    resolve_device(cfg.run.device)


def _check_data_files(cfg: SpeedtronicConfig) -> str:
    """Token files open and fit the vocabulary, a tokenizer loads, text files exist; a text
    source is not tokenized (``train`` does that, once)."""
    d = cfg.data
    if d.tokens_path is not None or (d.tokenizer is None and d.text_path is None
                                     and d.hf_dataset is None):
        from ..data.checks import check_data

        check_data(cfg)
        if d.tokens_path is not None:
            return f"data: {d.tokens_path}: ok"
        if isinstance(d.dataset, str) and ":" in d.dataset:
            _require_module("data.dataset", d.dataset)
        if d.synthetic or d.dataset is not None:
            return f"data: {'synthetic' if d.synthetic else d.dataset}: ok"
        # the default: the stdlib's own source. Building its split takes ~0.02 s; unchecked,
        # validate passed a data.stdlib_max_bytes too small to hold out a file, which train
        # then refused
        from ..data.sources import python_tag, stdlib_corpus

        corpus = stdlib_corpus(d.stdlib_max_bytes, d.eval_fraction)
        return (f"data: python {python_tag()} stdlib source ({len(corpus.train_paths)} train / "
                f"{len(corpus.eval_paths)} eval files): ok")
    if d.tokenizer is not None:
        from ..data.prepare import load_tokenizer

        load_tokenizer(d.tokenizer)
    if d.text_path is not None:
        from ..data.token_files import expand_paths

        if d.tokenizer is None:  # bytes: one file, as train reads it
            from ..config.rules import byte_text_file

            files = [byte_text_file(d.text_path)]
        else:  # recursive, as prepare lists it (validate once found 22 of 42 files, and none
            # of a corpus kept in sub-folders)
            files = expand_paths(d.text_path, "data.text_path", recursive=True)
        for path in files:
            if not os.access(path, os.R_OK):
                raise ConfigError(f"data.text_path: {str(path)!r} is not readable")
        return (f"data: {len(files)} text file(s) readable"
                + (", tokenizer loads" if d.tokenizer is not None else " (bytes)"))
    return "data: hf_dataset is opened by train (not checked here)"


def preflight(cfg: SpeedtronicConfig) -> list[str]:
    """Every check ``train`` makes before touching a device (``validate`` runs this); raises
    :class:`ConfigError` naming the key. Returns one line per check."""
    _check_model_name(cfg)
    _check_requested_device(cfg)
    check_fsdp(cfg)  # data_parallel.fsdp's combinations: the config alone decides
    lines = [_check_data_files(cfg)]  # first: it may set model.vocab_size from the tokenizer
    lines.insert(0, check_model_size(cfg, _device_type(cfg)))
    check_run_dir(cfg.run_dir)
    require_hook_packages(tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb)
    holder = held_by(cfg.run_dir)
    if holder is not None:  # train refuses this first: so does validate
        raise RunLockedError(f"run directory {cfg.run_dir} is in use by {holder}; train would "
                             "be refused until that run ends (or use another run.name / "
                             "run.output_dir)")
    lines.append(f"run directory: {cfg.run_dir} (writable)")
    return lines


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be created: no file in its path, and its nearest existing
    folder is writable (``train`` checks it first, before anything is built)."""
    blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise ConfigError(f"run directory {run_dir} (run.output_dir / run.name) cannot be "
                          f"created: {blocked} is a file; choose another run.output_dir or "
                          "run.name")
    if blocked is not None and not os.access(blocked, os.W_OK):
        what = ("is not writable" if blocked == run_dir else
                f"cannot be created: {blocked} is not writable")
        raise ConfigError(f"run directory {run_dir} {what}; fix its permissions or choose "
                          "another run.output_dir / run.name")
