"""Recognising speedtronic 2.0's checkpoints, so that pointing this version at one says what it
is instead of failing on a detail.

2.0 wrote ``<output_dir>/checkpoints/step_<12 digits>.pt`` beside a ``latest.json`` pointer,
with no digest files, as a pickle of Python objects; this version writes
``<output_dir>/<run.name>/checkpoints/step_<8 digits>.pt`` with a ``.sha256`` each and a
``latest`` pointer, loaded with ``weights_only=True``. A 2.0 run cannot be resumed: the layout,
the optimizer state and the tensor names differ, and so does what ``d_ff`` means (for 2.0's own
smoke config, ``d_ff: 128``, its MLP is 88 wide, here 128). Met with a 2.0 checkpoint,
``--resume`` started a fresh run without naming it (it looked one folder deeper), and
``model.init_from`` asked for a digest file 2.0 never wrote and then called the file "written
by something else".

The weights do carry over into a fresh run: :func:`load_v2_weights` reads a 2.0 checkpoint's
model tensors under this version's names (``model.init_from`` calls it). Checked against the
speedtronic 2.0.0 package itself (``benchmarks/check_v2_weights.py``): the converted model's
logits equal 2.0's to fp32 rounding once ``model.d_ff`` is set to 2.0's MLP width, which 2.0
derived from its ``d_ff`` (2/3 of it, rounded up to a multiple of ``n_head``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["V2_CHECKPOINT_ADVICE", "find_v2_checkpoints", "is_v2_checkpoint_file",
           "latest_v2_checkpoint", "load_v2_weights", "v2_architecture"]

_V2_NAME = re.compile(r"step_\d{12}\.pt")

V2_CHECKPOINT_ADVICE = ("this version cannot resume a speedtronic 2.0 run (its layout, names "
                        "and optimizer state differ); start a fresh run from its weights with "
                        "model.init_from: <the 2.0 checkpoint or run folder> (docs/upgrading.md)"
                        "; the 2.0 files are left as they are")
"""What a user pointed at a 2.0 checkpoint is told (after naming what was found)."""


def _is_v2_pointer(path: Path) -> bool:
    """``path`` is 2.0's ``latest.json``: ``{"step": int, "file": "step_<12 digits>.pt"}``."""
    try:
        pointer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(pointer, dict) and isinstance(pointer.get("file"), str)
            and _V2_NAME.fullmatch(pointer["file"]) is not None)


def is_v2_checkpoint_file(path: Path) -> bool:
    """``path`` is named as 2.0 named its checkpoints and has no digest of this version's."""
    return (_V2_NAME.fullmatch(path.name) is not None
            and not path.with_suffix(".sha256").exists())


def find_v2_checkpoints(*folders: Path) -> Path | None:
    """The first of ``folders`` (or its ``checkpoints/``) that holds 2.0's checkpoint layout:
    a 2.0 ``latest.json`` or ``step_<12 digits>.pt`` files."""
    for folder in folders:
        for candidate in (folder, folder / "checkpoints"):
            if not candidate.is_dir():
                continue
            if _is_v2_pointer(candidate / "latest.json"):
                return candidate
            if any(is_v2_checkpoint_file(p) for p in candidate.glob("step_*.pt")):
                return candidate
    return None


def latest_v2_checkpoint(folder: Path) -> Path | None:
    """The newest 2.0 checkpoint under ``folder`` (or its ``checkpoints/``): the one its
    ``latest.json`` names, else the highest step."""
    found = find_v2_checkpoints(folder)
    if found is None:
        return None
    pointer = found / "latest.json"
    if _is_v2_pointer(pointer):
        named = found / json.loads(pointer.read_text(encoding="utf-8"))["file"]
        if named.is_file():
            return named
    files = sorted(p for p in found.glob("step_*.pt") if is_v2_checkpoint_file(p))
    return files[-1] if files else None


#: 2.0's module paths -> this version's, applied in order to every tensor name.
_V2_RENAMES = (("transformer.wte.", "embed."), ("transformer.ln_f.", "final_norm."),
               ("transformer.h.", "blocks."), (".ln1.", ".attn_norm."),
               (".ln2.", ".mlp_norm."), (".attn.out_proj.", ".attn.o_proj."))

#: The only globals a 2.0 checkpoint needs beyond weights_only's: numpy arrays (its RNG state).
_NUMPY_GLOBALS = {"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                  "numpy._core.multiarray._reconstruct"}


def v2_architecture(model: dict[str, Any]) -> dict[str, Any]:
    """2.0's ``model`` section as this version's keys: ``d_ff`` becomes the SwiGLU width 2.0
    built from it (``int(2/3 d_ff)`` rounded up to a multiple of ``n_head``; ``d_ff: null`` was
    ``4 d_model``), which is what this version's ``d_ff`` means."""
    out = {k: model[k] for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model",
                                 "tie_weights", "rope_base") if k in model}
    out["name"] = "reference_transformer"
    if "d_model" in model and "n_head" in model:
        d_ff = model.get("d_ff") or 4 * model["d_model"]
        out["d_ff"] = math.ceil(int(d_ff * (2 / 3)) / model["n_head"]) * model["n_head"]
    return out


def load_v2_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(model tensors under this version's names, 2.0's architecture as this version's
    model keys)`` of a 2.0 checkpoint, read with ``weights_only=True``: numpy arrays are the one
    addition allowed (2.0 saved numpy's RNG state); any other object refuses the file."""
    import numpy as np

    from ..config import ConfigError

    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    if unsafe - _NUMPY_GLOBALS:
        raise ConfigError(f"model.init_from: {path} holds objects beyond tensors and numpy "
                          f"arrays ({', '.join(sorted(unsafe - _NUMPY_GLOBALS))}), refused "
                          "unopened: not a speedtronic 2.0 checkpoint")
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    # numpy >= 1.25 pickles an array's dtype as its class (numpy.dtypes.UInt32DType, ...);
    # numpy 1.x named the array builder numpy.core.multiarray._reconstruct
    dtype_classes = [getattr(np.dtypes, n) for n in dir(getattr(np, "dtypes", None))
                     if n.endswith("DType")]
    allowed = [np.ndarray, np.dtype, reconstruct, *dtype_classes,
               (reconstruct, "numpy.core.multiarray._reconstruct"),
               (reconstruct, "numpy._core.multiarray._reconstruct")]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - an unpickling refusal, a torn file: one line
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "global" in ln or "Can only build" in ln),
                   lines[0] if lines else type(exc).__name__)
        raise ConfigError(f"model.init_from: {path} cannot be read as a speedtronic 2.0 "
                          f"checkpoint: {why[:300]}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ConfigError(f"model.init_from: {path} has no model weights (not a speedtronic "
                          "2.0 checkpoint)")
    tensors = {}
    for name, tensor in state["model"].items():
        for old, new in _V2_RENAMES:
            name = name.replace(old, new)
        tensors[name] = tensor
    saved = ((state.get("config") or {}).get("model") or {}) if isinstance(state.get("config"),
                                                                           dict) else {}
    return tensors, v2_architecture(saved)
